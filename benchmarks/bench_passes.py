"""CPU and wall time per GB of each pass the converter makes over one cached source shard.

The first touch of the mapped source, the e4m3 scan, the hashes, buffered 256 KiB writes with
writeback advice (what ``write.ShardWriter`` does), O_DIRECT writes of aligned 8 MiB buffers
from 1-4 threads (no user-space copy at all: the disk's direct-write speed) and
``copy_file_range`` (what ``cp`` does), each fsynced, in one process.
Usage: python benchmarks/bench_passes.py SHARD [--out DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from mxfp8_convert.read import find_bytes

PIECE = 256 << 10
NAN = b"\x7f\xff"


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


def one_pass(src: Path, out: Path) -> None:
    """Scan, both hashes and a buffered write per piece, writeback advised every 32 MiB."""
    mm, h, g = _mapped(src), xxhash.xxh3_64(), xxhash.xxh3_128()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with ThreadPoolExecutor(1) as flusher:
        last = 0
        for at in range(0, len(mm), PIECE):
            piece = memoryview(mm)[at:at + PIECE]
            find_bytes(piece, NAN)
            h.update(piece)
            g.update(piece)
            while piece.nbytes:
                piece = piece[os.write(fd, piece):]
            if at - last >= 32 << 20:
                flusher.submit(os.posix_fadvise, fd, 0, at, os.POSIX_FADV_DONTNEED)
                last = at
            del piece
    os.fsync(fd)
    os.close(fd)
    mm.close()


def direct(threads: int):
    def run(src: Path, out: Path) -> None:
        size, slab = src.stat().st_size, 8 << 20
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        buf = mmap.mmap(-1, slab)  # page-aligned, as O_DIRECT needs
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda off: os.pwrite(fd, buf, off), range(0, size - slab, slab)))
        os.fsync(fd)
        os.close(fd)
    return run


def copy_range(src: Path, out: Path) -> None:
    size = src.stat().st_size
    with open(src, "rb") as f:
        fd, off = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 0
        while off < size:
            off += os.copy_file_range(f.fileno(), fd, size - off, off, off)
        os.fsync(fd)
        os.close(fd)


PASSES = {"first touch + scan": scan, "scan + xxh3_64 + xxh3_128": scan_and_hashes,
          "one pass: scan, hashes, write": one_pass, "O_DIRECT 1 thread": direct(1),
          "O_DIRECT 2 threads": direct(2), "O_DIRECT 4 threads": direct(4),
          "copy_file_range (cp)": copy_range}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shard", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench-passes"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    size = args.shard.stat().st_size
    with open(args.shard, "rb") as f:  # into the page cache, as the benchmarks' sources are
        while f.read(64 << 20):
            pass
    for name, fn in PASSES.items():
        out = args.out / "out.bin"
        c0, t0 = _usage()
        fn(args.shard, out)
        c1, t1 = _usage()
        out.unlink(missing_ok=True)
        cpu, speed = (c1 - c0) / size * 1e9, size / (t1 - t0) / 1e9
        print(f"{name:32s} CPU {cpu:5.2f} s/GB  wall {speed:5.2f} GB/s")


if __name__ == "__main__":
    main()
