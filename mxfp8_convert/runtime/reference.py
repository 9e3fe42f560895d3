"""Exact CPU reference of the MXFP8 linear: quantize activations, dequantize, matmul in float32.

This is both the ``reference`` engine and the oracle the faster engines are tested against.
Activation quantization follows FlashInfer's recipe (docs/LAYOUTS.md section 1, host code
``fp8Quantize.cpp``, ``float_to_ue8m0``), per 1x32 block along K:

- ``v = fl32(amax * fl32(1/448))``; ``code`` = the exponent field of ``v`` rounded up when ``v``
  is not a power of two, clamped to <= 254 (an all-zero block gives ``v = 0`` and code 0);
- ``q = round-nearest-even, saturating e4m3 of x * 2^(127-code)``.

Because UE8M0 scales are powers of two and e4m3 has 3 mantissa bits, ``q * 2^(code-127)`` is
exact in float32 and in bf16 (outside the subnormal range); that is what lets the Hopper
engine run a bf16 tensor-core GEMM on dequantized tiles and still compute the MXFP8 product.
"""

from __future__ import annotations

import torch

from mxfp8_convert.errors import LayoutError

BLOCK = 32
E4M3_MAX = 448.0
_INV_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # fl32(1/448), as the host code


def ue8m0_ceil(v: torch.Tensor) -> torch.Tensor:
    """UE8M0 code of ``ceil_pow2(v)`` for non-negative float32 ``v``, as FlashInfer rounds it.

    Args:
        v: float32 tensor, ``v >= 0`` (``amax / 448``).

    Returns:
        uint8 tensor of the same shape: the exponent field of ``v``, plus one when the mantissa
        is non-zero (not past 254); ``v <= 2^-127`` gives 0. Mirrors ``float_to_ue8m0``.
    """
    bits = v.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    bump = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    return (exp + bump.to(torch.int32)).to(torch.uint8)


def pow2_from_code(code: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """``2^(sign * (code - 127))`` as float32, exact for every code 0..254 (subnormals included)."""
    e = sign * (code.to(torch.int32) - 127)
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e).to(torch.float32)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8 with FlashInfer's recipe.

    Args:
        x: ``[..., K]`` float tensor (bf16, fp16 or fp32), ``K % 32 == 0``.

    Returns:
        ``(q, code)``: ``q`` float8_e4m3fn ``[..., K]`` and ``code`` uint8 ``[..., K/32]`` (linear,
        not swizzled), on ``x``'s device.

    Raises:
        LayoutError: if ``K % 32 != 0``.
    """
    k = x.shape[-1]
    if k % BLOCK:
        raise LayoutError(f"MXFP8 quantization needs K % 32 == 0, got K={k}")
    xf = x.float().reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    amax = xf.abs().amax(dim=-1)
    code = ue8m0_ceil(amax * _INV_448.to(x.device))
    y = xf * pow2_from_code(code, sign=-1).unsqueeze(-1)
    q = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), code


def dequantize_mxfp8(q: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """``q * 2^(code - 127)`` in float32.

    Args:
        q: float8_e4m3fn ``[..., K]`` (or its uint8 view).
        code: uint8 ``[..., K/32]`` linear UE8M0 codes (float8_e8m0fnu is read as uint8).

    Returns:
        float32 ``[..., K]``.
    """
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    if code.dtype != torch.uint8:
        code = code.view(torch.uint8)
    k = q.shape[-1]
    qf = q.float().reshape(*q.shape[:-1], k // BLOCK, BLOCK)
    return (qf * pow2_from_code(code).unsqueeze(-1)).reshape(q.shape)


def fake_quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(x))`` in float32: what every engine multiplies instead of ``x``."""
    return dequantize_mxfp8(*quantize_mxfp8(x))


def reference_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_code: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MXFP8 linear on canonical (un-laid-out) operands, float32 math, bf16 out.

    Args:
        x: ``[..., K]`` activations, any float dtype; quantized to MXFP8 first.
        w_q: float8_e4m3fn ``[N, K]`` canonical weight.
        w_code: uint8 ``[N, K/32]`` canonical (linear) weight scales.
        bias: optional ``[N]``, added in float32 before the one rounding to bf16.

    Returns:
        bf16 ``[..., N]``: ``bf16(fq(x) @ dq(W).T + bias)`` with float32 accumulation.
    """
    a = fake_quantize_mxfp8(x.reshape(-1, x.shape[-1]))
    w = dequantize_mxfp8(w_q, w_code)
    out = a @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16).reshape(*x.shape[:-1], w.shape[0])
