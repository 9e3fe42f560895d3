"""read -> plan -> transform -> write, reporting progress through a callback.

``convert()`` orchestrates: it plans (``run.plan_conversion``), opens the work folder
(``write.Staging``), writes the shards on ``workers`` threads, each tensor's bytes produced by
``transform.ShardTransform`` into a ``write.ShardWriter``, and finishes the output
(``run.finish_output``). Job-array parts and ``finalize`` are in ``parts``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from mxfp8_convert._buffers import SCRATCH
from mxfp8_convert._lazy import torch, torch_loaded
from mxfp8_convert._version import __version__
from mxfp8_convert.backends import BackendSpec, get_backend
from mxfp8_convert.errors import ConvertError, DiskFullError
from mxfp8_convert.format import FORMAT_VERSION, file_record
from mxfp8_convert.parts import finalize, part_shards
from mxfp8_convert.plan import ConversionPlan, ShardPlan
from mxfp8_convert.plan.shards import DEFAULT_MAX_SHARD_SIZE, shard_size_bytes
from mxfp8_convert.read import (
    ShardReader,
    SourceCheckpoint,
    TensorInfo,
    check_source_unchanged,
    watch_source,
)
from mxfp8_convert.run import (
    ConversionResult,
    Mispredicted,
    Modes,
    PlanGuess,
    ProgressCallback,
    ProgressEvent,
    SourceProof,
    default_output,
    finish_output,
    note_if_complete,
    output_names,
    plan_conversion,
    plan_guessing,
    shard_metadata,
)
from mxfp8_convert.transform import (
    CHUNK_BYTES,
    PIPELINE_DEPTH,
    QUEUED_AHEAD,
    ShardTransform,
    computed,
)
from mxfp8_convert.write import (
    DIRECT_BUFFERS,
    DIRECT_BYTES,
    ShardWriter,
    Staging,
    check_destination,
    finished_bytes,
    free_bytes,
)

__all__ = [  # the public names; plan_conversion, finalize and the types are re-exported
    "ConversionResult",
    "ProgressCallback",
    "ProgressEvent",
    "convert",
    "default_output",
    "finalize",
    "plan_conversion",
]


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
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
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
        max_shard_size: bound of an output shard, in bytes or as a size like ``"5GB"`` (as
            transformers' ``save_pretrained``); shards are named and indexed as Hub
            checkpoints are (docs/FORMAT.md section 1b).

    Returns:
        A ``ConversionResult``; the output folder exists only if the conversion completed.
        An interrupted run leaves ``.NAME.mxfp8-partial`` beside it; running the same
        conversion again resumes from the files it finished.

    Raises:
        ConvertError: any problem with the source, format, layout or destination; nothing is
            left at the destination and the source is never modified.
    """
    options = dict(source_format=source_format, on_ineligible=on_ineligible, ignore=ignore,
                   revision=revision, moe=moe, quantize_towers=quantize_towers,
                   allow_no_quantized=allow_no_quantized, progress=progress,
                   max_shard_size=max_shard_size)
    run = dict(output=output, overwrite=overwrite, dry_run=dry_run, fresh=fresh,
               hub_repo_id=hub_repo_id, part=part, workers=workers, max_memory=max_memory,
               progress=progress, on_ineligible=on_ineligible, ignore=ignore, moe=moe,
               quantize_towers=quantize_towers, allow_no_quantized=allow_no_quantized,
               max_shard_size=max_shard_size)
    t0 = time.perf_counter()
    if dry_run or part is not None:  # nothing to overlap the architecture's build with
        ckpt, plan = plan_conversion(model, backend, **options)
        return _convert(model, ckpt, plan, None, backend, t0, **run)
    ckpt, plan, guess = plan_guessing(model, backend, **options)
    try:
        return _convert(model, ckpt, plan, guess, backend, t0, **run)
    except Mispredicted:  # what was written is gone: convert on the architecture's plan
        ckpt, plan = plan_conversion(model, backend, **options)
        return _convert(model, ckpt, plan, None, backend, t0, **run)
    finally:
        if guess is not None:
            guess.close()


