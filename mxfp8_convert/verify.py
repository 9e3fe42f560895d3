"""``verify``: prove that an output is complete, self-consistent and, given its source, exact.

Checks, in order: the completion marker and every file it lists (inside the folder, size and
xxh3 hash), and that it lists every file the folder holds; the layout marker in config.json and
in every shard; every tensor's dtype and shape against its record. With ``source``: every
module's layouts are inverted (the inverse functions, not the forward ones the converter used)
and compared with the source's canonical MXFP8 bytes: identical for lossless conversions,
identical to a fresh FlashInfer-recipe quantization for requantized ones, whose recorded error
is recomputed too. Fused MoE tensors are cut per
expert and inverted with ``layouts/moe.py``'s inverse functions, each expert's projections
compared the same way. Pass-through tensors must be byte-identical. One module (one expert)
is in memory at a time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.dtypes import torch_dtype
from mxfp8_convert.errors import ConvertError, MarkerError, SourceError, VerifyError
from mxfp8_convert.format import (
    CANONICAL_LAYOUT,
    CANONICAL_SUFFIX,
    COMPLETE_MARKER,
    CONFIG_FILE,
    META_MARKER,
    META_TENSORS,
    MOE_LAYOUT,
    SWIZZLED_SUFFIX,
    Completion,
    Marker,
    file_digest,
    is_marker,
)
from mxfp8_convert.formats import detect_source
from mxfp8_convert.layouts.moe import (
    moe_fc1_scale_to_canonical,
    moe_fc1_weight_to_canonical,
    moe_fc2_scale_to_canonical,
    moe_fc2_weight_to_canonical,
)
from mxfp8_convert.plan import (
    MOE_TENSORS,
    MoELayerPlan,
    build_plan,
    expert_slice,
    model_dtype,
)
from mxfp8_convert.quantize import quantization_error
from mxfp8_convert.read import (
    SourceCheckpoint,
    open_checkpoint,
    read_tensor,
    resolve_model,
    safe_child,
)
from mxfp8_convert.transform import canonical_module, dense_weight, dequantized_module


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One problem: the tensor or file, what is wrong, and the first differing position."""

    where: str
    what: str
    position: list[int] | None = None

    def __str__(self) -> str:
        at = f" at {self.position}" if self.position is not None else ""
        return f"{self.where}: {self.what}{at}"

    def to_dict(self) -> dict:
        return {"where": self.where, "what": self.what, "position": self.position}


@dataclass(slots=True)
class VerifyReport:
    path: str
    backend: str | None
    source: str | None = None
    files_checked: int = 0
    tensors_checked: int = 0
    modules_compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "path": self.path,
            "backend": self.backend,
            "source": self.source,
            "files_checked": self.files_checked,
            "tensors_checked": self.tensors_checked,
            "modules_compared": self.modules_compared,
            "mismatches": [m.to_dict() for m in self.mismatches],
        }


def first_difference(a: torch.Tensor, b: torch.Tensor) -> list[int] | None:
    """Index of the first differing byte of two same-shape tensors (None if identical)."""
    a, b = (
        a.view(torch.uint8) if a.element_size() == 1 else a,
        b.view(torch.uint8) if b.element_size() == 1 else b,
    )
    if tuple(a.shape) != tuple(b.shape):
        return []
    diff = a != b
    if not bool(diff.any()):
        return None
    return [int(i) for i in diff.nonzero()[0]]


def verify(
    path: str | Path,
    source: str | Path | None = None,
    *,
    check_hashes: bool = True,
    source_format: str | None = None,
) -> VerifyReport:
    """Verify a converted checkpoint (see the module docstring).

    Args:
        path: the output folder.
        source: the checkpoint it was made from (folder or Hub repo id), to compare bytes.
        check_hashes: recompute every file's xxh3_128 and compare with the completion marker
            (False still checks that every file is listed, inside the folder and of its size).
        source_format: the source's format; by default the one the output records (completion
            marker ``source_format``, else the marker's ``source.dialect``), else detected.

    Returns:
        A ``VerifyReport``; ``report.ok`` is False when anything differs.

    Raises:
        VerifyError: the folder is not a complete mxfp8-convert output at all.
    """
    root = Path(path)
    done = _completion(root)
    report = VerifyReport(str(root), done.backend)
    _check_files(root, done, report, check_hashes)
    ckpt = open_checkpoint(root)
    marker = (ckpt.config or {}).get("quantization_config") or {}
    records = _check_marker(ckpt, marker, report)
    _check_tensors(ckpt, marker, records, report)
    if source is not None:
        src = open_checkpoint(resolve_model(str(source)))
        report.source = str(src.root)
        _compare_with_source(ckpt, src, marker, records, done, report, source_format)
    return report


