"""Fused-MoE layout of FlashInfer's trtllm-gen MXFP8 kernel (``trtllm_fp8_block_scale_moe``).

Target: ``fp8_quantization_type=Fp8QuantizationType.MxFp8``, ``use_shuffled_weight=True``,
``weight_layout=MajorK`` (the launcher refuses MxFp8 without both), gated activation (SwiGLU,
GeGLU, ...). docs/LAYOUTS.md sections 2 and 6. Per expert:

* FC1 ``w13 [2I, H]`` is ``cat([up, gate])``: the first ``I`` rows are the linear ("up", w3)
  half, the last ``I`` rows the activated ("gate", w1) half. Rows are interleaved
  ``[up0, gate0, up1, gate1, ...]`` (``reorder_rows_for_gated_act_gemm``), then P32-shuffled.
  Scales ``[2I, H/32]``: the same interleave, then P32, then the 128x4 swizzle.
* FC2 ``down [H, I]``: P32. Scales ``[H, I/32]``: P32, then 128x4.

Sources (FlashInfer 0.7.2.post1, re-read them when the pinned version changes):

* ``flashinfer/fused_moe/core.py``: ``get_reorder_rows_for_gated_act_gemm_row_indices`` /
  ``reorder_rows_for_gated_act_gemm`` (row ``2j`` <- ``j``, row ``2j+1`` <- ``I + j``);
  ``_maybe_get_cached_w3_w1_permute_indices`` (``permute0[permute1]``: the interleave
  composed with ``get_shuffle_matrix_a_row_indices``, or with
  ``get_shuffle_matrix_sf_a_row_indices`` when ``num_elts_per_sf`` is given, which is the same
  P32 plus an ``M % 128 == 0`` assert); ``get_w2_permute_indices_with_cache`` (P32 only);
  ``trtllm_fp8_block_scale_moe`` docstring: "GEMM1 output split as X1 (linear/up half) and X2
  (gate half); activation = X2 * sigmoid(alpha * X2) * (X1 + beta)".
* ``flashinfer/fused_moe/prepare.py`` ``prepare_trtllm_fp8_block_weights`` (MXFP8 branch):
  per expert, ``w1[permute]`` with ``_maybe_get_cached_w3_w1_permute_indices(cache, w, 128)``,
  scales ``block_scale_interleave(sf[permute_sf]).reshape_as(sf)`` with the same helper and
  ``num_elts_per_sf=32``; FC2 likewise with ``get_w2_permute_indices_with_cache``; it requires
  ``hidden_size % 128 == 0`` and ``intermediate_size % 128 == 0`` and pads nothing.
* ``flashinfer/fused_moe/api.py`` ``MoEWeightPack``: canonical ``w1`` rows are ``[up, gate]``
  (``act(x @ w1[I:].T) * (x @ w1[:I].T)``); backends wanting ``[gate, up]`` swap inside their
  prepare helper, and the trtllm FP8 one does not.
* flashinfer-ai/flashinfer ``tests/moe/trtllm_gen_fused_moe_utils.py``:
  ``FP8BlockScaleMoe.prepare_static_weights_for_kernel`` (MXFP8: ``reorder_rows_for_gated_act_gemm``
  on weights and linear scales, then ``shuffle_matrix_a(w, 128)`` and
  ``shuffle_matrix_sf_a(s, 128)``); ``run_moe_dequant``: ``x0 = out[:, :I]``,
  ``x1 = out[:, I:]``, SwiGLU ``= silu(x1) * x0``, so the second half is the gate.
* ``data/csrc/trtllm_fused_moe_kernel_launcher.cu``: MxFp8 scales are only checked to be uint8
  (no shape check); the kernel reads bytes, FlashInfer hands it ``[E, 2I, H/32]`` /
  ``[E, H, I/32]`` views of the swizzled buffers.

Our swizzled scales are returned as 128x4 tiles ``[..., rows/128, cols/4, 512]`` (see
``swizzle.py``); ``.reshape(E, 2I, H // 32)`` / ``.reshape(E, H, I // 32)`` gives the exact tensor
FlashInfer's prepare helper builds (same bytes). Every function refuses shapes the kernel
cannot take (:func:`moe_shape_violations`) instead of padding: padding a fused ``[up; gate]``
would have to pad each half separately (``valid_intermediate_size``), which is a different
layout, not a detail of this one.
"""

