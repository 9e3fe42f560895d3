"""``inspection.inspect_checkpoint``: the quantized pairs are searched for once and the FP8
scales read once per report, though the report lists the modules and plans every backend (the
documents themselves are compared with an older tree's in ``test_plan_json_unchanged.py``), and
nothing of that search outlives its checkpoint."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest

from mxfp8_convert import inspection
from mxfp8_convert.backends import BACKENDS, KERNEL_BACKENDS
from mxfp8_convert.formats import detect_source
from mxfp8_convert.inspection import inspect_checkpoint
from mxfp8_convert.plan import build_plan, classify
from mxfp8_convert.read import open_checkpoint
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from tests.checkpoints import Referable

SPEC = SynthSpec(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                 shards=2, experts=4, moe_intermediate=256)


def _counting(monkeypatch, module, name: str) -> list:
    """One entry per call of ``module.name`` (not its arguments: they would stay alive)."""
    calls: list = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
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


def test_a_report_keeps_no_checkpoint_alive(tmp_path, monkeypatch):
    """A long-lived process (a pipeline converting many models) holds nothing of a report's
    checkpoint once the report is made: not the checkpoint, nor its pairs."""
    src = write_checkpoint(tmp_path / "src", replace(SPEC, dialect="block_fp8"))
    opened = []
    real = inspection.open_checkpoint

    def referable(*args, **kwargs):
        ckpt = Referable.of(real(*args, **kwargs))
        opened.append(weakref.ref(ckpt))
        return ckpt

    monkeypatch.setattr(inspection, "open_checkpoint", referable)
    report = inspect_checkpoint(src)
    gc.collect()
    assert len(opened) == 1 and opened[0]() is None
    assert len(report.modules) == 2 * 4 * 3 + 2 * 4  # the report itself is whole


def test_plans_of_one_checkpoint_share_a_search_that_goes_with_it(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src", replace(SPEC, dialect="block_fp8"))
    searches = _counting(monkeypatch, classify, "_pairs")
    ckpt = Referable.of(open_checkpoint(src))
    fmt = detect_source(ckpt.config, ckpt.quant_files, ckpt.tensors)
    plans = [build_plan(ckpt, BACKENDS[b], fmt, on_ineligible="keep") for b in BACKENDS]
    assert len(searches) == 1 and all(p.modules for p in plans)
    held = weakref.ref(ckpt)
    del ckpt
    gc.collect()
    assert held() is None  # the plans, still held, do not keep it either
    other = open_checkpoint(src)
    build_plan(other, BACKENDS["canonical"], fmt, on_ineligible="keep")
    assert len(searches) == 2  # another checkpoint object: searched again
