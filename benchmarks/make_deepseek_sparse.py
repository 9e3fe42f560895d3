"""A DeepSeek-V3-sized checkpoint as sparse files: real headers, real scales, weights as holes.

DeepSeek-V3's tensor names and shapes (61 layers, the first 3 dense, 256 routed experts and a
shared expert per MoE layer, MLA attention, one MTP layer: 91,991 tensors, 45,808 of them FP8
weights), in 163 shards of about the Hub checkpoint's size. ``--format block_fp8`` writes FP8
weights with float32 128x128 block scales (``weight_scale_inv``, arbitrary values: requantized,
as the real checkpoint's are); ``--format mxfp8`` writes SGLang MXFP8 (UE8M0 ``[N, K/32]``
scales). Weight bytes read back as zeros (e4m3 +0), so the files cost no disk; ``--layers``
keeps a subset (embeddings, head and the first layers) for conversion benchmarks.

Usage: python benchmarks/make_deepseek_sparse.py DIR [--format block_fp8|mxfp8] [--layers N]
       [--scales real|holes] [--experts E]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _sparse import ITEMSIZE, write_index, write_sparse_safetensors  # noqa: E402

H, I_DENSE, I_MOE, EXPERTS, VOCAB = 7168, 18432, 2048, 256, 129280
LAYERS, DENSE_LAYERS, SHARDS = 61, 3, 163
ATTN = [("self_attn.q_a_proj", 1536, H), ("self_attn.q_b_proj", 24576, 1536),
        ("self_attn.kv_a_proj_with_mqa", 576, H), ("self_attn.kv_b_proj", 32768, 512),
        ("self_attn.o_proj", H, 16384)]
NORMS = [("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_a_layernorm", 1536),
         ("self_attn.kv_a_layernorm", 512)]


def _linear(p: str, n: int, k: int, fmt: str) -> list[tuple[str, str, tuple[int, ...]]]:
    if fmt == "block_fp8":
        scale = (f"{p}.weight_scale_inv", "F32", (-(-n // 128), -(-k // 128)))
    else:
        scale = (f"{p}.weight_scale_inv", "U8", (n, k // 32))
    return [(f"{p}.weight", "F8_E4M3", (n, k)), scale]


def layer_tensors(i: int, fmt: str,
                  experts: int = EXPERTS) -> list[tuple[str, str, tuple[int, ...]]]:
    p = f"model.layers.{i}"
    out = [(f"{p}.{name}.weight", "BF16", (d,)) for name, d in NORMS]
    for name, n, k in ATTN:
        out += _linear(f"{p}.{name}", n, k, fmt)
    if i < DENSE_LAYERS:
        return (
            out
            + _linear(f"{p}.mlp.gate_proj", I_DENSE, H, fmt)
            + _linear(f"{p}.mlp.up_proj", I_DENSE, H, fmt)
            + _linear(f"{p}.mlp.down_proj", H, I_DENSE, fmt)
        )
    out += [
        (f"{p}.mlp.gate.weight", "BF16", (experts, H)),
        (f"{p}.mlp.gate.e_score_correction_bias", "F32", (experts,)),
    ]
    for e in [*range(experts), "shared"]:
        q = f"{p}.mlp.shared_experts" if e == "shared" else f"{p}.mlp.experts.{e}"
        out += (
            _linear(f"{q}.gate_proj", I_MOE, H, fmt)
            + _linear(f"{q}.up_proj", I_MOE, H, fmt)
            + _linear(f"{q}.down_proj", H, I_MOE, fmt)
        )
    if i == LAYERS:  # the MTP layer
        out += [
            (f"{p}.embed_tokens.weight", "BF16", (VOCAB, H)),
            (f"{p}.enorm.weight", "BF16", (H,)),
            (f"{p}.hnorm.weight", "BF16", (H,)),
            (f"{p}.eh_proj.weight", "BF16", (H, 2 * H)),
            (f"{p}.shared_head.norm.weight", "BF16", (H,)),
            (f"{p}.shared_head.head.weight", "BF16", (VOCAB, H)),
        ]
    return out


def all_tensors(fmt: str, layers: int,
                experts: int = EXPERTS) -> list[tuple[str, str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", "BF16", (VOCAB, H))]
    for i in range(min(layers, LAYERS + 1)):
        out += layer_tensors(i, fmt, experts)
    return out + [("model.norm.weight", "BF16", (H,)), ("lm_head.weight", "BF16", (VOCAB, H))]


def _nbytes(t) -> int:
    n = ITEMSIZE[t[1]]
    for d in t[2]:
        n *= d
    return n


def config(fmt: str, layers: int, experts: int = EXPERTS) -> dict:
    q = (
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
        if fmt == "block_fp8"
        else {
            "quant_method": "mxfp8",
            "fmt": "e4m3",
            "weight_block_size": [1, 32],
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
        }
    )
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": H,
        "intermediate_size": I_DENSE,
        "moe_intermediate_size": I_MOE,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_hidden_layers": min(layers, LAYERS),
        "first_k_dense_replace": DENSE_LAYERS,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": VOCAB,
        "num_nextn_predict_layers": 1,
        "quantization_config": q,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--format", choices=["block_fp8", "mxfp8"], default="block_fp8")
    ap.add_argument(
        "--layers", type=int, default=LAYERS + 1, help="layers kept (default all 62, MTP included)"
    )
    ap.add_argument("--scales", choices=["real", "holes"], default="real")
    ap.add_argument("--experts", type=int, default=EXPERTS,
                    help=f"routed experts per MoE layer (default {EXPERTS}, fewer for quick runs)")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    tensors = all_tensors(args.format, args.layers, args.experts)
    total = sum(_nbytes(t) for t in tensors)
    shards = (
        SHARDS if args.layers > LAYERS else max(1, round(total / 4.3e9))
    )  # the Hub shards: ~4.3 GB
    rng = np.random.default_rng(0)

    def data(name: str, dtype: str, shape) -> bytes | None:
        if args.scales == "holes" or not name.endswith("weight_scale_inv"):
            return None
        if dtype == "F32":  # block scales near DeepSeek's (about 1e-4 .. 1e-3), not powers of two
            return rng.uniform(1e-4, 1e-3, size=shape).astype(np.float32).tobytes()
        return rng.integers(112, 128, size=shape, dtype=np.uint8).tobytes()  # UE8M0 codes

    weight_map, target, at, size = {}, total / shards, 0, 0
    groups: list[list] = [[] for _ in range(shards)]
    for t in tensors:  # in order, each shard about total / shards
        groups[min(shards - 1, int((at + _nbytes(t) / 2) // target))].append(t)
        at += _nbytes(t)
    groups = [g for g in groups if g]
    for j, g in enumerate(groups):
        fn = f"model-{j + 1:05d}-of-{len(groups):06d}.safetensors"
        size += write_sparse_safetensors(root / fn, g, data)
        weight_map.update({name: fn for name, _, _ in g})
    write_index(root, weight_map, total)
    cfg = config(args.format, args.layers, args.experts)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    fp8 = sum(1 for t in tensors if t[1] == "F8_E4M3")
    print(
        f"{root}: {len(tensors)} tensors ({fp8} FP8 weights), {len(groups)} shards, "
        f"{total / 1e9:.1f} GB of tensors"
    )


if __name__ == "__main__":
    main()
