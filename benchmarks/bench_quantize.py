"""Benchmark mxfp8_convert.quantize: quantize, dequantize and the FP8-source conversions.

Run: ``python benchmarks/bench_quantize.py [--device cuda] [--rows 7168] [--cols 2048]``.
Prints the environment, a memcpy baseline, and the median time and GB/s (bytes read + written)
of each operation; and two weights quantized with their error one after the other, beside the
same two on two threads at once (what a conversion does where its ops run on one thread:
``convert.MODULES_IN_FLIGHT``). Never collected by pytest.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

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


def median_seconds(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    for label, fn, nbytes in cases:
        sec = median_seconds(fn, dev, args.repeats)
        print(f"{label:30s} {sec * 1e3:9.2f} ms  {nbytes / sec / 1e9:8.2f} GB/s")


if __name__ == "__main__":
    main()
