"""Layer level, in this process: vLLM's own linear layers load a rank's slice through the plug-in.

Each rank's parameters must hold exactly the file's slice (checked against plain indexing of the
stored tensors: rows of q and of gate/up parts at their offsets, whole KV heads where they are
fewer than the ranks, K tiles of o_proj), ``process_weights_after_loading`` must keep the
parameters' storage (no copy, no re-layout), and the rank's weight must dequantize to the
source's rows / columns (the runtime's inverse layout, an independent path).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mxfp8_convert.errors import LayoutError

TP = 2


@pytest.fixture()
def vllm_rank(monkeypatch):
    """Build vLLM layers as rank ``r`` of ``TP`` (no process group: the sizes vLLM reads)."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    from vllm.config import VllmConfig, set_current_vllm_config

    def as_rank(r: int, tp: int = TP):
        for mod in (linear, parameter):
            monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: r, raising=False)
            monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: tp,
                                raising=False)
        import vllm.distributed as dist
        monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: tp)

    with set_current_vllm_config(VllmConfig()):
        yield as_rank


def _config(folder):
    import json

    from mxfp8_convert.engines.vllm import MXFP8ConvertConfig

    marker = json.loads((folder / "config.json").read_text())["quantization_config"]
    cfg = MXFP8ConvertConfig.from_config(marker)
    cfg.maybe_update_config(str(folder))
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                  "gate_up_proj": ["gate_proj", "up_proj"]}
    return cfg


def _load(layer, stored, names_and_ids):
    for name, shard in names_and_ids:
        for suffix in ("weight", "weight_scale_swizzled"):
            p = getattr(layer, suffix)
            t = stored[f"{name}.{suffix}"]
            p.weight_loader(p, t) if shard is None else p.weight_loader(p, t, shard)


@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_parameters_are_the_files_slices(models, vllm_rank, backend, rank):
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    from mxfp8_convert.runtime.weight import MXFP8Weight

    folder = models[("llama", backend)]
    stored = load_file(str(folder / "model.safetensors"))
    vllm_rank(rank)
    cfg = _config(folder)
    p = "model.layers.0"
    qkv = QKVParallelLinear(512, 128, 4, 1, bias=False, quant_config=cfg,
                            prefix=f"{p}.self_attn.qkv_proj", params_dtype=torch.float32)
    gate_up = MergedColumnParallelLinear(512, [1024, 1024], bias=False, quant_config=cfg,
                                         prefix=f"{p}.mlp.gate_up_proj", params_dtype=torch.float32)
    o = RowParallelLinear(512, 512, bias=False, quant_config=cfg, prefix=f"{p}.self_attn.o_proj",
                          params_dtype=torch.float32)
    a = f"{p}.self_attn"
    _load(qkv, stored, [(f"{a}.q_proj", "q"), (f"{a}.k_proj", "k"), (f"{a}.v_proj", "v")])
    _load(gate_up, stored, [(f"{p}.mlp.gate_proj", 0), (f"{p}.mlp.up_proj", 1)])
    _load(o, stored, [(f"{a}.o_proj", None)])

    def w(n): return stored[f"{n}.weight"].view(torch.uint8)
    def s(n): return stored[f"{n}.weight_scale_swizzled"]
    q_rows, q_tiles = slice(rank * 256, rank * 256 + 256), slice(rank * 2, rank * 2 + 2)
    mlp_rows, mlp_tiles = slice(rank * 512, rank * 512 + 512), slice(rank * 4, rank * 4 + 4)
    want = {  # plain indexing of the stored tensors; one KV head, so k and v are whole on each rank
        qkv: (torch.cat([w(f"{a}.q_proj")[q_rows], w(f"{a}.k_proj"), w(f"{a}.v_proj")]),
              torch.cat([s(f"{a}.q_proj")[q_tiles], s(f"{a}.k_proj"), s(f"{a}.v_proj")])),
        gate_up: (torch.cat([w(f"{p}.mlp.gate_proj")[mlp_rows], w(f"{p}.mlp.up_proj")[mlp_rows]]),
                  torch.cat([s(f"{p}.mlp.gate_proj")[mlp_tiles],
                             s(f"{p}.mlp.up_proj")[mlp_tiles]])),
        o: (w(f"{a}.o_proj")[:, rank * 256:rank * 256 + 256], s(f"{a}.o_proj")[:, q_tiles]),
    }
    for layer, (want_w, want_s) in want.items():
        ptrs = (layer.weight.data_ptr(), layer.weight_scale_swizzled.data_ptr())
        layer.quant_method.process_weights_after_loading(layer)
        mx = layer.mxfp8_weight
        assert (mx.data.data_ptr(), mx.scale.data_ptr()) == ptrs
        assert (layer.weight.data_ptr(), layer.weight_scale_swizzled.data_ptr()) == ptrs
        assert torch.equal(layer.weight.data.view(torch.uint8), want_w)
        assert torch.equal(layer.weight_scale_swizzled.data, want_s)
        assert layer.mxfp8_engine == "reference"

    def dq(n): return MXFP8Weight(stored[f"{n}.weight"], s(n), backend, n).dequantize()
    assert torch.equal(qkv.mxfp8_weight.dequantize(), torch.cat(
        [dq(f"{a}.q_proj")[q_rows], dq(f"{a}.k_proj"), dq(f"{a}.v_proj")]))
    assert torch.equal(gate_up.mxfp8_weight.dequantize(), torch.cat(
        [dq(f"{p}.mlp.gate_proj")[mlp_rows], dq(f"{p}.mlp.up_proj")[mlp_rows]]))
    assert torch.equal(o.mxfp8_weight.dequantize(),
                       dq(f"{a}.o_proj")[:, rank * 256:rank * 256 + 256])