def _completion(root: Path) -> Completion:
    if not root.is_dir():
        raise VerifyError(f"{root}: not a folder")
    if not (root / COMPLETE_MARKER).exists():
        raise VerifyError(
            f"{root}: no {COMPLETE_MARKER}: incomplete, or not an mxfp8-convert output"
        )
    return Completion.read(root, error=VerifyError)


#: bookkeeping of ``huggingface_hub``'s ``--local-dir`` downloads (``_local_folder.py``), which
#: a downloaded output holds besides the files it was published with
_DOWNLOAD_METADATA = ".cache/huggingface/"


def _present_files(root: Path) -> list[str]:
    """Relative POSIX paths of every file and link in ``root`` (links to folders not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in links]
        for fn in (*filenames, *links):
            out.append(fn if rel_dir == "." else f"{rel_dir}/{fn}")
    return sorted(
        rel for rel in out if rel != COMPLETE_MARKER and not rel.startswith(_DOWNLOAD_METADATA)
    )


def _file_problem(root: Path, rel: str, rec, check_hashes: bool) -> str | None:
    """What is wrong with listed file ``rel`` against its record (None if nothing)."""
    try:
        p = safe_child(root, rel, what="file")
    except SourceError as e:
        return str(e).removeprefix(f"file {rel!r} ")
    if not p.is_file():
        return "listed in the completion marker but missing"
    size = p.stat().st_size
    if size != rec.size:
        return f"size {size} != recorded {rec.size}"
    if check_hashes and file_digest(p) != rec.xxh3_128:
        return "xxh3_128 hash differs from the completion marker"
    return None


def _check_files(root: Path, done: Completion, report: VerifyReport, check_hashes: bool) -> None:
    """Every file listed in the completion marker is there, inside the folder, with its size (and
    hash); every file there is listed."""
    for rel, rec in sorted(done.files.items()):
        report.files_checked += 1
        what = _file_problem(root, rel, rec, check_hashes)
        if what:
            report.mismatches.append(Mismatch(rel, what))
    for rel in _present_files(root):
        if rel not in done.files:
            report.files_checked += 1
            report.mismatches.append(Mismatch(rel, "not listed in the completion marker"))


def _check_marker(ckpt: SourceCheckpoint, marker: dict, report: VerifyReport) -> dict[str, dict]:
    """Check config/shard markers; return every shard's per-tensor records, merged."""
    laid_out = is_marker(marker)
    if laid_out != BACKENDS[report.backend].laid_out:
        report.mismatches.append(
            Mismatch(CONFIG_FILE, f"quantization_config does not match backend {report.backend}")
        )
    if laid_out:
        try:
            if Marker.parse(marker, CONFIG_FILE).backend != report.backend:
                report.mismatches.append(
                    Mismatch(CONFIG_FILE, "layout marker disagrees with the completion marker")
                )
        except MarkerError as e:
            report.mismatches.append(Mismatch(CONFIG_FILE, str(e).removeprefix(f"{CONFIG_FILE}: ")))
    records: dict[str, dict] = {}
    for rel, sh in ckpt.shards.items():
        if not laid_out:
            continue
        try:
            shard_marker = json.loads(sh.metadata.get(META_MARKER, "null"))
            shard_records = json.loads(sh.metadata.get(META_TENSORS, "{}"))
        except json.JSONDecodeError:
            report.mismatches.append(Mismatch(rel, "layout metadata is not valid JSON"))
            continue
        if shard_marker != marker:
            report.mismatches.append(
                Mismatch(rel, "shard layout marker differs from config.json's")
            )
        for name, rec in shard_records.items():
            if ckpt.tensors.get(name) is None or ckpt.tensors[name].file != rel:
                report.mismatches.append(Mismatch(name, f"recorded in {rel} but not stored there"))
            records[name] = rec
    return records


