"""Writing the output: streamed safetensors shards, index, config, completion marker.

Everything is written into a staging folder beside the destination, flushed and fsynced, and
renamed into place only when complete; the completion marker is the last file written. A
safetensors file is streamed: its header is known from the plan, so tensor bytes go to disk
as they are produced and no tensor, let alone the model, needs to be held in memory.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import json
import os
import secrets
import shutil
import signal
import stat
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import xxhash

from mxfp8_convert._lazy import numpy as np
from mxfp8_convert._lazy import torch, torch_loaded
from mxfp8_convert.errors import ConvertError, DiskFullError, OutputError
from mxfp8_convert.format import COMPLETE_MARKER as COMPLETE_NAME
from mxfp8_convert.format import (  # noqa: F401 - re-exported
    PART_MANIFEST_GLOB,
    PARTIAL_MANIFEST_PREFIX,
    PARTIAL_SUFFIX,
    file_digest,
    part_manifest,
)
from mxfp8_convert.format import PARTIAL_MANIFEST as MANIFEST_NAME

#: bytes per step of the one pass over each chunk (scan, hashes, layout, copy or write): the
#: piece is still in the CPU cache for each of them (BENCHMARKS.md, "Design decisions
#: (conversion)")
WRITE_PIECE = 256 << 10
#: the same for direct writes, whose pieces are copied into a buffer rather than written one by
#: one: 1 MiB pieces (still within the CPU's caches) take fewer Python steps per byte than
#: 256 KiB ones, and less CPU per GB (BENCHMARKS.md, "Design decisions (conversion)")
DIRECT_PIECE = 1 << 20
#: writes smaller than this are copied into one buffer and written together: a thread hand-off
#: per small tensor dominated checkpoints of many small tensors
COALESCE_BYTES = 1 << 20
#: buffered writes only: every this many bytes written, the last window's pages are handed to
#: writeback and the window before it dropped from the page cache (``_Buffered._let_go``)
WRITEBACK_BYTES = 32 << 20
#: O_DIRECT: every direct write's file offset, length and buffer address is a multiple of this
#: (the page size; a multiple of the usual logical block sizes). A file system that refuses
#: O_DIRECT or these writes gets buffered ones instead (``_Direct._write_all``)
DIRECT_ALIGN = 4096
#: bytes per direct write, and per page-aligned buffer; each shard writer fills one buffer
#: while the others are written (BENCHMARKS.md, "Design decisions (conversion)")
DIRECT_BYTES = 8 << 20
DIRECT_BUFFERS = 3
_O_DIRECT = getattr(os, "O_DIRECT", 0)


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
    """One line for a write failure, naming the file; a full disk gets its own type and hint."""
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return DiskFullError(f"{path}: no space left on device",
                             hint="free disk space or choose another -o")
    return OutputError(f"{path}: {e.strerror or e}")


#: ``scan(piece, at)``: checks the bytes ``piece`` found at offset ``at`` of the data written;
#: raises to refuse them (e.g. an e4m3 NaN). ``source``: a hasher (``update``) of those bytes.
Scan = Callable[[memoryview, int], None]
#: ``lay_out(piece, out)``: the bytes to write for ``piece``, laid out into ``out`` (ShardWriter)
LayOut = Callable[[memoryview, "np.ndarray"], "np.ndarray"]


def _write_all(f, piece: memoryview) -> None:
    while piece.nbytes:
        piece = piece[f.write(piece):]


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False where the file system (or the OS) refuses."""
    if not _O_DIRECT:
        return False
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError:
        return False
    return True


class _Buffered:
    """The file's bytes written through the page cache as the pass produces them, each piece
    straight from where it lies (the source mapping, or the layout's scratch buffer).

    For file systems that refuse O_DIRECT (e.g. ramfs, some FUSE and network file systems).
    Runs on the writer thread.
    """

    def __init__(self, f) -> None:
        self._f = f
        self._scratch: np.ndarray | None = None  # laid-out bytes of one block
        self._on_disk = 0
        self._windows = (0, 0)  # starts of the last two windows handed to writeback
        self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp8-flush")

    def step(self, granule: int) -> int:
        return max(granule, WRITE_PIECE // granule * granule)

    def take(self, n: int) -> np.ndarray:
        """Where to lay out the next ``n`` bytes before ``put``."""
        if self._scratch is None or self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.uint8)
        return self._scratch[:n]

    def put(self, piece: memoryview) -> None:
        _write_all(self._f, piece)
        self._on_disk += piece.nbytes
        before, last = self._windows
        if self._on_disk - last >= WRITEBACK_BYTES:
            self._flusher.submit(self._let_go, before, self._on_disk)
            self._windows = (last, self._on_disk)

    def _let_go(self, begin: int, end: int) -> None:
        """Start writeback of the bytes written since the last call, and drop the pages of the
        window before (written back by now) from the page cache.

        A shard is not read again, and leaving gigabytes of it dirty in the page cache made the
        kernel throttle the writer (and reclaim other pages) once the output outgrew the dirty
        limits: on this project's 2-core VM a 4.33 GB conversion wrote its last shards at a
        third of the speed of its first. Handed over every ``WRITEBACK_BYTES``, the writes kept
        their speed and the final fsync had almost nothing left to do (BENCHMARKS.md). Each
        call covers two windows, not the whole file: advising from the start every time made
        the cost grow with the file's size. Only a hint: durability comes from ``fsync_paths``.
        """
        try:
            os.posix_fadvise(self._f.fileno(), begin, end - begin, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError, ValueError):
            pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self._flusher.shutdown(wait=True)