from __future__ import annotations

from mxfp8_convert._lazy import numpy as np
from mxfp8_convert._lazy import torch
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.layouts._common import as_bytes
from mxfp8_convert.layouts.rows import (
    P32_BLOCK,
    p32_row_indices,
    p32_shuffle_rows,
    p32_shuffle_rows_array,
    p32_unshuffle_rows,
)
from mxfp8_convert.layouts.swizzle import (
    TILE_BYTES,
    swizzle_128x4,
    swizzle_128x4_array,
    unswizzle_128x4,
)

MX_BLOCK = 32  # MXFP8: one UE8M0 scale per 1x32 block along K
MOE_ALIGN = 128  # H and I: 128x4 scale tiles without padding, FlashInfer's MXFP8 prepare check


# --- constraints and shapes -----------------------------------------------------------------


def moe_shape_violations(hidden: int, intermediate: int) -> list[str]:
    """Every reason an expert of this size cannot be laid out for the MXFP8 fused MoE.

    FC1 is ``[2I, H]`` (K = H), FC2 is ``[H, I]`` (K = I). The kernel path needs H and I to be
    multiples of 128 (``prepare_trtllm_fp8_block_weights`` checks exactly this); that implies
    the rest (2I % 128 for the FC1 P32 scale rows, K % 32 for MXFP8 blocks, scale columns % 4).
    The finer facts are listed too so the message says what breaks.

    Args:
        hidden: H, the model hidden size (FC1 K, FC2 rows).
        intermediate: I, the per-expert intermediate size (FC1 rows = 2I, FC2 K).

    Returns:
        Short phrases, empty when the shape is eligible.
    """
    out = []
    for name, v in (("H", hidden), ("I", intermediate)):
        if v <= 0:
            out.append(f"{name}={v} is not positive")
    if out:
        return out
    if hidden % MOE_ALIGN:
        out.append(f"H={hidden} is not a multiple of 128 (FC2 rows, FC1 scale columns H/32 % 4)")
    if hidden % MX_BLOCK:
        out.append(f"H={hidden} is not a multiple of 32 (FC1 K: MXFP8 1x32 blocks)")
    if intermediate % MOE_ALIGN:
        out.append(
            f"I={intermediate} is not a multiple of 128 (FC2 scale columns I/32 % 4, "
            "FlashInfer's MXFP8 prepare check)"
        )
    if (2 * intermediate) % MOE_ALIGN:
        out.append(f"2I={2 * intermediate} is not a multiple of 128 (FC1 P32 scale rows)")
    if intermediate % MX_BLOCK:
        out.append(f"I={intermediate} is not a multiple of 32 (FC2 K: MXFP8 1x32 blocks)")
    return out


def _require(hidden: int, intermediate: int, what: str) -> None:
    bad = moe_shape_violations(hidden, intermediate)
    if bad:
        raise LayoutError(
            f"{what}: expert shape H={hidden}, I={intermediate} does not fit the trtllm MXFP8 "
            f"fused MoE: {'; '.join(bad)}"
        )


def _lead(num_experts: int | None) -> tuple[int, ...]:
    return () if num_experts is None else (num_experts,)


def moe_fc1_weight_shape(
    hidden: int, intermediate: int, num_experts: int | None = None
) -> tuple[int, ...]:
    """Shape of :func:`moe_fc1_weight_from_canonical`'s output: ``([E,] 2I, H)``."""
    _require(hidden, intermediate, "FC1 weight shape")
    return (*_lead(num_experts), 2 * intermediate, hidden)