def _check_tensors(
    ckpt: SourceCheckpoint, marker: dict, records: dict[str, dict], report: VerifyReport
) -> None:
    backend = BACKENDS.get(report.backend or "")
    if backend is None or not backend.laid_out:
        return
    for name, info in sorted(ckpt.tensors.items()):
        rec = records.get(name)
        if rec is None:
            if name.endswith((f".{SWIZZLED_SUFFIX}", f".{CANONICAL_SUFFIX}", *_MOE_SUFFIXES)) or (
                info.dtype == "F8_E4M3" and name.endswith(".weight")
            ):
                report.mismatches.append(Mismatch(name, "quantized tensor without a layout record"))
            continue
        report.tensors_checked += 1
        what = (
            _moe_problem(info, rec, marker, records)
            if rec.get("role") in MOE_TENSORS
            else _tensor_problem(info, rec, backend, records)
        )
        if what:
            report.mismatches.append(Mismatch(name, what))


def _tensor_problem(info, rec: dict, backend, records: dict[str, dict]) -> str | None:
    layout = rec.get("layout")
    if rec.get("role") == "weight":
        if info.dtype != "F8_E4M3" or list(info.shape) != rec.get("shape") or len(info.shape) != 2:
            return f"{info.dtype} {list(info.shape)} does not match its record {rec.get('shape')}"
        if layout not in (backend.weight_layout, CANONICAL_LAYOUT):
            return f"layout {layout!r} is not {backend.name}'s {backend.weight_layout!r}"
        module = info.name[: -len(".weight")]
        suffix = CANONICAL_SUFFIX if layout == CANONICAL_LAYOUT else SWIZZLED_SUFFIX
        if f"{module}.{suffix}" not in records:
            return f"no {suffix} recorded for this weight"
        return None
    if rec.get("role") != "weight_scale":
        return f"unknown role {rec.get('role')!r}"
    n, c = rec.get("logical_shape", [0, 0])
    want = [n, c] if layout == CANONICAL_LAYOUT else list(backend.scale_shape(n, c))
    if layout not in (backend.scale_layout, CANONICAL_LAYOUT):
        return f"layout {layout!r} is not {backend.name}'s {backend.scale_layout!r}"
    if info.dtype != "U8" or list(info.shape) != want:
        return f"{info.dtype} {list(info.shape)}, but a {layout} scale of [{n}, {c}] is U8 {want}"
    return None


_MOE_SUFFIXES = tuple(f".{suffix}" for suffix, _, _ in MOE_TENSORS.values())


def _moe_problem(info, rec: dict, marker: dict, records: dict[str, dict]) -> str | None:
    """What is wrong with a fused MoE tensor, judged by its record and the marker (or None)."""
    role = rec["role"]
    suffix, dtype, shape_of = MOE_TENSORS[role]
    if rec.get("layout") != MOE_LAYOUT or not marker.get("moe"):
        return (f"layout {rec.get('layout')!r}: fused MoE tensors need layout {MOE_LAYOUT!r} "
                "and the marker's moe entry")
    e, h, i = rec.get("experts"), rec.get("hidden"), rec.get("intermediate")
    try:
        want = list(shape_of(h, i, e))
    except (ConvertError, TypeError):
        return f"record says E={e}, H={h}, I={i}, which the fused MoE kernel cannot take"
    if info.dtype != dtype or list(info.shape) != want:
        return (
            f"{info.dtype} {list(info.shape)}, but {role} of E={e}, H={h}, I={i} is {dtype} {want}"
        )
    if rec.get("shape", rec.get("tile_shape")) != want:
        return f"record's shape {rec.get('shape', rec.get('tile_shape'))} is not {want}"
    block = info.name[: -len(suffix) - 1]
    partners = [f"{block}.{other}" for other, _, _ in MOE_TENSORS.values()]
    missing = [p for p in partners if p not in records]
    if missing:
        return f"no {missing[0]!r} recorded beside it"
    if any(
        (records[p].get("experts"), records[p].get("hidden"), records[p].get("intermediate"))
        != (e, h, i)
        for p in partners
    ):
        return "the four fused tensors of this block record different E, H, I"
    return None