def _aligned_buffer(n: int) -> np.ndarray:
    """A uint8 array of ``n`` bytes starting at a multiple of ``DIRECT_ALIGN``."""
    raw = np.empty(n + DIRECT_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN
    return raw[skip:skip + n]


class _Direct:
    """The file's bytes gathered, in file order, into page-aligned ``DIRECT_BYTES`` buffers
    and written with O_DIRECT by an I/O thread while the pass fills the next buffer.

    Direct writes bypass the page cache: no page allocation, LRU or delayed-allocation work
    per byte, no dirty pages to hand to writeback (the buffered path's main CPU cost,
    BENCHMARKS.md, "Design decisions (conversion)"). The bytes cost one copy into the buffer (or a
    layout straight into it), in the same pass as the check and the hashes. The buffers hold
    the file's bytes from its start, header included, so every full buffer is an aligned
    write; the last one's aligned part goes direct and its tail (under ``DIRECT_ALIGN``
    bytes) buffered. A direct write the file system refuses (EINVAL) or cuts short turns
    O_DIRECT off for the rest of the file. ``take``, ``put`` and ``finish`` run on the writer
    thread; one I/O thread writes in order, through the file's ``write`` (sequential offsets).
    """

    def __init__(self, f) -> None:
        self._f = f
        self._direct = True  # I/O thread only, once writing
        self._failed: OSError | None = None  # (same)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp8-io")
        self._made = 0
        self._writing: deque = deque()  # futures of the writes in flight, each returns its buffer
        self._buf: np.ndarray | None = None
        self._fill = 0
        self._scratch: np.ndarray | None = None  # a laid-out block that straddles two buffers

    def _room(self) -> int:
        return DIRECT_BYTES - self._fill if self._buf is not None else DIRECT_BYTES

    def step(self, granule: int) -> int:
        """Bytes of the next piece: up to the current buffer's end (no copy across buffers)."""
        return max(granule, min(DIRECT_PIECE, self._room()) // granule * granule)

    def take(self, n: int) -> np.ndarray:
        """Where to lay out the next ``n`` bytes: in the buffer, where they fit."""
        if self._buf is None:
            self._buf, self._fill = self._next_buffer(), 0
        if n <= DIRECT_BYTES - self._fill:
            return self._buf[self._fill:self._fill + n]
        if self._scratch is None or self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.uint8)
        return self._scratch[:n]

    def put(self, piece: memoryview) -> None:
        """Append ``piece`` (copied, unless ``take`` gave its place in the buffer)."""
        src = np.frombuffer(piece, dtype=np.uint8)
        while src.size:
            if self._buf is None:
                self._buf, self._fill = self._next_buffer(), 0
            k = min(DIRECT_BYTES - self._fill, src.size)
            dst = self._buf[self._fill:self._fill + k]
            if dst.ctypes.data != src.ctypes.data:
                np.copyto(dst, src[:k])
            self._fill += k
            src = src[k:]
            if self._fill == DIRECT_BYTES:
                self._submit()

    def _next_buffer(self) -> np.ndarray:
        if self._made < DIRECT_BUFFERS:
            self._made += 1
            return _aligned_buffer(DIRECT_BYTES)
        return self._writing.popleft().result()  # the oldest write's buffer, once written

    def _submit(self) -> None:
        self._writing.append(self._io.submit(self._write, self._buf, self._fill))
        self._buf = None

    def _write(self, buf: np.ndarray, n: int) -> np.ndarray:
        if self._failed is not None:  # the file stops at the failed write: none after it
            raise self._failed
        try:
            self._write_buffer(memoryview(buf)[:n])
        except OSError as e:
            self._failed = e
            raise
        return buf

    def _write_buffer(self, mv: memoryview) -> None:
        n = mv.nbytes
        aligned = n - n % DIRECT_ALIGN
        self._write_all(mv[:aligned])
        if aligned < n:  # the file's tail: O_DIRECT needs whole blocks
            self._buffered()
            _write_all(self._f, mv[aligned:])

    def _write_all(self, piece: memoryview) -> None:
        while piece.nbytes:
            try:
                n = self._f.write(piece)
            except OSError as e:
                if not (self._direct and e.errno == errno.EINVAL):
                    raise
                self._buffered()  # refused (alignment, or the file system): write it buffered
                continue
            if n < piece.nbytes and self._direct:
                self._buffered()  # the rest starts unaligned
            piece = piece[n:]

    def _buffered(self) -> None:
        if self._direct:
            self._direct = False
            _set_direct(self._f.fileno(), False)

    def finish(self) -> None:
        """Write what the last buffer holds and wait for every write; raises their errors."""
        if self._buf is not None and self._fill:
            self._submit()
        while self._writing:
            self._writing.popleft().result()

    def close(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)


class ShardWriter:
    """Stream one safetensors file whose tensors (name, dtype, shape, nbytes) are known upfront.

    Tensors must be written in the order given, each exactly ``nbytes`` long; ``close()``
    checks that and returns ``(size, xxh3_128 hex)`` of the file.

    Each queued chunk gets one pass on the writer thread, a piece at a time while it is in the
    CPU cache (``DIRECT_PIECE`` bytes, ``WRITE_PIECE`` where writes are buffered): the optional
    check (``scan``) and source hash, the layout (``lay_out``, e.g. a row shuffle), the output
    hash, and the copy into the page-aligned
    buffer that an I/O thread writes with O_DIRECT (``_Direct``; where the file system refuses
    O_DIRECT, a buffered write of the piece instead: ``_Buffered``). The caller reads and lays
    out the next chunk meanwhile; at most ``depth`` chunks wait, bounding memory. Small writes
    are gathered and handled on the caller's thread, which a hand-off would cost more than.
    """

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...], int]],
                 metadata: dict[str, str], *, depth: int = 2, mode: int = 0o644):
        self.path = path
        header: dict = {"__metadata__": metadata} if metadata else {}
        pos = 0
        for name, dtype, shape, nbytes in entries:
            header[name] = {"dtype": dtype, "shape": list(shape),
                            "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._expected = 8 + len(raw) + pos
        self._hash = xxhash.xxh3_128()
        self._written = 0  # bytes accepted
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxfp8-write")
        self._pending: deque = deque()
        self._ordered = None  # the last queued job with a scan or a source hasher
        self._depth = depth
        self._small = bytearray()  # gathered small writes, not yet handed to the writer thread
        try:
            self._f = open(create_file(path, mode), "wb", buffering=0)
        except OSError as e:
            raise os_error(path, e) from None
        direct = _set_direct(self._f.fileno(), True)
        self._out: _Direct | _Buffered = _Direct(self._f) if direct else _Buffered(self._f)
        try:
            self.write(struct.pack("<Q", len(raw)) + raw)
        except BaseException:
            self.abort()
            raise

    @property
    def direct(self) -> bool:
        """Whether the file's bytes are written with O_DIRECT (the file system took it)."""
        return isinstance(self._out, _Direct)

    def _drain(self, keep: int) -> None:
        while len(self._pending) > keep:
            job, data, release = self._pending.popleft()
            try:
                job.result()
            except OSError as e:
                raise os_error(self.path, e) from None
            finally:
                if not job.done() and not job.cancel():  # the thread may not still read `data`
                    concurrent.futures.wait([job])
                if release is not None:
                    release(data)

    def _one_pass(self, mv: memoryview, scan: Scan | None, source, lay_out: LayOut | None = None,
                  granule: int = 1) -> None:
        """Each block of ``mv`` while it is in the CPU cache: checked and hashed in source order,
        laid out (``lay_out``), hashed in file order and handed to the output."""
        at, out = 0, self._out
        while at < mv.nbytes:
            piece = mv[at:at + out.step(granule)]
            at += piece.nbytes
            if scan is not None:
                scan(piece, at - piece.nbytes)
            if source is not None:
                source.update(piece)
            if lay_out is not None:
                piece = memoryview(lay_out(piece, out.take(piece.nbytes))).cast("B")
            self._hash.update(piece)
            out.put(piece)

    def write(self, data, release=None, *, scan: Scan | None = None, source=None,
              lay_out: LayOut | None = None, granule: int = 1) -> None:
        """Queue ``data`` to be appended to the file; ``release(data)`` is called once written
        (or copied). The caller must not modify ``data`` until then. ``scan(piece, at)`` checks
        every piece first, ``source.update(piece)`` hashes it.

        ``lay_out(piece, out)``: the bytes to write for ``piece`` (a multiple of ``granule``
        bytes of ``data``, e.g. 32 weight rows), laid out into ``out`` (a uint8 array of the same
        size: the piece's place in the output buffer where it fits) and returned. So a row
        shuffle costs one copy, in the same pass as the check, the hashes and the write:
        ``data`` may be the source mapping itself, and no shuffled copy of a chunk is made.
        """
        mv = _as_memoryview(data)
        if mv.nbytes % granule:
            raise OutputError(f"{self.path}: {mv.nbytes} bytes is not a multiple of the layout's "
                              f"{granule} (bug)")
        if mv.nbytes < COALESCE_BYTES:  # gathered: the caller's thread does the one pass
            if (scan is not None or source is not None) and self._ordered is not None:
                # after the queued pieces a scan or a hasher has seen (e.g. the last few rows of
                # a tensor whose earlier chunks are queued): its bytes in their order
                self._drain(0)
                self._ordered = None
            if scan is not None:
                scan(mv, 0)
            if source is not None:
                source.update(mv)
            if lay_out is not None:
                mv = memoryview(lay_out(mv, np.empty(mv.nbytes, dtype=np.uint8))).cast("B")
            self._small += mv
            self._count(mv.nbytes)
            if release is not None:
                release(data)
            if len(self._small) >= COALESCE_BYTES:
                self._flush_small()
            return
        self._flush_small()
        job = self._writer.submit(self._one_pass, mv, scan, source, lay_out, granule)
        if scan is not None or source is not None:
            self._ordered = job
        self._enqueue(job, mv, data, release)

    def _flush_small(self) -> None:
        if self._small:
            buf, self._small = self._small, bytearray()
            job = self._writer.submit(self._one_pass, memoryview(buf), None, None)
            self._pending.append((job, buf, None))
            self._drain(self._depth)

    def _count(self, n: int) -> None:
        self._written += n
        if self._written > self._expected:
            self._drain(0)
            raise OutputError(f"{self.path}: more bytes written than the header declares (bug)")

    def _enqueue(self, job, mv: memoryview, data, release) -> None:
        self._count(mv.nbytes)
        self._pending.append((job, data, release))
        self._drain(self._depth)

    def close(self) -> tuple[int, str]:
        """Finish writing and flush to the OS (``fsync_paths`` makes it durable later)."""
        try:
            self._flush_small()
            self._drain(0)
            self._writer.submit(self._out.finish).result()
        except OSError as e:
            raise os_error(self.path, e) from None
        finally:
            self._writer.shutdown()
            self._out.close()
            self._f.close()
        if self._written != self._expected:
            raise OutputError(f"{self.path}: wrote {self._written} bytes, "
                              f"header declares {self._expected} (bug)")
        return self._written, self._hash.hexdigest()

    def abort(self) -> None:
        """Stop, and remove the half-written file (ours: created by this writer)."""
        for job, _, _ in self._pending:
            job.cancel()
        self._writer.shutdown(wait=True)
        self._out.close()
        self._f.close()
        remove_created(self.path)


def fsync_paths(paths: list[Path]) -> None:
    """fsync files written earlier. Deferring this lets the kernel write shard i back while
    shard i+1 is produced, instead of stalling after each shard."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY | _O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise os_error(p, e) from None


# --- creating files: never through a link, never over something that is not ours ------------

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CREATE = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
             | getattr(os, "O_BINARY", 0))
#: the widest modes we write (the umask and the source's own modes narrow them further)
FILE_MODE, DIR_MODE = 0o644, 0o755


def _work_root(path: Path) -> Path | None:
    """The work folder ``.NAME.mxfp8-partial`` that ``path`` lies in, if any."""
    for p in path.parents:
        if p.name.startswith(".") and p.name.endswith(PARTIAL_SUFFIX):
            return p
    return None


def _real_dirs(folder: Path, root: Path | None) -> None:
    """Create ``folder`` below ``root`` as real folders, refusing a link or a file among them."""
    if root is None:
        folder.mkdir(parents=True, exist_ok=True)
        return
    p = root
    for part in folder.relative_to(root).parts:
        p = p / part
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(p).st_mode):
                raise OSError(errno.ENOTDIR, "exists and is not a real folder (a link?)",
                              str(p)) from None


def create_file(path: Path, mode: int = FILE_MODE) -> int:
    """A new file at ``path``, opened for writing: ``O_EXCL`` and ``O_NOFOLLOW``, so nothing is
    ever written through a link or into a file that was already there.

    Inside our own work folder (the only place a conversion writes) a leftover of an earlier
    run at ``path`` is unlinked first (unlinking a link never touches what it points to) and
    missing subfolders are made as real folders. ``mode`` is capped at 0644; the umask
    narrows it further.
    """
    root = _work_root(path)
    _real_dirs(path.parent, root)
    if root is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return os.open(path, _O_CREATE, mode & FILE_MODE)


def remove_created(path: Path) -> None:
    """Remove a file we were writing (after a failure); a missing one is fine."""
    try:
        os.unlink(path)
    except OSError:
        pass


def write_json(path: Path, obj: dict, *, mode: int = FILE_MODE) -> tuple[int, str]:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    return write_bytes(path, data, mode=mode)


def write_bytes(path: Path, data: bytes, *, mode: int = FILE_MODE) -> tuple[int, str]:
    """Write a new file ``path`` (``create_file``). Outside a work folder an existing file is
    replaced by renaming a new one over it (a link there is replaced, never followed)."""
    target = path
    if _work_root(path) is None and os.path.lexists(path):
        path = path.with_name(f".{path.name}.mxfp8-tmp-{secrets.token_hex(4)}")
    try:
        with open(create_file(path, mode), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path != target:
            os.replace(path, target)
    except OSError as e:
        remove_created(path)
        raise os_error(target, e) from None
    return len(data), xxhash.xxh3_128(data).hexdigest()


def copy_file(src, dst: Path, *, mode: int = FILE_MODE) -> tuple[int, str]:
    """Copy the bytes of ``src`` (an open binary file, checked by whoever opened it) to a new
    file ``dst``; fsync; return size + xxh3_128. Links and permissions are not copied."""
    h = xxhash.xxh3_128()
    size = 0
    try:
        with open(create_file(dst, mode), "wb") as fo:
            while chunk := src.read(8 << 20):
                fo.write(chunk)
                h.update(chunk)
                size += len(chunk)
            fo.flush()
            os.fsync(fo.fileno())
    except OSError as e:
        remove_created(dst)
        raise os_error(dst, e) from None
    return size, h.hexdigest()


# --- the destination and what lies beside it -------------------------------------------------

#: beside the destination: its lock, a part's lock, and an output being replaced
LOCK_SUFFIX, PART_LOCK_INFIX, OLD_INFIX = ".mxfp8-lock", ".mxfp8-lock-part-", ".mxfp8-old-"
#: the longest name we put beside a destination NAME: ``.NAME.mxfp8-old-<8 hex>``
_LONGEST_EXTRA = len(f".{OLD_INFIX}") + 8


def partial_dir(dest: Path) -> Path:
    return dest.parent / f".{dest.name}{PARTIAL_SUFFIX}"


def _name_max(folder: Path) -> int:
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return os.pathconf(p, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):
        return 255


def check_destination(dest: Path, source: Path, *, overwrite: bool, part: int | None = None,
                      exists: bool = True) -> None:
    """Refuse a destination that is the source, lies inside it, contains it, or whose name
    leaves no room for the names we put beside it; with ``exists``, also one that exists
    (without ``overwrite``) or is not a folder.

    A conversion checks existence again under the destination's lock (``Staging``), after
    finishing what a killed earlier run left, so it passes ``exists=False`` here.
    """
    d, s = dest.resolve(), source.resolve()
    if d == s or s in d.parents:
        raise OutputError(f"{dest}: the output must not be the source folder or lie inside it")
    if d in s.parents:
        raise OutputError(f"{dest}: the output must not contain the source folder")
    beside = [PARTIAL_SUFFIX, LOCK_SUFFIX, *([f"{OLD_INFIX}{'0' * 8}"] if overwrite else []),
              *([f"{PART_LOCK_INFIX}{part}"] if part is not None else [])]
    longest = max(len(os.fsencode(f".{dest.name}{suffix}")) for suffix in beside)
    limit = _name_max(dest.parent)
    if longest > limit:
        room = limit - (longest - len(os.fsencode(dest.name)))
        size = len(os.fsencode(dest.name))
        raise OutputError(f"{dest}: the folder name is {size} bytes; with the "
                          f"work folders beside it (.NAME{PARTIAL_SUFFIX}, .NAME{OLD_INFIX}*) "
                          f"at most {room} fit", hint="choose a shorter -o")
    if exists and os.path.lexists(dest):
        replace_check(dest, overwrite=overwrite)


def replace_check(dest: Path, *, overwrite: bool) -> None:
    """Refuse an existing ``dest`` without ``overwrite``, or one we may not replace."""
    if not overwrite:
        raise OutputError(f"{dest}: already exists", hint="pass --overwrite to replace it")
    if not stat.S_ISDIR(os.lstat(dest).st_mode):
        raise OutputError(f"{dest}: exists and is not a folder (a file or a link)")
    replaceable(dest)


def _owned_dir(path: Path) -> bool:
    """Whether ``path`` is a real folder (not a link) of this user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (not hasattr(os, "geteuid") or st.st_uid == os.geteuid())


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_json(path: Path) -> dict | None:
    """A JSON object from a regular file (never through a link, never a FIFO), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            doc = json.loads(f.read(64 << 20))
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _manifests(folder: Path) -> list[str]:
    """Names of our work manifests in ``folder`` (regular files)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(PARTIAL_MANIFEST_PREFIX)
                  and n.endswith((".json", ".json.tmp")) and _regular(folder / n))


