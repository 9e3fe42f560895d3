"""Convert the 17.4 GB MXFP8 DeepSeek-V3 subset (sparse files: reads free) beside `cp` + `sync`.

The source is ``make_deepseek_sparse.py --format mxfp8 --layers 4``: embeddings, head, the 3
dense layers and the first MoE layer (256 routed experts and the shared one), headers and
UE8M0 scales real, weight bytes holes. Each contender writes all 17.4 GB: the yardstick is
``cp -r --sparse=never`` + ``sync``, because plain ``cp -r`` (``--sparse=auto``) finds the holes
and writes almost nothing (0.2 s for 4.3 GB here), while the converter writes every byte.
Contenders: cutlass, and trtllm with the experts fused (``w13``/``w2`` stacked tensors). Each
is a fresh process, interleaved with cp, from a synced empty destination that is deleted after
each run (only one 17.4 GB output exists at a time). Per process: wall time, CPU (user +
system) and peak RSS, from ``os.wait4``.

Usage: python benchmarks/bench_deepseek_sparse.py [--dir /tmp/ds-sparse] [--repeat 1]
       [--experts 256] [--backend cutlass trtllm] [--baseline TREE] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_convert import timed  # noqa: E402

CP = "cp -r --sparse=never + sync"


def run_round(src: Path, dst: Path, contenders: dict[str, list[str]], rows: dict) -> None:
    """One interleaved round: cp + sync, then each contender, each from an empty destination."""
    def fresh() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)

    fresh()
    t_cp, c_cp, _, _ = timed(["cp", "-r", "--sparse=never", str(src), str(dst)])
    t_sync, c_sync, _, _ = timed(["sync"])
    rows[CP]["seconds"].append(t_cp + t_sync)
    rows[CP]["cpu_seconds"].append(c_cp + c_sync)
    for name, cmd in contenders.items():
        fresh()
        t, c, r, _ = timed([*cmd, "-o", str(dst)])
        rows[name]["seconds"].append(t)
        rows[name]["cpu_seconds"].append(c)
        rows[name]["peak_rss"].append(r)
    shutil.rmtree(dst, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ds-sparse")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--experts", type=int, default=256, help="fewer for quick runs")
    ap.add_argument("--backend", nargs="+", default=["cutlass", "trtllm"])
    ap.add_argument("--baseline", help="also time the converter at this source tree")
    ap.add_argument("--out",
                    default=str(Path(__file__).parent / "results" / "deepseek_sparse.json"))
    args = ap.parse_args()
    base = Path(args.dir)
    src = base / "src"
    if not (src / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "make_deepseek_sparse.py"),
                        str(src), "--format", "mxfp8", "--layers", "4",
                        "--experts", str(args.experts)], check=True)
    shards = sorted(src.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in src.iterdir())
    contenders = {}
    for backend in args.backend:
        cmd = [sys.executable, "-P", "-m", "mxfp8_convert", str(src), "--backend", backend,
               "--quiet"]
        label = f"mxfp8-convert {backend}" + (" (fused MoE)" if backend == "trtllm" else "")
        contenders[label] = cmd
        if args.baseline:
            contenders[f"{label}@baseline"] = [
                "env", f"PYTHONPATH={Path(args.baseline).resolve()}", *cmd]
    rows = {n: {"seconds": [], "cpu_seconds": [], "peak_rss": []} for n in [CP, *contenders]}
    for _ in range(args.repeat):
        run_round(src, base / "dst", contenders, rows)

    from _env import banner  # after the timings: torch must not inflate the children's RSS

    machine = banner()
    print(machine)
    print(f"source: {size / 1e9:.2f} GB in {len(shards)} sparse shards; {args.repeat} round(s)")
    cp = rows[CP]["seconds"]
    for name, row in rows.items():
        ts, cs = row["seconds"], row["cpu_seconds"]
        row["ratio_to_cp_per_round"] = [a / b for a, b in zip(cp, ts, strict=True)]
        rss = f"  peak RSS {max(row['peak_rss']) / 2**20:.0f} MiB" if row["peak_rss"] else ""
        t = statistics.median(ts)
        print(f"{name:40s} {t:7.2f} s  vs cp {statistics.median(cp) / t:4.2f}x"
              f"  CPU {statistics.median(cs):6.2f} s{rss}"
              f"  runs {', '.join(f'{x:.1f}' for x in ts)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "machine": machine, "bytes": size,
        "rows": [{"name": n, **r} for n, r in rows.items()]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
