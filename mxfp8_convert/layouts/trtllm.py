"""trtllm-gen weight-scale layout (``flashinfer.shuffle_matrix_sf_a(s, 128, 32)``).

Linear ``[N, C]`` UE8M0 scales are zero-padded to ``ceil128(N)`` rows (FlashInfer asserts
rows % 128 == 0; SGLang pads first, sglang PR #28459, for shapes such as the fused MLA
N = 576), P32-shuffled like the weight rows, then 128x4-swizzled. docs/LAYOUTS.md section 2.
Because P32 moves rows only inside 32-row blocks, scale row ``p`` belongs to physical
weight row ``p`` of the shuffled weight.
"""

from __future__ import annotations

from mxfp8_convert._lazy import numpy as np
from mxfp8_convert._lazy import torch
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.layouts._common import as_bytes, ceil_to, pad_2d
from mxfp8_convert.layouts.rows import (
    p32_shuffle_rows,
    p32_shuffle_rows_array,
    p32_unshuffle_rows,
    p32_unshuffle_rows_array,
)
from mxfp8_convert.layouts.swizzle import (
    swizzle_128x4,
    swizzle_128x4_array,
    swizzled_128x4_shape,
    unswizzle_128x4,
    unswizzle_128x4_array,
)


def trtllm_scale_shape(rows: int, cols: int) -> tuple[int, int, int]:
    """Tile shape of the trtllm weight scale of an ``[rows, cols]`` linear scale.

    Same as the 128x4 shape: ``(ceil128(rows)/128, ceil4(cols)/4, 512)``.
    """
    return swizzled_128x4_shape(rows, cols)


def trtllm_scale_from_canonical(s: torch.Tensor) -> torch.Tensor:
    """Lay out linear weight scales for trtllm.

    Args:
        s: ``[..., N, C]`` 1-byte linear scales, ``N % 32 == 0``.

    Returns:
        uint8 ``[..., ceil128(N)/128, ceil4(C)/4, 512]``: pad rows to ceil128(N), P32, 128x4.
    """
    s = as_bytes(s)
    if s.dim() < 2:
        raise LayoutError("trtllm weight scale needs a [..., N, C] tensor, "
                          f"got shape {list(s.shape)}")
    *batch, n, c = s.shape
    if n % 32:
        raise LayoutError(f"trtllm weight scale needs N % 32 == 0 (P32 row shuffle), got N={n}")
    s = pad_2d(s, ceil_to(n, 128), c)
    if batch:  # shuffle each matrix's rows: move the row dim first, then back
        s = p32_shuffle_rows(s.movedim(-2, 0)).movedim(0, -2)
    else:
        s = p32_shuffle_rows(s)
    return swizzle_128x4(s)


def trtllm_scale_from_canonical_array(s: np.ndarray) -> np.ndarray:
    """:func:`trtllm_scale_from_canonical` of a numpy uint8 ``[N, C]`` array, without torch.

    Returns:
        uint8 ``[ceil128(N)/128, ceil4(C)/4, 512]``, the same bytes as the torch version.
    """
    if s.ndim != 2:
        raise LayoutError(f"trtllm weight scale needs an [N, C] array, got shape {list(s.shape)}")
    n, c = s.shape
    if n % 32:
        raise LayoutError(f"trtllm weight scale needs N % 32 == 0 (P32 row shuffle), got N={n}")
    if n % 128 == 0 and c % 4 == 0:  # nothing to pad: P32 and 128x4 as one copy
        return _p32_swizzled_array(s)
    padded = np.zeros((ceil_to(n, 128), c), dtype=np.uint8)
    padded[:n] = s
    return swizzle_128x4_array(p32_shuffle_rows_array(padded))


def _p32_swizzled_array(s: np.ndarray) -> np.ndarray:
    """``swizzle_128x4_array(p32_shuffle_rows_array(s))`` for ``N % 128 == 0``, ``C % 4 == 0``,
    in one copy instead of two.

    Rows ``r = 128t + 32q + 8a + c`` (``q, a < 4``, ``c < 8``) of the P32-shuffled scale hold
    source row ``128t + 32q + 4c + a``; the swizzle puts the 4-byte word ``w`` of row ``r``
    at tile ``(t, w)``, position ``(r % 32) * 4 + q``. With the source viewed as words
    ``[t, q, c, a, w]``, the tiles are its axes in the order ``(t, w, a, c, q)``.
    """
    n, c = s.shape
    words = np.ascontiguousarray(s, dtype=np.uint8).view(np.int32)
    tiles = words.reshape(n // 128, 4, 8, 4, c // 4).transpose(0, 4, 3, 2, 1).copy()
    return tiles.view(np.uint8).reshape(n // 128, c // 4, 512)


def trtllm_scale_to_canonical(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`trtllm_scale_from_canonical`: tiles in, uint8 ``[..., rows, cols]`` out."""
    s = unswizzle_128x4(t, ceil_to(rows, 128), cols)
    if s.dim() > 2:
        s = p32_unshuffle_rows(s.movedim(-2, 0)).movedim(0, -2)
    else:
        s = p32_unshuffle_rows(s)
    return s[..., :rows, :].contiguous()


def trtllm_scale_to_canonical_array(t: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Inverse of :func:`trtllm_scale_from_canonical_array`, without torch.

    Args:
        t: uint8 ``[ceil128(rows)/128, ceil4(cols)/4, 512]`` tiles, or the same bytes flat.
        rows, cols: the linear scale shape ``N, C`` (``N % 32 == 0``).

    Returns:
        uint8 ``[rows, cols]``, contiguous.
    """
    s = p32_unshuffle_rows_array(unswizzle_128x4_array(t, ceil_to(rows, 128), cols))
    return np.ascontiguousarray(s[:rows])
