"""``_gc.paused_gc``: the cycle collector is off inside, back as it was after, and the planning
entry points pause it while they build (and only while)."""

from __future__ import annotations

import gc

import pytest

from mxfp8_convert import read
from mxfp8_convert._gc import paused_gc
from mxfp8_convert.backends import get_backend
from mxfp8_convert.formats import detect
from mxfp8_convert.plan import build
from mxfp8_convert.synth import SynthSpec, write_checkpoint


def test_paused_inside_restored_after_even_on_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves it to the outer one
        raise RuntimeError
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_opening_and_planning_pause_the_collector(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "m", SynthSpec(layers=1, hidden=256, intermediate=512))
    seen = []
    header, pack = read.read_header, build.pack

    def read_header(*a, **k):
        seen.append(("header", gc.isenabled()))
        return header(*a, **k)

    def packed(*a, **k):
        seen.append(("pack", gc.isenabled()))
        return pack(*a, **k)

    monkeypatch.setattr(read, "read_header", read_header)
    monkeypatch.setattr(build, "pack", packed)
    ckpt = read.open_checkpoint(src)
    assert gc.isenabled()
    build.build_plan(ckpt, get_backend("trtllm"), detect(ckpt.config, None, ckpt.tensors))
    assert gc.isenabled()
    assert seen and set(seen) == {("header", False), ("pack", False)}


def test_plan_conversion_is_one_pause_from_opening_to_the_plan(tmp_path, monkeypatch):
    """Between opening the checkpoint and planning it (format detection) the collector stays
    paused too, so that the objects of both are walked once afterwards, not once per step."""
    from mxfp8_convert import run

    src = write_checkpoint(tmp_path / "m", SynthSpec(layers=1, hidden=256, intermediate=512))
    seen = []
    detect_source = run.detect_source

    def detected(*a, **k):
        seen.append(gc.isenabled())
        return detect_source(*a, **k)

    monkeypatch.setattr(run, "detect_source", detected)
    _, plan = run.plan_conversion(src, "trtllm")
    assert seen == [False] and gc.isenabled() and plan.modules
