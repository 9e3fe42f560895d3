"""read -> plan -> transform -> write, reporting progress through a callback."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mxfp8_convert import __version__
from mxfp8_convert._buffers import BufferPool
from mxfp8_convert.backends import BackendSpec, get_backend
from mxfp8_convert.dtypes import torch_dtype
from mxfp8_convert.errors import OutputError
from mxfp8_convert.formats import detect, get_format
from mxfp8_convert.plan import COMPLETE_MARKER, ConversionPlan, ShardPlan, TensorPlan, build_plan
from mxfp8_convert.read import (
    INDEX_NAME,
    ShardReader,
    SourceCheckpoint,
    chunk_ranges,
    open_checkpoint,
    resolve_model,
)
from mxfp8_convert.transform import layout_scale, layout_weight_chunk, weight_granule
from mxfp8_convert.write import (
    ShardWriter,
    Staging,
    check_destination,
    copy_file,
    free_bytes,
    fsync_paths,
    write_json,
)

CHUNK_BYTES = 32 << 20
#: chunks queued for the writer thread while the next one is read and laid out
PIPELINE_DEPTH = 2


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
        files[shard.name] = {"size": size, "xxh3_128": digest}
    emit(ProgressEvent("writing", bytes_done=done, bytes_total=total))
    for rel in plan.copied_files:
        size, digest = copy_file(ckpt.path(rel), out / rel)
        files[rel] = {"size": size, "xxh3_128": digest}
    for rel, obj in _json_files(ckpt, plan).items():
        size, digest = write_json(out / rel, obj)
        files[rel] = {"size": size, "xxh3_128": digest}
    fsync_paths([out / s.name for s in plan.shards])  # durable before the marker says "complete"
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
    writer = ShardWriter(out / shard.name, entries, _shard_metadata(ckpt, plan, shard), depth=PIPELINE_DEPTH)
    pool = BufferPool(CHUNK_BYTES, PIPELINE_DEPTH + 2)  # queued + in hand
    readers: dict[str, ShardReader] = {}
    try:
        for t in shard.tensors:
            info = ckpt.tensors[t.source]
            if info.file not in readers:
                readers[info.file] = ShardReader(ckpt.root, info.file, ckpt.shards[info.file].size)
            for n in _produce(readers[info.file], backend, t, info, writer, pool):
                done += n
                emit(ProgressEvent("transforming", shard.name, t.name, done, total))
        size, digest = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        for r in readers.values():
            r.close()
    return size, digest, done


def _produce(reader: ShardReader, backend: BackendSpec, t: TensorPlan, info, writer: ShardWriter,
             pool: BufferPool) -> Iterator[int]:
    """Queue the output bytes of tensor ``t`` on ``writer``; yield the byte count of each piece.

    Bytes that do not change are copied in the kernel (copy_file_range, as cp does); a P32
    weight is shuffled chunk by chunk from the source's page cache into a pooled buffer.
    """
    if t.role == "weight_scale":
        s = reader.view(info.begin, info.nbytes).view(torch_dtype(info.dtype)).reshape(info.shape)
        laid = layout_scale(t, backend, s)
        if laid.data_ptr() == s.data_ptr():  # kept canonical: same bytes
            writer.copy(reader.fd, info.begin, s.reshape(-1).view(torch.uint8))
        else:
            writer.write(laid.reshape(-1))
        yield info.nbytes
        return
    granule = weight_granule(t)
    for begin, n in chunk_ranges(info, granule=granule, chunk_bytes=CHUNK_BYTES):
        src = reader.view(begin, n)
        if granule == 1:
            writer.copy(reader.fd, begin, src, lambda _, b=begin, m=n: reader.drop(b, m))
        else:
            laid = layout_weight_chunk(t, backend, src, pool.get(n))
            reader.drop(begin, n)
            writer.write(laid, pool.release)
        yield n
