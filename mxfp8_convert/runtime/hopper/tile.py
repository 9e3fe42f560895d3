"""Tile kernel: dequantize-then-bf16-MMA on the laid-out weight bytes, any M.

SM90 tensor cores have no block-scaled FP8 MMA, but UE8M0 scales are powers of two and e4m3 has a
4-bit significand, so ``q * 2^(code-127)`` is *exact* in bf16, and so are the products of two such
values in the fp32-accumulating bf16 MMA: a bf16 ``tl.dot`` on dequantized tiles computes the
MXFP8 GEMM (up to fp32 summation order) while the weight is streamed as 1.03 bytes per element.
Each output tile is computed transposed, ``acc[BLOCK_N, BLOCK_M] = W_tile @ A_tile^T``, so the
dequantized weight tile is the MMA's register operand and never goes through shared memory as
bf16. Under the interpreter (CPU) the dot runs on float32 copies of the same exact values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxfp8_convert.runtime.hopper.jit import (
    _dequant_weight,
    _load_codes,
    _mx_fake_quant,
    _physical_rows,
    _scale_row_base,
)


@triton.jit
def _tile_ids(N, M, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr):
    """(pid_n, pid_m): GROUP_N weight tiles walk down M together, so both operands hit L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_N * num_m
    first_n = (pid // width) * GROUP_N
    group = tl.minimum(tl.cdiv(N, BLOCK_N) - first_n, GROUP_N)
    return first_n + (pid % width) % group, (pid % width) // group


@triton.jit(do_not_specialize=["M", "split_k"])
def _mxfp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_os, scale_c, scale_cp4, split_k,
    LAYOUT: tl.constexpr, QUANT_X: tl.constexpr, DOT_BF16: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, SERIAL: tl.constexpr, GROUP_N: tl.constexpr,
):
    """out[M, N] (or split-K fp32 partials) of fq(x) @ dq(W).T on laid-out W bytes, computed as
    acc^T = W_tile @ A_tile^T so that the dequantized weight is the MMA's register operand."""
    pid_n, pid_m = _tile_ids(N, M, BLOCK_N, BLOCK_M, GROUP_N)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, split_k)
    kt0 = tl.program_id(1) * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1)  # clamp the tail: loads stay in bounds, stores are masked
    rows_n = rows  # logical output column of each tile row (clamped), for the bias
    rows = _physical_rows(rows, LAYOUT)
    cols = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    s_base = s_ptr + _scale_row_base(rows, scale_c, scale_cp4, LAYOUT)[:, None]
    x_ptrs = x_ptr + cols[None, :] * stride_xm + offs_k[:, None]  # A^T tile [BK, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)

    for kt in range(kt0, kt1):
        w = tl.load(w_ptrs + kt * BLOCK_K)
        wd = _dequant_weight(
            w, _load_codes(s_base, kt, BLOCK_K, LAYOUT), BLOCK_N, BLOCK_K, DOT_BF16
        )
        xa = tl.load(x_ptrs + kt * BLOCK_K)
        if QUANT_X:
            deq, _r, _c = _mx_fake_quant(
                tl.reshape(xa.to(tl.float32), (BLOCK_K // 32, 32, BLOCK_M)), 1
            )
            xa = tl.reshape(deq, (BLOCK_K, BLOCK_M))
        if DOT_BF16:
            acc = tl.dot(wd, xa.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(wd, xa.to(tl.float32), acc, input_precision="ieee")

    if HAS_BIAS and not PARTIAL:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
    res = tl.trans(acc)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_off = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if not PARTIAL:
        tl.store(out_ptr + out_off, res.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + tl.program_id(1).to(tl.int64) * stride_os + out_off, res, mask=mask)
        if SERIAL:  # the last split of this tile to arrive sums the partials: no second launch
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(lock_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, split_k):
                    total += tl.load(
                        ws_ptr + s * stride_os + out_off, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                if HAS_BIAS:
                    total += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
                tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + tl.program_id(0), 0)  # re-arm for the next call

