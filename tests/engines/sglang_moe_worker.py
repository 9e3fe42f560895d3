"""One tensor-parallel rank of SGLang's real MoE blocks, loading a converted MoE checkpoint.

Run by ``test_sglang_moe.py`` as
``python -m tests.engines.sglang_moe_worker TP EP RANK PORT OUT CKPT...`` in the sglang venv, one
process per rank, over gloo (parallel state as in ``sglang_worker.py``). For each checkpoint:
SGLang's ``ModelConfig`` and ``get_quant_config`` pick the plug-in from the marker; every layer's
MoE block of the model's own SGLang class (``MixtralMoE``, ``Qwen2MoeSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock``: router, ``TopK``, ``FusedMoE`` with the plug-in's experts method, and
Qwen2-MoE's shared expert) is built under its checkpoint name and loaded by the model's own
``load_weights`` (``FusedMoE.make_expert_params_mapping``'s shard ids and expert ids) from
SGLang's safetensors iterator, then ``process_weights_after_loading`` is called as SGLang's
loader calls it, and the block is run on fixed tokens: the router and ``TopK`` are SGLang's, the
experts ours; the output is this rank's partial sum (SGLang's decoder layer reduces the ranks).
What each rank holds and computes is saved to ``OUT/rank{RANK}-{i}.pt``; a checkpoint the plug-in
refuses saves the one-line error instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from tests.engines.sglang_worker import init_parallel, model_setup

SEED = 4321
TOKENS = 6


def _blocks(cfg, quant_config, arch: str):
    """``(attribute, [block per layer], the model class whose load_weights loads them)``."""
    if arch == "MixtralForCausalLM":
        from sglang.srt.models.mixtral import MixtralForCausalLM, MixtralMoE

        return "block_sparse_moe", [
            MixtralMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                       cfg.intermediate_size, layer_id=i, params_dtype=torch.bfloat16,
                       quant_config=quant_config, prefix=f"model.layers.{i}.block_sparse_moe")
            for i in range(cfg.num_hidden_layers)], MixtralForCausalLM
    if arch == "Qwen2MoeForCausalLM":
        from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeSparseMoeBlock

        return "mlp", [Qwen2MoeSparseMoeBlock(i, cfg, quant_config, prefix=f"model.layers.{i}.mlp")
                       for i in range(cfg.num_hidden_layers)], Qwen2MoeForCausalLM
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock

    return "mlp", [Qwen3MoeSparseMoeBlock(i, cfg, quant_config, prefix=f"model.layers.{i}.mlp")
                   for i in range(cfg.num_hidden_layers)], Qwen3MoeForCausalLM


class Holder(nn.Module):
    """A MoE model's MoE blocks under their checkpoint names (no attention, no embeddings)."""

    def __init__(self, cfg, quant_config):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        self.attr, blocks, self.model_class = _blocks(cfg, quant_config, cfg.architectures[0])
        for block in blocks:
            layer = nn.Module()
            setattr(layer, self.attr, block)
            self.model.layers.append(layer)


def build_and_load(ckpt: Path):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    model_config, quant_config, holder, files = model_setup(ckpt, Holder)
    mine = f".{holder.attr}."
    weights = ((n, t) for n, t in safetensors_weights_iterator(files)
               if n.startswith("model.layers.") and mine in n)
    holder.model_class.load_weights(holder, weights)
    return model_config.quantization, quant_config, holder


