"""GEMV kernel (M <= 4): the weight stream on CUDA cores, no tensor-core round trips.

One FMA per weight byte and activation row; bytes converted from int32 words by integer ops.
Launched by ``launch.py`` for :attr:`Kernel.GEMV` configs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxfp8_convert.runtime.hopper.jit import (
    _load_codes,
    _mx_fake_quant,
    _physical_rows,
    _pow2_f32,
    _scale_row_base,
)


@triton.jit
def _quantized_x_row(x_row, kt, BLOCK_K: tl.constexpr):
    """K-tile ``kt`` of one activation row as its exact MXFP8 value ``q * 2^(code-127)`` (fp32)."""
    x = tl.load(x_row + kt * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
    deq, _r, _c = _mx_fake_quant(tl.reshape(x, (1, BLOCK_K // 32, 32)), 2)
    return tl.reshape(deq, (BLOCK_K,))


@triton.jit
def _gemv_row(
    acc, wf, sw, x_row, kt, FUSE_QUANT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """``acc [BN, BK/32] += sum_32(wf * xd) * sw`` for one activation row of K-tile ``kt``.

    ``xd`` is the row's MXFP8 value ``q * 2^(code-127)`` in fp32 (exact): quantized here
    (FUSE_QUANT) or already by :func:`quantize_activations`. ``wf`` are the e4m3 weight values,
    so each product is exact and only the 32-term sums round (fp32), as in a tensor-core MMA.
    """
    if FUSE_QUANT:
        x = _quantized_x_row(x_row, kt, BLOCK_K)
    else:
        x = tl.load(x_row + kt * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
    part = tl.sum(tl.reshape(wf * x[None, :], (BLOCK_N, BLOCK_K // 32, 32)), axis=2)
    return acc + part * sw


@triton.jit
def _e4m3_pair_f32(t):
    """Two e4m3 bytes at bits 0-7 and 16-23 of int32 ``t`` -> their values / 256 as fp32.

    Each byte's bits are moved into an fp16 (sign to bit 15, exponent and mantissa to bits 7-13):
    the fp16 then holds exactly ``value * 2^-8`` (the exponent biases differ by 8), subnormal
    e4m3 included. Fewer instructions than Triton's generic fp8 cast (no byte permutes).
    """
    h = ((t << 7) & 0x3F803F80) | ((t << 8) & -0x7FFF8000)  # masks bits 7-13, 23-29 / 15, 31
    lo = (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((h >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _gemv_words_row(
    acc, w0, w1, w2, w3, sw, x_row, kt, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """:func:`_gemv_row` (activations quantized here) on weights given as fp32 [BN, BK/4] per byte
    position ``j`` of each int32 word (K index ``4*i + j``), scaled by 2^-8 (undone before the
    scale)."""
    even, odd = tl.split(
        tl.reshape(_quantized_x_row(x_row, kt, BLOCK_K), (BLOCK_K // 4, 2, 2))
    )  # K index 4i+2a / 4i+2a+1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    prod = w0 * x0[None, :] + w1 * x1[None, :] + w2 * x2[None, :] + w3 * x3[None, :]
    part = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 32, 8)), axis=2)
    return acc + (part * 256.0) * sw


@triton.jit
def _gemv_perm_row(
    acc, w0, w1, w2, w3, sw, x_row, kq, kt, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """:func:`_gemv_words_row` with the activation row already quantized and permuted
    (:func:`quantize_activations` ``permuted=True``): each ``x_j`` is loaded as a [BN, BK/4] tile
    of the same shape and contiguity as the weight words (zero row stride), so it arrives in
    the weights' register layout: no shared-memory layout conversion per K-tile."""
    offs = (kt * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4))[None, :] + tl.zeros(
        (BLOCK_N, 1), dtype=tl.int32
    )
    prod = w0 * tl.load(x_row + offs)
    prod += w1 * tl.load(x_row + kq + offs)
    prod += w2 * tl.load(x_row + 2 * kq + offs)
    prod += w3 * tl.load(x_row + 3 * kq + offs)
    part = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 32, 8)), axis=2)
    return acc + (part * 256.0) * sw


