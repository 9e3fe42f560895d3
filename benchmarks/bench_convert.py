"""Convert a synthetic >= 4 GB MXFP8 checkpoint and, in the same run, `cp -r` the same files.

Reports both times, their ratio, the CPU time (user + system) of each process and the
converter's peak RSS (all measured on child processes with ``os.wait4``). cp's CPU time leaves
out the kernel's writeback threads, which write its data back during ``sync``; the converter
writes its shards with O_DIRECT (``write.ShardWriter``: no page cache, no writeback), so the
submission of its writes is in its own figure. ``--baseline`` runs another tree beside it, e.g.
one that writes through the page cache. ``--timeline`` samples the disk that holds ``--dir``
(``/proc/diskstats``, every 2 ms) while each process runs: when its first and last writes reach
the disk, the write rate between them, how busy the disk was, how often its queue was empty,
and the bytes read from it (a source served from the page cache reads none).
Usage: python benchmarks/bench_convert.py [--gb 4] [--dir bench-data] [--backend trtllm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _env import banner  # noqa: E402

# (name, N, K): Llama-3-70B-like shapes; the largest weight is 512 MiB (16384 x 32768)
SHAPES = [("mlp.down_proj", 16384, 32768), ("mlp.up_proj", 28672, 8192),
          ("self_attn.q_proj", 8192, 8192)]


def _device(path: Path) -> str | None:
    """The /proc/diskstats name of the block device (the whole disk) holding ``path``."""
    dev = os.stat(path).st_dev
    try:
        sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    except OSError:
        return None
    if (sysfs / "partition").exists():
        sysfs = sysfs.parent
    return sysfs.name if sysfs.exists() else None


def _diskstats(device: str) -> tuple[int, int, int, int]:
    """Bytes read, bytes written, I/Os in flight and busy milliseconds of ``device``."""
    with open("/proc/diskstats") as f:
        for line in f:
            x = line.split()
            if x[2] == device:
                return int(x[5]) * 512, int(x[9]) * 512, int(x[11]), int(x[12])
    raise SystemExit(f"{device}: not in /proc/diskstats")


class Timeline:
    """/proc/diskstats of one device sampled every ``every`` seconds, from ``start()`` to
    ``stop()``; ``summary()`` times its write phase relative to ``start()``. Whole-disk
    counters: other processes' I/O on the same disk counts too."""

    def __init__(self, device: str, every: float = 0.002) -> None:
        self.device, self.every = device, every
        self.samples: list[tuple[float, int, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), *_diskstats(self.device)))
            time.sleep(self.every)

    def start(self) -> float:
        self.samples.append((time.perf_counter(), *_diskstats(self.device)))
        self._thread.start()
        return self.samples[0][0]

    def stop(self) -> None:
        time.sleep(5 * self.every)
        self._stop.set()
        self._thread.join()

    def summary(self, t0: float, t_exit: float) -> dict:
        """Seconds from ``t0`` to the first 16 MiB and the last MiB written on the disk; the
        rate between them, the share of that time the disk was busy and of samples with no
        I/O in flight; seconds from the last write to the process's exit; bytes read."""
        s = self.samples
        r0, w0 = s[0][1], s[0][2]
        total = s[-1][2] - w0
        if total < 32 << 20:
            return {"written": total}
        first = next(x for x in s if x[2] - w0 >= 16 << 20)
        last = next(x for x in s if x[2] - w0 >= total - (1 << 20))
        phase = [x for x in s if first[0] <= x[0] <= last[0]]
        span = max(last[0] - first[0], 1e-9)
        return {"first_write_s": round(first[0] - t0, 3), "last_write_s": round(last[0] - t0, 3),
                "tail_s": round(t_exit - last[0], 3), "written": total,
                "write_gb_per_s": round((last[2] - first[2]) / span / 1e9, 3),
                "busy": round((last[4] - first[4]) / 1e3 / span, 3),
                "queue_empty": round(sum(1 for x in phase if x[3] == 0) / len(phase), 3),
                "read": s[-1][1] - r0}


