"""Writing the output: streamed safetensors shards, index, config, completion marker.

Everything is written into a staging folder beside the destination, flushed and fsynced, and
renamed into place only when complete; the completion marker is the last file written. A
safetensors file is streamed: its header is known from the plan, so tensor bytes go to disk
as they are produced and no tensor, let alone the model, needs to be held in memory.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import json
import os
import secrets
import shutil
import struct
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from mxfp8_convert._lazy import torch, torch_loaded
from mxfp8_convert.errors import OutputError
from mxfp8_convert.format import (
    PART_MANIFEST_GLOB,
    PARTIAL_MANIFEST_PREFIX,
    PARTIAL_SUFFIX,
    file_digest,  # noqa: F401 - re-exported
    part_manifest,
)
from mxfp8_convert.format import PARTIAL_MANIFEST as MANIFEST_NAME

#: bytes per write() / writev(): 256 KiB writes ran 2-5x faster than 32 MiB ones on ext4 here
#: (the chunk is still in the CPU cache when the kernel copies it); BENCHMARKS.md
WRITE_PIECE = 256 << 10
#: iovecs per writev() (Linux's IOV_MAX)
_IOV_MAX = 1024
#: every this many bytes written, a shard's written pages are handed to writeback and the clean
#: ones dropped from the page cache (``ShardWriter._let_go``)
WRITEBACK_BYTES = 32 << 20


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _as_memoryview(data: torch.Tensor | bytes | memoryview) -> memoryview:
    if torch_loaded() and isinstance(data, torch.Tensor):  # bytes alone never import torch
        t = data.contiguous().reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
        return memoryview(t.numpy()).cast("B")
    return memoryview(data).cast("B")


def os_error(path: Path, e: OSError) -> OutputError:
    """One line for a write failure, naming the file; ENOSPC gets its own hint."""
    if e.errno == errno.ENOSPC:
        return OutputError(f"{path}: no space left on device", hint="free disk space or choose another -o")
    return OutputError(f"{path}: {e.strerror or e}")


class ShardWriter:
    """Stream one safetensors file whose tensors (name, dtype, shape, nbytes) are known upfront.

    Tensors must be written in the order given, each exactly ``nbytes`` long; ``close()``
    checks that and returns ``(size, xxh3_128 hex)`` of the file.
    """

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...], int]],
                 metadata: dict[str, str], *, depth: int = 2):
        self.path = path
        header: dict = {"__metadata__": metadata} if metadata else {}
        pos = 0
        self._sizes = []
        for name, dtype, shape, nbytes in entries:
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
            self._sizes.append((name, nbytes))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._expected = 8 + len(raw) + pos
        self._hash = xxhash.xxh3_128()
        self._written = 0
        # Background threads write and hash queued chunks (both release the GIL) while the
        # caller reads and lays out the next; at most `depth` chunks wait, bounding memory.
        # Writing and hashing run on threads of their own (each in queue order), so a chunk is
        # hashed while the previous one is written: on two cores this measured ~1.2x faster
        # than one thread doing both, one after the other.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp8-write")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp8-hash")
        self._pending: deque = deque()
        self._depth = depth
        self._unadvised = 0  # bytes written since the last _let_go (writer thread only)
        self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp8-flush")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # shards may sit in a subfolder
            self._f = open(path, "wb", buffering=0)  # raw: write() and os.writev() share the offset
        except OSError as e:
            raise os_error(path, e) from None
        self.write(struct.pack("<Q", len(raw)) + raw)

    def _drain(self, keep: int) -> None:
        while len(self._pending) > keep:
            jobs, data, release = self._pending.popleft()
            try:
                for job in jobs:
                    job.result()
            except OSError as e:
                raise os_error(self.path, e) from None
            finally:
                for job in jobs:  # neither thread may still read `data` when it is released
                    if not job.done() and not job.cancel():
                        concurrent.futures.wait([job])
                if release is not None:
                    release(data)

    def _write_raw(self, mv: memoryview) -> None:
        for at in range(0, mv.nbytes, WRITE_PIECE):
            piece = mv[at:at + WRITE_PIECE]
            while piece.nbytes:
                piece = piece[self._f.write(piece):]

    def _then_let_go(self, n: int, write, *args) -> None:
        write(*args)
        self._unadvised += n
        if self._unadvised >= WRITEBACK_BYTES:
            self._unadvised = 0
            self._flusher.submit(self._let_go)

    def _let_go(self) -> None:
        """Start writeback of what this file holds so far, and drop its pages already written back.

        A shard is not read again, and leaving gigabytes of it dirty in the page cache made the
        kernel throttle the writer (and reclaim other pages) once the output outgrew the dirty
        limits: on this project's 2-core VM a 4.33 GB conversion wrote its last shards at a
        third of the speed of its first. Handed over every ``WRITEBACK_BYTES``, the writes kept
        their speed and the final fsync had almost nothing left to do (BENCHMARKS.md).
        Only a hint: durability still comes from ``fsync_paths``.
        """
        try:
            os.posix_fadvise(self._f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass

    @staticmethod
    def _rows(view: memoryview, row_bytes: int, order: list[int]) -> Iterator[list[memoryview]]:
        """The rows ``order[0], order[1], ...`` of ``view``, in groups of about ``WRITE_PIECE`` bytes."""
        group = max(1, min(_IOV_MAX, WRITE_PIECE // row_bytes))
        for i in range(0, len(order), group):
            yield [view[r * row_bytes:(r + 1) * row_bytes] for r in order[i:i + group]]

    def _write_rows(self, view: memoryview, row_bytes: int, order: list[int]) -> None:
        fd = self._f.fileno()
        for rows in self._rows(view, row_bytes, order):
            got = os.writev(fd, rows)
            for piece in rows:  # after a short write: the rest, plainly
                if got < piece.nbytes:
                    self._write_raw(piece[got:])
                got = max(0, got - piece.nbytes)

    def _hash_rows(self, view: memoryview, row_bytes: int, order: list[int]) -> None:
        for rows in self._rows(view, row_bytes, order):
            for piece in rows:
                self._hash.update(piece)

    def copy_rows(self, row_bytes: int, order: list[int], view: torch.Tensor, release=None) -> None:
        """Queue the rows of ``view`` (``row_bytes`` each) in the given order.

        A row permutation (the P32 shuffle) written straight from the source mapping with
        vectored writes of ``WRITE_PIECE`` bytes: no shuffled copy in memory. On this project's
        machine 2-3x faster than one copy_file_range per row for 8 KiB rows.
        """
        mv = _as_memoryview(view)
        jobs = (self._writer.submit(self._then_let_go, mv.nbytes, self._write_rows, mv, row_bytes, order),
                self._hasher.submit(self._hash_rows, mv, row_bytes, order))
        self._enqueue(jobs, mv, view, release)

    def write(self, data: torch.Tensor | bytes, release=None) -> None:
        """Queue ``data`` to be appended to the file; ``release(data)`` is called once written.

        The caller must not modify ``data`` until then.
        """
        mv = _as_memoryview(data)
        jobs = (self._writer.submit(self._then_let_go, mv.nbytes, self._write_raw, mv),
                self._hasher.submit(self._hash.update, mv))
        self._enqueue(jobs, mv, data, release)

    def _enqueue(self, jobs: tuple, mv: memoryview, data, release) -> None:
        self._written += mv.nbytes
        self._pending.append((jobs, data, release))
        if self._written > self._expected:
            self._drain(0)
            raise OutputError(f"{self.path}: more bytes written than the header declares (bug)")
        self._drain(self._depth)

    def close(self) -> tuple[int, str]:
        """Finish writing and flush to the OS (``fsync_paths`` makes it durable later)."""
        try:
            self._drain(0)
        except OSError as e:
            raise os_error(self.path, e) from None
        finally:
            self._writer.shutdown()
            self._flusher.shutdown()
            self._f.close()
            self._hasher.shutdown()
        if self._written != self._expected:
            raise OutputError(f"{self.path}: wrote {self._written} bytes, header declares {self._expected} (bug)")
        return self._written, self._hash.hexdigest()

    def abort(self) -> None:
        for jobs, _, _ in self._pending:
            for job in jobs:
                job.cancel()
        self._writer.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        self._flusher.shutdown(wait=True)
        self._f.close()


def fsync_paths(paths: list[Path]) -> None:
    """fsync files written earlier. Deferring this lets the kernel write shard i back while
    shard i+1 is produced, instead of stalling after each shard."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise os_error(p, e) from None


