"""The Hopper selection rules on CPU: every config they choose equals the one the rules of commit
a5719ef chose (``data/hopper_configs.json``, written from that commit's code by
``data/snapshot_configs.py``), for the 19 model shapes and ten edge shapes at M = 1..16, 256
and 2048 on nine simulated devices, except where the serving-batch rule (issue 26) takes over
(M = 256 on Hopper with Gluon), whose choices are checked against hand-derived configs; and the
device probing behind the facts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxfp8_convert.runtime.hopper.config import Kernel
from mxfp8_convert.runtime.hopper.rules import TUNED, DeviceFacts, choose_config, serving_rule
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
        if serving_rule(m, n, k, facts) is not None:  # issue 26's rule: tested below
            assert m == 256 and facts.hopper and facts.gluon, (device, shape, m)
            continue
        got = choose_config(m, n, k, facts).to_dict()
        assert got.pop("specialized") is False  # newer than the snapshot (dqmma only)
        if got != want:
            diff = {f: (got[f], want[f]) for f in want if got[f] != want[f]}
            wrong.append(f"{shape} M={m}: {diff}")
    assert not wrong, f"{len(wrong)} configs differ (new, a5719ef):\n" + "\n".join(wrong[:20])


def test_every_kernel_kind_is_chosen_somewhere():
    """The snapshot exercises each family (else the comparison above proves little for it)."""
    kinds = {_expected(r)[1]["kind"] for rows in SNAPSHOT["devices"].values() for r in rows}
    newer = {Kernel.DQMMA.value, Kernel.BLOCK128.value}  # newer than the snapshot
    assert kinds == {k.value for k in Kernel} - newer


def test_thresholds_table_is_what_the_rules_read():
    """A threshold changed in :data:`TUNED` changes the choice: the cuBLAS boundary moves."""
    import dataclasses

    import mxfp8_convert.runtime.hopper.rules as rules

    h200 = FACTS["h200-no-gluon"]  # with Gluon the serving rule comes first (tests below)
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


# issue 26: serving batches (M = 17 .. 512) on Hopper with Gluon. Each expectation below is derived
# by hand from the rule's description (TUNED's comments) for an H200 (132 SMs):
#   dqmma: 64-row programs of 32 tokens (M <= 32), 64 (M <= 128) or 256; split-K 1 where the
#   tiles fill 132 SMs (above M = 128: 66), else min(ceil(waves * 132 / tiles), K-tiles // 4)
#   (waves 2 up to M = 128, 1 above), then the fewest splits giving the same K-tiles per split;
#   M = 65..128 where the 64-row tiles fit 132 SMs (128 rows where K >= 12288) or the 128-row
#   tiles are 99..132: programs of 128 tokens, split min(132 // tiles, K-tiles // 4);
#   wgmma at M = 17..32 (64-row tiles < 132 and K < 12288): 128-row programs,
#   split min(ceil(132 / tiles), K-tiles, 16), no empty split, a second kernel sums them, PDL.
SERVING = [
    # (M, N, K, kind, block_n, block_m, split_k)
    # the FP8 kernel: ceil(132 / tiles) splits, at most 16 and at most 132 programs (one an SM)
    (32, 4096, 4096, "wgmma", 128, 16, 4),  # 32 tiles: 5 -> 132 // 32 = 4; 32 K-tiles: 8 each
    (32, 7168, 2048, "wgmma", 128, 16, 2),  # 56 tiles: 3 -> 132 // 56 = 2 (112 programs)
    (32, 2560, 4096, "wgmma", 128, 16, 6),  # 20 tiles: 7 -> 6; 32 K-tiles: 6,6,6,6,6,2
    (17, 1024, 4096, "wgmma", 128, 16, 16),  # 8 tiles: ceil(132/8) = 17 -> 16 (at most 16)
    (32, 576, 7168, "wgmma", 128, 16, 14),  # 5 tiles: 27 -> 16 -> 56 K-tiles by 4: 14 splits
    (32, 14336, 4096, "dqmma", 64, 32, 1),  # 224 64-row tiles fill the SMs: dqmma, unsplit
    (32, 4096, 14336, "dqmma", 64, 32, 5),  # K >= 12288: 64 tiles, ceil(264/64) = 5 of 112
    (32, 32768, 512, "dqmma", 64, 32, 1),  # 512 tiles
    (32, 9728, 2560, "dqmma", 64, 32, 2),  # 152 tiles < 1.25 x 132: ceil(264/152) = 2
    (64, 9728, 2560, "dqmma", 64, 64, 3),  # ring of 2 (below): round(528 / 152) = 3
    (64, 14336, 4096, "dqmma", 64, 64, 1),  # 224 tiles >= 165: unsplit
    (64, 4096, 4096, "dqmma", 64, 64, 8),  # ring of 2 (below): round(528 / 64) = 8
    (64, 1024, 2560, "dqmma", 64, 64, 5),  # 16 tiles: 17 -> 20 K-tiles // 4 = 5: 4,4,4,4,4
    (100, 1024, 4096, "dqmma", 64, 128, 8),  # 16 tiles <= 132: 132 // 16 = 8, 32 // 4 = 8
    (128, 24576, 1536, "dqmma", 64, 64, 1),  # 384 tiles, 192 of 128 rows: 64 tokens, 384 x 2
    (128, 9728, 2560, "dqmma", 64, 64, 1),  # 152 tiles, 76 of 128 rows < 99: 152 x 2 >= 165
    (128, 4096, 4096, "dqmma", 64, 128, 2),  # 64 tiles: 132 // 64 = 2
    (128, 4096, 14336, "dqmma", 128, 128, 4),  # K >= 12288: 32 tiles of 128, 132 // 32 = 4
    (128, 14336, 4096, "dqmma", 128, 128, 1),  # 224 tiles; 112 of 128 rows in 99..132
    (128, 7168, 2048, "dqmma", 64, 128, 1),  # 112 tiles: 132 // 112 = 1
    (128, 576, 7168, "dqmma", 64, 128, 14),  # 9 tiles: 132 // 9 = 14, 56 // 4 = 14
    # 256-token programs fill an SM alone: at most 132 programs, 132 // tiles splits
    (256, 4096, 4096, "dqmma", 64, 256, 2),  # 64 tiles: 132 // 64 = 2
    (256, 2560, 4096, "dqmma", 64, 256, 3),  # 40 tiles: 132 // 40 = 3
    # N <= 1024 from M = 129 (to 512): 128-token programs (two to four M tiles), one an SM
    (256, 1024, 4096, "dqmma", 64, 128, 4),  # 16 x 2 tiles: 132 // 32 = 4
    (256, 576, 7168, "dqmma", 64, 128, 7),  # 9 x 2 tiles: 132 // 18 = 7 (56 K-tiles: 8 each)
    (257, 1024, 4096, "dqmma", 64, 128, 2),  # N <= 1024: 128 tokens, 16 x 3 tiles, 132 // 48
    (257, 1536, 7168, "cublas", 64, 0, 1),  # 1024 < N < 4096 above M = 256
    (512, 4096, 14336, "dqmma", 64, 256, 1),  # 64 x 2 = 128 tiles: 128-row ones, 64 < 66
    (512, 4096, 2560, "dqmma", 64, 256, 1),  # 64 x 2 = 128 tiles >= 66
    (512, 1024, 4096, "dqmma", 64, 128, 2),  # 16 x 4 tiles < 66: 132 // 64 = 2
    (512, 576, 7168, "dqmma", 64, 128, 3),  # 9 x 4 tiles: 132 // 36 = 3
    (512, 2048, 7168, "cublas", 64, 0, 1),  # 1024 < N < 4096 above M = 256
    (300, 4096, 4096, "dqmma", 64, 256, 1),  # 64 x 2 = 128 tiles >= 66
    (200, 4096, 4096, "dqmma", 64, 256, 2),  # 64 tiles < 66: 132 // 64 = 2
    (512, 2560, 4096, "cublas", 64, 0, 1),  # N < 4096 above M = 256
    (600, 4096, 4096, "cublas", 64, 0, 1),  # above M = 512
]


@pytest.mark.parametrize("m,n,k,kind,block_n,block_m,split", SERVING)
def test_serving_rule_on_an_h200(m, n, k, kind, block_n, block_m, split):
    cfg = choose_config(m, n, k, FACTS["h200"])
    assert (cfg.kind.value, cfg.block_n, cfg.block_m, cfg.split_k) == (kind, block_n, block_m,
                                                                       split)
    if kind == "wgmma":  # activations quantized inside, a second kernel sums, under PDL
        assert cfg.fuse_quant and not cfg.serial_reduce and cfg.pdl and cfg.phys_partials
        assert cfg.num_warps == 8 and not cfg.cluster
    if kind == "dqmma":
        ring = 2 if 32 < m <= 64 and n * k < 32_000_000 and n >= 2560 else 3  # OCCUPANCY
        assert cfg.num_warps == block_n // 16 and cfg.num_stages == ring and cfg.block_k == 128
        assert not cfg.specialized
        # quantization, kernel and reduction as a PDL chain below 32 M weight elements, the
        # weight's first tiles early
        assert cfg.pdl == cfg.prefetch == (n * k < 32_000_000)
        assert cfg.red_release == (cfg.pdl and split > 1)


@pytest.mark.parametrize("device,pdl,prefetch", [
    ("h200-pdl-strict", True, False), ("h200-pdl-off", False, False)])
@pytest.mark.parametrize("m,n,k", [(64, 4096, 4096), (128, 1024, 4096), (32, 32768, 512)])
def test_dqmma_launch_follows_the_pdl_mode(device, pdl, prefetch, m, n, k):
    """``MXFP8_PDL=strict``: the dqmma chain under PDL with nothing loaded before the waits;
    ``MXFP8_PDL=0``: no PDL."""
    cfg = choose_config(m, n, k, FACTS[device])
    assert cfg.kind is Kernel.DQMMA
    assert (cfg.pdl, cfg.prefetch, cfg.red_release) == (pdl, prefetch, pdl and cfg.split_k > 1)


@pytest.mark.parametrize("m,n,k,specialized", [
    (32, 7168, 16384, False), (64, 14336, 4096, False), (128, 7168, 16384, False),
    (512, 18432, 7168, True), (128, 4864, 6144, False)])
def test_dqmma_on_large_weights_runs_without_pdl(m, n, k, specialized):
    """From 32 M weight elements (DeepSeek o_proj 117 M, Llama gate_up 59 M, 29.9 M is below)
    the dqmma path runs without PDL, where it was slower (TUNED.dqmma_pdl_max_weight)."""
    cfg = choose_config(m, n, k, FACTS["h200"])
    assert cfg.kind is Kernel.DQMMA and cfg.specialized == specialized
    assert (cfg.pdl, cfg.prefetch) == ((n * k < 32_000_000),) * 2


# The warp-specialized dqmma (TUNED.ws_min_m): 128-row programs of 256 tokens (ring of 2) at
# M = 129..512 where its P = ceil(N / 128) * ceil(M / 256) programs are at least 0.5 * 132 = 66
# (unsplit) and fill their waves (P / (ceil(P / 132) * 132)) no more than 0.15 worse than the 2P
# 64-row programs of the one-chain kernel fill theirs.
SPECIALIZED = [
    # (M, N, K, block_m, split_k, stages)
    (512, 7168, 16384, 256, 1, 2),  # 112 programs: 0.85 against 224: 0.85
    (300, 14336, 4096, 256, 1, 2),  # 224: 0.85 against 448: 0.85
    (512, 7168, 2048, 256, 1, 2),  # K plays no part
    (512, 24576, 1536, 256, 1, 2),  # 384: 0.97 against 768: 0.97
    (256, 32768, 512, 256, 1, 2),  # 256: 0.97 against 512: 0.97
    (129, 9728, 2560, 256, 1, 2),  # 76: 0.58 against 152: 0.58
    (512, 18432, 7168, 256, 1, 2),  # 288: 0.73 against 576: 0.87 (within 0.15)
]


@pytest.mark.parametrize("m,n,k,block_m,split,stages", SPECIALIZED)
def test_serving_rule_takes_the_specialized_kernel(m, n, k, block_m, split, stages):
    cfg = choose_config(m, n, k, FACTS["h200"])
    assert cfg.kind is Kernel.DQMMA and cfg.specialized and cfg.block_n == 128
    assert (cfg.block_m, cfg.split_k, cfg.num_stages, cfg.num_warps) == (block_m, split, stages,
                                                                         4)


# M = 33..64, TUNED.dqmma_occupancy_*: on weights of < 32 M elements with N >= 2560, 64-row
# programs in a ring of 2 (2 x (8 + 16) KB: four fit an SM's 227 KB), split
# round(4 * 132 / tiles), at least 4 K-tiles a split, then no empty split; other weights keep
# the ring of 3 and dqmma's split (the table above).
OCCUPANCY = [
    # (M, N, K, split_k, stages)
    (64, 4096, 4096, 8, 2),  # 64 tiles: round(8.25) = 8 (32 K-tiles: 4 each)
    (48, 4096, 2560, 5, 2),  # round(8.25) = 8, 20 K-tiles // 4 = 5
    (33, 2560, 9728, 13, 2),  # 40 tiles: round(13.2) = 13 (76 K-tiles: 6 each)
    (64, 32768, 512, 1, 2),  # 512 tiles: round(1.03) = 1
    (64, 7168, 2048, 4, 2),  # 112 tiles: round(4.7) = 5, 16 K-tiles: 4 each -> 4 splits
    (64, 2560, 4096, 8, 2),  # 40 tiles: round(13.2) = 13, 32 K-tiles // 4 = 8
    (64, 2048, 7168, 8, 3),  # N < 2560: ceil(264 / 32) = 9 -> 56 K-tiles: 7 each -> 8
    (64, 14336, 4096, 1, 3),  # 58.7 M elements: 224 tiles fill the SMs, unsplit
    (32, 9728, 2560, 2, 3),  # M = 32: 32-token programs, dqmma's split (the table above)
]


@pytest.mark.parametrize("m,n,k,split,stages", OCCUPANCY)
def test_serving_rule_puts_four_64_token_programs_on_an_sm(m, n, k, split, stages):
    cfg = choose_config(m, n, k, FACTS["h200"])
    assert cfg.kind is Kernel.DQMMA and not cfg.specialized
    assert (cfg.block_n, cfg.block_m, cfg.split_k, cfg.num_stages) == (
        64, 64 if m > 32 else 32, split, stages)


# M = 65..128, TUNED.dqmma_pair_*: one-chain programs of 128 rows and 128 tokens in a ring of 2
# (two an SM), split min(2 * 132 // tiles, K-tiles // 4), where K >= 16384, and up to M = 96
# where tall_config gives none (64-row tiles > 132 and 128-row tiles outside 99..132).
PAIRS = [
    # (M, N, K, split_k)
    (128, 7168, 16384, 4),  # 56 tiles: 264 // 56 = 4 (128 K-tiles: 32 a split)
    (100, 7168, 18432, 4),  # 144 K-tiles: 36 a split
    (80, 9728, 2560, 3),  # 152 64-row tiles, 76 of 128 < 99: 264 // 76 = 3 (20 K-tiles: 7 each)
    (96, 24576, 1536, 1),  # 192 tiles >= 1.25 x 132: unsplit
    (80, 18432, 7168, 1),  # 144 tiles: 264 // 144 = 1
]


@pytest.mark.parametrize("m,n,k,split", PAIRS)
def test_serving_rule_takes_two_128_token_programs_an_sm(m, n, k, split):
    cfg = choose_config(m, n, k, FACTS["h200"])
    assert cfg.kind is Kernel.DQMMA and not cfg.specialized
    assert (cfg.block_n, cfg.block_m, cfg.num_stages, cfg.num_warps, cfg.split_k) == (
        128, 128, 2, 8, split)


def test_serving_rule_takes_64_token_programs_past_96_tokens():
    """Above ``dqmma_pair_max_m`` the weights that fit neither 128-token rule run 64-token
    programs (two M tiles), as at M = 128 in the sweep."""
    for n, k in ((9728, 2560), (24576, 1536), (32768, 512), (18432, 7168)):
        cfg = choose_config(97, n, k, FACTS["h200"])
        assert (cfg.block_n, cfg.block_m, cfg.num_stages) == (64, 64, 3), (n, k)


@pytest.mark.parametrize("m,n,k", [
    (128, 4096, 14336),  # K < 16384
    (64, 7168, 16384),  # M <= 64
    (256, 7168, 16384),  # 56 programs < 66
    (512, 4096, 4096),  # 32 x 2 = 64 programs < 66
    (512, 9728, 2560),  # 152 programs: 0.58 against 304: 0.77
    (256, 18432, 7168),  # 144: 0.55 against 288: 0.73
    (256, 24576, 1536),  # 192: 0.73 against 384: 0.97
    (128, 32768, 512),  # M <= 128
])
def test_serving_rule_keeps_the_one_chain_kernel(m, n, k):
    cfg = choose_config(m, n, k, FACTS["h200"])
    assert cfg.kind is Kernel.DQMMA and not cfg.specialized


@pytest.mark.parametrize("device", ["h200-no-gluon", "sm89-128", "sm80-108", "cpu"])
def test_serving_rule_needs_hopper_and_gluon(device):
    """Elsewhere M = 17..512 keeps its kernels: tile up to M = 255, cuBLAS from 256."""
    facts = FACTS[device]
    for m in (17, 32, 128, 256, 512):
        assert serving_rule(m, 4096, 4096, facts) is None
        want = Kernel.CUBLAS if m >= TUNED.cublas_min_m else Kernel.TILE
        assert choose_config(m, 4096, 4096, facts).kind is want


def test_serving_rule_bounds():
    h200 = FACTS["h200"]
    assert serving_rule(16, 4096, 4096, h200) is None  # the decode rules' (wgmma_rule)
    assert choose_config(16, 4096, 4096, h200).kind is Kernel.WGMMA
    assert serving_rule(64, 4096, 4160, h200) is None  # K % 128 != 0: the tile kernel
    assert choose_config(64, 4096, 4160, h200).kind is Kernel.TILE
    assert serving_rule(TUNED.dqmma_max_m + 1, 8192, 4096, h200) is None


@pytest.mark.parametrize("kw,runs,want,asks", [
    ({"cuda": "12.9"}, True, True, 1),
    ({"cuda": "13.0"}, False, False, 1),  # the build refuses the recipe
    ({"cuda": "12.8"}, True, False, 0),  # before torch's 1x128 recipe: not asked
    ({"cuda": "13.0", "capability": (10, 0)}, True, False, 0),  # Blackwell: FlashInfer's path
])
def test_block_fp8_probe(monkeypatch, kw, runs, want, asks):
    probe, dev = _probe(monkeypatch, **kw)
    asked = []
    monkeypatch.setattr(probe, "_BLOCK_FP8", {})
    monkeypatch.setattr(probe, "scaled_mm_1x128", lambda device: asked.append(device) or runs)
    assert probe.block_fp8(dev) is want and probe.block_fp8(dev) is want
    assert len(asked) == asks  # once per device


@pytest.mark.parametrize("capability,interpreting,want", [
    ((9, 0), False, True), ((10, 0), False, True), ((8, 9), False, True),  # cvt ... e4m3x2: sm_89+
    ((8, 0), False, False), ((9, 0), True, False),  # the interpreter: fp32-arithmetic rounding
])
def test_e4m3_conversion_where_the_gpu_has_it(monkeypatch, capability, interpreting, want):
    probe, dev = _probe(monkeypatch, capability=capability)
    monkeypatch.setattr(probe, "interpreting", lambda: interpreting)
    probe._capability.cache_clear()
    try:
        assert probe.e4m3_conversion(dev) is want
        assert probe.e4m3_conversion(torch.device("cpu")) is False
    finally:
        probe._capability.cache_clear()


def test_block128_rule():
    """The block-128 path from ``block128_min_m`` tokens on weights of ``block128_min_n`` rows;
    the cuBLAS path below either, without the recipe, with K % 128 or N % 16."""
    import dataclasses

    t = TUNED
    facts = dataclasses.replace(FACTS["h200"], block_fp8=True)

    def kind(m, n, k, f=facts):
        return choose_config(m, n, k, f).kind

    m, n = t.block128_min_m, t.block128_min_n
    assert kind(m, n, 4096) is Kernel.BLOCK128
    assert kind(8 * m, 18432, 7168) is Kernel.BLOCK128
    assert kind(m, n - 16, 4096) is Kernel.CUBLAS
    assert kind(m - 1, n, 4096) is not Kernel.BLOCK128
    assert kind(m, 4096, 4160) is Kernel.CUBLAS  # K % 128 == 64
    assert kind(m, 4104, 4096) is Kernel.CUBLAS  # N % 16 == 8
    assert kind(m, 4096, 4096, FACTS["h200"]) is Kernel.CUBLAS  # no recipe
    # chunks of the cuBLAS path's workspace bytes (multiples of 128 rows): FP8, twice the rows
    cfg = choose_config(t.block128_min_m, 32768, 16384, facts)
    want = 2 * t.dequant_workspace // 16384 // 128 * 128
    assert cfg.kind is Kernel.BLOCK128 and cfg.chunk_n == want < 32768
    assert choose_config(t.block128_min_m, 4096, 4096, facts).chunk_n == 4096
    assert choose_config(t.block128_min_m, 18432, 7168, facts).chunk_n == 18432  # DeepSeek MLP