@triton.jit
def _gemv_epilogue(acc, m, M, N, offs_n, rows_n, b_ptr, out_ptr, ws_ptr, stride_om, stride_os,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Store output row ``m`` (or its split-K partial); rows past M are never stored."""
    res = tl.sum(acc, axis=1)
    mask = (offs_n < N) & (offs_n * 0 + m < M)
    if PARTIAL:
        tl.store(
            ws_ptr + tl.program_id(1).to(tl.int64) * stride_os + m * N + offs_n, res, mask=mask
        )
    else:
        if HAS_BIAS:
            res += tl.load(b_ptr + rows_n).to(tl.float32)
        tl.store(out_ptr + m * stride_om + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "split_k"])
def _mxfp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_os, scale_c, scale_cp4, split_k,
    LAYOUT: tl.constexpr, FUSE_QUANT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, SERIAL: tl.constexpr, WORDS: tl.constexpr, X_PERM: tl.constexpr,
):
    """out[M, N] (or split-K fp32 partials) for M <= BLOCK_M <= 4 on CUDA cores.

    WORDS: ``w_ptr`` is the weight as int32 words, whose bytes are converted by integer ops
    (:func:`_e4m3_pair_f32`); otherwise e4m3 tensors converted by Triton's generic cast. With
    WORDS the activations are either quantized here (FUSE_QUANT) or pre-permuted (X_PERM).

    Program (pid_n, pid_k) streams BLOCK_N weight rows over a K range, 16 bytes per thread per
    load, with the next K-tile's weight and scale loads issued before the current one is used
    (a register double buffer: Triton's pipeliner stages only loads that feed a dot). Per
    32-block: the exact e4m3 x MXFP8 products are summed in fp32, then multiplied by the weight's
    power-of-two scale; one [BN, BK/32] accumulator per activation row, reduced at the end.
    """
    pid_n = tl.program_id(0)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, split_k)
    kt0 = tl.program_id(1) * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # clamp the tail: loads stay in bounds, stores are masked
    rows_n = rows
    rows = _physical_rows(rows, LAYOUT)
    BKW: tl.constexpr = BLOCK_K // 4 if WORDS else BLOCK_K  # loaded elements per row and K-tile
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BKW)[None, :]
    s_base = s_ptr + _scale_row_base(rows, scale_c, scale_cp4, LAYOUT)[:, None]
    x0 = x_ptr
    x1 = x_ptr + tl.minimum(1, M - 1) * stride_xm  # rows past M repeat row M-1, never stored
    x2 = x_ptr + tl.minimum(2, M - 1) * stride_xm
    x3 = x_ptr + tl.minimum(3, M - 1) * stride_xm
    NB: tl.constexpr = BLOCK_K // 32
    acc0 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)

    w_next = tl.load(w_ptrs + kt0 * BKW)
    c_next = _load_codes(s_base, kt0, BLOCK_K, LAYOUT)
    for kt in range(kt0, kt1):
        w = w_next
        c = c_next
        kn = tl.minimum(kt + 1, kt1 - 1)  # the last iteration re-loads its own tile (unused)
        w_next = tl.load(w_ptrs + kn * BKW)
        c_next = _load_codes(s_base, kn, BLOCK_K, LAYOUT)
        sw = _pow2_f32(c)
        if WORDS:
            b0, b2 = _e4m3_pair_f32(w)
            b1, b3 = _e4m3_pair_f32(w >> 8)
            if X_PERM:
                acc0 = _gemv_perm_row(acc0, b0, b1, b2, b3, sw, x0, K // 4, kt, BLOCK_N, BLOCK_K)
                if BLOCK_M > 1:
                    acc1 = _gemv_perm_row(
                        acc1, b0, b1, b2, b3, sw, x1, K // 4, kt, BLOCK_N, BLOCK_K
                    )
                if BLOCK_M > 2:
                    acc2 = _gemv_perm_row(
                        acc2, b0, b1, b2, b3, sw, x2, K // 4, kt, BLOCK_N, BLOCK_K
                    )
                    acc3 = _gemv_perm_row(
                        acc3, b0, b1, b2, b3, sw, x3, K // 4, kt, BLOCK_N, BLOCK_K
                    )
            else:
                acc0 = _gemv_words_row(acc0, b0, b1, b2, b3, sw, x0, kt, BLOCK_N, BLOCK_K)
                if BLOCK_M > 1:
                    acc1 = _gemv_words_row(acc1, b0, b1, b2, b3, sw, x1, kt, BLOCK_N, BLOCK_K)
                if BLOCK_M > 2:
                    acc2 = _gemv_words_row(acc2, b0, b1, b2, b3, sw, x2, kt, BLOCK_N, BLOCK_K)
                    acc3 = _gemv_words_row(acc3, b0, b1, b2, b3, sw, x3, kt, BLOCK_N, BLOCK_K)
        else:
            wf = w.to(tl.float32)
            acc0 = _gemv_row(acc0, wf, sw, x0, kt, FUSE_QUANT, BLOCK_N, BLOCK_K)
            if BLOCK_M > 1:
                acc1 = _gemv_row(acc1, wf, sw, x1, kt, FUSE_QUANT, BLOCK_N, BLOCK_K)
            if BLOCK_M > 2:
                acc2 = _gemv_row(acc2, wf, sw, x2, kt, FUSE_QUANT, BLOCK_N, BLOCK_K)
                acc3 = _gemv_row(acc3, wf, sw, x3, kt, FUSE_QUANT, BLOCK_N, BLOCK_K)

    _gemv_epilogue(
        acc0,
        0,
        M,
        N,
        offs_n,
        rows_n,
        b_ptr,
        out_ptr,
        ws_ptr,
        stride_om,
        stride_os,
        HAS_BIAS,
        PARTIAL,
    )
    if BLOCK_M > 1:
        _gemv_epilogue(
            acc1,
            1,
            M,
            N,
            offs_n,
            rows_n,
            b_ptr,
            out_ptr,
            ws_ptr,
            stride_om,
            stride_os,
            HAS_BIAS,
            PARTIAL,
        )
    if BLOCK_M > 2:
        _gemv_epilogue(
            acc2,
            2,
            M,
            N,
            offs_n,
            rows_n,
            b_ptr,
            out_ptr,
            ws_ptr,
            stride_om,
            stride_os,
            HAS_BIAS,
            PARTIAL,
        )
        _gemv_epilogue(
            acc3,
            3,
            M,
            N,
            offs_n,
            rows_n,
            b_ptr,
            out_ptr,
            ws_ptr,
            stride_om,
            stride_os,
            HAS_BIAS,
            PARTIAL,
        )
    if SERIAL:  # the last split of these rows to arrive sums the partials: no second launch
        tl.debug_barrier()  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            for m in range(0, M):
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for s in range(0, split_k):
                    total += tl.load(
                        ws_ptr + s * stride_os + m * N + offs_n,
                        mask=offs_n < N,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                if HAS_BIAS:
                    total += tl.load(b_ptr + rows_n).to(tl.float32)
                tl.store(
                    out_ptr + m * stride_om + offs_n,
                    total.to(out_ptr.dtype.element_ty),
                    mask=offs_n < N,
                )
            tl.atomic_xchg(lock_ptr + pid_n, 0)  # re-arm for the next call

