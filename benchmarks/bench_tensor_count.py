"""Per-tensor cost of a conversion from 1k to 100k tensors: it must stay flat (linear total time).

Synthetic MXFP8 checkpoints of N tensors (per layer one linear, weight [128, 256] + scale
[128, 8], and eight BF16 norms [64]; 1,000 tensors per shard; weights as holes), each converted
to trtllm by a fresh CLI process and planned by a fresh ``--dry-run`` process. Reports the wall
time, the time per tensor and the
marginal cost per tensor between successive sizes (which excludes start-up). Results as JSON
under ``benchmarks/results/``.

Usage:
    python benchmarks/bench_tensor_count.py [--counts 1000 10000 100000] [--dir /tmp/bench-count]
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
from _sparse import write_index, write_sparse_safetensors  # noqa: E402

PER_SHARD = 1000
PER_LAYER = 10
N, K = 128, 256


def make_source(root: Path, count: int) -> Path:
    if (root / "model.safetensors.index.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    layers = count // PER_LAYER
    per_shard = PER_SHARD // PER_LAYER
    shards = -(-layers // per_shard)
    weight_map, total = {}, 0
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = []
        for m in range(s * per_shard, min(layers, (s + 1) * per_shard)):
            tensors += [(f"model.layers.{m}.proj.weight", "F8_E4M3", (N, K)),
                        (f"model.layers.{m}.proj.weight_scale_inv", "U8", (N, K // 32))]
            tensors += [(f"model.layers.{m}.norm{j}.weight", "BF16", (64,))
                        for j in range(PER_LAYER - 2)]

        def data(name, dtype, shape):
            return bytes([127]) * (shape[0] * shape[1]) if dtype == "U8" else None

        total += write_sparse_safetensors(root / fn, tensors, data)
        weight_map.update({name: fn for name, _, _ in tensors})
    write_index(root, weight_map, total)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic"}}))
    return root


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--dir", default="/tmp/bench-count")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tensor_count.json"))
    args = ap.parse_args()
    base = Path(args.dir)
    cli = [sys.executable, "-P", "-m", "mxfp8_convert"]
    rows = []
    for count in args.counts:
        src = make_source(base / f"src-{count}", count)
        dst = base / f"dst-{count}"
        conv, dry = [], []
        for _ in range(args.repeat):  # interleaved: the same noise hits both
            shutil.rmtree(dst, ignore_errors=True)
            conv.append(timed([*cli, str(src), "--backend", "trtllm", "--quiet", "-o", str(dst)]))
            dry.append(timed([*cli, str(src), "--backend", "trtllm", "--quiet", "--dry-run",
                              "--json", "-o", str(dst) + "-dry"]))
        shutil.rmtree(dst, ignore_errors=True)
        rows.append({"tensors": count, "convert_s": conv, "dry_run_s": dry})
        c, d = statistics.median(conv), statistics.median(dry)
        print(f"{count:>7} tensors  convert {c:7.2f} s ({c / count * 1e6:6.1f} us/tensor)  "
              f"dry-run {d:6.2f} s ({d / count * 1e6:6.1f} us/tensor)  runs {conv} / {dry}",
              flush=True)
    for a, b in zip(rows, rows[1:], strict=False):
        dn = b["tensors"] - a["tensors"]
        mc = (statistics.median(b["convert_s"]) - statistics.median(a["convert_s"])) / dn * 1e6
        md = (statistics.median(b["dry_run_s"]) - statistics.median(a["dry_run_s"])) / dn * 1e6
        print(f"marginal {a['tensors']}->{b['tensors']}: convert {mc:.1f} us/tensor, "
              f"dry-run {md:.1f} us/tensor")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(sys.argv), "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
