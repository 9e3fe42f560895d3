"""The shard writer's O_DIRECT path (``write._Direct``) and its buffered fallback.

Every file is checked against bytes built here, independently of the writer: the safetensors
layout (an 8-byte little-endian header length, the JSON header, the tensors back to back) read
back by hand, a P32 row shuffle by index arithmetic, and the file's xxh3_128.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct

import numpy as np
import pytest
import torch
import xxhash

import mxfp8_convert.write as write_mod
from mxfp8_convert import convert
from mxfp8_convert.plan import COMPLETE_MARKER
from mxfp8_convert.transform import p32_rows
from mxfp8_convert.write import ShardWriter
from tests.checkpoints import leftovers, load_all

#: a small direct-write buffer, so that a few hundred KiB span several of them
SMALL_BUFFER = 64 << 10


def _takes_o_direct(folder) -> bool:
    probe = folder / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture()
def disk(tmp_path):
    """A folder on a file system that takes O_DIRECT (the tests' tmp folder on a disk)."""
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}: its file system refuses O_DIRECT")
    return tmp_path


def _p32(raw: bytes, row: int) -> bytes:
    """P32 by index: output row 8a + b of each 32-row block is source row 4b + a."""
    rows = [raw[i:i + row] for i in range(0, len(raw), row)]
    out = []
    for blk in range(0, len(rows), 32):
        out += [rows[blk + 4 * (r % 8) + r // 8] for r in range(32)]
    return b"".join(out)


def _tensors(seed: int, specs):
    """``specs``: (nbytes, row or None) per tensor -> [(name, bytes, row)]."""
    g = np.random.default_rng(seed)
    return [(f"t{i}", g.integers(0, 256, n, dtype=np.uint8).tobytes(), row)
            for i, (n, row) in enumerate(specs)]


def _write(path, tensors, chunk: int = 3 << 20):
    """Write ``tensors`` with a ShardWriter, ``chunk`` bytes (rounded to the layout's granule)
    per ``write``; returns (direct?, size, digest) as the writer reports them."""
    w = ShardWriter(path, [(n, "U8", (len(b),), len(b)) for n, b, _ in tensors], {"k": "v"})
    try:
        for _, b, row in tensors:
            granule = 32 * row if row else 1
            step = max(granule, chunk // granule * granule)
            for at in range(0, len(b), step):
                w.write(memoryview(b)[at:at + step], lay_out=p32_rows(row) if row else None,
                        granule=granule)
        return (w.direct, *w.close())
    except BaseException:
        w.abort()  # as convert does
        raise


def _check(path, tensors, size, digest) -> bytes:
    """The file holds the header and, in order, each tensor's bytes (shuffled where a row is
    given); the writer's size and digest are the file's."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"k": "v"}
    data, pos = raw[8 + n:], 0
    for name, b, row in tensors:
        assert header[name]["data_offsets"] == [pos, pos + len(b)]
        assert data[pos:pos + len(b)] == (_p32(b, row) if row else b), name
        pos += len(b)
    assert pos == len(data) and size == len(raw) and digest == xxhash.xxh3_128(raw).hexdigest()
    return raw


#: (nbytes, P32 row bytes or None) per tensor: tails of every kind, tiny shards, buffers crossed
CASES = {
    "tiny": [(1, None)],
    "one-aligned-block": [(4096 - 64, None)],
    "tail-of-one-byte": [(5 * SMALL_BUFFER + 1, None)],
    "exact-buffers": [(3 * SMALL_BUFFER - 200, None)],
    "small-writes-gathered": [(100, None), (3000, None), (70_000, None), (33, None)],
    "p32-straddling-buffers": [(32 * 2048 * 7, 2048), (17, None), (32 * 96 * 40, 96)],
    "p32-wide-rows": [(32 * 8192 * 3, 8192), (1 << 20, None)],
}


@pytest.mark.parametrize("case", CASES)
def test_direct_writes_give_the_same_bytes_as_buffered_ones(disk, mount_fs, monkeypatch, case):
    """On a disk the writer writes O_DIRECT; on a ramfs (which refuses O_DIRECT) buffered;
    on a tmpfs whatever it takes. The three files are the same bytes, the header and tensors
    (P32 rows shuffled) as built by hand, with unaligned tails and tiny shards included."""
    monkeypatch.setattr(write_mod, "DIRECT_BYTES", SMALL_BUFFER)
    tensors = _tensors(len(case), CASES[case])
    direct, *rec = _write(disk / "a.safetensors", tensors, chunk=1 << 20)
    assert direct
    want = _check(disk / "a.safetensors", tensors, *rec)
    ram = mount_fs("ramfs")
    direct, *rec = _write(ram / "b.safetensors", tensors, chunk=1 << 20)
    assert not direct
    assert _check(ram / "b.safetensors", tensors, *rec) == want
    tmp = mount_fs("tmpfs", 16 << 20)
    _, *rec = _write(tmp / "c.safetensors", tensors, chunk=1 << 20)
    assert _check(tmp / "c.safetensors", tensors, *rec) == want


class _Recorder:
    """A shard's raw file that notes, per write(), whether O_DIRECT is on, the offset and
    the length, and may answer a direct write with ``fail`` (an errno) instead."""

    def __init__(self, f, log: list, fail: int | None = None, at: int = 1) -> None:
        self._f, self._log, self._fail, self._at = f, log, fail, at

    def write(self, data) -> int:
        fd = self._f.fileno()
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        mv = memoryview(data).cast("B")
        self._log.append((direct, os.lseek(fd, 0, os.SEEK_CUR), mv.nbytes))
        if direct and self._fail is not None and len(self._log) > self._at:
            raise OSError(self._fail, os.strerror(self._fail))
        return self._f.write(mv)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _record(monkeypatch, log, **kw) -> None:
    real_open = open

    def rec_open(file, mode="r", buffering=-1, *args, **kwargs):
        f = real_open(file, mode, buffering, *args, **kwargs)
        return _Recorder(f, log, **kw) if buffering == 0 else f

    monkeypatch.setattr(write_mod, "open", rec_open, raising=False)


def test_direct_writes_are_whole_aligned_blocks_and_only_the_tail_is_buffered(disk, monkeypatch):
    """Each direct write starts at a multiple of 4096 bytes of the file and is whole buffers
    long; only the last write (the tail, under 4096 bytes) has O_DIRECT off; together they
    cover the file once, in order."""
    monkeypatch.setattr(write_mod, "DIRECT_BYTES", SMALL_BUFFER)
    log: list = []
    _record(monkeypatch, log)
    tensors = _tensors(1, [(7 * SMALL_BUFFER + 5000, None), (32 * 512 * 9, 512)])
    direct, *rec = _write(disk / "a.safetensors", tensors, chunk=200_000)
    _check(disk / "a.safetensors", tensors, *rec)
    assert direct and len(log) >= 8
    assert all(d and off % 4096 == 0 and n % 4096 == 0 for d, off, n in log[:-1]), log
    assert not log[-1][0] and log[-1][2] < 4096
    ends = [0] + [off + n for _, off, n in log]
    assert [off for _, off, _ in log] == ends[:-1] and ends[-1] == rec[0]


def test_a_refused_direct_write_is_written_buffered(disk, monkeypatch):
    """A file system that takes the O_DIRECT flag but refuses a write (EINVAL: e.g. a block
    size above 4096) gets that write and the rest of the file buffered: same bytes."""
    monkeypatch.setattr(write_mod, "DIRECT_BYTES", SMALL_BUFFER)
    log: list = []
    _record(monkeypatch, log, fail=errno.EINVAL, at=2)
    tensors = _tensors(2, [(6 * SMALL_BUFFER + 77, None), (32 * 256 * 8, 256)])
    _, *rec = _write(disk / "a.safetensors", tensors, chunk=100_000)
    _check(disk / "a.safetensors", tensors, *rec)
    assert [d for d, _, _ in log[:3]] == [True, True, True] and not any(d for d, _, _ in log[3:])


def test_a_failed_direct_write_is_reported_and_no_file_is_left(disk, monkeypatch):
    """An I/O error on the I/O thread (EIO) reaches the caller as one line naming the file;
    no write follows the failed one, and the half-written file is removed."""
    from mxfp8_convert.errors import OutputError

    monkeypatch.setattr(write_mod, "DIRECT_BYTES", SMALL_BUFFER)
    log: list = []
    _record(monkeypatch, log, fail=errno.EIO, at=1)
    path = disk / "a.safetensors"
    with pytest.raises(OutputError, match=r"a\.safetensors: Input/output error"):
        _write(path, _tensors(3, [(8 * SMALL_BUFFER, None)]), chunk=1 << 20)
    assert [off for _, off, _ in log] == [0, SMALL_BUFFER]
    assert not path.exists()


@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_conversions_on_disk_and_on_ramfs_are_the_same_bytes(tmp_path, disk, mount_fs, backend):
    """A whole conversion written O_DIRECT (disk) and buffered (ramfs) gives the same files;
    the cutlass weights are the source's bytes (as cp would copy them)."""
    from tests.test_convert import _wide_mxfp8

    src = _wide_mxfp8(tmp_path / "src")
    convert(src, backend, disk / "direct")
    ram = mount_fs("ramfs")
    convert(src, backend, ram / "buffered")
    names = sorted(os.listdir(disk / "direct"))
    assert names == sorted(os.listdir(ram / "buffered"))
    for n in names:
        a, b = (disk / "direct" / n).read_bytes(), (ram / "buffered" / n).read_bytes()
        if n != COMPLETE_MARKER:  # the marker names the destination's own path
            assert a == b, n
    got, _ = load_all(disk / "direct")
    want, _ = load_all(src)
    w = "model.layers.0.mlp.down_proj.weight"
    shuffled = _p32(want[w].view(torch.uint8).numpy().tobytes(), want[w].shape[1])
    assert got[w].view(torch.uint8).numpy().tobytes() == (
        shuffled if backend == "trtllm" else want[w].view(torch.uint8).numpy().tobytes())
    assert leftovers(tmp_path) == [] and leftovers(disk) == []


def _write_scanned(path, tensors, chunk: int = 3 << 20, nan_at: list | None = None):
    """``_write`` with a scan and a source hash per tensor: returns, per tensor, the (offset,
    length) of every piece the scan saw and the source hash's digest. ``nan_at`` (a list)
    makes the scan refuse 0x7F/0xFF bytes, noting the tensor offset of the first one."""
    from mxfp8_convert.read import find_bytes

    w = ShardWriter(path, [(n, "U8", (len(b),), len(b)) for n, b, _ in tensors], {"k": "v"})
    seen: dict[str, list] = {}
    digests: dict[str, str] = {}
    try:
        for name, b, row in tensors:
            granule = 32 * row if row else 1
            step = max(granule, chunk // granule * granule)
            source = xxhash.xxh3_64()
            for at in range(0, len(b), step):
                def scan(piece, off, base=at, name=name):
                    seen.setdefault(name, []).append((base + off, piece.nbytes))
                    if nan_at is not None and (hit := find_bytes(piece, b"\x7f\xff")) >= 0:
                        nan_at.append(base + off + hit)
                        raise ValueError(f"{name}: NaN")
                w.write(memoryview(b)[at:at + step], scan=scan, source=source,
                        lay_out=p32_rows(row) if row else None, granule=granule)
            w._drain(0)  # the writer thread has hashed this tensor
            digests[name] = source.hexdigest()
        return seen, digests, w.close()
    except BaseException:
        w.abort()
        raise


def test_direct_pieces_cover_every_byte_once_in_order(disk):
    """With the real 8 MiB buffers, each tensor's bytes reach the scan and the source hash
    once each, in order, in pieces of up to ``DIRECT_PIECE`` (larger than the buffered
    path's ``WRITE_PIECE``) cut at whole 32-row blocks; the file is the header and the
    tensors as built by hand, P32 rows shuffled. A tensor's last write under
    ``COALESCE_BYTES`` (9 MiB + 3 bytes in 3 MiB writes) is scanned and hashed after the
    queued chunks before it, not ahead of them: its source digest is the bytes' xxh3_64."""
    tensors = _tensors(4, [(32 * 8192 * 40, 8192), (9 * 2**20 + 3, None), (2 * 2**20, None),
                           (32 * 96 * 700, 96)])
    seen, digests, (size, digest) = _write_scanned(disk / "a.safetensors", tensors)
    _check(disk / "a.safetensors", tensors, size, digest)
    for name, b, row in tensors:
        pieces = seen[name]
        ends = [0] + [at + n for at, n in pieces]
        assert [at for at, _ in pieces] == ends[:-1] and ends[-1] == len(b), name
        if row:
            assert all(n % (32 * row) == 0 for _, n in pieces), name
        assert max(n for _, n in pieces) <= write_mod.DIRECT_PIECE
        assert digests[name] == xxhash.xxh3_64(b).hexdigest(), name
    assert max(n for p in seen.values() for _, n in p) > write_mod.WRITE_PIECE


def test_the_first_nan_is_found_whatever_the_pieces_and_no_file_is_left(disk):
    """Two NaN bytes in one tensor, the first 1 MiB + 7 bytes in (0xFF), the other further on
    (0x7F) within the same direct-write buffer: the scan refuses the first one, and the
    half-written file is removed."""
    g = np.random.default_rng(5)
    raw = bytearray(g.integers(0, 0x7f, 5 * 2**20, dtype=np.uint8).tobytes())  # no NaN byte
    raw[2**20 + 7], raw[2**20 + 300_000] = 0xFF, 0x7F
    path = disk / "a.safetensors"
    found: list = []
    with pytest.raises(ValueError, match="t0: NaN"):
        _write_scanned(path, [("t0", bytes(raw), None)], chunk=4 << 20, nan_at=found)
    assert found == [2**20 + 7]
    assert not path.exists()
