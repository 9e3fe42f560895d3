"""One tensor-parallel rank of SGLang's real linear layers, loading a converted checkpoint.

Run by ``test_sglang_plugin.py`` as
``python -m tests.engines.sglang_worker TP RANK PORT OUT CKPT...`` in the sglang venv, one
process per rank, over gloo. Parallel state is initialised the way SGLang's own layer tests do
(``sglang.test.layer_ut_utils.init_single_process_dist``, here with ``TP`` ranks); the plug-in
is found through its entry point (``load_plugins()``). For each checkpoint: SGLang's
``ModelConfig`` and ``get_quant_config`` pick the plug-in from the marker; every layer's
``QKVParallelLinear`` and ``RowParallelLinear`` o_proj and SGLang's ``LlamaMLP``
(``MergedColumnParallelLinear`` gate_up_proj + ``RowParallelLinear`` down_proj) are built with
it, with SGLang's ``RMSNorm`` norms, loaded by SGLang's own ``LlamaForCausalLM`` loader (its
``stacked_params_mapping`` shard ids) from SGLang's safetensors iterator, then run on fixed
inputs, each layer alone and as decoder layers whose attention is plain causal SDPA (no rotary:
SGLang's rotary embedding and ``RadixAttention`` need GPU kernels). What each rank holds and
computes is saved to ``OUT/rank{RANK}-{i}.pt``; the test compares it with our reference on the
same bytes. A checkpoint the plug-in refuses saves the one-line error instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

SEED = 1234
TOKENS = 5


def init_parallel(tp: int, rank: int, port: int, ep: int = 1) -> None:
    """SGLang's ``init_single_process_dist`` for ``tp`` ranks (``ep`` of them expert-parallel).
    No GPU: the groups get no NCCL, custom or symmetric-memory all-reduce (SGLang builds them
    only for GPUs), so they are plain gloo process groups."""
    import functools

    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.test.test_utils import publish_build_topology

    parallel_state.set_custom_all_reduce(False)
    parallel_state.init_model_parallel_group = functools.partial(
        parallel_state.init_model_parallel_group, use_pynccl=False)
    init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    publish_build_topology(world_rank=rank, tp_size=tp, ep_size=ep, pp_size=1)
    initialize_model_parallel(backend="gloo")


class Holder(nn.Module):
    """A Llama model's linear layers and norms under their checkpoint names (no attention)."""

    def __init__(self, cfg, quant_config):
        from sglang.srt.layers.layernorm import RMSNorm
        from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear
        from sglang.srt.models.llama import LlamaMLP

        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        hd = cfg.hidden_size // cfg.num_attention_heads
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            layer.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            layer.self_attn.qkv_proj = QKVParallelLinear(
                cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                bias=False, params_dtype=torch.bfloat16, quant_config=quant_config,
                prefix=f"{p}.self_attn.qkv_proj")
            layer.self_attn.o_proj = RowParallelLinear(
                cfg.num_attention_heads * hd, cfg.hidden_size, bias=False,
                params_dtype=torch.bfloat16, quant_config=quant_config,
                prefix=f"{p}.self_attn.o_proj")
            layer.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, "silu",
                                 quant_config=quant_config, prefix=f"{p}.mlp")
            self.model.layers.append(layer)


