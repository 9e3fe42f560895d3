"""read -> plan -> transform -> write, reporting progress through a callback."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from mxfp8_convert._buffers import BufferPool
from mxfp8_convert._lazy import torch, torch_loaded
from mxfp8_convert._version import __version__
from mxfp8_convert.backends import BACKENDS, BackendSpec, get_backend
from mxfp8_convert.dtypes import torch_dtype
from mxfp8_convert.errors import ConvertError, DiskFullError, LayoutError, OutputError
from mxfp8_convert.format import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    LAYOUTS,
    META_MARKER,
    META_TENSORS,
    Completion,
    FileRecord,
    file_record,
    is_marker,
)
from mxfp8_convert.formats import detect_source
from mxfp8_convert.layouts import p32_row_order, p32_shuffle_rows_array
from mxfp8_convert.layouts.rows import P32_BLOCK
from mxfp8_convert.plan import (
    ConversionPlan,
    ModulePlan,
    MoELayerPlan,
    ShardPlan,
    TensorPlan,
    build_plan,
)
from mxfp8_convert.publish import CARD_NAME, write_model_card
from mxfp8_convert.read import (
    ShardReader,
    SourceCheckpoint,
    check_source_unchanged,
    chunk_ranges,
    find_bytes,
    hub_blob_sha256,
    open_checkpoint,
    open_source_file,
    resolve_model,
    watch_source,
)
from mxfp8_convert.transform import (
    MOE_FUSE,
    canonical_module,
    check_scale_codes,
    dequantized_module,
    fuse_expert,
    layout_scale,
    layout_weight_chunk,
    weight_granule,
)
from mxfp8_convert.write import (
    ShardWriter,
    Staging,
    check_destination,
    copy_file,
    finished_bytes,
    free_bytes,
    fsync_paths,
    write_json,
)

CHUNK_BYTES = 32 << 20
E4M3_NAN_BYTES = bytes([0x7F, 0xFF])
#: P32 rows at least this long are written straight from the source mapping by vectored writes
#: (ShardWriter.copy_rows) rather than shuffled in memory and written (BENCHMARKS.md)
ROW_COPY_MIN_BYTES = 8192
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
    quantization_errors: dict = field(default_factory=dict)  # module -> {action, rel_fro, sqnr_db}
    part: tuple[int, int] | None = None  # job-array part this run converted, if any

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
            "quantization_errors": self.quantization_errors,
            "part": list(self.part) if self.part else None,
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
    moe: str = "fuse",
    quantize_towers: bool = False,
    allow_no_quantized: bool = False,
    progress: ProgressCallback | None = None,
) -> tuple[SourceCheckpoint, ConversionPlan]:
    """Open the source and build the plan (headers only). See ``plan.build_plan``."""
    emit = progress or (lambda e: None)
    spec = get_backend(backend)
    emit(ProgressEvent("reading"))
    root = resolve_model(str(model), revision=revision)
    ckpt = open_checkpoint(root)
    emit(ProgressEvent("planning"))
    fmt = detect_source(ckpt.config, ckpt.quant_files, ckpt.tensors, source_format)
    return ckpt, build_plan(ckpt, spec, fmt, on_ineligible=on_ineligible, ignore=ignore, moe=moe,
                            quantize_towers=quantize_towers, allow_no_quantized=allow_no_quantized)


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
    fresh: bool = False,
    hub_repo_id: str | None = None,
    part: tuple[int, int] | None = None,
    workers: int = 1,
    max_memory: int | None = None,
    moe: str = "fuse",
    quantize_towers: bool = False,
    allow_no_quantized: bool = False,
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
        fresh: discard an interrupted earlier run's work instead of resuming it.
        hub_repo_id: where the output will be published, named in its model card (README.md).
        part: ``(i, n)``: convert only part ``i`` of ``n`` (shards ``j`` with ``j % n == i``) into
            the shared work folder; ``finalize(output)`` completes the output once all parts ran.
        workers: shards converted in parallel.
        max_memory: bytes the workers may use together (fewer workers run if needed).
        moe: ``"fuse"`` (default): per-expert MoE weights (``...experts.<e>.{gate,up,down}_proj``
            or ``w1/w3/w2``) become the fused MoE kernel's ``[E, 2I, H]`` / ``[E, H, I]`` tensors
            for trtllm, and linears like any other for other backends; ``"keep"``: they stay
            per-expert canonical MXFP8.
        quantize_towers: dense sources: also quantize the linear layers outside the language
            model (vision/audio towers, projectors, task heads); by default they are kept.
        allow_no_quantized: write a plain copy when no module would be converted (else that
            is an error).
        progress: callback receiving ``ProgressEvent``s.

    Returns:
        A ``ConversionResult``; the output folder exists only if the conversion completed.
        An interrupted run leaves ``.NAME.mxfp8-partial`` beside it; running the same
        conversion again resumes from the files it finished.

    Raises:
        ConvertError: any problem with the source, format, layout or destination; nothing is
            left at the destination and the source is never modified.
    """
    t0 = time.perf_counter()
    ckpt, plan = plan_conversion(model, backend, source_format=source_format, on_ineligible=on_ineligible,
                                 ignore=ignore, revision=revision, moe=moe,
                                 quantize_towers=quantize_towers,
                                 allow_no_quantized=allow_no_quantized, progress=progress)
    dest = Path(output) if output is not None else default_output(str(model), backend)
    # an existing output: a real run checks under the lock; a dry run writes nothing (it is noted)
    check_destination(dest, ckpt.root, overwrite=overwrite, part=None if part is None else part[0],
                      exists=False)
    if dry_run:
        return ConversionResult(str(ckpt.root), str(dest), plan, True, time.perf_counter() - t0, 0)
    params = {"source_fingerprint": plan.fingerprint, "backend": backend, "format": plan.format,
              "on_ineligible": on_ineligible, "ignore": sorted(ignore or []), "tool_version": __version__,
              "format_version": FORMAT_VERSION, "moe": moe, "quantize_towers": quantize_towers,
              "allow_no_quantized": allow_no_quantized}
    shards = list(plan.shards)
    if part is not None:
        i, n = _check_part(part)
        params["num_parts"] = n
        shards = [s for j, s in enumerate(plan.shards) if j % n == i]  # round robin over sorted shards
    modes = _Modes.of(ckpt, plan)
    # parts record the source resolved, so `finalize` finds it from any working directory
    staging = Staging(dest, params, fresh=fresh, part=part, source=os.path.abspath(ckpt.root),
                      owned={s.name for s in shards} if part is not None else None,
                      overwrite=overwrite, writes=output_names(ckpt, plan), dir_mode=modes.folder)
    try:
        _check_free_space(dest, ckpt, plan, shards if part is not None else None, staging)
    except BaseException:
        staging.suspend() if staging.files else staging.abort()
        raise
    executor = _Executor(ckpt, plan, get_backend(backend), staging, progress or (lambda e: None),
                         hub_repo_id, modes)
    try:
        n_workers = _workers(plan, workers, max_memory)
        if _computes(plan):
            import torch  # noqa: F401 - now, so that _compute_threads can set its threads
        with _compute_threads(n_workers), watch_source():
            files = executor.write_shards(shards, workers=n_workers)
        if part is not None:
            staging.suspend()  # `finalize` gathers the parts
            written = sum(f["size"] for f in files.values())
            return ConversionResult(str(ckpt.root), None, plan, False, time.perf_counter() - t0, written,
                                    dict(sorted(executor.errors.items())), part=part)
        written = executor.finish(files)
        staging.commit()
    except DiskFullError as e:
        _suspend_full(staging, e)
        raise
    except ConvertError:
        staging.abort()  # bad input or output: nothing worth resuming
        raise
    except BaseException as e:
        staging.suspend()  # interrupted: the next run with the same parameters resumes
        _note_if_complete(staging, e)
        raise
    return ConversionResult(str(ckpt.root), str(dest), plan, False, time.perf_counter() - t0, written,
                            dict(sorted(executor.errors.items())))


