"""The plan's model: frozen dataclasses for what happens to every module and tensor.

Plans are data: ``build_plan()`` returns a ``ConversionPlan``, ``--dry-run`` prints its
``to_dict()`` (the ``--json`` contract: keep field names stable) and ``convert()`` consumes it.
Nothing here reads a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from mxfp8_convert.dtypes import itemsize
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.format import CANONICAL_LAYOUT, EXPERT_ROLES, MOE_LAYOUT
from mxfp8_convert.format import MOE_TENSORS as MOE_TENSOR_NAMES
from mxfp8_convert.layouts._common import ceil_to
from mxfp8_convert.layouts.moe import (
    moe_fc1_scale_shape,
    moe_fc1_weight_shape,
    moe_fc2_scale_shape,
    moe_fc2_weight_shape,
)
from mxfp8_convert.read import TensorInfo

#: tensors of a quantized source an MXFP8 output has no use for: static activation scales
#: (MXFP8 activations are quantized dynamically, per 1x32 block)
DROPPED_SUFFIXES = (".input_scale",)  # ModelOpt FP8, vLLM fp8 static, compressed-tensors FP8
#: KV-cache scales, kept under their names (vLLM's maybe_remap_kv_scale_name reads
#: ``self_attn.{k,v}_proj.{k,v}_scale`` and ``self_attn.{k,v}_scale``) with the marker's
#: ``kv_cache_scheme``
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")

#: what ``--moe`` may say: fuse per-expert weights (where the backend can), or keep them canonical
MOE_MODES = ("fuse", "keep")
#: what ``--on-ineligible`` may say: fail listing every offender, or keep them canonical
ON_INELIGIBLE = ("error", "keep")
_MOE_DTYPES = {
    "moe_fc1_weight": ("F8_E4M3", moe_fc1_weight_shape),
    "moe_fc1_scale": ("U8", moe_fc1_scale_shape),
    "moe_fc2_weight": ("F8_E4M3", moe_fc2_weight_shape),
    "moe_fc2_scale": ("U8", moe_fc2_scale_shape),
}
#: fused output tensors of one MoE block: role -> (name suffix, dtype, shape function of (H, I, E))
MOE_TENSORS = {role: (suffix, *_MOE_DTYPES[role]) for role, suffix in MOE_TENSOR_NAMES.items()}


@dataclass(frozen=True, slots=True)
class ExpertSlice:
    """Where one expert projection sits inside the fused MoE tensors of a laid-out source."""

    proj: str  # "gate" | "up" | "down"
    expert: int
    hidden: int
    intermediate: int


class ModulePlan(NamedTuple):
    """One linear module of the source and what happens to it.

    Immutable, as a frozen dataclass would be, and built in a fraction of its time: a
    DeepSeek-V3 plan has 45,808 of them, each MoE expert's built twice (found, then fused).
    """

    name: str  # module prefix, e.g. "model.layers.0.mlp.up_proj"
    n: int
    k: int
    weight: TensorInfo
    scale: TensorInfo | None
    action: str  # see ACTIONS
    layout: str  # output weight layout: a backend's, or "canonical"
    reason: str | None = None  # why kept canonical
    source_kind: str = "mxfp8"  # FormatSpec.kind of the source
    source_backend: str | None = None  # laid-out sources: the backend their bytes are laid out for
    fused: ExpertSlice | None = None  # an expert cut out of a fused MoE source
    #: how the module was found: "source" (quantized in the source), "architecture" or "names"
    decided_by: str = "source"
    stacked: StackedSlice | None = None  # an expert cut out of a stacked 3-D tensor

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": [self.n, self.k],
            "action": self.action,
            "layout": self.layout,
            "reason": self.reason,
            "source_kind": self.source_kind,
            "source_backend": self.source_backend,
            "decided_by": self.decided_by,
            "weight": self.weight.name,
            "scale": self.scale.name if self.scale else None,
        }


@dataclass(frozen=True, slots=True)
class StackedSlice:
    """Expert ``expert``'s projection ``proj`` of a stacked ``[E, K, N]`` source tensor (K is
    axis 1: Llama-4 ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``): ``weight`` is the
    ``[K, N']`` slice of that expert; the module's ``[N, K]`` weight is its columns ``cols``
    (``"first"`` / ``"second"`` half, ``"even"`` / ``"odd"`` columns, ``"all"``), transposed."""

    proj: str  # "gate" | "up" | "down"
    expert: int
    cols: str
    fusable: bool = True  # the trtllm-gen fused MoE kernel computes these experts


@dataclass(frozen=True, slots=True)
class Unquantized:
    """A weight of the source left as it is, and why (``kind``: ``architecture.KINDS``,
    ``ignored`` or ``ineligible``)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    why: str
    decided_by: str

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "kind": self.kind,
            "why": self.why,
            "decided_by": self.decided_by,
        }