def _is_work_folder(path: Path) -> bool:
    """Made by us: a real folder of ours holding one of our manifests, or nothing else (a run
    killed between making it and putting its first manifest in place)."""
    if not _owned_dir(path):
        return False
    mine = _manifests(path)
    if any(_read_json(path / n) is not None for n in mine):
        return True
    try:  # empty, or only the first manifest, not yet in place
        return set(os.listdir(path)) <= set(mine)
    except OSError:
        return False


def _is_output(path: Path) -> bool:
    """An output of ours: a real folder of ours holding a completion marker."""
    marker = _read_json(path / COMPLETE_NAME)
    return (_owned_dir(path) and marker is not None
            and "files" in marker and "format_version" in marker)


class _Lock:
    """An exclusive lock file beside the destination (``filelock``: flock on POSIX, msvcrt on
    Windows; the lock file is opened with O_NOFOLLOW, never truncated). Released by
    ``release()``, which first unlinks the file while still holding it (a waiter that opened
    the unlinked file sees so and tries again), so no lock file stays behind."""

    def __init__(self, path: Path, busy: str, *, wait: float = 0) -> None:
        from filelock import FileLock, Timeout

        self.path = path
        self._lock = FileLock(str(path), timeout=wait, mode=0o600)
        try:
            self._lock.acquire()
        except Timeout:
            raise OutputError(busy) from None
        except OSError as e:
            raise OutputError(f"{path}: cannot be used as a lock file ({e.strerror or e}); "
                              "it must be a regular file",
                              hint="remove it if no conversion runs") from None
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            self._lock.release()
            raise OutputError(f"{path}: is not a regular file; cannot be used as a lock file",
                              hint="remove it if no conversion runs")
        self._id = (st.st_dev, st.st_ino)

    def release(self) -> None:
        if self._lock is None:
            return
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._id:
                os.unlink(self.path)
        except OSError:
            pass
        self._lock.release()
        self._lock = None