def _compare_with_source(
    ckpt,
    src: SourceCheckpoint,
    marker,
    records,
    done,
    report: VerifyReport,
    source_format: str | None = None,
) -> None:
    backend = BACKENDS[report.backend]
    recorded = done.source_format or (marker.get("source") or {}).get("dialect")
    fmt = detect_source(src.config, src.quant_files, src.tensors, source_format or recorded)
    # an output without fused MoE tensors was made with --moe keep, or had nothing to fuse; the
    # modules it left unquantized (``ignored_layers``, exact names) are planned so again
    left = [n for n in marker.get("ignored_layers") or [] if isinstance(n, str)]
    plan = build_plan(
        src,
        backend,
        fmt,
        on_ineligible="keep",
        moe="fuse" if marker.get("moe") else "keep",
        ignore=left,
        strict_ignore=False,
        allow_no_quantized=True,
        quantize_towers=done.quantize_towers,
    )
    if done.source_fingerprint != plan.fingerprint:
        report.mismatches.append(
            Mismatch("source", "fingerprint differs from the one recorded at conversion")
        )
    errors = done.quantization_errors
    covered: set[str] = set()
    for m in plan.modules:
        if m.action == "dequantize":
            covered.add(f"{m.name}.weight")
            report.modules_compared += 1
            report.mismatches.extend(_compare_dequantized(m, ckpt, src))
            continue
        names = _output_names(m.name, ckpt)
        if names is None:
            continue  # left unconverted (e.g. --ignore): compared as pass-through below
        covered.update(names[:2])
        report.modules_compared += 1
        report.mismatches.extend(_compare_module(m, ckpt, src, backend, names, errors.get(m.name)))
    for layer in plan.moe:
        covered.update(layer.tensor_name(role) for role in MOE_TENSORS)
        report.modules_compared += len(layer.modules)
        report.mismatches.extend(_compare_moe_layer(layer, ckpt, src, errors))
    for name, info in sorted(ckpt.tensors.items()):
        if name in covered:
            continue
        if name not in src.tensors:
            report.mismatches.append(Mismatch(name, "not in the source"))
            continue
        a, b = read_tensor(ckpt.root, info), read_tensor(src.root, src.tensors[name])
        pos = first_difference(a, b) if a.dtype == b.dtype else []
        if pos is not None:
            report.mismatches.append(
                Mismatch(name, "pass-through tensor differs from the source", pos)
            )


def _compare_dequantized(m, ckpt, src) -> list[Mismatch]:
    """An ignored module of a quantized source: the source's values in the model's dtype."""
    name = f"{m.name}.weight"
    info = ckpt.tensors.get(name)
    want_dtype = model_dtype(src.config)
    if info is None or info.dtype != want_dtype or tuple(info.shape) != (m.n, m.k):
        got = f"{info.dtype} {list(info.shape)}" if info is not None else "missing"
        return [Mismatch(name, f"dequantized weight is {got}; want {want_dtype} [{m.n}, {m.k}]")]
    scale = read_tensor(src.root, m.scale) if m.scale is not None else None
    src_backend = BACKENDS[m.source_backend] if m.source_backend else None
    try:
        want = dequantized_module(
            m, read_tensor(src.root, m.weight), scale, src_backend, torch_dtype(want_dtype)
        )
    except ConvertError as e:
        return [Mismatch(m.name, f"source cannot be dequantized: {e}")]
    pos = first_difference(read_tensor(ckpt.root, info).view(torch.uint8), want.view(torch.uint8))
    if pos is None:
        return []
    return [Mismatch(name, "differs from the source's dequantized values", pos)]


def _output_names(module: str, ckpt: SourceCheckpoint) -> tuple[str, str, str] | None:
    w = f"{module}.weight"
    for suffix, layout in ((SWIZZLED_SUFFIX, "laid_out"), (CANONICAL_SUFFIX, "canonical")):
        if (
            f"{module}.{suffix}" in ckpt.tensors
            and w in ckpt.tensors
            and ckpt.tensors[w].dtype == "F8_E4M3"
        ):
            return w, f"{module}.{suffix}", layout
    return None


