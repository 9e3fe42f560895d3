"""Crash safety and resume: interrupted runs leave nothing that looks like a result, and the
same command finishes the job, keeping the files an earlier run finished."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from mxfp8_convert import convert as _convert
from mxfp8_convert.errors import OutputError
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from mxfp8_convert.verify import verify
from tests.checkpoints import Stop, interrupt_after, tree_hashes

SMALL = SynthSpec(layers=3, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=3)
# big enough that a conversion spends a while writing: 6 shards, ~40 MB
BIG = SynthSpec(layers=6, hidden=768, intermediate=2048, heads=8, kv_heads=4, vocab=1024, shards=6)
#: output shards of at most 0.6 MB for SMALL (2.1 MB: 4 shards), 7 MB for BIG (6 shards)
SMALL_SHARD, BIG_SHARD = 600_000, "7MB"


def convert(*args, **kwargs):
    return _convert(*args, max_shard_size=SMALL_SHARD, **kwargs)


def partial(out):
    return out.parent / f".{out.name}.mxfp8-partial"


def test_interrupted_run_resumes_keeping_finished_shards(tmp_path):
    src = write_checkpoint(tmp_path / "src", SMALL)
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(src, "trtllm", out, progress=interrupt_after(1))
    assert not out.exists()
    manifest = json.loads((partial(out) / "mxfp8_convert.partial.json").read_text())
    finished = sorted(manifest["files"])
    assert finished == ["model-00001-of-00004.safetensors"]
    before = os.stat(partial(out) / finished[0])
    r = convert(src, "trtllm", out)
    after = os.stat(out / finished[0])
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns), \
        "finished shard was redone"
    assert verify(out, src).ok and not partial(out).exists()
    assert r.bytes_written > 0 and "mxfp8_convert.partial.json" not in os.listdir(out)


def test_corrupt_finished_shard_is_redone(tmp_path):
    src = write_checkpoint(tmp_path / "src", SMALL)
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(src, "cutlass", out, progress=interrupt_after(2))
    shard = partial(out) / "model-00001-of-00004.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    convert(src, "cutlass", out)
    assert verify(out, src).ok


def test_other_parameters_refuse_to_resume_and_fresh_starts_over(tmp_path):
    src = write_checkpoint(tmp_path / "src", SMALL)
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(src, "trtllm", out, progress=interrupt_after(1))
    other = r"an interrupted conversion with other parameters \(backend\) is here"
    with pytest.raises(OutputError, match=other):
        convert(src, "cutlass", out)
    assert partial(out).exists() and not out.exists()
    convert(src, "cutlass", out, fresh=True)
    assert verify(out, src).ok
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["backend"] == "cutlass"


def test_bad_input_leaves_no_partial_folder(tmp_path):
    src = write_checkpoint(tmp_path / "src", replace(SMALL, intermediate=288))
    with pytest.raises(OutputError.__mro__[1]):  # ConvertError
        convert(src, "trtllm", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_second_concurrent_run_is_refused(tmp_path):
    from mxfp8_convert.write import Staging

    src = write_checkpoint(tmp_path / "src", SMALL)
    out = tmp_path / "out"
    holder = Staging(out, {"x": 1})
    try:
        with pytest.raises(OutputError, match="another mxfp8-convert is writing this destination"):
            convert(src, "trtllm", out)
    finally:
        holder.suspend()


def _cli(src, out, *extra):
    return [sys.executable, "-m", "mxfp8_convert", str(src), "--backend", "trtllm", "-o", str(out),
            "--quiet", "--max-shard-size", BIG_SHARD, *extra]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_sigint_sigterm_exit_cleanly_and_resumable(tmp_path, sig, code):
    src = write_checkpoint(tmp_path / "src", BIG)
    out = tmp_path / "out"
    proc = subprocess.Popen(_cli(src, out), stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not partial(out).exists() and time.time() < deadline:  # wait until it writes
        time.sleep(0.01)
    time.sleep(0.05)
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    if proc.returncode == 0:
        pytest.skip("conversion finished before the signal landed")
    assert proc.returncode == code, err
    assert err.strip().splitlines()[0] in ("Error: interrupted", "Error: terminated")
    assert "Traceback" not in err and not out.exists() and partial(out).exists()
    assert subprocess.run(_cli(src, out), capture_output=True).returncode == 0
    assert verify(out, src).ok


def _wait_for_finished_shards(out, k: int, proc, timeout: float = 120.0) -> None:
    """Return once the run's manifest lists ``k`` finished shards (or the run has ended)."""
    manifest = partial(out) / "mxfp8_convert.partial.json"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(json.loads(manifest.read_text())["files"]) >= k:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.002)


def test_sigkill_at_random_moments(tmp_path):
    """20 trials: SIGKILL at a random moment; the destination is absent or complete and
    verified; rerunning finishes and verifies; the source never changes."""
    src = write_checkpoint(tmp_path / "src", BIG)
    before = tree_hashes(src)
    rng = random.Random(1234)
    outcomes = {"before writing": 0, "while writing": 0, "after completion": 0}
    for trial in range(20):
        out = tmp_path / f"out{trial}"
        proc = subprocess.Popen(_cli(src, out), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if trial % 4 == 0:  # a moment anywhere in the run: start-up, writing, or done
            time.sleep(rng.uniform(0.1, 6.0))
        else:  # a moment while writing: once k shards are finished, plus a random fraction of one
            _wait_for_finished_shards(out, rng.randint(0, BIG.shards - 1), proc)
            time.sleep(rng.uniform(0.0, 0.05))
        proc.kill()
        proc.wait()
        if out.exists():
            outcomes["after completion"] += 1
            assert verify(out, src, check_hashes=True).ok, \
                f"trial {trial}: a visible output must be complete"
        else:
            outcomes["while writing" if partial(out).exists() else "before writing"] += 1
        rerun = subprocess.run(_cli(src, out), capture_output=True, text=True)
        if out.exists() and rerun.returncode == 1:
            assert "already exists" in rerun.stderr
        else:
            assert rerun.returncode == 0, rerun.stderr
        assert verify(out, src).ok, f"trial {trial}"
        assert not partial(out).exists()
        assert tree_hashes(src) == before, "the source must never change"
    print(f"SIGKILL trials: {outcomes}")
    assert outcomes["while writing"] >= 10, \
        f"too few kills landed mid-write to mean much: {outcomes}"
