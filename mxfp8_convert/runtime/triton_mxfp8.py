"""Triton MXFP8 linear for Hopper (SM90): reads the laid-out weight and scale bytes in place.

Why dequantize-then-bf16-MMA (SPEC.md section 7): SM90 tensor cores have no block-scaled FP8 MMA,
and rescaling FP8 partial products every 32 K-elements reached only ~0.15x bf16. But UE8M0 scales
are powers of two and e4m3 has a 4-bit significand, so ``q * 2^(code-127)`` is *exact* in bf16,
and so are the products of two such values in the fp32-accumulating bf16 MMA. A bf16 ``tl.dot``
on dequantized tiles therefore computes the MXFP8 GEMM (up to fp32 summation order) at bf16
tensor-core rate, while the weight is still streamed from memory as 1.03 bytes per element.

Data flow per output tile ``acc[BLOCK_N, BLOCK_M]`` (transposed, so the dequantized weight tile is
the MMA's register operand and never goes through shared memory as bf16):

- weight rows are gathered in logical order: for trtllm, logical row ``l`` lives at physical row
  ``32*(l//32) + 8*(l%4) + (l%32)//4`` (the inverse of the P32 shuffle, SPEC.md section 2), and its
  scale at the 128x4 offset of that *physical* row; no unshuffled copy is ever made;
- activations are quantized to MXFP8 with FlashInfer's recipe either inside the GEMM (small M:
  cheap, one launch) or by :func:`quantize_activations` into exactly-dequantized bf16 (large M);
- split-K partials (small M: a weight stream needs many CTAs) are summed by a second kernel,
  or, for small weights, by the last CTA of each tile to arrive (an atomic arrival counter).

M <= 2 (:func:`gemv_rule`) runs ``_mxfp8_gemv_kernel``: a weight stream on CUDA cores (one FMA
per weight byte and activation row; bytes converted from int32 words by integer ops), with no
tensor-core round trips (benchmarks/NOTES_gemm.md, GEMV kernel). Decode (:func:`use_decode`,
M <= 4 on large-N weights) runs ``_mxfp8_decode_kernel``: e4m3 weight and activation bytes go to
FP8 tensor-core MMAs untouched, one MMA per 32-block, and the two power-of-two scales multiply the
fp32 partial products (benchmarks/NOTES_gemm.md, decode).

M >= ``CUBLAS_MIN_M`` (:func:`cublas_config`) is compute-bound, and there the tile kernel's cost is
that it dequantizes every weight tile once per M-tile. Instead the activations are quantized once
(exact bf16), the weight is dequantized once by ``_dequantize_weight_kernel`` from the laid-out
bytes (same gather and scale offsets, exact in bf16) into a transient bf16 workspace of at most
``DEQUANT_WORKSPACE`` elements (larger weights go chunk by chunk, each chunk's output columns
written in place), and cuBLAS multiplies with fp32 accumulation (torch's
``allow_bf16_reduced_precision_reduction`` applies as to any bf16 matmul). The workspace goes back to
torch's caching allocator after the call; the checkpoint's bytes remain the only resident copy
of the weight.

Rounding to e4m3 is done in fp32 arithmetic (the magic-number trick), not by a float8 cast: it is
bit-exact RNE on every device and in Triton's interpreter, whose float8/bf16 casts truncate.
In the interpreter (``TRITON_INTERPRET=1``, CPU tensors) the dot runs on float32 copies of the
same exact values, because the interpreter's bf16 arithmetic is wrong; results are identical.

This module imports triton at import time; :mod:`mxfp8_convert.runtime` imports it lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch: Triton releases without it get the wgmma path without PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_wait = gdc_launch_dependents = None

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.weight import CANONICAL, MXFP8Weight

#: Kernel code of each weight layout (constexpr LAYOUT).
LAYOUT_CODE = {"cutlass": 0, "trtllm": 1, CANONICAL: 2}
_INV_448 = tl.constexpr(1.0 / 448.0)  # rounds to fl32(1/448) in fp32 math, as FlashInfer's host code


# --------------------------------------------------------------------------------------------
# Scalar helpers (all elementwise on fp32 / int32 tensors)
# --------------------------------------------------------------------------------------------
@triton.jit
def _ue8m0_code(amax):
    """int32 UE8M0 code of ceil_pow2(amax / 448), FlashInfer's ``float_to_ue8m0``."""
    v = amax * _INV_448
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    bump = (man > 0) & (exp != 0xFE) & ((exp != 0) | (man > 0x400000))
    return exp + bump.to(tl.int32)


