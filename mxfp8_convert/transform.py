"""Apply one plan entry to in-memory tensors. No disk, no rich, no flashinfer.

The weight is laid out in row chunks (P32 moves rows only within 32-row blocks, so any chunk
of a multiple of 32 rows is laid out on its own), which keeps memory bounded by the chunk,
not the tensor. Scales are ~1/32 of the weight and are laid out whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mxfp8_convert._lazy import torch
from mxfp8_convert.backends import BackendSpec
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.format import CANONICAL_LAYOUT, LAYOUTS
from mxfp8_convert.layouts.moe import (
    moe_fc1_scale_from_canonical,
    moe_fc1_scale_to_canonical,
    moe_fc1_weight_from_canonical,
    moe_fc1_weight_to_canonical,
    moe_fc2_scale_from_canonical,
    moe_fc2_scale_to_canonical,
    moe_fc2_weight_from_canonical,
    moe_fc2_weight_to_canonical,
)
from mxfp8_convert.layouts.rows import P32_BLOCK
from mxfp8_convert.plan import ModulePlan, TensorPlan

if TYPE_CHECKING:
    from mxfp8_convert.quantize import QuantError


_P32_ROWS, _IDENTITY = LAYOUTS["trtllm"].weight, LAYOUTS["cutlass"].weight


def weight_granule(t: TensorPlan) -> int:
    """Bytes per independent chunk of a weight: 32 rows for a shuffled layout, else 1."""
    if t.role == "weight" and t.layout == _P32_ROWS:
        return P32_BLOCK * t.shape[1]
    return 1


def layout_weight_chunk(t: TensorPlan, backend: BackendSpec, chunk: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Lay out a chunk of ``t``'s canonical weight bytes: uint8 ``[rows*K]`` in, same size out.

    Layouts that keep the bytes return ``chunk`` itself. ``out`` (same size) receives the
    shuffled bytes when given, so a pipeline can reuse its buffers.
    """
    if (t.layout in (CANONICAL_LAYOUT, "copy") or t.layout != backend.weight_layout
            or t.layout == _IDENTITY):
        return chunk
    k = t.shape[1]
    if out is None or t.layout != _P32_ROWS:
        return backend.weight_forward(chunk.view(-1, k)).reshape(-1)
    out.view(-1, 4, 8, k).copy_(chunk.view(-1, 8, 4, k).transpose(1, 2))  # = p32_shuffle_rows
    return out