def model_setup(ckpt: Path, holder_class):
    """SGLang's model config and our quantization config of the folder, as SGLang's loader makes
    them; ``holder_class(hf_config, quant_config)`` built in bf16; the folder's shard files."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config

    model_config = ModelConfig(model_path=str(ckpt))
    quant_config = get_quant_config(model_config, LoadConfig(), {})
    torch.set_default_dtype(torch.bfloat16)
    holder = holder_class(model_config.hf_config, quant_config)
    return model_config, quant_config, holder, sorted(str(f) for f in ckpt.glob("*.safetensors"))


def build_and_load(ckpt: Path):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.llama import LlamaForCausalLM

    model_config, quant_config, holder, files = model_setup(ckpt, Holder)
    LlamaForCausalLM._legacy_load_weights(holder, safetensors_weights_iterator(files))
    return model_config.quantization, quant_config, holder


def decoder_layer(layer, h: torch.Tensor, cfg, tp: int) -> torch.Tensor:
    """Llama decoder layer on this rank's heads, causal SDPA in float32 as the runtime's tiny
    Llama (tests/runtime/tiny_llama.py) computes it; o_proj and down_proj all-reduce."""
    hd = cfg.hidden_size // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads // tp, max(cfg.num_key_value_heads // tp, 1)
    t = h.shape[0]
    qkv = layer.self_attn.qkv_proj(layer.input_layernorm(h))[0]
    parts = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
    q, k, v = (y.view(t, -1, hd).transpose(0, 1) for y in parts)
    k, v = k.repeat_interleave(nq // nkv, 0), v.repeat_interleave(nq // nkv, 0)
    y = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                         is_causal=True).to(h.dtype)
    h = h + layer.self_attn.o_proj(y.transpose(0, 1).reshape(t, nq * hd))[0]
    return h + layer.mlp(layer.post_attention_layernorm(h))


def run_one(ckpt: Path, tp: int, rank: int) -> dict:
    try:
        quantization, quant_config, holder = build_and_load(ckpt)
    except Exception as e:  # the refusal the test expects for this checkpoint
        return {"error": f"{type(e).__name__}: {e}"}
    out: dict = {"quantization": quantization, "config": type(quant_config).__name__, "layers": []}
    cfg = holder.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(TOKENS, cfg.hidden_size, generator=g).to(torch.bfloat16)
    x_o = torch.randn(TOKENS, cfg.num_attention_heads * hd, generator=g).to(torch.bfloat16)
    k_rank = cfg.num_attention_heads * hd // tp
    for layer in holder.model.layers:
        rec = {}
        linears = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
                   "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
        for name, lin in linears.items():
            scale = getattr(lin, lin.mxfp8_scale_name)
            before = (lin.weight.data_ptr(), scale.data_ptr())
            lin.quant_method.process_weights_after_loading(lin)
            w = lin.mxfp8_weight
            rec[name] = {
                "method": type(lin.quant_method).__name__, "engine": lin.mxfp8_engine,
                "layout": lin.quant_method.layout, "scale_name": lin.mxfp8_scale_name,
                "params": sorted(n for n, _ in lin.named_parameters()),
                "same_storage": before == (w.data.data_ptr(), w.scale.data_ptr())
                and before == (lin.weight.data_ptr(), scale.data_ptr()),
                "weight": lin.weight.data.view(torch.uint8).clone(),
                "scale": scale.data.clone(),
            }
        rec["x"], rec["x_o"] = x, x_o
        rec["qkv"] = layer.self_attn.qkv_proj(x)[0]
        o_proj = layer.self_attn.o_proj
        rec["o"] = o_proj(x_o[:, rank * k_rank:(rank + 1) * k_rank], skip_all_reduce=True)[0]
        rec["gate_up"] = layer.mlp.gate_up_proj(x)[0]
        rec["mlp"] = layer.mlp(x)
        out["layers"].append(rec)
    h = x
    for layer in holder.model.layers:
        h = decoder_layer(layer, h, cfg, tp)
    out["decoder"] = h
    return out


def main(argv: list[str]) -> None:
    tp, rank, port, out_dir, *ckpts = argv
    tp, rank = int(tp), int(rank)
    init_parallel(tp, rank, int(port))
    from sglang.srt.layers import linear
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import QUANTIZATION_CHOICES

    load_plugins()
    registered = {"methods": "mxfp8_convert" in QUANTIZATION_METHODS,
                  "choices": "mxfp8_convert" in QUANTIZATION_CHOICES,
                  "v2": "MXFP8ConvertLinearMethod" in linear.WEIGHT_LOADER_V2_SUPPORTED}
    for i, ckpt in enumerate(ckpts):
        result = run_one(Path(ckpt), tp, rank)
        result["registered"] = registered
        torch.save(result, Path(out_dir) / f"rank{rank}-{i}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
