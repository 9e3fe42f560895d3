"""Apply one plan entry to in-memory tensors. No disk, no rich, no flashinfer.

The weight is laid out in row chunks (P32 moves rows only within 32-row blocks, so any chunk
of a multiple of 32 rows is laid out on its own), which keeps memory bounded by the chunk,
not the tensor. Scales are ~1/32 of the weight and are laid out whole.
"""

from __future__ import annotations

import torch

from mxfp8_convert.backends import BackendSpec
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.layouts.rows import P32_BLOCK
from mxfp8_convert.plan import TensorPlan


def weight_granule(t: TensorPlan) -> int:
    """Bytes per independent chunk of a weight: 32 rows for a shuffled layout, else 1."""
    if t.role == "weight" and t.layout == "p32_rows":
        return P32_BLOCK * t.shape[1]
    return 1


def layout_weight_chunk(t: TensorPlan, backend: BackendSpec, chunk: torch.Tensor) -> torch.Tensor:
    """Lay out a chunk of ``t``'s canonical weight bytes: uint8 ``[rows*K]`` in, same size out."""
    if t.layout in ("canonical", "copy") or t.layout != backend.weight_layout:
        return chunk
    k = t.shape[1]
    return backend.weight_forward(chunk.view(-1, k)).reshape(-1)


def layout_scale(t: TensorPlan, backend: BackendSpec, s: torch.Tensor) -> torch.Tensor:
    """Canonical uint8 ``[N, C]`` scale -> the bytes of ``t`` (tiles, or unchanged if canonical)."""
    s = s if s.dtype == torch.uint8 else s.view(torch.uint8)
    if tuple(s.shape) != tuple(t.logical_shape):
        raise LayoutError(f"scale {t.source!r}: shape {list(s.shape)} != planned {list(t.logical_shape)}")
    if t.layout == "canonical":
        return s
    out = backend.scale_forward(s)
    if tuple(out.shape) != tuple(t.shape):
        raise LayoutError(f"scale {t.name!r}: laid out to {list(out.shape)}, planned {list(t.shape)} (bug)")
    return out
