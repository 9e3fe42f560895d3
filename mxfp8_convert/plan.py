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

from mxfp8_convert._version import __version__
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
from mxfp8_convert.formats import FormatSpec
from mxfp8_convert.layouts._common import ceil_to
from mxfp8_convert.layouts.moe import (
    moe_fc1_scale_shape,
    moe_fc1_weight_shape,
    moe_fc2_scale_shape,
    moe_fc2_weight_shape,
    moe_shape_violations,
)
from mxfp8_convert.read import SourceCheckpoint, TensorInfo, read_tensor

#: modules never quantized from a dense source (docs/LAYOUTS.md section 4): embeddings, heads,
#: norms, routers
_DENSE_SKIP = re.compile(
    r"(^|\.)(lm_head|embed_tokens|embeddings?|wte|wpe|word_embeddings|output|score|classifier)$"
    r"|norm|(^|\.)(gate|router)$"
)

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

    def to_dict(self) -> dict:
        return {
            "name": self.name, "shape": [self.n, self.k], "action": self.action,
            "layout": self.layout, "reason": self.reason, "source_kind": self.source_kind,
            "source_backend": self.source_backend,
            "weight": self.weight.name, "scale": self.scale.name if self.scale else None,
        }


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
}


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

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

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

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

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
        }


def fingerprint(ckpt: SourceCheckpoint) -> str:
    """``headers-v1`` fingerprint of the source (docs/FORMAT.md section 5)."""
    h = hashlib.sha256(ckpt.config_raw)
    for rel in sorted(ckpt.shards):
        sh = ckpt.shards[rel]
        h.update(rel.encode() + b"\0" + str(sh.size).encode() + b"\0" + sh.raw)
    return "sha256:" + h.hexdigest()


def _matches_any(module: str, patterns: list[str]) -> bool:
    return any(module == p or fnmatch.fnmatchcase(module, p) or module.endswith("." + p) for p in patterns)


def find_modules(ckpt: SourceCheckpoint, fmt: FormatSpec, ignore: list[str]) -> list[tuple[str, TensorInfo, TensorInfo | None]]:
    """Pair each quantized (or, for dense sources, quantizable) weight with its scale."""
    tensors = ckpt.tensors
    out = []
    if fmt.kind == "dense":
        for name, info in tensors.items():
            if not name.endswith(".weight") or len(info.shape) != 2 or info.dtype not in FLOAT_DTYPES:
                continue
            module = name[: -len(".weight")]
            if _DENSE_SKIP.search(module) or _matches_any(module, ignore):
                continue
            out.append((module, info, None))
        return sorted(out, key=lambda m: m[0])
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
        if not _matches_any(module, ignore):
            out.append((module, info, scale))
    return sorted(out, key=lambda m: m[0])


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


def _check_fp8_pair(ckpt: SourceCheckpoint, fmt: FormatSpec, w: TensorInfo, s: TensorInfo) -> tuple[int, int, bool]:
    """Shapes of a block/per-tensor FP8 pair, and whether it converts losslessly (reads the
    small float scale tensor: the only tensor data the plan ever reads)."""
    n, k = _check_weight(w)
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
    from mxfp8_convert.quantize import fp8_scales_are_pow2  # torch: only for FP8 sources

    return n, k, fp8_scales_are_pow2(read_tensor(ckpt.root, s), name=s.name)


def _source_backend(ckpt: SourceCheckpoint, fmt: FormatSpec) -> BackendSpec | None:
    if fmt.kind != "laid_out":
        return None
    qc = (ckpt.config or {}).get("quantization_config")
    marker = Marker.parse(qc, f"{ckpt.root}/config.json", error=FormatError)
    return BACKENDS[marker.backend]


def _classify(ckpt, fmt, src, w, s) -> tuple[int, int, str]:
    """(N, K, action before backend constraints) of one module."""
    if fmt.kind == "dense":
        n, k = _check_weight(w)
        return n, k, "quantize"
    if fmt.kind in ("block_fp8", "fp8"):
        n, k, lossless = _check_fp8_pair(ckpt, fmt, w, s)
        return n, k, "lossless" if lossless else "requantize"
    n, k = _check_laid_out_pair(w, s, src) if src is not None else _check_mxfp8_pair(w, s)
    return n, k, "relayout"