def write_json(path: Path, obj: dict) -> tuple[int, str]:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    return write_bytes(path, data)


def write_bytes(path: Path, data: bytes) -> tuple[int, str]:
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise os_error(path, e) from None
    return len(data), xxhash.xxh3_128(data).hexdigest()


def copy_file(src: Path, dst: Path) -> tuple[int, str]:
    """Copy bytes (not links, not permissions of a read-only cache), fsync, return size + xxh3_128."""
    h = xxhash.xxh3_128()
    size = 0
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while chunk := fi.read(8 << 20):
                fo.write(chunk)
                h.update(chunk)
                size += len(chunk)
            fo.flush()
            os.fsync(fo.fileno())
    except OSError as e:
        raise os_error(dst, e) from None
    return size, h.hexdigest()


def check_destination(dest: Path, source: Path, *, overwrite: bool) -> None:
    """Refuse a destination that is the source, lies inside it, contains it, or exists."""
    d, s = dest.resolve(), source.resolve()
    if d == s or s in d.parents:
        raise OutputError(f"{dest}: the output must not be the source folder or lie inside it")
    if d in s.parents:
        raise OutputError(f"{dest}: the output must not contain the source folder")
    if dest.exists() and not overwrite:
        raise OutputError(f"{dest}: already exists", hint="pass --overwrite to replace it")
    if dest.exists() and not dest.is_dir():
        raise OutputError(f"{dest}: exists and is not a folder")


