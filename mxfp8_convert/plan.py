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
from dataclasses import dataclass, field

from mxfp8_convert import __version__
from mxfp8_convert.backends import (
    BACKENDS,
    EPILOGUE_TILE_M,
    FLASHINFER_LAYOUT_VERSION,
    FORMAT_VERSION,
    BackendSpec,
)
from mxfp8_convert.dtypes import FLOAT_DTYPES, UE8M0_DTYPES, itemsize
from mxfp8_convert.errors import FormatError, IneligibleError, LayoutError, SourceError
from mxfp8_convert.formats import LAID_OUT_QUANT_METHOD, FormatSpec
from mxfp8_convert.layouts._common import ceil_to
from mxfp8_convert.quantize import fp8_scales_are_pow2
from mxfp8_convert.read import SourceCheckpoint, TensorInfo, read_tensor

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
    action: str  # see ACTIONS
    layout: str  # output weight layout: a backend's, or "canonical"
    reason: str | None = None  # why kept canonical
    source_kind: str = "mxfp8"  # FormatSpec.kind of the source
    source_backend: str | None = None  # laid-out sources: the backend their bytes are laid out for

    def to_dict(self) -> dict:
        return {
            "name": self.name, "shape": [self.n, self.k], "action": self.action,
            "layout": self.layout, "reason": self.reason, "source_kind": self.source_kind,
            "source_backend": self.source_backend,
            "weight": self.weight.name, "scale": self.scale.name if self.scale else None,
        }


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
    fingerprint: str
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
    return n, k, fp8_scales_are_pow2(read_tensor(ckpt.root, s), name=s.name)


def _source_backend(ckpt: SourceCheckpoint, fmt: FormatSpec) -> BackendSpec | None:
    if fmt.kind != "laid_out":
        return None
    marker = (ckpt.config or {}).get("quantization_config") or {}
    if marker.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{ckpt.root}: mxfp8-convert format_version {marker.get('format_version')!r} "
                          f"is not {FORMAT_VERSION}", hint="use the mxfp8-convert release that wrote it")
    name = marker.get("backend")
    if name not in BACKENDS or not BACKENDS[name].laid_out:
        raise FormatError(f"config.json: unknown mxfp8-convert backend {name!r}")
    return BACKENDS[name]


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


def _module_plans(ckpt, fmt, backend: BackendSpec, ignore, on_ineligible) -> list[ModulePlan]:
    src = _source_backend(ckpt, fmt)
    if src is not None and src.name == backend.name:
        raise FormatError(f"{ckpt.root}: already laid out for {backend.name}",
                          hint="nothing to do; use --backend canonical to get plain MXFP8 back")
    plans, offenders = [], []
    for module, w, s in find_modules(ckpt, fmt, ignore):
        n, k, action = _classify(ckpt, fmt, src, w, s)
        bad = backend.violations(n, k)
        if bad and on_ineligible == "error":
            offenders.append(f"{w.name} [{n}, {k}]: {', '.join(bad)}")
            continue
        layout, reason = backend.weight_layout, None
        if bad:
            layout, reason = "canonical", "; ".join(bad)
            action = "keep" if action == "relayout" else action
        src_name = src.name if src is not None and s.name.endswith("." + SWIZZLED_SUFFIX) else None
        plans.append(ModulePlan(module, n, k, w, s, action, layout, reason, fmt.kind, src_name))
    if offenders:
        raise IneligibleError(
            f"{len(offenders)} tensor(s) do not fit backend {backend.name}: " + "; ".join(offenders),
            offenders=offenders,
            hint="use --on-ineligible keep to leave them in canonical MXFP8, or another --backend",
        )
    return plans


def _module_tensors(m: ModulePlan, backend: BackendSpec) -> list[TensorPlan]:
    c = m.k // 32
    if m.layout == "canonical":
        return [
            TensorPlan(m.weight.name, "weight", "F8_E4M3", (m.n, m.k), "canonical", m.weight.name, m.name),
            TensorPlan(f"{m.name}.{CANONICAL_SUFFIX}", "weight_scale", "U8", (m.n, c), "canonical",
                       m.scale.name if m.scale else m.weight.name, m.name, (m.n, c)),
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
        fingerprint=fingerprint(ckpt),
        kept=tuple(m.name for m in modules if m.layout == "canonical" and backend.laid_out),
    )


def _original_config(ckpt: SourceCheckpoint) -> dict | None:
    """The source's own quantization_config; for one of our outputs, the one it came from."""
    q = (ckpt.config or {}).get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == LAID_OUT_QUANT_METHOD:
        q = q.get("original_quantization_config")
    return q if isinstance(q, dict) else None


def canonical_config(original: dict | None, ignored: list[str]) -> dict:
    """quantization_config of plain SGLang/Miles MXFP8 output (SPEC section 4)."""
    if original and original.get("quant_method") == "mxfp8":
        return original  # came from SGLang MXFP8: give its config back untouched
    return {"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic", "ignored_layers": sorted(set(ignored))}


def make_marker(ckpt: SourceCheckpoint, backend: BackendSpec, fmt: FormatSpec, ignored: list[str]) -> dict:
    """The ``quantization_config`` of the output (docs/FORMAT.md section 2)."""
    original = _original_config(ckpt)
    if fmt.kind == "laid_out":
        ignored = ignored + list(((ckpt.config or {}).get("quantization_config") or {}).get("ignored_layers") or [])
    if not backend.laid_out:
        return canonical_config(original, ignored)
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
        "original_quantization_config": original,
    }
