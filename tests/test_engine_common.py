"""engines/common.py: tp_compat as the converter records it, and each rank's slice of the file.

The oracle is the source's canonical MXFP8 bytes: a rank's rows (or K columns) of the canonical
weight and scale, laid out from scratch with the backend's own forward functions, must be
byte-identical to the slice the engine core cuts from the converted file. For a TP size outside
``tp_compat`` the first offending module is named, and its piece indeed is not tile-aligned.
"""

from __future__ import annotations

import json

import pytest
import torch

from mxfp8_convert import convert
from mxfp8_convert.engines import common
from mxfp8_convert.format import MOE_TENSORS
from mxfp8_convert.inspection import inspect_checkpoint
from mxfp8_convert.runtime.weight import MXFP8Weight
from mxfp8_convert.synth import SynthSpec, linear_names, write_checkpoint
from tests.checkpoints import load_all

# head_dim 128: q 512 rows, k/v 2 heads = 256 rows, MLP 1024; o_proj K 512, down_proj K 1024
SPEC = SynthSpec(layers=1, hidden=512, intermediate=1024, heads=4, kv_heads=2, vocab=256, shards=1)


def _rank_range(name: str, n: int, k: int, tp: int, rank: int) -> tuple[slice, slice]:
    """Rows and K columns of rank ``rank``, from the model's own arithmetic (not common.py)."""
    leaf = name.rpartition(".")[2]
    if leaf in ("o_proj", "down_proj"):
        return slice(0, n), slice(rank * k // tp, (rank + 1) * k // tp)
    if leaf in ("k_proj", "v_proj") and tp >= SPEC.kv_heads:
        head = rank // (tp // SPEC.kv_heads)
        hd = n // SPEC.kv_heads
        return slice(head * hd, (head + 1) * hd), slice(0, k)
    return slice(rank * n // tp, (rank + 1) * n // tp), slice(0, k)


@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_tp_compat_slices_are_the_layout_of_the_canonical_slices(tmp_path, backend):
    src = write_checkpoint(tmp_path / "src", SPEC)
    out = tmp_path / f"out-{backend}"
    convert(src, backend, out)
    marker = json.loads((out / "config.json").read_text())["quantization_config"]
    assert marker["format_version"] == 2
    # trtllm: o_proj at TP=4 has K=128 per rank, not the 256 its kernel needs
    want = {"trtllm": [1, 2], "cutlass": [1, 2, 4]}[backend]
    assert marker["tp_compat"] == want
    assert inspect_checkpoint(out).to_dict()["tp_compat"] == want
    ckpt = common.read_checkpoint(out)
    assert ckpt.tp_compat == want
    assert sorted(ckpt.modules) == sorted(m for m, _, _ in linear_names(SPEC))
    source, stored = load_all(src)[0], load_all(out)[0]
    for tp in common.TP_SIZES:
        if tp not in want:
            why = common.first_tp_violation(ckpt, tp)
            assert why and f"at tensor parallel {tp}:" in why
            with pytest.raises(common.LayoutError, match=f"tensor parallel {tp} is not in"):
                common.check_tp(ckpt, tp)
            continue
        common.check_tp(ckpt, tp)
        for name, n, k in linear_names(SPEC):
            m = ckpt.modules[name]
            gw, gs = common.grid(backend, "weight"), common.grid(backend, "scale")
            for rank in range(tp):
                rows, cols = _rank_range(name, n, k, tp, rank)
                q = source[f"{name}.weight"][rows, cols]
                code = source[f"{name}.weight_scale_inv"][rows, cols.start // 32:cols.stop // 32]
                expect = MXFP8Weight.from_canonical(q.contiguous(), code.contiguous(), backend)
                w, s = stored[f"{name}.weight"], stored[f"{name}.weight_scale_swizzled"]
                if m.split == common.ROW:
                    w = common.take_cols(w, gw, cols.start, cols.stop - cols.start)
                    s = common.take_cols(s, gs, cols.start, cols.stop - cols.start)
                else:
                    kv = m.split == common.KV_HEADS
                    replicas = max(1, tp // SPEC.kv_heads) if kv else 1
                    start, size = common.rank_part(n, tp, rank, replicas)
                    assert (start, size) == (rows.start, rows.stop - rows.start)
                    w = common.take_rows(w, gw, start, size)
                    s = common.take_rows(s, gs, start, size)
                assert torch.equal(w.view(torch.uint8), expect.data.view(torch.uint8)), (
                    name, tp, rank)
                assert torch.equal(s, expect.scale), (name, tp, rank)


def test_first_violation_names_the_module_and_why():
    mods = [common.Module("model.layers.0.mlp.down_proj", 512, 1152, "cutlass"),
            common.Module("model.layers.0.self_attn.k_proj", 128, 512, "cutlass"),
            common.Module("model.layers.0.mystery", 256, 256, "cutlass")]
    assert common.tp_violation(mods[0], 2, 1, "cutlass") == "K=576 per rank, not a multiple of 128"
    assert common.tp_violation(mods[1], 2, 1, "cutlass") is None  # one KV head, whole on each rank
    assert common.tp_violation(mods[1], 2, 4, "cutlass") == (  # 4 heads of 32 rows
        "64 rows per rank, not a multiple of 128; per rank N=64 < 128")
    assert common.tp_violation(mods[2], 2, 1, "cutlass") is None  # 128 rows and 128 K both ways
    assert common.tp_violation(mods[2], 4, 1, "cutlass") == (
        "64 rows per rank, not a multiple of 128; per rank N=64 < 128; "
        "K=64 per rank, not a multiple of 128; per rank K=64 < 128")
    assert common.tp_compat(mods, 1, "cutlass") == [1]
    ck = common.EngineCheckpoint(None, {"backend": "cutlass"}, {m.name: m for m in mods}, 1)
    assert common.first_tp_violation(ck, 2) == (
        "model.layers.0.mlp.down_proj [512, 1152] (row-parallel, cutlass) at tensor parallel 2: "
        "K=576 per rank, not a multiple of 128")


def test_slices_off_the_tile_grid_are_refused():
    g = common.grid("trtllm", "scale")
    tiles = torch.zeros(4, 2, 512, dtype=torch.uint8)
    assert common.take_rows(tiles, g, 128, 256).shape == (2, 2, 512)
    with pytest.raises(common.LayoutError, match="not on a multiple of 128"):
        common.take_rows(tiles, g, 64, 128, "q.weight_scale_swizzled")
    with pytest.raises(common.LayoutError, match="past its"):
        common.take_rows(tiles, g, 384, 256)
    assert common.rank_part(128, 2, 1, replicas=2) == (0, 128)  # one KV head shared by 2 ranks
    assert common.rank_part(256, 4, 3, replicas=2) == (128, 128)


def test_experts_split_as_an_engines_fused_moe_layer():
    """A per-expert projection ``...experts.<e>.<leaf>`` splits as vLLM's / SGLang's fused-MoE
    layer splits it: gate / up (Mixtral w1 / w3) by rows, down (w2) by K; so experts of H=256,
    I=1024 slice at TP=4 (256 rows / 256 K a rank), where a split both ways would not (K=64)."""
    p = "model.layers.0.block_sparse_moe.experts.3"
    gate = common.Module(f"{p}.w1", 1024, 256, "cutlass")
    up = common.Module(f"{p}.w3", 1024, 256, "cutlass")
    down = common.Module(f"{p}.w2", 256, 1024, "cutlass")
    assert [m.split for m in (gate, up, down)] == ["column", "column", "row"]
    assert common.Module("model.layers.0.mlp.experts.0.down_proj", 256, 1024, "cutlass").split \
        == "row"
    assert common.Module("model.layers.0.mlp.w2", 256, 1024, "cutlass").split == "either"
    assert common.expert_of(f"{p}.w1") == ("model.layers.0.block_sparse_moe.experts", 3)
    assert common.expert_of("model.layers.0.mlp.down_proj") is None
    assert common.tp_compat([gate, up, down], 1, "cutlass") == [1, 2, 4, 8]
    assert common.tp_violation(gate, 16, 1, "cutlass") == (
        "64 rows per rank, not a multiple of 128; per rank N=64 < 128")


class _Linear:
    """A stand-in for an engine's linear base class."""


class _Experts:
    """A stand-in for an engine's fused-MoE layer class (expert parallel or not)."""

    def __init__(self, ep: int = 1):
        self.ep = ep


class _ExpertsMethod:
    def __init__(self, config, layout: str, prefix: str, layer):
        self.layout, self.prefix = layout, prefix


def _quant_config(ckpt):
    """``common.QuantConfig`` as an engine adapter mixes it, without the engine: TP=1, an
    experts method, expert parallelism refused."""
    class Config(common.QuantConfig):
        linear_base, linear_method, unquantized = _Linear, common.LinearMethod, object
        experts_base, experts_method = _Experts, _ExpertsMethod

        @staticmethod
        def tp_size() -> int:
            return 1

        @staticmethod
        def experts_refusal(layer) -> str | None:
            return f"expert parallelism (EP size {layer.ep}) is refused" if layer.ep > 1 else None

    cfg = Config()
    cfg.checkpoint = ckpt
    return cfg


def test_per_expert_moe_gets_the_experts_method_at_its_fused_moe_layers(tmp_path):
    """A MoE checkpoint with per-expert projections (cutlass): the engine's fused-MoE layer of a
    block gets the experts method with the experts' layout, its linears the linear method; a
    fused-MoE layer whose experts the checkpoint does not quantize keeps the engine's own
    method (``None``); the adapter's refusal (expert parallelism) is one line naming the
    layer."""
    spec = SynthSpec(layers=1, hidden=256, intermediate=512, heads=2, kv_heads=2, vocab=256,
                     shards=1, experts=2, moe_intermediate=256)
    out = convert(write_checkpoint(tmp_path / "moe", spec), "cutlass", tmp_path / "moe-c").output
    cfg = _quant_config(common.read_checkpoint(out))
    block = "model.layers.0.mlp.experts"
    method = cfg.get_quant_method(_Experts(), block)
    assert isinstance(method, _ExpertsMethod) and (method.layout, method.prefix) == (
        "cutlass", block)
    assert isinstance(cfg.get_quant_method(_Linear(), "model.layers.0.self_attn.q_proj"),
                      common.LinearMethod)
    assert cfg.get_quant_method(_Experts(), "model.layers.0.mlp.other_experts") is None
    with pytest.raises(common.LayoutError) as e:
        cfg.get_quant_method(_Experts(ep=2), block)
    assert str(e.value) == f"{block}: expert parallelism (EP size 2) is refused"


@pytest.mark.parametrize(("hidden", "heads", "inter", "want"),
                         [(512, 4, 384, [1]), (1024, 8, 512, [1, 2, 4])])
def test_fused_blocks_slice_as_the_fused_layout_of_the_canonical_slices(tmp_path, hidden, heads,
                                                                         inter, want):
    """A fused trtllm MoE block (docs/FORMAT.md section 3a) slices at a TP size where each rank's
    I/tp is a multiple of 128, and the marker's ``tp_compat`` says so (the dense modules alone
    slice at [1, 2] and [1, 2, 4]). There each rank's contiguous share of the stored ``w13``
    rows and ``w2`` K, with their tiles (``common.fused_share``), is byte for byte the fused
    layout (``layouts/moe.py``) of the rank's rows ``[r*I/tp, (r+1)*I/tp)`` of the source's
    canonical up and gate and those K columns of its down. Elsewhere the block is named."""
    from mxfp8_convert.layouts import moe as lay

    spec = SynthSpec(layers=1, hidden=hidden, intermediate=1024, heads=heads, kv_heads=heads,
                     vocab=256, shards=1, experts=2, moe_intermediate=inter)
    src = write_checkpoint(tmp_path / "src", spec)
    out = tmp_path / "out"
    convert(src, "trtllm", out)
    marker = json.loads((out / "config.json").read_text())["quantization_config"]
    block = "model.layers.0.mlp.experts"
    assert marker["moe"]["layers"] == [block]
    assert marker["tp_compat"] == want
    ckpt = common.read_checkpoint(out, fused=True)
    assert ckpt.tp_compat == want
    assert ckpt.blocks[block] == common.FusedBlock(block, 2, hidden, inter, dict(MOE_TENSORS))
    for tp in common.TP_SIZES:
        if tp not in want:
            assert common.first_tp_violation(ckpt, tp) == (
                f"{block} fused MoE block (E=2, H={hidden}, I={inter}, trtllm_fused_moe) at "
                f"tensor parallel {tp}: I={inter // tp} per rank, not a multiple of 128")
            with pytest.raises(common.LayoutError, match=f"tensor parallel {tp} is not in"):
                common.check_tp(ckpt, tp)
    source, stored = load_all(src)[0], load_all(out)[0]

    def canon(leaf, suffix):
        return torch.stack([source[f"{block}.{e}.{leaf}.{suffix}"] for e in range(2)])

    up, gate, down = (canon(leaf, "weight").view(torch.uint8)
                      for leaf in ("up_proj", "gate_proj", "down_proj"))
    up_s, gate_s, down_s = (canon(leaf, "weight_scale_inv")
                            for leaf in ("up_proj", "gate_proj", "down_proj"))
    for tp in want:
        step = inter // tp
        b = common.FusedBlock(block, 2, hidden, step, dict(MOE_TENSORS))
        for rank in range(tp):
            rows, cols = slice(rank * step, (rank + 1) * step), slice(rank * step // 32,
                                                                      (rank + 1) * step // 32)
            expect = {
                "moe_fc1_weight": lay.moe_fc1_weight_from_canonical(up[:, rows], gate[:, rows]),
                "moe_fc1_scale": lay.moe_fc1_scale_from_canonical(up_s[:, rows],
                                                                  gate_s[:, rows]),
                "moe_fc2_weight": lay.moe_fc2_weight_from_canonical(
                    down[:, :, rows].contiguous()),
                "moe_fc2_scale": lay.moe_fc2_scale_from_canonical(
                    down_s[:, :, cols].contiguous()),
            }
            for role, name, dest in common.fused_tensors(b, step):
                got = common.fused_share(stored[f"{block}.{name}"], dest, role, rank, tp, name)
                assert torch.equal(got.view(torch.uint8), expect[role]), (tp, rank, role)


def test_a_stored_fused_tensor_of_another_size_is_refused():
    """A stored fused tensor that is not TP shares of the rank's parameter, a per-rank I off the
    tiles, an I that does not divide: one line each."""
    b = common.FusedBlock("B", 2, 512, 128, dict(MOE_TENSORS))
    (_, _, w13), *_ = common.fused_tensors(b, 128)
    assert list(w13.shape) == [2, 256, 512]
    stored = torch.zeros(2, 384, 512, dtype=torch.float8_e4m3fn)
    with pytest.raises(common.LayoutError, match=r"^B.w13_weight: stored torch.float8_e4m3fn "
                       r"\[2, 384, 512\] is not 2 shares of the rank's torch.float8_e4m3fn "
                       r"\[2, 256, 512\]$"):
        common.fused_share(stored, w13, "moe_fc1_weight", 0, 2, "B.w13_weight")
    with pytest.raises(common.LayoutError, match="B: per-rank I=64: "):
        common.fused_tensors(b, 64)
    assert common.block_tp_violation(common.FusedBlock("B", 2, 512, 384, {}), 5) == (
        "I=384 does not split in 5")


def test_fused_blocks_are_refused_by_a_plugin_that_does_not_serve_them(tmp_path):
    """SGLang's plug-in reads the marker without ``fused``: a checkpoint with fused MoE blocks
    is refused in one line naming the first block; vLLM's (``fused=True``) reads it."""
    spec = SynthSpec(layers=1, hidden=512, intermediate=1024, heads=4, kv_heads=2, vocab=256,
                     shards=1, experts=2, moe_intermediate=256)
    out = tmp_path / "out"
    convert(write_checkpoint(tmp_path / "src", spec), "trtllm", out)
    with pytest.raises(common.FormatError) as e:
        common.read_checkpoint(out)
    assert str(e.value) == (f"{out}/config.json: fused MoE blocks (model.layers.0.mlp.experts, "
                            "...) are not served by this engine's mxfp8_convert plug-in yet")
    assert e.value.hint == "serve it with vLLM or mxfp8_convert.runtime"
    assert list(common.read_checkpoint(out, fused=True).blocks) == ["model.layers.0.mlp.experts"]


def test_a_marker_written_before_fused_blocks_counted_is_checked_against_them():
    """A marker whose ``tp_compat`` did not count its fused block (the converter before this
    rule): the block rule still applies at start-up, and the refusal names the block."""
    b = common.FusedBlock("model.layers.0.mlp.experts", 4, 512, 384, dict(MOE_TENSORS))
    ck = common.EngineCheckpoint("out", {"backend": "trtllm", "tp_compat": [1, 2]}, {}, 1,
                                 {b.name: b})
    assert ck.tp_compat == [1]
    with pytest.raises(common.LayoutError) as e:
        common.check_tp(ck, 2)
    assert str(e.value) == (
        "out: tensor parallel 2 is not in this checkpoint's tp_compat [1]: "
        "model.layers.0.mlp.experts fused MoE block (E=4, H=512, I=384, trtllm_fused_moe) at "
        "tensor parallel 2: I=192 per rank, not a multiple of 128")
