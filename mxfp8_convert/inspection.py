"""``inspect``: what a checkpoint is, and what each backend could do with each of its linears.

Reads headers only (plus the small float scales of FP8 sources, to tell lossless from
requantized), so it is instant on any size of model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mxfp8_convert._gc import paused_gc
from mxfp8_convert.backends import BACKENDS, KERNEL_BACKENDS
from mxfp8_convert.errors import ConvertError
from mxfp8_convert.format import CANONICAL_LAYOUT, COMPLETE_MARKER, SWIZZLED_SUFFIX
from mxfp8_convert.formats import detect_source
from mxfp8_convert.layouts.moe import moe_shape_violations
from mxfp8_convert.plan import (
    EXPERT_ROLES,
    MOE_BACKENDS,
    expert_key,
    find_modules,
    fp8_lossless,
    fused_moe_blocks,
    fused_moe_shape,
    plan_modules,
)
from mxfp8_convert.plan.classify import violations
from mxfp8_convert.read import open_checkpoint, resolve_model


@dataclass(slots=True)
class ModuleReport:
    name: str
    shape: list[int]
    weight_dtype: str
    layout: str  # how it is stored now
    #: backend -> violations (empty: it can take it); modules of one shape share this dict
    backends: dict[str, list[str]]

    def to_dict(self, docs: dict[int, dict] | None = None) -> dict:
        """The module's document. ``docs``: the ``backends`` documents made so far, by the id
        of their ``backends`` dict; modules that share that dict get the same (read-only)
        document, written once by ``cli._output.dumps``."""
        backends = None if docs is None else docs.get(id(self.backends))
        if backends is None:
            backends = {b: {"ok": not v, "why_not": v} for b, v in self.backends.items()}
            if docs is not None:
                docs[id(self.backends)] = backends
        return {
            "name": self.name,
            "shape": self.shape,
            "weight_dtype": self.weight_dtype,
            "layout": self.layout,
            "backends": backends,
        }


@dataclass(slots=True)
class MoEReport:
    """One MoE block: its experts, their sizes, and whether the fused MoE kernel takes them."""

    name: str  # e.g. "model.layers.3.mlp.experts"
    experts: int
    hidden: int | None
    intermediate: int | None
    stored: str  # "per-expert" or "fused (trtllm)"
    why_not: list[str]  # empty: the trtllm fused MoE kernel can take this block

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "experts": self.experts,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "stored": self.stored,
            "fused_moe": {
                "ok": not self.why_not,
                "why_not": self.why_not,
                "backends": list(MOE_BACKENDS),
            },
        }


@dataclass(slots=True)
class InspectReport:
    path: str
    format: str
    kind: str
    backend: str | None  # laid-out checkpoints: the backend they are laid out for
    complete: bool | None  # laid-out checkpoints: whether the completion marker is there
    shards: int
    bytes_by_role: dict[str, int] = field(default_factory=dict)
    count_by_role: dict[str, int] = field(default_factory=dict)
    modules: list[ModuleReport] = field(default_factory=list)
    actions: dict[str, str] = field(default_factory=dict)  # backend -> modules_by_action or error
    moe: list[MoEReport] = field(default_factory=list)
    #: laid-out checkpoints: the marker's tensor-parallel sizes (None: a version-1 marker)
    tp_compat: list[int] | None = None

    def to_dict(self) -> dict:
        docs: dict[int, dict] = {}  # the modules' ``backends`` are shared by shape: so are these
        return {
            "path": self.path,
            "format": self.format,
            "kind": self.kind,
            "backend": self.backend,
            "complete": self.complete,
            "tp_compat": self.tp_compat,
            "shards": self.shards,
            "bytes_by_role": self.bytes_by_role,
            "count_by_role": self.count_by_role,
            "conversion": self.actions,
            "moe_layers": [m.to_dict() for m in self.moe],
            "modules": [m.to_dict(docs) for m in self.modules],
        }


@paused_gc()  # a report per module and three plans, no cycles (``_gc``)
def inspect_checkpoint(
    path: str | Path, *, source_format: str | None = None, revision: str | None = None
) -> InspectReport:
    """Describe a source or an output checkpoint (local folder or Hub repo id)."""
    root = resolve_model(str(path), revision=revision)
    ckpt = open_checkpoint(root)
    fmt = detect_source(ckpt.config, ckpt.quant_files, ckpt.tensors, source_format)
    marker = (ckpt.config or {}).get("quantization_config") or {}
    laid_out = fmt.kind == "laid_out"
    report = InspectReport(
        path=str(root),
        format=fmt.name,
        kind=fmt.kind,
        backend=marker.get("backend") if laid_out else None,
        complete=(root / COMPLETE_MARKER).exists() if laid_out else None,
        shards=len(ckpt.shards),
        tp_compat=marker.get("tp_compat") if laid_out else None,
    )
    modules = find_modules(ckpt, fmt, [])
    roles: dict[str, str] = {}
    by_shape: dict[tuple, tuple[list[int], dict]] = {}  # a few shapes, many modules of each
    for module, w, s in modules:
        roles[w.name] = "weight"
        if s is not None:
            roles[s.name] = "weight_scale"
        shared = by_shape.get(w.shape)
        if shared is None:
            n, k = (w.shape + (0, 0))[:2] if len(w.shape) == 2 else (0, 0)
            why = {b: _why_not(BACKENDS[b], w, n, k) for b in KERNEL_BACKENDS}
            shared = by_shape[w.shape] = (list(w.shape), why)
        stored = _stored_as(fmt, report.backend, s)
        report.modules.append(ModuleReport(module, shared[0], w.dtype, stored, shared[1]))
    report.moe = _per_expert_blocks(report.modules) + _fused_blocks(ckpt, roles)
    for name, info in ckpt.tensors.items():
        role = roles.get(name, "other")
        report.bytes_by_role[role] = report.bytes_by_role.get(role, 0) + info.nbytes
        report.count_by_role[role] = report.count_by_role.get(role, 0) + 1
    try:
        lossless = fp8_lossless(ckpt, fmt)  # read once for the three plans below
    except ConvertError:
        lossless = None  # each plan reports the error
    for b in (*KERNEL_BACKENDS, "canonical"):
        report.actions[b] = _conversion(ckpt, fmt, b, lossless)
    return report


def _stored_as(fmt, backend: str | None, scale) -> str:
    """How a module is stored now: a backend's layout, ``canonical`` MXFP8, or the source's own
    scheme (``block_fp8``, ``fp8``, ``dense``: the kinds of ``formats.FORMATS``)."""
    if fmt.kind == "laid_out":
        swizzled = scale is not None and scale.name.endswith("." + SWIZZLED_SUFFIX)
        return backend if swizzled else CANONICAL_LAYOUT
    return CANONICAL_LAYOUT if fmt.kind == "mxfp8" else fmt.kind


def _per_expert_blocks(modules: list[ModuleReport]) -> list[MoEReport]:
    """MoE blocks stored per expert (``...experts.<e>.{gate,up,down}_proj`` or ``w1/w3/w2``)."""
    blocks: dict[str, dict[tuple[int, str], ModuleReport]] = {}
    for m in modules:
        key = expert_key(m.name)
        if key is not None:
            blocks.setdefault(key[0], {})[key[1:]] = m
    out = []
    for block, by in sorted(blocks.items()):
        count = 1 + max(e for e, _ in by)
        missing = next(
            ((e, r) for e in range(count) for r in EXPERT_ROLES if (e, r) not in by), None
        )
        gate = by.get((0, "gate"))
        i, h = gate.shape[:2] if gate is not None and len(gate.shape) == 2 else (None, None)
        why = ([f"expert {missing[0]} has no {missing[1]} projection"] if missing else []) + (
            moe_shape_violations(h, i) if h is not None else ["expert 0 has no 2-D gate projection"]
        )
        out.append(MoEReport(block, count, h, i, "per-expert", why))
    return out


def _fused_blocks(ckpt, roles: dict[str, str]) -> list[MoEReport]:
    """Fused MoE blocks of a laid-out output (their tensors get the ``moe_*`` roles)."""
    out = []
    for block, tensors in fused_moe_blocks(ckpt).items():
        try:
            e, h, i = fused_moe_shape(block, tensors)
            why = []
        except ConvertError as err:
            e, h, i, why = 0, None, None, [str(err)]
        for role, t in tensors.items():
            if t is not None:
                roles[t.name] = role
        out.append(MoEReport(block, e, h, i, "fused (trtllm)", why))
    return out


def _why_not(backend, w, n: int, k: int) -> list[str]:
    if len(w.shape) != 2:
        return [f"weight is {len(w.shape)}-D"]
    return list(violations(backend, n, k))


def _conversion(ckpt, fmt, backend: str, lossless: dict[str, bool] | None) -> str:
    """What converting to ``backend`` would do with the modules, in one phrase (the module
    decisions of its plan, ``plan_modules``; the output's tensors need not be laid out)."""
    try:
        modules, layers, _ = plan_modules(
            ckpt, BACKENDS[backend], fmt, on_ineligible="keep", lossless=lossless
        )
    except ConvertError as e:
        return f"not possible: {e}"
    counts: dict[str, int] = {}
    for m in (*modules, *(m for layer in layers for m in layer.modules)):
        counts[m.action] = counts.get(m.action, 0) + 1
    text = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "nothing to convert"
    experts = sum(layer.experts for layer in layers)
    return text + (f" ({experts} experts fused into {len(layers)} MoE blocks)" if layers else "")