@triton.jit
def _pow2_f32(e_field):
    """fp32 ``2^(e_field - 127)`` for e_field in 0..254 (0 gives the subnormal 2^-127; -1 too, 255
    +inf). One max: ``e_field << 23`` is <= 0 exactly where e_field <= 0. Also called from the
    Gluon kernel (``gluon_mxfp8``)."""
    bits = tl.maximum(e_field << 23, 0x400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(y):
    """Round fp32 ``y`` to the nearest e4m3 value (ties to even), saturating at +-448.

    Adding ``1.5 * 2^(e+20)`` (e = binade of |y|, at least -6 for subnormals) leaves exactly the
    e4m3 ulp ``2^(e-3)`` as the fp32 ulp of the sum, so fp32's RNE add does the rounding.
    """
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31  # the sign bit alone
    a = tl.minimum(tl.abs(y), 448.0)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = (((147 + e) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_byte(r):
    """uint8 e4m3fn encoding of an fp32 value that is exactly representable in e4m3."""
    bits = r.to(tl.int32, bitcast=True)
    ex = (bits >> 23) & 0xFF
    mag = tl.where(ex >= 121, ((ex - 120) << 3) | ((bits >> 20) & 0x7), (tl.abs(r) * 512.0).to(tl.int32))
    return (mag | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _mx_fake_quant(xf, AXIS: tl.constexpr):
    """Quantize-dequantize fp32 ``xf`` whose 32-blocks run along ``AXIS`` of a 3-D tensor.

    Returns ``(deq, r, code)``: exact fp32 ``q * 2^(code-127)``, the e4m3 values ``q`` (fp32) and
    the int32 codes (``AXIS`` reduced away).
    """
    code = _ue8m0_code(tl.max(tl.abs(xf), axis=AXIS))
    inv = tl.expand_dims(_pow2_f32(254 - code), AXIS)  # 2^(127-code)
    r = _round_e4m3(xf * inv)
    deq = r * tl.expand_dims(_pow2_f32(code), AXIS)
    return deq, r, code


# --------------------------------------------------------------------------------------------
# Activation quantization: x [M, K] -> exactly dequantized A (bf16/fp32) and/or (q, code)
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(
    x_ptr, deq_ptr, q_ptr, code_ptr, M, K, stride_xm,
    WRITE_DEQ: tl.constexpr, WRITE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PERM_DEQ: tl.constexpr = False,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    xf = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32))
    deq, r, code = _mx_fake_quant(xf, 2)
    if WRITE_DEQ:
        d = tl.reshape(deq, (BLOCK_M, BLOCK_K))
        if PERM_DEQ:  # [M, 4, K/4]: element k at (k % 4, k // 4), for the GEMV kernel's word loads
            cols = (offs_k % 4) * (K // 4) + offs_k // 4
        else:
            cols = offs_k
        tl.store(deq_ptr + rows * K + cols[None, :], d.to(deq_ptr.dtype.element_ty), mask=mask)
    if WRITE_Q:
        q = tl.reshape(_e4m3_byte(r), (BLOCK_M, BLOCK_K))
        tl.store(q_ptr + rows * K + offs_k[None, :], q, mask=mask)
        offs_c = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        cmask = (offs_m < M)[:, None] & (offs_c < K // 32)[None, :]
        tl.store(code_ptr + rows * (K // 32) + offs_c[None, :], code.to(code_ptr.dtype.element_ty), mask=cmask)


# --------------------------------------------------------------------------------------------
# The GEMM
# --------------------------------------------------------------------------------------------
@triton.jit
def _scale_row_base(rows, scale_c, scale_cp4, LAYOUT: tl.constexpr):
    """Offset of (physical row, scale column 0): in bytes (canonical) or int32 words (128x4)."""
    if LAYOUT == 2:  # canonical: linear uint8 [N, C]
        return rows.to(tl.int64) * scale_c
    else:  # 128x4 byte offset (r//128)*(Cp/4)*512 + (r%32)*16 + ((r%128)//32)*4, in words
        return (rows // 128).to(tl.int64) * (scale_cp4 * 128) + (rows % 32) * 4 + (rows % 128) // 32


@triton.jit
def _p32_logical(rows):
    """The logical rows held by physical rows ``rows`` of a trtllm weight: physical row p holds
    logical row ``32*(p//32) + 4*(q%8) + q//8``, q = p % 32 (the inverse of the gather
    ``32*(l//32) + 8*(l%4) + (l%32)//4`` in the module docstring; the P32 shuffle stays within
    32-row groups). Also called by the Gluon kernel's epilogues."""
    q = rows % 32
    return rows - q + 4 * (q % 8) + q // 8


@triton.jit
def _load_codes(s_base, kt, BLOCK_K: tl.constexpr, LAYOUT: tl.constexpr):
    """int32 UE8M0 codes [BN, BLOCK_K/32] of K-tile ``kt``.

    128x4 layouts are read as int32 words (the 4 codes of scale columns 4j..4j+3 of a row are
    one aligned word), so the load is wide enough for cp.async and gets software-pipelined.
    """
    c = kt * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    if LAYOUT == 2:
        return tl.load(s_base + c[None, :]).to(tl.int32)
    else:
        words = tl.load(s_base + ((c // 4) * 128)[None, :])
        return (words >> (8 * (c % 4))[None, :]) & 0xFF


@triton.jit
def _dequant_weight(w, code, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr):
    """e4m3 [BN, BK] and int32 codes [BN, BK/32] -> exact ``w * 2^(code-127)`` (bf16 or fp32)."""
    if DOT_BF16:
        sc = tl.where(code == 0, 0x40, code << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        wd = w.to(tl.bfloat16)
    else:
        sc = _pow2_f32(code)
        wd = w.to(tl.float32)
    wd = tl.reshape(wd, (BLOCK_N, BLOCK_K // 32, 32)) * sc[:, :, None]
    return tl.reshape(wd, (BLOCK_N, BLOCK_K))


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
    W_IN_REGS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, SERIAL: tl.constexpr, GROUP_N: tl.constexpr,
):
    """out[M, N] (or split-K fp32 partials) of fq(x) @ dq(W).T on laid-out W bytes.

    W_IN_REGS: compute acc^T = W_tile @ A_tile^T so the dequantized weight is the MMA's register
    operand; otherwise acc = A_tile @ W_tile^T with the dequantized weight staged in shared memory.
    """
    pid_n, pid_m = _tile_ids(N, M, BLOCK_N, BLOCK_M, GROUP_N)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, split_k)
    kt0 = tl.program_id(1) * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1)  # clamp the tail: loads stay in bounds, stores are masked
    rows_n = rows  # logical output column of each tile row (clamped), for the bias
    if LAYOUT == 1:  # gather: logical row l lives at physical row 32*(l//32) + 8*(l%4) + (l%32)//4
        rows = (rows // 32) * 32 + 8 * (rows % 4) + (rows % 32) // 4
    cols = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    s_base = s_ptr + _scale_row_base(rows, scale_c, scale_cp4, LAYOUT)[:, None]
    if W_IN_REGS:
        x_ptrs = x_ptr + cols[None, :] * stride_xm + offs_k[:, None]  # A^T tile [BK, BM]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        x_ptrs = x_ptr + cols[:, None] * stride_xm + offs_k[None, :]  # A tile [BM, BK]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for kt in range(kt0, kt1):
        w = tl.load(w_ptrs + kt * BLOCK_K)
        wd = _dequant_weight(w, _load_codes(s_base, kt, BLOCK_K, LAYOUT), BLOCK_N, BLOCK_K, DOT_BF16)
        xa = tl.load(x_ptrs + kt * BLOCK_K)
        if W_IN_REGS:
            if QUANT_X:
                deq, _r, _c = _mx_fake_quant(tl.reshape(xa.to(tl.float32), (BLOCK_K // 32, 32, BLOCK_M)), 1)
                xa = tl.reshape(deq, (BLOCK_K, BLOCK_M))
            if DOT_BF16:
                acc = tl.dot(wd, xa.to(tl.bfloat16), acc)
            else:
                acc = tl.dot(wd, xa.to(tl.float32), acc, input_precision="ieee")
        else:
            if QUANT_X:
                deq, _r, _c = _mx_fake_quant(tl.reshape(xa.to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32)), 2)
                xa = tl.reshape(deq, (BLOCK_M, BLOCK_K))
            if DOT_BF16:
                acc = tl.dot(xa.to(tl.bfloat16), tl.trans(wd), acc)
            else:
                acc = tl.dot(xa.to(tl.float32), tl.trans(wd), acc, input_precision="ieee")

    if W_IN_REGS:
        if HAS_BIAS and not PARTIAL:
            acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
        res = tl.trans(acc)
    else:
        if HAS_BIAS and not PARTIAL:
            acc += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
        res = acc
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
                    total += tl.load(ws_ptr + s * stride_os + out_off, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
                tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + tl.program_id(0), 0)  # re-arm for the next call


@triton.jit(do_not_specialize=["total", "stride_ps", "split_k"])
def _splitk_reduce_kernel(p_ptr, b_ptr, out_ptr, N, total, stride_ps, split_k,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                          CHUNK: tl.constexpr = 4, RELEASE: tl.constexpr = False, P32: tl.constexpr = False):
    if PDL:  # a programmatic dependent of the GEMM: its partials are complete and visible after this
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    # P32: the partials' rows are the trtllm weight's physical rows (N % 32 == 0), mapped to their
    # logical rows within the same 64 output bytes
    dst = _p32_logical(offs) if P32 else offs
    if HAS_BIAS:
        bias = tl.load(b_ptr + dst % N, mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    # CHUNK partials per round trip, summed in split order
    for s in range(1, split_k, CHUNK):
        sv = offs * 0 + s  # the split as a tensor: the interpreter takes no scalar in a mask
        for j in tl.static_range(CHUNK):
            acc += tl.load(p_ptr + (s + j) * stride_ps + offs, mask=mask & (sv + j < split_k), other=0.0)
    if HAS_BIAS:
        acc += bias
    tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Decode (M <= 16): a weight stream with one FP8 tensor-core dot per 32-block
# --------------------------------------------------------------------------------------------
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
    if LAYOUT == 1:  # trtllm: logical row l lives at physical row 32*(l//32) + 8*(l%4) + (l%32)//4
        rows = (rows // 32) * 32 + 8 * (rows % 4) + (rows % 32) // 4
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
                    total += tl.load(ws_ptr + s * stride_os + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
                tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + pid_n, 0)  # re-arm for the next call


# --------------------------------------------------------------------------------------------
# GEMV (M <= 4): the weight stream on CUDA cores, no tensor-core round trips
# --------------------------------------------------------------------------------------------
@triton.jit
def _quantized_x_row(x_row, kt, BLOCK_K: tl.constexpr):
    """K-tile ``kt`` of one activation row as its exact MXFP8 value ``q * 2^(code-127)`` (fp32)."""
    x = tl.load(x_row + kt * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
    deq, _r, _c = _mx_fake_quant(tl.reshape(x, (1, BLOCK_K // 32, 32)), 2)
    return tl.reshape(deq, (BLOCK_K,))


@triton.jit
def _gemv_row(acc, wf, sw, x_row, kt, FUSE_QUANT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
def _gemv_words_row(acc, w0, w1, w2, w3, sw, x_row, kt, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`_gemv_row` (activations quantized here) on weights given as fp32 [BN, BK/4] per byte
    position ``j`` of each int32 word (K index ``4*i + j``), scaled by 2^-8 (undone before the
    scale)."""
    even, odd = tl.split(tl.reshape(_quantized_x_row(x_row, kt, BLOCK_K), (BLOCK_K // 4, 2, 2)))  # K index 4i+2a / 4i+2a+1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    prod = w0 * x0[None, :] + w1 * x1[None, :] + w2 * x2[None, :] + w3 * x3[None, :]
    part = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 32, 8)), axis=2)
    return acc + (part * 256.0) * sw


@triton.jit
def _gemv_perm_row(acc, w0, w1, w2, w3, sw, x_row, kq, kt, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`_gemv_words_row` with the activation row already quantized and permuted
    (:func:`quantize_activations` ``permuted=True``): each ``x_j`` is loaded as a [BN, BK/4] tile
    of the same shape and contiguity as the weight words (zero row stride), so it arrives in
    the weights' register layout: no shared-memory layout conversion per K-tile."""
    offs = (kt * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4))[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
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
        tl.store(ws_ptr + tl.program_id(1).to(tl.int64) * stride_os + m * N + offs_n, res, mask=mask)
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
    if LAYOUT == 1:  # trtllm: logical row l lives at physical row 32*(l//32) + 8*(l%4) + (l%32)//4
        rows = (rows // 32) * 32 + 8 * (rows % 4) + (rows % 32) // 4
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
                    acc1 = _gemv_perm_row(acc1, b0, b1, b2, b3, sw, x1, K // 4, kt, BLOCK_N, BLOCK_K)
                if BLOCK_M > 2:
                    acc2 = _gemv_perm_row(acc2, b0, b1, b2, b3, sw, x2, K // 4, kt, BLOCK_N, BLOCK_K)
                    acc3 = _gemv_perm_row(acc3, b0, b1, b2, b3, sw, x3, K // 4, kt, BLOCK_N, BLOCK_K)
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

    _gemv_epilogue(acc0, 0, M, N, offs_n, rows_n, b_ptr, out_ptr, ws_ptr, stride_om, stride_os, HAS_BIAS, PARTIAL)
    if BLOCK_M > 1:
        _gemv_epilogue(acc1, 1, M, N, offs_n, rows_n, b_ptr, out_ptr, ws_ptr, stride_om, stride_os, HAS_BIAS, PARTIAL)
    if BLOCK_M > 2:
        _gemv_epilogue(acc2, 2, M, N, offs_n, rows_n, b_ptr, out_ptr, ws_ptr, stride_om, stride_os, HAS_BIAS, PARTIAL)
        _gemv_epilogue(acc3, 3, M, N, offs_n, rows_n, b_ptr, out_ptr, ws_ptr, stride_om, stride_os, HAS_BIAS, PARTIAL)
    if SERIAL:  # the last split of these rows to arrive sums the partials: no second launch
        tl.debug_barrier()  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            for m in range(0, M):
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for s in range(0, split_k):
                    total += tl.load(ws_ptr + s * stride_os + m * N + offs_n, mask=offs_n < N, other=0.0,
                                     cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + rows_n).to(tl.float32)
                tl.store(out_ptr + m * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < N)
            tl.atomic_xchg(lock_ptr + pid_n, 0)  # re-arm for the next call


# --------------------------------------------------------------------------------------------
# Large M: the weight dequantized chunk by chunk, multiplied by cuBLAS
# --------------------------------------------------------------------------------------------
@triton.jit
def _dequantize_weight_kernel(
    w_ptr, s_ptr, out_ptr, N, n0, stride_wn, stride_on, scale_c, scale_cp4,
    LAYOUT: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[l - n0, k] = w[l, k] * 2^(code[l, k/32]-127) for logical rows l in [n0, N), in logical
    row order, read from the laid-out bytes (the gather and scale offsets of the GEMM kernels).
    Exact in bf16 (e4m3 has a 4-bit significand, UE8M0 scales are powers of two)."""
    offs_n = n0 + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kt = tl.program_id(1)
    rows = tl.minimum(offs_n, N - 1)  # clamp the tail: loads stay in bounds, stores are masked
    if LAYOUT == 1:  # trtllm: logical row l lives at physical row 32*(l//32) + 8*(l%4) + (l%32)//4
        rows = (rows // 32) * 32 + 8 * (rows % 4) + (rows % 32) // 4
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + kt * BLOCK_K + offs_k[None, :])
    s_base = s_ptr + _scale_row_base(rows, scale_c, scale_cp4, LAYOUT)[:, None]
    wd = _dequant_weight(w, _load_codes(s_base, kt, BLOCK_K, LAYOUT), BLOCK_N, BLOCK_K, DOT_BF16)
    dst = (offs_n - n0).to(tl.int64)[:, None] * stride_on + kt * BLOCK_K + offs_k[None, :]
    tl.store(out_ptr + dst, wd.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tile shape and launch parameters of one GEMM call (``block_n`` = weight rows per tile)."""

    block_n: int
    block_m: int
    block_k: int
    split_k: int = 1
    fuse_quant: bool = True
    num_warps: int = 4
    num_stages: int = 3
    group_n: int = 8
    w_in_regs: bool = True
    serial_reduce: bool = False  # split-K: the last CTA of a tile sums the partials (one launch)
    decode: bool = False  # M <= 16: the FP8-dot weight stream (_mxfp8_decode_kernel)
    gemv: bool = False  # M <= 4: the CUDA-core weight stream (_mxfp8_gemv_kernel)
    words: bool = True  # gemv: convert the weight bytes from int32 words with integer ops
    cublas: bool = False  # large M: dequantize the weight chunk by chunk, bf16 GEMM by cuBLAS
    wgmma: bool = False  # M <= 16: the Gluon kernel, FP8 wgmma per 32-block, four in flight
    chunk_n: int = 0  # cublas: weight rows dequantized per chunk (0: as many as the workspace holds)
    sw_ahead: int = 1  # wgmma: K-tiles ahead of use that the weight scale words are loaded
    pdl: bool = False  # wgmma: programmatic dependent launch (``gluon_mxfp8.wgmma_decode``)
    red_chunk: int = 4  # wgmma: split-K partials loaded per round trip by the reducing program or kernel
    x_words: bool = True  # wgmma, fused: bf16 activations loaded as int32 words of two (``wgmma_decode``)
    cluster: bool = False  # wgmma, split-K: the splits of a row tile are one cluster, summed through DSMEM
    prefetch: bool = False  # wgmma with PDL: the weight's first tiles loaded before waiting for the inputs
    red_release: bool = False  # wgmma with PDL: the split-K reduction kernel lets the next kernel launch at once
    phys_partials: bool = False  # wgmma, two kernels: partials in the weight's physical row order
    x_prefetch: bool = False  # wgmma with the prefetch: the activations' lines also asked of L2 before the wait

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _fit_block_k(k: int, want: int) -> int:
    """Largest of ``want, want/2, ..., 32`` dividing ``k`` (K % 32 == 0 is checked earlier)."""
    bk = want
    while k % bk:
        bk //= 2
    return bk


def _no_empty_splits(k_tiles: int, split: int) -> int:
    """The split-K count the kernels that give each split ``cdiv(k_tiles, split)`` K-tiles really
    use: at most ``split``, none of the splits empty."""
    return _cdiv(k_tiles, _cdiv(k_tiles, split))


#: Programs per thread-block cluster the wgmma kernel's launch accepts (``wgmma_config(cluster=True)``):
#: up to 8 (portable), and 16, which Triton's launcher allows as non-portable (Hopper, Blackwell)
CLUSTER_SIZES = (2, 3, 4, 5, 6, 7, 8, 16)

#: Below this many weight elements a decode GEMM runs as one kernel (activation quantization
#: fused, split-K reduced by the last CTA); above it, three (quantize, GEMM, reduce) are faster.
SMALL_WEIGHT = 40_000_000


def _pow2_split(tiles: int, k_tiles: int, target: int, min_k_tiles: int) -> int:
    """Smallest power-of-two split-K with ``tiles * split >= target`` (each split >= min_k_tiles)."""
    split = 1
    while tiles * split < target and k_tiles // (split * 2) >= min_k_tiles:
        split *= 2
    return split


def _wave_eff(ctas: int, sms: int) -> float:
    return ctas / (triton.cdiv(ctas, sms) * sms)


#: The decode kernel pads M to this (the N of its FP8 MMA); it serves M <= DECODE_BLOCK_M.
DECODE_BLOCK_M = 16


def _has_fp8_mma(device: torch.device) -> bool:
    """FP8 tensor-core dots (SM89+), or the interpreter (which runs them in float32)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def decode_config(m: int, n: int, k: int, device: torch.device, *, block_n: int = 64, block_k: int = 256,
                  num_warps: int = 4, num_stages: int = 5, fuse_quant: bool = False, waves: float = 2.0,
                  serial_reduce: bool = True) -> GemmConfig:
    """Config of the decode kernel: BLOCK_N weight rows per program, split-K up to ~``waves`` x SMs
    programs (each split keeps >= 1 K-tile; no empty splits)."""
    sms = _num_sms(device)
    bk = _fit_block_k(k, block_k)
    tiles = triton.cdiv(n, block_n)
    k_tiles = k // bk
    split = max(1, min(triton.cdiv(int(waves * sms), tiles), k_tiles))
    split = _no_empty_splits(k_tiles, split)
    return GemmConfig(block_n, DECODE_BLOCK_M, bk, split_k=split, fuse_quant=fuse_quant, num_warps=num_warps,
                      num_stages=num_stages, serial_reduce=serial_reduce, decode=True)


#: The GEMV kernel keeps one accumulator per activation row; it serves M <= GEMV_MAX_M.
GEMV_MAX_M = 4


def gemv_config(m: int, n: int, k: int, device: torch.device, *, block_n: int = 32, block_k: int = 256,
                num_warps: int = 4, fuse_quant: bool = True, waves: float = 4.0,
                serial_reduce: bool = True, words: bool = True) -> GemmConfig:
    """Config of the GEMV kernel: BLOCK_N weight rows per program, split-K up to ~``waves`` x SMs
    programs (each split keeps >= 1 K-tile; no empty splits)."""
    if m > GEMV_MAX_M:
        raise LayoutError(f"the GEMV kernel serves M <= {GEMV_MAX_M}, got M={m}")
    sms = _num_sms(device)
    bk = _fit_block_k(k, block_k)
    tiles = triton.cdiv(n, block_n)
    k_tiles = k // bk
    split = max(1, min(triton.cdiv(int(waves * sms), tiles), k_tiles))
    split = _no_empty_splits(k_tiles, split)
    return GemmConfig(block_n, triton.next_power_of_2(max(m, 1)), bk, split_k=split, fuse_quant=fuse_quant,
                      num_warps=num_warps, num_stages=1, serial_reduce=serial_reduce, gemv=True, words=words)


def _gluon():
    """The Gluon module, or None where Gluon (Triton >= 3.6's ``triton.experimental.gluon``) is missing."""
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        return None  # Gluon's Hopper API before 3.6 differs from the one the kernel is written for
    try:
        from mxfp8_convert.runtime import gluon_mxfp8
    except ImportError:
        return None
    return gluon_mxfp8


def _red_chunk(split: int) -> int:
    """Split-K partials loaded per round trip when the last program of a row tile sums them: all
    of them in one trip up to 16, at least 4 (measured: 16 at a time beat 4 by up to x0.27 bf16 on
    10-28 splits, 8 beat 16 at 5-8)."""
    return min(16, max(4, triton.next_power_of_2(split)))


def wgmma_config(m: int, n: int, k: int, device: torch.device, *, stages: int = 2, waves: float = 3.0,
                 serial_reduce: bool = True, fuse_quant: bool = False, sw_ahead: int = 1,
                 pdl: bool = False, red_chunk: int = 0, max_split: int = 0, cluster: bool = False,
                 block_n: int = 64) -> GemmConfig:
    """Config of the Gluon wgmma decode kernel: ``block_n`` physical weight rows per program (64:
    one warpgroup; 128: two, sharing each quantized activation tile; ``waves`` then counts pairs
    of 64-row programs), 128-wide
    K-tiles in a ring of ``stages`` TMA buffers, weight scale words loaded ``sw_ahead`` K-tiles
    ahead, split-K up to ~``waves`` x SMs programs (none when the row tiles alone fill 2.5 waves:
    measured faster on DeepSeek q_b/kv_b), summed by the last program of each row tile
    (``serial_reduce``) or by a second kernel; activations quantized by a kernel before the GEMM,
    or inside it (``fuse_quant``: each program quantizes the K-tiles it reads); at most
    ``max_split`` splits when given. ``cluster``: the splits of a row tile run as one thread-block
    cluster, K-tiles spread evenly over them, and are summed through distributed shared memory;
    the split is then the largest cluster size (:data:`CLUSTER_SIZES`) up to the one above (no
    cluster where that is 1)."""
    sms = _num_sms(device)
    tiles = triton.cdiv(n, block_n)
    k_tiles = k // 128
    split = 1 if tiles >= 2.5 * sms else max(1, min(triton.cdiv(int(waves * sms), tiles), k_tiles))
    split = min(split, max_split or split)
    if cluster:  # the K-tiles spread evenly over the cluster (none empty)
        split = max(s for s in (1, *CLUSTER_SIZES) if s <= split)
        cluster = split > 1
    else:
        split = _no_empty_splits(k_tiles, split)
    red_chunk = red_chunk or _red_chunk(split)
    return GemmConfig(block_n, 16, 128, split_k=split, fuse_quant=fuse_quant, num_warps=block_n // 16,
                      num_stages=stages,
                      serial_reduce=serial_reduce, wgmma=True, sw_ahead=sw_ahead, pdl=pdl, red_chunk=red_chunk,
                      cluster=cluster)


#: Below this many weight elements the wgmma kernel runs with fewer programs (~2 per SM at
#: M <= 8, ~1 at M = 9..16, instead of ~3 / ~2) and sums the partials in its last program; at
#: M = 1 without programmatic dependent launch the GEMV kernel stays faster.
WGMMA_SMALL_WEIGHT = 8_000_000
#: From this many weight elements, ~3 programs per SM at M = 9..16 (below, ~2).
WGMMA_MID_WEIGHT = 20_000_000
#: At M = 5..8, split-K partials are summed by a second kernel where K is split at most this
#: many ways, on weights of :data:`WGMMA_SMALL_WEIGHT` to :data:`WGMMA_HUGE_WEIGHT` elements; at
#: M = 9..16 wherever K is split, except more than this many ways on weights under
#: :data:`WGMMA_SMALL_WEIGHT`; elsewhere (and at M <= 4) by the last program of each row tile.
WGMMA_TWO_KERNEL_SPLIT = 8
#: At M = 9..16, split-K partials go through distributed shared memory (a cluster per row tile)
#: on weights of at most this many 64-row tiles (:func:`wgmma_rule`).
WGMMA_CLUSTER_MAX_TILES = 32
#: At M = 9..16, programs of 128 weight rows (two warpgroups; their registers allow two per SM)
#: in clusters of this many, where that makes :data:`WGMMA_WIDE_PER_SM` programs per SM; where a
#: second kernel sums the partials, with the split that makes that many (:func:`_wide_split`).
WGMMA_WIDE_CLUSTER = 4
WGMMA_WIDE_PER_SM = (1.5, 2.0)
WGMMA_HUGE_WEIGHT = 64_000_000
#: At M = 9..16, where a second kernel sums the partials, K is split into splits of this many
#: K-tiles each where that is 2-8 splits of at most :data:`WGMMA_EVEN_PER_SM` programs per SM.
WGMMA_SPLIT_TILES = 4
WGMMA_EVEN_PER_SM = 4


def _driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports, or None where torch does not say."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        v = get() if get is not None else 0
    except RuntimeError:
        return None
    return (v // 1000, v % 1000 // 10) if v else None


def pdl_enabled(device: torch.device) -> bool:
    """Whether the wgmma path launches its kernels as programmatic dependents (PDL): on Hopper or
    newer, with a CUDA 12.4+ build of torch and driver (CUDA graphs capture the programmatic
    edges), unless ``MXFP8_PDL=0``. FlashInfer enables PDL by default on the same GPUs (``device_support_pdl``).
    Each kernel waits for the previous one before it reads the activations or writes anything
    (``gluon_mxfp8.wgmma_decode``); only the weight's first tile and scale words are loaded
    before that wait (:func:`weight_prefetch`; the activations' lines are only asked of L2 then, a
    hint that reads no value), so the previous kernel must not be the one that
    writes the weight (an in-place weight update is followed by a synchronization, or run with
    ``MXFP8_PDL=strict``: every memory access after the wait). A kernel launched without the
    attribute is not affected."""
    if (os.environ.get("MXFP8_PDL", "1") == "0" or gdc_wait is None or device.type != "cuda"
            or not torch.version.cuda):
        return False
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    driver = _driver_cuda_version()  # minor-version compatibility lets a 12.4+ torch run on older drivers
    return (cuda >= (12, 4) and (driver is None or driver >= (12, 4))
            and torch.cuda.get_device_capability(device)[0] >= 9)


def wgmma_rule(m: int, n: int, k: int, device: torch.device, *, cluster: bool = True) -> GemmConfig | None:
    """The Gluon wgmma kernel's config where it measured fastest on the H200
    (benchmarks/NOTES_gemm.md, "Fifth session", calls 2, 4, 6 and 8; "Sixth session"; "Seventh
    session"), else None. Hopper with Gluon, K % 128 == 0, M <= 16; activations always quantized
    inside the kernel (scale words two K-tiles ahead).

    Split-K partials summed through distributed shared memory, the splits of a row tile one
    thread-block cluster (:func:`wgmma_config` with ``cluster``; seventh session, call 4): at
    M <= 8 everywhere K is split, with ~3 programs per SM and at most 8 splits, or 16 where 8 would
    leave a quarter of the SMs without a program (DeepSeek kv_a); at M = 9..16 where the weight has
    at most :data:`WGMMA_CLUSTER_MAX_TILES` row tiles, with ~2 programs per SM and up to 16 splits
    (more row tiles: clusters measured slower at 16 columns, Qwen q_proj 8.0-9.5 us vs 7.8); at
    least two K-tiles per split (Qwen k_proj, 20 K-tiles, M = 16: 8 splits 5.0 us, 16 5.5). Not on
    a device that refused a clustered launch (:data:`_CLUSTERS_REFUSED`). At M = 9..16, where
    programs of 128 weight rows (two warpgroups sharing each quantized activation tile) in
    clusters of 4 make 1.5-2 programs per SM (:data:`WGMMA_WIDE_PER_SM`; their registers allow
    two), those (eighth session, three runs: DeepSeek expert.down 8.4 us vs 9.2, o_proj 37.1-37.8
    vs 39.8-40.5, mlp.down 41.6-42.8 vs 45.2-46.0; the weights of N = 7168 on the H200).
    Elsewhere (and with ``cluster=False``, the sixth session's rule) the partials go through global
    memory, by weight size (elements):

    ========  ==========================  ================  ================
    M         < 8 M                       8 M .. 20 M       >= 20 M
    ========  ==========================  ================  ================
    1         2 waves (GEMV without PDL)  3 waves           3 waves
    2..8      2 waves                     3 waves           3 waves
    9..16     1 wave                      2 waves           3 waves
    ========  ==========================  ================  ================

    "waves": split-K up to that many programs per SM, from M = 4 at most 16 splits
    (:func:`wgmma_config`, which also sets how many partials are loaded per round trip when they
    are summed). The partials are summed by the last program to arrive, or by a second kernel: at
    M = 5..8 where K is split 2-8 ways on weights of 8 M to 64 M elements
    (:data:`WGMMA_TWO_KERNEL_SPLIT`), at M = 9..16 wherever K is split, except more than 8 ways on
    a weight under 8 M (sixth session, call 3: Qwen down_proj 10 splits 13.1 us vs 15.4, DeepSeek
    o_proj 39.9 vs 43.6, q_a 9.6 vs 10.1, Llama k_proj 6.9 vs 7.4; DeepSeek kv_a, 14 splits, 7.9
    vs 7.6). There, where K divides into 2-8 splits of 4 K-tiles (:data:`WGMMA_SPLIT_TILES`) that
    make at most 4 programs per SM, those splits instead of the waves' (tenth session, four runs:
    Llama q_proj 8.5-8.6 us vs 9.1-9.3 with 5 splits of up to 7 K-tiles, Llama o_proj 8.5-8.8 vs
    9.2-9.5, Qwen o_proj 6.9 vs 7.3-7.4 with 7 of up to 5; Qwen q_proj keeps its 5 of 4; Qwen
    gate_up, 5 x 152 row tiles, measured 12.5-12.8 vs 11.8-12.0 with 3 of up to 7). Ahead of
    both: programs of 128 rows where a split of K into at least 4 K-tiles each makes 1.5-2 of them
    per SM (the most even such split, :func:`_wide_split`; eleventh session, two runs each: Llama
    q_proj 8 splits 8.13 / 8.18 us vs 8.61 / 8.50, o_proj 8.22 / 8.12 vs 8.57 / 8.46, down_proj 8
    splits 20.5 / 20.3 vs 21.6 / 21.7, gate_up 2 splits 21.7 / 21.2 vs 23.8 / 23.3, Qwen gate_up 3
    splits 11.2 / 11.2 vs 11.9 / 11.7, down_proj 11 splits 11.1 / 11.1 vs 12.3 / 12.2; not where
    only 3 K-tiles a split make that many: Qwen o_proj 11 splits 7.14 / 7.15 vs 6.93 / 6.91, q_proj
    7 splits 6.78 / 6.86 vs 6.86 / 6.86). Programmatic dependent launch where
    :func:`pdl_enabled`, except for an unsplit K at M > 8 (DeepSeek q_b_proj, M = 16:
    x1.17 bf16 with it, x1.39 without: the next call's programs, launched early into the free
    slots, end up unevenly spread), with the weight prefetch, early release and physical-order
    partials of :func:`_launch_options` (ninth session).
    """
    if m > 16 or k % 128 or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    size = n * k
    if (size < WGMMA_SMALL_WEIGHT and m == 1 and not pdl_enabled(device)) or _gluon() is None:
        return None
    tiles = _cdiv(n, 64)
    clusters = cluster and _device_index(device) not in _CLUSTERS_REFUSED
    lo, hi = WGMMA_WIDE_PER_SM
    if clusters and m > 8 and k >= 1024 and lo <= WGMMA_WIDE_CLUSTER * _cdiv(n, 128) / _num_sms(device) <= hi:
        cfg = wgmma_config(m, n, k, device, waves=16, fuse_quant=True, sw_ahead=2, max_split=WGMMA_WIDE_CLUSTER,
                           cluster=True, block_n=128)
        return _launch_options(cfg, m, device)
    if clusters and (m <= 8 or tiles <= WGMMA_CLUSTER_MAX_TILES):
        cap = min(16 if m > 8 or tiles * 8 < 0.75 * _num_sms(device) else 8, k // 256)  # >= 2 K-tiles per split
        cfg = wgmma_config(m, n, k, device, waves=3 if m <= 8 else 2, fuse_quant=True, sw_ahead=2, max_split=cap,
                           cluster=True)
        if cfg.cluster:
            return _launch_options(cfg, m, device)
    if m <= 8:
        waves = 2 if size < WGMMA_SMALL_WEIGHT else 3
    else:
        waves = 1 if size < WGMMA_SMALL_WEIGHT else 2 if size < WGMMA_MID_WEIGHT else 3
    # from M = 4, K split at most 16 ways: the partials then take one round trip to sum (DeepSeek
    # kv_a, 576 rows: 14 splits x1.34 / x1.23 bf16 at M = 4 / 8 vs 28 splits x1.32 / x1.17)
    cfg = wgmma_config(m, n, k, device, waves=waves, fuse_quant=True, sw_ahead=2, max_split=16 if m >= 4 else 0)
    if m <= 8:
        two_kernel = m >= 5 and 1 < cfg.split_k <= WGMMA_TWO_KERNEL_SPLIT and WGMMA_SMALL_WEIGHT <= size < WGMMA_HUGE_WEIGHT
    else:  # 16-column partials: summed by a second kernel, but for many splits of a small weight
        two_kernel = cfg.split_k > 1 and (size >= WGMMA_SMALL_WEIGHT or cfg.split_k <= WGMMA_TWO_KERNEL_SPLIT)
        even = k // 128 // WGMMA_SPLIT_TILES  # splits of WGMMA_SPLIT_TILES K-tiles each
        if two_kernel and (wide := _wide_split(n, k, device)):  # 128-row programs, 1.5-2 per SM
            cfg = dataclasses.replace(cfg, block_n=128, num_warps=8, split_k=wide)
        elif (two_kernel and even * WGMMA_SPLIT_TILES * 128 == k and 2 <= even <= WGMMA_TWO_KERNEL_SPLIT
                and tiles * even <= WGMMA_EVEN_PER_SM * _num_sms(device)):
            cfg = dataclasses.replace(cfg, split_k=even)
    return _launch_options(dataclasses.replace(cfg, serial_reduce=not two_kernel), m, device)


def _wide_split(n: int, k: int, device: torch.device) -> int:
    """At M = 9..16, where a second kernel sums the partials: a split of K (2..16, none empty) into
    splits of at least :data:`WGMMA_SPLIT_TILES` K-tiles that gives programs of 128 weight rows
    :data:`WGMMA_WIDE_PER_SM` programs per SM, 0 where none does. Of those, the one whose splits
    are the most even (a row tile's programs last as long as its longest split), then the most
    programs: Qwen down_proj (76 K-tiles) 11 splits of up to 7, not 13 of up to 6 (eleventh
    session: 11.06-11.34 us vs 11.27-12.89, both layouts)."""
    k_tiles, pairs, sms = k // 128, _cdiv(n, 128), _num_sms(device)
    lo, hi = WGMMA_WIDE_PER_SM
    fits = [s for s in {_no_empty_splits(k_tiles, s) for s in range(2, 17)}
            if s >= 2 and _cdiv(k_tiles, s) >= WGMMA_SPLIT_TILES and lo <= pairs * s / sms <= hi]
    return max(fits, key=lambda s: (k_tiles / (s * _cdiv(k_tiles, s)), s), default=0)


def _launch_options(cfg: GemmConfig, m: int, device: torch.device) -> GemmConfig:
    """The rule's launch options for a wgmma config: programmatic dependent launch where
    :func:`wgmma_pdl`, with the weight's first tile and scale words loaded before the wait
    (``prefetch``); partials summed by a second kernel are stored in the weight's physical row
    order and mapped by that kernel (``phys_partials``), which, under PDL, lets the next kernel
    launch as soon as the partials are complete (``red_release``). Ninth session (NOTES_gemm.md):
    Qwen q_proj at M = 16 6.90-6.92 us vs 7.70-7.73, Qwen k_proj 4.6 vs 5.0. With the prefetch,
    each program also asks L2 for its activations' lines before the wait (``x_prefetch``, a hint
    that reads no value; twelfth session, cold activations, M = 16: Qwen k_proj 4.17 vs 4.55 us,
    DeepSeek q_a 7.14 vs 7.82, kv_a 5.18 vs 5.77, Qwen q_proj 6.71 vs 6.80; M = 8: Qwen q_proj 5.54
    vs 5.96; with activations already in L2 within +-3 %)."""
    pdl = wgmma_pdl(m, cfg.split_k, device)
    two_kernel = cfg.split_k > 1 and not cfg.cluster and not cfg.serial_reduce
    # the second kernel loads the first partial, then the others in chunks: all in one chunk, no
    # masked loads (Qwen q_proj, 5 splits: 4 at a time 6.82 / 6.85 us vs 8 at a time 6.97 / 6.91)
    chunk = min(16, triton.next_power_of_2(cfg.split_k - 1)) if two_kernel else cfg.red_chunk
    early = pdl and weight_prefetch()
    return dataclasses.replace(cfg, pdl=pdl, prefetch=early, x_prefetch=early, red_release=pdl and two_kernel,
                               phys_partials=two_kernel, red_chunk=chunk)


#: Devices (by index) on which the GPU refused a clustered launch of the wgmma kernel (a cluster
#: of that size did not fit: a partitioned or smaller Hopper): their split-K partials go through
#: global memory from then on (:func:`_launch_wgmma`).
_CLUSTERS_REFUSED: set[int] = set()


def _device_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for ``torch.device("cuda")``)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def weight_prefetch() -> bool:
    """Whether kernels launched with PDL load the weight's first K-tile and scale words, and ask L2
    for the activations' lines, before waiting for the previous kernel (default), or touch every
    byte after it (``MXFP8_PDL=strict``)."""
    return os.environ.get("MXFP8_PDL", "1") != "strict"


def wgmma_pdl(m: int, split_k: int, device: torch.device) -> bool:
    """Whether the wgmma path launches as a programmatic dependent: where :func:`pdl_enabled`,
    except for an unsplit K at M > 8 (see :func:`wgmma_rule`)."""
    return pdl_enabled(device) and not (m > 8 and split_k == 1)


def use_decode(m: int, n: int, k: int, device: torch.device) -> bool:
    """Where the decode kernel beat the tile kernel on the H200 (benchmarks/NOTES_gemm.md, decode
    section, run 2): M <= 4 on weights with enough 64-row tiles for two waves without split-K and
    K >= 1024 (DeepSeek q_b_proj and mlp.gate_up_proj: x1.06-1.10 bf16 vs x0.87-0.99). Everywhere
    else measured, the tile kernel was as fast or faster, so it stays the default."""
    return (m <= 4 and k >= 1024 and k % 256 == 0 and triton.cdiv(n, 64) >= 2 * _num_sms(device)
            and _has_fp8_mma(device))


#: Weights of at least this many elements stream best with more splits per SM in the GEMV kernel.
GEMV_LARGE_WEIGHT = 64_000_000
#: Below this many elements, 512-wide K-tiles (few, long programs) were fastest.
GEMV_SMALL_WEIGHT = 5_000_000


def gemv_rule(m: int, n: int, k: int, device: torch.device) -> GemmConfig | None:
    """The GEMV kernel's config where it measured fastest on the H200 (benchmarks/NOTES_gemm.md,
    "GEMV kernel"), else None: M <= 2 on every shape measured. 512-wide K-tiles (fused
    quantization) for weights under 5 M elements; activations quantized once and pre-permuted
    (one launch more, no per-row layout conversion) with ~8 programs per SM for weights of
    >= 64 M elements; in between, M = 1: fused quantization, 16- or 32-row programs, ~4 per SM,
    and M = 2: pre-permuted activations, ~2 programs per SM."""
    if m > 2 or k % 128:
        return None
    if n * k < GEMV_SMALL_WEIGHT and k % 512 == 0:
        return gemv_config(m, n, k, device, block_k=512)
    if n * k >= GEMV_LARGE_WEIGHT:
        return gemv_config(m, n, k, device, fuse_quant=False, waves=8)
    if m == 1:  # 16-row programs where there are many rows and long ones (measured: N >= 4096, K >= 2048)
        return gemv_config(m, n, k, device, block_n=16 if n >= 4096 and k >= 2048 else 32)
    return gemv_config(m, n, k, device, fuse_quant=False, waves=2)


#: From this M on, dequantizing the weight once and multiplying with cuBLAS beat the tile kernel
#: (which dequantizes every weight tile once per M-tile) on the H200: at M = 256 on 15 of 19 model
#: shapes (median x0.51 vs x0.44 bf16), at M >= 512 on all; at M = 128 the tile kernel won
#: (x0.56 vs x0.47). benchmarks/NOTES_gemm.md, "cuBLAS path".
CUBLAS_MIN_M = 256
#: Elements of the bf16 weight workspace of the cuBLAS path (128 MiB); larger weights go in chunks.
#: Smaller workspaces (8-32 M elements, kept in L2) measured no faster, often slower.
DEQUANT_WORKSPACE = 64 * 1024 * 1024


def cublas_config(m: int, n: int, k: int, device: torch.device, *, chunk_n: int = 0) -> GemmConfig:
    """Config of the cuBLAS path: 64 x 256 dequantization tiles, ``chunk_n`` rows per chunk
    (default: the most multiple-of-128 rows whose bf16 copy fits :data:`DEQUANT_WORKSPACE`)."""
    if not chunk_n:
        chunk_n = min(n, max(128, DEQUANT_WORKSPACE // k // 128 * 128))
    return GemmConfig(64, 0, _fit_block_k(k, 256), fuse_quant=False, cublas=True, chunk_n=chunk_n)


@functools.lru_cache(maxsize=4096)
def default_config(m: int, n: int, k: int, device: torch.device, pdl_env: str | None, *,
                   wgmma: bool = True) -> GemmConfig:
    """:func:`choose_config`, memoized per shape, device and ``MXFP8_PDL`` value (the other inputs of
    the rules, the device's capability and SM count and the installed CUDA and Triton, do not
    change within a process): the choice costs tens of microseconds of Python, which an eager
    decode step would pay per linear layer (``benchmarks/bench_gemm.py host``, on a GPU)."""
    return choose_config(m, n, k, device, wgmma=wgmma)


def choose_config(m: int, n: int, k: int, device: torch.device, *, decode: bool = True,
                  cublas: bool = True, wgmma: bool = True) -> GemmConfig:
    """Tile choice by M bucket; rules fitted to sweeps on one H200 (benchmarks/NOTES_gemm.md).

    - :func:`wgmma_rule` (M <= 16, Hopper; ``wgmma=False`` skips it): the Gluon kernel, FP8 wgmma
      per 32-block with four in flight, weights by TMA, activations quantized inside it,
      programmatic dependent launch where :func:`pdl_enabled`.
    - :func:`gemv_rule` (M <= 2): the CUDA-core GEMV kernel.
    - :func:`use_decode` (M <= 4 on large-N weights): the decode kernel, one FP8 MMA per 32-block
      (``decode=False`` skips these two, for comparisons).
    - M <= 64: a weight stream. 64-row weight tiles, split-K up to ~2 CTAs per SM for
      small weights (< 40 M elements: one kernel, activations quantized inside the GEMM, the last
      CTA of each tile reduces the splits) and ~4 per SM for large ones (separate quantize and
      reduce kernels, which then cost less than the fused quantization's ALU work).
    - M >= :data:`CUBLAS_MIN_M` (``cublas=False`` skips it): :func:`cublas_config`, the weight
      dequantized exactly into a bounded bf16 workspace by our kernel, multiplied by cuBLAS.
    - Otherwise (and with ``cublas=False``): M <= 1024: 128x128 tiles (64x64 when N <= 2048),
      split-K while < half the SMs are busy; larger: 128x256x64 tiles, 8 warps, split-K=2 when it
      fixes a poor last wave.
    """
    if cublas and m >= CUBLAS_MIN_M:
        return cublas_config(m, n, k, device)
    if decode and wgmma and (cfg := wgmma_rule(m, n, k, device)) is not None:
        return cfg
    if decode and (cfg := gemv_rule(m, n, k, device)) is not None:
        return cfg
    if decode and use_decode(m, n, k, device):
        return decode_config(m, n, k, device)
    sms = _num_sms(device)
    small = n * k < SMALL_WEIGHT
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        cfg = GemmConfig(64, bm, _fit_block_k(k, 128), fuse_quant=small and m <= 16,
                         num_warps=4, num_stages=4, serial_reduce=small)
        tiles = triton.cdiv(n, 64) * triton.cdiv(m, bm)
        target = int(1.9 * sms) if small else 4 * sms
        return dataclasses.replace(cfg, split_k=_pow2_split(tiles, k // cfg.block_k, target, 2))
    if m <= 1024:
        if n <= 2048:
            cfg = GemmConfig(64, 64, _fit_block_k(k, 128), fuse_quant=False, num_warps=4, num_stages=4)
        else:
            cfg = GemmConfig(128, 128, _fit_block_k(k, 64), fuse_quant=False, num_warps=8, num_stages=4)
        tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
        return dataclasses.replace(cfg, split_k=_pow2_split(tiles, k // cfg.block_k, sms // 2, 4),
                                   serial_reduce=False)
    cfg = GemmConfig(128, 256, _fit_block_k(k, 64), fuse_quant=False, num_warps=8,
                     num_stages=4 if m <= 4096 else 3, serial_reduce=False)
    tiles = triton.cdiv(n, 128) * triton.cdiv(m, 256)
    if _wave_eff(2 * tiles, sms) > _wave_eff(tiles, sms) + 0.1 and k // 2 >= 2048:
        cfg = dataclasses.replace(cfg, split_k=2)
    return cfg


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if not interpreting():
        raise LayoutError(
            f"the triton engine needs CUDA tensors (got {t.device}); "
            "on CPU use engine='reference' or set TRITON_INTERPRET=1 before importing triton"
        )


def quantize_activations(
    x: torch.Tensor, *, dequantized: bool = True, codes: bool = False, block_m: int = 32,
    block_k: int = 128, permuted: bool = False,
) -> dict[str, torch.Tensor]:
    """Quantize ``x [M, K]`` to MXFP8 (FlashInfer's recipe) with one Triton kernel.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 with unit stride along K, ``K % 32 == 0``.
        dequantized: also return ``"deq"``: ``q * 2^(code-127)`` as bf16 ``[M, K]`` (exact);
            float32 under the interpreter.
        codes: also return ``"q"`` (float8_e4m3fn ``[M, K]``) and ``"code"`` (uint8 ``[M, K/32]``,
            linear).
        block_m, block_k: tile of one program.
        permuted: ``"deq"`` as float32 ``[M, 4, K/4]`` holding element ``k`` at ``(k % 4, k // 4)``
            (the order in which the GEMV kernel reads weight bytes from int32 words).

    Returns:
        dict with the requested tensors.
    """
    _check_device(x)
    m, k = x.shape
    if k % 32 or x.stride(1) != 1:
        raise LayoutError(f"activations must be [M, K] with K % 32 == 0 and unit K stride, got {list(x.shape)}")
    out: dict[str, torch.Tensor] = {}
    deq_dtype = torch.float32 if x.device.type == "cpu" or permuted else torch.bfloat16
    deq = torch.empty((m, k), dtype=deq_dtype, device=x.device) if dequantized else x
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device) if codes else x
    code = torch.empty((m, k // 32), dtype=torch.uint8, device=x.device) if codes else x
    block_k = min(block_k, triton.next_power_of_2(k))
    grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    _quantize_kernel[grid](x, deq, q, code, m, k, x.stride(0), WRITE_DEQ=dequantized,
                           WRITE_Q=codes, BLOCK_M=block_m, BLOCK_K=block_k, PERM_DEQ=permuted, num_warps=4)
    if dequantized:
        out["deq"] = deq.view(m, 4, k // 4) if permuted else deq
    if codes:
        out["q"] = q.view(torch.float8_e4m3fn)
        out["code"] = code
    return out


_LOCKS: dict[torch.device, torch.Tensor] = {}


def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python, for the launch paths: Triton's costs ~3 us of Python per
    call (a constexpr function), several per launch (``benchmarks/bench_host.py``)."""
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python (n >= 1), for the launch paths."""
    return 1 << (n - 1).bit_length()


def _tile_locks(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-device int32 arrival counters of the serial split-K reduction, zero between calls.

    Each counter is reset by the CTA that finishes its tile, so the buffer is allocated (zeroed)
    once and reused; grow it before capturing a CUDA graph. Calls that run concurrently on two
    streams of one device must not share it: use ``serial_reduce=False`` there.
    """
    buf = _LOCKS.get(device)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = buf
    return buf


def _split_k_buffers(out: torch.Tensor, cfg: GemmConfig, tiles: int):
    """``(partial, serial, ws, lock)`` of a launch over ``tiles`` output tiles into ``out`` [M, N]:
    the fp32 split-K workspace (``out`` when unsplit) and the arrival counters (``ws`` when unused)."""
    m, n = out.shape
    partial = cfg.split_k > 1
    serial = partial and cfg.serial_reduce
    ws = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=out.device) if partial else out
    lock = _tile_locks(out.device, tiles) if serial else ws
    return partial, serial, ws, lock


def _reduce_splits(ws: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, cfg: GemmConfig, has_bias: bool,
                   pdl: bool = False, p32: bool = False, block: int = 1024) -> None:
    """Sum the split-K partials ``ws`` (+ bias) into ``out`` with a second kernel (``pdl``: launched
    as a programmatic dependent of the GEMM, which lets it launch early; ``p32``: the partials' rows
    are in the trtllm weight's physical order)."""
    total = out.shape[0] * out.shape[1]
    _splitk_reduce_kernel[(_cdiv(total, block),)](
        ws, bias, out, out.shape[1], total, total, cfg.split_k, HAS_BIAS=has_bias, BLOCK=block, PDL=pdl,
        CHUNK=cfg.red_chunk, RELEASE=cfg.red_release, P32=p32, num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )


def _scale_operand(weight: MXFP8Weight) -> torch.Tensor:
    """The scale bytes as the kernel reads them: int32 words for 128x4 tiles, else uint8."""
    s = weight.scale
    if weight.layout == CANONICAL:
        return s
    if not s.is_contiguous() or s.data_ptr() % 4:
        raise LayoutError(f"{weight.name or 'weight'}: 128x4 scale tiles must be contiguous and 4-byte aligned")
    return s.view(torch.int32)


def _scale_geometry(weight: MXFP8Weight) -> tuple[int, int]:
    """(C, Cp/4) of the weight's scale buffer: linear columns and 128x4 column tiles."""
    n, k = weight.shape
    c = k // 32
    return c, (c + 3) // 4


def triton_linear(
    x: torch.Tensor,
    weight: MXFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``bf16(fq(x) @ dq(W).T + bias)`` on the laid-out bytes of ``weight``.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 activations (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        weight: trtllm, cutlass or canonical :class:`MXFP8Weight` on the same device.
        bias: optional ``[N]``, added in fp32 before the rounding to bf16.
        out: optional contiguous bf16 ``[M, N]`` to write into.
        config: tile choice; :func:`choose_config` when omitted.

    Returns:
        bf16 ``[M, N]`` (``out`` when given).
    """
    _check_device(x)
    m, k = x.shape
    n, kw = weight.shape
    if kw != k:
        raise LayoutError(f"{weight.name or 'weight'}: input has K={k}, weight has K={kw}")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise LayoutError(f"out must be a contiguous bf16 [{m}, {n}] tensor")
    if m == 0:
        return out
    if x.device.type == "cpu":  # interpreter: its fp32->bf16 cast truncates; round on the host
        out.copy_(_launch(x, weight, bias, torch.empty((m, n), device=x.device), config))
        return out
    return _launch(x, weight, bias, out, config)


def _launch(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    config: GemmConfig | None,
) -> torch.Tensor:
    """Run the quantize (large M), GEMM and split-K reduce kernels into ``out`` [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        pdl_env = os.environ.get("MXFP8_PDL")
        cfg = default_config(m, n, k, x.device, pdl_env)
        if cfg.wgmma and not _gluon().supported(weight, k):  # e.g. canonical or unaligned weight bytes
            cfg = default_config(m, n, k, x.device, pdl_env, wgmma=False)
    else:
        cfg = config
    if k % cfg.block_k:
        raise LayoutError(f"block_k={cfg.block_k} does not divide K={k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if cfg.decode:
        return _launch_decode(x, weight, bias, out, cfg)
    if cfg.gemv:
        return _launch_gemv(x, weight, bias, out, cfg)
    if cfg.cublas:
        return _launch_cublas(x, weight, bias, out, cfg)
    if cfg.wgmma:
        return _launch_wgmma(x, weight, bias, out, cfg)
    a = x if cfg.fuse_quant else quantize_activations(x)["deq"]
    c, cp4 = _scale_geometry(weight)
    has_bias = bias is not None
    bias_t = bias if has_bias else out
    tiles = _cdiv(n, cfg.block_n) * _cdiv(m, cfg.block_m)
    partial, serial, ws, lock = _split_k_buffers(out, cfg, tiles)
    _mxfp8_gemm_kernel[(tiles, cfg.split_k)](
        a, weight.data, _scale_operand(weight), bias_t, out, ws, lock,
        m, n, k, a.stride(0), weight.data.stride(0), n, m * n, c, cp4, cfg.split_k,
        LAYOUT=LAYOUT_CODE[weight.layout], QUANT_X=cfg.fuse_quant, W_IN_REGS=cfg.w_in_regs,
        DOT_BF16=x.device.type == "cuda", HAS_BIAS=has_bias,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        PARTIAL=partial, SERIAL=serial, GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial and not serial:
        _reduce_splits(ws, bias_t, out, cfg, has_bias)
    return out


def _scale_tile(weight: MXFP8Weight, block_k: int) -> int:
    """How the decode kernel reads scales: 2 = one [BN, 2]-word load per 256-wide K-tile (split
    into columns), 1 = [BN, BK/128] words per K-tile, 0 = one load per 32-block (canonical)."""
    if weight.layout == CANONICAL or block_k % 128:
        return 0
    return 2 if block_k == 256 else 1


def _quantize_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 bytes ``[M, K]`` and int32 codes ``[M, K/32]`` of ``x`` (32-bit code loads pipeline)."""
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    xc = torch.empty((m, k // 32), dtype=torch.int32, device=x.device)
    bk = min(128, _next_pow2(k))
    _quantize_kernel[(_cdiv(m, 16), _cdiv(k, bk))](
        x, x, xq, xc, m, k, x.stride(0), WRITE_DEQ=False, WRITE_Q=True, BLOCK_M=16, BLOCK_K=bk, num_warps=4)
    return xq.view(torch.float8_e4m3fn), xc


def _launch_wgmma(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor, cfg: GemmConfig,
) -> torch.Tensor:
    """Activation quantization (unless the kernel does it: bf16, fp16 or fp32 activations, the
    same bits as the quantization kernel's), the Gluon wgmma decode kernel, and the split-K
    reduction (unless serial or through a cluster's shared memory). Where the GPU refuses a
    clustered launch (its error names the cluster), the call runs with the partials summed by the
    last program instead, and so does every later call on that device (:data:`_CLUSTERS_REFUSED`)."""
    gluon = _gluon()
    if gluon is None:
        raise LayoutError("the wgmma decode kernel needs Triton's Gluon (triton >= 3.6)")
    xq, xc = (x, None) if cfg.fuse_quant else _quantize_codes(x)
    has_bias = bias is not None
    partial, serial, ws, lock = (False, False, None, None) if cfg.cluster else _split_k_buffers(
        out, cfg, _cdiv(weight.shape[0], cfg.block_n))
    try:
        gluon.wgmma_decode(xq, weight, bias, out, ws if partial else None, lock if serial else None,
                           split_k=cfg.split_k, xc=xc, stages=cfg.num_stages, sw_ahead=cfg.sw_ahead, pdl=cfg.pdl,
                           red_chunk=cfg.red_chunk, x_words=cfg.x_words, cluster=cfg.cluster, block_n=cfg.block_n,
                           prefetch=cfg.prefetch, phys_partials=cfg.phys_partials, x_prefetch=cfg.x_prefetch)
    except RuntimeError as err:
        if not cfg.cluster or "cluster" not in str(err).lower():
            raise
        _CLUSTERS_REFUSED.add(_device_index(x.device))
        default_config.cache_clear()  # the memoized rule chose clusters
        split = _no_empty_splits(x.shape[1] // 128, cfg.split_k)  # the global-memory kernel's splits
        return _launch_wgmma(x, weight, bias, out, dataclasses.replace(cfg, cluster=False, split_k=split,
                                                                       serial_reduce=True))
    if partial and not serial:
        _reduce_splits(ws, bias if has_bias else out, out, cfg, has_bias, pdl=cfg.pdl,
                       p32=weight.layout == "trtllm" and cfg.phys_partials)
    return out


def _launch_decode(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor, cfg: GemmConfig,
) -> torch.Tensor:
    """The decode kernel (+ activation quantization unless fused, + reduce unless serial)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > cfg.block_m:
        raise LayoutError(f"the decode kernel serves M <= block_m={cfg.block_m}, got M={m}")
    if cfg.block_k % 32 or k % cfg.block_k:
        raise LayoutError(f"block_k={cfg.block_k} must be a multiple of 32 dividing K={k}")
    xq, xc = (x, x) if cfg.fuse_quant else _quantize_codes(x)
    c, cp4 = _scale_geometry(weight)
    has_bias = bias is not None
    bias_t = bias if has_bias else out
    tiles = _cdiv(n, cfg.block_n)
    partial, serial, ws, lock = _split_k_buffers(out, cfg, tiles)
    _mxfp8_decode_kernel[(tiles, cfg.split_k)](
        x, xq, xc, weight.data, _scale_operand(weight), bias_t, out, ws, lock,
        m, n, k, x.stride(0), weight.data.stride(0), out.stride(0), m * n, c, cp4, cfg.split_k,
        LAYOUT=LAYOUT_CODE[weight.layout], FUSE_QUANT=cfg.fuse_quant, FP8_DOT=x.device.type == "cuda",
        HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        PARTIAL=partial, SERIAL=serial, SCALE_TILE=_scale_tile(weight, cfg.block_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial and not serial:
        _reduce_splits(ws, bias_t, out, cfg, has_bias)
    return out


def _launch_gemv(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor, cfg: GemmConfig,
) -> torch.Tensor:
    """The GEMV kernel (+ activation quantization unless fused, + reduce unless serial)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > cfg.block_m or cfg.block_m > GEMV_MAX_M:
        raise LayoutError(f"the GEMV kernel serves M <= block_m <= {GEMV_MAX_M}, got M={m}, block_m={cfg.block_m}")
    if cfg.block_k % 32 or k % cfg.block_k:
        raise LayoutError(f"block_k={cfg.block_k} must be a multiple of 32 dividing K={k}")
    wdata = weight.data
    # int32 words need a contiguous, 4-byte aligned weight; any other view takes the generic cast
    words = cfg.words and wdata.is_contiguous() and wdata.data_ptr() % 4 == 0
    if words:
        wdata = wdata.view(torch.int32)
    x_perm = words and not cfg.fuse_quant
    a = x if cfg.fuse_quant else quantize_activations(x, permuted=x_perm)["deq"].view(m, k)
    c, cp4 = _scale_geometry(weight)
    has_bias = bias is not None
    bias_t = bias if has_bias else out
    tiles = _cdiv(n, cfg.block_n)
    partial, serial, ws, lock = _split_k_buffers(out, cfg, tiles)
    _mxfp8_gemv_kernel[(tiles, cfg.split_k)](
        a, wdata, _scale_operand(weight), bias_t, out, ws, lock,
        m, n, k, a.stride(0), wdata.stride(0), out.stride(0), m * n, c, cp4, cfg.split_k,
        LAYOUT=LAYOUT_CODE[weight.layout], FUSE_QUANT=cfg.fuse_quant, HAS_BIAS=has_bias,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, PARTIAL=partial, SERIAL=serial,
        WORDS=words, X_PERM=x_perm,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial and not serial:
        _reduce_splits(ws, bias_t, out, cfg, has_bias)
    return out


def dequantize_weight(
    weight: MXFP8Weight, start: int = 0, stop: int | None = None, *, out: torch.Tensor | None = None,
    block_n: int = 64, block_k: int = 256,
) -> torch.Tensor:
    """Logical rows ``[start, stop)`` of ``weight`` as exact ``q * 2^(code-127)``, read from the
    laid-out bytes by one Triton kernel (bf16 on CUDA, float32 under the interpreter).

    Args:
        weight: trtllm, cutlass or canonical :class:`MXFP8Weight`.
        start, stop: logical row range (default: every row).
        out: optional ``[stop - start, K]`` tensor with unit K stride to write into.
        block_n, block_k: tile of one program (``block_k`` is fitted to K).

    Returns:
        ``[stop - start, K]`` (``out`` when given).
    """
    _check_device(weight.data)
    n, k = weight.shape
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise LayoutError(f"{weight.name or 'weight'}: row range [{start}, {stop}) outside [0, {n})")
    dtype = torch.bfloat16 if weight.data.device.type == "cuda" else torch.float32
    if out is None:
        out = torch.empty((stop - start, k), dtype=dtype, device=weight.data.device)
    elif out.shape != (stop - start, k) or out.stride(1) != 1:
        raise LayoutError(f"out must be [{stop - start}, {k}] with unit K stride, got {list(out.shape)}")
    if stop == start:
        return out
    bk = _fit_block_k(k, block_k)
    c, cp4 = _scale_geometry(weight)
    grid = (_cdiv(stop - start, block_n), k // bk)
    _dequantize_weight_kernel[grid](
        weight.data, _scale_operand(weight), out, stop, start, weight.data.stride(0), out.stride(0), c, cp4,
        LAYOUT=LAYOUT_CODE[weight.layout], DOT_BF16=out.dtype == torch.bfloat16, BLOCK_N=block_n, BLOCK_K=bk,
        num_warps=4,
    )
    return out


def _launch_cublas(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor, cfg: GemmConfig,
) -> torch.Tensor:
    """Activations quantized once; per chunk of ``cfg.chunk_n`` weight rows, the rows dequantized
    into one reused workspace and ``out[:, chunk] = A @ Wd.T (+ bias)`` by cuBLAS (fp32
    accumulation; strided ``out`` column slices are written in place)."""
    n, k = weight.shape
    a = quantize_activations(x)["deq"]
    chunk = min(cfg.chunk_n or n, n)
    ws = torch.empty((chunk, k), dtype=a.dtype, device=x.device)
    if bias is not None:
        bias = bias.to(out.dtype)  # added in fp32 by cuBLAS; a non-bf16 bias is rounded to bf16 first
    for n0 in range(0, n, chunk):
        n1 = min(n0 + chunk, n)
        wd = dequantize_weight(weight, n0, n1, out=ws[: n1 - n0], block_n=cfg.block_n, block_k=cfg.block_k)
        if bias is None:
            torch.mm(a, wd.t(), out=out[:, n0:n1])
        else:
            torch.addmm(bias[n0:n1], a, wd.t(), out=out[:, n0:n1])
    return out
