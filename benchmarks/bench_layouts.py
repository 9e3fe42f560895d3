"""Time the layout functions against a plain memcpy (``torch.clone``) of the same bytes.

Each layout moves every byte once, so a clone of its input is the floor to compare with. Reports
the median time and GB/s (bytes read + bytes written) per case. Run via ``make bench``; pytest
never collects this file.

Usage: python benchmarks/bench_layouts.py [--device cpu|cuda] [--repeat 7] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _env import banner  # noqa: E402

from mxfp8_convert.layouts import (  # noqa: E402
    p32_shuffle_rows,
    p32_unshuffle_rows,
    swizzle_128x4,
    trtllm_scale_from_canonical,
    trtllm_scale_to_canonical,
    unswizzle_128x4,
)

# (label, shape): a Llama-3-70B / Mixtral-like up_proj [14336, 4096], its scales, the fused MLA
# qkv scale [576, 7168/32], and a stacked MoE FC1 scale [E=32, 2*2048, 7168/32].
WEIGHT = ("W 14336x4096", (14336, 4096))
SCALES = [
    ("S 14336x128", (14336, 128)),
    ("S 576x224 (MLA)", (576, 224)),
    ("S 32x4096x224 (MoE)", (32, 4096, 224)),
]


def cases(device: str):
    """(label, input, fn) triples; the first of each group is the clone baseline."""
    gen = torch.Generator().manual_seed(0)

    def rand(shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)

    label, shape = WEIGHT
    w = rand(shape)
    yield f"{label} clone", w, torch.clone
    yield f"{label} p32_shuffle_rows", w, p32_shuffle_rows
    yield f"{label} p32_unshuffle_rows", w, p32_unshuffle_rows
    try:
        import flashinfer

        yield (
            f"{label} flashinfer.shuffle_matrix_a",
            w,
            lambda x: flashinfer.shuffle_matrix_a(x, 128),
        )
    except ImportError:
        pass
    for label, shape in SCALES:
        s = rand(shape)
        rows, cols = shape[-2:]
        yield f"{label} clone", s, torch.clone
        yield f"{label} swizzle_128x4", s, swizzle_128x4
        tiles = swizzle_128x4(s)
        yield f"{label} unswizzle_128x4", tiles, lambda t, r=rows, c=cols: unswizzle_128x4(t, r, c)
        if rows % 32 == 0:
            yield f"{label} trtllm scale", s, trtllm_scale_from_canonical
            tiles = trtllm_scale_from_canonical(s)
            yield (
                f"{label} trtllm scale inverse",
                tiles,
                lambda t, r=rows, c=cols: trtllm_scale_to_canonical(t, r, c),
            )


def timings(fn, repeat: int) -> list[float]:
    fn()  # warm-up: allocator, lazy imports, CUDA context
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    print(banner())
    print(f"device={args.device} torch_threads={torch.get_num_threads()} repeat={args.repeat}")
    # min ms is there because shared CI machines preempt: a median far above it means noise.
    print(f"{'case':<48} {'MB in':>8} {'median ms':>10} {'min ms':>8} {'GB/s':>8} {'vs clone':>9}")
    baseline = None
    for label, x, fn in cases(args.device):
        out = fn(x)
        moved = x.numel() * x.element_size() + out.numel() * out.element_size()

        def run(fn=fn, x=x):
            fn(x)
            sync()

        times = timings(run, args.repeat)
        t = statistics.median(times)
        if label.endswith(" clone"):
            baseline = t
        print(
            f"{label:<48} {x.numel() / 1e6:>8.2f} {t * 1e3:>10.3f} {min(times) * 1e3:>8.3f} "
            f"{moved / t / 1e9:>8.2f} "
            f"{t / baseline:>8.2f}x"
        )


if __name__ == "__main__":
    main()
