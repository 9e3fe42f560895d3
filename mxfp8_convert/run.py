"""What a conversion and a ``finalize`` share: the progress and result types, opening and
planning the source, proving the source bytes behind a finished shard, and the output's files
besides its shards (permission bits, shard metadata, index and config, copied side files, model
card and, last, the completion marker)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from mxfp8_convert._gc import paused_gc
from mxfp8_convert._version import __version__
from mxfp8_convert.backends import get_backend
from mxfp8_convert.errors import ConvertError
from mxfp8_convert.format import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    INDEX_FILE,
    META_MARKER,
    META_TENSORS,
    Completion,
    FileRecord,
    file_record,
    is_marker,
)
from mxfp8_convert.formats import detect_source
from mxfp8_convert.plan import (
    ConversionPlan,
    ModulePlan,
    MoELayerPlan,
    ShardPlan,
    build_plan,
    classify,
)
from mxfp8_convert.plan.shards import DEFAULT_MAX_SHARD_SIZE
from mxfp8_convert.publish import CARD_NAME, write_model_card
from mxfp8_convert.read import (
    ShardReader,
    SourceCheckpoint,
    TensorInfo,
    hub_blob_sha256,
    open_checkpoint,
    open_source_file,
    resolve_model,
)
from mxfp8_convert.transform import source_key
from mxfp8_convert.write import Staging, copy_file, fsync_paths, write_json


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
    """``<model folder>-<backend>`` beside a local model, ``./<repo name>-<backend>`` for a Hub
    id."""
    local = Path(model).expanduser()
    if local.exists():
        return local.resolve().parent / f"{local.resolve().name}-{backend}"
    return Path.cwd() / f"{model.rstrip('/').split('/')[-1]}-{backend}"


@paused_gc()  # one pause from opening to the plan: the first collection after it walks all
def plan_conversion(  # that was made during it, once instead of once per step (``_gc``)
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
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
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
                            quantize_towers=quantize_towers, allow_no_quantized=allow_no_quantized,
                            max_shard_size=max_shard_size)


class Mispredicted(Exception):
    """A plan made on the name rules (``PlanGuess``) writes other bytes than the architecture's:
    what was written is discarded and the conversion starts again on the architecture's."""


class PlanGuess:
    """A plan made on the name rules while a child process builds the dense source's
    architecture (``classify.Guess``). ``final()`` is the architecture's plan, which the
    conversion keeps what it wrote for only where it writes the same bytes as the guess
    (``same_bytes``): the result, marker, config and card are always the architecture's."""

    def __init__(self, guess: classify.Guess, plan: ConversionPlan,
                 replan: Callable[[], ConversionPlan]) -> None:
        self.guess, self.plan, self._replan = guess, plan, replan
        self._final: ConversionPlan | None = None
        self._wrong = False
        self._lock = threading.Lock()

    @property
    def confirmed(self) -> bool:
        return self._final is not None

    def start(self) -> None:
        """Start the child process (forked: best once this process has imported torch)."""
        if self.guess.pending is not None:
            self.guess.pending.start()

    def check(self) -> None:
        """Without waiting: once the child has answered, compare the plans.

        Raises:
            Mispredicted: the architecture's plan writes other bytes.
        """
        pending = self.guess.pending
        if self._final is None and (pending is None or pending.done()):
            self.final()

    def final(self) -> ConversionPlan:
        """The architecture's plan (waits for the child).

        Raises:
            Mispredicted: it writes other bytes than the guess, or cannot be made.
        """
        with self._lock:
            if self._final is None and not self._wrong:
                self.guess.resolve()
                try:
                    real = self._replan()
                except ConvertError as e:
                    self._wrong = True
                    raise Mispredicted(str(e)) from e
                self._wrong = not same_bytes(real, self.plan)
                self._final = None if self._wrong else real
            if self._wrong:
                raise Mispredicted("the name rules' plan is not the architecture's")
            return self._final

    def close(self) -> None:
        self.guess.close()


def same_bytes(a: ConversionPlan, b: ConversionPlan) -> bool:
    """Whether two plans of one source write the same output bytes: all they hold but how
    each module was found (``decided_by``) and the weights they leave as they are (whose names
    the marker holds) is the same."""
    return _bytes_of(a) == _bytes_of(b)


def _bytes_of(plan: ConversionPlan) -> ConversionPlan:
    def strip(modules):
        return tuple(m._replace(decided_by="") for m in modules)

    moe = tuple(dataclasses.replace(x, gate=strip(x.gate), up=strip(x.up), down=strip(x.down))
                for x in plan.moe)
    return dataclasses.replace(plan, modules=strip(plan.modules), moe=moe, unquantized=())


