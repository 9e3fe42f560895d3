"""Scale-factor swizzles: 128x4 (weights and activations) and 8x4 (trtllm activations only).

128x4 (``flashinfer.block_scale_interleave``, kernel index ``get_sf_out_offset_128x4``, cuBLAS
"1D block scaling factors layout"; docs/LAYOUTS.md section 2): pad rows to ``Rp = ceil128(R)`` and
columns to ``Cp = ceil4(C)`` with byte 0, then element ``(r, c)`` lands at
``(r//128)*(Cp/4)*512 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``.

We return the bytes as a 3-D tile tensor ``[Rp/128, Cp/4, 512]``: ``.flatten()`` is exactly
FlashInfer's flat buffer, and slicing the first two dims gives the swizzled bytes of a
128-row / 128-K slice of the weight (tensor parallelism), which a 2-D view would not.
"""

from __future__ import annotations

from mxfp8_convert._lazy import numpy as np
from mxfp8_convert._lazy import torch
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.layouts._common import as_bytes, ceil_to, pad_2d

TILE_ROWS = 128
TILE_COLS = 4
TILE_BYTES = TILE_ROWS * TILE_COLS  # 512


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bytes as int32 words (its last dim must be a multiple of 4)."""
    x = x.contiguous()
    if x.storage_offset() % 4:
        x = x.clone()  # an int32 view needs 4-byte alignment
    return x.view(torch.int32)


def _check_2d(s: torch.Tensor, what: str) -> None:
    if s.dim() < 2:
        raise LayoutError(f"{what} needs a [..., rows, cols] tensor, got shape {list(s.shape)}")


def swizzled_128x4_shape(rows: int, cols: int) -> tuple[int, int, int]:
    """Tile shape of the 128x4 swizzle of an ``[rows, cols]`` scale tensor.

    Returns ``(ceil128(rows)/128, ceil4(cols)/4, 512)``; its product is FlashInfer's flat size.
    """
    return (ceil_to(rows, TILE_ROWS) // TILE_ROWS, ceil_to(cols, TILE_COLS) // TILE_COLS,
            TILE_BYTES)


def swizzle_128x4(s: torch.Tensor) -> torch.Tensor:
    """128x4-swizzle linear scales.

    Args:
        s: ``[..., R, C]`` 1-byte tensor (uint8 or float8_e8m0fnu) in row-major linear layout;
            leading dims (experts) are kept and each matrix is swizzled on its own.

    Returns:
        uint8 ``[..., ceil128(R)/128, ceil4(C)/4, 512]``, contiguous; padding bytes are 0.
    """
    _check_2d(s, "128x4 swizzle")
    s = as_bytes(s)
    *batch, r, c = s.shape
    rp, cp = ceil_to(r, TILE_ROWS), ceil_to(c, TILE_COLS)
    s = pad_2d(s, rp, cp)
    # The 4 bytes of a row within a 4-column group stay together: move them as one int32 word.
    words = _words(s).reshape(*batch, rp // 128, 4, 32, cp // 4)
    nb = len(batch)
    perm = [*range(nb), nb, nb + 3, nb + 2, nb + 1]
    tiles = words.permute(perm).contiguous().view(torch.uint8)
    return tiles.reshape(*batch, rp // 128, cp // 4, TILE_BYTES)


def swizzle_128x4_array(s: np.ndarray) -> np.ndarray:
    """:func:`swizzle_128x4` of a numpy uint8 ``[R, C]`` array: the same bytes, without torch.

    The converter lays out the scales of MXFP8 sources with it, so that moving their bytes
    never imports torch (tests/layouts/test_swizzle.py checks it against the torch version).

    Returns:
        uint8 ``[ceil128(R)/128, ceil4(C)/4, 512]``, contiguous; padding bytes are 0.
    """
    if s.ndim != 2:
        raise LayoutError(f"128x4 swizzle needs a [rows, cols] array, got shape {list(s.shape)}")
    r, c = s.shape
    rp, cp = ceil_to(r, TILE_ROWS), ceil_to(c, TILE_COLS)
    if (r, c) != (rp, cp):
        padded = np.zeros((rp, cp), dtype=np.uint8)
        padded[:r, :c] = s
        s = padded
    words = np.ascontiguousarray(s, dtype=np.uint8).view(np.int32)
    words = words.reshape(rp // 128, 4, 32, cp // 4)
    return words.transpose(0, 3, 2, 1).copy().view(np.uint8).reshape(rp // 128, cp // 4, TILE_BYTES)


def unswizzle_128x4_array(t: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Inverse of :func:`swizzle_128x4_array`, without torch.

    Args:
        t: uint8 ``[ceil128(rows)/128, ceil4(cols)/4, 512]`` tiles, or the same bytes flat.
        rows, cols: the logical scale shape ``R, C`` to cut the padding back to.

    Returns:
        uint8 ``[rows, cols]``, contiguous.

    Raises:
        LayoutError: if ``t`` does not hold that many tiles.
    """
    tr, tc, _ = swizzled_128x4_shape(rows, cols)
    if t.size != tr * tc * TILE_BYTES:
        raise LayoutError(f"128x4 scale tiles of shape {list(t.shape)} do not hold a "
                          f"[{rows}, {cols}] scale (expected [{tr}, {tc}, 512] or its flat bytes)")
    words = np.ascontiguousarray(t, dtype=np.uint8).view(np.int32).reshape(tr, tc, 32, 4)
    x = words.transpose(0, 3, 2, 1).copy().view(np.uint8).reshape(tr * 128, tc * 4)
    return np.ascontiguousarray(x[:rows, :cols])


