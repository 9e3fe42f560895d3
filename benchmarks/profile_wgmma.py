"""One MXFP8 linear call per config, for a profiler (Nsight Compute) on a Hopper GPU.

    ncu --kernel-name regex:wgmma --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        python benchmarks/profile_wgmma.py --n 4096 --k 4096 --m 4

Runs the rule's config (``choose_config``), or with ``--cluster-waves W`` the splits of a row tile
as one cluster at ``W`` waves of programs, or with ``--cluster N`` clusters of N (``--global``:
the partials through global memory, the rule without clusters; ``--block-n 128``: programs of two
warpgroups), three times, and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm import random_weight  # noqa: E402

from mxfp8_convert.runtime.triton_mxfp8 import (  # noqa: E402
    choose_config,
    triton_linear,
    wgmma_config,
    wgmma_rule,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--layout", default="trtllm")
    p.add_argument("--cluster-waves", type=float, default=0)
    p.add_argument("--cluster", type=int, default=0)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--stages", type=int, default=0)
    p.add_argument("--global", dest="global_", action="store_true")
    args = p.parse_args()
    w, _, _ = random_weight(args.n, args.k, args.layout)  # the benchmark's operands
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    cfg = choose_config(args.m, args.n, args.k, x.device)
    if args.global_:
        cfg = wgmma_rule(args.m, args.n, args.k, x.device, cluster=False)
    elif args.cluster_waves or args.cluster:
        cfg = wgmma_config(args.m, args.n, args.k, x.device, waves=args.cluster_waves or 16, fuse_quant=True,
                           sw_ahead=2, max_split=args.cluster or 16, cluster=True, block_n=args.block_n)
    if args.stages:
        cfg = dataclasses.replace(cfg, num_stages=args.stages)
    print(cfg.to_dict(), flush=True)
    for _ in range(3):
        triton_linear(x, w, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