def plan_guessing(model: str | Path, backend: str, **options) -> tuple[
        SourceCheckpoint, ConversionPlan, PlanGuess | None]:
    """``plan_conversion(model, backend, **options)``, except that where a dense source's
    architecture is not cached, the plan is made on the name rules while a child process
    builds it, with the ``PlanGuess`` that confirms it (None: the plan is final)."""
    guess = classify.Guess()
    classify._GUESS.append(guess)
    try:
        ckpt, plan = plan_conversion(model, backend, **options)
    except ConvertError:
        if guess.pending is None:
            raise
        guess.resolve()  # the name rules' plan failed: the architecture's may not
        ckpt, plan = plan_conversion(model, backend, **options)
    except BaseException:
        guess.close()
        raise
    finally:
        classify._GUESS.remove(guess)
        guess.active = False
    if guess.pending is None:
        return ckpt, plan, None
    spec = get_backend(backend)
    fmt = detect_source(ckpt.config, ckpt.quant_files, ckpt.tensors, options.get("source_format"))
    build = {k: v for k, v in options.items() if k not in ("source_format", "revision", "progress")}
    return ckpt, plan, PlanGuess(guess, plan, lambda: build_plan(ckpt, spec, fmt, **build))


def note_if_complete(staging: Staging, e: BaseException) -> None:
    """An interrupt that came during the final rename is acted on once it is done: say the
    output is complete rather than that a rerun would resume."""
    if staging.committed and not isinstance(e, ConvertError):
        e.hint = f"the output was already complete: {staging.dest}"


# --- the source bytes behind a shard ----------------------------------------------------------


class SourceProof:
    """Which source tensors make up each output shard, and whether their bytes are still those
    a shard's record was made from (resume and ``finalize`` keep a shard only then)."""

    def __init__(self, ckpt: SourceCheckpoint, plan: ConversionPlan) -> None:
        self.ckpt = ckpt
        self.modules: dict[str, ModulePlan] = {m.name: m for m in plan.modules}
        self.moe: dict[str, MoELayerPlan] = {layer.name: layer for layer in plan.moe}

    def sources(self, shard: ShardPlan) -> list[TensorInfo]:
        """The source tensors whose bytes make up output ``shard`` (each belongs to one
        shard)."""
        out: dict[str, TensorInfo] = {}
        for t in shard.tensors:
            if t.module in self.moe:
                infos = [i for m in self.moe[t.module].modules for i in (m.weight, m.scale)]
            elif t.module in self.modules:
                infos = [self.modules[t.module].weight, self.modules[t.module].scale]
            else:
                infos = [self.ckpt.tensors[t.source]]
            for info in infos:
                if info is not None:
                    out.setdefault(source_key(info), info)
        return list(out.values())

    def blobs(self, shard: ShardPlan) -> dict[str, str | None]:
        """Source file -> its Hub blob SHA-256 name (None where it is not a Hub blob)."""
        files = sorted({info.file for info in self.sources(shard)})
        return {f: hub_blob_sha256(self.ckpt.root, f) for f in files}

    def hash_sources(self, shard: ShardPlan) -> dict[str, str]:
        """``source_key -> xxh3_64`` of every source tensor behind ``shard``, read again."""
        out = {}
        readers: dict[str, ShardReader] = {}
        try:
            for info in self.sources(shard):
                if info.file not in readers:
                    size = self.ckpt.shards[info.file].size
                    readers[info.file] = ShardReader(self.ckpt.root, info.file, size)
                data = readers[info.file].bytes(info.begin, info.nbytes)
                out[source_key(info)] = xxhash.xxh3_64(data).hexdigest()
        finally:
            for r in readers.values():
                r.close()
        return out

    @staticmethod
    def record(hashes: dict[str, str], blobs: dict[str, str | None]) -> dict:
        """The ``source`` entry of a shard's record, from the hashes taken while converting."""
        source: dict = {"xxh3_128": combine(hashes)}
        if None not in blobs.values():
            source["hub_blobs"] = blobs
        return source

    def unchanged(self, shard: ShardPlan, rec: dict) -> bool:
        """Whether the source bytes behind ``shard`` are those its record was made from.

        Hub snapshot files are named by the Hub's own SHA-256 of their bytes: where every
        source file of the shard is one, those names are compared and nothing is read. Else
        each source tensor is hashed again (xxh3, at memory speed: far cheaper than redoing
        the shard) and the digest compared with the one recorded while it was converted.
        """
        source = rec.get("source")
        if not isinstance(source, dict) or not isinstance(source.get("xxh3_128"), str):
            return False  # recorded by a version that did not hash its source: redo
        blobs = self.blobs(shard)
        if None not in blobs.values() and blobs == source.get("hub_blobs"):
            return True
        return combine(self.hash_sources(shard)) == source["xxh3_128"]