def unswizzle_128x4(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`.

    Args:
        t: uint8 ``[..., ceil128(rows)/128, ceil4(cols)/4, 512]`` tiles, or the same bytes flat
            (``[..., Rp*Cp]``) as FlashInfer returns them.
        rows, cols: the logical scale shape ``R, C`` to cut the padding back to.

    Returns:
        uint8 ``[..., rows, cols]``, contiguous.
    """
    t = as_bytes(t)
    tr, tc, _ = swizzled_128x4_shape(rows, cols)
    flat = tr * tc * TILE_BYTES
    if t.dim() >= 3 and tuple(t.shape[-3:]) == (tr, tc, TILE_BYTES):
        batch = t.shape[:-3]
    elif t.shape[-1] == flat:
        batch = t.shape[:-1]
    else:
        raise LayoutError(
            f"128x4 scale tiles of shape {list(t.shape)} do not hold a [{rows}, {cols}] scale "
            f"(expected [..., {tr}, {tc}, 512] or [..., {flat}])"
        )
    words = _words(t).reshape(*batch, tr, tc, 32, 4)
    nb = len(batch)
    perm = [*range(nb), nb, nb + 3, nb + 2, nb + 1]
    x = words.permute(perm).contiguous().view(torch.uint8).reshape(*batch, tr * 128, tc * 4)
    return x[..., :rows, :cols].contiguous()


def swizzled_8x4_shape(rows: int, cols: int) -> tuple[int, int, int]:
    """Tile shape of the 8x4 swizzle: ``(ceil8(rows)/8, ceil4(cols)/4, 32)``."""
    return (ceil_to(rows, 8) // 8, ceil_to(cols, 4) // 4, 32)


def swizzle_8x4(s: torch.Tensor) -> torch.Tensor:
    """8x4-swizzle linear activation scales (trtllm ``use_8x4_sf_layout=True``).

    Element ``(r, c)`` lands at ``(r//8)*(Cp/4)*32 + (c//4)*32 + (r%8)*4 + c%4``.

    Args:
        s: ``[..., R, C]`` 1-byte tensor.

    Returns:
        uint8 ``[..., ceil8(R)/8, ceil4(C)/4, 32]``, contiguous; padding bytes are 0.
    """
    _check_2d(s, "8x4 swizzle")
    s = as_bytes(s)
    *batch, r, c = s.shape
    rp, cp = ceil_to(r, 8), ceil_to(c, 4)
    s = pad_2d(s, rp, cp)
    nb = len(batch)
    t = s.reshape(*batch, rp // 8, 8, cp // 4, 4)
    perm = [*range(nb), nb, nb + 2, nb + 1, nb + 3]
    return t.permute(perm).reshape(*batch, rp // 8, cp // 4, 32).contiguous()


def unswizzle_8x4(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_8x4`: tiles (or the same bytes flat) in, ``[..., rows, cols]``
    out."""
    t = as_bytes(t)
    tr, tc, _ = swizzled_8x4_shape(rows, cols)
    flat = tr * tc * 32
    if t.dim() >= 3 and tuple(t.shape[-3:]) == (tr, tc, 32):
        batch = t.shape[:-3]
    elif t.shape[-1] == flat:
        batch = t.shape[:-1]
    else:
        raise LayoutError(
            f"8x4 scale tiles of shape {list(t.shape)} do not hold a [{rows}, {cols}] scale"
        )
    nb = len(batch)
    x = t.reshape(*batch, tr, tc, 8, 4)
    perm = [*range(nb), nb, nb + 2, nb + 1, nb + 3]
    x = x.permute(perm).reshape(*batch, tr * 8, tc * 4)
    return x[..., :rows, :cols].contiguous()