def _suspend_full(staging: Staging, e: DiskFullError) -> None:
    """The disk filled up: keep what is finished for a resume (a work folder with nothing
    finished is removed, as after any other failure)."""
    if not staging.files:
        staging.abort()
        return
    staging.discard_unfinished()  # e.g. the side files: cheap to redo, and not listed
    staging.suspend()
    e.hint = (f"free disk space and rerun the same command: it resumes, keeping the "
              f"{len(staging.files)} finished file(s) in {staging.path}")


def _check_free_space(dest: Path, ckpt: SourceCheckpoint, plan: ConversionPlan,
                      shards: list[ShardPlan] | None, staging: Staging) -> None:
    """Room for what is left to write: the files an interrupted run finished count as written."""
    if shards is None:
        need = plan.nbytes + sum(ckpt.path(f).stat().st_size for f in plan.copied_files) + (1 << 20)
    else:  # a part writes its shards only
        need = sum(s.nbytes for s in shards) + (1 << 20)
    need -= finished_bytes(staging)
    free = free_bytes(dest.parent)
    if free < need:
        raise DiskFullError(f"{dest.parent}: {free} bytes free, the output needs {need} more",
                            hint="free disk space or choose another -o")


def output_names(ckpt: SourceCheckpoint, plan: ConversionPlan) -> set[str]:
    """Every file a conversion of ``plan`` writes into its work folder (relative names)."""
    return ({s.name for s in plan.shards} | set(plan.copied_files) | set(_json_files(ckpt, plan))
            | {CARD_NAME, COMPLETE_MARKER})


