"""Grouped MXFP8 GEMMs for the fused MoE on Hopper: one launch per GEMM for every expert.

The per-expert path of :func:`mxfp8_convert.runtime.moe.triton_fused_moe` calls the dense kernel
once per expert and GEMM, so at decode/prefill batch sizes with 256 experts it is bound by
~500 Python launches. Here each GEMM is one launch over a tile schedule ``(expert, first row,
end row)`` built on the host from the expert counts, with the same data path as the dense kernel
(``tile.py``: P32 row gather, 128x4 scale words, exact dequantization to bf16, bf16 MMA
with fp32 accumulation, transposed tile so the weight is the register operand):

- FC1 gathers its activation rows by token (the input ``x [T, H]`` is quantized once, not
  ``T*k`` times), and its epilogue does the rest of the expert's first half: the tile's rows
  ``2j, 2j+1`` are ``up_j, gate_j`` (the interleaved layout exists for this), so it rounds both
  to bf16, computes ``silu(gate) * up`` in fp32, rounds to bf16 and MXFP8-quantizes the result
  (``BLOCK_N / 2`` is a multiple of 32, so each 32-block lies in one tile) before storing it.
- FC2 reads those exactly-dequantized activations and stores bf16 ``y [T*k, H]`` in sorted order.

The numbers are those of the per-expert path (the "staged" oracle of ``moe.py``): GEMM outputs
rounded to bf16, activation and requantization as ``quantize_activations``. bf16 rounding is done
in fp32 bit arithmetic (round-nearest-even), because the interpreter's casts truncate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.hopper.jit import (
    FP_FUSION,
    _dequant_weight,
    _load_codes,
    _mx_fake_quant,
    _physical_rows,
    _scale_row_base,
)
from mxfp8_convert.runtime.hopper.launch import _check_device, quantize_activations


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest bf16 value (ties to even), still fp32; finite inputs."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000 as int32
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["num_tiles"])
def _grouped_mxfp8_kernel(
    a_ptr, src_ptr, w_ptr, s_ptr, out_ptr, sched_ptr,
    num_tiles, N, K, stride_a, w_expert_stride, s_expert_words, scale_cp4,
    GATHER: tl.constexpr, SWIGLU: tl.constexpr, DOT_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Tile ``(pid_t, pid_n)``: rows ``[r0, r1)`` of expert ``e`` times the output columns of
    tile ``pid_n``.

    ``sched [3, num_tiles]`` int32 holds ``e, r0, r1`` per tile. Activations ``a`` are exactly
    dequantized MXFP8 (bf16, or fp32 under the interpreter); row ``r`` reads ``a[src[r]]`` when
    GATHER. Weight rows are P32-shuffled (trtllm), scales 128x4 int32 words.
    """
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(sched_ptr + pid_t).to(tl.int64)
    r0 = tl.load(sched_ptr + num_tiles + pid_t)
    r1 = tl.load(sched_ptr + 2 * num_tiles + pid_t)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    rows = _physical_rows(rows, 1)  # the trtllm gather
    offs_m = r0 + tl.arange(0, BLOCK_M)
    m_in = offs_m < r1
    mrow = tl.minimum(offs_m, r1 - 1)
    if GATHER:
        src = tl.load(src_ptr + mrow).to(tl.int64)
    else:
        src = mrow.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + e * w_expert_stride + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    s_base = s_ptr + e * s_expert_words + _scale_row_base(rows, 0, scale_cp4, 1)[:, None]
    x_ptrs = a_ptr + src[None, :] * stride_a + offs_k[:, None]  # A^T tile [BK, BM]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(0, K // BLOCK_K):
        w = tl.load(w_ptrs + kt * BLOCK_K)
        wd = _dequant_weight(w, _load_codes(s_base, kt, BLOCK_K, 1), BLOCK_N, BLOCK_K, DOT_BF16)
        xa = tl.load(x_ptrs + kt * BLOCK_K)
        if DOT_BF16:
            acc = tl.dot(wd, xa.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(wd, xa.to(tl.float32), acc, input_precision="ieee")

    h = _round_bf16(acc)  # the GEMM output in bf16, as the per-expert path stores it
    if SWIGLU:
        pairs = tl.permute(tl.reshape(h, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1))
        up, gate = tl.split(pairs)  # [BN/2, BM] each: logical rows 2j (up_j) and 2j+1 (gate_j)
        act = _round_bf16(gate * tl.sigmoid(gate) * up)
        deq, _r, _c = _mx_fake_quant(tl.reshape(tl.trans(act), (BLOCK_M, BLOCK_N // 64, 32)), 2)
        res = tl.reshape(deq, (BLOCK_M, BLOCK_N // 2))
        out_cols = N // 2
        offs_o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        res = tl.trans(h)
        out_cols = N
        offs_o = offs_n
    mask = m_in[:, None] & (offs_o < out_cols)[None, :]
    out_off = offs_m.to(tl.int64)[:, None] * out_cols + offs_o[None, :]
    tl.store(out_ptr + out_off, res.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class GroupedConfig:
    """Tile of the grouped kernel: ``block_n`` weight rows x ``block_m`` token rows x
    ``block_k``."""

    block_n: int = 64
    block_m: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def choose_grouped_config(rows: int, active_experts: int) -> GroupedConfig:
    """By the mean rows per active expert: weight-stream tiles for small groups, bigger for prefill.

    Not tuned on a GPU yet (benchmarks/bench_moe_runtime.py records what it gives).
    """
    mean = rows / max(active_experts, 1)
    if mean <= 16:
        return GroupedConfig(64, 16, 128, 4, 4)
    if mean <= 32:
        return GroupedConfig(64, 32, 128, 4, 4)
    if mean <= 64:
        return GroupedConfig(64, 64, 128, 4, 4)
    return GroupedConfig(128, 128, 64, 8, 3)


def tile_schedule(offsets: list[int], block_m: int, device: torch.device) -> torch.Tensor:
    """int32 ``[3, tiles]``: expert, first row, end row of every ``block_m``-row tile of each
    group."""
    es, r0s, r1s = [], [], []
    for e in range(len(offsets) - 1):
        lo, hi = offsets[e], offsets[e + 1]
        for r in range(lo, hi, block_m):
            es.append(e)
            r0s.append(r)
            r1s.append(hi)
    return torch.tensor([es, r0s, r1s], dtype=torch.int32).to(device)


def grouped_gemm(
    a: torch.Tensor,
    src: torch.Tensor | None,
    w: torch.Tensor,
    scale_tiles: torch.Tensor,
    sched: torch.Tensor,
    rows: int,
    *,
    swiglu: bool,
    config: GroupedConfig,
) -> torch.Tensor:
    """One grouped GEMM over every expert.

    Args:
        a: exactly dequantized MXFP8 activations ``[*, K]`` (bf16; fp32 under the interpreter).
        src: int32 ``[rows]``: row ``r`` reads ``a[src[r]]``; None reads ``a[r]``.
        w: e4m3 ``[E, N, K]`` laid-out weights (P32 rows).
        scale_tiles: uint8 ``[E, N/128, K/128, 512]`` 128x4 tiles.
        sched: :func:`tile_schedule` of ``config.block_m``.
        rows: output rows (``T*k``).
        swiglu: FC1 (interleaved ``[up; gate]`` rows): output ``fq(bf16(silu(gate) * up))``
            ``[rows, N/2]``; else the bf16 GEMM output ``[rows, N]``.

    Returns:
        bf16 ``[rows, N/2 or N]``.
    """
    _check_device(a)
    e, n, k = w.shape
    if k % config.block_k or n % config.block_n or (swiglu and config.block_n % 64):
        raise LayoutError(f"grouped MoE GEMM: tile {config} does not divide N={n}, K={k}")
    if a.shape[1] != k or a.stride(1) != 1:
        raise LayoutError(f"grouped MoE GEMM: activations {list(a.shape)} do not match K={k}")
    out = torch.empty((rows, n // 2 if swiglu else n), dtype=torch.bfloat16, device=a.device)
    tiles = sched.shape[1]
    if rows == 0 or tiles == 0:
        return out
    s_words = scale_tiles.view(torch.int32)
    grid = (tiles, n // config.block_n)
    _grouped_mxfp8_kernel[grid](
        a, src if src is not None else sched, w, s_words, out, sched,
        tiles, n, k, a.stride(0), n * k, s_words[0].numel(), k // 128,
        GATHER=src is not None, SWIGLU=swiglu, DOT_BF16=a.device.type == "cuda",
        BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=FP_FUSION,
    )
    return out


def grouped_fused_moe(
    hidden_states: torch.Tensor,
    order: torch.Tensor,
    offsets: list[int],
    topk_weights: torch.Tensor,
    experts,
    *,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """The routed MoE on sorted (token, slot) pairs: quantize, FC1+SwiGLU, FC2, weighted sum.

    Args:
        hidden_states: ``[T, H]``.
        order, offsets: from ``moe._expert_spans`` (pairs sorted by expert, group offsets).
        topk_weights: ``[T, k]``.
        experts: :class:`~mxfp8_convert.runtime.moe.MXFP8MoEWeights`.
        config: tile choice for both GEMMs (default :func:`choose_grouped_config`).

    Returns:
        bf16 ``[T, H]``.
    """
    t, k = topk_weights.shape
    rows = t * k
    if rows == 0:
        return torch.empty((t, experts.hidden), dtype=torch.bfloat16, device=hidden_states.device)
    active = sum(1 for e in range(len(offsets) - 1) if offsets[e + 1] > offsets[e])
    cfg = config or choose_grouped_config(rows, active)
    dev = hidden_states.device
    sched = tile_schedule(offsets, cfg.block_m, dev)
    tok = (order // k).to(torch.int32)
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    a1 = quantize_activations(x)["deq"]
    act = grouped_gemm(
        a1, tok, experts.w13, experts.w13_scale, sched, rows, swiglu=True, config=cfg
    )
    if dev.type == "cpu":
        act = act.float()  # the interpreter's dot runs on fp32 copies of the same exact values
    y = grouped_gemm(act, None, experts.w2, experts.w2_scale, sched, rows, swiglu=False, config=cfg)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(rows, device=dev)
    per_token = y[inv].view(t, k, experts.hidden).float()  # pair t*k + j of token t, in slot order
    return (per_token * topk_weights.float().unsqueeze(-1)).sum(1).to(torch.bfloat16)