def _candidates(ckpt, fmt, src: BackendSpec | None, backend: BackendSpec, ignore) -> list[ModulePlan]:
    """Every linear module of the source, classified and planned for ``backend`` before its
    constraints are checked: the weight/scale pairs found, and the experts of fused MoE sources."""
    out = []
    for module, w, s in find_modules(ckpt, fmt, ignore):
        n, k, action = _classify(ckpt, fmt, src, w, s)
        src_name = src.name if src is not None and s.name.endswith("." + SWIZZLED_SUFFIX) else None
        out.append(ModulePlan(module, n, k, w, s, action, backend.weight_layout, None, fmt.kind, src_name))
    if src is not None:
        out += _unfused_experts(ckpt, fmt, src, backend, ignore)
    return out


def _module_plans(ckpt, fmt, backend: BackendSpec, ignore, on_ineligible,
                  moe: str) -> tuple[list[ModulePlan], list[MoELayerPlan]]:
    src = _source_backend(ckpt, fmt)
    if src is not None and src.name == backend.name:
        raise FormatError(f"{ckpt.root}: already laid out for {backend.name}",
                          hint="nothing to do; use --backend canonical to get plain MXFP8 back")
    dense, blocks = _split_experts(_candidates(ckpt, fmt, src, backend, ignore))
    offenders: list[str] = []
    plans = [p for m in dense if (p := _fit(m, backend, on_ineligible, offenders)) is not None]
    layers = []
    for block, experts in blocks.items():
        if moe == "keep" and backend.laid_out:
            plans += [_kept(m, "--moe keep") for m in experts]
        elif backend.name not in MOE_BACKENDS or moe == "keep":
            plans += [p for m in experts if (p := _fit(m, backend, on_ineligible, offenders)) is not None]
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
        hint = "use --on-ineligible keep to leave them in canonical MXFP8, or another --backend"
        what = "tensor(s) or MoE block(s)" if any(o.startswith(tuple(b + " [E=" for b in blocks)) for o in offenders) \
            else "tensor(s)"
        raise IneligibleError(
            f"{len(offenders)} {what} do not fit backend {backend.name}: " + "; ".join(offenders),
            offenders=offenders,
            hint=hint + ("; --moe keep leaves the experts per-expert" if blocks else ""),
        )
    _check_spelling(layers)
    return plans, sorted(layers, key=lambda layer: layer.name)


def _fit(m: ModulePlan, backend: BackendSpec, on_ineligible: str, offenders: list[str]) -> ModulePlan | None:
    """``m`` if ``backend`` takes it; else ``m`` kept canonical, or None (and noted in ``offenders``)."""
    bad = backend.violations(m.n, m.k)
    if not bad:
        return m
    if on_ineligible == "error":
        offenders.append(f"{m.name}.weight [{m.n}, {m.k}]: {', '.join(bad)}")
        return None
    return _kept(m, "; ".join(bad))


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


def _unfused_experts(ckpt, fmt, src: BackendSpec, backend: BackendSpec, ignore) -> list[ModulePlan]:
    """Each expert projection of each fused MoE block of a laid-out source, as a module."""
    out = []
    for block, tensors in fused_moe_blocks(ckpt).items():
        if _matches_any(block, ignore):
            continue
        e_count, h, i = fused_moe_shape(block, tensors)
        names = _experts_suffixes(ckpt, block)
        for e in range(e_count):
            for role in EXPERT_ROLES:
                fc = "moe_fc2" if role == "down" else "moe_fc1"
                w, s = (expert_slice(tensors[f"{fc}_{part}"], e) for part in ("weight", "scale"))
                n, k = (h, i) if role == "down" else (i, h)
                out.append(ModulePlan(f"{block}.{e}.{names[role]}", n, k, w, s, "relayout", backend.weight_layout,
                                      None, fmt.kind, src.name, ExpertSlice(role, e, h, i)))
    return out


