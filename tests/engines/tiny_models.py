"""Tiny decoders from real transformers configs, random BF16 weights, a tokenizer trained here.

Nothing comes from the Hub: the tokenizer is a byte-level BPE trained with ``tokenizers`` on a
few paragraphs written below. Shapes are the smallest that keep every projection a trtllm module
at TP=1 and TP=2 (rows and K multiples of 128 per rank, K of 256 for trtllm), with 128-wide heads:

- ``llama``: GQA, 4 query heads, 1 KV head (replicated on both ranks at TP=2);
- ``qwen2``: q/k/v biases, 4 query heads, 2 KV heads (one per rank at TP=2);
- ``llama_tp1``: as ``llama`` with an MLP of 1152 (9 tiles): slices only at TP=1;
- ``mixtral``: as ``llama`` with a MoE block of 4 experts (top 2, I=256: 128 rows / K per rank
  at TP=2) instead of the MLP;
- ``qwen2_moe``: as ``qwen2`` with a MoE block of 4 experts (top 2, I=256) and a shared expert
  (I=256) behind its sigmoid gate;
- ``qwen3_moe``: Qwen3-MoE (q/k norms, no biases), 2 KV heads, a MoE block of 4 experts (top 2,
  renormalized, I=256) in every layer, no shared expert.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = """
The converter lays out every weight once, offline, so that the engine starts without moving a
byte. A tile holds the scales of one hundred and twenty eight rows and as many columns; a rank
takes whole tiles, never a part of one. Rows go to the column parallel layers, columns to the
row parallel ones, and the heads of keys and values are shared when there are fewer of them than
ranks. The quick brown fox jumps over the lazy dog while the engine answers a completion.
Numbers one two three four five six seven eight nine ten eleven twelve, and the days of the week:
Monday Tuesday Wednesday Thursday Friday Saturday Sunday. Colours red green blue yellow black.
""".strip()

COMMON = dict(hidden_size=512, num_attention_heads=4, head_dim=128, num_hidden_layers=2,
              max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
              initializer_range=0.08)
MODELS = {  # kind: (config class, model class, keys)
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(num_key_value_heads=1, intermediate_size=1024)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_key_value_heads=2, intermediate_size=1024)),
    "llama_tp1": ("LlamaConfig", "LlamaForCausalLM",
                  dict(num_key_value_heads=1, intermediate_size=1152)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_key_value_heads=1, intermediate_size=256, num_local_experts=4,
                     num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_key_value_heads=2, intermediate_size=256, moe_intermediate_size=256,
                       shared_expert_intermediate_size=256, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_key_value_heads=2, intermediate_size=1024, moe_intermediate_size=256,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       norm_topk_prob=True)),
}


def train_tokenizer(out: Path, vocab_size: int = 384):
    """A byte-level BPE trained on :data:`CORPUS`, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return fast


def build(kind: str, out: Path, seed: int = 0) -> Path:
    """Write model ``kind`` of :data:`MODELS` (BF16 safetensors, config, tokenizer) to ``out``."""
    import transformers

    cfg_name, model_name, extra = MODELS[kind]
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out)
    vocab = ((len(tok) + 63) // 64) * 64
    config = getattr(transformers, cfg_name)(vocab_size=vocab, bos_token_id=tok.bos_token_id,
                                            eos_token_id=tok.eos_token_id, **COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.bfloat16)
    with torch.no_grad():  # biases non-zero, so that a misplaced one would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out