def _compare_module(m, ckpt, src, backend, names, recorded) -> list[Mismatch]:
    wname, sname, layout = names
    w_out = read_tensor(ckpt.root, ckpt.tensors[wname]).view(torch.uint8)
    s_out = read_tensor(ckpt.root, ckpt.tensors[sname]).view(torch.uint8)
    c = m.k // 32
    if layout == "laid_out":
        w_out, s_out = backend.weight_inverse(w_out), backend.scale_inverse(s_out, m.n, c)
    return _compare_canonical(m, w_out, s_out, src, recorded)


def _compare_canonical(m, w_out, s_out, src, recorded, expert: int | None = None) -> list[Mismatch]:
    """Compare an output module's canonical bytes with the source's (first differing
    ``[row, col]``, or ``[expert, row, col]`` for an expert of a fused MoE tensor)."""
    scale = read_tensor(src.root, m.scale) if m.scale is not None else None
    src_backend = BACKENDS[m.source_backend] if m.source_backend else None
    try:
        q, s, err = canonical_module(m, read_tensor(src.root, m.weight), scale, src_backend)
    except ConvertError as e:
        return [Mismatch(m.name, f"source cannot be converted: {e}")]
    out = []
    axes, lead = ("row, col", []) if expert is None else ("expert, row, col", [expert])
    for what, got, want in (("weight", w_out, q), ("scale", s_out, s)):
        pos = first_difference(
            got.reshape(want.shape) if got.numel() == want.numel() else got, want
        )
        if pos is not None:
            out.append(
                Mismatch(
                    f"{m.name}.{what}",
                    f"differs from the source's canonical MXFP8 ({axes})",
                    lead + pos,
                )
            )
    if err is not None:
        out.extend(_check_error(m, w_out, s_out, src, recorded, err))
    return out


def _compare_moe_layer(layer: MoELayerPlan, ckpt, src, errors: dict) -> list[Mismatch]:
    """Invert each expert's slice of the fused tensors and compare its three projections."""
    names = {role: layer.tensor_name(role) for role in MOE_TENSORS}
    missing = [n for n in names.values() if n not in ckpt.tensors]
    if missing:
        return [Mismatch(missing[0], "fused MoE tensor missing from the output")]
    out = []
    for e in range(layer.experts):
        got = _expert_canonical(ckpt, names, layer, e)
        for role, (w, s) in got.items():
            m = layer.module(role, e)
            out.extend(_compare_canonical(m, w, s, src, errors.get(m.name), expert=e))
    return out


def _expert_canonical(ckpt, names: dict[str, str], layer: MoELayerPlan, e: int) -> dict:
    """role -> canonical (weight, scale) of expert ``e``, read from the output's fused tensors."""
    h, i = layer.hidden, layer.intermediate

    def read(role: str) -> torch.Tensor:
        return read_tensor(ckpt.root, expert_slice(ckpt.tensors[names[role]], e)).view(torch.uint8)

    up, gate = moe_fc1_weight_to_canonical(read("moe_fc1_weight"))
    up_s, gate_s = moe_fc1_scale_to_canonical(read("moe_fc1_scale"), h, i)
    down = moe_fc2_weight_to_canonical(read("moe_fc2_weight"))
    down_s = moe_fc2_scale_to_canonical(read("moe_fc2_scale"), h, i)
    return {"gate": (gate, gate_s), "up": (up, up_s), "down": (down, down_s)}


def _check_error(m, q, s, src, recorded, err) -> list[Mismatch]:
    if recorded is None:
        return [Mismatch(m.name, "requantized, but no error recorded in the completion marker")]
    if m.source_kind == "dense":
        ref = dense_weight(m, read_tensor(src.root, m.weight))
        now = quantization_error(ref, q.view(torch.float8_e4m3fn), s)
    else:
        now = err
    have, want = now.to_dict()["rel_fro"], recorded.get("rel_fro", -1)  # null: not finite
    same = (
        have == want
        if None in (have, want)
        else math.isclose(have, want, rel_tol=1e-6, abs_tol=1e-12)
    )
    if not same:
        return [Mismatch(m.name, f"relative error {have} != recorded {want}")]
    return []