def _experts_record(experts) -> dict:
    """The rank's expert parameters as loaded, then wrapped (``process_weights_after_loading``)."""
    method = experts.quant_method
    params = dict(experts.named_parameters())
    before = {n: p.data_ptr() for n, p in params.items()}
    saved = {n: p.data.view(torch.uint8).clone() for n, p in params.items()}
    method.process_weights_after_loading(experts)
    ex = method.experts
    sfx = experts.mxfp8_scale_suffix
    w13, s13 = experts.w13_weight, getattr(experts, f"w13_{sfx}")
    w2 = experts.w2_weight
    inter = w13.shape[1] // 2
    views = {  # the runtime's buffers are views of the loaded parameters
        "gate": ex.e0_gate_data.data_ptr() == w13.data_ptr(),
        "up": ex.e0_up_data.data_ptr() == w13.data_ptr() + inter * w13.shape[2],
        "down": ex.e1_down_data.data_ptr() == w2.data_ptr() + w2[0].numel(),
        "scale": ex.e0_gate_scale.data_ptr() == s13.data_ptr(),
    }
    return {"method": type(method).__name__, "layout": method.layout, "engine": ex.engine,
            "params": saved, "same_storage": before == {n: p.data_ptr()
                                                        for n, p in experts.named_parameters()},
            "views": views, "tp": method.layer_tp(experts)}


def run_one(ckpt: Path) -> dict:
    try:
        quantization, quant_config, holder = build_and_load(ckpt)
    except Exception as e:  # the refusal the test expects for this checkpoint
        return {"error": f"{type(e).__name__}: {e}"}
    cfg = holder.config
    out: dict = {"quantization": quantization, "config": type(quant_config).__name__,
                 "attr": holder.attr, "layers": []}
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(TOKENS, cfg.hidden_size, generator=g).to(torch.bfloat16)
    for layer in holder.model.layers:
        block = getattr(layer, holder.attr)
        rec = _experts_record(block.experts)
        with torch.no_grad():
            logits = block.gate(x)[0]
            topk = block.topk(x, logits)
            rec["topk_ids"], rec["topk_weights"] = topk.topk_ids, topk.topk_weights
            rec["renormalize"] = block.topk.topk_config.renormalize
            rec["experts_out"] = block.experts(x, topk)
            if cfg.architectures[0] != "Qwen2MoeForCausalLM":  # its shared expert: GPU kernels
                rec["block_out"] = block(x)
            rec.update(other_topk_formats(block, x, logits))
        rec["x"] = x
        out["layers"].append(rec)
    out["unsupported"] = unsupported_layer_error(quant_config, cfg, holder)
    return out


def other_topk_formats(block, x: torch.Tensor, logits: torch.Tensor) -> dict:
    """The experts method's ``apply`` given a lazy (bypassed) top-k, as a model that asks for
    one by name passes it, and a top-k format it does not take (refused in one line)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import BypassedTopKOutput, TopKOutputFormat

    experts = block.experts
    lazy = BypassedTopKOutput(x, logits, block.topk.topk_config)
    out = {"bypassed_out": experts.quant_method.apply(
        experts, StandardDispatchOutput(x, None, lazy)).hidden_states}
    other = SimpleNamespace(format=TopKOutputFormat.TRITON_KERNEL)
    try:
        experts.quant_method.apply(experts, StandardDispatchOutput(x, None, other))
        out["triton_format_error"] = ""
    except Exception as e:
        out["triton_format_error"] = f"{type(e).__name__}: {e}"
    return out


def unsupported_layer_error(quant_config, cfg, holder) -> str:
    """A ``FusedMoE`` of the same experts asking for another activation: refused in one line."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    prefix = f"model.layers.0.{holder.attr}.experts"
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    try:
        FusedMoE(experts, cfg.hidden_size, inter, layer_id=0, top_k=cfg.num_experts_per_tok,
                 params_dtype=torch.bfloat16, quant_config=quant_config, prefix=prefix,
                 activation="gelu")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def main(argv: list[str]) -> None:
    tp, ep, rank, port, out_dir, *ckpts = argv
    tp, ep, rank = int(tp), int(ep), int(rank)
    init_parallel(tp, rank, int(port), ep=ep)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    for i, ckpt in enumerate(ckpts):
        torch.save(run_one(Path(ckpt)), Path(out_dir) / f"rank{rank}-{i}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
