r"""One MXFP8 linear call of the rule's config, for a profiler (Nsight Compute) on a Hopper GPU.

    ncu --kernel-name regex:wgmma --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        python benchmarks/profile_wgmma.py --n 4096 --k 4096 --m 4

Runs the config ``choose_config`` picks for (M, N, K) on this GPU three times, and prints it;
with ``--bf16``, bf16 ``F.linear`` on the same shape instead (the yardstick's cuBLAS kernel).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm import random_weight  # noqa: E402

from mxfp8_convert.runtime.hopper import choose_config, device_facts, triton_linear  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--layout", default="trtllm")
    p.add_argument("--bf16", action="store_true", help="profile bf16 F.linear instead")
    args = p.parse_args()
    if args.bf16:
        x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
        wb = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            torch.nn.functional.linear(x, wb)
        torch.cuda.synchronize()
        return
    w, _, _ = random_weight(args.n, args.k, args.layout)  # the benchmark's operands
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    cfg = choose_config(args.m, args.n, args.k, device_facts(x.device))
    print(cfg.to_dict(), flush=True)
    for _ in range(3):
        triton_linear(x, w, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
