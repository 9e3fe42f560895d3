"""Split-K reduction kernel: sums the fp32 partials ``[split_k, M, N]`` of a GEMM (+ bias) into its
bf16 output, in split order (the bits of the last-program reductions of the GEMM kernels)."""

from __future__ import annotations

import triton
import triton.language as tl

from mxfp8_convert.runtime.hopper.jit import _p32_logical, gdc_launch_dependents, gdc_wait


@triton.jit(do_not_specialize=["total", "stride_ps", "split_k"])
def _splitk_reduce_kernel(
    p_ptr,
    b_ptr,
    out_ptr,
    N,
    total,
    stride_ps,
    split_k,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
    CHUNK: tl.constexpr = 4,
    RELEASE: tl.constexpr = False,
    P32: tl.constexpr = False,
):
    if (
        PDL
    ):  # a programmatic dependent of the GEMM: its partials are complete and visible after this
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
            acc += tl.load(
                p_ptr + (s + j) * stride_ps + offs, mask=mask & (sv + j < split_k), other=0.0
            )
    if HAS_BIAS:
        acc += bias
    tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=mask)