@dataclass(frozen=True, slots=True)
class MoELayerPlan:
    """The experts of one MoE block, fused into the trtllm-gen MoE kernel's four tensors.

    ``gate``, ``up`` and ``down`` hold expert ``e``'s module plan at index ``e``; gate and up
    are ``[I, H]``, down is ``[H, I]``. Output: ``{name}.w13_weight`` ``[E, 2I, H]`` and
    ``{name}.w2_weight`` ``[E, H, I]`` with their scales (each weight in the shard of its scale).
    """

    name: str  # the block, e.g. "model.layers.3.mlp.experts"
    experts: int
    hidden: int
    intermediate: int
    gate: tuple[ModulePlan, ...]
    up: tuple[ModulePlan, ...]
    down: tuple[ModulePlan, ...]
    shard: str = ""  # output shard of its fused FC1 weight (set once the shards are laid out)

    def __post_init__(self) -> None:
        if not len(self.gate) == len(self.up) == len(self.down) == self.experts:
            raise LayoutError(
                f"{self.name}: {self.experts} experts but {len(self.gate)} gate, "
                f"{len(self.up)} up and {len(self.down)} down projections (bug)"
            )

    @property
    def modules(self) -> tuple[ModulePlan, ...]:
        return (*self.gate, *self.up, *self.down)

    def module(self, role: str, expert: int) -> ModulePlan:
        return {"gate": self.gate, "up": self.up, "down": self.down}[role][expert]

    def tensor_name(self, role: str) -> str:
        """Output name of fused tensor ``role`` (a key of ``MOE_TENSORS``)."""
        return f"{self.name}.{MOE_TENSORS[role][0]}"

    @property
    def suffixes(self) -> dict[str, str]:
        """Role -> the projection name the source used (``gate_proj`` or ``w1``, ...)."""
        return {r: self.module(r, 0).name.rsplit(".", 1)[1] for r in EXPERT_ROLES}

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "experts": self.experts,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "layout": MOE_LAYOUT,
            "shard": self.shard,
            "action": self.gate[0].action,
            "experts_suffixes": self.suffixes,
            "tensors": [self.tensor_name(r) for r in MOE_TENSORS],
        }


#: what happens to a linear module
ACTIONS = {
    "relayout": "MXFP8 bytes kept, re-laid out",
    "keep": "left in canonical MXFP8 (the backend cannot take it)",
    "lossless": "FP8 bytes kept, power-of-two scales mapped exactly to UE8M0",
    "requantize": "FP8 dequantized and requantized to MXFP8 (error reported)",
    "quantize": "high-precision weight quantized to MXFP8 (error reported)",
    "dequantize": "quantized source weight written dequantized in the model's dtype (ignored, "
    "or no MXFP8 layout fits it)",
}
#: actions that write an MXFP8 module (a run with none of them converts nothing)
MXFP8_ACTIONS = ("relayout", "keep", "lossless", "requantize", "quantize")
#: weights left as they are that the marker's ``ignored_layers`` does not list: they are not
#: linear layers an engine could take as quantized (embeddings, norms), or routers, which no
#: MXFP8 scheme quantizes
NOT_IGNORED_KINDS = ("other", "router")
#: the layout name of a dequantized module's weight
DEQUANTIZED_LAYOUT = "dequantized"


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One output tensor: where its bytes come from and what layout they take."""

    name: str
    role: str  # "weight" | "weight_scale" | "passthrough"
    dtype: str  # output safetensors dtype
    shape: tuple[int, ...]
    layout: str  # backend layout name, "canonical" or "copy"
    source: str  # source tensor name
    module: str | None = None
    logical_shape: tuple[int, ...] | None = None  # scales: canonical [N, K/32]
    reason: str | None = None  # kept canonical: why (recorded, docs/FORMAT.md section 3)
    #: bytes of the tensor, computed once: shard packing and progress read it often
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = itemsize(self.dtype)
        for d in self.shape:
            n *= d
        object.__setattr__(self, "nbytes", n)

    def record(self) -> dict:
        """The per-tensor entry of the shard metadata (docs/FORMAT.md section 3)."""
        if self.role in MOE_TENSORS:
            return self._moe_record()
        rec: dict = {"role": self.role, "layout": self.layout}
        if self.role == "weight":
            rec["shape"] = list(self.shape)
        else:
            n, c = self.logical_shape
            rec["logical_shape"] = [n, c]
            rec["padded_shape"] = (
                [ceil_to(n, 128), ceil_to(c, 4)] if self.layout != CANONICAL_LAYOUT else [n, c]
            )
            rec["tile_shape"] = list(self.shape)
        if self.reason is not None:
            rec["reason"] = self.reason
        return rec

    def _moe_record(self) -> dict:
        rec: dict = {"role": self.role, "layout": self.layout}
        if self.role.endswith("_weight"):
            e, rows, cols = self.shape
            rec["shape"] = list(self.shape)
        else:
            e, rows, c = self.logical_shape
            cols = c * 32
            rec["logical_shape"] = list(self.logical_shape)
            rec["tile_shape"] = list(self.shape)
        hidden, intermediate = (
            (cols, rows // 2) if self.role.startswith("moe_fc1") else (rows, cols)
        )
        return {**rec, "experts": e, "hidden": hidden, "intermediate": intermediate}

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "role": self.role,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "layout": self.layout,
            "source": self.source,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One output file: its name (``model-00001-of-00004.safetensors``, docs/FORMAT.md section
    1), its tensors in the order they are written, and the ``__metadata__`` it keeps from the
    source shards it draws on."""

    name: str
    tensors: tuple[TensorPlan, ...]
    metadata: tuple[tuple[str, str], ...] = ()
    #: sum of the tensors' sizes, computed once: progress reports read it per tensor written
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum(t.nbytes for t in self.tensors))

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "nbytes": self.nbytes,
            "tensors": [t.to_dict() for t in self.tensors],
        }


