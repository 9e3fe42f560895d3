"""MXFP8 operands regrouped to one fp32 scale per 128 elements of K, for Hopper's block-scaled
FP8 GEMM (cuBLAS's 1x128 x 1x128 recipe, ``torch._scaled_mm``).

Each 128-block of a row holds four 32-blocks with UE8M0 codes ``c0..c3``; with ``cmax`` their
largest, element ``q * 2^(c - 127)`` becomes ``q' * 2^(cmax - 127)`` with
``q' = round_e4m3(q * 2^(c - cmax))``. Multiplying by a power of two is exact in e4m3 as long as
the result stays in its normal range, ``|q'| >= 2^-6``, so every element within ``448 / 2^-6 =
2^14.8`` of its 128-block's largest possible magnitude keeps its value exactly; smaller ones are
rounded (ties to even) to that block's subnormal grid, an absolute error of at most ``2^-10 *
2^(cmax - 127)``. A code of 255 (NaN) makes the block's scale NaN.

On the GPU both roundings (the activations' to FlashInfer's 32-block e4m3 values, then every
operand's to its 128-block) are the hardware's conversion, ``cvt.rn.satfinite.e4m3x2.f32`` (ties
to even, saturating at 448: under a third of the arithmetic rounding's instructions); under
Triton's interpreter, whose float8 cast does not round ties to even, they are ``jit._round_e4m3``.
Both give the same bytes (``tests/runtime/test_triton_gpu.py::test_block128_path_agrees``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxfp8_convert.runtime.hopper.jit import (
    _e4m3_bytes,
    _load_codes,
    _mx_fake_quant,
    _physical_rows,
    _pow2_f32,
    _scale_row_base,
)


@triton.jit
def _regroup(r, code, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HW_ROUND: tl.constexpr):
    """e4m3 values ``r`` (fp32 [ROWS, BLOCK_K/32, 32]) with int32 codes [ROWS, BLOCK_K/32] ->
    (uint8 e4m3 bytes [ROWS, BLOCK_K], fp32 scales [ROWS, BLOCK_K/128])."""
    code = tl.reshape(code, (ROWS, BLOCK_K // 128, 4))
    cmax = tl.max(code, axis=2)
    shift = _pow2_f32(127 + code - cmax[:, :, None])  # 2^(c - cmax), exact down to 2^-127
    r = tl.reshape(r, (ROWS, BLOCK_K // 128, 4, 32)) * shift[:, :, :, None]
    q = tl.reshape(_e4m3_bytes(r, HW_ROUND), (ROWS, BLOCK_K))
    scale = tl.where(cmax == 255, float("nan"), _pow2_f32(cmax))
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _regroup_activations_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    """``x [M, K]`` quantized to MXFP8 (FlashInfer's recipe, as ``_quantize_kernel``) and
    regrouped: e4m3 bytes ``q [M, K]``, scales ``s`` stored K-block-major (``s[j * M + m]``: the
    ``[M, K/128]`` operand with strides ``(1, M)`` that cuBLAS's 1x128 recipe takes)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)[:, None]
    mask = (offs_m < M)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    xf = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32))
    _deq, r, code = _mx_fake_quant(xf, 2, HW_ROUND)
    q, scale = _regroup(r, code, BLOCK_M, BLOCK_K, HW_ROUND)
    tl.store(q_ptr + rows * K + offs_k[None, :], q, mask=mask)
    offs_j = tl.program_id(1) * (BLOCK_K // 128) + tl.arange(0, BLOCK_K // 128)
    tl.store(s_ptr + offs_j.to(tl.int64)[None, :] * M + offs_m[:, None], scale, mask=mask)


@triton.jit
def _regroup_weight_kernel(
    w_ptr, s_ptr, q_ptr, o_ptr, N, n0, stride_wn, scale_c, scale_cp4,
    LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HW_ROUND: tl.constexpr,
):
    """Logical rows ``l`` in ``[n0, N)`` of the laid-out weight (the gather and scale offsets of
    ``_dequantize_weight_kernel``) as e4m3 bytes ``q [N - n0, K]`` and scales ``o`` stored
    K-block-major (``o[j * (N - n0) + l - n0]``: the ``[K/128, N - n0]`` row-major operand of
    cuBLAS's 1x128 recipe for ``W.T``)."""
    offs_n = n0 + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kt = tl.program_id(1)
    rows = tl.minimum(offs_n, N - 1)
    rows = _physical_rows(rows, LAYOUT)
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + kt * BLOCK_K + offs_k[None, :])
    s_base = s_ptr + _scale_row_base(rows, scale_c, scale_cp4, LAYOUT)[:, None]
    code = _load_codes(s_base, kt, BLOCK_K, LAYOUT)
    r = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32))
    q, scale = _regroup(r, code, BLOCK_N, BLOCK_K, HW_ROUND)
    mask = (offs_n < N)[:, None]
    dst = (offs_n - n0).to(tl.int64)
    tl.store(q_ptr + dst[:, None] * (scale_c * 32) + kt * BLOCK_K + offs_k[None, :], q, mask=mask)
    offs_j = kt * (BLOCK_K // 128) + tl.arange(0, BLOCK_K // 128)
    tl.store(o_ptr + offs_j.to(tl.int64)[None, :] * (N - n0) + dst[:, None], scale, mask=mask)
