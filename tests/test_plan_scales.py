"""The reader's batched FP8 scale test agrees with the per-tensor torch test it replaced.

``plan.fp8_lossless`` (the reader's ``read.pow2_scales``) opens every scale file once, reads its
scales with one read per run of nearby scales and tests powers of two with numpy on the float32
bits; ``quantize.fp8_scales_are_pow2`` (torch, one tensor at a time) is the reference.
Scales of every float dtype, per-tensor and block shapes, powers of two at the edges of the
UE8M0 range (2^-127 is a float32 subnormal), values just off a power of two, and bad values.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from mxfp8_convert import read
from mxfp8_convert.errors import LayoutError, SourceError
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


# --- reading scales in runs ---------------------------------------------------------------------

GAP = read.SCALE_READ_GAP


def _raw_scales(tmp_path, layout: list[tuple[str, int]], values: dict[str, torch.Tensor]):
    """A file of ``layout``: (tensor name, its byte offset); every other byte is 0xFF (a NaN if a
    gap were ever taken for a scale). Returns the scales' ``TensorInfo`` and the file size."""
    end = max(at + values[n].numel() * 4 for n, at in layout)
    buf = bytearray(b"\xff" * end)
    infos = []
    for name, at in layout:
        data = values[name].to(torch.float32).numpy().tobytes()
        buf[at:at + len(data)] = data
        infos.append(read.TensorInfo(name, "F32", tuple(values[name].shape), "s.safetensors",
                                     at, len(data)))
    (tmp_path / "s.safetensors").write_bytes(bytes(buf))
    return infos, end


def _values() -> dict[str, torch.Tensor]:
    """Five 4x4 scales, each all powers of two or not (and 2^-127, the float32 subnormal)."""
    out = {}
    for i, odd in enumerate([None, 3.0, 2.0 ** -127, 1.5, None]):
        t = torch.full((4, 4), 2.0 ** (i - 2))
        if odd is not None:
            t[3, 3] = odd
        out[f"m{i}.weight_scale_inv"] = t
    return out


def _count_preads(monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = os.pread

    def pread(fd, n, offset):
        calls.append((offset, n))
        return real(fd, n, offset)

    monkeypatch.setattr(read.os, "pread", pread)
    return calls


def test_scales_near_each_other_are_read_together_and_far_ones_apart(tmp_path, monkeypatch):
    values = _values()
    names = list(values)
    size = 64  # bytes of each 4x4 float32 scale
    # m0 | m1 adjacent | GAP bytes | m2 | GAP + 1 bytes | m3 | 100 * GAP bytes | m4, the file's end
    at = [0, size, 2 * size + GAP, 3 * size + 2 * GAP + 1, 4 * size + 102 * GAP + 1]
    layout = list(zip(names[::-1], at, strict=True))  # file order is not name order
    infos, end = _raw_scales(tmp_path, layout, values)
    calls = _count_preads(monkeypatch)
    advice = []
    monkeypatch.setattr(read.os, "posix_fadvise", lambda fd, o, n, a: advice.append(a))
    got = read.pow2_scales(tmp_path, infos[::-1])
    want = {n: fp8_scales_are_pow2(t, name=n) for n, t in values.items()}
    assert got == want and any(want.values()) and not all(want.values())
    # three reads: the first three scales (gaps 0 and GAP), then each of the other two
    assert calls == [(0, 3 * size + GAP), (at[3], size), (at[4], size)]
    assert at[4] + size == end
    assert advice == [os.POSIX_FADV_RANDOM]


def test_a_run_is_cut_at_its_longest_read(tmp_path, monkeypatch):
    values = _values()
    layout = [(n, i * 64) for i, n in enumerate(values)]  # five adjacent scales
    infos, _ = _raw_scales(tmp_path, layout, values)
    monkeypatch.setattr(read, "SCALE_READ_MAX", 2 * 64)
    calls = _count_preads(monkeypatch)
    got = read.pow2_scales(tmp_path, infos)
    assert got == {n: fp8_scales_are_pow2(t, name=n) for n, t in values.items()}
    assert calls == [(0, 128), (128, 128), (256, 64)]


def test_a_bad_scale_inside_a_run_fails_with_the_reference_message(tmp_path):
    values = _values()
    values["m2.weight_scale_inv"][1, 2] = float("nan")
    infos, _ = _raw_scales(tmp_path, [(n, i * 64) for i, n in enumerate(values)], values)
    with pytest.raises(LayoutError) as want:
        fp8_scales_are_pow2(values["m2.weight_scale_inv"], name="m2.weight_scale_inv")
    with pytest.raises(LayoutError) as got:
        read.pow2_scales(tmp_path, infos)
    assert str(got.value) == str(want.value)


def test_a_scale_past_the_end_of_the_file_is_named(tmp_path, monkeypatch):
    values = _values()
    layout = [(n, i * 64) for i, n in enumerate(values)]
    infos, end = _raw_scales(tmp_path, layout, values)
    with open(tmp_path / "s.safetensors", "r+b") as f:
        f.truncate(end - 10)  # the last scale's last bytes are gone
    message = "s.safetensors: file ended inside tensor 'm4.weight_scale_inv' (truncated?)"
    with pytest.raises(SourceError, match=re.escape(message)):
        read.pow2_scales(tmp_path, infos)
    # the same when the file shrinks after it was opened (the size seen at opening is stale)
    real = read._open_regular
    monkeypatch.setattr(read, "_open_regular",
                        lambda root, rel, *, what: (real(root, rel, what=what)[0], end))
    with pytest.raises(SourceError, match=re.escape(message)):
        read.pow2_scales(tmp_path, infos)
