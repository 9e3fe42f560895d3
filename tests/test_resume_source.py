"""A resume keeps a finished shard only if the source bytes behind it are those it was made from.

The source is changed the way the header fingerprint cannot see: one tensor byte rewritten in
place (same header, same size, same mtime), or a Hub snapshot at a new revision whose shard has
the same header and other bytes. The resumed output must then equal a fresh conversion of the
changed source, file for file (the real filesystem is the judge, not the converter's records).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from mxfp8_convert import convert as _convert
from mxfp8_convert.convert import plan_conversion
from mxfp8_convert.run import SourceProof
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from tests.checkpoints import tree_hashes

SPEC = SynthSpec(layers=3, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=3)
#: output shards of about 0.6 MB: 4 of them (the source's 3 shards are 0.6-0.7 MB each)
SHARD = 600_000
FIRST = "model-00001-of-00004.safetensors"  # the first output shard


def convert(*args, **kwargs):
    return _convert(*args, max_shard_size=SHARD, **kwargs)


class Stop(KeyboardInterrupt):
    pass


def _interrupt_after_first_shard(e) -> None:
    if e.shard is not None and e.shard != FIRST:
        raise Stop()


def _partial(out: Path) -> Path:
    return out.parent / f".{out.name}.mxfp8-partial"


def _tensor_span(path: Path, name: str) -> tuple[int, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _rewrite_byte_keeping_mtime(path: Path, at: int) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([0x01 if b != 0x01 else 0x02]))  # never an e4m3 NaN (0x7F / 0xFF)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def _first_shard_tensor(src: Path, suffix: str, backend: str = "trtllm") -> tuple[Path, str]:
    """A source tensor (its file and name) whose bytes go into the first output shard."""
    ckpt, plan = plan_conversion(src, backend, max_shard_size=SHARD)
    assert plan.shards[0].name == FIRST
    name = sorted(t.source for t in plan.shards[0].tensors if t.source.endswith(suffix))[0]
    return src / ckpt.tensors[name].file, name


@pytest.mark.parametrize(("dialect", "backend", "suffix"), [
    ("sglang_mxfp8", "trtllm", "mlp.down_proj.weight"),  # streamed relayout
    ("sglang_mxfp8", "cutlass", "norm.weight"),  # passthrough copy
    ("block_fp8", "trtllm", "mlp.up_proj.weight"),  # computed module
    ("dense", "cutlass", "mlp.gate_proj.weight"),  # quantized
])
def test_resume_redoes_a_shard_whose_source_bytes_changed(tmp_path, dialect, backend, suffix):
    src = write_checkpoint(tmp_path / "src", replace(SPEC, dialect=dialect))
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(src, backend, out, progress=_interrupt_after_first_shard)
    assert FIRST in json.loads((_partial(out) / "mxfp8_convert.partial.json").read_text())["files"]
    path, name = _first_shard_tensor(src, suffix, backend)
    begin, end = _tensor_span(path, name)
    _rewrite_byte_keeping_mtime(path, (begin + end) // 2)
    convert(src, backend, out)  # resumes: same header fingerprint, same parameters
    convert(src, backend, tmp_path / "fresh")
    assert tree_hashes(out) == tree_hashes(tmp_path / "fresh")


def test_unchanged_source_keeps_the_finished_shard(tmp_path):
    src = write_checkpoint(tmp_path / "src", SPEC)
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(src, "trtllm", out, progress=_interrupt_after_first_shard)
    before = os.stat(_partial(out) / FIRST)
    convert(src, "trtllm", out)
    after = os.stat(out / FIRST)
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def _hub_snapshot(cache: Path, src: Path, rev: str) -> Path:
    """``src`` laid out as huggingface_hub caches it: ``snapshots/<rev>/<f>`` ->
    ``blobs/<sha256>``."""
    blobs, snap = cache / "blobs", cache / "snapshots" / rev
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        (snap / f.name).symlink_to(Path("../../blobs") / sha)
    return snap


def test_hub_snapshot_uses_blob_names_and_a_new_revision_redoes_the_shard(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src", SPEC)
    cache = tmp_path / "hub" / "models--org--m"
    old = _hub_snapshot(cache, src, "a" * 40)
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(old, "trtllm", out, progress=_interrupt_after_first_shard)
    rec = json.loads((_partial(out) / "mxfp8_convert.partial.json").read_text())["files"][FIRST]
    blobs = rec["source"]["hub_blobs"]
    assert _first_shard_tensor(src, "")[0].name in blobs
    assert blobs == {f: os.readlink(old / f).rsplit("/", 1)[1] for f in blobs}
    # same revision: the blob names prove the bytes, nothing is hashed again
    hashed = []
    real = SourceProof.hash_sources
    monkeypatch.setattr(SourceProof, "hash_sources",
                        lambda self, s: hashed.append(s.name) or real(self, s))
    with pytest.raises(Stop):
        convert(old, "trtllm", out, progress=_interrupt_after_first_shard)
    assert hashed == []
    # a new revision: same headers, other bytes in the first shard
    path, name = _first_shard_tensor(src, "mlp.down_proj.weight")
    begin, end = _tensor_span(path, name)
    _rewrite_byte_keeping_mtime(path, (begin + end) // 2)
    new = _hub_snapshot(cache, src, "b" * 40)
    convert(new, "trtllm", out)
    convert(new, "trtllm", tmp_path / "fresh")
    assert hashed == [FIRST]
    assert tree_hashes(out) == tree_hashes(tmp_path / "fresh")


def test_finalize_refuses_a_part_whose_source_bytes_changed_and_the_rerun_part_redoes_it(tmp_path):
    from mxfp8_convert.convert import finalize
    from mxfp8_convert.errors import OutputError

    src = write_checkpoint(tmp_path / "src", SPEC)
    out = tmp_path / "out"
    for i in range(3):
        convert(src, "cutlass", out, part=(i, 3))
    path, name = _first_shard_tensor(src, "mlp.down_proj.weight", "cutlass")
    begin, end = _tensor_span(path, name)
    _rewrite_byte_keeping_mtime(path, (begin + end) // 2)
    with pytest.raises(OutputError,
                       match=rf"shard {FIRST} \(part 0 of 3\) are not those it was converted from"):
        finalize(out)
    assert not out.exists()
    convert(src, "cutlass", out, part=(0, 3))
    finalize(out)
    convert(src, "cutlass", tmp_path / "fresh")
    assert tree_hashes(out) == tree_hashes(tmp_path / "fresh")
