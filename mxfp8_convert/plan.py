"""The plan: what happens to every tensor, decided from headers alone.

``build_plan()`` reads no tensor data. It pairs each quantized weight with its scale (they may
sit in different shards), checks every constraint of the target backend, and fails with the
full list of offending tensors before any work starts. ``convert()`` consumes the plan;
``--dry-run`` prints it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
from dataclasses import dataclass, field, replace

import numpy as np

from mxfp8_convert._version import __version__
from mxfp8_convert.architecture import QUANTIZED_KINDS, NameRules
from mxfp8_convert.backends import BACKENDS, BackendSpec
from mxfp8_convert.dtypes import FLOAT_DTYPES, UE8M0_DTYPES, itemsize
from mxfp8_convert.errors import FormatError, IneligibleError, LayoutError, SourceError
from mxfp8_convert.format import (  # noqa: F401 - COMPLETE_MARKER re-exported for old callers
    CANONICAL_LAYOUT,
    CANONICAL_SUFFIX,
    COMPLETE_MARKER,
    EXPERT_ROLES,
    MOE_LAYOUT,
    SWIZZLED_SUFFIX,
    Marker,
    MoeMarker,
    canonical_config,
    is_marker,
    make_marker,
)
from mxfp8_convert.format import MOE_TENSORS as MOE_TENSOR_NAMES
from mxfp8_convert.formats import FormatSpec, kv_cache_scheme
from mxfp8_convert.layouts._common import ceil_to
from mxfp8_convert.layouts.moe import (
    moe_fc1_scale_shape,
    moe_fc1_weight_shape,
    moe_fc2_scale_shape,
    moe_fc2_weight_shape,
    moe_shape_violations,
)
from mxfp8_convert.read import SourceCheckpoint, TensorInfo, read_small_tensors, read_tensor

#: tensors of a quantized source an MXFP8 output has no use for: static activation scales
#: (MXFP8 activations are quantized dynamically, per 1x32 block)
DROPPED_SUFFIXES = (".input_scale",)  # ModelOpt FP8, vLLM fp8 static, compressed-tensors FP8
#: KV-cache scales, kept under their names (vLLM's maybe_remap_kv_scale_name reads
#: ``self_attn.{k,v}_proj.{k,v}_scale`` and ``self_attn.{k,v}_scale``) with the marker's
#: ``kv_cache_scheme``
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")

#: per-expert linear modules of a MoE block under the usual Hub names (docs/LAYOUTS.md section 6):
#: ``<block>.experts.<e>.<proj>``. The ``.experts.`` must follow a dot, so shared experts
#: (``mlp.shared_experts.*``, ``mlp.shared_expert.*``) and routers (``mlp.gate``) stay dense.
EXPERT_RE = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
#: projection name -> role; "gate" is the activated half (w1), "up" the linear half (w3)
EXPERT_PROJS = {
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",  # Qwen2/3-MoE, DeepSeek-V2/V3
    "w1": "gate", "w3": "up", "w2": "down",  # Mixtral
}
#: backends with a fused-MoE layout (layouts/moe.py); others take experts as dense linears
MOE_BACKENDS = ("trtllm",)
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


@dataclass(frozen=True, slots=True)
class ModulePlan:
    """One linear module of the source and what happens to it."""

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
            "name": self.name, "shape": [self.n, self.k], "action": self.action,
            "layout": self.layout, "reason": self.reason, "source_kind": self.source_kind,
            "source_backend": self.source_backend, "decided_by": self.decided_by,
            "weight": self.weight.name, "scale": self.scale.name if self.scale else None,
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
        return {"name": self.name, "shape": list(self.shape), "kind": self.kind, "why": self.why,
                "decided_by": self.decided_by}


@dataclass(frozen=True, slots=True)
class MoELayerPlan:
    """The experts of one MoE block, fused into the trtllm-gen MoE kernel's four tensors.

    ``gate``, ``up`` and ``down`` hold expert ``e``'s module plan at index ``e``; gate and up
    are ``[I, H]``, down is ``[H, I]``. Output: ``{name}.w13_weight`` ``[E, 2I, H]`` and
    ``{name}.w2_weight`` ``[E, H, I]`` with their scales, all in ``shard``.
    """

    name: str  # the block, e.g. "model.layers.3.mlp.experts"
    experts: int
    hidden: int
    intermediate: int
    gate: tuple[ModulePlan, ...]
    up: tuple[ModulePlan, ...]
    down: tuple[ModulePlan, ...]
    shard: str  # output shard: that of expert 0's gate weight

    def __post_init__(self) -> None:
        if not len(self.gate) == len(self.up) == len(self.down) == self.experts:
            raise LayoutError(f"{self.name}: {self.experts} experts but {len(self.gate)} gate, "
                              f"{len(self.up)} up and {len(self.down)} down projections (bug)")

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
        return {"name": self.name, "experts": self.experts, "hidden": self.hidden,
                "intermediate": self.intermediate, "layout": MOE_LAYOUT, "shard": self.shard,
                "action": self.gate[0].action, "experts_suffixes": self.suffixes,
                "tensors": [self.tensor_name(r) for r in MOE_TENSORS]}


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

    @property
    def nbytes(self) -> int:
        n = itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n

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
            rec["padded_shape"] = [ceil_to(n, 128), ceil_to(c, 4)] if self.layout != CANONICAL_LAYOUT else [n, c]
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
        hidden, intermediate = (cols, rows // 2) if self.role.startswith("moe_fc1") else (rows, cols)
        return {**rec, "experts": e, "hidden": hidden, "intermediate": intermediate}

    def to_dict(self) -> dict:
        return {"name": self.name, "role": self.role, "dtype": self.dtype, "shape": list(self.shape),
                "layout": self.layout, "source": self.source, "nbytes": self.nbytes}


@dataclass(frozen=True, slots=True)
class ShardPlan:
    name: str  # output file name (same as the source shard's)
    tensors: tuple[TensorPlan, ...]
    #: sum of the tensors' sizes, computed once: progress reports read it per tensor written
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum(t.nbytes for t in self.tensors))

    def to_dict(self) -> dict:
        return {"name": self.name, "nbytes": self.nbytes, "tensors": [t.to_dict() for t in self.tensors]}


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

    def to_dict(self) -> dict:
        actions: dict[str, int] = {}
        for m in (*self.modules, *(m for layer in self.moe for m in layer.modules)):
            actions[m.action] = actions.get(m.action, 0) + 1
        return {
            "source": self.source, "backend": self.backend, "format": self.format,
            "total_bytes": self.nbytes, "modules_by_action": actions, "kept_canonical": list(self.kept),
            "moe_layers": [layer.to_dict() for layer in self.moe],
            "modules": [m.to_dict() for m in self.modules],
            "shards": [s.to_dict() for s in self.shards], "copied_files": list(self.copied_files),
            "source_fingerprint": self.fingerprint,
            "marker": self.marker,
            "unquantized": [u.to_dict() for u in self.unquantized],
            "dropped_tensors": list(self.dropped),
            "kv_cache_scales": list(self.kv_scales),
        }


def fingerprint(ckpt: SourceCheckpoint) -> str:
    """``headers-v1`` fingerprint of the source (docs/FORMAT.md section 5)."""
    h = hashlib.sha256(ckpt.config_raw)
    for rel in sorted(ckpt.shards):
        sh = ckpt.shards[rel]
        h.update(rel.encode() + b"\0" + str(sh.size).encode() + b"\0" + sh.raw)
    return "sha256:" + h.hexdigest()


def _matches_any(module: str, patterns: list[str]) -> bool:
    return any(_matches(module, p) for p in patterns)


def _matches(module: str, pattern: str) -> bool:
    """``--ignore`` semantics: the checkpoint's module name (tensor name less ``.weight``) equals
    the pattern, matches it as an fnmatch pattern, or ends with ``.PATTERN``."""
    return (module == pattern or fnmatch.fnmatchcase(module, pattern)
            or module.endswith("." + pattern))


def module_names(ckpt: SourceCheckpoint) -> set[str]:
    """Every module name ``--ignore`` can match: tensor names less ``.weight``, stacked expert
    tensors and fused MoE blocks."""
    names = {n[: -len(".weight")] for n in ckpt.tensors if n.endswith(".weight")}
    names |= {n for n, i in ckpt.tensors.items() if len(i.shape) == 3}
    return names | set(fused_moe_blocks(ckpt))


def resolve_ignore(ckpt: SourceCheckpoint, patterns: list[str], *, strict: bool = True) -> set[str]:
    """The exact module names ``--ignore`` patterns select.

    Raises:
        FormatError: ``strict`` and a pattern matches no module of the checkpoint.
    """
    names = module_names(ckpt)
    out: set[str] = set()
    for p in patterns:
        hits = {n for n in names if _matches(n, p)}
        if not hits and strict:
            raise FormatError(f"--ignore {p!r} matches no module of {ckpt.root}",
                              hint="patterns match the checkpoint's own names (tensor names less "
                                   "'.weight'; `inspect` lists them), e.g. 'model.visual.*'")
        out |= hits
    return out


def find_modules(ckpt: SourceCheckpoint, fmt: FormatSpec,
                 ignore) -> list[tuple[str, TensorInfo, TensorInfo | None]]:
    """Pair each quantized weight with its scale; for dense sources, each weight the
    architecture (or the name rules) calls a linear of the language model. ``ignore``: module
    names (or patterns) left out."""
    if fmt.kind == "dense":
        arch = dense_architecture(ckpt)
        return sorted((_module_of(n), i, None) for n, i in ckpt.tensors.items()
                      if n.endswith(".weight") and i.dtype in FLOAT_DTYPES and len(i.shape) == 2
                      and arch.decide(n, i.shape).quantized
                      and not _matches_any(_module_of(n), list(ignore)))
    pairs = _quantized_pairs(ckpt, fmt)
    return [(m, w, s) for m, w, s in pairs if not _matches_any(m, list(ignore))]


def _quantized_pairs(ckpt: SourceCheckpoint,
                     fmt: FormatSpec) -> list[tuple[str, TensorInfo, TensorInfo]]:
    tensors = ckpt.tensors
    out = []
    suffixes = _scale_suffixes(fmt)
    for name, info in tensors.items():
        for suffix in suffixes:
            if name.endswith("." + suffix) and name[: -len(suffix)] + "weight" not in tensors:
                raise SourceError(f"{info.file}: scale {name!r} has no weight {name[: -len(suffix)] + 'weight'!r}")
        if not name.endswith(".weight") or info.dtype != "F8_E4M3":
            continue
        module = name[: -len(".weight")]
        scale = next((tensors[f"{module}.{x}"] for x in suffixes if f"{module}.{x}" in tensors), None)
        if scale is None:
            raise SourceError(f"{info.file}: weight {name!r} is float8_e4m3fn but has no scale "
                              f"{module + '.' + suffixes[0]!r}")
        out.append((module, info, scale))
    return sorted(out, key=lambda m: m[0])


_ARCHITECTURES: dict[str, object] = {}


def dense_architecture(ckpt: SourceCheckpoint):
    """``architecture.architecture(config)``, built once per config (it imports transformers)."""
    from mxfp8_convert.architecture import architecture

    key = ckpt.config_raw.decode("utf-8", "replace")
    if key not in _ARCHITECTURES:
        _ARCHITECTURES.clear()  # one model at a time
        _ARCHITECTURES[key] = architecture(ckpt.config)
    return _ARCHITECTURES[key]


def _scale_suffixes(fmt: FormatSpec) -> tuple[str, ...]:
    # a laid-out checkpoint holds swizzled scales, and canonical ones for modules it kept
    return (SWIZZLED_SUFFIX, CANONICAL_SUFFIX) if fmt.kind == "laid_out" else (fmt.scale_suffix,)


def _check_mxfp8_pair(w: TensorInfo, s: TensorInfo) -> tuple[int, int]:
    n, k = _check_weight(w)
    if s.dtype not in UE8M0_DTYPES:
        raise LayoutError(f"{s.file}: scale {s.name!r} has dtype {s.dtype}; MXFP8 scales are U8 or F8_E8M0")
    if tuple(s.shape) != (n, k // 32):
        raise LayoutError(f"{s.file}: scale {s.name!r} has shape {list(s.shape)}; weight {w.name!r} [{n}, {k}] needs [{n}, {k // 32}]")
    return n, k


def _check_weight(w: TensorInfo) -> tuple[int, int]:
    if len(w.shape) != 2:
        raise LayoutError(f"{w.file}: weight {w.name!r} has shape {list(w.shape)}; only 2-D linear weights are supported")
    n, k = w.shape
    if k % 32:
        raise LayoutError(f"{w.file}: weight {w.name!r} has K={k}, not a multiple of 32 (MXFP8 blocks are 1x32)")
    return n, k


def _check_laid_out_pair(w: TensorInfo, s: TensorInfo, src: BackendSpec) -> tuple[int, int]:
    n, k = _check_weight(w)
    if s.name.endswith("." + CANONICAL_SUFFIX):
        return _check_mxfp8_pair(w, s)
    want = tuple(src.scale_shape(n, k // 32))
    if s.dtype != "U8" or tuple(s.shape) != want:
        raise LayoutError(f"{s.file}: scale {s.name!r} is {s.dtype} {list(s.shape)}; a {src.name} scale of "
                          f"weight {w.name!r} [{n}, {k}] is U8 {list(want)}")
    return n, k


def _check_fp8_pair(fmt: FormatSpec, w: TensorInfo, s: TensorInfo) -> tuple[int, int]:
    """Shapes of a block/per-tensor FP8 pair (its scale's values: ``fp8_lossless``). K need not
    be a multiple of 32: the backend check says what becomes of such a module."""
    n, k = _check_2d(w)
    if s.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"{s.file}: scale {s.name!r} has dtype {s.dtype}; FP8 scales are floating point")
    if fmt.kind == "block_fp8":
        want = (-(-n // 128), -(-k // 128))
        if tuple(s.shape) != want:
            raise LayoutError(f"{s.file}: scale {s.name!r} has shape {list(s.shape)}; weight {w.name!r} "
                              f"[{n}, {k}] with 128x128 blocks needs {list(want)}")
    elif math.prod(s.shape) not in (1, n) or len(s.shape) > 2:
        raise LayoutError(f"{s.file}: scale {s.name!r} has shape {list(s.shape)}; per-tensor or per-channel "
                          f"scales of weight {w.name!r} [{n}, {k}] are [], [1], [{n}] or [{n}, 1]")
    return n, k


#: float safetensors dtype -> how its bytes become float32 with numpy (exact, or rounded to
#: nearest as torch's ``.to(torch.float32)`` does for F64)
_AS_F32 = {
    "F32": lambda b: np.frombuffer(b, dtype="<f4"),
    "F16": lambda b: np.frombuffer(b, dtype="<f2").astype(np.float32),
    "BF16": lambda b: (np.frombuffer(b, dtype="<u2").astype(np.uint32) << 16).view(np.float32),
    "F64": lambda b: np.frombuffer(b, dtype="<f8").astype(np.float32),
}


def fp8_lossless(ckpt: SourceCheckpoint, fmt: FormatSpec) -> dict[str, bool]:
    """Scale name -> whether that FP8 pair converts losslessly: every multiplier an exact power
    of two in ``[2^-127, 2^127]`` (the only tensor data a plan reads).

    All scales are read file by file (``read_small_tensors``) and tested at once with numpy, on
    their float32 values as ``quantize.fp8_scales_are_pow2`` tests them; a scale that is zero,
    negative, NaN or Inf is handed to that function, whose error names it.

    Raises:
        LayoutError: a scale that is not a finite positive number.
    """
    if fmt.kind not in ("block_fp8", "fp8"):
        return {}
    return _lossless(ckpt, [s for _, _, s in _quantized_pairs(ckpt, fmt)])


def _lossless(ckpt: SourceCheckpoint, scales: list[TensorInfo]) -> dict[str, bool]:
    by_file: dict[str, list[TensorInfo]] = {}
    for s in scales:
        if s is not None and s.dtype in _AS_F32:
            by_file.setdefault(s.file, []).append(s)
    out: dict[str, bool] = {}
    for rel in sorted(by_file):  # a file at a time: memory bounded by one file's scales
        out.update(_lossless_file(ckpt, by_file[rel]))
    return out


def _lossless_file(ckpt: SourceCheckpoint, scales: list[TensorInfo]) -> dict[str, bool]:
    data = read_small_tensors(ckpt.root, scales)
    out = {}
    for dtype in sorted({s.dtype for s in scales}):
        group = [s for s in scales if s.dtype == dtype]
        bits = _AS_F32[dtype](b"".join(data[(s.file, s.begin)] for s in group)).view(np.uint32)
        sizes = np.array([s.nbytes // itemsize(dtype) for s in group], dtype=np.int64)
        # on the float32 bits: NaN/Inf (exponent 255) or a sign bit (>= 0x7F800000), or +0
        bad = (bits >= 0x7F800000) | (bits == 0)
        # a positive finite power of two: mantissa 0, or the subnormal 2^-127 (mantissa 1 << 22)
        pow2 = ((bits & 0x7FFFFF) == 0) | (bits == 1 << 22)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        nonempty = sizes > 0
        tensor_bad = np.zeros(len(group), dtype=bool)
        tensor_pow2 = np.ones(len(group), dtype=bool)
        if nonempty.any():
            tensor_bad[nonempty] = np.logical_or.reduceat(bad, starts[nonempty])
            tensor_pow2[nonempty] = np.logical_and.reduceat(pow2, starts[nonempty])
        for s, is_bad, ok in zip(group, tensor_bad.tolist(), tensor_pow2.tolist(), strict=True):
            if is_bad:
                from mxfp8_convert.quantize import (
                    fp8_scales_are_pow2,  # torch: its error names the value
                )

                fp8_scales_are_pow2(read_tensor(ckpt.root, s), name=s.name)
            out[s.name] = ok
    return out


def _source_backend(ckpt: SourceCheckpoint, fmt: FormatSpec) -> BackendSpec | None:
    if fmt.kind != "laid_out":
        return None
    qc = (ckpt.config or {}).get("quantization_config")
    marker = Marker.parse(qc, f"{ckpt.root}/config.json", error=FormatError)
    return BACKENDS[marker.backend]


def _classify(fmt, src, w, s, lossless: dict[str, bool]) -> tuple[int, int, str]:
    """(N, K, action before backend constraints) of one module."""
    if fmt.kind == "dense":
        return (*_check_2d(w), "quantize")
    if fmt.kind in ("block_fp8", "fp8"):  # the pair's shapes are checked already (_candidates)
        n, k = w.shape
        return n, k, "lossless" if lossless[s.name] else "requantize"
    n, k = _check_laid_out_pair(w, s, src) if src is not None else _check_mxfp8_pair(w, s)
    return n, k, "relayout"


def _check_2d(w: TensorInfo) -> tuple[int, int]:
    """``[N, K]`` of a weight whose K need not fit MXFP8 blocks (the backend check says so)."""
    if len(w.shape) != 2:
        raise LayoutError(f"{w.file}: weight {w.name!r} has shape {list(w.shape)}; "
                          "only 2-D linear weights are supported")
    return w.shape


@dataclass(frozen=True, slots=True)
class _Found:
    """What the search of a source found: modules to plan, weights left as they are."""

    modules: list[ModulePlan]
    unquantized: list[Unquantized]


def _candidates(ckpt, fmt, src: BackendSpec | None, backend: BackendSpec, ignored: set[str],
                towers: bool, lossless: dict[str, bool] | None = None) -> _Found:
    """Every linear module of the source, classified and planned for ``backend`` before its
    constraints are checked, and every other weight with why it is left as it is. Ignored
    modules of a quantized source are planned dequantized."""
    if fmt.kind == "dense":
        return _dense_candidates(ckpt, backend, ignored, towers)
    out, unq = [], []
    pairs = _quantized_pairs(ckpt, fmt)
    if fmt.kind in ("block_fp8", "fp8"):
        for _, w, s in pairs:  # shapes first: a bad pair fails before any scale is read
            _check_fp8_pair(fmt, w, s)
        if lossless is None:
            lossless = _lossless(ckpt, [s for _, _, s in pairs])
    for module, w, s in pairs:
        n, k, action = _classify(fmt, src, w, s, lossless)
        src_name = src.name if src is not None and s.name.endswith("." + SWIZZLED_SUFFIX) else None
        m = ModulePlan(module, n, k, w, s, action, backend.weight_layout, None, fmt.kind, src_name)
        out.append(_dequantized(m, "--ignore") if module in ignored else m)
    if src is not None:
        out += _unfused_experts(ckpt, fmt, src, backend, ignored)
    consumed = {t.name for m in out for t in (m.weight, m.scale) if t is not None}
    rules = NameRules("not quantized in the source")
    for name, info in sorted(ckpt.tensors.items()):
        if name in consumed or info.dtype not in FLOAT_DTYPES or len(info.shape) not in (2, 3):
            continue
        if len(info.shape) == 2 and not name.endswith(".weight"):
            continue
        d = rules.decide(name[: -len(".weight")] if name.endswith(".weight") else name, info.shape)
        unq.append(Unquantized(_module_of(name), info.shape, d.kind, "not quantized in the source",
                               "source"))
    return _Found(out, unq)


def _module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _dequantized(m: ModulePlan, reason: str) -> ModulePlan:
    return replace(m, action="dequantize", layout=DEQUANTIZED_LAYOUT, reason=reason)


def _dense_candidates(ckpt, backend: BackendSpec, ignored: set[str], towers: bool) -> _Found:
    """Float weights: the linears the architecture (or the name rules) puts in the language
    model, or outside it with ``towers``; stacked 3-D experts where their layout is known."""
    arch = dense_architecture(ckpt)
    out, unq = [], []
    for name, info in sorted(ckpt.tensors.items()):
        if info.dtype not in FLOAT_DTYPES or len(info.shape) not in (2, 3):
            continue
        if len(info.shape) == 2 and not name.endswith(".weight"):
            continue
        module = _module_of(name)
        d = arch.decide(name, info.shape)
        wanted = d.kind in (*QUANTIZED_KINDS, "stacked_experts") or (towers and d.kind == "outside")
        if not wanted:
            unq.append(Unquantized(module, info.shape, d.kind, d.why, d.basis))
        elif module in ignored:
            unq.append(Unquantized(module, info.shape, "ignored", "--ignore", d.basis))
        elif d.kind == "stacked_experts":
            found = _stacked_experts(ckpt, name, info, backend, d)
            out += found.modules
            unq += found.unquantized
        elif len(info.shape) == 2:
            n, k = info.shape
            out.append(ModulePlan(module, n, k, info, None, "quantize", backend.weight_layout, None,
                                  "dense", None, decided_by=d.basis))
    return _Found(out, unq)


@dataclass(frozen=True, slots=True)
class StackedLayout:
    """How a family stores its experts stacked: tensor name -> the projections it holds (and
    their columns), and whether the trtllm-gen fused MoE kernel computes that family's experts
    (a plain SiLU-gated MLP without biases)."""

    projs: dict
    fusable: bool


#: model_type -> layout of ``<block>.gate_up_proj [E, H, 2I]`` / ``<block>.down_proj [E, I, H]``
#: (K is axis 1: the modules compute ``x @ W[e]``)
STACKED_EXPERTS = {
    # Llama-4: gate_up.chunk(2, dim=-1): gate first (Llama4TextExperts)
    "llama4_text": StackedLayout({"gate_up_proj": (("gate", "first"), ("up", "second")),
                                  "down_proj": (("down", "all"),)}, fusable=True),
    # gpt-oss: gate_up[..., ::2], gate_up[..., 1::2]; clamped SwiGLU with biases (GptOssExperts)
    "gpt_oss": StackedLayout({"gate_up_proj": (("gate", "even"), ("up", "odd")),
                              "down_proj": (("down", "all"),)}, fusable=False),
}
STACKED_EXPERTS["llama4"] = STACKED_EXPERTS["llama4_text"]
_STACKED_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _text_config(cfg: dict) -> dict:
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


def _stacked_experts(ckpt, name: str, info: TensorInfo, backend: BackendSpec, d) -> _Found:
    """Per-expert modules ``<block>.<e>.{gate,up,down}_proj`` cut out of a stacked tensor whose
    layout ``STACKED_EXPERTS`` knows and whose shape fits the config; else the tensor is left
    as it is, saying why."""
    cfg = ckpt.config or {}
    text = _text_config(cfg)
    model_type = text.get("model_type", cfg.get("model_type"))
    block, _, tensor = name.rpartition(".")
    layout = STACKED_EXPERTS.get(model_type)
    projs = layout.projs.get(tensor) if layout is not None else None
    if projs is None:
        why = f"stacked experts of {model_type!r}: layout of {tensor!r} unknown, left as it is"
        return _Found([], [Unquantized(name, info.shape, "stacked_experts", why, d.basis)])
    e, k, cols = info.shape
    h, i = text.get("hidden_size"), text.get("intermediate_size")
    want = (h, 2 * i) if tensor == "gate_up_proj" else (i, h)
    if not isinstance(h, int) or not isinstance(i, int) or (k, cols) != want:
        why = (f"stacked experts [E, K, N] = {list(info.shape)} do not fit hidden_size={h}, "
               f"intermediate_size={i} of config.json; left as they are")
        return _Found([], [Unquantized(name, info.shape, "stacked_experts", why, d.basis)])
    n = cols // len(projs)
    out = [ModulePlan(f"{block}.{x}.{_STACKED_NAMES[proj]}", n, k, expert_slice(info, x), None,
                      "quantize", backend.weight_layout, None, "dense", None, decided_by=d.basis,
                      stacked=StackedSlice(proj, x, sel, layout.fusable))
           for x in range(e) for proj, sel in projs]
    return _Found(out, [])


def _module_plans(ckpt, fmt, backend: BackendSpec, ignored: set[str], on_ineligible, moe: str,
                  towers: bool, lossless: dict[str, bool] | None = None,
                  ) -> tuple[list[ModulePlan], list[MoELayerPlan], list[Unquantized]]:
    src = _source_backend(ckpt, fmt)
    plans, layers, unq = _plan_modules(ckpt, fmt, src, backend, ignored, on_ineligible, moe, towers,
                                       lossless)
    if src is not None and src.name == backend.name and _changes_nothing(plans, layers, backend):
        raise FormatError(f"{ckpt.root}: already laid out for {backend.name}",
                          hint="nothing to do; use --backend canonical to get plain MXFP8 back")
    return plans, layers, unq


def _changes_nothing(plans: list[ModulePlan], layers: list[MoELayerPlan], backend: BackendSpec) -> bool:
    """Whether converting a checkpoint laid out for ``backend`` to ``backend`` again would
    write what it holds: no module it kept canonical (``--moe keep``, ``--on-ineligible keep``)
    is laid out now, no block is fused or un-fused."""
    def same(m: ModulePlan) -> bool:
        was = m.source_backend == backend.name
        return m.fused is None and was == (m.layout == backend.weight_layout)

    return all(same(m) for m in plans) and all(m.fused is not None for layer in layers for m in layer.modules)


def _plan_modules(ckpt, fmt, src: BackendSpec | None, backend: BackendSpec, ignored: set[str],
                  on_ineligible, moe: str, towers: bool, lossless: dict[str, bool] | None
                  ) -> tuple[list[ModulePlan], list[MoELayerPlan], list[Unquantized]]:
    found = _candidates(ckpt, fmt, src, backend, ignored, towers, lossless)
    unq = list(found.unquantized)
    dense, blocks = _split_experts(found.modules)
    offenders: list[str] = []
    plans = [p for m in dense if (p := _fit(m, backend, on_ineligible, offenders, unq)) is not None]
    layers = []
    for block, experts in blocks.items():
        fusable = all(m.stacked is None or m.stacked.fusable for m in experts)
        plans += [m for m in experts if m.action == "dequantize"]  # ignored: not in the block
        experts = [m for m in experts if m.action != "dequantize"]
        if not experts:
            continue
        if moe == "keep" and backend.laid_out:
            plans += [_kept(m, "--moe keep") for m in experts]
        elif backend.name not in MOE_BACKENDS or moe == "keep" or not fusable:
            fits = (_fit(m, backend, on_ineligible, offenders, unq) for m in experts)
            plans += [p for p in fits if p is not None]
        else:
            layer = _moe_layer(block, experts)
            bad = moe_shape_violations(layer.hidden, layer.intermediate)
            if not bad:
                layers.append(layer)
            elif on_ineligible == "error":
                offenders.append(f"{block} [E={layer.experts}, H={layer.hidden}, I={layer.intermediate}]: "
                                 + "; ".join(bad))
            else:
                plans += [_kept(m, "fused MoE: " + "; ".join(bad)) for m in experts]
    if offenders:
        hint = ("use --on-ineligible keep to keep them (canonical MXFP8 where K is a multiple of "
                "32, else as they are), --ignore NAME to leave a module as it is, or another "
                "--backend")
        what = "tensor(s) or MoE block(s)" if any(o.startswith(tuple(b + " [E=" for b in blocks)) for o in offenders) \
            else "tensor(s)"
        raise IneligibleError(
            f"{len(offenders)} {what} do not fit backend {backend.name}: " + "; ".join(offenders),
            offenders=offenders,
            hint=hint + ("; --moe keep leaves the experts per-expert" if blocks else ""),
        )
    _check_spelling(layers)
    return plans, sorted(layers, key=lambda layer: layer.name), unq


def _fit(m: ModulePlan, backend: BackendSpec, on_ineligible: str, offenders: list[str],
         unquantized: list[Unquantized]) -> ModulePlan | None:
    """``m`` if ``backend`` takes it; else (``keep``) ``m`` kept canonical, or, where K has no
    1x32 blocks, left in the source's precision (dense: as it is, quantized: dequantized);
    else None (noted in ``offenders``)."""
    if m.action == "dequantize":
        return m
    bad = backend.violations(m.n, m.k)
    if not bad:
        return m
    if on_ineligible == "error":
        offenders.append(f"{m.name}.weight [{m.n}, {m.k}]: {', '.join(bad)}")
        return None
    if m.k % 32 == 0:
        return _kept(m, "; ".join(bad))
    if m.source_kind == "dense":
        unquantized.append(Unquantized(m.name, (m.n, m.k), "ineligible", "; ".join(bad),
                                       m.decided_by))
        return None
    return _dequantized(m, "; ".join(bad))


def _kept(m: ModulePlan, reason: str) -> ModulePlan:
    return replace(m, layout=CANONICAL_LAYOUT, reason=reason, action="keep" if m.action == "relayout" else m.action)


# --- MoE: per-expert modules fused for the trtllm-gen MoE kernel, and back ---------------------


def expert_key(module: str) -> tuple[str, int, str] | None:
    """``(block, expert, role)`` of a per-expert projection, e.g.
    ``("model.layers.3.mlp.experts", 7, "up")`` for ``model.layers.3.mlp.experts.7.up_proj``;
    None for any other module."""
    m = EXPERT_RE.match(module)
    if m is None or m["proj"] not in EXPERT_PROJS:
        return None
    return m["block"], int(m["expert"]), EXPERT_PROJS[m["proj"]]


def _split_experts(modules: list[ModulePlan]) -> tuple[list[ModulePlan], dict[str, list[ModulePlan]]]:
    dense: list[ModulePlan] = []
    blocks: dict[str, list[ModulePlan]] = {}
    for m in modules:
        key = expert_key(m.name)
        if key is None:
            dense.append(m)
        else:
            blocks.setdefault(key[0], []).append(m)
    return dense, blocks


def _moe_layer(block: str, experts: list[ModulePlan]) -> MoELayerPlan:
    """The experts of ``block`` as one fused layer; every expert 0..E-1 needs gate, up and down,
    gate and up ``[I, H]``, down ``[H, I]``."""
    by: dict[tuple[int, str], ModulePlan] = {}
    for m in experts:
        _, e, role = expert_key(m.name)
        if (e, role) in by:
            raise LayoutError(f"{block}: expert {e} has two {role} projections ({by[(e, role)].name}, {m.name})")
        by[(e, role)] = replace(m, layout=MOE_LAYOUT)
    count = 1 + max(e for e, _ in by)
    missing = next(((e, r) for e in range(count) for r in EXPERT_ROLES if (e, r) not in by), None)
    if missing is not None:
        raise LayoutError(f"{block}: expert {missing[0]} has no {missing[1]} projection; the fused MoE "
                          f"needs gate, up and down of experts 0..{count - 1}",
                          hint="use --moe keep to leave the experts per-expert")
    gate0 = by[(0, "gate")]
    i, h = gate0.n, gate0.k
    for (_, role), m in sorted(by.items()):
        want = (h, i) if role == "down" else (i, h)
        if (m.n, m.k) != want:
            raise LayoutError(f"{m.weight.file}: expert weight {m.name + '.weight'!r} is [{m.n}, {m.k}]; with "
                              f"H={h}, I={i} (from expert 0's {gate0.name.rsplit('.', 1)[1]}) it must be "
                              f"[{want[0]}, {want[1]}]", hint="use --moe keep to leave the experts per-expert")
    per = {r: tuple(by[(e, r)] for e in range(count)) for r in EXPERT_ROLES}
    return MoELayerPlan(block, count, h, i, per["gate"], per["up"], per["down"], gate0.weight.file)


def _check_spelling(layers: list[MoELayerPlan]) -> None:
    spellings = {tuple(sorted(layer.suffixes.items())): layer.name for layer in layers}
    if len(spellings) > 1:
        (a, la), (b, lb) = list(spellings.items())[:2]
        raise LayoutError(f"MoE blocks name their experts differently ({la}: {dict(a)}; {lb}: {dict(b)}); "
                          "the marker records one spelling", hint="use --moe keep to leave the experts per-expert")


def expert_slice(info: TensorInfo, expert: int) -> TensorInfo:
    """Expert ``expert``'s bytes of a stacked ``[E, ...]`` tensor, as a tensor of its own
    (same name and file, shape ``[...]``): the fused tensors are contiguous per expert."""
    per = info.nbytes // info.shape[0]
    return TensorInfo(info.name, info.dtype, tuple(info.shape[1:]), info.file, info.begin + expert * per, per)


def fused_moe_blocks(ckpt: SourceCheckpoint) -> dict[str, dict[str, TensorInfo | None]]:
    """The fused MoE tensors of a laid-out checkpoint: block -> role -> tensor (None if missing)."""
    blocks = set()
    for name in ckpt.tensors:
        for suffix, _, _ in MOE_TENSORS.values():
            if name.endswith("." + suffix):
                blocks.add(name[: -len(suffix) - 1])
    return {b: {role: ckpt.tensors.get(f"{b}.{suffix}") for role, (suffix, _, _) in MOE_TENSORS.items()}
            for b in sorted(blocks)}


def fused_moe_shape(block: str, tensors: dict[str, TensorInfo | None]) -> tuple[int, int, int]:
    """``(E, H, I)`` of a fused MoE block, checking each of its four tensors' dtype and shape.

    Raises:
        LayoutError: a tensor missing, or a dtype or shape that does not fit the others.
    """
    for role, t in tensors.items():
        if t is None:
            raise LayoutError(f"{block}: fused MoE tensor {block}.{MOE_TENSORS[role][0]!r} is missing")
    w13 = tensors["moe_fc1_weight"]
    if len(w13.shape) != 3 or w13.shape[1] % 2:
        raise LayoutError(f"{w13.file}: {w13.name!r} has shape {list(w13.shape)}; a fused FC1 weight is [E, 2I, H]")
    e, two_i, h = w13.shape
    for role, t in tensors.items():
        _, dtype, shape_of = MOE_TENSORS[role]
        want = shape_of(h, two_i // 2, e)
        if t.dtype != dtype or tuple(t.shape) != want:
            raise LayoutError(f"{t.file}: {t.name!r} is {t.dtype} {list(t.shape)}; in a fused MoE block of "
                              f"E={e}, H={h}, I={two_i // 2} it is {dtype} {list(want)}")
    return e, h, two_i // 2


def _experts_suffixes(ckpt: SourceCheckpoint, block: str) -> dict[str, str]:
    moe = ((ckpt.config or {}).get("quantization_config") or {}).get("moe")
    names = moe.get("experts_suffixes") if isinstance(moe, dict) else None
    if not isinstance(names, dict) or not all(isinstance(names.get(r), str) for r in EXPERT_ROLES):
        raise FormatError(f"config.json: the checkpoint holds fused MoE tensors ({block}) but its marker has "
                          "no moe.experts_suffixes {gate, up, down}")
    return names


def _unfused_experts(ckpt, fmt, src: BackendSpec, backend: BackendSpec,
                     ignored: set[str]) -> list[ModulePlan]:
    """Each expert projection of each fused MoE block of a laid-out source, as a module (an
    ignored block's experts dequantized)."""
    out = []
    for block, tensors in fused_moe_blocks(ckpt).items():
        e_count, h, i = fused_moe_shape(block, tensors)
        names = _experts_suffixes(ckpt, block)
        for e in range(e_count):
            for role in EXPERT_ROLES:
                fc = "moe_fc2" if role == "down" else "moe_fc1"
                w, s = (expert_slice(tensors[f"{fc}_{part}"], e) for part in ("weight", "scale"))
                n, k = (h, i) if role == "down" else (i, h)
                m = ModulePlan(f"{block}.{e}.{names[role]}", n, k, w, s, "relayout",
                               backend.weight_layout, None, fmt.kind, src.name,
                               ExpertSlice(role, e, h, i))
                skip = block in ignored or m.name in ignored
                out.append(_dequantized(m, "--ignore") if skip else m)
    return out


def _moe_tensors(layer: MoELayerPlan) -> list[TensorPlan]:
    e, h, i = layer.experts, layer.hidden, layer.intermediate
    logical = {"moe_fc1_scale": (e, 2 * i, h // 32), "moe_fc2_scale": (e, h, i // 32)}
    return [TensorPlan(layer.tensor_name(role), role, dtype, shape_of(h, i, e), MOE_LAYOUT,
                       layer.gate[0].weight.name, layer.name, logical.get(role))
            for role, (_, dtype, shape_of) in MOE_TENSORS.items()]


def _module_tensors(m: ModulePlan, backend: BackendSpec,
                    model_dtype: str = "BF16") -> list[TensorPlan]:
    c = m.k // 32
    w = f"{m.name}.weight"
    if m.action == "dequantize":
        return [TensorPlan(w, "dequantized", model_dtype, (m.n, m.k), DEQUANTIZED_LAYOUT,
                           m.weight.name, m.name)]
    if m.layout == CANONICAL_LAYOUT:
        return [
            TensorPlan(w, "weight", "F8_E4M3", (m.n, m.k), CANONICAL_LAYOUT, m.weight.name, m.name,
                       reason=m.reason),
            TensorPlan(f"{m.name}.{CANONICAL_SUFFIX}", "weight_scale", "U8", (m.n, c), CANONICAL_LAYOUT,
                       m.scale.name if m.scale else m.weight.name, m.name, (m.n, c), m.reason),
        ]
    return [
        TensorPlan(w, "weight", "F8_E4M3", (m.n, m.k), backend.weight_layout, m.weight.name, m.name),
        TensorPlan(f"{m.name}.{SWIZZLED_SUFFIX}", "weight_scale", "U8", backend.scale_shape(m.n, c),
                   backend.scale_layout, m.scale.name if m.scale else m.weight.name, m.name, (m.n, c)),
    ]


#: config.json ``torch_dtype`` / ``dtype`` -> the safetensors dtype dequantized weights take
MODEL_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def model_dtype(cfg: dict | None) -> str:
    """The dtype of the model's unquantized weights (config.json), BF16 if it says none."""
    cfg = cfg or {}
    for c in (cfg, _text_config(cfg)):
        for key in ("torch_dtype", "dtype"):
            if c.get(key) in MODEL_DTYPES:
                return MODEL_DTYPES[c[key]]
    return "BF16"


def _sort_key(t: TensorPlan) -> tuple[int, str]:
    # widest dtype first, as safetensors' own writer does, so every tensor stays aligned
    return (-itemsize(t.dtype), t.name)


def _check_unique_names(shards: tuple[ShardPlan, ...], ckpt: SourceCheckpoint) -> None:
    """A source tensor named like one the conversion writes (``P.weight_scale_swizzled`` beside
    a converted ``P``) would be written twice, and a loader could read the wrong bytes."""
    seen: set[str] = set()
    for shard in shards:
        for t in shard.tensors:
            if t.name in seen:
                where = ckpt.tensors[t.name].file if t.name in ckpt.tensors else shard.name
                raise SourceError(f"{where}: tensor {t.name!r} has the name of a tensor the conversion writes")
            seen.add(t.name)


def build_plan(
    ckpt: SourceCheckpoint,
    backend: BackendSpec,
    fmt: FormatSpec,
    *,
    on_ineligible: str = "error",
    ignore: list[str] | None = None,
    moe: str = "fuse",
    quantize_towers: bool = False,
    allow_no_quantized: bool = False,
    strict_ignore: bool = True,
    lossless: dict[str, bool] | None = None,
) -> ConversionPlan:
    """Decide every output tensor from the source's headers.

    Args:
        ckpt: the opened source (headers only).
        backend: target backend from ``BACKENDS``.
        fmt: source format from ``formats.detect`` or ``--source-format``.
        on_ineligible: ``"error"`` (fail listing every offender) or ``"keep"`` (leave them in
            canonical MXFP8, or where K has no 1x32 blocks in the source's precision, and
            record why).
        ignore: module-name patterns (``_matches``) to leave unquantized; a quantized source's
            ignored modules are written dequantized to the model's dtype.
        moe: ``"fuse"``: per-expert MoE weights become the fused MoE kernel's tensors where the
            backend has that layout (trtllm), else they are linears like any other; ``"keep"``:
            they stay per-expert canonical MXFP8.
        quantize_towers: dense sources: also quantize the linears outside the language model
            (vision/audio towers, projectors, task heads).
        allow_no_quantized: plan a plain copy when no module would be converted.
        strict_ignore: a pattern of ``ignore`` that matches no module is an error.
        lossless: FP8 sources: ``fp8_lossless(ckpt, fmt)``, when already computed (it reads
            every scale; ``inspect`` plans three backends from one reading).

    Returns:
        The frozen plan.

    Raises:
        IneligibleError: tensors (or MoE blocks) fail the backend's constraints and
            ``on_ineligible="error"``.
        LayoutError / SourceError / FormatError: malformed pairs, missing partners or experts,
            unsupported format, an ``ignore`` pattern matching nothing, nothing to convert.
    """
    if on_ineligible not in ON_INELIGIBLE:
        raise FormatError(f"--on-ineligible must be 'error' or 'keep', got {on_ineligible!r}")
    if moe not in MOE_MODES:
        raise FormatError(f"--moe must be 'fuse' or 'keep', got {moe!r}")
    ignored = resolve_ignore(ckpt, list(ignore or []), strict=strict_ignore)
    modules, layers, unquantized = _module_plans(ckpt, fmt, backend, ignored, on_ineligible, moe,
                                                 quantize_towers, lossless)
    converts = bool(layers) or any(m.action in MXFP8_ACTIONS for m in modules)
    if not allow_no_quantized and not converts:
        raise FormatError(f"{ckpt.root}: no module would be converted to MXFP8 ({fmt.name} source, "
                          f"{len(unquantized)} weights left as they are)",
                          hint="pass --allow-no-quantized to write a plain copy anyway")
    dtype = model_dtype(ckpt.config)
    consumed: set[str] = set()
    per_shard: dict[str, list[TensorPlan]] = {rel: [] for rel in ckpt.shards}
    for m in modules:
        per_shard[m.weight.file].extend(_module_tensors(m, backend, dtype))
    for layer in layers:
        per_shard[layer.shard].extend(_moe_tensors(layer))
    for m in (*modules, *(m for layer in layers for m in layer.modules)):
        consumed.update(t.name for t in (m.weight, m.scale) if t is not None)
    quantized = fmt.kind != "dense"
    dropped = tuple(sorted(n for n in ckpt.tensors if quantized and n.endswith(DROPPED_SUFFIXES)))
    kv = tuple(sorted(n for n in ckpt.tensors if quantized and n.endswith(KV_SCALE_SUFFIXES)))
    for name, info in ckpt.tensors.items():
        if name not in consumed and name not in dropped:
            per_shard[info.file].append(TensorPlan(name, "passthrough", info.dtype, info.shape, "copy", name))
    shards = tuple(ShardPlan(rel, tuple(sorted(ts, key=_sort_key))) for rel, ts in sorted(per_shard.items()))
    _check_unique_names(shards, ckpt)
    left = sorted({u.name for u in unquantized if u.kind not in NOT_IGNORED_KINDS}
                  | {m.name for m in modules if m.action == "dequantize"})
    mxfp8 = [m for m in modules if m.action in MXFP8_ACTIONS]
    tp = marker_tp_compat(ckpt, mxfp8, backend) if backend.laid_out else None
    marker = quantization_config(ckpt, backend, fmt, left, layers, tp, kv)
    return ConversionPlan(
        source=str(ckpt.root), backend=backend.name, format=fmt.name, shards=shards,
        modules=tuple(modules), copied_files=ckpt.other_files, marker=marker, indexed=ckpt.indexed,
        fingerprint=fingerprint(ckpt),
        kept=tuple(m.name for m in modules if m.layout == CANONICAL_LAYOUT and backend.laid_out),
        moe=tuple(layers), moe_mode=moe, unquantized=tuple(unquantized), dropped=dropped,
        kv_scales=kv, quantize_towers=quantize_towers,
    )


def marker_tp_compat(ckpt: SourceCheckpoint, modules, backend: BackendSpec) -> list[int]:
    """The marker's ``tp_compat`` (docs/FORMAT.md section 2a): tensor-parallel sizes at which
    every quantized linear module slices on tile boundaries."""
    from mxfp8_convert.engines.common import CANONICAL, Module, config_kv_heads, tp_compat

    mods = [Module(m.name, m.n, m.k, CANONICAL if m.layout == "canonical" else backend.name)
            for m in modules]
    return tp_compat(mods, config_kv_heads(ckpt.config or {}), backend.name)


def _original_config(ckpt: SourceCheckpoint) -> dict | None:
    """The source's own quantization_config; for one of our outputs, the one it came from."""
    q = (ckpt.config or {}).get("quantization_config")
    if is_marker(q):
        q = q.get("original_quantization_config")
    return q if isinstance(q, dict) else None


def moe_marker(layers: list[MoELayerPlan] | tuple[MoELayerPlan, ...]) -> MoeMarker | None:
    """The marker's ``moe`` entry (docs/FORMAT.md section 2): None without fused MoE tensors."""
    if not layers:
        return None
    return MoeMarker(experts_suffixes=layers[0].suffixes,
                     layers=tuple(layer.name for layer in layers))


def quantization_config(ckpt: SourceCheckpoint, backend: BackendSpec, fmt: FormatSpec,
                        ignored: list[str],
                        moe_layers: list[MoELayerPlan] | tuple[MoELayerPlan, ...] = (),
                        tp_compat: list[int] | None = None,
                        kv_scales: tuple[str, ...] = ()) -> dict:
    """The ``quantization_config`` of the output: the marker (docs/FORMAT.md section 2), or plain
    MXFP8's for the canonical backend. ``ignored``: exact names of the linear modules left
    unquantized; ``kv_scales``: the KV-cache scales kept (their scheme goes with them)."""
    original = _original_config(ckpt)
    kv = None
    if kv_scales:
        kv = kv_cache_scheme(ckpt.config or {}, ckpt.hf_quant_config or {})
    if not backend.laid_out:
        return canonical_config(original, ignored, kv)
    return make_marker(backend.name, dialect=fmt.name, fingerprint=fingerprint(ckpt),
                       tool_version=__version__, ignored_layers=ignored, moe=moe_marker(moe_layers),
                       original=original, tp_compat=tp_compat, kv_cache_scheme=kv).to_dict()
