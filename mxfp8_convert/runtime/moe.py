"""Fused MoE on laid-out MXFP8 experts: FlashInfer's trtllm-gen kernel, Triton, or a reference.

A layer's experts are held as :class:`MXFP8MoEWeights`, in the layout of FlashInfer's
``trtllm_fp8_block_scale_moe`` with ``Fp8QuantizationType.MxFp8`` (``layouts/moe.py``,
docs/LAYOUTS.md section 6): FC1 ``w13 [E, 2I, H]`` = ``cat([up, gate])`` rows interleaved then
P32, FC2 ``w2 [E, H, I]`` P32, scales the same rows then 128x4 tiles.

Semantics, on every engine (FlashInfer's docstring of ``trtllm_fp8_block_scale_moe`` and its test
oracle ``run_moe_dequant``, tests/moe/trtllm_gen_fused_moe_utils.py)::

    a      = fq(x)                                   # MXFP8, FlashInfer's recipe (reference.py)
    X1, X2 = a @ dq(up_e).T, a @ dq(gate_e).T        # FC1 output halves: X1 linear, X2 gate
    h      = fq(bf16(silu(X2) * X1))                 # SwiGLU, then MXFP8 again for FC2
    out[t] = bf16(sum_k w[t, k] * (h @ dq(down_e).T))   with e = topk_ids[t, k]

``dq`` is the exact dequantization of the stored bytes; products are exact, sums float64
(reference) or float32 (kernels). Routing is done by the caller (``topk_ids``, ``topk_weights``
are used as given: no softmax, no renormalization, no scaling factor).

Engines (``engine=``, same names and ``auto`` rule as the dense linear, ``select.py``):

- ``flashinfer`` (SM100/SM103): ``flashinfer.trtllm_fp8_block_scale_routed_moe`` with the
  unpacked ``(topk_ids int32, topk_weights float32)`` pair, ``MxFp8``, ``use_shuffled_weight=True``,
  ``MajorK``; activations quantized by ``mxfp8_quantize(x, is_sf_swizzled_layout=False)``
  (token-major linear ``uint8 [T, H/32]`` scales, what the MXFP8 MoE launcher reads). The weight
  scales are the checkpoint's tiles viewed as ``[E, 2I, H/32]`` / ``[E, H, I/32]`` (same bytes).
- ``triton`` (Hopper): (token, slot) pairs sorted by expert (one host sync), then either
  ``method="loop"`` (default): per expert the dense Triton kernels (``runtime/hopper/``) on that
  expert's slice of the laid-out bytes: ``w13[e]`` is exactly a trtllm dense weight of the
  interleaved ``[2I, H]`` matrix, so output column ``2j`` is ``up_j`` and ``2j+1`` is ``gate_j``;
  ``w2[e]`` is a trtllm dense ``[H, I]`` weight; or ``method="grouped"``
  (``hopper/grouped_moe.py``): one launch per GEMM for all experts, SwiGLU and requantization
  in FC1's epilogue. Both store FC1
  and FC2 outputs in bf16 (as the dense kernel does) and sum the top-k in float32; they agree
  bit for bit up to fp32 summation order. Against the oracle below they differ by ~1.6e-2
  relative, because rounding FC1 to bf16 before the activation's MXFP8 requantization moves some
  values across an e4m3 rounding boundary (a whole e4m3 step each); ``moe_from_dequantized(...,
  bf16_gemm_outputs=True)`` is the "staged" oracle they match to ~1e-3.
- ``reference`` (anywhere): dequantizes each expert straight from the laid-out bytes (physical
  rows, scales read from their 128x4 tiles), puts rows back in logical order with the layout's
  row index, float64 matmuls. This is the oracle.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.format import Marker, MoeMarker
from mxfp8_convert.layouts.moe import (
    MX_BLOCK,
    moe_fc1_row_indices,
    moe_fc1_scale_from_canonical,
    moe_fc1_scale_shape,
    moe_fc1_scale_to_canonical,
    moe_fc1_weight_from_canonical,
    moe_fc1_weight_to_canonical,
    moe_fc2_scale_from_canonical,
    moe_fc2_scale_shape,
    moe_fc2_scale_to_canonical,
    moe_fc2_weight_from_canonical,
    moe_fc2_weight_to_canonical,
    moe_shape_violations,
)
from mxfp8_convert.layouts.rows import p32_row_indices
from mxfp8_convert.layouts.swizzle import unswizzle_128x4
from mxfp8_convert.runtime.reference import dequantize_mxfp8, fake_quantize_mxfp8

#: Gated activations we run, and FlashInfer's ``ActivationType`` value for each.
ACTIVATIONS = {"swiglu": 3}
#: FlashInfer ``RoutingMethodType.TopK``: with pre-computed routing the kernel uses the given ids
#: and weights as they are (routingCustom's post-top-k pipeline); TopK adds no softmax/renorm.
ROUTING_METHOD_TOPK = 5
_E4M3 = torch.float8_e4m3fn
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# The weights of one layer
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MXFP8MoEWeights:
    """The laid-out experts of one MoE layer (FlashInfer trtllm-gen MXFP8 fused-MoE layout).

    Attributes:
        w13: float8_e4m3fn ``[E, 2I, H]``: per expert ``cat([up, gate])``, rows interleaved
            ``[up0, gate0, up1, ...]`` then P32-shuffled.
        w13_scale: uint8 ``[E, 2I/128, H/128, 512]`` 128x4 tiles of the FC1 scales (same row
            permutation); float8_e8m0fnu is viewed as uint8. Only the tile shape is accepted
            (see :func:`_scale_tiles`).
        w2: float8_e4m3fn ``[E, H, I]``: ``down`` rows P32-shuffled.
        w2_scale: uint8 ``[E, H/128, I/128, 512]`` tiles.
        hidden: H.
        intermediate: I (per expert, per tensor-parallel rank).
        name: layer name for messages (``model.layers.3.mlp.experts``), may be empty.
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    hidden: int
    intermediate: int
    name: str = ""

    def __post_init__(self) -> None:
        what = self.name or "experts"
        h, i = int(self.hidden), int(self.intermediate)
        bad = moe_shape_violations(h, i)
        if bad:
            raise LayoutError(f"{what}: H={h}, I={i} does not fit the trtllm MXFP8 fused MoE: "
                              f"{'; '.join(bad)}")
        for field, t in (("w13", self.w13), ("w2", self.w2)):
            if t.dtype != _E4M3 or t.dim() != 3:
                raise LayoutError(f"{what}: {field} must be float8_e4m3fn [E, rows, K], "
                                  f"got {t.dtype} {list(t.shape)}")
        e = self.w13.shape[0]
        for field, t, want in (("w13", self.w13, (e, 2 * i, h)), ("w2", self.w2, (e, h, i))):
            if tuple(t.shape) != want:
                raise LayoutError(f"{what}: {field} must have shape {list(want)} "
                                  f"(E, H={h}, I={i}), got {list(t.shape)}")
        w13_scale = _scale_tiles(self.w13_scale, moe_fc1_scale_shape(h, i, e),
                                 (e, 2 * i, h // MX_BLOCK), f"{what}: w13_scale")
        w2_scale = _scale_tiles(self.w2_scale, moe_fc2_scale_shape(h, i, e),
                                (e, h, i // MX_BLOCK), f"{what}: w2_scale")
        object.__setattr__(self, "w13_scale", w13_scale)
        object.__setattr__(self, "w2_scale", w2_scale)
        devices = {t.device for t in (self.w13, self.w13_scale, self.w2, self.w2_scale)}
        if len(devices) != 1:
            listed = ", ".join(sorted(map(str, devices)))
            raise LayoutError(f"{what}: tensors on several devices ({listed})")
        for field in ("w13", "w13_scale", "w2", "w2_scale"):
            if not getattr(self, field).is_contiguous():
                raise LayoutError(f"{what}: {field} must be contiguous "
                                  "(the kernels index it by expert stride)")
        object.__setattr__(self, "hidden", h)
        object.__setattr__(self, "intermediate", i)

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def to(self, device: torch.device | str) -> MXFP8MoEWeights:
        """The same bytes on ``device`` (a copy, never a re-layout)."""
        return MXFP8MoEWeights(self.w13.to(device), self.w13_scale.to(device), self.w2.to(device),
                               self.w2_scale.to(device), self.hidden, self.intermediate, self.name)

    def kernel_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale bytes as FlashInfer hands them to the kernel: ``[E, 2I, H/32]``,
        ``[E, H, I/32]``."""
        e, h, i = self.num_experts, self.hidden, self.intermediate
        return (self.w13_scale.view(e, 2 * i, h // MX_BLOCK),
                self.w2_scale.view(e, h, i // MX_BLOCK))

    def canonical(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Invert the layouts: ``{"up"|"gate": (q [E, I, H], s [E, I, H/32]),
        "down": (q [E, H, I], s [E, H, I/32])}``.

        Allocates new tensors; the engines never call this (the tests do).
        """
        h, i = self.hidden, self.intermediate
        up, gate = moe_fc1_weight_to_canonical(self.w13)
        up_s, gate_s = moe_fc1_scale_to_canonical(self.w13_scale, h, i)
        down = moe_fc2_weight_to_canonical(self.w2)
        down_s = moe_fc2_scale_to_canonical(self.w2_scale, h, i)
        return {"up": (up, up_s), "gate": (gate, gate_s), "down": (down, down_s)}

    @classmethod
    def from_canonical(
        cls,
        up: tuple[torch.Tensor, torch.Tensor],
        gate: tuple[torch.Tensor, torch.Tensor],
        down: tuple[torch.Tensor, torch.Tensor],
        name: str = "",
    ) -> MXFP8MoEWeights:
        """Lay out canonical MXFP8 experts (``layouts/moe.py``); bytes are moved, never
        re-quantized.

        Args:
            up: ``(q, s)``: e4m3 ``[E, I, H]`` and uint8 ``[E, I, H/32]`` of ``up_proj`` (w3).
            gate: same for ``gate_proj`` (w1), the activated half.
            down: ``(q, s)``: e4m3 ``[E, H, I]`` and uint8 ``[E, H, I/32]`` of ``down_proj`` (w2).
            name: layer name for messages.
        """
        (uq, us), (gq, gs), (dq, ds) = up, gate, down
        if uq.dim() != 3 or dq.dim() != 3:
            raise LayoutError(f"{name or 'experts'}: canonical experts must be stacked "
                              f"[E, rows, K] tensors, got up {list(uq.shape)} "
                              f"and down {list(dq.shape)}")
        _, i, h = uq.shape
        return cls(moe_fc1_weight_from_canonical(uq, gq), moe_fc1_scale_from_canonical(us, gs),
                   moe_fc2_weight_from_canonical(dq), moe_fc2_scale_from_canonical(ds), h, i, name)

    @classmethod
    def from_checkpoint(cls, ckpt, block: str) -> MXFP8MoEWeights:
        """A fused block of a checkpoint loaded with ``load_checkpoint`` (FORMAT.md section 3a).

        Args:
            ckpt: :class:`~mxfp8_convert.runtime.MXFP8Checkpoint` (the fused tensors are among
                its ``tensors``, on its device, as stored).
            block: e.g. ``"model.layers.3.mlp.experts"``; :func:`moe_blocks` lists them.

        Raises:
            MarkerError: the marker has no such fused block, or an unknown ``moe.layout``.
            LayoutError: a tensor is missing or has the wrong shape/dtype.
        """
        return _from_checkpoint(cls, ckpt, block)

    @classmethod
    def quantize(
        cls,
        up: torch.Tensor | Sequence[torch.Tensor],
        gate: torch.Tensor | Sequence[torch.Tensor],
        down: torch.Tensor | Sequence[torch.Tensor],
        name: str = "",
    ) -> MXFP8MoEWeights:
        """Quantize high-precision experts with FlashInfer's recipe (``quantize.quantize_mxfp8``),
        lay out.

        For test models and experiments; a real checkpoint is converted offline.

        Args:
            up: ``[E, I, H]`` (or E tensors ``[I, H]``) bf16/fp16/fp32, ``up_proj`` (w3).
            gate: same for ``gate_proj`` (w1), the activated half.
            down: ``[E, H, I]`` (or E tensors ``[H, I]``).
            name: layer name for messages.
        """
        from mxfp8_convert.quantize import quantize_mxfp8 as quantize_weight

        def q(ws, what):
            pairs = [quantize_weight(w, name=f"{name or 'experts'}.{e}.{what}")
                     for e, w in enumerate(ws)]
            return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

        return cls.from_canonical(q(up, "up_proj"), q(gate, "gate_proj"), q(down, "down_proj"),
                                  name)


def _moe_marker(ckpt) -> MoeMarker | None:
    return Marker.parse(ckpt.marker, f"{ckpt.path}/config.json").moe


def moe_blocks(ckpt) -> list[str]:
    """The fused MoE blocks of a loaded checkpoint (``marker["moe"]["layers"]``), empty if none.

    Raises:
        MarkerError: the marker is not valid (e.g. its ``moe`` entry has a layout this runtime does
            not read).
    """
    moe = _moe_marker(ckpt)
    return list(moe.layers) if moe is not None else []


def _from_checkpoint(cls, ckpt, block: str) -> MXFP8MoEWeights:
    from mxfp8_convert.errors import MarkerError

    blocks = moe_blocks(ckpt)
    if block not in blocks:
        listed = ", ".join(blocks[:3]) + (", ..." if len(blocks) > 3 else "") or "none"
        raise MarkerError(f"{ckpt.path}: {block!r} is not a fused MoE block of this checkpoint "
                          f"(blocks: {listed})")
    names = _moe_marker(ckpt).tensor_names()
    got = {}
    for role, suffix in names.items():
        name = f"{block}.{suffix}"
        if name not in ckpt.tensors:
            raise LayoutError(f"{ckpt.path}: fused MoE tensor {name} is missing")
        got[role] = ckpt.tensors[name]
    w13 = got["moe_fc1_weight"]
    if w13.dim() != 3:
        raise LayoutError(f"{block}.{names['moe_fc1_weight']}: expected [E, 2I, H], "
                          f"got {list(w13.shape)}")
    return cls(w13, got["moe_fc1_scale"], got["moe_fc2_weight"], got["moe_fc2_scale"],
               int(w13.shape[2]), int(w13.shape[1]) // 2, block)


def _scale_tiles(
    s: torch.Tensor, tiles: tuple[int, ...], linear: tuple[int, ...], what: str
) -> torch.Tensor:
    """Scale bytes as uint8 128x4 tiles, refusing anything else.

    The tile shape is what tells laid-out scales from canonical ones: FlashInfer's kernel-shaped
    ``[E, 2I, H/32]`` view of the swizzled bytes has exactly the shape of a canonical *linear*
    scale (SGLang's ``w13_weight_scale_inv``), so accepting it would let unswizzled scales in
    as silent garbage (docs/LAYOUTS.md section 5, sglang #38028).
    """
    if s.element_size() != 1 or (s.is_floating_point() and s.dtype != torch.float8_e8m0fnu):
        raise LayoutError(f"{what} must be uint8 (or float8_e8m0fnu) UE8M0 codes, got {s.dtype}")
    s = s.view(torch.uint8)
    if tuple(s.shape) == tiles:
        return s
    hint = " (that is a linear scale's shape: lay it out with MXFP8MoEWeights.from_canonical)" \
        if tuple(s.shape) == linear else ""
    raise LayoutError(f"{what} must be 128x4 tiles of shape {list(tiles)}, "
                      f"got {list(s.shape)}{hint}")


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def mxfp8_fused_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: MXFP8MoEWeights,
    *,
    engine: str = "auto",
    activation: str = "swiglu",
) -> torch.Tensor:
    """Routed MoE layer on laid-out MXFP8 experts (module docstring: semantics and engines).

    Args:
        hidden_states: ``[T, H]`` bf16 (fp16/fp32 accepted; the flashinfer engine casts fp32 to
            bf16 before quantizing) on the experts' device.
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)`` (checked by the triton and
            reference engines; the flashinfer kernel skips out-of-range ids).
        topk_weights: ``[T, k]`` float routing weights, used as given.
        experts: the layer's :class:`MXFP8MoEWeights`.
        engine: ``"auto"``, ``"flashinfer"``, ``"triton"`` or ``"reference"``.
        activation: ``"swiglu"`` (``silu(gate) * up``).

    Returns:
        bf16 ``[T, H]``.

    Raises:
        LayoutError: shapes, dtypes or devices that do not fit.
        BackendUnavailableError / MarkerError: the engine cannot run here.

    Example:
        >>> ex = MXFP8MoEWeights.quantize(torch.randn(4, 128, 128), torch.randn(4, 128, 128),
        ...                               torch.randn(4, 128, 128))
        >>> ids = torch.tensor([[0, 3], [1, 2]]); w = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
        >>> mxfp8_fused_moe(torch.randn(2, 128), ids, w, ex, engine="reference").shape
        torch.Size([2, 128])
    """
    _check_inputs(hidden_states, topk_ids, topk_weights, experts, activation)
    from mxfp8_convert.runtime.select import check_engine

    name = check_engine(engine, hidden_states.device, "trtllm")
    if hidden_states.shape[0] == 0:
        return hidden_states.new_empty((0, experts.hidden), dtype=torch.bfloat16)
    engines = {"flashinfer": flashinfer_fused_moe, "triton": triton_fused_moe,
               "reference": reference_fused_moe}
    run = engines[name]
    return run(hidden_states, topk_ids, topk_weights, experts, activation=activation)


def _check_inputs(x, ids, w, experts, activation) -> None:
    what = experts.name or "experts"
    if activation not in ACTIVATIONS:
        raise LayoutError(f"{what}: activation {activation!r} is not supported "
                          f"(supported: {', '.join(ACTIVATIONS)})")
    if x.dim() != 2 or x.shape[1] != experts.hidden or x.dtype not in _FLOATS:
        raise LayoutError(f"{what}: hidden_states must be bf16/fp16/fp32 [T, {experts.hidden}], "
                          f"got {x.dtype} {list(x.shape)}")
    t = x.shape[0]
    integer = not ids.dtype.is_floating_point and ids.dtype != torch.bool
    if ids.dim() != 2 or ids.shape[0] != t or not integer:
        raise LayoutError(f"{what}: topk_ids must be an integer [T={t}, k] tensor, "
                          f"got {ids.dtype} {list(ids.shape)}")
    if tuple(w.shape) != tuple(ids.shape) or not w.dtype.is_floating_point:
        raise LayoutError(f"{what}: topk_weights must be a float {list(ids.shape)} tensor, "
                          f"got {w.dtype} {list(w.shape)}")
    if ids.shape[1] < 1 or ids.shape[1] > experts.num_experts:
        raise LayoutError(f"{what}: top-k={ids.shape[1]} must be between 1 and "
                          f"E={experts.num_experts}")
    for nm, tensor in (("hidden_states", x), ("topk_ids", ids), ("topk_weights", w)):
        if tensor.device != experts.device:
            raise LayoutError(f"{what}: {nm} on {tensor.device}, experts on {experts.device}")


def _expert_spans(
    topk_ids: torch.Tensor, num_experts: int, what: str
) -> tuple[torch.Tensor, list[int]]:
    """Stable sort of the ``T*k`` (token, slot) pairs by expert: ``(order, offsets)``, one host
    sync.

    ``order[j]`` is the flat index ``t*k + slot`` of the j-th pair; expert ``e`` owns
    ``order[offsets[e]:offsets[e+1]]``.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel() == 0:
        return flat, [0] * (num_experts + 1)
    lo, hi = (int(v) for v in torch.stack([flat.min(), flat.max()]).tolist())
    if lo < 0 or hi >= num_experts:
        raise LayoutError(f"{what}: topk_ids hold expert ids in [{lo}, {hi}], "
                          f"outside [0, {num_experts})")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return order, offsets


def _activate(h13: torch.Tensor, activation: str) -> torch.Tensor:
    """``bf16(silu(X2) * X1)`` in float32 from FC1 outputs ``[..., 2I]`` in *interleaved* order."""
    up, gate = h13[..., 0::2].float(), h13[..., 1::2].float()
    return (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Reference engine: the oracle, straight from the laid-out bytes
# --------------------------------------------------------------------------------------------
def expert_matrices(experts: MXFP8MoEWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s dequantized weights in logical order, read from the laid-out bytes.

    Each physical row is dequantized with the scale row of the same physical index (read from
    the 128x4 tiles), then rows go back to logical order with the layout's row index:
    FC1 physical row ``p`` is row ``moe_fc1_row_indices(I)[p]`` of ``cat([up, gate])``, FC2
    physical row ``p`` is row ``p32_row_indices(H)[p]`` of ``down``.

    Returns:
        float32 ``(w13 [2I, H]`` rows ``[up; gate]``, ``w2 [H, I])``, exact values.
    """
    h, i = experts.hidden, experts.intermediate
    dev = experts.device
    s13 = unswizzle_128x4(experts.w13_scale[e], 2 * i, h // MX_BLOCK)
    s2 = unswizzle_128x4(experts.w2_scale[e], h, i // MX_BLOCK)
    w13 = torch.empty((2 * i, h), dtype=torch.float32, device=dev)
    w13[moe_fc1_row_indices(i, device=dev)] = dequantize_mxfp8(experts.w13[e], s13)
    w2 = torch.empty((h, i), dtype=torch.float32, device=dev)
    w2[p32_row_indices(h, device=dev)] = dequantize_mxfp8(experts.w2[e], s2)
    return w13, w2


def moe_from_dequantized(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    matrices,
    num_experts: int,
    *,
    accum: torch.dtype = torch.float64,
    quantize_activations: bool = True,
    bf16_gemm_outputs: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The MoE math on dequantized expert matrices (shared by the reference engine and the tests).

    Args:
        hidden_states: ``[T, H]``.
        topk_ids: ``[T, k]`` expert ids.
        topk_weights: ``[T, k]`` routing weights, used as given.
        matrices: ``e -> (w13 [2I, H] rows [up; gate], w2 [H, I])`` float tensors (logical order).
        num_experts: E.
        accum: matmul / sum dtype (float64: exact products and, for realistic data, exact sums).
        quantize_activations: MXFP8-quantize ``x`` and the activation (the MXFP8 layer); False
            gives the same layer on unquantized activations (for comparisons).
        bf16_gemm_outputs: round each FC1 and FC2 output to bf16, as the triton engine's GEMMs
            write them (the "staged" oracle it is compared to bit for bit). The default keeps
            FC1 in float32 into the activation, as the trtllm kernel's fused epilogue does.
        out_dtype: bf16 (the layer's output, rounded once from ``accum``), or ``accum`` itself
            to measure other engines' errors against the unrounded sum.

    Returns:
        ``[T, H]`` of ``out_dtype``.
    """
    t, k = topk_ids.shape
    fq = fake_quantize_mxfp8 if quantize_activations else (lambda v: v.float())
    stage = torch.bfloat16 if bf16_gemm_outputs else torch.float32  # FC1 output precision
    a = fq(hidden_states).to(accum)
    out = torch.zeros((t, hidden_states.shape[1]), dtype=accum, device=hidden_states.device)
    order, offsets = _expert_spans(topk_ids, num_experts, "topk_ids")
    flat_w = topk_weights.reshape(-1).to(accum)
    for e in range(num_experts):
        r0, r1 = offsets[e], offsets[e + 1]
        if r0 == r1:
            continue
        pairs = order[r0:r1]
        tok = pairs // k
        w13, w2 = matrices(e)
        half = w13.shape[0] // 2
        x12 = (a[tok] @ w13.to(accum).t()).to(stage).float()  # float32 FC1 (bf16 when staged)
        act = (torch.nn.functional.silu(x12[:, half:]) * x12[:, :half]).to(torch.bfloat16)
        y = fq(act).to(accum) @ w2.to(accum).t()
        if bf16_gemm_outputs:
            y = y.to(torch.bfloat16).to(accum)
        out.index_add_(0, tok, y * flat_w[pairs].unsqueeze(1))
    return out.to(out_dtype)


def reference_fused_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: MXFP8MoEWeights,
    *,
    activation: str = "swiglu",
) -> torch.Tensor:
    """The oracle: float64 MoE on weights dequantized from the laid-out bytes (any device)."""
    _check_inputs(hidden_states, topk_ids, topk_weights, experts, activation)
    return moe_from_dequantized(hidden_states, topk_ids, topk_weights,
                                lambda e: expert_matrices(experts, e), experts.num_experts)


# --------------------------------------------------------------------------------------------
# Triton engine (Hopper): the dense kernel on each expert's slice of the laid-out bytes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertSlice:
    """One expert's FC1 or FC2 bytes as the dense Triton kernel reads a ``trtllm`` weight.

    ``w13[e]`` is the P32-shuffled interleaved ``[2I, H]`` matrix and ``w13_scale[e]`` its
    128x4 tiles: byte for byte a dense trtllm weight (rows % 128 == 0, so no padding), only its
    logical rows are interleaved ``[up0, gate0, ...]``. Same for ``w2[e]``. ``MXFP8Weight`` is
    not used because it also enforces ``mm_mxfp8``'s K % 256 rule, which the MoE kernel (and
    ours) do not need (I = 384 is a valid expert).
    """

    data: torch.Tensor
    scale: torch.Tensor
    name: str = ""
    layout: str = "trtllm"

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), int(self.data.shape[1]))


def expert_slices(experts: MXFP8MoEWeights, e: int) -> tuple[ExpertSlice, ExpertSlice]:
    """``(FC1, FC2)`` of expert ``e`` as views of the laid-out tensors (no copy)."""
    what = experts.name or "experts"
    return (ExpertSlice(experts.w13[e], experts.w13_scale[e], f"{what}.{e}.w13"),
            ExpertSlice(experts.w2[e], experts.w2_scale[e], f"{what}.{e}.w2"))


#: How the triton engine runs the experts: ``"loop"`` (the dense kernel per expert, proven on the
#: H200) or ``"grouped"`` (``hopper/grouped_moe.py``: one launch per GEMM for all experts).
TRITON_METHODS = ("loop", "grouped")
DEFAULT_TRITON_METHOD = "grouped"  # the faster on the H200 (BENCHMARKS.md, fused MoE on Hopper)


def triton_fused_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: MXFP8MoEWeights,
    *,
    activation: str = "swiglu",
    method: str | None = None,
    configs: tuple | None = None,
    grouped_config=None,
) -> torch.Tensor:
    """The MoE layer on Hopper with Triton, on the laid-out bytes.

    Pairs ``(token, slot)`` are sorted by expert (one host sync for the counts), so each expert's
    rows are contiguous.

    - ``method="loop"``: per expert, the dense kernel (``triton_linear``) on the expert's slice,
      FC1 into ``h13 [T*k, 2I]`` and FC2 into ``y [T*k, H]`` through ``out=`` slices; the SwiGLU
      runs once over all rows; the weighted sum is one float32 ``index_add_``.
    - ``method="grouped"``: ``hopper.grouped_moe.grouped_fused_moe`` (one launch per GEMM,
      SwiGLU and the requantization fused into FC1's epilogue). Same numbers up to fp32
      summation order.

    Args:
        hidden_states: ``[T, H]`` bf16/fp16/fp32 on the experts' device.
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)``.
        topk_weights: ``[T, k]`` float routing weights, used as given.
        experts: the layer's :class:`MXFP8MoEWeights`.
        activation: ``"swiglu"``.
        method: ``"loop"`` or ``"grouped"`` (default :data:`DEFAULT_TRITON_METHOD`).
        configs: loop only: ``(fc1, fc2)`` :class:`GemmConfig` for every expert (tests);
            default: the rule's choice per shape (``hopper.launch.default_config``).
        grouped_config: grouped only: a ``hopper.grouped_moe.GroupedConfig``.
    """
    _check_inputs(hidden_states, topk_ids, topk_weights, experts, activation)
    method = method or DEFAULT_TRITON_METHOD
    if method not in TRITON_METHODS:
        raise LayoutError(f"unknown triton MoE method {method!r} "
                          f"(choose {' or '.join(TRITON_METHODS)})")
    what = experts.name or "experts"
    order, offsets = _expert_spans(topk_ids, experts.num_experts, what)
    if method == "grouped":
        from mxfp8_convert.runtime.hopper.grouped_moe import grouped_fused_moe

        return grouped_fused_moe(hidden_states, order, offsets, topk_weights, experts,
                                 config=grouped_config)
    from mxfp8_convert.runtime.hopper.launch import triton_linear

    t, k = topk_ids.shape
    h, i = experts.hidden, experts.intermediate
    tok = order // k
    xs = hidden_states[tok]  # quantization is per row, so gathering first changes nothing
    dev = hidden_states.device
    h13 = torch.empty((t * k, 2 * i), dtype=torch.bfloat16, device=dev)
    y = torch.empty((t * k, h), dtype=torch.bfloat16, device=dev)
    cfg1, cfg2 = configs or (None, None)
    live = [(e, offsets[e], offsets[e + 1]) for e in range(experts.num_experts)
            if offsets[e + 1] > offsets[e]]
    slices = {e: expert_slices(experts, e) for e, _, _ in live}
    for e, r0, r1 in live:
        triton_linear(xs[r0:r1], slices[e][0], out=h13[r0:r1], config=cfg1)
    act = _activate(h13, activation)
    for e, r0, r1 in live:
        triton_linear(act[r0:r1], slices[e][1], out=y[r0:r1], config=cfg2)
    out = torch.zeros((t, h), dtype=torch.float32, device=dev)
    out.index_add_(0, tok, y.float() * topk_weights.reshape(-1)[order].float().unsqueeze(1))
    return out.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# FlashInfer engine (SM100): trtllm_fp8_block_scale_routed_moe, MxFp8
# --------------------------------------------------------------------------------------------
def _flashinfer_enums():
    from mxfp8_convert.runtime.sm100 import import_flashinfer

    import_flashinfer()
    fm = importlib.import_module("flashinfer.fused_moe")
    return fm.Fp8QuantizationType, fm.WeightLayout, fm.RoutingMethodType, fm.ActivationType


def trtllm_routed_moe_args(
    hidden_q: torch.Tensor,
    hidden_sf: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: MXFP8MoEWeights,
    *,
    activation: str = "swiglu",
    output: torch.Tensor | None = None,
) -> dict:
    """The exact keyword arguments we pass to ``flashinfer.trtllm_fp8_block_scale_routed_moe``.

    Args:
        hidden_q: float8_e4m3fn ``[T, H]`` MXFP8 activations.
        hidden_sf: uint8 ``[T, H/32]`` token-major linear UE8M0 scales
            (``mxfp8_quantize(x, is_sf_swizzled_layout=False)`` reshaped).
        topk_ids: int32 ``[T, k]`` contiguous.
        topk_weights: float32 (or bf16) ``[T, k]`` contiguous.
        experts: the layer.
        activation: ``"swiglu"``.
        output: optional bf16 ``[T, H]`` to write into.

    Returns:
        dict for ``trtllm_fp8_block_scale_routed_moe(**args)``: ``topk_ids=(ids, weights)``
        (unpacked pre-computed routing: ids int32, weights float32, used as given),
        ``gemm1/2_weights`` = the laid-out bytes, ``gemm1/2_weights_scale`` = the tiles viewed
        ``[E, 2I, H/32]`` / ``[E, H, I/32]``, ``fp8_quantization_type=MxFp8``,
        ``use_shuffled_weight=True``, ``weight_layout=MajorK``, ``routing_method_type=TopK``,
        no groups, all experts local, no routed scaling factor, ``do_finalize=True``.

    Raises:
        LayoutError: before any launch, if a tensor does not have what the launcher checks.
    """
    fp8_type, weight_layout, routing, act_type = _flashinfer_enums()
    what = experts.name or "experts"
    t, h = hidden_q.shape if hidden_q.dim() == 2 else (-1, -1)
    if hidden_q.dtype != _E4M3 or h != experts.hidden:
        raise LayoutError(f"{what}: activations must be float8_e4m3fn [T, {experts.hidden}], "
                          f"got {hidden_q.dtype} {list(hidden_q.shape)}")
    if hidden_sf.dtype != torch.uint8 or tuple(hidden_sf.shape) != (t, h // MX_BLOCK):
        raise LayoutError(f"{what}: activation scales must be uint8 [{t}, {h // MX_BLOCK}] "
                          f"(token-major linear), got {hidden_sf.dtype} {list(hidden_sf.shape)}")
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    if (topk_ids.dtype != torch.int32 or tuple(topk_ids.shape) != (t, k)
            or not topk_ids.is_contiguous()):
        raise LayoutError(f"{what}: topk_ids must be contiguous int32 [{t}, k], "
                          f"got {topk_ids.dtype} {list(topk_ids.shape)}")
    if topk_weights.dtype not in (torch.float32, torch.bfloat16) \
            or tuple(topk_weights.shape) != (t, k) \
            or not topk_weights.is_contiguous():
        raise LayoutError(f"{what}: topk_weights must be contiguous float32/bf16 [{t}, {k}], "
                          f"got {topk_weights.dtype} {list(topk_weights.shape)}")
    e = experts.num_experts
    if e % 4 or e <= k:
        raise LayoutError(f"{what}: the trtllm routing kernel needs E % 4 == 0 and E > top-k, "
                          f"got E={e}, k={k}")
    s13, s2 = experts.kernel_scales()
    args = {
        "topk_ids": (topk_ids, topk_weights),
        "routing_bias": None,
        "hidden_states": hidden_q,
        "hidden_states_scale": hidden_sf,
        "gemm1_weights": experts.w13,
        "gemm1_weights_scale": s13,
        "gemm2_weights": experts.w2,
        "gemm2_weights_scale": s2,
        "num_experts": e,
        "top_k": k,
        "n_group": None,
        "topk_group": None,
        "intermediate_size": experts.intermediate,
        "local_expert_offset": 0,
        "local_num_experts": e,
        "routed_scaling_factor": None,
        "routing_method_type": int(routing.TopK),
        "use_shuffled_weight": True,
        "weight_layout": int(weight_layout.MajorK),
        "do_finalize": True,
        "fp8_quantization_type": fp8_type.MxFp8,
        "activation_type": int(act_type(ACTIVATIONS[activation])),
    }
    if output is not None:
        args["output"] = output
    return args


def flashinfer_fused_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: MXFP8MoEWeights,
    *,
    activation: str = "swiglu",
) -> torch.Tensor:
    """The MoE layer through FlashInfer's trtllm-gen MXFP8 fused-MoE kernel (SM100/SM103)."""
    from mxfp8_convert.runtime.sm100 import import_flashinfer

    _check_inputs(hidden_states, topk_ids, topk_weights, experts, activation)
    fi = import_flashinfer()
    fm = importlib.import_module("flashinfer.fused_moe")
    x = hidden_states if hidden_states.dtype != torch.float32 else hidden_states.to(torch.bfloat16)
    q, sf = fi.mxfp8_quantize(x.contiguous(), is_sf_swizzled_layout=False)
    t = x.shape[0]
    sf = sf.view(torch.uint8).reshape(t, experts.hidden // MX_BLOCK)
    ids = topk_ids.to(torch.int32).contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    args = trtllm_routed_moe_args(q, sf, ids, w, experts, activation=activation)
    out = fm.trtllm_fp8_block_scale_routed_moe(**args)
    return out[0] if isinstance(out, (list, tuple)) else out
