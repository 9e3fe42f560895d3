"""Weight dequantization kernel of the cuBLAS path (large M): logical rows of the laid-out weight
as exact ``q * 2^(code-127)`` in bf16, for cuBLAS to multiply. Launched by
``launch.dequantize_weight``."""

from __future__ import annotations

import triton
import triton.language as tl

from mxfp8_convert.runtime.hopper.jit import (
    _dequant_weight,
    _load_codes,
    _physical_rows,
    _scale_row_base,
)


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
    rows = _physical_rows(rows, LAYOUT)
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + kt * BLOCK_K + offs_k[None, :])
    s_base = s_ptr + _scale_row_base(rows, scale_c, scale_cp4, LAYOUT)[:, None]
    wd = _dequant_weight(w, _load_codes(s_base, kt, BLOCK_K, LAYOUT), BLOCK_N, BLOCK_K, DOT_BF16)
    dst = (offs_n - n0).to(tl.int64)[:, None] * stride_on + kt * BLOCK_K + offs_k[None, :]
    tl.store(out_ptr + dst, wd.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None])

