"""Shared benchmark helpers: environment banner and timing."""

from __future__ import annotations

import os
import platform
import statistics
import time


def banner() -> str:
    import torch

    try:
        import flashinfer

        fi = flashinfer.__version__
    except Exception:  # noqa: BLE001 - any import failure just means "not installed"
        fi = "not installed"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    cpu = platform.processor() or platform.machine()
    return (f"date={time.strftime('%Y-%m-%d')} host={platform.node()} cpu={cpu} cores={os.cpu_count()} "
            f"python={platform.python_version()} torch={torch.__version__} flashinfer={fi} gpu={gpu}")


def median_time(fn, *, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
