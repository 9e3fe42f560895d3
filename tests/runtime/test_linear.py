"""MXFP8Weight, mxfp8_linear and MXFP8Linear on CPU (reference engine), both layouts.

The runtime reads the laid-out bytes; the oracle is computed from the un-laid-out (canonical)
source: they must agree bit for bit, because inverting a layout is exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxfp8_convert.errors import BackendUnavailableError, LayoutError
from mxfp8_convert.runtime import (
    MXFP8Linear,
    MXFP8Weight,
    mxfp8_linear,
    quantize_mxfp8,
    reference_linear,
)
from mxfp8_convert.runtime.weight import KERNEL_LAYOUTS

LAYOUTS = ("trtllm", "cutlass")
SHAPES = [(1, 576, 512), (7, 128, 256), (33, 256, 1024), (1, 1536, 256)]  # (M, N, K); N=576 as MLA


def _case(layout, m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, code = quantize_mxfp8(torch.randn(n, k, generator=g))
    w = MXFP8Weight.from_canonical(q, code, layout)
    x = torch.randn(m, k, generator=g).bfloat16()
    return w, q, code, x


def test_kernel_layouts_are_trtllm_and_cutlass():
    assert set(LAYOUTS) <= set(KERNEL_LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_runtime_equals_reference_from_canonical_source(layout, m, n, k):
    w, q, code, x = _case(layout, m, n, k)
    bias = torch.randn(n)
    out = mxfp8_linear(x, w, bias, engine="reference")
    assert torch.equal(out, reference_linear(x, q, code, bias))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_really_moves_bytes(layout):
    """Guard against a no-op layout: the stored bytes differ from canonical where they should."""
    w, q, code, _ = _case(layout, 1, 576, 512)
    if layout == "trtllm":
        assert not torch.equal(w.data.view(torch.uint8), q.view(torch.uint8))
    assert w.scale.shape == (5, 4, 512)  # ceil(576/128) x ceil(16/4) tiles
    q2, c2 = w.canonical()
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(c2, code)


def test_weight_validation():
    q, code = quantize_mxfp8(torch.randn(256, 512))
    w = MXFP8Weight.from_canonical(q, code, "cutlass")
    with pytest.raises(LayoutError, match="scale of a"):
        MXFP8Weight(w.data, w.scale[:1], "cutlass")
    with pytest.raises(LayoutError, match="float8_e4m3fn"):
        MXFP8Weight(w.data.view(torch.uint8), w.scale, "cutlass")
    with pytest.raises(LayoutError, match="unknown layout"):
        MXFP8Weight(w.data, w.scale, "marlin")
    with pytest.raises(LayoutError, match="multiple of 256"):
        MXFP8Weight.from_canonical(*quantize_mxfp8(torch.randn(256, 384)), "trtllm")
    e8m0 = MXFP8Weight(w.data, w.scale.view(torch.float8_e8m0fnu), "cutlass")
    assert e8m0.scale.dtype == torch.uint8


def test_canonical_layout_runs_any_n():
    q, code = quantize_mxfp8(torch.randn(40, 96))  # fits no kernel backend
    w = MXFP8Weight.from_canonical(q, code, "canonical")
    x = torch.randn(3, 96)
    assert torch.equal(mxfp8_linear(x, w, engine="reference"), reference_linear(x, q, code))


def test_input_checks_and_engine_errors(monkeypatch):
    w, _, _, x = _case("cutlass", 2, 128, 256)
    with pytest.raises(LayoutError, match="features"):
        mxfp8_linear(torch.randn(2, 128), w)
    with pytest.raises(BackendUnavailableError, match="unknown engine"):
        mxfp8_linear(x, w, engine="cublas")
    with pytest.raises(BackendUnavailableError, match="SM100"):
        mxfp8_linear(x, w, engine="flashinfer")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        mxfp8_linear(x, w, engine="triton")
    monkeypatch.setenv("MXFP8_CONVERT_ENGINE", "reference")
    assert mxfp8_linear(x, w).shape == (2, 128)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_module(layout):
    lin = nn.Linear(256, 576, bias=True)
    mod = MXFP8Linear.from_linear(lin, layout, engine="reference")
    assert "layout=" + layout in repr(mod)
    x = torch.randn(2, 3, 256).bfloat16()
    y = mod(x)
    assert y.shape == (2, 3, 576) and y.dtype == torch.bfloat16
    q, code = quantize_mxfp8(lin.weight.detach().float())
    assert torch.equal(y, reference_linear(x, q, code, lin.bias.detach()))
    state = mod.state_dict()
    assert set(state) == {"weight_data", "weight_scale", "bias"}
    # the e4m3 bytes held as uint8, so that model.to(dtype) cannot cast them
    assert state["weight_data"].dtype == torch.uint8 and state["weight_scale"].dtype == torch.uint8
    assert mod.mx_weight.data.dtype == torch.float8_e4m3fn
