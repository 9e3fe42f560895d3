"""Deterministic synthetic checkpoints in every source dialect, for the demo, tests and benchmarks.

Llama/Qwen-style tensor names, configs with the exact keys of docs/LAYOUTS.md section 4, a bf16
``lm_head`` listed as ignored, tokenizer-like side files, and at least one module whose weight
and scale sit in different shards. The bytes are random but valid: no NaN e4m3 codes, scale
codes in a realistic range. With ``experts > 0`` every layer's MLP is a Qwen3-MoE-style block
(``mlp.experts.<e>.{gate,up,down}_proj`` or Mixtral's ``w1/w3/w2``, a bf16 router
``mlp.gate``, optionally DeepSeek's ``mlp.shared_experts``), its experts spread over shards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

MXFP8_DIALECTS = ("sglang_mxfp8", "compressed_tensors_mxfp8", "modelopt_mxfp8")
FP8_DIALECTS = ("block_fp8", "compressed_tensors_block_fp8", "fp8", "compressed_tensors_fp8")
ALL_DIALECTS = (*MXFP8_DIALECTS, *FP8_DIALECTS, "dense")


@dataclass(frozen=True, slots=True)
class SynthSpec:
    layers: int = 2
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    shards: int = 2
    dialect: str = "sglang_mxfp8"
    scale_dtype: torch.dtype = torch.uint8  # or torch.float8_e8m0fnu
    seed: int = 0
    #: FP8 dialects: power-of-two scales (lossless) or arbitrary ones (requantized)
    pow2_scales: bool = True
    #: fp8 dialects: per-channel [N, 1] scales instead of one per tensor
    per_channel: bool = False
    #: more linears, e.g. DeepSeek MLA shapes: (module, N, K)
    extra_modules: tuple[tuple[str, int, int], ...] = ()
    #: MoE: experts per layer (0: dense MLP), their intermediate size I, a shared expert
    #: (``mlp.shared_experts``, intermediate ``intermediate``), Mixtral's w1/w3/w2 names
    experts: int = 0
    moe_intermediate: int = 256
    shared_expert: bool = False
    w123_names: bool = False


def random_e4m3(shape, gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 bytes, NaN codes (0x7F, 0xFF) excluded."""
    b = torch.randint(0, 254, shape, generator=gen, dtype=torch.int16)
    b = b + (b >= 0x7F).to(torch.int16)  # skip 0x7F; 0xFF is never drawn
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def random_scales(shape, gen: torch.Generator, dtype=torch.uint8) -> torch.Tensor:
    s = torch.randint(112, 128, shape, generator=gen, dtype=torch.int16).to(torch.uint8)
    return s if dtype == torch.uint8 else s.view(dtype)


def fp8_scales(shape, gen: torch.Generator, *, pow2: bool) -> torch.Tensor:
    """float32 multipliers: powers of two (2^-10..2^-6), or arbitrary values in the same range."""
    e = torch.randint(-10, -6, shape, generator=gen).to(torch.float32)
    if pow2:
        return torch.exp2(e)
    return torch.exp2(e) * (1 + torch.rand(shape, generator=gen))


def linear_names(spec: SynthSpec) -> list[tuple[str, int, int]]:
    """(module, N, K) of every quantized linear, in layer order."""
    h, i = spec.hidden, spec.intermediate
    hd = h // spec.heads
    out = []
    for layer in range(spec.layers):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.self_attn.q_proj", spec.heads * hd, h),
            (f"{p}.self_attn.k_proj", spec.kv_heads * hd, h),
            (f"{p}.self_attn.v_proj", spec.kv_heads * hd, h),
            (f"{p}.self_attn.o_proj", h, spec.heads * hd),
        ]
        out += _mlp(f"{p}.mlp", h, i) if not spec.experts else _moe(spec, f"{p}.mlp")
    return out + list(spec.extra_modules)


def expert_names(spec: SynthSpec) -> tuple[str, str, str]:
    """(gate, up, down) projection names of one expert."""
    return ("w1", "w3", "w2") if spec.w123_names else ("gate_proj", "up_proj", "down_proj")


def _mlp(
    p: str, h: int, i: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> list:
    gate, up, down = names
    return [(f"{p}.{gate}", i, h), (f"{p}.{up}", i, h), (f"{p}.{down}", h, i)]


def _moe(spec: SynthSpec, p: str) -> list[tuple[str, int, int]]:
    out = _mlp(f"{p}.shared_experts", spec.hidden, spec.intermediate) if spec.shared_expert else []
    for e in range(spec.experts):
        out += _mlp(f"{p}.experts.{e}", spec.hidden, spec.moe_intermediate, expert_names(spec))
    return out


def scale_suffix(dialect: str) -> str | None:
    if dialect == "dense":
        return None
    return "weight_scale_inv" if dialect in ("sglang_mxfp8", "block_fp8") else "weight_scale"


def quantization_config(dialect: str) -> tuple[dict | None, dict | None]:
    """(config.json quantization_config, hf_quant_config.json) of a dialect (docs/LAYOUTS.md
    section 4)."""
    if dialect == "sglang_mxfp8":
        return {"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32],
                "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                "ignored_layers": ["lm_head"]}, None
    if dialect == "compressed_tensors_mxfp8":
        return {"quant_method": "compressed-tensors", "format": "mxfp8-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": False, "scale_dtype": "uint8"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                          "group_size": 32, "dynamic": True}}},
                "ignore": ["lm_head"]}, None
    if dialect == "modelopt_mxfp8":
        return ({"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["lm_head"]},
                {"producer": {"name": "modelopt", "version": "0.37.0"},
                 "quantization": {"quant_algo": "MXFP8", "group_size": 32,
                                  "exclude_modules": ["lm_head"]}})
    if dialect == "block_fp8":  # DeepSeek-V3 style
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}, None
    if dialect in ("compressed_tensors_block_fp8", "compressed_tensors_fp8"):
        strategy = "block" if dialect.endswith("block_fp8") else "channel"
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                   "dynamic": False}
        if strategy == "block":
            weights["block_structure"] = [128, 128]
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                "ignore": ["lm_head"]}, None
    if dialect == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static",
                "ignored_layers": ["lm_head"]}, None
    if dialect == "dense":
        return None, None
    raise ValueError(f"unknown dialect {dialect!r}")