def layout_scale(t: TensorPlan, backend: BackendSpec, s: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Canonical uint8 ``[N, C]`` scale -> the bytes of ``t`` (tiles, or unchanged if canonical).

    A numpy uint8 array is laid out with numpy (no torch), into a numpy array of the same bytes.
    """
    if isinstance(s, np.ndarray):
        forward = backend.scale_forward_array
    else:
        s = s if s.dtype == torch.uint8 else s.view(torch.uint8)
        forward = backend.scale_forward
    if tuple(s.shape) != tuple(t.logical_shape):
        raise LayoutError(f"scale {t.source!r}: shape {list(s.shape)} != planned {list(t.logical_shape)}")
    if t.layout == "canonical":
        return s
    out = forward(s)
    if tuple(out.shape) != tuple(t.shape):
        raise LayoutError(f"scale {t.name!r}: laid out to {list(out.shape)}, planned {list(t.shape)} (bug)")
    return out


def canonical_module(m: ModulePlan, weight: torch.Tensor, scale: torch.Tensor | None,
                     src_backend: BackendSpec | None) -> tuple[torch.Tensor, torch.Tensor, QuantError | None]:
    """A module's canonical MXFP8: (uint8 ``[N, K]``, uint8 ``[N, K/32]``, error or None).

    Args:
        m: the module's plan (its ``action`` and ``source_kind`` say which path).
        weight: the source weight as stored (its dtype and shape).
        scale: the source scale as stored, or None for a dense source.
        src_backend: for a laid-out source, the backend its bytes follow.

    Raises:
        LayoutError: NaN/Inf in the source, a scale byte of 255, bad shapes (naming the tensor).
    """
    from mxfp8_convert.quantize import (  # torch at import: only computed modules need it
        block_fp8_to_mxfp8,
        per_tensor_fp8_to_mxfp8,
        quantization_error,
        quantize_mxfp8,
    )

    name = m.weight.name
    if m.fused is not None:
        return (*expert_from_fused(m, weight, scale), None)
    if m.source_kind == "dense":
        ref = dense_weight(m, weight)
        q, s = quantize_mxfp8(ref, name=name)
        return q.view(torch.uint8), s, quantization_error(ref, q, s, name=name)
    if m.source_kind == "block_fp8":
        r = block_fp8_to_mxfp8(weight, scale, name=name, scale_name=m.scale.name)
        return r.q.view(torch.uint8), r.s, r.error
    if m.source_kind == "fp8":
        r = per_tensor_fp8_to_mxfp8(weight, scale, name=name, scale_name=m.scale.name)
        return r.q.view(torch.uint8), r.s, r.error
    w = weight.reshape(m.n, m.k).view(torch.uint8)
    s = scale.view(torch.uint8)
    if src_backend is not None:  # undo the source's layout
        w = src_backend.weight_inverse(w)
        s = src_backend.scale_inverse(s, m.n, m.k // 32)
    check_scale_codes(s.reshape(m.n, m.k // 32), m.scale.name)
    return w, s.reshape(m.n, m.k // 32), None


def dense_weight(m: ModulePlan, weight: torch.Tensor) -> torch.Tensor:
    """A dense module's ``[N, K]`` weight: the tensor itself, or its expert's columns of a
    stacked ``[K, N']`` expert slice (``plan.StackedSlice``), transposed."""
    if m.stacked is None:
        return weight.reshape(m.n, m.k)
    cols = {"all": slice(None), "first": slice(0, m.n), "second": slice(m.n, 2 * m.n),
            "even": slice(0, None, 2), "odd": slice(1, None, 2)}[m.stacked.cols]
    return weight.reshape(m.k, -1)[:, cols].t().contiguous()


def dequantized_module(m: ModulePlan, weight: torch.Tensor, scale: torch.Tensor,
                       src_backend: BackendSpec | None, dtype: torch.dtype) -> torch.Tensor:
    """A quantized source module's ``[N, K]`` values in ``dtype``: FP8 sources by their own
    float32 math (``fl32(w) * scale``), MXFP8 ones (laid out or not) from their canonical bytes.

    Raises:
        LayoutError: NaN/Inf in the source, a bad scale (naming the tensor).
    """
    from mxfp8_convert.quantize import check_finite, dequantize_mxfp8

    if m.source_kind in ("block_fp8", "fp8"):
        w = weight.reshape(m.n, m.k)
        check_finite(w, m.weight.name)
        f = scale.to(torch.float32)
        if m.source_kind == "block_fp8":
            rows, cols = torch.arange(m.n) // 128, torch.arange(m.k) // 128
            f = f[rows][:, cols]
        else:
            f = f.reshape(-1, 1) if f.numel() > 1 else f.reshape(())
        return (w.to(torch.float32) * f).to(dtype)
    q, s, _ = canonical_module(m, weight, scale, src_backend)
    out = dequantize_mxfp8(q.reshape(m.n, m.k), s, name=m.weight.name)
    return out.to(dtype)


#: fused MoE tensor role -> (expert projections it is made of, in argument order; layout function)
MOE_FUSE = {
    "moe_fc1_weight": (("up", "gate"), moe_fc1_weight_from_canonical),
    "moe_fc1_scale": (("up", "gate"), moe_fc1_scale_from_canonical),
    "moe_fc2_weight": (("down",), moe_fc2_weight_from_canonical),
    "moe_fc2_scale": (("down",), moe_fc2_scale_from_canonical),
}


def fuse_expert(role: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One expert's bytes of the fused MoE tensor ``role`` (a key of ``MOE_FUSE``), flat uint8.

    Args:
        role: ``moe_fc1_weight`` / ``moe_fc2_weight`` (``parts`` are canonical uint8 ``[I, H]``
            up and gate, or ``[H, I]`` down) or ``moe_fc1_scale`` / ``moe_fc2_scale`` (their
            canonical ``[rows, K/32]`` scales).
        parts: the canonical tensors, in the order ``MOE_FUSE[role]`` names them.

    Returns:
        uint8 ``[2I*H]``, ``[H*I]`` or the flat 128x4 tiles: expert ``e``'s slice of the stacked tensor.
    """
    _, lay_out = MOE_FUSE[role]
    return lay_out(*(p.view(torch.uint8) for p in parts)).view(torch.uint8).reshape(-1)


def expert_from_fused(m: ModulePlan, weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert projection's canonical MXFP8, cut out of its expert's fused MoE bytes.

    Args:
        m: a module with ``m.fused`` set (which projection of which expert, H and I).
        weight: that expert's fused weight, ``[2I, H]`` (gate, up) or ``[H, I]`` (down), 1-byte.
        scale: that expert's fused scale tiles (uint8 ``[2I/128, H/128, 512]`` or ``[H/128, I/128, 512]``).

    Returns:
        ``(uint8 [N, K], uint8 [N, K/32])``, contiguous.
    """
    f = m.fused
    w, s = weight.view(torch.uint8), scale.view(torch.uint8)
    if f.proj == "down":
        w = moe_fc2_weight_to_canonical(w.reshape(f.hidden, f.intermediate))
        s = moe_fc2_scale_to_canonical(s, f.hidden, f.intermediate)
    else:
        half = 0 if f.proj == "up" else 1  # FC1 is cat([up, gate])
        w = moe_fc1_weight_to_canonical(w.reshape(2 * f.intermediate, f.hidden))[half]
        s = moe_fc1_scale_to_canonical(s, f.hidden, f.intermediate)[half]
    check_scale_codes(s, f"{m.scale.name} (expert {f.expert} {f.proj})")
    return w, s


def check_scale_codes(s: torch.Tensor | np.ndarray, name: str) -> None:
    """UE8M0 byte 255 is NaN: refuse it, naming the tensor and the first position.

    ``s`` may be a tensor or a numpy uint8 array (the converter's torch-free path).
    """
    if isinstance(s, np.ndarray):
        bad = s == 255
        if bad.any():
            idx = [int(i) for i in np.unravel_index(int(bad.argmax()), s.shape)]
            raise LayoutError(f"scale {name!r} holds NaN (UE8M0 byte 255) at {idx}")
        return
    bad = s.view(torch.uint8) == 255
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise LayoutError(f"scale {name!r} holds NaN (UE8M0 byte 255) at {idx}")
