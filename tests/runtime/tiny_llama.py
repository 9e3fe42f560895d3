"""A tiny Llama-style causal LM in plain torch (transformers is not installed here).

Parameter names match Hugging Face Llama checkpoints (``model.layers.N.self_attn.q_proj`` ...),
so ``load_into`` can fill it from a converted checkpoint built from the same config.json keys.
No rotary embedding: the test compares engines, not language modelling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        y = y.to(x.dtype)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        h = F.silu(self.gate_proj(x).float()) * self.up_proj(x).float()
        return self.down_proj(h.to(x.dtype))


class Layer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.input_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.self_attn = Attention(h, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        self.post_attention_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.mlp = MLP(h, cfg["intermediate_size"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x)).to(x.dtype)
        return x + self.mlp(self.post_attention_layernorm(x)).to(x.dtype)


class Body(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class TinyLlama(nn.Module):
    """``TinyLlama(config)(token_ids [B, T]) -> logits [B, T, vocab]``, in the parameters' dtype."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x)).float()
