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
    return (f"date={time.strftime('%Y-%m-%d')} host={platform.node()} cpu={cpu} "
            f"cores={os.cpu_count()} python={platform.python_version()} torch={torch.__version__} "
            f"flashinfer={fi} gpu={gpu}")


def median_time(fn, *, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall time and peak RSS (bytes) of one child process, from ``os.wait4``.

    The calling process must stay small (no torch import before the timings): a child's
    ru_maxrss counts the image it was forked from until exec, so a large parent would be
    reported as a large child.
    """
    import subprocess

    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{cmd[0]} failed with exit code {os.waitstatus_to_exitcode(status)}")
    return dt, usage.ru_maxrss * 1024  # KiB on Linux


def against_cp(src, dst, contenders: dict[str, list[str]], repeat: int) -> tuple[dict, dict]:
    """Time ``cp -r src dst`` + ``sync`` and each contender (a command given ``-o dst``),
    interleaved ``repeat`` times so machine noise hits all alike. Returns (times, peak RSS)."""
    import shutil
    import subprocess

    times: dict[str, list[float]] = {"cp -r + sync": []}
    rss: dict[str, int] = {}
    for _ in range(repeat):
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        t_cp, _ = timed(["cp", "-r", str(src), str(dst)])
        t_sync, _ = timed(["sync"])
        times["cp -r + sync"].append(t_cp + t_sync)
        for name, cmd in contenders.items():
            shutil.rmtree(dst, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            t, r = timed([*cmd, "-o", str(dst)])
            times.setdefault(name, []).append(t)
            rss[name] = max(rss.get(name, 0), r)
    shutil.rmtree(dst, ignore_errors=True)
    return times, rss
