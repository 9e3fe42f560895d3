"""Convert a synthetic >= 4 GB MXFP8 checkpoint and, in the same run, `cp -r` the same files.

Reports both times, their ratio and the converter's peak RSS (measured on a child process).
Usage: python benchmarks/bench_convert.py [--gb 4] [--dir bench-data] [--backend trtllm]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from _env import banner  # noqa: E402

# (name, N, K): Llama-3-70B-like shapes; the largest weight is 512 MiB (16384 x 32768)
SHAPES = [("mlp.down_proj", 16384, 32768), ("mlp.up_proj", 28672, 8192), ("self_attn.q_proj", 8192, 8192)]


def make_source(root: Path, gb: float) -> Path:
    if (root / "model.safetensors.index.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weight_map, total, shard, layer = {}, 0, 0, 0
    while total < gb * 1e9:
        tensors = {}
        for name, n, k in SHAPES:
            p = f"model.layers.{layer}.{name}"
            tensors[f"{p}.weight"] = torch.randint(0, 126, (n, k), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
            tensors[f"{p}.weight_scale_inv"] = torch.randint(110, 130, (n, k // 32), dtype=torch.uint8, generator=gen)
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(8192, dtype=torch.bfloat16)
        fn = f"model-{shard + 1:05d}.safetensors"
        save_file(tensors, str(root / fn), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fn
            total += t.numel() * t.element_size()
        shard += 1
        layer += 1
        del tensors
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic"}}))
    return root


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall time and peak RSS (bytes) of a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    dt = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return dt, max(after, before) * 1024  # ru_maxrss is KiB on Linux; max over children so far


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--dir", default="bench-data")
    ap.add_argument("--backend", default="trtllm")
    args = ap.parse_args()
    print(banner())
    base = Path(args.dir)
    src = make_source(base / "src", args.gb)
    size = sum(p.stat().st_size for p in src.iterdir())
    out, cp_out = base / f"out-{args.backend}", base / "cp"
    for p in (out, cp_out):
        shutil.rmtree(p, ignore_errors=True)
    subprocess.run(["cat", *map(str, src.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)  # warm the page cache

    t_cp, _ = timed(["cp", "-r", str(src), str(cp_out)])
    t_sync, _ = timed(["sync"])
    t_conv, rss = timed([sys.executable, "-m", "mxfp8_convert", str(src), "--backend", args.backend, "-o", str(out), "--quiet"])
    for p in (out, cp_out):
        shutil.rmtree(p, ignore_errors=True)

    print(f"source: {size / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} shards, largest tensor 512 MiB")
    print(f"cp -r:             {t_cp:7.2f} s  {size / t_cp / 1e9:6.2f} GB/s")
    print(f"cp -r + sync:      {t_cp + t_sync:7.2f} s  {size / (t_cp + t_sync) / 1e9:6.2f} GB/s")
    print(f"mxfp8-convert {args.backend}: {t_conv:7.2f} s  {size / t_conv / 1e9:6.2f} GB/s (fsync'd)")
    print(f"speed vs cp: {t_cp / t_conv:.2f}x   vs cp+sync: {(t_cp + t_sync) / t_conv:.2f}x")
    print(f"converter peak RSS: {rss / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
