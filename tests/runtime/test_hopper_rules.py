"""The Hopper selection rules on CPU: every config they choose equals the one the rules of commit
a5719ef chose (``data/hopper_configs.json``, written from that commit's code by
``data/snapshot_configs.py``), for the 19 model shapes and ten edge shapes at M = 1..16, 256
and 2048 on nine simulated devices; and the device probing behind the facts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxfp8_convert.runtime.hopper.config import Kernel
from mxfp8_convert.runtime.hopper.rules import TUNED, DeviceFacts, choose_config
from mxfp8_convert.runtime.hopper.shapes import MODEL_SHAPES

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "hopper_configs.json").read_text())
# the simulated devices of the snapshot (data/snapshot_configs.py's DEVICES) as facts
FACTS = {
    "h200": DeviceFacts(132, (9, 0), gluon=True, pdl=True),
    "h200-pdl-strict": DeviceFacts(132, (9, 0), gluon=True, pdl=True, weight_prefetch=False),
    "h200-pdl-off": DeviceFacts(132, (9, 0), gluon=True, pdl=False),
    "h200-clusters-refused": DeviceFacts(132, (9, 0), gluon=True, pdl=True, clusters=False),
    "h200-no-gluon": DeviceFacts(132, (9, 0), gluon=False, pdl=True),
    "hopper-114": DeviceFacts(114, (9, 0), gluon=True, pdl=True),
    "sm89-128": DeviceFacts(128, (8, 9)),
    "sm80-108": DeviceFacts(108, (8, 0)),
    "cpu": DeviceFacts(4, None),
}
OLD_KINDS = ("decode", "gemv", "cublas", "wgmma")  # a5719ef's exclusive booleans; none: tile


def _expected(row: list) -> tuple[tuple, dict]:
    """(shape, M, N, K) and the a5719ef config in this package's fields."""
    rec = dict(zip(SNAPSHOT["fields"], row, strict=True))
    key = tuple(rec.pop(f) for f in ("shape", "m", "n", "k"))
    kinds = [kind for kind in OLD_KINDS if rec.pop(kind)]
    assert len(kinds) <= 1 and rec.pop("w_in_regs") is True, rec
    rec["kind"] = kinds[0] if kinds else "tile"
    return key, rec


def test_snapshot_covers_the_model_shapes():
    assert set(SNAPSHOT["devices"]) == set(FACTS)
    for rows in SNAPSHOT["devices"].values():
        keys = [_expected(r)[0] for r in rows]
        shapes = {(s, n, k) for s, _, n, k in keys}
        assert shapes >= set(MODEL_SHAPES)
        assert sorted({m for _, m, _, _ in keys}) == [*range(1, 17), 256, 2048]
        assert len(keys) == len(set(keys)) == len(shapes) * 18


@pytest.mark.parametrize("device", sorted(FACTS))
def test_configs_are_those_of_a5719ef(device):
    facts = FACTS[device]
    wrong = []
    for row in SNAPSHOT["devices"][device]:
        (shape, m, n, k), want = _expected(row)
        got = choose_config(m, n, k, facts).to_dict()
        if got != want:
            diff = {f: (got[f], want[f]) for f in want if got[f] != want[f]}
            wrong.append(f"{shape} M={m}: {diff}")
    assert not wrong, f"{len(wrong)} configs differ (new, a5719ef):\n" + "\n".join(wrong[:20])


def test_every_kernel_kind_is_chosen_somewhere():
    """The snapshot exercises each family (else the comparison above proves little for it)."""
    kinds = {_expected(r)[1]["kind"] for rows in SNAPSHOT["devices"].values() for r in rows}
    assert kinds == {k.value for k in Kernel}


def test_thresholds_table_is_what_the_rules_read():
    """A threshold changed in :data:`TUNED` changes the choice: the cuBLAS boundary moves."""
    import dataclasses

    import mxfp8_convert.runtime.hopper.rules as rules

    h200 = FACTS["h200"]
    assert choose_config(TUNED.cublas_min_m, 4096, 4096, h200).kind is Kernel.CUBLAS
    try:
        rules.TUNED = dataclasses.replace(TUNED, cublas_min_m=TUNED.cublas_min_m + 1)
        assert choose_config(TUNED.cublas_min_m, 4096, 4096, h200).kind is Kernel.TILE
    finally:
        rules.TUNED = TUNED


def _probe(monkeypatch, capability=(9, 0), cuda="12.8", driver=(12, 8), pdl_env=None):
    """probe.device_facts on a simulated CUDA device (what snapshot_configs.py patched)."""
    pytest.importorskip("triton")
    import torch

    from mxfp8_convert.runtime.hopper import jit, probe

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(probe, "num_sms", lambda device: 132)
    monkeypatch.setattr(probe, "driver_cuda_version", lambda: driver)
    monkeypatch.setattr(probe, "gluon", lambda: object())
    monkeypatch.setattr(jit, "gdc_wait", jit.gdc_wait or (lambda: None))
    if pdl_env is None:
        monkeypatch.delenv("MXFP8_PDL", raising=False)
    else:
        monkeypatch.setenv("MXFP8_PDL", pdl_env)
    return probe, torch.device("cuda")


def test_device_facts_of_a_hopper_gpu(monkeypatch):
    """The facts probed under the snapshot's patches are the ones the rules are tested with."""
    probe, dev = _probe(monkeypatch)
    assert probe.device_facts(dev) == FACTS["h200"]
    monkeypatch.setenv("MXFP8_PDL", "strict")
    assert probe.device_facts(dev) == FACTS["h200-pdl-strict"]
    monkeypatch.setenv("MXFP8_PDL", "0")
    assert probe.device_facts(dev) == FACTS["h200-pdl-off"]
    monkeypatch.delenv("MXFP8_PDL")
    monkeypatch.setattr(probe, "CLUSTERS_REFUSED", {0})
    assert probe.device_facts(dev) == FACTS["h200-clusters-refused"]
    monkeypatch.setattr(probe, "gluon", lambda: None)
    assert probe.device_facts(dev).gluon is False


@pytest.mark.parametrize("kw,pdl", [
    ({}, True),
    ({"cuda": "12.2"}, False),  # a torch built before CUDA 12.4
    ({"driver": (12, 2)}, False),  # a driver older than the toolkit
    ({"driver": None}, True),  # a driver that does not say
    ({"driver": (13, 0)}, True),
    ({"capability": (8, 9)}, False),  # before Hopper
    ({"pdl_env": "0"}, False),
    ({"pdl_env": "strict"}, True),
])
def test_pdl_enabled(monkeypatch, kw, pdl):
    probe, dev = _probe(monkeypatch, **kw)
    assert probe.pdl_enabled(dev) is pdl
    assert probe.pdl_enabled(__import__("torch").device("cpu")) is False


def test_pdl_needs_a_triton_with_gdc(monkeypatch):
    probe, dev = _probe(monkeypatch)
    from mxfp8_convert.runtime.hopper import jit

    monkeypatch.setattr(jit, "gdc_wait", None)
    assert probe.pdl_enabled(dev) is False


def test_cpu_facts():
    pytest.importorskip("triton")
    import torch

    from mxfp8_convert.runtime.hopper import probe

    assert probe.device_facts(torch.device("cpu")) == FACTS["cpu"]