@dataclass(frozen=True, slots=True)
class _Modes:
    """Permission bits of what we write: at most 0644 / 0755 and never wider than the source
    (a shard's mode is capped by its source shard's, a copied file's by its source's; the
    files we generate and the folder by the source's shards, config and folder together)."""

    shards: dict[str, int]  # output shard -> mode
    generated: int
    folder: int

    @classmethod
    def of(cls, ckpt: SourceCheckpoint, plan: ConversionPlan) -> _Modes:
        def mode(rel: str | None) -> int:
            try:
                return stat.S_IMODE(os.stat(ckpt.root if rel is None else ckpt.path(rel)).st_mode)
            except OSError:
                return 0o644
        per_file = {name: mode(name) & 0o644 for name in ckpt.shards}
        generated = 0o644
        config = mode(CONFIG_FILE) if (ckpt.root / CONFIG_FILE).exists() else 0o644
        for m in (*per_file.values(), config):
            generated &= m
        shards = {}
        for shard in plan.shards:
            m = per_file.get(shard.name, generated)
            for t in shard.tensors:
                info = ckpt.tensors.get(t.source)
                m &= per_file.get(info.file, 0o644) if info is not None else 0o644
            shards[shard.name] = m
        return cls(shards, generated, 0o755 & mode(None) & (generated | 0o111))


def _check_part(part: tuple[int, int]) -> tuple[int, int]:
    i, n = part
    if n < 1 or not 0 <= i < n:
        raise ConvertError(f"--part {i} is not in 0..{n - 1} for --num-parts {n}")
    return i, n


@contextmanager
def _compute_threads(workers: int) -> Iterator[None]:
    """Leave a core to each worker's writer thread while the shards are written.

    torch's OpenMP pool waits for all of its threads at the end of every parallel op; a writer
    thread busy hashing and writing keeps one of them off its core, so on small machines every
    op stalls (2 cores: the MXFP8 and dense conversions ran 1.5x and 3x slower, a fused MoE 4x).
    The setting is process-wide, restored on return. Conversions that only move bytes never
    import torch, and leave it alone.
    """
    if not torch_loaded():
        yield
        return
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, min(before, cores - workers)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _computes(plan: ConversionPlan) -> bool:
    """Whether converting ``plan`` computes on tensors (torch), rather than only moving bytes
    (with mmap and numpy): computed modules and fused MoE layers."""
    return bool(plan.moe) or any(_computed(m) for m in plan.modules)


#: memory one worker needs beyond its largest in-memory module: its buffer pool and queue
WORKER_BASE_BYTES = (2 * PIPELINE_DEPTH + 2) * CHUNK_BYTES


