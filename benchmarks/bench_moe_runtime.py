"""Fused MoE on Hopper (triton engine): time and error at DeepSeek-V3 expert sizes.

    # H200: H=7168, I=2048, E=256, top-8
    python3 benchmarks/bench_moe_runtime.py --out DIR
    # CPU, Triton interpreter, small shapes
    python3 benchmarks/bench_moe_runtime.py --out DIR --tiny

Self-contained (torch + triton + this repo; no FlashInfer, no pytest). Writes ``DIR/bench_moe.json``
(after every measurement, so a crash keeps what was done) and prints a table. Exit code 0 when
every measurement ran and met its error bound, 1 otherwise.

What it does, per token count T (default 128 and 512):

1. Random MXFP8 experts built on the GPU from random canonical bytes (e4m3 values, UE8M0 codes
   114..117, i.e. weights ~N(0, 0.02)-sized), laid out with ``layouts/moe.py`` (11.3 GB at full
   size).
2. Random routing: softmax of random logits, top-k, renormalized (Qwen3/DeepSeek style).
3. Each triton method (``loop``: the dense kernel per expert; ``grouped``: one launch per GEMM):
   CUDA-event time of whole calls (host sync for expert counts included), median of ``--repeat``
   after ``--warmup`` calls (which compile). Weights (11 GB) far exceed the 60 MB L2, so no flush.
4. Errors against float64 oracles computed on the GPU from the *canonical* bytes (independent of
   the layout code the engines read): ``oracle`` (FC1 kept float32 into SwiGLU, like trtllm's fused
   epilogue) and ``staged`` (FC1/FC2 outputs rounded to bf16, as these kernels store them).
   rel = ||out - ref||_F / ||ref||_F. Bounds: staged <= 5e-3 (fp32 summation order only), oracle
   <= 3e-2 (bf16 rounding before the activation's MXFP8 requantization flips some e4m3 roundings;
   tests/runtime/test_moe.py explains it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--tiny" in sys.argv:  # must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxfp8_convert.runtime.moe import (  # noqa: E402
    TRITON_METHODS,
    MXFP8MoEWeights,
    moe_from_dequantized,
    triton_fused_moe,
)
from mxfp8_convert.runtime.reference import dequantize_mxfp8  # noqa: E402

FULL = dict(experts=256, hidden=7168, intermediate=2048, topk=8, tokens=(128, 512))
TINY = dict(experts=8, hidden=256, intermediate=128, topk=2, tokens=(5, 19))
BOUNDS = {"rel_err_staged": 5e-3, "rel_err_oracle": 3e-2}
HBM_TBPS = 4.3  # measured copy rate on the H200 (docs/LAYOUTS.md section 7), for the bytes floor


def environment(device: torch.device) -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__,
           "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device),
                   capability=list(torch.cuda.get_device_capability(device)),
                   sms=props.multi_processor_count, gpu_mem_gb=round(props.total_memory / 2**30, 1))
    return env


def random_canonical(e: int, rows: int, k: int, device, gen: torch.Generator, chunk: int = 8):
    """Stacked canonical MXFP8 ``(q [e, rows, k], s [e, rows, k/32])`` from random bytes."""
    q = torch.empty((e, rows, k), dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty((e, rows, k // 32), dtype=torch.uint8, device=device)
    for e0 in range(0, e, chunk):
        e1 = min(e, e0 + chunk)
        v = torch.randn((e1 - e0, rows, k), device=device, generator=gen) * 96
        q[e0:e1] = v.clamp_(-448, 448).to(torch.float8_e4m3fn)
        s[e0:e1] = torch.randint(114, 118, (e1 - e0, rows, k // 32), device=device, generator=gen,
                                 dtype=torch.uint8)
        del v
    return q, s


def build_experts(e: int, h: int, i: int, device, seed: int = 0):
    """Random laid-out experts and the canonical bytes they were laid out from."""
    gen = torch.Generator(device=device).manual_seed(seed)
    canon = {"up": random_canonical(e, i, h, device, gen),
             "gate": random_canonical(e, i, h, device, gen),
             "down": random_canonical(e, h, i, device, gen)}
    experts = MXFP8MoEWeights.from_canonical(canon["up"], canon["gate"], canon["down"],
                                             "bench.experts")
    return experts, canon


def random_routing(t: int, e: int, k: int, h: int, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((t, h), device=device, generator=gen).to(torch.bfloat16)
    logits = torch.randn((t, e), device=device, generator=gen)
    w, ids = torch.topk(logits.softmax(-1), k)
    return x, ids, w / w.sum(-1, keepdim=True)


def canonical_matrices(canon):
    def mats(e):
        w13 = torch.cat([dequantize_mxfp8(canon["up"][0][e], canon["up"][1][e]),
                         dequantize_mxfp8(canon["gate"][0][e], canon["gate"][1][e])])
        return w13, dequantize_mxfp8(canon["down"][0][e], canon["down"][1][e])

    return mats


def time_calls(fn, device, warmup: int, repeat: int) -> list[float]:
    """Milliseconds of each of ``repeat`` whole calls (CUDA events; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def write(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "bench_moe.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(out_dir / "bench_moe.json")


def table(report: dict) -> str:
    cfg = report["config"]
    lines = [f"env: {report['env']}",
             f"MoE: E={cfg['experts']} H={cfg['hidden']} I={cfg['intermediate']} "
             f"top-{cfg['topk']}, expert bytes {cfg['expert_mb']:.1f} MB, "
             f"build {report.get('build_s', float('nan')):.1f} s",
             "| T | method | active experts | rows/expert (mean, max) | median ms | min ms "
             "| floor ms | TB/s | rel err staged | rel err oracle | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if r.get("error"):
            lines.append(f"| {r['tokens']} | {r['method']} | | | | | | | | "
                         f"| FAILED: {r['error']} |")
            continue
        lines.append(
            f"| {r['tokens']} | {r['method']} | {r['active_experts']} "
            f"| {r['rows_mean']:.1f}, {r['rows_max']} | "
            f"{r['time_ms_median']:.3f} | {r['time_ms_min']:.3f} | {r['floor_ms']:.3f} "
            f"| {r['tbps']:.2f} | "
            f"{r['rel_err_staged']:.2e} | {r['rel_err_oracle']:.2e} "
            f"| {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for bench_moe.json")
    p.add_argument("--tiny", action="store_true",
                   help="CPU, TRITON_INTERPRET=1, small shapes (a smoke test)")
    p.add_argument("--tokens", type=int, nargs="+",
                   help="token counts (default 128 512; tiny: 5 19)")
    p.add_argument("--methods", nargs="+", default=list(TRITON_METHODS), choices=TRITON_METHODS)
    p.add_argument("--experts", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    shapes = dict(TINY if args.tiny else FULL)
    for key in ("experts", "hidden", "intermediate", "topk"):
        if getattr(args, key) is not None:
            shapes[key] = getattr(args, key)
    tokens = tuple(args.tokens or shapes["tokens"])
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        import triton

        if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
            print(f"--tiny runs Triton's interpreter, which needs Triton >= 3.9 here "
                  f"(found {triton.__version__}: "
                  "its interpreter cannot loop to a bound passed at run time); "
                  "compiled GPU runs are unaffected",
                  file=sys.stderr)
            return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 2)
    repeat = args.repeat if args.repeat is not None else (1 if args.tiny else 10)
    e, h, i, k = shapes["experts"], shapes["hidden"], shapes["intermediate"], shapes["topk"]
    expert_bytes = (3 * h * i) * (1 + 1 / 32)  # e4m3 weights + one UE8M0 byte per 32
    config = {**shapes, "tokens": list(tokens), "methods": args.methods,
              "warmup": warmup, "repeat": repeat, "seed": args.seed,
              "expert_mb": expert_bytes / 1e6, "bounds": BOUNDS}
    report = {"env": environment(device), "config": config, "results": []}
    t_start = time.perf_counter()
    ok = True
    try:
        t0 = time.perf_counter()
        experts, canon = build_experts(e, h, i, device, args.seed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        report["build_s"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - reported, then nothing else can run
        report["build_error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
        write(args.out, report)
        print(report["traceback"], file=sys.stderr)
        return 1
    mats = canonical_matrices(canon)
    for t in tokens:
        x, ids, w = random_routing(t, e, k, h, device, args.seed + t)
        counts = torch.bincount(ids.reshape(-1), minlength=e)
        active = int((counts > 0).sum())
        base = {"tokens": t, "active_experts": active,
                "rows_mean": float(counts[counts > 0].float().mean()),
                "rows_max": int(counts.max()), "weight_gb": active * expert_bytes / 1e9}
        try:
            oracle = moe_from_dequantized(x, ids, w, mats, e, out_dtype=torch.float64)
            staged = moe_from_dequantized(x, ids, w, mats, e, bf16_gemm_outputs=True,
                                          out_dtype=torch.float64)
        except Exception as exc:  # noqa: BLE001
            ok = False
            report["results"].append({**base, "method": "oracle",
                                      "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()})
            write(args.out, report)
            continue
        for method in args.methods:
            r = {**base, "method": method, "error": None}
            try:
                def call(method=method, x=x, ids=ids, w=w):
                    return triton_fused_moe(x, ids, w, experts, method=method)

                out = call()
                times = time_calls(call, device, warmup, repeat)
                r.update(time_ms_median=statistics.median(times), time_ms_min=min(times),
                         times_ms=times,
                         floor_ms=base["weight_gb"] / HBM_TBPS, nan=int(out.isnan().sum()),
                         rel_err_staged=rel(out, staged), rel_err_oracle=rel(out, oracle),
                         max_abs_err_oracle=float((out.double() - oracle).abs().max()),
                         frac_equal_staged_bf16=float(
                             (out == staged.to(torch.bfloat16)).float().mean()))
                r["tbps"] = base["weight_gb"] / r["time_ms_median"]
                r["ok"] = r["nan"] == 0 and all(r[key] <= bound for key, bound in BOUNDS.items())
            except Exception as exc:  # noqa: BLE001 - record and go on with the next measurement
                r.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                         ok=False)
                print(r["traceback"], file=sys.stderr)
            ok &= bool(r["ok"])
            report["results"].append(r)
            write(args.out, report)
    report["wall_s"] = time.perf_counter() - t_start
    report["ok"] = ok
    write(args.out, report)
    print(table(report))
    print(f"wrote {args.out / 'bench_moe.json'} in {report['wall_s']:.1f} s; ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