def _part_locks(dest: Path) -> list[tuple[int, Path]]:
    prefix = f".{dest.name}{PART_LOCK_INFIX}"
    try:
        names = os.listdir(dest.parent)
    except OSError:
        return []
    return sorted((int(n[len(prefix):]), dest.parent / n) for n in names
                  if n.startswith(prefix) and n[len(prefix):].isdigit())


#: seconds a part waits for the destination's lock, which other parts hold only to start
PART_WAIT = 60.0


def lock_destination(dest: Path, *, part: int | None = None, what: str = "writing") -> list[_Lock]:
    """The locks a run holds on ``dest`` (released in reverse order).

    Every mode takes the destination's lock ``.NAME.mxfp8-lock`` first. A whole run, ``--fresh``
    and ``finalize`` keep it until after the final rename, and also take the lock of every part
    that left one (refused while a part runs). A part keeps only its own lock
    ``.NAME.mxfp8-lock-part-I``, taken while it holds the destination's, so parts run side by
    side but never beside a whole run, a finalize or the same part. A part waits up to
    ``PART_WAIT`` seconds for the destination's lock (parts of a job array start together).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    busy = f"{dest}: another mxfp8-convert is {what} this destination"
    main = _Lock(dest.parent / f".{dest.name}{LOCK_SUFFIX}", busy,
                 wait=0 if part is None else PART_WAIT)
    locks = [main]
    try:
        if part is not None:
            busy = f"{dest}: another mxfp8-convert is writing part {part} of this destination"
            locks.append(_Lock(dest.parent / f".{dest.name}{PART_LOCK_INFIX}{part}", busy))
        else:
            for i, p in _part_locks(dest):
                locks.append(_Lock(p, f"{dest}: part {i} of this destination is still running"))
    except BaseException:
        for lk in reversed(locks):
            lk.release()
        raise
    return locks


def clean_leftovers(dest: Path) -> None:
    """Finish what a run killed inside its final steps left (call it holding the lock).

    A complete destination that still holds our manifests was renamed into place just before
    the kill: the output it replaced, if still at the work folder's name (the manifest records
    its inode), is put aside, and the manifests go. With no destination but a work folder
    whose manifest records an output put aside, that output is put back: the destination holds
    the old output or the new one. Old outputs put aside (``.NAME.mxfp8-old-*``: real folders
    of ours holding a completion marker, which is removed last, or empty) are removed. The
    parent folder is fsynced after any of these changes, and only then: with nothing to clean
    (the usual start) that fsync committed the file system's journal before the first write
    for nothing.
    """
    work = partial_dir(dest)
    changed = False
    if _is_output(dest) and _manifests(dest):
        rec = (_read_json(dest / MANIFEST_NAME) or {}).get("replacing")
        held = _recorded(dest.parent, rec, work.name)
        if held is not None and not os.path.lexists(dest.parent / rec["aside"]):
            os.rename(held, dest.parent / rec["aside"])
        for n in _manifests(dest):
            remove_created(dest / n)
        _fsync_dir(dest)
        changed = True
    elif not os.path.lexists(dest) and _is_work_folder(work):
        rec = (_read_json(work / MANIFEST_NAME) or {}).get("replacing")
        aside = _recorded(dest.parent, rec, rec.get("aside") if isinstance(rec, dict) else None)
        if aside is not None:
            os.rename(aside, dest)
            changed = True
    prefix = f".{dest.name}{OLD_INFIX}"
    for n in sorted(os.listdir(dest.parent)):
        p = dest.parent / n
        if n.startswith(prefix) and _owned_dir(p) and (_is_output(p) or not os.listdir(p)):
            _remove_output(p)
            changed = True
    if changed:
        _fsync_dir(dest.parent)


def _recorded(parent: Path, rec, name: str | None) -> Path | None:
    """``parent/name`` if it is the folder a manifest's ``replacing`` record names by inode."""
    if not (isinstance(rec, dict) and isinstance(name, str) and isinstance(rec.get("aside"), str)):
        return None
    if "/" in name or not name.startswith("."):
        return None
    p = parent / name
    try:
        st = os.lstat(p)
    except OSError:
        return None
    return p if [st.st_dev, st.st_ino] == rec.get("id") and _owned_dir(p) else None


