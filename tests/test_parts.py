"""Split conversions (job arrays: --num-parts/--part + finalize) and --workers."""

from __future__ import annotations

import json

import pytest
import torch

from mxfp8_convert import convert as _convert
from mxfp8_convert.cli import main as _main
from mxfp8_convert.convert import finalize
from mxfp8_convert.errors import ConvertError, OutputError
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from mxfp8_convert.verify import verify
from tests.checkpoints import load_all

SPEC = SynthSpec(layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=4)
#: output shards of at most 0.8 MB: 4 of them (2.7 MB in all), as the source has
SHARD = 800_000


def convert(*args, **kwargs):
    return _convert(*args, max_shard_size=SHARD, **kwargs)


def main(argv: list[str]) -> int:
    return _main([*argv, "--max-shard-size", str(SHARD)] if argv[0] != "finalize" else argv)


@pytest.fixture()
def src(tmp_path):
    return write_checkpoint(tmp_path / "src", SPEC)


def _same_tensors(a, b):
    ta, _ = load_all(a)
    tb, _ = load_all(b)
    return ta.keys() == tb.keys() and all(
        torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)) for k in ta)


def test_parts_then_finalize_equals_one_run(src, tmp_path):
    out = tmp_path / "out"
    results = [convert(src, "trtllm", out, part=(i, 3)) for i in (2, 0, 1)]  # any order
    assert all(r.output is None for r in results) and not out.exists()
    assert sorted(n for r in results for n in [r.part]) == [(0, 3), (1, 3), (2, 3)]
    r = finalize(out)
    assert r.output == str(out) and verify(out, src).ok
    convert(src, "trtllm", tmp_path / "one")
    assert _same_tensors(out, tmp_path / "one")
    assert json.loads((out / "model.safetensors.index.json").read_text()) == json.loads(
        (tmp_path / "one" / "model.safetensors.index.json").read_text())


def test_finalize_refuses_missing_part_and_rerun_is_safe(src, tmp_path):
    out = tmp_path / "out"
    convert(src, "cutlass", out, part=(0, 2))
    with pytest.raises(OutputError, match=r"part\(s\) 1 of 2 have not run"):
        finalize(out)
    convert(src, "cutlass", out, part=(0, 2))  # rerunning a finished part keeps its shards
    convert(src, "cutlass", out, part=(1, 2))
    finalize(out)
    assert verify(out, src).ok
    with pytest.raises(OutputError, match="already exists"):
        finalize(out)


def test_parts_with_other_parameters_do_not_mix(src, tmp_path):
    out = tmp_path / "out"
    convert(src, "trtllm", out, part=(0, 2))
    convert(src, "cutlass", out, part=(1, 2))
    with pytest.raises(OutputError, match="parts were made with different parameters"):
        finalize(out)


def test_part_resumes_its_own_work_only(src, tmp_path):
    out = tmp_path / "out"
    convert(src, "trtllm", out, part=(0, 2))
    work = tmp_path / ".out.mxfp8-partial"
    before = {p.name: p.stat().st_mtime_ns for p in work.glob("*.safetensors")}
    convert(src, "trtllm", out, part=(1, 2))
    after = {p.name: p.stat().st_mtime_ns for p in work.glob("*.safetensors")}
    assert all(after[n] == t for n, t in before.items()), "part 1 must not touch part 0's shards"
    assert len(after) == 4


def test_bad_part_numbers(src, tmp_path, capsys):
    with pytest.raises(ConvertError, match="--part 2 is not in 0..1"):
        convert(src, "trtllm", tmp_path / "o", part=(2, 2))
    assert main([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--part", "0"]) == 2
    o = str(tmp_path / "o")
    assert main([str(src), "-b", "trtllm", "-o", o, "--num-parts", "2", "--part", "5"]) == 2
    assert "--part 5 is not in 0..1" in capsys.readouterr().err


def test_cli_parts_and_finalize(src, tmp_path, capsys):
    out = tmp_path / "out"
    for i in range(2):
        args = ["-b", "trtllm", "-o", str(out), "--num-parts", "2", "--part", str(i), "--json"]
        assert main([str(src), *args]) == 0
        assert json.loads(capsys.readouterr().out)["part"] == [i, 2]
    assert main(["finalize", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == str(out)
    assert verify(out, src).ok


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_give_the_same_output(src, tmp_path, workers):
    convert(src, "trtllm", tmp_path / "w1")
    convert(src, "trtllm", tmp_path / "wn", workers=workers)
    assert _same_tensors(tmp_path / "w1", tmp_path / "wn") and verify(tmp_path / "wn", src).ok


def test_max_memory_limits_workers(src, tmp_path):
    from mxfp8_convert.backends import BACKENDS
    from mxfp8_convert.convert import WORKER_BASE_BYTES, _workers
    from mxfp8_convert.formats import detect
    from mxfp8_convert.plan import build_plan
    from mxfp8_convert.read import open_checkpoint

    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, BACKENDS["trtllm"], detect(ckpt.config, None, set(ckpt.tensors)),
                      max_shard_size=SHARD)
    assert _workers(plan, 8, None) == 4  # no more workers than shards
    assert _workers(plan, 8, 2 * WORKER_BASE_BYTES) == 2
    with pytest.raises(ConvertError, match="--max-memory .* is below what one worker needs"):
        _workers(plan, 2, WORKER_BASE_BYTES // 2)


def test_cli_max_memory(src, tmp_path, capsys):
    assert main([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--max-memory", "lots"]) == 2
    assert "'lots' is not a size like 8GiB" in capsys.readouterr().err
    assert main([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--max-memory", "1MiB"]) == 1
    assert "--max-memory 1048576 bytes is below what one worker needs" in capsys.readouterr().err
    args = ["-b", "trtllm", "-o", str(tmp_path / "o"), "--workers", "2", "--max-memory", "2GiB"]
    assert main([str(src), *args]) == 0
