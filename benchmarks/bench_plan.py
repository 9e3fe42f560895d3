"""Planning time at DeepSeek-V3 size: ``--dry-run`` and ``inspect`` of the sparse checkpoints that
``make_deepseek_sparse.py`` builds (91,991 tensors in 163 shards; block-FP8 with real float32
scales, and MXFP8), each a fresh CLI process, interleaved, optionally beside an older tree
(``--baseline``: e.g. a commit's ``git archive``). Also the output shards each tree's trtllm
plan lays out (count, empty ones, largest and smallest). Results as JSON under
``benchmarks/results/``.

The block-FP8 plan reads 45,808 scales (166 MB). By default every timed process finds them in
the page cache (an untimed dry run of each tree reads them first); ``--cold`` drops the
checkpoint's pages from the cache (``POSIX_FADV_DONTNEED``, its files only) before every timed
process instead.

Each tree's package is compiled to bytecode first (``compileall``), as ``pip install`` does: a
``git archive`` tree has no ``__pycache__``, and where ``PYTHONDONTWRITEBYTECODE`` is set (this
VM sets it) every process would compile every module from source again (0.1-0.3 s of CPU a
process), a cost no installed copy pays.

Usage: python benchmarks/bench_plan.py [--dir /tmp/bench-plan] [--repeat 3] [--baseline DIR]
       [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def timed(cmd: list[str], env: dict) -> tuple[float, float, bytes]:
    """Wall seconds, CPU seconds (user + system) and stdout of one child: on a shared machine
    the CPU time is the steadier figure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, env=env).stdout
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def precompile(tree: str) -> None:
    """Compile the package of ``tree`` (a ``PYTHONPATH``) to bytecode once, as installing it
    does."""
    for entry in tree.split(os.pathsep):
        if (Path(entry) / "mxfp8_convert").is_dir():
            subprocess.run([sys.executable, "-m", "compileall", "-q",
                            str(Path(entry) / "mxfp8_convert")], check=True)


def drop_cache(folder: Path) -> None:
    """Drop the page cache of the files of ``folder`` (clean pages only; nothing else's)."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def shard_stats(doc: dict) -> dict:
    """The output shards of a ``--dry-run --json`` document."""
    sizes = [s["nbytes"] for s in doc["plan"]["shards"]]
    empty = sum(1 for s in doc["plan"]["shards"] if not s["tensors"])
    return {"shards": len(sizes), "empty": empty, "largest_gb": max(sizes) / 1e9,
            "smallest_gb": min(sizes) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/bench-plan")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline")
    ap.add_argument("--out", default=str(HERE / "results" / "plan.json"))
    ap.add_argument("--cold", action="store_true",
                    help="drop the checkpoint's page cache before every timed process")
    args = ap.parse_args()
    base = Path(args.dir)
    trees = {"new": os.environ.get("PYTHONPATH", str(HERE.parent))}
    if args.baseline:
        trees["baseline"] = str(Path(args.baseline).resolve())
    for path in trees.values():
        precompile(path)
    rows, shards = [], {}
    for fmt, scales in (("block_fp8", "real"), ("mxfp8", "holes")):
        src = base / fmt
        if not (src / "model.safetensors.index.json").exists():
            subprocess.run([sys.executable, str(HERE / "make_deepseek_sparse.py"), str(src),
                            "--format", fmt, "--scales", scales], check=True)
        jobs = {"dry-run trtllm": [str(src), "--backend", "trtllm", "--dry-run", "--json", "-o",
                                   str(base / "out")],
                "inspect": ["inspect", str(src), "--json"]}
        times: dict[str, list[tuple[float, float]]] = {}
        if not args.cold:  # the scales in the page cache for every timed process
            for path in trees.values():
                timed([sys.executable, "-P", "-m", "mxfp8_convert", *jobs["dry-run trtllm"]],
                      {**os.environ, "PYTHONPATH": path})
        for _ in range(args.repeat):
            for tree, path in trees.items():
                env = {**os.environ, "PYTHONPATH": path}
                for job, extra in jobs.items():
                    if args.cold:
                        drop_cache(src)
                    wall, cpu, out = timed([sys.executable, "-P", "-m", "mxfp8_convert", *extra],
                                           env)
                    times.setdefault(f"{job} {tree}", []).append((wall, cpu))
                    print(f"  {fmt} {job} {tree}: wall {wall:.2f} s, CPU {cpu:.2f} s", flush=True)
                    if job == "dry-run trtllm":
                        shards[f"{fmt} {tree}"] = shard_stats(json.loads(out))
        for name, ts in times.items():
            wall, cpu = [w for w, _ in ts], [c for _, c in ts]
            print(f"{fmt:9s} {name:24s} wall median {statistics.median(wall):6.2f} s (runs "
                  f"{', '.join(f'{t:.2f}' for t in wall)})  CPU median "
                  f"{statistics.median(cpu):6.2f} s (runs {', '.join(f'{t:.2f}' for t in cpu)})",
                  flush=True)
            rows.append({"format": fmt, "job": name, "wall_s": wall, "cpu_s": cpu})
        for tree in trees:
            cpu = {job: statistics.median(r["cpu_s"]) for r in rows for job in jobs
                   if r["format"] == fmt and r["job"] == f"{job} {tree}"}
            print(f"{fmt:9s} {tree}: inspect / dry run (CPU medians) "
                  f"{cpu['inspect'] / cpu['dry-run trtllm']:.2f}x; trtllm output shards "
                  f"{shards[f'{fmt} {tree}']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(sys.argv), "page_cache": "cold" if args.cold else "warm",
           "rows": rows, "trtllm_output_shards": shards}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
