"""read -> plan -> transform -> write, reporting progress through a callback."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mxfp8_convert import __version__
from mxfp8_convert.backends import BackendSpec, get_backend
from mxfp8_convert.errors import OutputError
from mxfp8_convert.formats import detect, get_format
from mxfp8_convert.plan import COMPLETE_MARKER, ConversionPlan, ShardPlan, TensorPlan, build_plan
from mxfp8_convert.read import INDEX_NAME, SourceCheckpoint, iter_chunks, open_checkpoint, read_tensor, resolve_model
from mxfp8_convert.transform import layout_scale, layout_weight_chunk, weight_granule
from mxfp8_convert.write import (
    ShardWriter,
    Staging,
    check_destination,
    copy_file,
    free_bytes,
    write_json,
)

CHUNK_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """One progress report: ``stage`` is reading, planning, transforming, writing or done."""

    stage: str
    shard: str | None = None
    tensor: str | None = None
    bytes_done: int = 0
    bytes_total: int = 0


ProgressCallback = Callable[[ProgressEvent], None]


@dataclass(frozen=True, slots=True)
class ConversionResult:
    """What ``convert()`` did. ``to_dict()`` is the ``--json`` document."""

    source: str
    output: str | None
    plan: ConversionPlan
    dry_run: bool
    seconds: float
    bytes_written: int

    def to_dict(self) -> dict:
        return {
            "tool_version": __version__,
            "source": self.source,
            "output": self.output,
            "backend": self.plan.backend,
            "format": self.plan.format,
            "dry_run": self.dry_run,
            "seconds": round(self.seconds, 3),
            "bytes_written": self.bytes_written,
            "plan": self.plan.to_dict(),
        }


def default_output(model: str, backend: str) -> Path:
    """``<model folder>-<backend>`` beside a local model, ``./<repo name>-<backend>`` for a Hub id."""
    local = Path(model).expanduser()
    if local.exists():
        return local.resolve().parent / f"{local.resolve().name}-{backend}"
    return Path.cwd() / f"{model.rstrip('/').split('/')[-1]}-{backend}"


def plan_conversion(
    model: str | Path,
    backend: str,
    *,
    source_format: str | None = None,
    on_ineligible: str = "error",
    ignore: list[str] | None = None,
    revision: str | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[SourceCheckpoint, ConversionPlan]:
    """Open the source and build the plan (headers only). See ``plan.build_plan``."""
    emit = progress or (lambda e: None)
    spec = get_backend(backend)
    emit(ProgressEvent("reading"))
    root = resolve_model(str(model), revision=revision)
    ckpt = open_checkpoint(root)
    emit(ProgressEvent("planning"))
    fmt = get_format(source_format) if source_format else detect(ckpt.config, ckpt.hf_quant_config, set(ckpt.tensors))
    return ckpt, build_plan(ckpt, spec, fmt, on_ineligible=on_ineligible, ignore=ignore)


def convert(
    model: str | Path,
    backend: str,
    output: str | Path | None = None,
    *,
    overwrite: bool = False,
    dry_run: bool = False,
    source_format: str | None = None,
    on_ineligible: str = "error",
    ignore: list[str] | None = None,
    revision: str | None = None,
    progress: ProgressCallback | None = None,
) -> ConversionResult:
    """Convert a checkpoint to the layout of ``backend``.

    Args:
        model: local folder or Hub repo id.
        backend: ``"trtllm"`` or ``"cutlass"``.
        output: destination folder (default: ``default_output(model, backend)``).
        overwrite: replace an existing destination.
        dry_run: build and return the plan, write nothing.
        source_format: override format detection (a name of ``formats.FORMATS``).
        on_ineligible: ``"error"`` or ``"keep"`` (leave tensors that fail the backend canonical).
        ignore: module-name patterns to leave untouched.
        revision: Hub revision (repo ids only).
        progress: callback receiving ``ProgressEvent``s.

    Returns:
        A ``ConversionResult``; the output folder exists only if the conversion completed.

    Raises:
        ConvertError: any problem with the source, format, layout or destination; nothing is
            left at the destination and the source is never modified.
    """
    t0 = time.perf_counter()
    ckpt, plan = plan_conversion(model, backend, source_format=source_format, on_ineligible=on_ineligible,
                                 ignore=ignore, revision=revision, progress=progress)
    dest = Path(output) if output is not None else default_output(str(model), backend)
    check_destination(dest, ckpt.root, overwrite=overwrite)
    if dry_run:
        return ConversionResult(str(ckpt.root), str(dest), plan, True, time.perf_counter() - t0, 0)
    need = plan.nbytes + sum(ckpt.path(f).stat().st_size for f in plan.copied_files)
    if free_bytes(dest.parent) < need:
        raise OutputError(f"{dest.parent}: {free_bytes(dest.parent)} bytes free, the output needs {need}",
                          hint="free disk space or choose another -o")
    staging = Staging(dest)
    try:
        written = _execute(ckpt, plan, get_backend(backend), staging.path, progress or (lambda e: None))
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    return ConversionResult(str(ckpt.root), str(dest), plan, False, time.perf_counter() - t0, written)


def _execute(ckpt: SourceCheckpoint, plan: ConversionPlan, backend: BackendSpec, out: Path,
             emit: ProgressCallback) -> int:
    files: dict[str, dict] = {}
    total = plan.nbytes
    done = 0
    for shard in plan.shards:
        size, digest, done = _write_shard(ckpt, plan, backend, shard, out, emit, done, total)
        files[shard.name] = {"size": size, "sha256": digest}
    emit(ProgressEvent("writing", bytes_done=done, bytes_total=total))
    for rel in plan.copied_files:
        size, digest = copy_file(ckpt.path(rel), out / rel)
        files[rel] = {"size": size, "sha256": digest}
    for rel, obj in _json_files(ckpt, plan).items():
        size, digest = write_json(out / rel, obj)
        files[rel] = {"size": size, "sha256": digest}
    write_json(out / COMPLETE_MARKER, {
        "format_version": plan.marker["format_version"],
        "backend": plan.backend,
        "tool_version": __version__,
        "source_fingerprint": plan.marker["source"]["fingerprint"],
        "files": dict(sorted(files.items())),
    })
    emit(ProgressEvent("done", bytes_done=total, bytes_total=total))
    return sum(f["size"] for f in files.values())


def _json_files(ckpt: SourceCheckpoint, plan: ConversionPlan) -> dict[str, dict]:
    config = dict(ckpt.config or {})
    config["quantization_config"] = plan.marker
    out = {"config.json": config}
    if plan.indexed or len(plan.shards) > 1:
        out[INDEX_NAME] = {
            "metadata": {"total_size": plan.nbytes, "mxfp8_convert": plan.marker},
            "weight_map": {t.name: s.name for s in plan.shards for t in s.tensors},
        }
    return out


def _shard_metadata(ckpt: SourceCheckpoint, plan: ConversionPlan, shard: ShardPlan) -> dict[str, str]:
    meta = dict(ckpt.shards[shard.name].metadata)
    meta.setdefault("format", "pt")
    meta["mxfp8_convert"] = json.dumps(plan.marker, sort_keys=True, separators=(",", ":"))
    records = {t.name: t.record() for t in shard.tensors if t.role != "passthrough"}
    meta["mxfp8_convert.tensors"] = json.dumps(records, sort_keys=True, separators=(",", ":"))
    return meta


def _write_shard(ckpt, plan, backend, shard: ShardPlan, out: Path, emit, done: int, total: int):
    entries = [(t.name, t.dtype, t.shape, t.nbytes) for t in shard.tensors]
    writer = ShardWriter(out / shard.name, entries, _shard_metadata(ckpt, plan, shard))
    try:
        for t in shard.tensors:
            for chunk in _produce(ckpt, backend, t):
                writer.write(chunk)
                done += chunk.numel()
                emit(ProgressEvent("transforming", shard.name, t.name, done, total))
        size, digest = writer.close()
    except BaseException:
        writer.abort()
        raise
    return size, digest, done


def _produce(ckpt: SourceCheckpoint, backend: BackendSpec, t: TensorPlan) -> Iterator[torch.Tensor]:
    """The output bytes of tensor ``t``, in chunks."""
    info = ckpt.tensors[t.source]
    if t.role == "weight_scale":
        s = read_tensor(ckpt.root, info)
        yield layout_scale(t, backend, s).reshape(-1)
        return
    for chunk in iter_chunks(ckpt.root, info, granule=weight_granule(t), chunk_bytes=CHUNK_BYTES):
        yield layout_weight_chunk(t, backend, chunk)
