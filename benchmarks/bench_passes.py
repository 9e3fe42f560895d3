"""CPU and wall time per GB of each pass the converter makes over one cached source shard.

Raw passes: the first touch of the mapped source, the e4m3 scan, the hashes,
``copy_file_range`` (what ``cp`` does), and O_DIRECT writes of one aligned buffer over and
over (no user-space copy at all: the disk's direct-write speed) from 1-4 threads and in
8 / 32 MiB writes, into a new file (extending it, as the converter does), one preallocated
with ``posix_fallocate`` (unwritten extents: concurrent direct writes on ext4), and over a
file already written (no block allocation at all: what the disk takes once blocks exist).
Then the writer itself (``write.ShardWriter``, the converter's one pass:
scan, source hash, layout, output hash, write) on the shard's bytes, kept as they are
(cutlass) and P32-shuffled (trtllm), both ways it writes: O_DIRECT from page-aligned buffers
(its default; also in the 256 KiB pieces of the buffered path) and buffered with writeback
advice (what it does where O_DIRECT is refused).
Each output is fsynced and removed; all in one process, passes interleaved over ``--rounds``.
Usage: python benchmarks/bench_passes.py SHARD [--out DIR] [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from mxfp8_convert import write
from mxfp8_convert.read import find_bytes
from mxfp8_convert.transform import CHUNK_BYTES, p32_rows

PIECE = 256 << 10
NAN = b"\x7f\xff"
ROW = 8192  # bytes per row for the P32 shuffle (a 8192-wide e4m3 weight)


def _usage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, time.perf_counter()


def _mapped(path: Path):
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def scan(src: Path, out: Path) -> None:
    mm = _mapped(src)
    for at in range(0, len(mm), PIECE):
        find_bytes(memoryview(mm)[at:at + PIECE], NAN)
    mm.close()


def scan_and_hashes(src: Path, out: Path) -> None:
    mm, h, g = _mapped(src), xxhash.xxh3_64(), xxhash.xxh3_128()
    for at in range(0, len(mm), PIECE):
        piece = memoryview(mm)[at:at + PIECE]
        find_bytes(piece, NAN)
        h.update(piece)
        g.update(piece)
        del piece
    mm.close()


def direct(threads: int, slab: int, prealloc: bool = False, overwrite: bool = False):
    def run(src: Path, out: Path) -> None:
        size = src.stat().st_size
        flags = os.O_WRONLY | os.O_CREAT | os.O_DIRECT | (0 if overwrite else os.O_TRUNC)
        fd = os.open(out, flags)
        if prealloc:
            os.posix_fallocate(fd, 0, size)
        buf = mmap.mmap(-1, slab)  # page-aligned, as O_DIRECT needs
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda off: os.pwrite(fd, buf, off), range(0, size - slab, slab)))
        os.fsync(fd)
        os.close(fd)

    if overwrite:  # the file written and synced first, untimed: its blocks exist
        run.prepare = direct(1, slab)
    return run


def copy_range(src: Path, out: Path) -> None:
    size = src.stat().st_size
    with open(src, "rb") as f:
        fd, off = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 0
        while off < size:
            off += os.copy_file_range(f.fileno(), fd, size - off, off, off)
        os.fsync(fd)
        os.close(fd)


def writer(shuffle: bool, direct_io: bool, piece: int | None = None):
    """The converter's writer over the shard's bytes as one tensor, in 32 MiB chunks from the
    mapping: checked, hashed, shuffled (``shuffle``) and written, then fsynced; ``piece``:
    bytes per step of its pass over direct writes instead of ``write.DIRECT_PIECE``."""
    def run(src: Path, out: Path) -> None:
        mm = _mapped(src)
        granule = 32 * ROW if shuffle else 1
        n = len(mm) // (32 * ROW) * (32 * ROW)
        chunk = CHUNK_BYTES // granule * granule
        source = xxhash.xxh3_64()
        saved, saved_piece = write._O_DIRECT, write.DIRECT_PIECE
        write._O_DIRECT = saved if direct_io else 0  # as on a file system that refuses it
        write.DIRECT_PIECE = piece or saved_piece
        try:
            w = write.ShardWriter(out, [("w", "U8", (n,), n)], {})
            assert w.direct == direct_io, "O_DIRECT refused here: run on a disk file system"
            for at in range(0, n, chunk):
                w.write(memoryview(mm)[at:at + min(chunk, n - at)],
                        scan=lambda piece, _at: find_bytes(piece, NAN), source=source,
                        lay_out=p32_rows(ROW) if shuffle else None, granule=granule)
            w.close()
        finally:
            write._O_DIRECT, write.DIRECT_PIECE = saved, saved_piece
        write.fsync_paths([out])
        mm.close()
    return run


PASSES = {"first touch + scan": scan, "scan + xxh3_64 + xxh3_128": scan_and_hashes,
          "copy_file_range (cp)": copy_range,
          "O_DIRECT 8 MiB, 1 thread": direct(1, 8 << 20),
          "O_DIRECT 8 MiB, 2 threads": direct(2, 8 << 20),
          "O_DIRECT 8 MiB, 4 threads, fallocated": direct(4, 8 << 20, prealloc=True),
          "O_DIRECT 8 MiB, 1 thread, overwrite": direct(1, 8 << 20, overwrite=True),
          "O_DIRECT 32 MiB, 1 thread": direct(1, 32 << 20),
          "writer, copy, buffered": writer(False, False),
          "writer, copy, O_DIRECT": writer(False, True),
          "writer, copy, O_DIRECT, 256 KiB pieces": writer(False, True, 256 << 10),
          "writer, P32, buffered": writer(True, False),
          "writer, P32, O_DIRECT": writer(True, True),
          "writer, P32, O_DIRECT, 256 KiB pieces": writer(True, True, 256 << 10)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shard", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench-passes"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    size = args.shard.stat().st_size
    with open(args.shard, "rb") as f:  # into the page cache, as the benchmarks' sources are
        while f.read(64 << 20):
            pass
    rows: dict[str, list] = {name: [] for name in PASSES}
    for r in range(args.rounds):
        for name, fn in PASSES.items():
            out = args.out / "out.bin"
            out.unlink(missing_ok=True)
            if hasattr(fn, "prepare"):
                fn.prepare(args.shard, out)
            os.sync()
            c0, t0 = _usage()
            fn(args.shard, out)
            c1, t1 = _usage()
            out.unlink(missing_ok=True)
            cpu, speed = (c1 - c0) / size * 1e9, size / (t1 - t0) / 1e9
            rows[name].append({"cpu_s_per_gb": round(cpu, 3), "gb_per_s": round(speed, 3)})
            print(f"round {r + 1}  {name:38s} CPU {cpu:5.2f} s/GB  wall {speed:5.2f} GB/s",
                  flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shard": str(args.shard),
            "bytes": size, "passes": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
