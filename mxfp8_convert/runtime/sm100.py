"""SM100-family engine: FlashInfer's ``mxfp8_quantize`` + ``mm_mxfp8`` on the laid-out bytes.

The weight goes in exactly as the checkpoint holds it (docs/FORMAT.md section 6): ``b = W.t()``
(a view of the contiguous ``[N, K]`` bytes) and ``b_descale = scale.flatten()`` (the 1-D buffer
``shuffle_matrix_sf_a`` / ``block_scale_interleave`` return), with ``backend`` = the marker's
backend. Activations: ``mxfp8_quantize(x, is_sf_swizzled_layout=True)`` (128x4 scales, the only
layout cutlass reads; trtllm reads it too with ``use_8x4_sf_layout=False``).
FlashInfer is imported lazily, on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from mxfp8_convert.backends import FLASHINFER_LAYOUT_VERSION
from mxfp8_convert.errors import BackendUnavailableError, LayoutError
from mxfp8_convert.layouts import swizzled_128x4_shape
from mxfp8_convert.runtime.weight import KERNEL_LAYOUTS, MXFP8Weight

INSTALL_HINT = (
    "pip install 'mxfp8-convert[flashinfer]' (flashinfer-python=="
    f"{FLASHINFER_LAYOUT_VERSION}); on Hopper use engine='triton', on CPU engine='reference'"
)


def import_flashinfer() -> ModuleType:
    """Import FlashInfer or raise :class:`BackendUnavailableError` saying what to install."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:
        raise BackendUnavailableError(f"FlashInfer is not importable ({e})",
                                      hint=INSTALL_HINT) from None


def activation_scale_len(m: int, k: int) -> int:
    """Bytes of the 128x4-swizzled activation scales of an ``[m, k]`` input:
    ceil128(m)*ceil4(k/32)."""
    tr, tc, tile = swizzled_128x4_shape(m, k // 32)
    return tr * tc * tile


def mm_mxfp8_args(a: torch.Tensor, a_sf: torch.Tensor, weight: MXFP8Weight) -> dict:
    """The exact keyword arguments we pass to ``flashinfer.mm_mxfp8``.

    Args:
        a: float8_e4m3fn ``[M, K]`` quantized activations.
        a_sf: uint8 ``[ceil128(M) * ceil4(K/32)]`` 128x4-swizzled activation scales.
        weight: a ``trtllm`` or ``cutlass`` weight.

    Returns:
        dict for ``mm_mxfp8(**args)``: ``b = W.t()`` ``[K, N]`` column-major view,
        ``b_descale`` flat uint8, ``out_dtype=bf16``, ``use_8x4_sf_layout=False``, ``backend``.

    Raises:
        LayoutError: before any launch, if a tensor does not have the shape/dtype the backend needs.
    """
    what = weight.name or "weight"
    if weight.layout not in KERNEL_LAYOUTS:
        raise LayoutError(
            f"{what}: layout {weight.layout!r} cannot run on FlashInfer without a re-layout",
            hint="run it with engine='triton' or 'reference', or convert it for trtllm/cutlass",
        )
    n, k = weight.shape
    if a.dtype != torch.float8_e4m3fn or a.dim() != 2 or a.shape[1] != k:
        raise LayoutError(f"{what}: activations must be float8_e4m3fn [M, {k}], "
                          f"got {a.dtype} {list(a.shape)}")
    want = activation_scale_len(a.shape[0], k)
    if a_sf.dtype != torch.uint8 or a_sf.dim() != 1 or a_sf.numel() != want:
        raise LayoutError(f"{what}: activation scales must be uint8 [{want}], "
                          f"got {a_sf.dtype} {list(a_sf.shape)}")
    return {
        "a": a,
        "b": weight.data.t(),
        "a_descale": a_sf,
        "b_descale": weight.scale.reshape(-1),
        "out_dtype": torch.bfloat16,
        "use_8x4_sf_layout": False,
        "backend": weight.layout,
    }


def flashinfer_linear(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``bf16(fq(x) @ dq(W).T) + bias`` through FlashInfer on an SM100-family GPU.

    Args:
        x: ``[M, K]`` bf16/fp16 activations on the GPU.
        weight: trtllm or cutlass weight on the same GPU.
        bias: optional ``[N]``, added to the bf16 output (FlashInfer's GEMM has no bias input).

    Returns:
        bf16 ``[M, N]``.
    """
    fi = import_flashinfer()
    a, a_sf = fi.mxfp8_quantize(x, is_sf_swizzled_layout=True)
    out = fi.mm_mxfp8(**mm_mxfp8_args(a, a_sf, weight))
    return out if bias is None else out + bias.to(out.dtype)