def _convert(model: str | Path, ckpt: SourceCheckpoint, plan: ConversionPlan,
             guess: PlanGuess | None, backend: str, t0: float, *, output, overwrite, dry_run,
             fresh, hub_repo_id, part, workers, max_memory, progress, on_ineligible, ignore,
             moe, quantize_towers, allow_no_quantized, max_shard_size) -> ConversionResult:
    """``convert()`` on ``plan``. A ``guess``'s plan (made on the name rules) is checked
    against the architecture's as soon as that is made, and replaced by it before the output
    is finished. Where they would write different bytes (``Mispredicted``), the work folder is
    removed (a stopped run waits for the architecture's plan to know: only work on the right
    plan is kept for a resume)."""
    dest = Path(output) if output is not None else default_output(str(model), backend)
    # an existing output: a real run checks under the lock; a dry run writes nothing (it is noted)
    check_destination(dest, ckpt.root, overwrite=overwrite, part=None if part is None else part[0],
                      exists=False)
    if dry_run:
        return ConversionResult(str(ckpt.root), str(dest), plan, True, time.perf_counter() - t0, 0)
    params = {"source_fingerprint": plan.fingerprint, "backend": backend, "format": plan.format,
              "on_ineligible": on_ineligible, "ignore": sorted(ignore or []),
              "tool_version": __version__, "format_version": FORMAT_VERSION, "moe": moe,
              "quantize_towers": quantize_towers, "allow_no_quantized": allow_no_quantized,
              "max_shard_size": shard_size_bytes(max_shard_size)}
    shards = list(plan.shards)
    if part is not None:
        shards = part_shards(plan, part)
        params["num_parts"] = part[1]
    modes = Modes.of(ckpt, plan)
    # parts record the source resolved, so `finalize` finds it from any working directory
    staging = Staging(dest, params, fresh=fresh, part=part, source=os.path.abspath(ckpt.root),
                      owned={s.name for s in shards} if part is not None else None,
                      overwrite=overwrite, writes=output_names(ckpt, plan), dir_mode=modes.folder)
    try:
        _check_free_space(dest, ckpt, plan, shards if part is not None else None, staging)
    except BaseException:
        staging.suspend() if staging.files else staging.abort()
        raise
    shard_writing = _ShardWriting(ckpt, plan, get_backend(backend), staging,
                                  progress or (lambda e: None), modes, guess)
    errors = shard_writing.errors
    try:
        n_workers = _workers(plan, workers, max_memory)
        if _computes(plan):
            import torch  # noqa: F401 - now, so that _compute_threads can set its threads
        if guess is not None:
            guess.start()  # after torch: a fork of this process imports only transformers
        with _compute_threads(n_workers) as in_flight, watch_source():
            in_flight = _in_flight(plan, n_workers, in_flight, max_memory)
            files = shard_writing.write_shards(shards, workers=n_workers, in_flight=in_flight)
        if part is not None:
            staging.suspend()  # `finalize` gathers the parts
            written = sum(f["size"] for f in files.values())
            return ConversionResult(str(ckpt.root), None, plan, False, time.perf_counter() - t0,
                                    written, dict(sorted(errors.items())), part=part)
        if guess is not None:
            plan = guess.final()  # the architecture's: its marker, config, card and result
        written = finish_output(ckpt, plan, staging.path, files, errors, modes=modes,
                                hub_repo_id=hub_repo_id, emit=shard_writing.emit,
                                done=shard_writing.done)
        staging.commit()
    except BaseException as e:
        if guess is not None and not _confirmed(guess):
            staging.abort()  # written on a plan that is not the architecture's
        elif isinstance(e, DiskFullError):
            _suspend_full(staging, e)
        elif isinstance(e, ConvertError):
            staging.abort()  # bad input or output: nothing worth resuming
        else:
            staging.suspend()  # interrupted: the next run with the same parameters resumes
            note_if_complete(staging, e)
        raise
    return ConversionResult(str(ckpt.root), str(dest), plan, False, time.perf_counter() - t0,
                            written, dict(sorted(errors.items())))


def _confirmed(guess: PlanGuess) -> bool:
    """Whether the architecture's plan writes what the guess wrote, waiting for it if need be
    (a stopped conversion keeps its work for a resume only then); an interrupt while waiting:
    not known, so no."""
    try:
        guess.final()
    except BaseException:  # noqa: BLE001 - Mispredicted, or interrupted again: discard the work
        return False
    return True


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
        copied = sum(ckpt.path(f).stat().st_size for f in plan.copied_files)
        need = plan.nbytes + copied + (1 << 20)
    else:  # a part writes its shards only
        need = sum(s.nbytes for s in shards) + (1 << 20)
    need -= finished_bytes(staging)
    free = free_bytes(dest.parent)
    if free is not None and free < need:
        raise DiskFullError(f"{dest.parent}: {free} bytes free, the output needs {need} more",
                            hint="free disk space or choose another -o")