@dataclass(frozen=True, slots=True)
class ConversionPlan:
    """Everything ``convert()`` will do, decided before any tensor data is read."""

    source: str
    backend: str
    format: str
    shards: tuple[ShardPlan, ...]
    modules: tuple[ModulePlan, ...]
    copied_files: tuple[str, ...]
    marker: dict
    indexed: bool
    fingerprint: str
    kept: tuple[str, ...] = field(default=())
    moe: tuple[MoELayerPlan, ...] = field(default=())  # MoE blocks fused for the backend
    moe_mode: str = "fuse"
    unquantized: tuple[Unquantized, ...] = field(default=())  # weights left as they are
    dropped: tuple[str, ...] = field(default=())  # source tensors not written (DROPPED_SUFFIXES)
    kv_scales: tuple[str, ...] = field(default=())  # KV-cache scales kept
    quantize_towers: bool = False  # linears outside the language model quantized too
    #: total output tensor bytes, computed once: every progress event carries it
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum(s.nbytes for s in self.shards))

    def modules_by_action(self) -> dict[str, int]:
        """Action -> how many modules (fused MoE experts included) take it."""
        actions: dict[str, int] = {}
        for m in (*self.modules, *(m for layer in self.moe for m in layer.modules)):
            actions[m.action] = actions.get(m.action, 0) + 1
        return actions

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "backend": self.backend,
            "format": self.format,
            "total_bytes": self.nbytes,
            "modules_by_action": self.modules_by_action(),
            "kept_canonical": list(self.kept),
            "moe_layers": [layer.to_dict() for layer in self.moe],
            "modules": [m.to_dict() for m in self.modules],
            "shards": [s.to_dict() for s in self.shards],
            "copied_files": list(self.copied_files),
            "source_fingerprint": self.fingerprint,
            "marker": self.marker,
            "unquantized": [u.to_dict() for u in self.unquantized],
            "dropped_tensors": list(self.dropped),
            "kv_cache_scales": list(self.kv_scales),
        }


def module_of(name: str) -> str:
    """The module a tensor name belongs to: the name less ``.weight``."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


_new_tuple = tuple.__new__


def revised(m: ModulePlan, *, action: str, layout: str, reason: str | None) -> ModulePlan:
    """``m`` with another action, layout and reason (fields 5-7). Built as the tuple it is:
    ``_replace`` goes through a dict of keywords, the class call through a Python ``__new__``,
    and this runs once per expert of every MoE block."""
    return _new_tuple(ModulePlan, (*m[:5], action, layout, reason, *m[8:]))


def dequantized(m: ModulePlan, reason: str) -> ModulePlan:
    """``m`` written in the model's dtype instead (ignored, or no MXFP8 layout fits it)."""
    return revised(m, action="dequantize", layout=DEQUANTIZED_LAYOUT, reason=reason)


def kept(m: ModulePlan, reason: str) -> ModulePlan:
    """``m`` left in canonical MXFP8, saying why."""
    action = "keep" if m.action == "relayout" else m.action
    return revised(m, action=action, layout=CANONICAL_LAYOUT, reason=reason)
