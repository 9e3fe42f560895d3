"""Small helpers shared by the layout modules."""

from __future__ import annotations

from mxfp8_convert._lazy import torch
from mxfp8_convert.errors import LayoutError


def ceil_to(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """View a 1-byte tensor (uint8, int8, float8_*) as uint8 without copying."""
    if x.element_size() != 1:
        raise LayoutError(f"layouts move bytes: expected a 1-byte dtype, got {x.dtype}")
    return x if x.dtype == torch.uint8 else x.view(torch.uint8)


def pad_2d(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad the last two dims of ``x`` to ``(rows, cols)``; no copy when already that size."""
    r, c = x.shape[-2:]
    if (r, c) == (rows, cols):
        return x
    out = x.new_zeros((*x.shape[:-2], rows, cols))
    out[..., :r, :c] = x
    return out
