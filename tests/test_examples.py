"""examples/: the library example runs, and the GitHub Actions workflow says what it should."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mxfp8_convert.synth import SynthSpec, write_checkpoint

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORKFLOW = EXAMPLES / "github-actions-convert.yml"
TINY = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256)


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / "convert_with_library.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_convert_with_library_dry_run(tmp_path):
    src = write_checkpoint(tmp_path / "model", TINY)
    p = run_example(str(src), "--backend", "trtllm", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == ["[reading]", "[planning]"]
    lines = p.stdout.splitlines()
    assert lines[0] == f"source:   {src} (sglang_mxfp8)"
    assert "backend:  trtllm" in lines and "modules:  7 relayout" in lines
    assert lines[-1] == f"dry run: nothing written; output would be {tmp_path / 'model-trtllm'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_convert_with_library_writes_and_reports_progress(tmp_path):
    src = write_checkpoint(tmp_path / "model", TINY)
    p = run_example(str(src), "--backend", "cutlass", "-o", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    assert "[transforming]" in p.stderr
    assert "model.layers.0.mlp.up_proj.weight_scale_swizzled" in p.stderr
    assert p.stderr.splitlines()[-1] == "[done]"
    assert (tmp_path / "out" / "mxfp8_convert.complete.json").is_file()


def test_convert_with_library_error_is_one_line(tmp_path):
    p = run_example(str(tmp_path / "missing"), "--backend", "trtllm")
    assert p.returncode == 1
    assert p.stderr.splitlines()[-2:] == [
        f"Error: {tmp_path / 'missing'}: no such folder",
        "Hint: pass a model folder or a Hub repo id (org/name)",
    ]


def workflow_commands() -> str:
    """Every ``run:`` script of the workflow, parsed with PyYAML when it is installed."""
    try:
        import yaml
    except ImportError:  # PyYAML comes with huggingface_hub, but do not depend on it here
        return WORKFLOW.read_text()
    doc = yaml.safe_load(WORKFLOW.read_text())
    triggers = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert set(triggers["workflow_dispatch"]["inputs"]) == {"model", "backend", "target", "private"}
    job = doc["jobs"]["convert"]
    assert job["env"]["HF_TOKEN"] == "${{ secrets.HF_TOKEN }}"
    steps = job["steps"]
    assert all("uses" in s or "run" in s for s in steps)
    return "\n".join(s.get("run", "") for s in steps)


def test_workflow_installs_converts_verifies_and_uploads():
    text = workflow_commands()
    order = [
        "--index-url https://download.pytorch.org/whl/cpu",
        'mxfp8-convert "$MODEL" --backend "$BACKEND" -o "$OUT" --json',
        'mxfp8-convert verify "$OUT"',
        "from mxfp8_convert.publish import push_to_hub",
    ]
    assert [s for s in order if s not in text] == []
    at = [text.find(s) for s in order]
    assert at == sorted(at), "install, convert, verify and upload run in this order"
    assert "${{ inputs." not in text  # inputs go through env, never spliced into shell text


def test_workflow_structure_without_yaml(monkeypatch):
    """The fallback path: a plain text check when PyYAML is absent."""
    monkeypatch.setitem(sys.modules, "yaml", None)
    text = workflow_commands()
    assert "HF_TOKEN: ${{ secrets.HF_TOKEN }}" in text
    assert 'mxfp8-convert verify "$OUT"' in text



def test_convert_and_run_example(tmp_path):
    src = write_checkpoint(tmp_path / "model", TINY)
    p = subprocess.run([sys.executable, str(EXAMPLES / "convert_and_run.py"), str(src),
                        "--backend", "trtllm", "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    # TINY: hidden 256, intermediate 512
    assert "down_proj: x [4, 512] -> y [4, 256] torch.bfloat16" in last
    # on CPU the reference engine reads the laid-out bytes; the example's yardstick, the canonical
    # bytes: the same numbers, so no difference at all
    assert last.endswith("relative difference to the reference 0.00e+00"), last


def test_slurm_array_script_dry_run_and_parts(tmp_path):
    import json
    import os
    import shutil

    bindir = str(Path(sys.executable).parent)  # the venv's console scripts, activated or not
    path = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    assert shutil.which("mxfp8-convert", path=path), (
        "the console script must be installed (pip install -e .)")
    src = write_checkpoint(tmp_path / "model", TINY)
    script = str(EXAMPLES / "slurm-convert-array.sh")
    out = tmp_path / "out"
    env = {**os.environ, "PATH": path, "DRY_RUN": "1"}
    p = subprocess.run(["bash", script, str(src), str(out)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["dry_run"] is True and not out.exists()
    for task in range(2):  # what SLURM would run, one task per array index
        env = {**os.environ, "PATH": path, "SLURM_ARRAY_TASK_COUNT": "2",
               "SLURM_ARRAY_TASK_ID": str(task)}
        p = subprocess.run(["bash", script, str(src), str(out)], capture_output=True, text=True,
                           env=env, timeout=300)
        assert p.returncode == 0, p.stderr
    finalize = subprocess.run([shutil.which("mxfp8-convert", path=path), "finalize", str(out)],
                              capture_output=True, timeout=300)
    assert finalize.returncode == 0, finalize.stderr
    assert (out / "mxfp8_convert.complete.json").exists()