def _remove_output(path: Path) -> None:
    """Remove an output of ours, its completion marker last: while anything of it is left,
    the marker still says whose it is (and a later run finishes the job)."""
    for n in os.listdir(path):
        if n != COMPLETE_NAME:
            p = path / n
            if stat.S_ISDIR(os.lstat(p).st_mode):
                shutil.rmtree(p)
            else:
                os.unlink(p)
    remove_created(path / COMPLETE_NAME)
    os.rmdir(path)


def replaceable(dest: Path) -> None:
    """Refuse to replace ``dest`` unless it is an empty folder or an output of ours (its
    completion marker, or our work manifest, inside)."""
    if not os.path.lexists(dest):
        return
    if not _owned_dir(dest):
        raise OutputError(f"{dest}: exists and is not a folder of this user; not replacing it")
    if _is_output(dest) or _manifests(dest) or not os.listdir(dest):
        return
    raise OutputError(f"{dest}: exists and is not an mxfp8-convert output (no {COMPLETE_NAME}); "
                      "--overwrite only replaces an empty folder or an earlier output",
                      hint="remove it yourself or choose another -o")


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (where handlers can be set: the main
    thread), so the final renames are never cut in half; one that came meanwhile is raised
    again right after, to the handlers in place before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    sigs = [s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None)) if s is not None]
    previous = {s: signal.signal(s, lambda n, _f: held.append(n)) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if held:
            signal.raise_signal(held[0])


def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap two names atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    unsupported = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP,
                   getattr(errno, "EOPNOTSUPP", errno.ENOTSUP))
    if err in unsupported:
        return False
    raise OSError(err, os.strerror(err), str(b))


