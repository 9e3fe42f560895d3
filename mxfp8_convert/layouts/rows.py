"""P32 row shuffle of trtllm-gen weights (``flashinfer.shuffle_matrix_a``).

Inside every 32-row block, output row ``p`` is input row ``32*(p//32) + 4*(p%8) + (p%32)//8``
(docs/LAYOUTS.md section 2; ``get_shuffle_matrix_a_row_indices`` in ``flashinfer/utils.py``, with
``epilogue_tile_m=128``; any multiple of 128 gives the same permutation). The permutation only
moves rows within 32-row blocks, so it commutes with slicing rows at multiples of 32.
"""

from __future__ import annotations

from mxfp8_convert._lazy import numpy as np
from mxfp8_convert._lazy import torch
from mxfp8_convert.errors import LayoutError

P32_BLOCK = 32


def _check_rows(x: torch.Tensor) -> int:
    if x.dim() < 1:
        raise LayoutError("P32 row shuffle needs a tensor with at least one dimension")
    n = x.shape[0]
    if n % P32_BLOCK:
        raise LayoutError(f"P32 row shuffle needs rows % 32 == 0, got {n} rows")
    return n


def p32_shuffle_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Shuffle the rows of ``x`` the way ``shuffle_matrix_a(x, 128)`` does.

    Args:
        x: ``[N, ...]`` tensor of any dtype, ``N % 32 == 0``.
        out: a contiguous tensor of ``x``'s dtype and element count (any shape) to receive the
            rows (a pipeline reuses its buffers), or None.

    Returns:
        ``out`` viewed as ``[N, ...]``, or a new contiguous ``[N, ...]`` tensor, same dtype and
        device.

    Raises:
        LayoutError: if ``N % 32 != 0``.
    """
    n = _check_rows(x)
    rest = x.shape[1:]
    blocks = x.reshape(n // 32, 8, 4, -1).transpose(1, 2)
    if out is None:
        return blocks.reshape(n, *rest).contiguous()
    out.view(n // 32, 4, 8, -1).copy_(blocks)
    return out.view(n, *rest)


def p32_unshuffle_rows(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`p32_shuffle_rows`: ``[N, ...]`` in, ``[N, ...]`` out."""
    n = _check_rows(x)
    rest = x.shape[1:]
    return x.reshape(n // 32, 4, 8, -1).transpose(1, 2).reshape(n, *rest).contiguous()


def p32_shuffle_rows_array(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`p32_shuffle_rows` in numpy (no torch): ``[N, K]`` in, a new ``[N, K]`` out.

    Args:
        x: ``[N, K]`` array of any dtype, ``N % 32 == 0`` (may be read-only, e.g. a mapping).
        out: an array of ``x``'s size and dtype (any shape) to receive the rows, or None.

    Returns:
        ``out`` reshaped to ``[N, K]`` (a new contiguous array if ``out`` is None).

    Raises:
        LayoutError: if ``x`` is not 2-D or ``N % 32 != 0``.
    """
    n, k = _array_rows(x, "P32 row shuffle")
    out = np.empty_like(x) if out is None else out.reshape(n, k)
    out.reshape(-1, 4, 8, k)[...] = x.reshape(-1, 8, 4, k).transpose(0, 2, 1, 3)
    return out


def p32_unshuffle_rows_array(x: np.ndarray) -> np.ndarray:
    """Inverse of :func:`p32_shuffle_rows_array`: ``[N, K]`` in, a new ``[N, K]`` out.

    Raises:
        LayoutError: if ``x`` is not 2-D or ``N % 32 != 0``.
    """
    n, k = _array_rows(x, "P32 row unshuffle")
    return np.ascontiguousarray(x.reshape(-1, 4, 8, k).transpose(0, 2, 1, 3)).reshape(n, k)


def _array_rows(x: np.ndarray, what: str) -> tuple[int, int]:
    if x.ndim != 2:
        raise LayoutError(f"{what} of an array needs [N, K], got {list(x.shape)}")
    if x.shape[0] % P32_BLOCK:
        raise LayoutError(f"P32 row shuffle needs rows % 32 == 0, got {x.shape[0]} rows")
    return x.shape


def _source_row(p):
    """The input row that lands at output row ``p`` (a Python int or an integer tensor)."""
    return 32 * (p // 32) + 4 * (p % 8) + (p % 32) // 8


def p32_row_order(n: int) -> list[int]:
    """``p32_row_indices(n)`` as a list of ints, computed without torch (for row copies)."""
    if n % P32_BLOCK:
        raise LayoutError(f"P32 row shuffle needs rows % 32 == 0, got {n} rows")
    return [_source_row(p) for p in range(n)]


def p32_row_indices(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``idx[p]`` = the input row that lands at output row ``p`` (int64, ``[n]``).

    ``x[p32_row_indices(N)]`` equals ``p32_shuffle_rows(x)``; kernels use it to map a physical
    row of a shuffled weight back to its logical output feature.
    """
    if n % P32_BLOCK:
        raise LayoutError(f"P32 row shuffle needs rows % 32 == 0, got {n} rows")
    return _source_row(torch.arange(n, device=device))