def timed(cmd: list[str], device: str | None = None) -> tuple[float, float, int, dict | None]:
    """Wall time, CPU time (user + system), peak RSS (bytes) of one child process and, with
    ``device``, its disk timeline (``Timeline.summary``)."""
    timeline = Timeline(device) if device else None
    t = timeline.start() if timeline else time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    t_exit = time.perf_counter()
    dt = t_exit - t
    if timeline:
        timeline.stop()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{cmd[0]} failed with exit code {os.waitstatus_to_exitcode(status)}")
    line = timeline.summary(t, t_exit) if timeline else None
    return dt, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, line  # KiB on Linux


def warm(src: Path, drop: bool = False) -> None:
    """The source's shards read into the page cache; with ``drop``, after emptying it (root:
    every other cached file out first, so each process starts with the same free memory)."""
    if drop:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    subprocess.run(["cat", *map(str, src.glob("*.safetensors"))], stdout=subprocess.DEVNULL,
                   check=True)


def against_cp(src: Path, dst: Path, contenders: dict[str, list[str]], repeat: int,
               device: str | None = None, drop_caches: bool = False):
    """``cp -r src dst`` + ``sync`` and each contender (given ``-o dst``), interleaved
    ``repeat`` times, each from a synced, empty destination (with ``drop_caches``, and a page
    cache holding only the source). Returns per name the lists of wall and CPU seconds, the
    peak RSS and (with ``device``) the disk timelines; cp's timeline covers ``sh -c 'cp -r ...
    && sync'``, one process."""
    wall: dict[str, list[float]] = {"cp -r + sync": []}
    cpu: dict[str, list[float]] = {"cp -r + sync": []}
    rss: dict[str, int] = {}
    lines: dict[str, list] = {}
    for _ in range(repeat):
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        if drop_caches:
            warm(src, drop=True)
        if device:
            t, c, _, line = timed(["sh", "-c", 'cp -r "$0" "$1" && sync', str(src), str(dst)],
                                  device)
            lines.setdefault("cp -r + sync", []).append(line)
        else:
            t_cp, c_cp, _, _ = timed(["cp", "-r", str(src), str(dst)])
            t_sync, c_sync, _, _ = timed(["sync"])
            t, c = t_cp + t_sync, c_cp + c_sync
        wall["cp -r + sync"].append(t)
        cpu["cp -r + sync"].append(c)
        for name, cmd in contenders.items():
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            if drop_caches:
                warm(src, drop=True)
            t, c, r, line = timed([*cmd, "-o", str(dst)], device)
            wall.setdefault(name, []).append(t)
            cpu.setdefault(name, []).append(c)
            rss[name] = max(rss.get(name, 0), r)
            if line is not None:
                lines.setdefault(name, []).append(line)
    shutil.rmtree(dst, ignore_errors=True)
    return wall, cpu, rss, lines