#: modules a worker computes at once where its torch ops run on one thread but the machine has
#: a core for each: both cores of a 2-core machine quantize (BENCHMARKS.md, issue 25's dense row)
MODULES_IN_FLIGHT = 2


@contextmanager
def _compute_threads(workers: int) -> Iterator[int]:
    """Leave a core to each worker's writer thread while the shards are written; yield how many
    modules each worker computes at once (``ShardTransform``'s ``in_flight``).

    torch's OpenMP pool waits for all of its threads at the end of every parallel op; a writer
    thread busy hashing and writing keeps one of them off its core, so on small machines every
    op stalls (2 cores: the MXFP8 and dense conversions ran 1.5x and 3x slower, a fused MoE 4x).
    Where that leaves one thread per op and there are at least two cores per worker, the worker
    computes ``MODULES_IN_FLIGHT`` modules side by side on single-threaded ops instead: the
    thread count of each op is unchanged, and with it MKL's float64 dot products (it splits them
    by thread count, which rounds differently), so the error sums stay bit for bit the same.
    The setting is process-wide, restored on return. Conversions that only move bytes never
    import torch, and leave it alone.
    """
    if not torch_loaded():
        yield 1
        return
    before = torch.get_num_threads()
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    threads = max(1, min(before, cores - workers))
    torch.set_num_threads(threads)
    try:
        yield MODULES_IN_FLIGHT if threads == 1 and cores >= 2 * workers else 1
    finally:
        torch.set_num_threads(before)


def _computes(plan: ConversionPlan) -> bool:
    """Whether converting ``plan`` computes on tensors (torch), rather than only moving bytes
    (with mmap and numpy): computed modules, fused into MoE layers or not. Fusing the experts
    of an MXFP8 source only moves bytes (``ShardTransform._fused``)."""
    modules = (*plan.modules, *(m for layer in plan.moe for m in layer.modules))
    return any(computed(m) for m in modules)


#: memory one worker needs beyond its largest in-memory module: its buffer pool and queue, and
#: its shard writer's direct-write buffers
WORKER_BASE_BYTES = (2 * PIPELINE_DEPTH + 2) * CHUNK_BYTES + DIRECT_BUFFERS * DIRECT_BYTES


def _module_bytes(plan: ConversionPlan) -> int:
    """Memory of the largest module computed whole (see ``_workers``)."""
    modules = (*plan.modules, *(m for layer in plan.moe for m in layer.modules))
    return max((m.n * m.k * 2 for m in modules if computed(m)), default=0)


#: working buffers each helper thread keeps while it converts (``_buffers.Scratch``: a chunk of
#: 2**20 elements in float32 three times, in float64 twice, and its e4m3 pairs' int32 indices)
HELPER_SCRATCH_BYTES = 30 << 20


def _in_flight(plan: ConversionPlan, workers: int, in_flight: int, max_memory: int | None) -> int:
    """``in_flight`` modules per worker, or one where ``max_memory`` does not hold the extra
    modules (one being written, ``in_flight`` being computed and ``QUEUED_AHEAD`` computed or
    queued) and the helpers' working buffers."""
    if in_flight <= 1 or max_memory is None:
        return in_flight
    need = workers * (WORKER_BASE_BYTES + in_flight * HELPER_SCRATCH_BYTES
                      + (in_flight + QUEUED_AHEAD + 1) * _module_bytes(plan))
    return in_flight if need <= max_memory else 1