def _moe_tensors(layer: MoELayerPlan) -> list[TensorPlan]:
    e, h, i = layer.experts, layer.hidden, layer.intermediate
    logical = {"moe_fc1_scale": (e, 2 * i, h // 32), "moe_fc2_scale": (e, h, i // 32)}
    return [TensorPlan(layer.tensor_name(role), role, dtype, shape_of(h, i, e), MOE_LAYOUT,
                       layer.gate[0].weight.name, layer.name, logical.get(role))
            for role, (_, dtype, shape_of) in MOE_TENSORS.items()]


def _module_tensors(m: ModulePlan, backend: BackendSpec) -> list[TensorPlan]:
    c = m.k // 32
    w = f"{m.name}.weight"
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
) -> ConversionPlan:
    """Decide every output tensor from the source's headers.

    Args:
        ckpt: the opened source (headers only).
        backend: target backend from ``BACKENDS``.
        fmt: source format from ``formats.detect`` or ``--source-format``.
        on_ineligible: ``"error"`` (fail listing every offender) or ``"keep"`` (leave them in
            canonical MXFP8 and record why).
        ignore: extra module-name patterns (fnmatch) to leave untouched.
        moe: ``"fuse"``: per-expert MoE weights become the fused MoE kernel's tensors where the
            backend has that layout (trtllm), else they are linears like any other; ``"keep"``:
            they stay per-expert canonical MXFP8.

    Returns:
        The frozen plan.

    Raises:
        IneligibleError: tensors (or MoE blocks) fail the backend's constraints and
            ``on_ineligible="error"``.
        LayoutError / SourceError / FormatError: malformed pairs, missing partners or experts,
            unsupported format.
    """
    if on_ineligible not in ("error", "keep"):
        raise FormatError(f"--on-ineligible must be 'error' or 'keep', got {on_ineligible!r}")
    if moe not in MOE_MODES:
        raise FormatError(f"--moe must be 'fuse' or 'keep', got {moe!r}")
    cfg, hfq = ckpt.config or {}, ckpt.hf_quant_config or {}
    ignored = fmt.ignored(cfg, hfq) + list(ignore or [])
    modules, layers = _module_plans(ckpt, fmt, backend, list(ignore or []), on_ineligible, moe)
    consumed: set[str] = set()
    per_shard: dict[str, list[TensorPlan]] = {rel: [] for rel in ckpt.shards}
    for m in modules:
        per_shard[m.weight.file].extend(_module_tensors(m, backend))
    for layer in layers:
        per_shard[layer.shard].extend(_moe_tensors(layer))
    for m in (*modules, *(m for layer in layers for m in layer.modules)):
        consumed.update(t.name for t in (m.weight, m.scale) if t is not None)
    for name, info in ckpt.tensors.items():
        if name not in consumed:
            per_shard[info.file].append(TensorPlan(name, "passthrough", info.dtype, info.shape, "copy", name))
    shards = tuple(ShardPlan(rel, tuple(sorted(ts, key=_sort_key))) for rel, ts in sorted(per_shard.items()))
    _check_unique_names(shards, ckpt)
    tp = marker_tp_compat(ckpt, modules, backend) if backend.laid_out else None
    marker = quantization_config(ckpt, backend, fmt, ignored, layers, tp)
    return ConversionPlan(
        source=str(ckpt.root), backend=backend.name, format=fmt.name, shards=shards,
        modules=tuple(modules), copied_files=ckpt.other_files, marker=marker, indexed=ckpt.indexed,
        fingerprint=fingerprint(ckpt),
        kept=tuple(m.name for m in modules if m.layout == CANONICAL_LAYOUT and backend.laid_out),
        moe=tuple(layers), moe_mode=moe,
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
                        tp_compat: list[int] | None = None) -> dict:
    """The ``quantization_config`` of the output: the marker (docs/FORMAT.md section 2), or plain
    MXFP8's for the canonical backend."""
    original = _original_config(ckpt)
    if fmt.kind == "laid_out":
        ignored = ignored + list(((ckpt.config or {}).get("quantization_config") or {}).get("ignored_layers") or [])
    if not backend.laid_out:
        return canonical_config(original, ignored)
    return make_marker(backend.name, dialect=fmt.name, fingerprint=fingerprint(ckpt),
                       tool_version=__version__, ignored_layers=ignored, moe=moe_marker(moe_layers),
                       original=original, tp_compat=tp_compat).to_dict()
