"""Small checkpoints of real model families: the config keys and tensor names of their Hub
checkpoints (transformers' model docs and configs), with small shapes.

:data:`CONFIGS` holds each family's config keys; :func:`decoder` builds the tensors the decoder
families here name alike (embeddings, final norm, ``lm_head``, per layer the two norms, the
attention projections and dense MLPs), parametrised by where the family puts them; each
family's builder adds what only it has. A builder returns the tensors (or ``(tensors, side
file)`` for a quantized one); ``write`` lays them out as a model folder, with any quantization
side file (``hf_quant_config.json``, ``quant_config.json``).
"""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from mxfp8_convert.synth import random_e4m3

BF16 = torch.bfloat16


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, g: torch.Generator, dtype=BF16) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def write(
    path: Path, config: dict, tensors: dict[str, torch.Tensor], files: dict | None = None
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, obj in (files or {}).items():
        (path / name).write_text(json.dumps(obj, indent=2))
    return path


# --- Config keys, per family (small values) ----------------------------------------------------

#: keys every decoder family here sets alike
_DECODER = {"tie_word_embeddings": False, "torch_dtype": "bfloat16"}

CONFIGS: dict[str, dict] = {
    "llama": {  # LlamaForCausalLM
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 500000.0,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, **_DECODER,
    },
    "gpt_oss": {  # GptOssForCausalLM
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 256,
        "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
        "sliding_window": 128, "layer_types": ["sliding_attention"], "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0, "rope_theta": 150000, **_DECODER,
    },
    "llama4": {  # Llama4ForCausalLM (text)
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
        "hidden_size": 128, "intermediate_size": 128, "intermediate_size_mlp": 256,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "vocab_size": 256, "num_local_experts": 2, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "use_qk_norm": True, **_DECODER,
    },
    "qwen2_vl": {  # Qwen2VLForConditionalGeneration
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
        "num_hidden_layers": 1, "num_key_value_heads": 2, "vocab_size": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        "max_position_embeddings": 32768, "vision_start_token_id": 151652,
        "image_token_id": 151655, "video_token_id": 151656, **_DECODER,
        "vision_config": {
            "depth": 1, "embed_dim": 128, "mlp_ratio": 4, "num_heads": 2, "in_chans": 3,
            "hidden_size": 128, "patch_size": 14, "spatial_merge_size": 2,
            "spatial_patch_size": 14, "temporal_patch_size": 2,
        },
    },
    "qwen2_moe": {  # Qwen2MoeForCausalLM
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256, "num_experts": 2, "num_experts_per_tok": 1,
        "decoder_sparse_step": 1, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": 256, "norm_topk_prob": False,
        "rms_norm_eps": 1e-6, **_DECODER,
    },
    "bert": {  # BertForMaskedLM (an encoder: its own tensor names, bert_fp32)
        "architectures": ["BertForMaskedLM"], "model_type": "bert",
        "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 1,
        "num_attention_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
        "torch_dtype": "float32",
    },
}


def config(family: str, **keys) -> dict:
    """A fresh copy of family ``family``'s config, ``keys`` (real config keys) replaced."""
    return {**copy.deepcopy(CONFIGS[family]), **keys}


llama_config = partial(config, "llama")
gpt_oss_config = partial(config, "gpt_oss")
llama4_config = partial(config, "llama4")
qwen2_vl_config = partial(config, "qwen2_vl")
qwen2_moe_config = partial(config, "qwen2_moe")
bert_config = partial(config, "bert")


# --- The decoder tensors the families name alike -----------------------------------------------

QKV = ("q_proj", "k_proj", "v_proj")


def decoder_linears(
    cfg: dict, *, lm: str = "model", mlps: dict[str, int] | None = None
) -> dict[str, tuple[int, int]]:
    """``{module: (N, K)}`` of every layer's attention projections and dense MLPs.

    ``lm``: the language model's prefix; ``mlps``: ``{path in the layer: intermediate size}``
    of its dense MLPs (default ``{"mlp": intermediate_size}``; ``{}`` for none).
    """
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // heads)
    mlps = {"mlp": cfg["intermediate_size"]} if mlps is None else mlps
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"{lm}.layers.{layer}"
        out |= {
            f"{p}.self_attn.q_proj": (heads * hd, h),
            f"{p}.self_attn.k_proj": (kv * hd, h),
            f"{p}.self_attn.v_proj": (kv * hd, h),
            f"{p}.self_attn.o_proj": (h, heads * hd),
        }
        for mlp, i in mlps.items():
            out |= {f"{p}.{mlp}.gate_proj": (i, h), f"{p}.{mlp}.up_proj": (i, h),
                    f"{p}.{mlp}.down_proj": (h, i)}
    return out


def decoder(
    cfg: dict,
    g: torch.Generator,
    *,
    lm: str = "model",
    bias: tuple[str, ...] = (),
    mlps: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """BF16 embeddings, final norm, ``lm_head`` and, per layer, the two norms and the linears of
    :func:`decoder_linears` (``bias``: the attention projections that have one)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    t = {
        f"{lm}.embed_tokens.weight": randn((v, h), g),
        f"{lm}.norm.weight": torch.ones(h, dtype=BF16),
        "lm_head.weight": randn((v, h), g),
    }
    for layer in range(cfg["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{lm}.layers.{layer}.{norm}.weight"] = torch.ones(h, dtype=BF16)
    for m, shape in decoder_linears(cfg, lm=lm, mlps=mlps).items():
        t[f"{m}.weight"] = randn(shape, g)
        if m.rpartition(".")[2] in bias:
            t[f"{m}.bias"] = randn((shape[0],), g)
    return t


# --- Llama (LlamaForCausalLM) and its quantized checkpoints ------------------------------------


def llama_linears(cfg: dict) -> dict[str, tuple[int, int]]:
    return decoder_linears(cfg)


def llama_dense(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    return decoder(cfg, gen(seed))


def modelopt_fp8(cfg: dict, *, kv_cache: bool = True, seed: int = 0) -> tuple[dict, dict]:
    """ModelOpt FP8 (``export_hf_checkpoint``): e4m3 weights, F32 per-tensor ``weight_scale``
    and static ``input_scale``, ``k_proj.k_scale`` / ``v_proj.v_scale`` for the FP8 KV cache;
    the scheme only in hf_quant_config.json."""
    g = gen(seed)
    t = llama_dense(cfg, seed)
    for m, shape in llama_linears(cfg).items():
        t[f"{m}.weight"] = random_e4m3(shape, g)
        t[f"{m}.weight_scale"] = torch.tensor(2.0**-8, dtype=torch.float32)
        t[f"{m}.input_scale"] = torch.tensor(0.0173, dtype=torch.float32)
        if kv_cache and m.endswith(("k_proj", "v_proj")):
            t[f"{m}.{m[-6]}_scale"] = torch.tensor(0.0625, dtype=torch.float32)
    hfq = {
        "producer": {"name": "modelopt", "version": "0.23.0"},
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8" if kv_cache else None,
            "exclude_modules": ["lm_head"],
        },
    }
    return t, hfq


def modelopt_nvfp4(cfg: dict, seed: int = 0) -> tuple[dict, dict]:
    """ModelOpt NVFP4: packed e2m1 pairs in U8 ``[N, K/2]``, e4m3 group-16 ``weight_scale``,
    F32 ``weight_scale_2`` and ``input_scale``; declared only in hf_quant_config.json."""
    g = gen(seed)
    t = llama_dense(cfg, seed)
    for m, (n, k) in llama_linears(cfg).items():
        t[f"{m}.weight"] = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        t[f"{m}.weight_scale"] = random_e4m3((n, k // 16), g)
        t[f"{m}.weight_scale_2"] = torch.tensor(1e-3, dtype=torch.float32)
        t[f"{m}.input_scale"] = torch.tensor(1e-2, dtype=torch.float32)
    hfq = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ["lm_head"],
        },
    }
    return t, hfq


def autoawq(cfg: dict, seed: int = 0) -> tuple[dict, dict]:
    """AutoAWQ GEMM: int32 ``qweight [K, N/8]``, ``qzeros [K/128, N/8]``, fp16 ``scales``;
    declared in quant_config.json (no quantization_config in config.json)."""
    g = gen(seed)
    t = llama_dense(cfg, seed)
    for m, (n, k) in llama_linears(cfg).items():
        del t[f"{m}.weight"]
        t[f"{m}.qweight"] = torch.randint(0, 2**30, (k, n // 8), generator=g, dtype=torch.int32)
        t[f"{m}.qzeros"] = torch.randint(
            0, 2**30, (k // 128, n // 8), generator=g, dtype=torch.int32
        )
        t[f"{m}.scales"] = randn((k // 128, n), g, torch.float16)
    return t, {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}


# --- gpt-oss (GptOssForCausalLM) ---------------------------------------------------------------


def _gpt_oss_common(cfg: dict, g) -> dict[str, torch.Tensor]:
    """Attention with biases on all four projections and sinks, a router with a bias; no dense
    MLP (the experts are stacked, per builder below)."""
    h, e = cfg["hidden_size"], cfg["num_local_experts"]
    t = decoder(cfg, g, bias=(*QKV, "o_proj"), mlps={})
    p = "model.layers.0"
    t |= {
        f"{p}.self_attn.sinks": randn((cfg["num_attention_heads"],), g),
        f"{p}.mlp.router.weight": randn((e, h), g),
        f"{p}.mlp.router.bias": randn((e,), g),
    }
    return t


def gpt_oss_bf16(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """The BF16 release layout: stacked ``experts.gate_up_proj [E, H, 2I]`` (gate and up
    interleaved along the last axis) and ``experts.down_proj [E, I, H]``, with biases."""
    g = gen(seed)
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    t = _gpt_oss_common(cfg, g)
    p = "model.layers.0.mlp.experts"
    t |= {
        f"{p}.gate_up_proj": randn((e, h, 2 * i), g),
        f"{p}.gate_up_proj_bias": randn((e, 2 * i), g),
        f"{p}.down_proj": randn((e, i, h), g),
        f"{p}.down_proj_bias": randn((e, h), g),
    }
    return t


def gpt_oss_mxfp4(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """The MXFP4 release: ``*_blocks`` U8 ``[E, N, K/32, 16]``, ``*_scales`` U8 ``[E, N, K/32]``."""
    g = gen(seed)
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    t = _gpt_oss_common(cfg, g)
    p = "model.layers.0.mlp.experts"
    for proj, (n, k) in {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}.items():
        t[f"{p}.{proj}_blocks"] = torch.randint(
            0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8
        )
        t[f"{p}.{proj}_scales"] = torch.randint(
            118, 128, (e, n, k // 32), generator=g, dtype=torch.uint8
        )
        t[f"{p}.{proj}_bias"] = randn((e, n), g)
    return t


GPT_OSS_MXFP4_QC = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


# --- Llama-4 text (Llama4ForCausalLM) ----------------------------------------------------------


def llama4_bf16(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """``feed_forward.experts.gate_up_proj [E, H, 2I]`` (gate the first half of the last axis),
    ``down_proj [E, I, H]``, a bf16 ``router`` and a dense ``shared_expert``."""
    g = gen(seed)
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    t = decoder(cfg, g, mlps={"feed_forward.shared_expert": i})
    p = "model.layers.0.feed_forward"
    t |= {
        f"{p}.router.weight": randn((e, h), g),
        f"{p}.experts.gate_up_proj": randn((e, h, 2 * i), g),
        f"{p}.experts.down_proj": randn((e, i, h), g),
    }
    return t


# --- Qwen2-VL (Qwen2VLForConditionalGeneration) ------------------------------------------------


def qwen2_vl_bf16(cfg: dict, *, new_names: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hub names ``visual.*`` and ``model.layers.*`` (``new_names``: transformers >= 4.52's
    ``model.visual.*`` and ``model.language_model.*``)."""
    g = gen(seed)
    h = cfg["hidden_size"]
    vc = cfg["vision_config"]
    e = vc["embed_dim"]
    m = e * vc["spatial_merge_size"] ** 2
    vis, lm = ("model.visual", "model.language_model") if new_names else ("visual", "model")
    t = decoder(cfg, g, lm=lm, bias=QKV)
    t |= {
        f"{vis}.patch_embed.proj.weight": randn((e, 3, 2, 14, 14), g),
        f"{vis}.merger.ln_q.weight": torch.ones(e, dtype=BF16),
        f"{vis}.merger.ln_q.bias": torch.zeros(e, dtype=BF16),
        f"{vis}.merger.mlp.0.weight": randn((m, m), g),
        f"{vis}.merger.mlp.0.bias": randn((m,), g),
        f"{vis}.merger.mlp.2.weight": randn((h, m), g),
        f"{vis}.merger.mlp.2.bias": randn((h,), g),
    }
    b = f"{vis}.blocks.0"
    for lin, shape in {"attn.qkv": (3 * e, e), "attn.proj": (e, e), "mlp.fc1": (4 * e, e),
                       "mlp.fc2": (e, 4 * e)}.items():
        t[f"{b}.{lin}.weight"] = randn(shape, g)
        t[f"{b}.{lin}.bias"] = randn((shape[0],), g)
    for norm in ("norm1", "norm2"):
        t[f"{b}.{norm}.weight"] = torch.ones(e, dtype=BF16)
        t[f"{b}.{norm}.bias"] = torch.zeros(e, dtype=BF16)
    return t


QWEN2_VL_LM = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


# --- BERT (BertForMaskedLM) and Qwen2-MoE (Qwen2MoeForCausalLM) --------------------------------


def bert_fp32(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = gen(seed)
    h, v, f32 = cfg["hidden_size"], cfg["vocab_size"], torch.float32
    t = {
        "bert.embeddings.word_embeddings.weight": randn((v, h), g, f32),
        "bert.embeddings.position_embeddings.weight": randn((512, h), g, f32),
        "bert.embeddings.token_type_embeddings.weight": randn((2, h), g, f32),
        "bert.embeddings.LayerNorm.weight": torch.ones(h),
        "bert.embeddings.LayerNorm.bias": torch.zeros(h),
        "cls.predictions.bias": torch.zeros(v),
        "cls.predictions.transform.dense.weight": randn((h, h), g, f32),
        "cls.predictions.transform.dense.bias": torch.zeros(h),
        "cls.predictions.transform.LayerNorm.weight": torch.ones(h),
        "cls.predictions.transform.LayerNorm.bias": torch.zeros(h),
    }
    p = "bert.encoder.layer.0"
    for m, shape in {
        "attention.self.query": (h, h),
        "attention.self.key": (h, h),
        "attention.self.value": (h, h),
        "attention.output.dense": (h, h),
        "intermediate.dense": (4 * h, h),
        "output.dense": (h, 4 * h),
    }.items():
        t[f"{p}.{m}.weight"] = randn(shape, g, f32)
        t[f"{p}.{m}.bias"] = torch.zeros(shape[0])
    for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
        t[f"{p}.{ln}.weight"] = torch.ones(h)
        t[f"{p}.{ln}.bias"] = torch.zeros(h)
    return t


BERT_LINEARS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)


def qwen2_moe_bf16(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert ``mlp.experts.<e>.{gate,up,down}_proj``, router ``mlp.gate [E, H]``, a shared
    expert and its scalar gate ``mlp.shared_expert_gate [1, H]``."""
    g = gen(seed)
    h, e = cfg["hidden_size"], cfg["num_experts"]
    i, si = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    mlps = {**{f"mlp.experts.{j}": i for j in range(e)}, "mlp.shared_expert": si}
    t = decoder(cfg, g, bias=QKV, mlps=mlps)
    p = "model.layers.0"
    t[f"{p}.mlp.gate.weight"] = randn((e, h), g)
    t[f"{p}.mlp.shared_expert_gate.weight"] = randn((1, h), g)
    return t