def _workers(plan: ConversionPlan, workers: int, max_memory: int | None) -> int:
    """Workers to run: at most ``workers``, as many as ``max_memory`` bytes allow, at most one
    per shard. A worker holds its buffers and, for modules computed whole (FP8, dense,
    laid-out sources), one module's canonical bytes (about 1.1 bytes per weight element, plus
    float32 working chunks)."""
    if workers < 1:
        raise ConvertError(f"--workers must be at least 1, got {workers}")
    modules = (*plan.modules, *(m for layer in plan.moe for m in layer.modules))
    whole = [m.n * m.k * 2 for m in modules if m.action != "relayout" and m.action != "keep"
             or m.source_backend is not None]
    per_worker = WORKER_BASE_BYTES + max(whole, default=0)
    if max_memory is not None:
        if max_memory < per_worker:
            raise ConvertError(f"--max-memory {max_memory} bytes is below what one worker needs ({per_worker})",
                               hint=f"allow at least {per_worker // 2**20 + 1} MiB")
        workers = min(workers, max_memory // per_worker)
    return max(1, min(workers, len(plan.shards)))


def finalize(output: str | Path, *, source: str | Path | None = None, hub_repo_id: str | None = None,
             progress: ProgressCallback | None = None) -> ConversionResult:
    """Gather the parts of a split conversion (``--num-parts N --part I``) into the output.

    Checks that every part ran with the same parameters and that every shard it wrote still
    verifies, then writes the index, config, model card and completion marker, and renames the
    work folder into place. Safe to rerun.

    Args:
        output: the destination the parts were converted to.
        source: the source checkpoint, if not at the path the parts recorded.
        hub_repo_id: where the output will be published (named in its model card).
        progress: callback receiving ``ProgressEvent``s.

    Raises:
        OutputError: a part missing, unfinished, still running, or made with other parameters.
    """
    t0 = time.perf_counter()
    dest = Path(output)
    staging, _ = Staging.finalizing(dest)
    try:
        p = staging.params
        ckpt, plan = plan_conversion(str(source or staging.source), p["backend"], source_format=p["format"],
                                     on_ineligible=p["on_ineligible"], ignore=p["ignore"],
                                     moe=p.get("moe", "fuse"),
                                     quantize_towers=p.get("quantize_towers", False),
                                     allow_no_quantized=p.get("allow_no_quantized", False))
        if plan.fingerprint != p["source_fingerprint"]:
            raise OutputError(f"{ckpt.root}: not the source the parts were converted from (fingerprint differs)")
        missing = [s.name for s in plan.shards if s.name not in staging.files]
        if missing:
            i = plan.shards.index(next(s for s in plan.shards if s.name == missing[0])) % p["num_parts"]
            raise OutputError(f"{dest}: shard {missing[0]} (part {i} of {p['num_parts']}) is not finished",
                              hint="rerun that part; it resumes")
        executor = _Executor(ckpt, plan, get_backend(p["backend"]), staging, progress or (lambda e: None), hub_repo_id)
        files = {}
        for j, s in enumerate(plan.shards):
            rec = staging.files[s.name]
            if not executor.source_unchanged(s, rec):
                raise OutputError(f"{dest}: the source bytes behind shard {s.name} (part {j % p['num_parts']} of "
                                  f"{p['num_parts']}) are not those it was converted from",
                                  hint="rerun that part; it redoes the shard")
            executor.errors.update(rec.get("errors") or {})
            files[s.name] = {"size": rec["size"], "xxh3_128": rec["xxh3_128"]}
        written = executor.finish(files)
        staging.commit()
    except BaseException as e:
        staging.suspend()
        _note_if_complete(staging, e)
        raise
    return ConversionResult(str(ckpt.root), str(dest), plan, False, time.perf_counter() - t0, written,
                            dict(sorted(executor.errors.items())))


def _note_if_complete(staging: Staging, e: BaseException) -> None:
    """An interrupt that came during the final rename is acted on once it is done: say the
    output is complete rather than that a rerun would resume."""
    if staging.committed and not isinstance(e, ConvertError):
        e.hint = f"the output was already complete: {staging.dest}"


class _Executor:
    """Runs a plan: writes every shard, copies side files, writes configs and the marker."""

    def __init__(self, ckpt: SourceCheckpoint, plan: ConversionPlan, backend: BackendSpec,
                 staging: Staging, emit: ProgressCallback, hub_repo_id: str | None = None,
                 modes: _Modes | None = None) -> None:
        self.ckpt, self.plan, self.backend, self.emit = ckpt, plan, backend, emit
        self.modes = modes or _Modes.of(ckpt, plan)
        self.hub_repo_id = hub_repo_id
        self.staging, self.out = staging, staging.path
        self.modules = {m.name: m for m in plan.modules}
        self.moe = {layer.name: layer for layer in plan.moe}
        self.errors: dict[str, dict] = {}
        self.done = 0
        self._lock = threading.Lock()
        self._local = threading.local()  # per worker: readers, buffer pool, modules in flight

    def write_shards(self, shards: list[ShardPlan], *, workers: int = 1) -> dict[str, dict]:
        """Write ``shards`` (``workers`` at a time), keeping any an interrupted run finished."""
        def one(shard: ShardPlan) -> tuple[str, dict]:
            rec = self.staging.finished(shard.name)
            if rec is None or rec.get("errors") is None or not self.source_unchanged(shard, rec):
                rec = self._write_shard(shard)
                rec["errors"] = self._shard_errors(shard)
                with self._lock:
                    self.staging.record(shard.name, rec)
            else:  # finished by an interrupted earlier run, and still intact
                self.errors.update(rec["errors"])
                self._advance(shard.nbytes, shard.name, None)
            return shard.name, {"size": rec["size"], "xxh3_128": rec["xxh3_128"]}

        if workers <= 1:
            return dict(one(s) for s in shards)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mxfp8-shard") as pool:
            return dict(pool.map(one, shards))

    def finish(self, files: dict[str, dict]) -> int:
        """Copy side files, write configs, model card and, last, the completion marker."""
        files = dict(files)
        self.emit(ProgressEvent("writing", bytes_done=self.done, bytes_total=self.plan.nbytes))
        for rel in self.plan.copied_files:
            src, st = open_source_file(self.ckpt.root, rel)  # checked now, as it is opened
            with src:
                mode = stat.S_IMODE(st.st_mode)
                files[rel] = file_record(*copy_file(src, self.out / rel, mode=mode))
        for rel, obj in _json_files(self.ckpt, self.plan).items():
            files[rel] = file_record(*write_json(self.out / rel, obj, mode=self.modes.generated))
        files[CARD_NAME] = file_record(*write_model_card(  # replaces the copied source README
            self.out, self.ckpt.root, repo_id=self.hub_repo_id,
            completion=self.completion_record({}), mode=self.modes.generated))
        fsync_paths([self.out / s.name for s in self.plan.shards])  # durable before "complete"
        write_json(self.out / COMPLETE_MARKER, self.completion_record(files),
                   mode=self.modes.generated)
        self.emit(ProgressEvent("done", bytes_done=self.plan.nbytes, bytes_total=self.plan.nbytes))
        return sum(f["size"] for f in files.values())

    def source_unchanged(self, shard: ShardPlan, rec: dict) -> bool:
        """Whether the source bytes behind ``shard`` are those its record was made from.

        Hub snapshot files are named by the Hub's own SHA-256 of their bytes: where every
        source file of the shard is one, those names are compared and nothing is read. Else
        each source tensor is hashed again (xxh3, at memory speed: far cheaper than redoing
        the shard) and the digest compared with the one recorded while it was converted.
        """
        source = rec.get("source")
        if not isinstance(source, dict) or not isinstance(source.get("xxh3_128"), str):
            return False  # recorded by a version that did not hash its source: redo
        blobs = self._blobs(shard)
        if None not in blobs.values() and blobs == source.get("hub_blobs"):
            return True
        return _combine(self._hash_sources(shard)) == source["xxh3_128"]

    def _blobs(self, shard: ShardPlan) -> dict[str, str | None]:
        files = sorted({info.file for info in _sources(self.ckpt.tensors, shard, self.modules, self.moe)})
        return {f: hub_blob_sha256(self.ckpt.root, f) for f in files}

    def _hash_sources(self, shard: ShardPlan) -> dict[str, str]:
        out = {}
        readers: dict[str, ShardReader] = {}
        try:
            for info in _sources(self.ckpt.tensors, shard, self.modules, self.moe):
                if info.file not in readers:
                    readers[info.file] = ShardReader(self.ckpt.root, info.file, self.ckpt.shards[info.file].size)
                out[_source_key(info)] = xxhash.xxh3_64(readers[info.file].bytes(info.begin, info.nbytes)).hexdigest()
        finally:
            for r in readers.values():
                r.close()
        return out

    def _source_hasher(self, info):
        """A new hasher for source tensor ``info``'s bytes, or None if they are hashed already."""
        key = _source_key(info)
        if key in self._local.hashes:
            return None
        h = self._local.hashes[key] = xxhash.xxh3_64()
        return h

    def _hash_whole(self, info) -> None:
        """Hash source tensor ``info`` in one go (tensors read whole: scales, computed modules)."""
        h = self._source_hasher(info)
        if h is not None:
            h.update(self.reader(info).bytes(info.begin, info.nbytes))

    def _advance(self, n: int, shard: str, tensor: str | None) -> None:
        check_source_unchanged()  # workers stop too when another process changes a source shard
        with self._lock:
            self.done += n
            done = self.done
        self.emit(ProgressEvent("transforming", shard, tensor, done, self.plan.nbytes))

    def _shard_errors(self, shard: ShardPlan) -> dict:
        modules = {t.module for t in shard.tensors if t.module}
        modules |= {m.name for name in modules & self.moe.keys() for m in self.moe[name].modules}
        return {m: e for m, e in self.errors.items() if m in modules}

    def completion_record(self, files: dict[str, dict]) -> dict:
        return Completion(
            backend=self.plan.backend, tool_version=__version__,
            source_fingerprint=self.plan.fingerprint, source_format=self.plan.format,
            quantize_towers=self.plan.quantize_towers,
            quantization_errors=dict(sorted(self.errors.items())),
            files={rel: FileRecord(**rec) for rel, rec in sorted(files.items())},
        ).to_dict()

    def reader(self, info) -> ShardReader:
        if info.file not in self.readers:
            self.readers[info.file] = ShardReader(self.ckpt.root, info.file, self.ckpt.shards[info.file].size)
        return self.readers[info.file]

    def source(self, info) -> torch.Tensor:
        """Zero-copy view of a source tensor in its own dtype and shape."""
        return self.reader(info).view(info.begin, info.nbytes).view(torch_dtype(info.dtype)).reshape(info.shape)

    @property
    def readers(self) -> dict[str, ShardReader]:
        return self._local.readers

    @property
    def pool(self) -> BufferPool:
        return self._local.pool

    @property
    def pending(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return self._local.pending  # module -> canonical (q, s), until both tensors are written

    def _write_shard(self, shard: ShardPlan) -> dict:
        entries = [(t.name, t.dtype, t.shape, t.nbytes) for t in shard.tensors]
        self._local.readers, self._local.pending, self._local.hashes = {}, {}, {}
        self._local.pool = BufferPool(CHUNK_BYTES, PIPELINE_DEPTH + 2)  # queued + in hand
        blobs = self._blobs(shard)
        writer = ShardWriter(self.out / shard.name, entries, _shard_metadata(self.ckpt, self.plan, shard),
                             depth=PIPELINE_DEPTH,
                             mode=self.modes.shards.get(shard.name, self.modes.generated))
        try:
            for t in shard.tensors:
                for n in self._produce(t, writer):
                    self._advance(n, shard.name, t.name)
            rec = file_record(*writer.close())
            source = {"xxh3_128": _combine({k: h.hexdigest() for k, h in self._local.hashes.items()})}
            if None not in blobs.values():
                source["hub_blobs"] = blobs
            return {**rec, "source": source}
        except BaseException:
            writer.abort()
            raise
        finally:
            for r in self.readers.values():
                r.close()
            self._local.readers, self._local.pending = {}, {}

    def _produce(self, t: TensorPlan, writer: ShardWriter) -> Iterator[int]:
        """Queue the output bytes of tensor ``t`` on ``writer``; yield the size of each piece."""
        m = self.modules.get(t.module) if t.module else None
        if t.module in self.moe:
            yield from self._fused(t, self.moe[t.module], writer)
        elif m is None:
            yield from self._copy(self.ckpt.tensors[t.source], writer, check_nan=False)
        elif m.action == "dequantize":
            yield from self._dequantized(t, m, writer)
        elif m.action in ("relayout", "keep") and m.source_backend is None:
            yield from self._stream_mxfp8(t, m, writer)
        else:
            yield from self._from_canonical(t, m, writer)

    @staticmethod
    def _check_nan(reader: ShardReader, info, begin: int, n: int) -> None:
        """e4m3 NaN is 0x7F or 0xFF: refuse it, naming the tensor and the [row, col]."""
        _nan_scan(info, begin)(reader.bytes(begin, n), 0)

    def _copy(self, info, writer: ShardWriter, *, check_nan: bool) -> Iterator[int]:
        """Unchanged bytes: written straight from the source mapping, checked (``check_nan``)
        and hashed in the writer's one pass over each piece.

        Not copy_file_range (what cp does): with the writer's early writeback (ShardWriter), the
        kernel copy ran ~1 s slower over 4.33 GB than writes from the mapping (BENCHMARKS.md).
        """
        reader = self.reader(info)
        source = self._source_hasher(info)
        for begin, n in chunk_ranges(info, granule=1, chunk_bytes=CHUNK_BYTES):
            writer.write(reader.bytes(begin, n), lambda _, b=begin, k=n: reader.drop(b, k),
                         scan=_nan_scan(info, begin) if check_nan else None, source=source)
            yield n

    def _stream_mxfp8(self, t: TensorPlan, m: ModulePlan, writer: ShardWriter) -> Iterator[int]:
        """Canonical MXFP8 source: the weight streams chunk by chunk, never whole in memory."""
        info = self.ckpt.tensors[t.source]
        if t.role == "weight_scale":  # numpy: moving MXFP8 bytes never imports torch
            self._hash_whole(info)
            s = np.frombuffer(self.reader(info).bytes(info.begin, info.nbytes), dtype=np.uint8).reshape(info.shape)
            check_scale_codes(s, info.name)
            laid = layout_scale(t, self.backend, s)
            if laid is s:  # kept canonical: same bytes
                yield from self._copy(info, writer, check_nan=False)
                return
            writer.write(laid.reshape(-1))
            yield info.nbytes
            return
        granule = weight_granule(t)
        if granule == 1:
            yield from self._copy(info, writer, check_nan=True)
            return
        reader = self.reader(info)
        source = self._source_hasher(info)
        row_bytes = t.shape[1]
        for begin, n in chunk_ranges(info, granule=granule, chunk_bytes=CHUNK_BYTES):
            if t.layout == LAYOUTS["trtllm"].weight and row_bytes >= ROW_COPY_MIN_BYTES:
                order = p32_row_order(n // row_bytes)  # output row p <- source row order[p]
                writer.copy_rows(row_bytes, order, reader.bytes(begin, n), lambda _, b=begin, k=n: reader.drop(b, k),
                                 group=P32_BLOCK, scan=_nan_scan(info, begin), source=source)
            else:  # narrow rows: checked, hashed and shuffled in memory, with numpy (no torch)
                self._check_nan(reader, info, begin, n)
                if source is not None:
                    source.update(reader.bytes(begin, n))
                rows = np.frombuffer(reader.bytes(begin, n), dtype=np.uint8).reshape(-1, row_bytes)
                laid = p32_shuffle_rows_array(rows, self.pool.get(n))
                del rows
                reader.drop(begin, n)
                writer.write(laid, self.pool.release)
            yield n

    def _canonical(self, m: ModulePlan) -> tuple[torch.Tensor, torch.Tensor]:
        if m.name not in self.pending:
            for info in (m.weight, m.scale):
                if info is not None:
                    self._hash_whole(info)
            scale = self.source(m.scale) if m.scale is not None else None
            src = BACKENDS[m.source_backend] if m.source_backend else None
            q, s, err = canonical_module(m, self.source(m.weight), scale, src)
            if err is not None:
                self.errors[m.name] = {"action": m.action, **err.to_dict()}
            self.pending[m.name] = (q, s)
        return self.pending[m.name]

    def _from_canonical(self, t: TensorPlan, m: ModulePlan, writer: ShardWriter) -> Iterator[int]:
        """Sources whose canonical bytes must be computed first (laid out, FP8, dense): one
        module at a time in memory, released once both of its tensors are written."""
        q, s = self._canonical(m)
        if t.role == "weight_scale":
            writer.write(layout_scale(t, self.backend, s).reshape(-1))
            self.pending.pop(m.name)
            self._drop(m)
            yield t.nbytes
            return
        flat = q.reshape(-1)
        granule = weight_granule(t)
        step = max(granule, CHUNK_BYTES // granule * granule)
        for begin in range(0, flat.numel(), step):
            chunk = flat[begin:begin + step]
            if granule == 1:  # bytes unchanged: write the canonical tensor as it is
                writer.write(chunk)
            else:
                buf = self.pool.get(chunk.numel())
                writer.write(layout_weight_chunk(t, self.backend, chunk, torch.from_numpy(buf)),
                             lambda _, b=buf: self.pool.release(b))
            yield chunk.numel()

    def _dequantized(self, t: TensorPlan, m: ModulePlan, writer: ShardWriter) -> Iterator[int]:
        """An ignored (or unfit) module of a quantized source, in the model's dtype."""
        scale = self.source(m.scale) if m.scale is not None else None
        src = BACKENDS[m.source_backend] if m.source_backend else None
        out = dequantized_module(m, self.source(m.weight), scale, src, torch_dtype(t.dtype))
        writer.write(out.reshape(-1).view(torch.uint8))
        self._drop(m)
        yield t.nbytes

    def _drop(self, m: ModulePlan) -> None:
        """Done with a module's source bytes: let their pages leave the resident set."""
        for info in (m.weight, m.scale):
            if info is not None:
                self.reader(info).drop(info.begin, info.nbytes)

    def _fused(self, t: TensorPlan, layer: MoELayerPlan, writer: ShardWriter) -> Iterator[int]:
        """A fused MoE tensor, produced expert by expert (it is contiguous per expert).

        Only one expert's canonical weights are in memory at a time. Canonical scales are
        taken again for the scale tensors that follow the weights; sources whose canonical
        bytes are computed (FP8, dense, laid out) keep them from the weight pass instead, which
        is at most one layer's scales (1/32 of its weights).
        """
        projs, _ = MOE_FUSE[t.role]
        take = self._expert_weight if t.role.endswith("_weight") else self._expert_scale
        for e in range(layer.experts):
            modules = [layer.module(p, e) for p in projs]
            out = fuse_expert(t.role, [take(m) for m in modules])
            for m in modules:  # read: the fused bytes are a new tensor
                self._drop(m)
            writer.write(out)
            yield out.numel()
            del out  # the writer holds it until written

    def _expert_weight(self, m: ModulePlan) -> torch.Tensor:
        q, s = self._canonical(m)
        if _computed(m):
            self.pending[m.name] = (None, s)  # its scale, for the scale tensor
        else:
            self.pending.pop(m.name)
            self._check_nan(self.reader(m.weight), m.weight, m.weight.begin, m.weight.nbytes)
        return q.reshape(m.n, m.k)

    def _expert_scale(self, m: ModulePlan) -> torch.Tensor:
        _, s = self._canonical(m)
        self.pending.pop(m.name)
        return s


def _nan_scan(info, begin: int):
    """``ShardWriter`` scan of e4m3 bytes of ``info`` that start at absolute offset ``begin``:
    e4m3 NaN is 0x7F or 0xFF; refuse it, naming the tensor and the [row, col]."""
    def scan(piece, at: int) -> None:
        hit = find_bytes(piece, E4M3_NAN_BYTES)
        if hit >= 0:
            row, col = divmod(begin + at + hit - info.begin, info.shape[-1])
            raise LayoutError(f"{info.file}: weight {info.name!r} holds NaN (e4m3 byte 0x7F/0xFF) at [{row}, {col}]")
    return scan


def _source_key(info) -> str:
    return f"{info.file}\0{info.begin}\0{info.nbytes}\0{info.name}"


def _combine(hashes: dict[str, str]) -> str:
    """One digest of the source tensors behind a shard: xxh3_128 of their sorted (key, xxh3_64)."""
    h = xxhash.xxh3_128()
    for key in sorted(hashes):
        h.update(f"{key}\0{hashes[key]}\n".encode())
    return h.hexdigest()


def _sources(tensors: dict, shard: ShardPlan, modules: dict[str, ModulePlan],
             moe: dict[str, MoELayerPlan]) -> list:
    """The source tensors whose bytes make up output ``shard`` (each belongs to one shard)."""
    out: dict[str, object] = {}
    for t in shard.tensors:
        if t.module in moe:
            infos = [i for m in moe[t.module].modules for i in (m.weight, m.scale)]
        elif t.module in modules:
            infos = [modules[t.module].weight, modules[t.module].scale]
        else:
            infos = [tensors[t.source]]
        for info in infos:
            if info is not None:
                out.setdefault(_source_key(info), info)
    return list(out.values())


def _computed(m: ModulePlan) -> bool:
    """Whether a module's canonical bytes are computed (not views of the source's own bytes)."""
    return m.action not in ("relayout", "keep") or m.source_backend is not None


def _json_files(ckpt: SourceCheckpoint, plan: ConversionPlan) -> dict[str, dict]:
    config = dict(ckpt.config or {})
    config["quantization_config"] = plan.marker
    out = {CONFIG_FILE: config}
    if plan.indexed or len(plan.shards) > 1:
        meta = {"total_size": plan.nbytes}
        if is_marker(plan.marker):
            meta[META_MARKER] = plan.marker
        out[INDEX_FILE] = {"metadata": meta, "weight_map": {t.name: s.name for s in plan.shards for t in s.tensors}}
    return out


def _shard_metadata(ckpt: SourceCheckpoint, plan: ConversionPlan, shard: ShardPlan) -> dict[str, str]:
    meta = {k: v for k, v in ckpt.shards[shard.name].metadata.items() if not k.startswith(META_MARKER)}
    meta.setdefault("format", "pt")
    if not is_marker(plan.marker):
        return meta  # canonical output: plain MXFP8, no marker
    meta[META_MARKER] = json.dumps(plan.marker, sort_keys=True, separators=(",", ":"))
    records = {t.name: t.record() for t in shard.tensors
               if t.role not in ("passthrough", "dequantized")}
    meta[META_TENSORS] = json.dumps(records, sort_keys=True, separators=(",", ":"))
    return meta
