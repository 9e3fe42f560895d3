"""Decode kernel (M <= 16): a weight stream with one FP8 tensor-core dot per 32-block.

e4m3 weight and activation bytes go to FP8 MMAs untouched and the two power-of-two scales
multiply the fp32 partial products (the Gluon kernel, ``wgmma.py``, does the same with several
MMAs in flight). Launched by ``launch.py`` for :attr:`Kernel.DECODE` configs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxfp8_convert.runtime.hopper.jit import (
    _physical_rows,
    _pow2_f32,
    _round_e4m3,
    _scale_row_base,
    _ue8m0_code,
)


@triton.jit(do_not_specialize=["M", "split_k"])
def _mxfp8_decode_kernel(
    x_ptr, xq_ptr, xc_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_os, scale_c, scale_cp4, split_k,
    LAYOUT: tl.constexpr, FUSE_QUANT: tl.constexpr, FP8_DOT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, SERIAL: tl.constexpr, SCALE_TILE: tl.constexpr,
):
    """out[M, N] (or split-K fp32 partials) for small M, reading the e4m3 weight bytes as they are.

    Program (pid_n, pid_k) owns BLOCK_N weight rows and a K range. Per 32-block ``b`` of K:
    ``part = W[rows, b] @ Xq[b, :]^T`` on e4m3 operands (an exact sum of exact products,
    accumulated in fp32), then ``acc += part * 2^(cw-127) * 2^(cx-127)``: the weight bytes go from
    global to shared memory to the tensor core untouched (no conversion, no register copy);
    the only per-element work is on the small [BLOCK_N, BLOCK_M] accumulator. ``Xq`` is the
    MXFP8 activation (codes ``cx``), quantized in the kernel (FUSE_QUANT) or by
    :func:`quantize_activations`. Rows of the tile past M repeat row M-1 and are never stored.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, split_k)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    NB: tl.constexpr = BLOCK_K // 32

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # clamp the tail: loads stay in bounds, stores are masked
    rows_n = rows
    rows = _physical_rows(rows, LAYOUT)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_b = tl.arange(0, 32)
    w_base = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_b[None, :]  # [BN, 32]
    s_base = s_ptr + _scale_row_base(rows, scale_c, scale_cp4, LAYOUT)  # [BN]
    if FUSE_QUANT:
        x_base = x_ptr + cols[None, :] * stride_xm + offs_b[:, None]  # X^T block [32, BM]
    else:
        x_base = xq_ptr + cols[None, :] * K + offs_b[:, None]
        xc_base = xc_ptr + cols * (K // 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)

    if SCALE_TILE:
        # 128x4 words of the whole K-tile ([BN, NB/4]) and the activation codes ([BM, NB]) in one
        # load each: tensors of >= 32*num_warps elements, which Triton stages through shared
        # memory once instead of re-loading them from global memory in each consumer's layout.
        NW: tl.constexpr = NB // 4
        offs_w = tl.arange(0, NW)
        offs_nb = tl.arange(0, NB)
        for kt in range(kt0, kt1):
            words = tl.load(s_base[:, None] + ((kt * NW + offs_w) * 128)[None, :])
            if not FUSE_QUANT:
                xcs = tl.load(xc_base[:, None] + (kt * NB + offs_nb)[None, :])
            if SCALE_TILE == 2:  # BLOCK_K = 256: columns by splits, no reductions
                word_lo, word_hi = tl.split(words)
                if not FUSE_QUANT:
                    xe, xo = tl.split(tl.reshape(xcs, (BLOCK_M, 4, 2)))  # columns 0,2,4,6 / 1,3,5,7
                    xe0, xe1 = tl.split(tl.reshape(xe, (BLOCK_M, 2, 2)))  # 0,4 / 2,6
                    xo0, xo1 = tl.split(tl.reshape(xo, (BLOCK_M, 2, 2)))  # 1,5 / 3,7
                    xc0, xc4 = tl.split(xe0)
                    xc2, xc6 = tl.split(xe1)
                    xc1, xc5 = tl.split(xo0)
                    xc3, xc7 = tl.split(xo1)
            for c in tl.static_range(NB):
                kb = kt * NB + c
                if SCALE_TILE == 2:
                    word = word_lo if c < 4 else word_hi
                else:
                    word = tl.sum(tl.where(offs_w[None, :] == c // 4, words, 0), axis=1)
                cw = (word >> (8 * (c % 4))) & 0xFF
                # (cw >> 8) is 0: the dependency only makes Triton's pipeliner stage the scale
                # load (it pipelines loads feeding a dot's operands, directly or via an address).
                w = tl.load(w_base + kb * 32 + ((cw >> 8) * 16)[:, None])
                if FUSE_QUANT:
                    xf = tl.load(x_base + kb * 32).to(tl.float32)
                    cx = _ue8m0_code(tl.max(tl.abs(xf), axis=0))  # [BM]
                    xr = _round_e4m3(xf * _pow2_f32(254 - cx)[None, :])  # exact e4m3 values, fp32
                else:
                    if SCALE_TILE == 2:
                        if c == 0:
                            cx = xc0
                        elif c == 1:
                            cx = xc1
                        elif c == 2:
                            cx = xc2
                        elif c == 3:
                            cx = xc3
                        elif c == 4:
                            cx = xc4
                        elif c == 5:
                            cx = xc5
                        elif c == 6:
                            cx = xc6
                        else:
                            cx = xc7
                    else:
                        cx = tl.sum(tl.where(offs_nb[None, :] == c, xcs, 0), axis=1)
                    xr = tl.load(x_base + kb * 32 + ((cx >> 8) * 16)[None, :])
                if FP8_DOT:
                    part = tl.dot(w, xr.to(tl.float8e4nv))
                else:  # interpreter: the same exact values as float32
                    part = tl.dot(w.to(tl.float32), xr.to(tl.float32), input_precision="ieee")
                acc += (part * _pow2_f32(cw)[:, None]) * _pow2_f32(cx)[None, :]
    else:  # canonical scales, or BLOCK_K < 128: one load per 32-block
        for kt in range(kt0, kt1):
            for c in tl.static_range(NB):
                kb = kt * NB + c  # 32-block index along K
                if LAYOUT == 2:
                    cw = tl.load(s_base + kb).to(tl.int32)
                else:  # the int32 word holding scale columns 4j..4j+3 of each row
                    if c % 4 == 0:
                        word = tl.load(s_base + (kb // 4) * 128)
                    cw = (word >> (8 * (kb % 4))) & 0xFF
                # (cw >> 8) is 0: the dependency only makes Triton's pipeliner stage the scale load
                # (it pipelines loads feeding a dot's operands, directly or through an address).
                w = tl.load(w_base + kb * 32 + ((cw >> 8) * 16)[:, None])
                if FUSE_QUANT:
                    xf = tl.load(x_base + kb * 32).to(tl.float32)
                    cx = _ue8m0_code(tl.max(tl.abs(xf), axis=0))  # [BM]
                    xr = _round_e4m3(xf * _pow2_f32(254 - cx)[None, :])  # exact e4m3 values, fp32
                else:
                    cx = tl.load(xc_base + kb)  # int32 codes
                    xr = tl.load(x_base + kb * 32 + ((cx >> 8) * 16)[None, :])
                if FP8_DOT:
                    part = tl.dot(w, xr.to(tl.float8e4nv))
                else:  # interpreter: the same exact values as float32
                    part = tl.dot(w.to(tl.float32), xr.to(tl.float32), input_precision="ieee")
                acc += (part * _pow2_f32(cw)[:, None]) * _pow2_f32(cx)[None, :]

    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out_off = offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]  # [BN, BM]
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws_off = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(ws_ptr + pid_k.to(tl.int64) * stride_os + ws_off, acc, mask=mask)
        if SERIAL:  # the last split of this tile to arrive sums the partials: no second launch
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(0, split_k):
                    total += tl.load(
                        ws_ptr + s * stride_os + ws_off, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                if HAS_BIAS:
                    total += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
                tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + pid_n, 0)  # re-arm for the next call

