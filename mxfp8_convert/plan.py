"""The plan: what happens to every tensor, decided from headers alone.

``build_plan()`` reads no tensor data. It pairs each quantized weight with its scale (they may
sit in different shards), checks every constraint of the target backend, and fails with the
full list of offending tensors before any work starts. ``convert()`` consumes the plan;
``--dry-run`` prints it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass, field

from mxfp8_convert import __version__
from mxfp8_convert.backends import (
    EPILOGUE_TILE_M,
    FLASHINFER_LAYOUT_VERSION,
    FORMAT_VERSION,
    BackendSpec,
)
from mxfp8_convert.dtypes import FLOAT_DTYPES, UE8M0_DTYPES, itemsize
from mxfp8_convert.errors import FormatError, IneligibleError, LayoutError, SourceError
from mxfp8_convert.formats import LAID_OUT_QUANT_METHOD, FormatSpec
from mxfp8_convert.layouts._common import ceil_to
from mxfp8_convert.read import SourceCheckpoint, TensorInfo

#: output scale tensor suffix of a laid-out module (docs/FORMAT.md section 3)
SWIZZLED_SUFFIX = "weight_scale_swizzled"
#: output scale tensor suffix of a module kept canonical
CANONICAL_SUFFIX = "weight_scale_inv"
COMPLETE_MARKER = "mxfp8_convert.complete.json"

#: modules never quantized from a dense source (SPEC section 4): embeddings, heads, norms, routers
_DENSE_SKIP = re.compile(
    r"(^|\.)(lm_head|embed_tokens|embeddings?|wte|wpe|word_embeddings|output|score|classifier)$"
    r"|norm|(^|\.)(gate|router)$"
)


@dataclass(frozen=True, slots=True)
class ModulePlan:
    """One linear module of the source and what happens to it."""

    name: str  # module prefix, e.g. "model.layers.0.mlp.up_proj"
    n: int
    k: int
    weight: TensorInfo
    scale: TensorInfo | None
    action: str  # "relayout" | "keep" | "expand_block" | "requantize" | "quantize"
    layout: str  # backend weight layout, or "canonical"
    reason: str | None = None  # why kept canonical

    def to_dict(self) -> dict:
        return {
            "name": self.name, "shape": [self.n, self.k], "action": self.action,
            "layout": self.layout, "reason": self.reason,
            "weight": self.weight.name, "scale": self.scale.name if self.scale else None,
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

    @property
    def nbytes(self) -> int:
        n = itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n

    def record(self) -> dict:
        """The per-tensor entry of the shard metadata (docs/FORMAT.md section 3)."""
        rec: dict = {"role": self.role, "layout": self.layout}
        if self.role == "weight":
            rec["shape"] = list(self.shape)
        else:
            n, c = self.logical_shape
            rec["logical_shape"] = [n, c]
            rec["padded_shape"] = [ceil_to(n, 128), ceil_to(c, 4)] if self.layout != "canonical" else [n, c]
            rec["tile_shape"] = list(self.shape)
        return rec

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
    kept: tuple[str, ...] = field(default=())

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def to_dict(self) -> dict:
        actions: dict[str, int] = {}
        for m in self.modules:
            actions[m.action] = actions.get(m.action, 0) + 1
        return {
            "source": self.source, "backend": self.backend, "format": self.format,
            "total_bytes": self.nbytes, "modules_by_action": actions, "kept_canonical": list(self.kept),
            "modules": [m.to_dict() for m in self.modules],
            "shards": [s.to_dict() for s in self.shards], "copied_files": list(self.copied_files),
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
    suffix = "." + fmt.scale_suffix
    for name, info in tensors.items():
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            if module + ".weight" not in tensors:
                raise SourceError(f"{info.file}: scale {name!r} has no weight {module + '.weight'!r}")
        if not name.endswith(".weight") or info.dtype != "F8_E4M3":
            continue
        module = name[: -len(".weight")]
        scale = tensors.get(module + suffix)
        if scale is None:
            raise SourceError(f"{info.file}: weight {name!r} is float8_e4m3fn but has no scale {module + suffix!r}")
        out.append((module, info, scale))
    return sorted(out, key=lambda m: m[0])


def _check_mxfp8_pair(w: TensorInfo, s: TensorInfo) -> tuple[int, int]:
    if len(w.shape) != 2:
        raise LayoutError(f"{w.file}: weight {w.name!r} has shape {list(w.shape)}; only 2-D linear weights are supported")
    n, k = w.shape
    if k % 32:
        raise LayoutError(f"{w.file}: weight {w.name!r} has K={k}, not a multiple of 32 (MXFP8 blocks are 1x32)")
    if s.dtype not in UE8M0_DTYPES:
        raise LayoutError(f"{s.file}: scale {s.name!r} has dtype {s.dtype}; MXFP8 scales are U8 or F8_E8M0")
    if tuple(s.shape) != (n, k // 32):
        raise LayoutError(f"{s.file}: scale {s.name!r} has shape {list(s.shape)}; weight {w.name!r} [{n}, {k}] needs [{n}, {k // 32}]")
    return n, k


def _module_plans(ckpt, fmt, backend: BackendSpec, ignore, on_ineligible) -> list[ModulePlan]:
    if fmt.kind == "laid_out":
        raise FormatError(
            f"{ckpt.root}: already laid out by mxfp8-convert "
            f"(backend {((ckpt.config or {}).get('quantization_config') or {}).get('backend')!r})",
            hint="use --backend canonical to turn it back into plain MXFP8 first",
        )
    if fmt.kind != "mxfp8":
        raise FormatError(f"{ckpt.root}: source format {fmt.name!r} ({fmt.description}) is not supported yet")
    plans, offenders = [], []
    for module, w, s in find_modules(ckpt, fmt, ignore):
        n, k = _check_mxfp8_pair(w, s)
        bad = backend.violations(n, k)
        if bad and on_ineligible == "error":
            offenders.append(f"{w.name} [{n}, {k}]: {', '.join(bad)}")
            continue
        action, layout, reason = ("keep", "canonical", "; ".join(bad)) if bad else ("relayout", backend.weight_layout, None)
        plans.append(ModulePlan(module, n, k, w, s, action, layout, reason))
    if offenders:
        raise IneligibleError(
            f"{len(offenders)} tensor(s) do not fit backend {backend.name}: " + "; ".join(offenders),
            offenders=offenders,
            hint="use --on-ineligible keep to leave them in canonical MXFP8, or another --backend",
        )
    return plans


def _module_tensors(m: ModulePlan, backend: BackendSpec) -> list[TensorPlan]:
    c = m.k // 32
    if m.action == "keep":
        return [
            TensorPlan(m.weight.name, "weight", "F8_E4M3", (m.n, m.k), "canonical", m.weight.name, m.name),
            TensorPlan(f"{m.name}.{CANONICAL_SUFFIX}", "weight_scale", "U8", (m.n, c), "canonical",
                       m.scale.name, m.name, (m.n, c)),
        ]
    return [
        TensorPlan(m.weight.name, "weight", "F8_E4M3", (m.n, m.k), backend.weight_layout, m.weight.name, m.name),
        TensorPlan(f"{m.name}.{SWIZZLED_SUFFIX}", "weight_scale", "U8", backend.scale_shape(m.n, c),
                   backend.scale_layout, m.scale.name if m.scale else m.weight.name, m.name, (m.n, c)),
    ]


def _sort_key(t: TensorPlan) -> tuple[int, str]:
    # widest dtype first, as safetensors' own writer does, so every tensor stays aligned
    return (-itemsize(t.dtype), t.name)


def build_plan(
    ckpt: SourceCheckpoint,
    backend: BackendSpec,
    fmt: FormatSpec,
    *,
    on_ineligible: str = "error",
    ignore: list[str] | None = None,
) -> ConversionPlan:
    """Decide every output tensor from the source's headers.

    Args:
        ckpt: the opened source (headers only).
        backend: target backend from ``BACKENDS``.
        fmt: source format from ``formats.detect`` or ``--source-format``.
        on_ineligible: ``"error"`` (fail listing every offender) or ``"keep"`` (leave them in
            canonical MXFP8 and record why).
        ignore: extra module-name patterns (fnmatch) to leave untouched.

    Returns:
        The frozen plan.

    Raises:
        IneligibleError: tensors fail the backend's constraints and ``on_ineligible="error"``.
        LayoutError / SourceError / FormatError: malformed pairs, missing partners, unsupported format.
    """
    if on_ineligible not in ("error", "keep"):
        raise FormatError(f"--on-ineligible must be 'error' or 'keep', got {on_ineligible!r}")
    cfg, hfq = ckpt.config or {}, ckpt.hf_quant_config or {}
    ignored = fmt.ignored(cfg, hfq) + list(ignore or [])
    modules = _module_plans(ckpt, fmt, backend, list(ignore or []), on_ineligible)
    consumed: set[str] = set()
    per_shard: dict[str, list[TensorPlan]] = {rel: [] for rel in ckpt.shards}
    for m in modules:
        consumed.add(m.weight.name)
        if m.scale is not None:
            consumed.add(m.scale.name)
        per_shard[m.weight.file].extend(_module_tensors(m, backend))
    for name, info in ckpt.tensors.items():
        if name not in consumed:
            per_shard[info.file].append(TensorPlan(name, "passthrough", info.dtype, info.shape, "copy", name))
    shards = tuple(ShardPlan(rel, tuple(sorted(ts, key=_sort_key))) for rel, ts in sorted(per_shard.items()))
    marker = make_marker(ckpt, backend, fmt, ignored)
    return ConversionPlan(
        source=str(ckpt.root), backend=backend.name, format=fmt.name, shards=shards,
        modules=tuple(modules), copied_files=ckpt.other_files, marker=marker, indexed=ckpt.indexed,
        kept=tuple(m.name for m in modules if m.action == "keep"),
    )


def make_marker(ckpt: SourceCheckpoint, backend: BackendSpec, fmt: FormatSpec, ignored: list[str]) -> dict:
    """The ``quantization_config`` of the output (docs/FORMAT.md section 2)."""
    original = (ckpt.config or {}).get("quantization_config")
    return {
        "quant_method": LAID_OUT_QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "backend": backend.name,
        "weight_layout": backend.weight_layout,
        "scale_layout": backend.scale_layout,
        "epilogue_tile_m": EPILOGUE_TILE_M,
        "block_size": 32,
        "weight_dtype": "float8_e4m3fn",
        "scale_dtype": "uint8",
        "scale_suffix": SWIZZLED_SUFFIX,
        "flashinfer_layout_version": FLASHINFER_LAYOUT_VERSION,
        "tool": {"name": "mxfp8-convert", "version": __version__},
        "source": {"dialect": fmt.name, "fingerprint": fingerprint(ckpt), "fingerprint_method": "headers-v1"},
        "ignored_layers": sorted(set(ignored)),
        "original_quantization_config": original if isinstance(original, dict) else None,
    }
