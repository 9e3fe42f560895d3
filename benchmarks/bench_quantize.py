"""Benchmark mxfp8_convert.quantize: quantize, dequantize and the FP8-source conversions.

Run: ``python benchmarks/bench_quantize.py [--device cuda] [--rows 7168] [--cols 2048]
[--out results/quantize.json]``. Prints the environment, a memcpy baseline, and the median time
and GB/s (bytes read + written) of each operation; and two weights quantized with their error
one after the other, beside the same two on two threads at once (what a conversion does where
its ops run on one thread: ``convert.MODULES_IN_FLIGHT``). On CPU with the quantizer's C
accelerator built, each operation runs on it and on the torch path, rounds interleaved, with
the wall and CPU nanoseconds per element of both. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from mxfp8_convert import quantize
from mxfp8_convert.quantize import (
    block_fp8_to_mxfp8,
    dequantize_mxfp8,
    per_tensor_fp8_to_mxfp8,
    quantization_error,
    quantize_mxfp8,
    quantize_mxfp8_with_error,
)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(paths: dict, device: str, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each of ``paths`` (label -> (quantizer, fn)) or
    (label -> fn), their rounds interleaved."""
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in paths}
    for rnd in range(repeats + 1):  # round 0 warms up
        for label, fn in paths.items():
            backend, fn = fn if isinstance(fn, tuple) else (quantize._CQUANT, fn)
            saved, quantize._CQUANT = quantize._CQUANT, backend
            try:
                _sync(device)
                w0, c0 = time.perf_counter(), time.process_time()
                fn()
                _sync(device)
                if rnd:
                    times[label].append((time.perf_counter() - w0, time.process_time() - c0))
            finally:
                quantize._CQUANT = saved
    return {label: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
            for label, ts in times.items()}


def environment(device: str) -> str:
    try:
        fi = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        fi = "not installed"
    where = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor()
    return (f"torch {torch.__version__}, flashinfer {fi}, device {device} ({where}), "
            f"threads {torch.get_num_threads()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=7168)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    n, k, dev = args.rows, args.cols, args.device
    print(environment(dev))
    print(f"shape [{n}, {k}]")

    x = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    q, s = quantize_mxfp8(x)
    w = q  # any e4m3 bytes will do as an FP8 source
    pow2 = torch.full((-(-n // 128), -(-k // 128)), 2.0**-3, device=dev)
    odd = torch.rand(pow2.shape, device=dev) + 0.1
    mx_bytes = n * k + n * k // 32
    cases = [
        ("memcpy bf16 (baseline)", lambda: x.clone(), 4 * n * k),
        ("quantize_mxfp8 bf16", lambda: quantize_mxfp8(x), 2 * n * k + mx_bytes),
        ("dequantize_mxfp8 -> f32", lambda: dequantize_mxfp8(q, s), mx_bytes + 4 * n * k),
        ("quantization_error", lambda: quantization_error(x, q, s), 2 * n * k + mx_bytes),
        ("quantize_mxfp8_with_error", lambda: quantize_mxfp8_with_error(x), 2 * n * k + mx_bytes),
        ("block_fp8 lossless", lambda: block_fp8_to_mxfp8(w, pow2), n * k + n * k // 32),
        ("block_fp8 requantize", lambda: block_fp8_to_mxfp8(w, odd), n * k + mx_bytes),
        (
            "per_tensor requantize",
            lambda: per_tensor_fp8_to_mxfp8(w, torch.tensor(0.3, device=dev)),
            n * k + mx_bytes,
        ),
    ]
    pool = ThreadPoolExecutor(2)
    cases += [
        ("2x with_error, one by one", lambda: [quantize_mxfp8_with_error(x) for _ in range(2)],
         2 * (2 * n * k + mx_bytes)),
        ("2x with_error, 2 threads", lambda: list(pool.map(quantize_mxfp8_with_error, (x, x))),
         2 * (2 * n * k + mx_bytes)),
    ]
    native = quantize._CQUANT if dev == "cpu" else None
    rows = []
    for label, fn, nbytes in cases:
        paths = {"c": (native, fn), "torch": (None, fn)} if native else {"torch": (None, fn)}
        got = timed(paths, dev, args.repeats)
        if label == "memcpy bf16 (baseline)":
            got = {"c": got["torch"], "torch": got["torch"]} if native else got
        line = f"{label:30s}"
        elements = n * k * (2 if label.startswith("2x") else 1)
        row = {"case": label, "bytes": nbytes, "elements": elements}
        for path, (wall, cpu) in got.items():
            line += f"  {path} {wall * 1e3:8.2f} ms {wall / elements * 1e9:6.2f} ns/el"
            row[path] = {"wall_s": wall, "cpu_s": cpu, "ns_per_element": wall / elements * 1e9,
                         "cpu_ns_per_element": cpu / elements * 1e9,
                         "gb_per_s": nbytes / wall / 1e9}
        if native and label != "memcpy bf16 (baseline)":
            line += f"  torch/c {got['torch'][0] / got['c'][0]:5.2f}x"
        print(line)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "environment": environment(dev), "shape": [n, k],
                       "c_accelerator": native is not None, "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
