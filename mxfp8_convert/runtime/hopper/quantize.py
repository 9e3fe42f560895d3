"""Activation quantization kernel: ``x [M, K]`` -> MXFP8 (FlashInfer's recipe) as exactly
dequantized bf16/fp32 and/or (e4m3 bytes, UE8M0 codes). Launched by
``launch.quantize_activations``."""

from __future__ import annotations

import triton
import triton.language as tl

from mxfp8_convert.runtime.hopper.jit import (
    _e4m3_bytes,
    _mx_fake_quant,
    gdc_launch_dependents,
    gdc_wait,
)


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(
    x_ptr, deq_ptr, q_ptr, code_ptr, M, K, stride_xm,
    WRITE_DEQ: tl.constexpr, WRITE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PERM_DEQ: tl.constexpr = False,
    PDL: tl.constexpr = False, HW_ROUND: tl.constexpr = False,
):
    if PDL:  # a programmatic dependent: ``x`` is complete and visible after the wait; the GEMM
        # after this kernel may launch at once (it waits for this one before reading ``deq``)
        gdc_wait()
        gdc_launch_dependents()
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    xf = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32))
    deq, r, code = _mx_fake_quant(xf, 2, HW_ROUND)
    if WRITE_DEQ:
        d = tl.reshape(deq, (BLOCK_M, BLOCK_K))
        if PERM_DEQ:  # [M, 4, K/4]: element k at (k % 4, k // 4), for the GEMV kernel's word loads
            cols = (offs_k % 4) * (K // 4) + offs_k // 4
        else:
            cols = offs_k
        tl.store(deq_ptr + rows * K + cols[None, :], d.to(deq_ptr.dtype.element_ty), mask=mask)
    if WRITE_Q:
        q = tl.reshape(_e4m3_bytes(r, HW_ROUND), (BLOCK_M, BLOCK_K))  # exact: r is e4m3
        tl.store(q_ptr + rows * K + offs_k[None, :], q, mask=mask)
        offs_c = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        cmask = (offs_m < M)[:, None] & (offs_c < K // 32)[None, :]
        tl.store(
            code_ptr + rows * (K // 32) + offs_c[None, :],
            code.to(code_ptr.dtype.element_ty),
            mask=cmask,
        )