def _workers(plan: ConversionPlan, workers: int, max_memory: int | None) -> int:
    """Workers to run: at most ``workers``, as many as ``max_memory`` bytes allow, at most one
    per shard. A worker holds its buffers and, for modules computed whole (FP8, dense,
    laid-out sources), one module's canonical bytes (about 1.1 bytes per weight element, plus
    float32 working chunks)."""
    if workers < 1:
        raise ConvertError(f"--workers must be at least 1, got {workers}")
    per_worker = WORKER_BASE_BYTES + _module_bytes(plan)
    if max_memory is not None:
        if max_memory < per_worker:
            raise ConvertError(f"--max-memory {max_memory} bytes is below what one worker needs "
                               f"({per_worker})",
                               hint=f"allow at least {per_worker // 2**20 + 1} MiB")
        workers = min(workers, max_memory // per_worker)
    return max(1, min(workers, len(plan.shards)))


class _ShardWriting:
    """Writes a plan's shards into the work folder, keeping those an interrupted run finished,
    and collects the modules' quantization errors and the progress."""

    def __init__(self, ckpt: SourceCheckpoint, plan: ConversionPlan, backend: BackendSpec,
                 staging: Staging, emit: ProgressCallback, modes: Modes,
                 guess: PlanGuess | None = None) -> None:
        self.ckpt, self.plan, self.backend, self.emit = ckpt, plan, backend, emit
        self.staging, self.modes, self.guess = staging, modes, guess
        self.proof = SourceProof(ckpt, plan)
        self.errors: dict[str, dict] = {}
        self.in_flight = 1
        self.done = 0
        self._lock = threading.Lock()

    def write_shards(self, shards: list[ShardPlan], *, workers: int = 1,
                     in_flight: int = 1) -> dict[str, dict]:
        """Write ``shards`` (``workers`` at a time, each computing ``in_flight`` modules at
        once), keeping any an interrupted run finished."""
        self.in_flight = in_flight
        def one(shard: ShardPlan) -> tuple[str, dict]:
            rec = self.staging.finished(shard.name)
            if (rec is None or rec.get("errors") is None
                    or not self.proof.unchanged(shard, rec)):
                rec = self._write_shard(shard)
                rec["errors"] = self._shard_errors(shard)
                with self._lock:
                    self.staging.record(shard.name, rec)
            else:  # finished by an interrupted earlier run, and still intact
                self.errors.update(rec["errors"])
                self._advance(shard.nbytes, shard.name, None)
            return shard.name, {"size": rec["size"], "xxh3_128": rec["xxh3_128"]}

        if workers <= 1:
            with SCRATCH.kept():  # the quantizer's buffers serve every module, then go
                return dict(one(s) for s in shards)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mxfp8-shard",
                                initializer=SCRATCH.keep) as pool:  # buffers kept, as here
            return dict(pool.map(one, shards))

    def _write_shard(self, shard: ShardPlan) -> dict:
        entries = [(t.name, t.dtype, t.shape, t.nbytes) for t in shard.tensors]
        readers: dict[str, ShardReader] = {}

        def reader(info: TensorInfo) -> ShardReader:
            if info.file not in readers:
                size = self.ckpt.shards[info.file].size
                readers[info.file] = ShardReader(self.ckpt.root, info.file, size)
            return readers[info.file]

        produce = ShardTransform(self.ckpt.tensors, self.proof.modules, self.proof.moe,
                                 self.backend, reader, self.errors, in_flight=self.in_flight)
        produce.expect(shard.tensors)
        blobs = self.proof.blobs(shard)
        writer = ShardWriter(self.staging.path / shard.name, entries,
                             shard_metadata(self.ckpt, self.plan, shard), depth=PIPELINE_DEPTH,
                             mode=self.modes.shard(shard.name))
        try:
            for t in shard.tensors:
                for n in produce.produce(t, writer):
                    self._advance(n, shard.name, t.name)
            rec = file_record(*writer.close())
            return {**rec, "source": SourceProof.record(produce.source_hashes(), blobs)}
        except BaseException:
            produce.close()  # before the writer goes: no helper still reads the source
            writer.abort()
            raise
        finally:
            produce.close()
            for r in readers.values():
                r.close()

    def _advance(self, n: int, shard: str, tensor: str | None) -> None:
        check_source_unchanged()  # workers stop too when another process changes a source shard
        if self.guess is not None:
            self.guess.check()  # stop as soon as the architecture's plan differs
        with self._lock:
            self.done += n
            done = self.done
        self.emit(ProgressEvent("transforming", shard, tensor, done, self.plan.nbytes))

    def _shard_errors(self, shard: ShardPlan) -> dict:
        modules = {t.module for t in shard.tensors if t.module}
        moe = self.proof.moe
        modules |= {m.name for name in modules & moe.keys() for m in moe[name].modules}
        return {m: e for m, e in self.errors.items() if m in modules}