def model_config(spec: SynthSpec) -> dict:
    q, _ = quantization_config(spec.dialect)
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "num_experts": spec.experts, "num_experts_per_tok": min(2, spec.experts),
           "moe_intermediate_size": spec.moe_intermediate,
           "shared_expert_intermediate_size": spec.intermediate if spec.shared_expert else 0}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": spec.hidden, "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "vocab_size": spec.vocab,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        **(moe if spec.experts else {}),
        **({"quantization_config": q} if q else {}),
    }


def make_tensors(spec: SynthSpec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    suffix = scale_suffix(spec.dialect)
    embed = torch.randn(spec.vocab, spec.hidden, generator=gen).to(torch.bfloat16)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for layer in range(spec.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{layer}.{norm}.weight"] = torch.ones(spec.hidden, dtype=torch.bfloat16)
        if spec.experts:  # the router: bf16, passed through
            t[f"model.layers.{layer}.mlp.gate.weight"] = (
                torch.randn(spec.experts, spec.hidden, generator=gen) * 0.02).to(torch.bfloat16)
    for module, n, k in linear_names(spec):
        if spec.dialect == "dense":
            t[f"{module}.weight"] = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
            continue
        t[f"{module}.weight"] = random_e4m3((n, k), gen)
        if spec.dialect in MXFP8_DIALECTS:
            t[f"{module}.{suffix}"] = random_scales((n, k // 32), gen, spec.scale_dtype)
            continue
        if "block" in spec.dialect:
            shape = (-(-n // 128), -(-k // 128))
        elif spec.per_channel or spec.dialect == "compressed_tensors_fp8":
            shape = (n, 1)
        else:
            shape = ()
        t[f"{module}.{suffix}"] = fp8_scales(shape, gen, pow2=spec.pow2_scales)
        if spec.dialect in ("fp8", "compressed_tensors_fp8"):
            t[f"{module}.input_scale"] = torch.tensor(0.0125, dtype=torch.float32)
    t["model.norm.weight"] = torch.ones(spec.hidden, dtype=torch.bfloat16)
    head = torch.randn(spec.vocab, spec.hidden, generator=gen) * 0.02
    t["lm_head.weight"] = head.to(torch.bfloat16)
    return t


def shard_of(name: str, spec: SynthSpec) -> int:
    """Layers are spread over shards; layer 0's o_proj scale is put in the last shard on purpose.

    Experts are spread over shards by (layer, expert), so one layer's experts span shards, and
    layer 0's expert 1 has its up_proj and its down_proj scale in the last shard, away from its
    gate_proj.
    """
    if spec.shards == 1:
        return 0
    if name.startswith("model.layers.0.self_attn.o_proj.weight_scale"):
        return spec.shards - 1
    _, up, down = expert_names(spec)
    expert1 = "model.layers.0.mlp.experts.1"
    if name.startswith((f"{expert1}.{up}.", f"{expert1}.{down}.weight_")):
        return spec.shards - 1
    if ".mlp.experts." in name:
        layer, expert = int(name.split(".")[2]), int(name.split(".")[5])
        return (layer * spec.experts + expert) * spec.shards // (spec.layers * spec.experts)
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return min(layer * spec.shards // max(spec.layers, 1), spec.shards - 1)
    return 0 if name.startswith("model.embed") else spec.shards - 1


def write_checkpoint(path: str | Path, spec: SynthSpec = SynthSpec()) -> Path:
    """Write the synthetic checkpoint of ``spec`` into folder ``path`` (created)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = make_tensors(spec)
    _, hfq = quantization_config(spec.dialect)
    _write_shards(path, tensors, spec)
    (path / "config.json").write_text(json.dumps(model_config(spec), indent=2))
    if hfq is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hfq, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tokenizer_config = {"model_max_length": 4096, "chat_template": "{{ messages }}"}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": {}}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "README.md").write_text(
        "# synthetic model\n\nMade by mxfp8_convert.synth for tests and demos.\n"
    )
    (path / "LICENSE").write_text("Apache-2.0\n")
    return path


def _write_shards(path: Path, tensors: dict[str, torch.Tensor], spec: SynthSpec) -> None:
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.shards)]
    for name, t in tensors.items():
        groups[shard_of(name, spec)][name] = t.contiguous()
    if spec.shards == 1:
        save_file(groups[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    total = 0
    for i, g in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{spec.shards:05d}.safetensors"
        save_file(g, str(path / fn), metadata={"format": "pt"})
        for name, t in g.items():
            weight_map[name] = fn
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
