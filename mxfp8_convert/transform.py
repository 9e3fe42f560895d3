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


def layout_weight_chunk(t: TensorPlan, backend: BackendSpec, chunk: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Lay out a chunk of ``t``'s canonical weight bytes: uint8 ``[rows*K]`` in, same size out.

    Layouts that keep the bytes return ``chunk`` itself. ``out`` (same size) receives the
    shuffled bytes when given, so a pipeline can reuse its buffers.
    """
    if t.layout in ("canonical", "copy") or t.layout != backend.weight_layout or t.layout == "identity":
        return chunk
    k = t.shape[1]
    if out is None or t.layout != "p32_rows":
        return backend.weight_forward(chunk.view(-1, k)).reshape(-1)
    out.view(-1, 4, 8, k).copy_(chunk.view(-1, 8, 4, k).transpose(1, 2))  # = p32_shuffle_rows
    return out


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
