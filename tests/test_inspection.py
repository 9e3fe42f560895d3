"""``inspection.inspect_checkpoint``: the quantized pairs are searched for once and the FP8
scales read once per report, though the report lists the modules and plans every backend (the
documents themselves are compared with an older tree's in ``test_plan_json_unchanged.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mxfp8_convert.backends import BACKENDS, KERNEL_BACKENDS
from mxfp8_convert.inspection import inspect_checkpoint
from mxfp8_convert.plan import classify
from mxfp8_convert.synth import SynthSpec, write_checkpoint

SPEC = SynthSpec(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                 shards=2, experts=4, moe_intermediate=256)


def _counting(monkeypatch, module, name: str) -> list:
    calls: list = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("dialect", ["sglang_mxfp8", "block_fp8"])
def test_one_search_and_one_read_of_the_scales_per_report(tmp_path, monkeypatch, dialect):
    src = write_checkpoint(tmp_path / "src", replace(SPEC, dialect=dialect))
    searches = _counting(monkeypatch, classify, "_pairs")
    reads = _counting(monkeypatch, classify, "pow2_scales")
    report = inspect_checkpoint(src)
    assert len(searches) == 1
    assert len(reads) == (dialect == "block_fp8")
    # it did plan every backend, and list every quantized module: 2 layers x 4 experts x 3,
    # 2 x 4 attention projections (the MoE layers have no dense MLP here)
    assert set(report.actions) == {*KERNEL_BACKENDS, "canonical"} and len(BACKENDS) == 3
    assert len(report.modules) == 2 * 4 * 3 + 2 * 4
    inspect_checkpoint(src)  # another report: another checkpoint object, searched again
    assert len(searches) == 2