def moe_fc1_scale_shape(
    hidden: int, intermediate: int, num_experts: int | None = None
) -> tuple[int, ...]:
    """Shape of :func:`moe_fc1_scale_from_canonical`'s output: ``([E,] 2I/128, H/128, 512)``.

    That is ``ceil128(2I)/128, ceil4(H/32)/4`` with nothing to round, since H, I % 128 == 0.
    """
    _require(hidden, intermediate, "FC1 scale shape")
    return (*_lead(num_experts), 2 * intermediate // 128, hidden // 128, TILE_BYTES)


def moe_fc2_weight_shape(
    hidden: int, intermediate: int, num_experts: int | None = None
) -> tuple[int, ...]:
    """Shape of :func:`moe_fc2_weight_from_canonical`'s output: ``([E,] H, I)``."""
    _require(hidden, intermediate, "FC2 weight shape")
    return (*_lead(num_experts), hidden, intermediate)


def moe_fc2_scale_shape(
    hidden: int, intermediate: int, num_experts: int | None = None
) -> tuple[int, ...]:
    """Shape of :func:`moe_fc2_scale_from_canonical`'s output: ``([E,] H/128, I/128, 512)``."""
    _require(hidden, intermediate, "FC2 scale shape")
    return (*_lead(num_experts), hidden // 128, intermediate // 128, TILE_BYTES)


# --- row permutations -----------------------------------------------------------------------


def gated_interleave_rows(w13: torch.Tensor) -> torch.Tensor:
    """Interleave the two halves of a fused gated weight (``reorder_rows_for_gated_act_gemm``).

    Args:
        w13: ``[..., 2I, C]`` tensor of any dtype, rows ``[h0_0 .. h0_{I-1}, h1_0 .. h1_{I-1}]``.

    Returns:
        A new contiguous ``[..., 2I, C]`` tensor with rows ``[r0, r_I, r1, r_{I+1}, ...]``.

    Raises:
        LayoutError: if ``w13`` has fewer than 2 dims or an odd row count.
    """
    *lead, n, c = _rows_of(w13, "gated interleave")
    return w13.reshape(*lead, 2, n // 2, c).transpose(-3, -2).reshape(*lead, n, c).contiguous()


def gated_deinterleave_rows(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`gated_interleave_rows`: ``[..., 2I, C]`` in, ``[..., 2I, C]`` out."""
    *lead, n, c = _rows_of(x, "gated de-interleave")
    return x.reshape(*lead, n // 2, 2, c).transpose(-3, -2).reshape(*lead, n, c).contiguous()


def _rows_of(x: torch.Tensor, what: str) -> tuple[int, ...]:
    if x.dim() < 2:
        raise LayoutError(f"{what} needs a [..., rows, cols] tensor, got shape {list(x.shape)}")
    if x.shape[-2] % 2:
        raise LayoutError(f"{what} needs an even row count, got {x.shape[-2]} rows")
    return tuple(x.shape)


def _p32(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """P32 on the rows (dim -2) of every matrix of ``[..., N, C]``, N % 32 == 0.

    Flattening the leading dims into the rows is exact: with N % 32 == 0 no 32-row block spans
    two matrices, and P32 never moves a row out of its block.
    """
    if x.shape[-2] % P32_BLOCK:
        raise LayoutError(f"P32 row shuffle needs rows % 32 == 0, got {x.shape[-2]} rows")
    flat = x.reshape(-1, x.shape[-1])
    out = p32_unshuffle_rows(flat) if inverse else p32_shuffle_rows(flat)
    return out.reshape(x.shape)


def moe_fc1_row_indices(
    intermediate: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``idx[p]`` = the row of canonical ``cat([up, gate])`` that lands at FC1 physical row ``p``.

    Equals FlashInfer's ``_maybe_get_cached_w3_w1_permute_indices(cache, w13, 128)`` (int64,
    ``[2I]``); handy for laying out a per-row FC1 bias the same way (``bias[idx]``).
    """
    if intermediate <= 0 or (2 * intermediate) % P32_BLOCK:
        raise LayoutError(f"FC1 row indices need 2I % 32 == 0, got I={intermediate}")
    q = p32_row_indices(2 * intermediate, device=device)  # interleaved row at physical row p
    return (q % 2) * intermediate + q // 2


# --- FC1: fused [up; gate] ------------------------------------------------------------------


def _pair(up: torch.Tensor, gate: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise LayoutError(
            f"{what}: up {list(up.shape)} {up.dtype} and gate {list(gate.shape)} {gate.dtype} "
            "must have the same shape and dtype"
        )
    if up.dim() < 2:
        raise LayoutError(f"{what} needs [..., I, K] tensors, got shape {list(up.shape)}")
    return as_bytes(up), as_bytes(gate)


def _fc1_pack(up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``_p32(gated_interleave_rows(cat([up, gate], -2)))`` in one pass: ``[..., I, K]`` x2 in.

    FC1 tensors are the biggest in a MoE checkpoint, so the two row permutations are composed
    instead of materialised one after the other (about 2x faster on CPU). Physical row
    ``32b + 8a + c`` (``a < 4``, ``c < 8``) takes interleaved row ``32b + 4c + a`` (P32), that is
    row ``j = 16b + 2c + a//2`` of half ``a % 2`` (0 = up, 1 = gate). The tests check this
    against ``gated_interleave_rows`` + ``p32_shuffle_rows`` and FlashInfer's permute indices.
    """
    *lead, i, k = up.shape
    out = up.new_empty(*lead, i // 16, 2, 2, 8, k)  # (b, a//2, a%2, c, K)
    for half, src in enumerate((up, gate)):
        out[..., half, :, :] = src.reshape(*lead, i // 16, 8, 2, k).transpose(-3, -2)
    return out.reshape(*lead, 2 * i, k)


def _fc1_unpack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fc1_pack`: ``[..., 2I, K]`` in, ``(up, gate)`` ``[..., I, K]`` out."""
    *lead, n, k = x.shape
    v = x.reshape(*lead, n // 32, 2, 2, 8, k)
    halves = (v[..., h, :, :].transpose(-3, -2).reshape(*lead, n // 2, k) for h in (0, 1))
    up, gate = (t.contiguous() for t in halves)
    return up, gate


def moe_fc1_weight_from_canonical(up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Fuse, interleave and P32-shuffle the FC1 weights of every expert.

    Args:
        up: ``[..., I, H]`` e4m3 (or any 1-byte dtype) linear half, w3 / ``up_proj``.
        gate: ``[..., I, H]`` same dtype, activated half, w1 / ``gate_proj``.

    Returns:
        ``[..., 2I, H]``, contiguous, same dtype as the inputs:
        ``shuffle_matrix_a(reorder_rows_for_gated_act_gemm(cat([up, gate])), 128)`` per expert.

    Raises:
        LayoutError: on mismatched inputs or a shape :func:`moe_shape_violations` rejects.
    """
    u, g = _pair(up, gate, "FC1 weight")
    _require(u.shape[-1], u.shape[-2], "FC1 weight")
    return _fc1_pack(u, g).view(up.dtype)


def moe_fc1_weight_to_canonical(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`moe_fc1_weight_from_canonical`.

    Args:
        w: ``[..., 2I, H]`` laid-out FC1 weight, any 1-byte dtype.

    Returns:
        ``(up, gate)``, each a contiguous ``[..., I, H]`` tensor of ``w``'s dtype.
    """
    b = as_bytes(w)
    _rows_of(b, "FC1 weight")
    _require(b.shape[-1], b.shape[-2] // 2, "FC1 weight")
    up, gate = _fc1_unpack(b)
    return up.view(w.dtype), gate.view(w.dtype)


def moe_fc1_scale_from_canonical(up_s: torch.Tensor, gate_s: torch.Tensor) -> torch.Tensor:
    """Fuse, interleave, P32-shuffle and 128x4-swizzle the FC1 scales of every expert.

    Args:
        up_s: ``[..., I, H/32]`` UE8M0 scales of ``up`` (uint8 or float8_e8m0fnu).
        gate_s: ``[..., I, H/32]`` scales of ``gate``, same dtype.

    Returns:
        uint8 ``[..., 2I/128, H/128, 512]`` tiles; no padding. Per expert this is the byte
        sequence of ``block_scale_interleave(s[perm])`` with ``s = cat([up_s, gate_s])`` and
        ``perm = _maybe_get_cached_w3_w1_permute_indices(cache, s, 128, num_elts_per_sf=32)``;
        ``.reshape(E, 2I, H // 32)`` is the tensor FlashInfer passes to the kernel.

    Raises:
        LayoutError: on mismatched inputs or a shape :func:`moe_shape_violations` rejects.
    """
    u, g = _pair(up_s, gate_s, "FC1 scale")
    _require(u.shape[-1] * MX_BLOCK, u.shape[-2], "FC1 scale")
    return swizzle_128x4(_fc1_pack(u, g))


def moe_fc1_scale_to_canonical(
    t: torch.Tensor, hidden: int, intermediate: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`moe_fc1_scale_from_canonical`.

    Args:
        t: uint8 ``[..., 2I/128, H/128, 512]`` tiles, or the same bytes flat ``[..., 2I*H/32]``
            (a kernel-shaped ``[E, 2I, H/32]`` tensor must be ``.reshape(E, -1)`` first).
        hidden: H.
        intermediate: I.

    Returns:
        ``(up_s, gate_s)``, each uint8 ``[..., I, H/32]``, contiguous.
    """
    _require(hidden, intermediate, "FC1 scale")
    s = unswizzle_128x4(t, 2 * intermediate, hidden // MX_BLOCK)
    return _fc1_unpack(s)


def moe_fc1_rows_array(up: np.ndarray, gate: np.ndarray,
                       out: np.ndarray | None = None) -> np.ndarray:
    """:func:`moe_fc1_weight_from_canonical` of one expert's rows, in numpy (no torch).

    The FC1 permutation moves rows only within 32-row output blocks, and output block ``b``
    holds rows ``16b .. 16b+15`` of ``up`` and of ``gate``; so rows ``[16j, 16(j+n))`` of both
    halves give output rows ``[32j, 32(j+n))`` on their own, and an expert can be laid out in
    row chunks (the converter writes a fused ``w13`` so, through one reused buffer).

    Args:
        up: uint8 ``[R, K]`` rows of the linear half (``R % 16 == 0``; may be read-only, e.g.
            a source mapping).
        gate: uint8 ``[R, K]``, the same rows of the activated half.
        out: a uint8 array of ``2 * R * K`` bytes (any shape) to receive them, or None.

    Returns:
        uint8 ``[2R, K]``: ``out`` reshaped, or a new array.

    Raises:
        LayoutError: on mismatched inputs or ``R % 16 != 0``.
    """
    if up.shape != gate.shape or up.ndim != 2:
        raise LayoutError(f"FC1 rows: up {list(up.shape)} and gate {list(gate.shape)} must be "
                          "the same [R, K]")
    r, k = up.shape
    if r % (P32_BLOCK // 2):
        raise LayoutError(f"FC1 rows: {r} rows of each half is not a multiple of 16")
    out = np.empty((2 * r, k), dtype=np.uint8) if out is None else out.reshape(2 * r, k)
    blocks = out.reshape(r // 16, 2, 2, 8, k)  # (b, a//2, a%2, c, K), as _fc1_pack
    for half, src in enumerate((up, gate)):
        blocks[:, :, half] = src.reshape(r // 16, 8, 2, k).transpose(0, 2, 1, 3)
    return out


def moe_fc1_scale_from_canonical_array(up_s: np.ndarray, gate_s: np.ndarray) -> np.ndarray:
    """:func:`moe_fc1_scale_from_canonical` of one expert, in numpy (no torch).

    Args:
        up_s: uint8 ``[I, H/32]`` scales of ``up``; ``gate_s``: the same of ``gate``.

    Returns:
        uint8 ``[2I/128, H/128, 512]`` tiles, the same bytes as the torch function.
    """
    if up_s.shape != gate_s.shape or up_s.ndim != 2:
        raise LayoutError(f"FC1 scale: up {list(up_s.shape)} and gate {list(gate_s.shape)} "
                          "must be the same [I, H/32]")
    _require(up_s.shape[1] * MX_BLOCK, up_s.shape[0], "FC1 scale")
    return swizzle_128x4_array(moe_fc1_rows_array(up_s, gate_s))


# --- FC2: down ------------------------------------------------------------------------------


def moe_fc2_weight_from_canonical(down: torch.Tensor) -> torch.Tensor:
    """P32-shuffle the FC2 weights of every expert (``get_w2_permute_indices_with_cache``).

    Args:
        down: ``[..., H, I]`` e4m3 (or any 1-byte dtype), ``down_proj`` / w2.

    Returns:
        ``[..., H, I]``, contiguous, same dtype: ``shuffle_matrix_a(down, 128)`` per expert.
    """
    b = as_bytes(down)
    _rows_of(b, "FC2 weight")
    _require(b.shape[-2], b.shape[-1], "FC2 weight")
    return _p32(b).view(down.dtype)


def moe_fc2_weight_to_canonical(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`moe_fc2_weight_from_canonical`: ``[..., H, I]`` in and out."""
    b = as_bytes(w)
    _rows_of(b, "FC2 weight")
    _require(b.shape[-2], b.shape[-1], "FC2 weight")
    return _p32(b, inverse=True).view(w.dtype)


def moe_fc2_scale_from_canonical(down_s: torch.Tensor) -> torch.Tensor:
    """P32-shuffle and 128x4-swizzle the FC2 scales of every expert.

    Args:
        down_s: ``[..., H, I/32]`` UE8M0 scales (uint8 or float8_e8m0fnu).

    Returns:
        uint8 ``[..., H/128, I/128, 512]`` tiles; no padding. Per expert the bytes of
        ``block_scale_interleave(s[get_w2_permute_indices_with_cache(cache, s, 128, 32)])``;
        ``.reshape(E, H, I // 32)`` is the tensor FlashInfer passes to the kernel.
    """
    b = as_bytes(down_s)
    _rows_of(b, "FC2 scale")
    _require(b.shape[-2], b.shape[-1] * MX_BLOCK, "FC2 scale")
    return swizzle_128x4(_p32(b))


def moe_fc2_scale_to_canonical(t: torch.Tensor, hidden: int, intermediate: int) -> torch.Tensor:
    """Inverse of :func:`moe_fc2_scale_from_canonical`.

    Args:
        t: uint8 ``[..., H/128, I/128, 512]`` tiles or the same bytes flat ``[..., H*I/32]``.
        hidden: H.
        intermediate: I.

    Returns:
        uint8 ``[..., H, I/32]``, contiguous.
    """
    _require(hidden, intermediate, "FC2 scale")
    return _p32(unswizzle_128x4(t, hidden, intermediate // MX_BLOCK), inverse=True)


def moe_fc2_scale_from_canonical_array(down_s: np.ndarray) -> np.ndarray:
    """:func:`moe_fc2_scale_from_canonical` of one expert, in numpy (no torch).

    Args:
        down_s: uint8 ``[H, I/32]``.

    Returns:
        uint8 ``[H/128, I/128, 512]`` tiles, the same bytes as the torch function.
    """
    if down_s.ndim != 2:
        raise LayoutError(f"FC2 scale needs [H, I/32], got {list(down_s.shape)}")
    _require(down_s.shape[0], down_s.shape[1] * MX_BLOCK, "FC2 scale")
    return swizzle_128x4_array(p32_shuffle_rows_array(down_s))