def test_a_module_kept_canonical_loads_as_stored(models, vllm_rank):
    """``--on-ineligible keep``: trtllm takes K in multiples of 256, so down_proj (K=1152) stays
    canonical (``weight_scale_inv [N, K/32]``); vLLM's RowParallelLinear loads it under that name
    and it dequantizes as the runtime reads the same file."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    from mxfp8_convert.runtime.reference import reference_linear

    folder = models[("llama_tp1", "trtllm-keep")]
    stored = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    assert f"{name}.weight_scale_swizzled" not in stored  # kept canonical by the converter
    vllm_rank(0, 1)
    down = RowParallelLinear(1152, 512, bias=False, quant_config=_config(folder), prefix=name,
                             params_dtype=torch.float32)
    for suffix in ("weight", "weight_scale_inv"):
        p = getattr(down, suffix)
        p.weight_loader(p, stored[f"{name}.{suffix}"])
    down.quant_method.process_weights_after_loading(down)
    assert down.quant_method.layout == "canonical"
    assert torch.equal(down.weight.data.view(torch.uint8),
                       stored[f"{name}.weight"].view(torch.uint8))
    q, code = stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"]
    assert torch.equal(down.weight_scale_inv.data, code)
    # e4m3 value x 2^(code - 127), one code per 32 K columns
    want = q.float() * torch.exp2(code.float() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(down.mxfp8_weight.dequantize(), want)
    x = torch.randn(3, 1152)
    got, _ = down(x)
    assert torch.equal(got, reference_linear(x, q, code).to(x.dtype))


def test_a_stored_part_of_another_size_is_refused(models, vllm_rank):
    """A stored q_proj of other rows than TP x the rows vLLM gives each rank: one line naming
    the parameter, nothing copied."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    folder = models[("llama", "cutlass")]
    stored = load_file(str(folder / "model.safetensors"))
    vllm_rank(0)
    a = "model.layers.0.self_attn"
    qkv = QKVParallelLinear(512, 128, 4, 1, bias=False, quant_config=_config(folder),
                            prefix=f"{a}.qkv_proj", params_dtype=torch.float32)
    before = qkv.weight.data.clone()
    short = stored[f"{a}.q_proj.weight"][:256]  # 2 heads where the config has 4
    with pytest.raises(LayoutError, match=r"qkv_proj\.weight: a stored part of 256 rows is not 2 "
                                          r"shares of the 256 rows per rank"):
        qkv.weight.weight_loader(qkv.weight, short, "q")
    assert torch.equal(qkv.weight.data.view(torch.uint8), before.view(torch.uint8))