def combine(hashes: dict[str, str]) -> str:
    """One digest of the source tensors behind a shard: xxh3_128 of their sorted (key, xxh3_64)."""
    h = xxhash.xxh3_128()
    for key in sorted(hashes):
        h.update(f"{key}\0{hashes[key]}\n".encode())
    return h.hexdigest()


# --- the output's files besides its shards ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Modes:
    """Permission bits of what we write: at most 0644 / 0755 and never wider than the source
    (a shard's mode is capped by its source shard's, a copied file's by its source's; the
    files we generate and the folder by the source's shards, config and folder together)."""

    shards: dict[str, int]  # output shard -> mode
    generated: int
    folder: int

    @classmethod
    def of(cls, ckpt: SourceCheckpoint, plan: ConversionPlan) -> Modes:
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

    def shard(self, name: str) -> int:
        return self.shards.get(name, self.generated)


def output_names(ckpt: SourceCheckpoint, plan: ConversionPlan) -> set[str]:
    """Every file a conversion of ``plan`` writes into its work folder (relative names)."""
    return ({s.name for s in plan.shards} | set(plan.copied_files) | set(json_files(ckpt, plan))
            | {CARD_NAME, COMPLETE_MARKER})


def json_files(ckpt: SourceCheckpoint, plan: ConversionPlan) -> dict[str, dict]:
    """config.json (with the plan's ``quantization_config``) and, if sharded, the index."""
    config = dict(ckpt.config or {})
    config["quantization_config"] = plan.marker
    out = {CONFIG_FILE: config}
    if len(plan.shards) > 1:  # as transformers: one shard is model.safetensors, unindexed
        meta = {"total_size": plan.nbytes}
        if is_marker(plan.marker):
            meta[META_MARKER] = plan.marker
        weight_map = {t.name: s.name for s in plan.shards for t in s.tensors}
        out[INDEX_FILE] = {"metadata": meta, "weight_map": weight_map}
    return out


def shard_metadata(ckpt: SourceCheckpoint, plan: ConversionPlan,
                   shard: ShardPlan) -> dict[str, str]:
    """The ``__metadata__`` of an output shard: what it keeps of its source shards'
    (``ShardPlan.metadata``), plus the marker and the per-tensor layout records (none for a
    canonical output: plain MXFP8)."""
    meta = {k: v for k, v in shard.metadata if not k.startswith(META_MARKER)}
    meta.setdefault("format", "pt")
    if not is_marker(plan.marker):
        return meta
    meta[META_MARKER] = json.dumps(plan.marker, sort_keys=True, separators=(",", ":"))
    records = {t.name: t.record() for t in shard.tensors
               if t.role not in ("passthrough", "dequantized")}
    meta[META_TENSORS] = json.dumps(records, sort_keys=True, separators=(",", ":"))
    return meta


def completion_record(plan: ConversionPlan, errors: dict[str, dict],
                      files: dict[str, dict]) -> dict:
    return Completion(
        backend=plan.backend, tool_version=__version__,
        source_fingerprint=plan.fingerprint, source_format=plan.format,
        quantize_towers=plan.quantize_towers,
        quantization_errors=dict(sorted(errors.items())),
        files={rel: FileRecord(**rec) for rel, rec in sorted(files.items())},
    ).to_dict()


def finish_output(ckpt: SourceCheckpoint, plan: ConversionPlan, out: Path,
                  files: dict[str, dict], errors: dict[str, dict], *, modes: Modes,
                  hub_repo_id: str | None, emit: ProgressCallback, done: int) -> int:
    """Once every shard is written: copy the side files, write the configs, the model card and,
    last, the completion marker into work folder ``out``; return the bytes of all files.

    ``files`` holds the shards' records (size, xxh3_128); ``done`` the bytes converted so far
    (for the progress event).
    """
    files = dict(files)
    emit(ProgressEvent("writing", bytes_done=done, bytes_total=plan.nbytes))
    for rel in plan.copied_files:
        src, st = open_source_file(ckpt.root, rel)  # checked now, as it is opened
        with src:
            mode = stat.S_IMODE(st.st_mode)
            files[rel] = file_record(*copy_file(src, out / rel, mode=mode))
    for rel, obj in json_files(ckpt, plan).items():
        files[rel] = file_record(*write_json(out / rel, obj, mode=modes.generated))
    files[CARD_NAME] = file_record(*write_model_card(  # replaces the copied source README
        out, ckpt.root, repo_id=hub_repo_id,
        completion=completion_record(plan, errors, {}), mode=modes.generated))
    fsync_paths([out / s.name for s in plan.shards])  # durable before "complete"
    write_json(out / COMPLETE_MARKER, completion_record(plan, errors, files), mode=modes.generated)
    emit(ProgressEvent("done", bytes_done=plan.nbytes, bytes_total=plan.nbytes))
    return sum(f["size"] for f in files.values())
