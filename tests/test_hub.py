"""Hub repo ids, for real, against an offline Hugging Face cache laid out as huggingface_hub does.

The cache is ``$HF_HOME/hub/models--org--name/{refs/main, snapshots/<commit>/<file> ->
../../blobs/<sha256>, blobs/<sha256>}``. The CLI runs in a subprocess with HF_HOME and
HF_HUB_OFFLINE=1, so huggingface_hub reads its settings exactly as a user's would.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxfp8_convert.synth import SynthSpec, write_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SPEC = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256)


def make_hub_cache(hf_home: Path, repo_id: str, src: Path) -> Path:
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    blobs = repo / "blobs"
    blobs.mkdir()
    for f in sorted(src.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blobs / sha, link.parent))
    return snap


def run_cli(args, hf_home: Path, cwd: Path):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "mxfp8_convert", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture()
def hub(tmp_path):
    src = write_checkpoint(tmp_path / "made", SPEC)
    (src / "pytorch_model.bin").write_bytes(b"never downloaded, never unpickled")
    hf_home = tmp_path / "hf"
    snap = make_hub_cache(hf_home, "org/tiny-mxfp8", src)
    work = tmp_path / "work"
    work.mkdir()
    return hf_home, snap, work


def test_convert_repo_id_from_offline_cache(hub):
    hf_home, snap, work = hub
    r = run_cli(["org/tiny-mxfp8", "--backend", "trtllm", "--json"], hf_home, work)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["source"] == str(snap) and doc["output"] == str(work / "tiny-mxfp8-trtllm")
    out = work / "tiny-mxfp8-trtllm"
    assert (out / "mxfp8_convert.complete.json").exists()
    assert not (out / "pytorch_model.bin").exists()
    assert (out / "tokenizer.json").read_bytes() == (snap / "tokenizer.json").read_bytes()
    assert not (out / "tokenizer.json").is_symlink()
    v = run_cli(["verify", str(out), "--source", "org/tiny-mxfp8"], hf_home, work)
    assert v.returncode == 0, v.stderr


def test_inspect_and_revision(hub):
    hf_home, _, work = hub
    r = run_cli(["inspect", "org/tiny-mxfp8", "--revision", COMMIT, "--json"], hf_home, work)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "sglang_mxfp8"


def test_repo_not_in_offline_cache_is_one_line(hub):
    hf_home, _, work = hub
    r = run_cli(["org/absent", "--backend", "cutlass"], hf_home, work)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "Error: org/absent: not in the local Hub cache and the Hub cannot be reached "
        "(HF_HUB_OFFLINE is set)"]
    assert list(work.iterdir()) == []


def test_only_needed_files_are_asked_for(monkeypatch, tmp_path):
    """snapshot_download is called with patterns that exclude pickles and other weight formats."""
    import huggingface_hub

    from mxfp8_convert import read

    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(write_checkpoint(tmp_path / "snap", SPEC))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    path = read.resolve_model("org/name", revision="v1")
    assert path == tmp_path / "snap"
    (repo_id, kw), = calls
    assert repo_id == "org/name" and kw["revision"] == "v1"
    assert "*.safetensors" in kw["allow_patterns"] and "*.json" in kw["allow_patterns"]
    for pattern in ("*.bin", "*.pt", "*.pth"):
        assert pattern in kw["ignore_patterns"]
