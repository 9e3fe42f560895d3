"""The reader's batched FP8 scale test agrees with the per-tensor torch test it replaced.

``plan.fp8_lossless`` (the reader's ``read.pow2_scales``) maps every scale file once and tests
powers of two with numpy on the float32 bits; ``quantize.fp8_scales_are_pow2`` (torch, one
tensor at a time) is the reference.
Scales of every float dtype, per-tensor and block shapes, powers of two at the edges of the
UE8M0 range (2^-127 is a float32 subnormal), values just off a power of two, and bad values.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.formats import get_format
from mxfp8_convert.plan import fp8_lossless
from mxfp8_convert.quantize import fp8_scales_are_pow2
from mxfp8_convert.read import open_checkpoint

POW2 = [2.0 ** e for e in (-127, -126, -20, 0, 5, 127)]
NOT_POW2 = [3.0, 2.0 ** -128, 1.5 * 2.0 ** -127, 2.0 ** 10 * (1 + 2 ** -23), 2.0 ** 127 * 1.5]


def _checkpoint(tmp_path, scales: dict[str, torch.Tensor]):
    tensors = {}
    for i, (name, s) in enumerate(scales.items()):
        tensors[f"m{i}.weight"] = torch.zeros(256, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
        tensors[f"m{i}.weight_scale_inv"] = s
        del name
    half = len(tensors) // 2
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(tmp_path / "b.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
        "activation_scheme": "dynamic"}}))
    return open_checkpoint(tmp_path), tensors


def _scales() -> dict[str, torch.Tensor]:
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for j, v in enumerate(POW2 + NOT_POW2):
            t = torch.full((2, 2), 2.0 ** -3, dtype=torch.float64)
            t[1, 1] = v
            t = t.to(dtype)
            if torch.isfinite(t).all() and (t > 0).all():
                out[f"{dtype}-{j}"] = t
        out[f"{dtype}-all-pow2"] = torch.tensor([[0.5, 0.25], [4.0, 1.0]], dtype=dtype)
    return out


def test_batched_scale_test_agrees_with_the_per_tensor_reference(tmp_path):
    ckpt, tensors = _checkpoint(tmp_path, _scales())
    got = fp8_lossless(ckpt, get_format("block_fp8"))
    want = {k: fp8_scales_are_pow2(t, name=k) for k, t in tensors.items()
            if k.endswith("scale_inv")}
    assert got == want
    assert any(want.values()) and not all(want.values())


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -0.0])
def test_a_bad_scale_fails_with_the_reference_message(tmp_path, bad):
    scales = _scales()
    t = torch.full((2, 2), 0.5)
    t[0, 1] = bad
    scales["bad"] = t
    ckpt, tensors = _checkpoint(tmp_path, scales)
    name = next(k for k, v in tensors.items() if v is t)
    with pytest.raises(LayoutError) as want:
        fp8_scales_are_pow2(t, name=name)
    with pytest.raises(LayoutError) as got:
        fp8_lossless(ckpt, get_format("block_fp8"))
    assert str(got.value) == str(want.value)
