"""The SM100 (FlashInfer) engine up to the kernel launch, on CPU.

No SM100 GPU exists here, so we run FlashInfer's *own* argument checks for ``mm_mxfp8`` on the
exact tensors the engine passes: the ``common_check`` (``_check_mm_mxfp8_problem_size``), the
per-backend ``@backend_requirement`` functions, and the real ``mm_mxfp8`` wrapper with only the
device-capability lookups patched (SM100 for the checks; the capability lookup that follows the
checks, inside ``mm_mxfp8``'s body, raises ``ReachedLaunch``). The negative tests prove those
checks would catch a wrong shape, dtype or layout.
"""

from __future__ import annotations

import pytest
import torch

from mxfp8_convert.layouts import swizzle_128x4
from mxfp8_convert.runtime import MXFP8Weight, quantize_mxfp8
from mxfp8_convert.runtime.sm100 import activation_scale_len, flashinfer_linear, mm_mxfp8_args

fi = pytest.importorskip("flashinfer")
gemm_base = pytest.importorskip("flashinfer.gemm.gemm_base")

SHAPES = [(1, 576, 7168), (16, 4096, 4096), (129, 128, 512), (3, 1536, 256)]


class ReachedLaunch(Exception):
    """Raised where mm_mxfp8 would pick a kernel: every argument check has passed."""


def flashinfer_style_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU stand-in for ``flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=True)``.

    Same recipe and the same output format: e4m3 ``[M, K]`` and flat uint8 128x4-swizzled scales
    of ``ceil128(M) * ceil4(K/32)`` bytes (``_compute_swizzled_layout_sf_size``).
    """
    q, code = quantize_mxfp8(x)
    return q, swizzle_128x4(code).reshape(-1)


@pytest.fixture
def sm100(monkeypatch):
    """Pretend the checks run on an SM100 GPU; stop mm_mxfp8 right after its checks."""
    import flashinfer.utils as fu

    monkeypatch.setattr(fu, "get_compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(gemm_base, "is_sm12x_supported", lambda device: False)

    def launch(device):
        raise ReachedLaunch

    monkeypatch.setattr(gemm_base, "get_compute_capability", launch)


def _args(layout, m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = MXFP8Weight.quantize(torch.randn(n, k, generator=g), layout)
    a, a_sf = flashinfer_style_quantize(torch.randn(m, k, generator=g).bfloat16())
    return mm_mxfp8_args(a, a_sf, w), w


def _requirement(layout):
    return {"trtllm": gemm_base._trtllm_gemm_mxfp8_requirement,
            "cutlass": gemm_base._cutlass_gemm_mxfp8_requirement}[layout]


@pytest.mark.parametrize("layout", ["trtllm", "cutlass"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_our_tensors_pass_flashinfer_checks(sm100, layout, m, n, k):
    args, w = _args(layout, m, n, k)
    assert args["b"].shape == (k, n) and args["b"].stride() == (1, k)  # W.t(), column-major
    assert args["b_descale"].dim() == 1 and args["b_descale"].numel() == w.scale.numel()
    assert args["a_descale"].numel() == activation_scale_len(m, k)
    assert gemm_base._check_mm_mxfp8_problem_size(**args) is True
    req = _requirement(layout)
    assert req(**args) is True
    for cc in (100, 103):
        assert req.is_compute_capability_supported(cc)
    assert not req.is_compute_capability_supported(90)


@pytest.mark.parametrize("layout", ["trtllm", "cutlass"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_mm_mxfp8_reaches_launch(sm100, layout, m, n, k):
    args, _ = _args(layout, m, n, k)
    with pytest.raises(ReachedLaunch):
        fi.mm_mxfp8(**args)


@pytest.mark.parametrize("layout", ["trtllm", "cutlass"])
def test_engine_path_reaches_launch(sm100, monkeypatch, layout):
    """The engine itself: its quantize call, its argument building, FlashInfer's checks."""
    monkeypatch.setattr(fi, "mxfp8_quantize",
                        lambda x, is_sf_swizzled_layout: flashinfer_style_quantize(x))
    w = MXFP8Weight.quantize(torch.randn(576, 7168), layout)
    with pytest.raises(ReachedLaunch):
        flashinfer_linear(torch.randn(1, 7168).bfloat16(), w)


def _expect_rejected(args, match: str):
    """FlashInfer's own argument checks refuse these arguments, before any launch, with the
    ValueError that names what is wrong (FlashInfer 0.7.2.post1, ``gemm_base.mm_mxfp8``)."""
    with pytest.raises(ValueError, match=match):
        fi.mm_mxfp8(**args)


@pytest.mark.parametrize("layout", ["trtllm", "cutlass"])
def test_checks_have_teeth(sm100, layout):
    args, w = _args(layout, 16, 576, 7168)
    _expect_rejected({**args, "b": w.data},  # W, not W.t()
                     r"K dimension mismatch .* b.shape\[0\]=576")
    _expect_rejected({**args, "b_descale": w.scale},  # 3-D tiles, not the flat buffer
                     r"b_descale must be 1D \(swizzled\) or 2D \(non-swizzled\), "
                     r"got torch.Size\(\[5, 56, 512\]\)")
    _expect_rejected({**args, "b_descale": w.scale.reshape(-1)[:-512]},  # one tile short
                     r"b_descale shape mismatch for swizzled layout. Expected \(143360,\), "
                     r"got torch.Size\(\[142848\]\)")
    _expect_rejected({**args, "a_descale": args["a_descale"].reshape(-1, 4)},  # 2-D (linear) scales
                     r"a_descale shape mismatch for non-swizzled layout")
    _expect_rejected({**args, "a": args["a"].view(torch.uint8)},  # wrong dtype
                     r"a must be a float8_e4m3fn tensor, got a.dtype=torch.uint8")
    _expect_rejected({**args, "out_dtype": torch.float32},
                     r"Unsupported output dtype: torch.float32")


def test_trtllm_rejects_k_not_multiple_of_256(sm100):
    w = MXFP8Weight.quantize(torch.randn(256, 384), "cutlass")  # K=384 is fine for cutlass only
    a, a_sf = flashinfer_style_quantize(torch.randn(4, 384).bfloat16())
    args = {**mm_mxfp8_args(a, a_sf, w), "backend": "trtllm"}
    # the trtllm requirement's refusal (K % 256); the same tensors reach cutlass's launch
    _expect_rejected(args, "^Problem size is not supported for mm_mxfp8$")
    with pytest.raises(ReachedLaunch):
        fi.mm_mxfp8(**{**args, "backend": "cutlass"})


def test_our_preflight_catches_bad_activations():
    from mxfp8_convert.errors import LayoutError

    _, w = _args("cutlass", 4, 256, 512)
    a, a_sf = flashinfer_style_quantize(torch.randn(4, 512).bfloat16())
    with pytest.raises(LayoutError, match="activation scales"):
        mm_mxfp8_args(a, a_sf[:-1], w)
    with pytest.raises(LayoutError, match="float8_e4m3fn"):
        mm_mxfp8_args(a.float(), a_sf, w)
    canon = MXFP8Weight.quantize(torch.randn(256, 512), "canonical")
    with pytest.raises(LayoutError, match="re-layout"):
        mm_mxfp8_args(a, a_sf, canon)