_LOCK_NAME = ".lock"


def manifest_name(part: tuple[int, int] | None) -> str:
    return MANIFEST_NAME if part is None else part_manifest(*part)


def _lock_name(part: tuple[int, int] | None) -> str:
    return _LOCK_NAME if part is None else f"{_LOCK_NAME}-part-{part[0]}"


def _take_lock(path: Path, what: str):
    f = open(path, "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise OutputError(what) from None
    return f


class Staging:
    """The work folder ``.NAME.mxfp8-partial`` beside ``dest``; it becomes ``dest`` on ``commit()``.

    Its manifest records the conversion's parameters and every finished file (size, xxh3).
    Created again with the same parameters after an interruption, it keeps the finished files
    that still verify and removes the rest; with other parameters it refuses, unless ``fresh``.
    A lock file keeps two conversions from writing the same destination at once. With
    ``part=(i, n)`` (a job-array task) each part has its own manifest and lock, and only
    touches the files it ``owns``; ``finalizing()`` gathers the parts.
    """

    def __init__(self, dest: Path, params: dict, *, fresh: bool = False, part: tuple[int, int] | None = None,
                 owned: set[str] | None = None, source: str | None = None) -> None:
        self.dest, self.params, self.part, self.source = dest, params, part, source
        self.path = partial_dir(dest)
        self._manifest = manifest_name(part)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            if fresh and self.path.exists() and part is None:
                shutil.rmtree(self.path)
            created = not self.path.exists()
            self.path.mkdir(exist_ok=True)
        except OSError as e:
            raise os_error(self.path, e) from None
        who = "this destination" if part is None else f"part {part[0]} of this destination"
        self._locks = [_take_lock(self.path / _lock_name(part), f"{dest}: another mxfp8-convert is writing {who}")]
        try:
            if fresh and part is not None:
                (self.path / self._manifest).unlink(missing_ok=True)
            self.files = self._resume(owned)
            self._save()
        except BaseException:  # e.g. ENOSPC on the first manifest: leave nothing behind we made
            self._release()
            if created:
                shutil.rmtree(self.path, ignore_errors=True)
            raise

    @classmethod
    def finalizing(cls, dest: Path) -> tuple[Staging, list[dict]]:
        """The work folder of a conversion split into parts, once every part has run.

        Returns the staging (its ``files`` are the union of the parts') and the part manifests.

        Raises:
            OutputError: no parts, a part missing or still running, or parts with other parameters.
        """
        self = cls.__new__(cls)
        self.dest, self.path, self.part, self._manifest = dest, partial_dir(dest), None, MANIFEST_NAME
        manifests = sorted(self.path.glob(PART_MANIFEST_GLOB)) if self.path.is_dir() else []
        if not manifests:
            raise OutputError(f"{dest}: no parts to finalize in {self.path}",
                              hint="run the conversion with --num-parts N --part I for every I first")
        parts = [json.loads(p.read_text()) for p in manifests]
        n = parts[0]["params"].get("num_parts")
        if any(p["params"] != parts[0]["params"] for p in parts):
            raise OutputError(f"{self.path}: parts were made with different parameters; rerun them alike")
        have = {p["part"] for p in parts}
        missing = sorted(set(range(n)) - have)
        if missing:
            raise OutputError(f"{dest}: part(s) {', '.join(map(str, missing))} of {n} have not run")
        self._locks = [_take_lock(self.path / _LOCK_NAME, f"{dest}: another mxfp8-convert is finalizing it")]
        for i in range(n):
            self._locks.append(_take_lock(self.path / _lock_name((i, n)), f"{dest}: part {i} of {n} is still running"))
        self.params, self.source = parts[0]["params"], parts[0].get("source")
        self.files = {}
        for p in parts:
            for rel, rec in p["files"].items():
                f = self.path / rel
                if f.is_file() and f.stat().st_size == rec.get("size") and file_digest(f) == rec.get("xxh3_128"):
                    self.files[rel] = rec
        return self, parts

    def _resume(self, owned: set[str] | None) -> dict[str, dict]:
        manifest = self._read_manifest()
        if manifest is not None and manifest.get("params") != self.params:
            self._release()
            diff = sorted(k for k in set(self.params) | set(manifest.get("params") or {})
                          if self.params.get(k) != (manifest.get("params") or {}).get(k))
            raise OutputError(
                f"{self.path}: an interrupted conversion with other parameters ({', '.join(diff)}) is here",
                hint="rerun it with the same options to resume it, or pass --fresh to start over")
        kept = {}
        for rel, rec in ((manifest or {}).get("files") or {}).items():
            p = self.path / rel
            if p.is_file() and p.stat().st_size == rec.get("size") and file_digest(p) == rec.get("xxh3_128"):
                kept[rel] = rec
        for p in sorted(self.path.rglob("*"), reverse=True):  # anything unfinished goes
            rel = str(p.relative_to(self.path))
            if rel in kept or p.name.startswith((PARTIAL_MANIFEST_PREFIX, _LOCK_NAME)):
                continue
            if owned is not None and rel not in owned:
                continue  # another part's file
            if p.is_dir():
                if not any(p.iterdir()):
                    p.rmdir()
            else:
                p.unlink()
        return kept

    def _read_manifest(self) -> dict | None:
        try:
            m = json.loads((self.path / self._manifest).read_text())
            return m if isinstance(m, dict) else None
        except (OSError, ValueError):
            return None

    def _save(self) -> None:
        tmp = self.path / (self._manifest + ".tmp")
        doc = {"params": self.params, "source": self.source, "files": self.files}
        if self.part is not None:
            doc["part"] = self.part[0]
        write_json(tmp, doc)
        os.replace(tmp, self.path / self._manifest)

    def finished(self, rel: str) -> dict | None:
        """The record of a file finished by an earlier, interrupted run (or None)."""
        return self.files.get(rel)

    def record(self, rel: str, rec: dict) -> None:
        """Note a finished file in the manifest, so an interrupted run can keep it."""
        self.files[rel] = rec
        self._save()

    def _release(self) -> None:
        for f in self._locks:
            f.close()

    def commit(self) -> None:
        """Rename into place; an existing destination is swapped out and then removed."""
        for p in list(self.path.iterdir()):
            if p.name.startswith((PARTIAL_MANIFEST_PREFIX, _LOCK_NAME)):
                p.unlink(missing_ok=True)
        _fsync_dir(self.path)
        old = None
        try:
            if self.dest.exists():
                old = self.dest.parent / f".{self.dest.name}.mxfp8-old-{secrets.token_hex(4)}"
                os.rename(self.dest, old)
            os.rename(self.path, self.dest)
        except OSError as e:
            if old is not None and not self.dest.exists():
                os.rename(old, self.dest)
            raise os_error(self.dest, e) from None
        finally:
            self._release()
        _fsync_dir(self.dest.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Remove the work folder (the input was bad: nothing to resume). A part only removes
        its own manifest, since other parts may be writing beside it."""
        self._release()
        if self.part is None:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            (self.path / self._manifest).unlink(missing_ok=True)

    def suspend(self) -> None:
        """Leave the work folder for a later run to resume (interrupted, or a finished part)."""
        self._release()


def partial_dir(dest: Path) -> Path:
    return dest.parent / f".{dest.name}{PARTIAL_SUFFIX}"


def free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free
