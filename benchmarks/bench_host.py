"""Python (host) time per MXFP8 linear call of the Hopper launch paths, on CPU, kernels stubbed.

Run (no GPU needed; never collected by pytest):

    python benchmarks/bench_host.py [--baseline REV] [--rounds 5] [--calls 3000]

Every kernel launch (``kernel[grid](...)``) is replaced by a no-op, so what is timed is our
Python between the call and the launches: argument checks, buffers, layouts, grid arithmetic.
Triton's own launcher (argument binding, the driver call) is not in it; on a GPU,
``bench_gemm.py host`` times whole eager calls. With ``--baseline REV`` the same measurement
runs on a git worktree of ``REV`` (one with the ``runtime/hopper/`` package) in alternating
rounds (one process per round and tree), and the table gives both medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (name, M, N, K, GemmConfig fields): the wgmma decode kernel with the last-program and with
#: the second-kernel reduction, as the rule picks them at M = 16 (Llama q_proj / k_proj shapes),
#: and with the splits as one cluster, as it picks them at M <= 8.
CASES = (
    ("wgmma M=16 s5 serial", 16, 4096, 4096, dict(split_k=5, serial_reduce=True)),
    ("wgmma M=16 s8 2-kernel", 16, 1024, 4096, dict(split_k=8, serial_reduce=False)),
    ("wgmma M=4 s16 serial", 4, 1024, 4096, dict(split_k=16, serial_reduce=True)),
    ("wgmma M=8 cluster 7", 8, 4096, 4096, dict(split_k=7, cluster=True)),
)


def worker(calls: int) -> dict:
    """Median microseconds per call of each case, in this process's ``mxfp8_convert``."""
    from types import SimpleNamespace

    import torch

    import mxfp8_convert.runtime.hopper.launch as tri
    import mxfp8_convert.runtime.hopper.wgmma as wgmma
    from mxfp8_convert.runtime import MXFP8Weight, quantize_mxfp8
    from mxfp8_convert.runtime.hopper.config import GemmConfig, Kernel

    # returns what a launch returns: the compiled kernel, here its launch metadata only
    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: SimpleNamespace(
                packed_metadata=(4, kwargs.get("CLUSTER") or 1, 0)
            )

    wgmma._wgmma_decode_kernel = NoLaunch()
    tri._splitk_reduce_kernel = NoLaunch()
    out = {}
    for name, m, n, k, fields in CASES:
        q, code = quantize_mxfp8(torch.randn(n, k))
        w = MXFP8Weight.from_canonical(q, code, "trtllm")
        x = torch.randn(m, k).bfloat16()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        cfg = GemmConfig(
            64,
            16,
            128,
            Kernel.WGMMA,
            fuse_quant=True,
            num_stages=2,
            sw_ahead=2,
            pdl=True,
            red_chunk=8,
            **fields,
        )
        for _ in range(200):
            tri._launch_wgmma(x, w, None, y, cfg)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                tri._launch_wgmma(x, w, None, y, cfg)
            times.append((time.perf_counter() - t0) / calls * 1e6)
        out[name] = statistics.median(times)
    return out


def run_tree(tree: Path, calls: int) -> dict:
    code = (
        f"import sys; sys.path.insert(0, {str(tree)!r}); "
        f"sys.path.insert(1, {str(ROOT / 'benchmarks')!r}); "
        f"import json, bench_host; print(json.dumps(bench_host.worker({calls})))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="", help="git revision to compare with, in the same run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args()
    trees = {"current": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            base = Path(tmp) / "baseline"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                check=True,
                capture_output=True,
            )
            trees = {f"baseline {args.baseline}": base, **trees}
        try:
            runs = {label: [] for label in trees}
            for _ in range(args.rounds):  # alternating, so drift on a noisy machine hits both alike
                for label, tree in trees.items():
                    runs[label].append(run_tree(tree, args.calls))
        finally:
            if args.baseline:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                    check=False,
                )
    print(
        f"python {sys.version.split()[0]}, {args.rounds} rounds x 5 x {args.calls} calls, "
        "median us per call"
    )
    labels = list(trees)
    print(
        f"{'case':28s} "
        + " ".join(f"{lab:>22s}" for lab in labels)
        + ("   ratio" if len(labels) == 2 else "")
    )
    for name, *_ in CASES:
        med = [
            statistics.median(r[name] for r in runs[lab]) if name in runs[lab][0] else None
            for lab in labels
        ]
        ratio = f"   x{med[0] / med[1]:.2f}" if len(med) == 2 and None not in med else ""
        print(
            f"{name:28s} "
            + " ".join(f"{v:22.1f}" if v is not None else f"{'-':>22s}" for v in med)
            + ratio
        )


if __name__ == "__main__":
    main()