def make_source(root: Path, gb: float) -> Path:
    import torch  # only in the child that makes the data: the timing parent stays small
    from safetensors.torch import save_file

    if (root / "model.safetensors.index.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weight_map, total, shard, layer = {}, 0, 0, 0
    while total < gb * 1e9:
        tensors = {}
        for name, n, k in SHAPES:
            p = f"model.layers.{layer}.{name}"
            w = torch.randint(0, 126, (n, k), dtype=torch.uint8, generator=gen)
            tensors[f"{p}.weight"] = w.view(torch.float8_e4m3fn)
            tensors[f"{p}.weight_scale_inv"] = torch.randint(110, 130, (n, k // 32),
                                                             dtype=torch.uint8, generator=gen)
        norm = torch.ones(8192, dtype=torch.bfloat16)
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = norm
        fn = f"model-{shard + 1:05d}.safetensors"
        save_file(tensors, str(root / fn), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fn
            total += t.numel() * t.element_size()
        shard += 1
        layer += 1
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic"}}))
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--dir", default="bench-data")
    ap.add_argument("--backend", nargs="+", default=["trtllm", "cutlass"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1],
                    help="also time --workers N (e.g. 1 2)")
    ap.add_argument("--baseline", help="also time the converter at this source tree (e.g. an older "
                    "commit's `git archive`), as 'NAME@baseline'")
    ap.add_argument("--timeline", action="store_true",
                    help="sample the disk holding --dir while each process runs (Timeline)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="before every process, empty the page cache (root) and read the source "
                    "back: cp's time depends on how much memory it must first reclaim")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "convert.json"))
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    base = Path(args.dir)
    if args.make_only:
        make_source(base / "src", args.gb)
        return
    # made in a child so that this process stays small and cannot skew the RSS figures
    subprocess.run([sys.executable, __file__, "--make-only", "--gb", str(args.gb), "--dir",
                    args.dir], check=True)
    src = base / "src"
    size = sum(p.stat().st_size for p in src.iterdir())
    warm(src)
    contenders = {
        f"mxfp8-convert {backend}" + (f" --workers {w}" if w > 1 else ""):
            [sys.executable, "-P", "-m", "mxfp8_convert", str(src), "--backend", backend,
             "--quiet", "--workers", str(w)]
        for backend in args.backend for w in args.workers
    }
    if args.baseline:  # the same commands with the older tree first on the path
        for backend in args.backend:
            contenders[f"mxfp8-convert {backend}@baseline"] = [
                "env", f"PYTHONPATH={Path(args.baseline).resolve()}", sys.executable, "-P", "-m",
                "mxfp8_convert", str(src), "--backend", backend, "--quiet"]
    device = _device(base) if args.timeline else None
    if args.timeline and device is None:
        raise SystemExit(f"{base}: no block device found for --timeline")
    results, cpu, rss, lines = against_cp(src, base / "dst", contenders, args.repeat, device,
                                          args.drop_caches)

    machine = banner()  # after the timings: importing torch must not inflate the children's RSS
    print(machine)
    shards = len(list(src.glob("*.safetensors")))
    print(f"source: {size / 1e9:.2f} GB in {shards} shards, largest tensor 512 MiB; "
          f"median of {args.repeat} interleaved runs")
    report(results, cpu, rss, size, args, machine, lines)


def report(results: dict, cpu: dict, rss: dict, size: int, args, machine: str,
           lines: dict | None = None) -> None:
    """Median per contender, the ratio to cp of every interleaved round (its spread) and the
    median CPU seconds per GB."""
    cp = results["cp -r + sync"]
    base_t = statistics.median(cp)
    rows = []
    for name, ts in results.items():
        t = statistics.median(ts)
        ratios = [c / x for c, x in zip(cp, ts, strict=True)]
        extra = f"  peak RSS {rss[name] / 2**20:.0f} MiB" if name in rss else ""
        c = statistics.median(cpu[name])
        runs = ", ".join(f"{x:.2f}" for x in ts)
        print(f"{name:36s} {t:7.2f} s  {size / t / 1e9:5.2f} GB/s  vs cp+sync {base_t / t:4.2f}x "
              f"(per round {min(ratios):.2f}-{max(ratios):.2f}x)  CPU {c:5.2f} s "
              f"({c / size * 1e9:.2f} s/GB){extra}  runs {runs}")
        row = {"name": name, "seconds": ts, "cpu_seconds": cpu[name],
               "ratio_to_cp_per_round": ratios, "peak_rss": rss.get(name)}
        if lines and name in lines:
            row["timeline"] = lines[name]
            for x in lines[name]:
                if "write_gb_per_s" in x:
                    print(f"    disk: first write {x['first_write_s']:.2f} s, last "
                          f"{x['last_write_s']:.2f} s, exit +{x['tail_s']:.2f} s; "
                          f"{x['write_gb_per_s']:.2f} GB/s between, busy {x['busy']:.0%}, "
                          f"queue empty {x['queue_empty']:.0%}; read {x['read'] / 1e6:.0f} MB")
        rows.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "machine": machine,
        "bytes": size, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
