"""Writing the output: streamed safetensors shards, index, config, completion marker.

Everything is written into a staging folder beside the destination, flushed and fsynced, and
renamed into place only when complete; the completion marker is the last file written. A
safetensors file is streamed: its header is known from the plan, so tensor bytes go to disk
as they are produced and no tensor, let alone the model, needs to be held in memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import struct
from pathlib import Path

import torch

from mxfp8_convert.errors import OutputError


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
    if isinstance(data, torch.Tensor):
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
    checks that, flushes, fsyncs and returns ``(size, sha256 hex)`` of the file.
    """

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]):
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
        self._hash = hashlib.sha256()
        self._written = 0
        try:
            self._f = open(path, "wb")
            self._put(struct.pack("<Q", len(raw)) + raw)
        except OSError as e:
            raise os_error(path, e) from None

    def _put(self, data) -> None:
        mv = _as_memoryview(data)
        self._f.write(mv)
        self._hash.update(mv)
        self._written += mv.nbytes

    def write(self, data: torch.Tensor | bytes) -> None:
        try:
            self._put(data)
        except OSError as e:
            raise os_error(self.path, e) from None
        if self._written > self._expected:
            raise OutputError(f"{self.path}: more bytes written than the header declares (bug)")

    def close(self) -> tuple[int, str]:
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise os_error(self.path, e) from None
        finally:
            self._f.close()
        if self._written != self._expected:
            raise OutputError(f"{self.path}: wrote {self._written} bytes, header declares {self._expected} (bug)")
        return self._written, self._hash.hexdigest()

    def abort(self) -> None:
        self._f.close()


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
    return len(data), hashlib.sha256(data).hexdigest()


def copy_file(src: Path, dst: Path) -> tuple[int, str]:
    """Copy bytes (not links, not permissions of a read-only cache), fsync, return size + sha256."""
    h = hashlib.sha256()
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


class Staging:
    """A temporary folder beside ``dest`` that becomes ``dest`` on ``commit()``."""

    def __init__(self, dest: Path, *, name: str | None = None):
        self.dest = dest
        parent = dest.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise os_error(parent, e) from None
        self.path = parent / (name or f".{dest.name}.mxfp8-tmp-{secrets.token_hex(4)}")
        try:
            self.path.mkdir(exist_ok=name is not None)
        except OSError as e:
            raise os_error(self.path, e) from None

    def commit(self) -> None:
        """Rename into place; an existing destination is swapped out and then removed."""
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
        _fsync_dir(self.dest.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free