class _RoutedExperts(torch.nn.Module):
    """What the experts method reads of vLLM's ``RoutedExperts`` (rank ``r`` of ``tp``, no EP)."""

    def __init__(self, rank: int, tp: int):
        super().__init__()
        from types import SimpleNamespace

        self.moe_config = SimpleNamespace(tp_rank=rank, tp_size=tp)

    @staticmethod
    def _map_global_expert_id_to_local_expert_id(expert_id: int) -> int:
        return expert_id

    def load_weights(self, weights):
        """vLLM's own loader: records what it is handed."""
        self.passed = [name for name, _ in weights]
        yield from ()


def _load_experts(layer, stored: dict, prefix: str, experts: int) -> None:
    """vLLM's per-expert mapping (``RoutedExperts.build_expert_params_mapping``), applied to the
    stored tensors as ``RoutedExperts.load_weights`` applies it."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    mapping = RoutedExperts.build_expert_params_mapping("w1", "w2", "w3", experts,
                                                        routed_experts_prefix="")
    for qual, t in stored.items():
        for param_name, weight_name, expert, shard in mapping:
            if weight_name in qual:
                name = qual.replace(weight_name, param_name).removeprefix(f"{prefix}.")
                p = getattr(layer, name)
                assert p.weight_loader(param=p, loaded_weight=t, weight_name=name, shard_id=shard,
                                       expert_id=expert, return_success=True)


@pytest.mark.parametrize("backend", ["cutlass", "trtllm-moe-keep"])
@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parameters_are_the_files_slices(models, vllm_rank, backend, rank):
    """A fused-MoE layer's per-rank expert parameters (w13: each expert's gate rows then its up
    rows; w2: its K of down) hold exactly the file's slices, in whole 128x128 tiles (cutlass) or
    rows / 32-column blocks (canonical), and ``process_weights_after_loading`` copies nothing."""
    from mxfp8_convert.engines.vllm import MXFP8ConvertExpertsMethod

    folder = models[("mixtral", backend)]
    stored = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.0.block_sparse_moe.experts"
    mine = {k: v for k, v in stored.items() if k.startswith(f"{prefix}.")}
    vllm_rank(rank)
    cfg = _config(folder)
    layout = cfg.experts_layout(prefix)
    assert layout == ("cutlass" if backend == "cutlass" else "canonical")
    layer = _RoutedExperts(rank, TP)
    method = MXFP8ConvertExpertsMethod(cfg, layout, prefix, layer)
    method.create_weights(layer, 4, 512, 256 // TP, torch.float32)
    _load_experts(layer, mine, prefix, 4)
    sfx = "weight_scale_swizzled" if layout == "cutlass" else "weight_scale_inv"
    rows = slice(rank * 128, rank * 128 + 128)  # I=256: 128 rows (K) per rank
    srows = slice(rank, rank + 1) if layout == "cutlass" else rows  # scale rows: tiles or rows
    scols = slice(rank, rank + 1) if layout == "cutlass" else slice(rank * 4, rank * 4 + 4)

    def w(e, n): return stored[f"{prefix}.{e}.{n}.weight"].view(torch.uint8)
    def s(e, n): return stored[f"{prefix}.{e}.{n}.{sfx}"]
    w13, s13 = layer.w13_weight.data.view(torch.uint8), getattr(layer, f"w13_{sfx}").data
    w2, s2 = layer.w2_weight.data.view(torch.uint8), getattr(layer, f"w2_{sfx}").data
    for e in range(4):
        assert torch.equal(w13[e], torch.cat([w(e, "w1")[rows], w(e, "w3")[rows]]))
        assert torch.equal(s13[e], torch.cat([s(e, "w1")[srows], s(e, "w3")[srows]]))
        assert torch.equal(w2[e], w(e, "w2")[:, rows])
        assert torch.equal(s2[e], s(e, "w2")[:, scols])
    ptrs = [t.data_ptr() for t in (w13, s13, w2, s2)]
    method.process_weights_after_loading(layer)
    ex = method.experts
    assert ex.e0_gate_data.data_ptr() == ptrs[0] and ex.e0_gate_scale.data_ptr() == ptrs[1]
    assert ex.e3_down_data.data_ptr() == ptrs[2] + 3 * w2[0].numel()
    assert [t.data_ptr() for t in (w13, s13, w2, s2)] == ptrs
    assert ex.engine == "reference"


def test_an_expert_not_loaded_is_refused(models, vllm_rank):
    """A stored expert projection missing: one line naming the parameter and the expert."""
    from mxfp8_convert.engines.vllm import MXFP8ConvertExpertsMethod

    folder = models[("mixtral", "cutlass")]
    prefix = "model.layers.0.block_sparse_moe.experts"
    stored = {k: v for k, v in load_file(str(folder / "model.safetensors")).items()
              if k.startswith(f"{prefix}.") and f"{prefix}.2.w3." not in k}
    vllm_rank(0, 1)
    cfg = _config(folder)
    layer = _RoutedExperts(0, 1)
    method = MXFP8ConvertExpertsMethod(cfg, "cutlass", prefix, layer)
    method.create_weights(layer, 4, 512, 256, torch.float32)
    _load_experts(layer, stored, prefix, 4)
    with pytest.raises(LayoutError, match=r"experts: w13_weight of expert 2 \(w3\) was not "
                                          r"loaded from the checkpoint \(1 parts missing\)"):
        method.process_weights_after_loading(layer)


FUSED = ("w13_weight", "w13_weight_scale_swizzled", "w2_weight", "w2_weight_scale_swizzled")


def _fused_layer(models, tp: int, rank: int):
    """Rank ``rank`` of ``tp``'s vLLM fused-MoE method for the fused trtllm Mixtral block, its
    (fake) layer, the block's stored tensors by parameter name, and the block's name."""
    from mxfp8_convert.engines.vllm import MXFP8ConvertFusedExpertsMethod

    folder = models[("mixtral", "trtllm")]
    prefix = "model.layers.0.block_sparse_moe.experts"
    stored = {k.removeprefix(f"{prefix}."): v
              for k, v in load_file(str(folder / "model.safetensors")).items()
              if k.startswith(f"{prefix}.")}
    assert sorted(stored) == sorted(FUSED)  # fused by the converter: no per-expert tensor
    cfg = _config(folder)
    layer = _RoutedExperts(rank, tp)
    method = MXFP8ConvertFusedExpertsMethod(cfg, cfg.engine_checkpoint().blocks[prefix], prefix,
                                            layer)
    method.create_weights(layer, 4, 512, 256 // tp, torch.float32)
    return method, layer, stored, prefix


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_fused_block_parameters_are_the_files_slices(models, vllm_rank, tp, rank):
    """A fused trtllm MoE block (docs/FORMAT.md section 3a) in vLLM's fused-MoE layer: each
    rank's parameters hold exactly the file's contiguous share (w13 rows ``[2r*I/tp, ...)``, w2
    K ``[r*I/tp, ...)``, their tiles), and that share is the fused layout (``layouts/moe.py``)
    of the rank's rows of the canonical per-expert tensors (the same source converted with
    ``--moe keep``), independent of the loader. The block's tensors go to the plug-in and
    anything else to vLLM's loader; ``process_weights_after_loading`` copies nothing and the
    rank's experts compute exactly what the runtime's fused reference computes on the canonical
    slices."""
    from mxfp8_convert.layouts import moe as lay
    from mxfp8_convert.runtime.moe import MXFP8MoEWeights, reference_fused_moe

    vllm_rank(rank, tp)
    method, layer, stored, prefix = _fused_layer(models, tp, rank)
    bias = torch.zeros(4, 512)
    got = list(layer.load_weights(iter([*stored.items(), ("w2_bias", bias)])))
    assert sorted(got) == sorted(FUSED) and layer.passed == ["w2_bias"]

    keep = load_file(str(models[("mixtral", "trtllm-moe-keep")] / "model.safetensors"))

    def c(leaf, suffix): return torch.stack([keep[f"{prefix}.{e}.{leaf}.{suffix}"]
                                             for e in range(4)])
    step = 256 // tp
    rows, cols = slice(rank * step, (rank + 1) * step), slice(rank * step // 32,
                                                              (rank + 1) * step // 32)
    up, gate, down = (c(leaf, "weight")[:, rows] if leaf != "w2" else
                      c(leaf, "weight")[:, :, rows] for leaf in ("w3", "w1", "w2"))
    up_s, gate_s = c("w3", "weight_scale_inv")[:, rows], c("w1", "weight_scale_inv")[:, rows]
    down_s = c("w2", "weight_scale_inv")[:, :, cols]
    up, gate, down, down_s = (t.contiguous() for t in (up, gate, down, down_s))
    want = {
        "w13_weight": lay.moe_fc1_weight_from_canonical(up, gate),
        "w13_weight_scale_swizzled": lay.moe_fc1_scale_from_canonical(up_s, gate_s),
        "w2_weight": lay.moe_fc2_weight_from_canonical(down),
        "w2_weight_scale_swizzled": lay.moe_fc2_scale_from_canonical(down_s),
    }
    two = slice(2 * rank * step, 2 * (rank + 1) * step)
    tiles13, tiles2 = slice(two.start // 128, two.stop // 128), slice(rows.start // 128,
                                                                      rows.stop // 128)
    file_share = {  # plain indexing of the stored tensors
        "w13_weight": stored["w13_weight"][:, two],
        "w13_weight_scale_swizzled": stored["w13_weight_scale_swizzled"][:, tiles13],
        "w2_weight": stored["w2_weight"][:, :, rows],
        "w2_weight_scale_swizzled": stored["w2_weight_scale_swizzled"][:, :, tiles2],
    }
    for name in FUSED:
        param = getattr(layer, name).data.view(torch.uint8)
        assert torch.equal(param, file_share[name].view(torch.uint8)), name
        assert torch.equal(param, want[name].view(torch.uint8)), name
    ptrs = [getattr(layer, n).data_ptr() for n in FUSED]
    method.process_weights_after_loading(layer)
    ex = method.experts
    assert ex.kind == "fused" and ex.engine == "reference" and ex.intermediate == step
    assert [t.data_ptr() for t in (ex.w13, ex.w13_scale, ex.w2, ex.w2_scale)] == ptrs
    assert [getattr(layer, n).data_ptr() for n in FUSED] == ptrs
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 512, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=gen)
    f8 = torch.float8_e4m3fn
    oracle = MXFP8MoEWeights.from_canonical((up.view(f8), up_s), (gate.view(f8), gate_s),
                                            (down.view(f8), down_s))
    assert torch.equal(method.run_experts(x, weights, ids),
                       reference_fused_moe(x, ids, weights, oracle).to(x.dtype))


def test_a_fused_tensor_not_loaded_is_refused(models, vllm_rank):
    """A fused block's stored tensor missing: one line naming the block and the parameter."""
    vllm_rank(0, 1)
    method, layer, stored, prefix = _fused_layer(models, 1, 0)
    list(layer.load_weights(iter([(k, v) for k, v in stored.items() if k != "w2_weight"])))
    with pytest.raises(LayoutError, match=r"^model.layers.0.block_sparse_moe.experts: w2_weight "
                                          r"was not loaded from the checkpoint$"):
        method.process_weights_after_loading(layer)
