"""The reference recipe and engine: FlashInfer's quantization, exact dequantization, float32
matmul."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.reference import (
    dequantize_mxfp8,
    fake_quantize_mxfp8,
    quantize_mxfp8,
    reference_linear,
    ue8m0_ceil,
)


def host_float_to_ue8m0(value: float) -> int:
    """Line-by-line port of FlashInfer's ``float_to_ue8m0`` (fp8Quantize.cpp)."""
    if value == 0.0:
        return 0
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    if mantissa > 0 and exponent != 0xFE and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent & 0xFF


def test_ue8m0_matches_flashinfer_host_code():
    g = torch.Generator().manual_seed(0)
    v = torch.cat([
        torch.exp2(torch.randint(-140, 128, (2000,), generator=g).float()),  # powers of two
        torch.rand(2000, generator=g)
        * torch.exp2(torch.randint(-130, 120, (2000,), generator=g).float()),
        torch.tensor([0.0, 2.0**-127, 2.0**-127 * 1.5, 2.0**-126, 3.0e38, 1.0, 1.0000001]),
    ]).float()
    got = ue8m0_ceil(v)
    want = torch.tensor([host_float_to_ue8m0(float(x)) for x in v], dtype=torch.uint8)
    assert torch.equal(got, want)


def test_quantize_recipe_by_hand():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-3.0, 3.0, 32)  # amax 3 -> 3/448 -> ceil_pow2 = 2^-7 -> code 120
    x[1, 32:] = 1000.0  # amax 1000 -> 2^2 -> code 129; 1000/4 = 250 -> e4m3 256 (RNE, step 16)
    q, code = quantize_mxfp8(x)
    assert code.tolist() == [[120, 0], [0, 129]]
    # within half a step (32 in [256, 448])
    assert q[0, :32].float().mul(2.0**-7).sub(x[0, :32]).abs().max() <= 2.0**-7 * 16
    assert torch.all(q[1, 32:].float() == 256.0)
    assert torch.all(q[0, 32:].view(torch.uint8) == 0)
    assert torch.all(q[1, :32].view(torch.uint8) == 0)


def test_quantize_is_rne_and_saturating():
    # 17, 19, 21 sit half-way between e4m3 neighbours (step 2 in [16, 32)): ties go to even.
    x = torch.tensor([[448.0, 17.0, 19.0, 21.0, 447.0] + [0.0] * 27])  # amax 448 -> code 127
    q, code = quantize_mxfp8(x)
    assert code.item() == 127
    assert q[0, :5].float().tolist() == [448.0, 16.0, 20.0, 20.0, 448.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_exact(dtype):
    x = (torch.randn(64, 256) * torch.logspace(-3, 3, 256)).to(dtype)
    q, code = quantize_mxfp8(x)
    deq = dequantize_mxfp8(q, code)
    # exact: q has 4 significant bits, the scale is a power of two
    scales = torch.exp2(code.double() - 127)[..., None]
    assert torch.equal(deq, q.double().reshape(64, 8, 32).mul(scales).reshape(64, 256).float())
    assert torch.equal(deq.to(torch.bfloat16).float(), deq)  # and representable in bf16
    rel = (deq - x.float()).norm() / x.float().norm()
    assert rel < 0.05


def test_k_must_be_multiple_of_32():
    with pytest.raises(LayoutError, match="K % 32"):
        quantize_mxfp8(torch.randn(2, 48))


def test_reference_linear_is_float32_of_exact_operands():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g)
    x = torch.randn(3, 5, 128, generator=g).bfloat16()
    b = torch.randn(96, generator=g)
    qw, cw = quantize_mxfp8(w)
    out = reference_linear(x, qw, cw, b)
    assert out.shape == (3, 5, 96) and out.dtype == torch.bfloat16
    a = fake_quantize_mxfp8(x.reshape(-1, 128)).double()
    ref = a @ dequantize_mxfp8(qw, cw).double().t() + b.double()
    err = (out.reshape(-1, 96).double() - ref).abs() / ref.abs().clamp_min(1e-3)
    assert err.max() <= 2.0**-8 + 1e-6  # one bf16 rounding of an fp32 sum
    assert not math.isnan(float(out.float().sum()))