def _intact(path: Path, rec: dict) -> bool:
    try:
        st = os.lstat(path)
        return (stat.S_ISREG(st.st_mode) and st.st_size == rec.get("size")
                and file_digest(path, follow_links=False) == rec.get("xxh3_128"))
    except OSError:
        return False


def manifest_name(part: tuple[int, int] | None) -> str:
    return MANIFEST_NAME if part is None else part_manifest(*part)


class Staging:
    """The work folder ``.NAME.mxfp8-partial`` beside ``dest``; it becomes ``dest`` on ``commit()``.

    Its manifest records the conversion's parameters and every finished file (size, xxh3).
    Created again with the same parameters after an interruption, it keeps the finished files
    that still verify and removes the unfinished files it would write (``writes``: the names
    of the output; nothing else is ever removed); with other parameters it refuses, unless
    ``fresh``. A work folder is used only if it is a real folder of this user holding our
    manifest (or empty); anything else at that name is refused, never deleted. The
    destination's lock (``lock_destination``) is held from before the first write until after
    the final rename. With ``part=(i, n)`` (a job-array task) each part has its own manifest
    and only touches the files it ``owns``; ``finalizing()`` gathers the parts.
    """

    def __init__(self, dest: Path, params: dict, *, fresh: bool = False,
                 part: tuple[int, int] | None = None, owned: set[str] | None = None,
                 source: str | None = None, overwrite: bool = False,
                 writes: set[str] | None = None, dir_mode: int = DIR_MODE) -> None:
        self.dest, self.params, self.part, self.source = dest, params, part, source
        self.committed = False
        self.path = partial_dir(dest)
        self._manifest = manifest_name(part)
        self.dir_mode = dir_mode & DIR_MODE
        try:
            self._locks = lock_destination(dest, part=None if part is None else part[0])
        except OSError as e:
            raise os_error(dest.parent, e) from None
        created = False
        try:
            clean_leftovers(dest)
            if os.path.lexists(dest):
                replace_check(dest, overwrite=overwrite)
            created = self._open(fresh)
            if part is not None:  # the destination's lock was needed only to start beside others
                self._locks.pop(0).release()
                if fresh:
                    remove_created(self.path / self._manifest)
            self.files = self._resume(owned, writes)
            self._save()
        except OSError as e:  # e.g. ENOSPC on the first manifest: leave nothing behind we made
            self._undo(created)
            raise os_error(self.path, e) from None
        except ConvertError:
            self._undo(created)
            raise
        except BaseException:  # interrupted: the folder (ours, perhaps empty) stays to resume
            self._release()
            raise

    def _undo(self, created: bool) -> None:
        if created and self.part is None:  # other parts may have started in it
            shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _open(self, fresh: bool) -> bool:
        """Make the work folder, or check the one there is ours; True if made now."""
        if os.path.lexists(self.path):
            if not _is_work_folder(self.path):
                raise OutputError(f"{self.path}: exists and is not a work folder of mxfp8-convert "
                                  "(a link, another user's, or without our manifest); "
                                  "not touching it",
                                  hint="move it away, or choose another -o")
            if not (fresh and self.part is None):
                return False
            shutil.rmtree(self.path)  # ours, and the user asked to start over
        os.mkdir(self.path, self.dir_mode)
        return True

    @classmethod
    def finalizing(cls, dest: Path) -> tuple[Staging, list[dict]]:
        """The work folder of a conversion split into parts, once every part has run.

        Returns the staging (its ``files`` are the union of the parts') and the part manifests.

        Raises:
            OutputError: no parts, a part missing or still running, or parts with other parameters.
        """
        self = cls.__new__(cls)
        self.dest, self.path, self.part = dest, partial_dir(dest), None
        self._manifest = MANIFEST_NAME
        self.dir_mode, self.committed = DIR_MODE, False
        self._locks = lock_destination(dest, what="finalizing")
        try:
            clean_leftovers(dest)
            if os.path.lexists(dest):
                raise OutputError(f"{dest}: already exists",
                                  hint="nothing to finalize; remove it to redo")
            if os.path.lexists(self.path) and not _is_work_folder(self.path):
                raise OutputError(f"{self.path}: exists and is not a work folder of mxfp8-convert; "
                                  "not touching it")
            names = [n for n in _manifests(self.path)
                     if n.startswith(f"{PARTIAL_MANIFEST_PREFIX}.part-") and n.endswith(".json")]
            parts = [doc for n in names if (doc := _read_json(self.path / n)) is not None]
            if not parts:
                raise OutputError(f"{dest}: no parts to finalize in {self.path}",
                                  hint="run the conversion with --num-parts N --part I "
                                       "for every I first")
            n = parts[0]["params"].get("num_parts")
            if any(p.get("params") != parts[0]["params"] for p in parts):
                raise OutputError(f"{self.path}: parts were made with different parameters; "
                                  "rerun them alike")
            missing = sorted(set(range(n)) - {p.get("part") for p in parts})
            if missing:
                raise OutputError(f"{dest}: part(s) {', '.join(map(str, missing))} of {n} "
                                  "have not run")
            self.params, self.source = parts[0]["params"], parts[0].get("source")
            self.files = {rel: rec for p in parts for rel, rec in (p.get("files") or {}).items()
                          if isinstance(rec, dict) and _safe_rel(rel)
                          and _intact(self.path / rel, rec)}
        except BaseException:
            self._release()
            raise
        return self, parts

    def _resume(self, owned: set[str] | None, writes: set[str] | None) -> dict[str, dict]:
        manifest = _read_json(self.path / self._manifest)
        if manifest is not None and manifest.get("params") != self.params:
            diff = sorted(k for k in set(self.params) | set(manifest.get("params") or {})
                          if self.params.get(k) != (manifest.get("params") or {}).get(k))
            raise OutputError(
                f"{self.path}: an interrupted conversion with other parameters "
                f"({', '.join(diff)}) is here",
                hint="rerun it with the same options to resume it, or pass --fresh to start over")
        kept = {rel: rec for rel, rec in ((manifest or {}).get("files") or {}).items()
                if isinstance(rec, dict) and _safe_rel(rel) and _intact(self.path / rel, rec)}
        # unfinished files of ours go: only names this run writes (of this part), never others
        self._mine = (owned if owned is not None else (writes or set())) | {self._manifest + ".tmp"}
        self.discard_unfinished(kept)
        return kept

    def discard_unfinished(self, kept: dict | None = None) -> None:
        """Remove the files this run writes that its manifest does not list as finished."""
        for rel in sorted(self._mine - set(self.files if kept is None else kept)):
            if _safe_rel(rel) and os.path.lexists(self.path / rel):
                remove_created(self.path / rel)

    def _save(self) -> None:
        tmp = self.path / (self._manifest + ".tmp")
        doc = {"params": self.params, "source": self.source, "files": self.files}
        if self.part is not None:
            doc["part"] = self.part[0]
        if getattr(self, "replacing", None):
            doc["replacing"] = self.replacing
        write_json(tmp, doc, mode=0o600)
        os.replace(tmp, self.path / self._manifest)

    def finished(self, rel: str) -> dict | None:
        """The record of a file finished by an earlier, interrupted run (or None)."""
        return self.files.get(rel)

    def record(self, rel: str, rec: dict) -> None:
        """Note a finished file in the manifest, so an interrupted run can keep it."""
        self.files[rel] = rec
        self._save()

    def _release(self) -> None:
        for lk in reversed(self._locks):
            lk.release()
        self._locks = []

    def commit(self) -> None:
        """Rename into place, the manifests still inside; then remove them.

        An existing destination (an output of ours, checked when the lock was taken) is
        swapped with the new one in one atomic rename where the system has one (Linux
        ``renameat2(RENAME_EXCHANGE)``), else renamed aside just before; the manifest records
        where the old output went, so a run killed at any point here is finished by the next
        one (``clean_leftovers``). The lock is released last.
        """
        with signals_held():
            self._commit()
            self.committed = True

    def _commit(self) -> None:
        try:
            old = None
            if os.path.lexists(self.dest):
                st = os.lstat(self.dest)
                old = self.dest.parent / f".{self.dest.name}{OLD_INFIX}{secrets.token_hex(4)}"
                self.replacing = {"aside": old.name, "id": [st.st_dev, st.st_ino]}
                self._save()  # where the old output goes, before it goes there
            _fsync_dir(self.path)
            if old is None:
                os.rename(self.path, self.dest)
            elif _rename_exchange(self.path, self.dest):
                os.rename(self.path, old)  # the old output, now at the work folder's name
            else:
                os.rename(self.dest, old)
                os.rename(self.path, self.dest)
            for n in _manifests(self.dest):
                remove_created(self.dest / n)
            _fsync_dir(self.dest)
            _fsync_dir(self.dest.parent)
            if old is not None:
                _remove_output(old)
                _fsync_dir(self.dest.parent)
        except OSError as e:
            raise os_error(self.dest, e) from None
        finally:
            self._release()

    def abort(self) -> None:
        """Remove the work folder (the input was bad: nothing to resume). A part only removes
        its own manifest, since other parts may be writing beside it."""
        try:
            if self.part is None:
                shutil.rmtree(self.path, ignore_errors=True)
            else:
                remove_created(self.path / self._manifest)
        finally:
            self._release()

    def suspend(self) -> None:
        """Leave the work folder for a later run to resume (interrupted, or a finished part)."""
        self._release()


def _safe_rel(rel) -> bool:
    """A manifest's file name: relative, normalised, staying inside the work folder."""
    import posixpath

    return (isinstance(rel, str) and bool(rel) and "\0" not in rel
            and not rel.startswith(("/", "\\")) and ".." not in rel.split("/")
            and posixpath.normpath(rel) == rel)


def finished_bytes(staging: Staging) -> int:
    return sum(int(rec.get("size") or 0) for rec in staging.files.values())


def free_bytes(path: Path) -> int | None:
    """Bytes free where ``path`` is (or would be); None where the file system keeps no count
    (no blocks at all, e.g. ramfs: it grows until memory runs out)."""
    p = path
    while not p.exists():
        p = p.parent
    usage = shutil.disk_usage(p)
    return None if usage.total == 0 else usage.free
