"""MXFP8 linear on Hopper (Triton engine) vs bf16 cuBLAS, and checkpoint load times.

Run on the GPU (never collected by pytest):

    python benchmarks/bench_gemm.py gemm  [--vs-tile] [--layouts L,..] [--out DIR]  # model shapes x M vs bf16
    python benchmarks/bench_gemm.py tune  [--out DIR]   # every candidate tile config per shape and M
    python benchmarks/bench_gemm.py load  [--out DIR]   # converted vs canonical+layout-at-load
    python benchmarks/bench_gemm.py decode [--sweep | --grid | --wgmma] [--out DIR]  # M <= 16: kernels vs bf16
    python benchmarks/bench_gemm.py quant  [--out DIR]   # the activation-quantization pass's share of a GEMM
    python benchmarks/bench_gemm.py host   [--out DIR]   # Python time per eager call: config choice, launch

Every mode takes --ms 1,2,... and --shapes NAME,... (substrings of the model-shape names).
``decode --wgmma`` times the Gluon kernel's configs (the rule's; the split-K partials summed
through global memory instead, by the sixth session's rule, also with 3- and 4-stage rings; the
splits of a row tile as one thread-block cluster, summed through distributed shared memory, at 1,
2 and 3 waves of programs, at M > 8 also without PDL, and as clusters of 4 and 8 programs of 64
or 128 weight rows) and a ``read-only`` row per
shape: a kernel that only reads the fp8 weight bytes, the ceiling for any kernel that streams
them. ``MXFP8_PDL=0`` times the rule without PDL.

Timing: CUDA-graph replays of many calls, each on its own copy of the operands (>= 400 MB
streamed per replay, so weights come from HBM, not the 60 MB L2), CUDA events, median. TFLOP/s
counts 2*M*N*K; ratio = bf16 time / MXFP8 time, both measured in the same run on the same
shapes. The MXFP8 time includes quantizing the activations (every call does). Each row also
reports ||out - ref|| / ||ref|| against a float64 product of the same quantized operands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxfp8_convert.runtime import MXFP8Weight, load_checkpoint  # noqa: E402
from mxfp8_convert.runtime.reference import dequantize_mxfp8, fake_quantize_mxfp8  # noqa: E402
from tests.runtime.shapes import MODEL_SHAPES  # noqa: E402

MS = (1, 16, 128, 2048, 8192)


def environment() -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError:
        env["flashinfer"] = None
    return env


def bench(fn) -> float:
    """Median milliseconds of ``fn()`` (L2 flushed before each call)."""
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def time_graph(make_call, copies: int, reps: int = 10) -> float:
    """Median GPU milliseconds per call, from CUDA-graph replays of ``copies`` calls.

    Each call uses its own copy of the operands (``make_call(i)``), so a weight stream cannot
    be served from the 60 MB L2 across calls, and launch overhead (which CUDA graphs remove in
    serving engines) does not count. Kernels are compiled by a warm-up call before capture.
    """
    calls = [make_call(i) for i in range(copies)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / copies)
    del graph
    return sorted(times)[len(times) // 2]


def n_copies(bytes_per_call: int, out_bytes: int) -> int:
    """Enough operand copies to stream >= 400 MB per replay (7x L2), bounded in memory."""
    c = -(-400_000_000 // max(bytes_per_call, 1))
    return int(max(2, min(c, 64, 8_000_000_000 // max(out_bytes, 1))))


def time_mx(x, w: MXFP8Weight, cfg) -> float:
    from mxfp8_convert.runtime.triton_mxfp8 import triton_linear

    m, k = x.shape
    n = w.shape[0]
    copies = n_copies(w.data.numel() + w.scale.numel() + x.numel() * 2, m * n * 2)
    ws = [MXFP8Weight(w.data.clone(), w.scale.clone(), w.layout) for _ in range(copies)]
    xs = [x.clone() for _ in range(copies)]
    return time_graph(lambda i: (lambda: triton_linear(xs[i], ws[i], config=cfg)), copies)


def time_bf16(x, wbf) -> float:
    m, k = x.shape
    copies = n_copies(wbf.numel() * 2 + x.numel() * 2, m * wbf.shape[0] * 2)
    ws = [wbf.clone() for _ in range(copies)]
    xs = [x.clone() for _ in range(copies)]
    return time_graph(lambda i: (lambda: torch.nn.functional.linear(xs[i], ws[i])), copies)


def random_weight(n: int, k: int, layout: str, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(n, k, device="cuda", generator=g) * 96).clamp(-448, 448).to(torch.float8_e4m3fn)
    code = torch.randint(116, 126, (n, k // 32), device="cuda", generator=g).to(torch.uint8)
    return MXFP8Weight.from_canonical(q, code, layout), q, code


def rel_err(out, x, q, code) -> float:
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    return float((out.double() - ref).norm() / ref.norm())


def _quant_calls(xs, quantize):
    return lambda i: (lambda: quantize(xs[i]))


def quant_share_rows(shapes, ms) -> list[dict]:
    """Time the activation-quantization pass alone next to the whole GEMM (rule config, trtllm)
    and bf16: how much of a large-M GEMM the separate pass costs."""
    from mxfp8_convert.runtime.triton_mxfp8 import choose_config, quantize_activations

    rows = []
    for name, n, k in shapes:
        w, _, _ = random_weight(n, k, "trtllm")
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = choose_config(m, n, k, x.device)
            copies = n_copies(m * k * 4, m * k * 2)
            xs = [x.clone() for _ in range(copies)]
            t_q = time_graph(_quant_calls(xs, quantize_activations), copies)
            t_mx, t_bf = time_mx(x, w, cfg), time_bf16(x, wbf)
            rows.append({"shape": name, "m": m, "n": n, "k": k, "quant_ms": t_q, "gemm_ms": t_mx, "bf16_ms": t_bf,
                         "quant_tbps": m * k * 4 / t_q / 1e9, "config": cfg.to_dict()})
            print(f"{name:32s} M={m:5d} quantize {t_q * 1e3:7.1f} us ({m * k * 4 / t_q / 1e9:.2f} TB/s) = "
                  f"{t_q / t_mx:5.1%} of the MXFP8 GEMM {t_mx * 1e3:7.1f} us; bf16 {t_bf * 1e3:7.1f} us: "
                  f"x{t_bf / t_mx:.2f}, x{t_bf / (t_mx - t_q):.2f} without the pass", flush=True)
            del xs
        del w, wbf
        torch.cuda.empty_cache()
    return rows


def peak_bf16() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench(lambda: a @ b) / 1e9


def gemm_rows(shapes, ms, layouts=("trtllm", "cutlass"), config_fn=None, alts=None) -> list[dict]:
    """Rule config (or ``config_fn``) vs bf16 per shape, M and layout; ``alts``: name -> config
    function of alternative configs timed in the same run (``alt`` entries of each row)."""
    from mxfp8_convert.runtime.triton_mxfp8 import choose_config, triton_linear

    rows = []
    for name, n, k in shapes:
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        mx = {lay: random_weight(n, k, lay) for lay in layouts}
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = time_bf16(x, wbf)
            flops = 2 * m * n * k
            for lay, (w, q, code) in mx.items():
                cfg = (config_fn or choose_config)(m, n, k, x.device)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                triton_linear(x, w, out=out, config=cfg)
                t = time_mx(x, w, cfg)
                rows.append({"shape": name, "m": m, "n": n, "k": k, "layout": lay, "ms": t,
                             "tflops": flops / t / 1e9, "bf16_ms": t_bf16, "bf16_tflops": flops / t_bf16 / 1e9,
                             "ratio": t_bf16 / t, "rel_err": rel_err(out, x, q, code),
                             "unwritten": int(out.isnan().sum()), "config": cfg.to_dict(), "alt": {}})
                r = rows[-1]
                line = (f"{name:32s} M={m:5d} {lay:8s} {r['tflops']:7.1f} TF/s  bf16 {r['bf16_tflops']:7.1f}  "
                        f"x{r['ratio']:.2f}  err {r['rel_err']:.1e}  {t * 1e3:8.1f} us")
                for alt, fn in (alts or {}).items():
                    acfg = fn(m, n, k, x.device)
                    if acfg == cfg:
                        continue
                    t_alt = time_mx(x, w, acfg)
                    r["alt"][alt] = {"ms": t_alt, "ratio": t_bf16 / t_alt, "config": acfg.to_dict()}
                    line += f"  | {alt} x{t_bf16 / t_alt:.2f} {t_alt * 1e3:8.1f} us"
                print(line + (f"  UNWRITTEN {r['unwritten']}" if r["unwritten"] else ""), flush=True)
            del x
        del wbf, mx
        torch.cuda.empty_cache()
    return rows


def gemm_summary(rows: list[dict]) -> None:
    """Per M: min / median / max ratio to bf16 and rows >= 0.5x, for the rule and each alternative."""
    from statistics import median

    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m]
        series = {"rule": [r["ratio"] for r in rs]}
        for r in rs:
            for alt, a in r["alt"].items():
                series.setdefault(alt, []).append(a["ratio"])
        for label, v in series.items():
            print(f"M={m:5d} {label:6s} min {min(v):.2f} median {median(v):.2f} max {max(v):.2f}  "
                  f">=0.5x {sum(x >= 0.5 for x in v)}/{len(v)}  >=1.2x {sum(x >= 1.2 for x in v)}/{len(v)}")


def candidates(m: int, n: int, k: int, sms: int = 132) -> list:
    """Tile configs worth timing for one (M, N, K); split-K values that keep >= 2 K-tiles/split."""
    import dataclasses

    from mxfp8_convert.runtime.triton_mxfp8 import GemmConfig, _fit_block_k

    def g(bn, bm, bk, warps, stages, fuse):
        return GemmConfig(bn, bm, _fit_block_k(k, bk), fuse_quant=fuse, num_warps=warps, num_stages=stages)

    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bases = [g(64, bm, 128, 4, 4, True), g(64, bm, 128, 4, 4, False), g(64, bm, 256, 4, 3, False),
                 g(128, bm, 128, 4, 4, False)]
    elif m <= 512:
        bases = [g(64, 128, 64, 4, 4, False), g(128, 128, 64, 8, 4, False), g(64, 64, 128, 4, 4, False)]
    else:
        bases = [g(128, 256, 64, 8, 4, False), g(128, 256, 64, 8, 3, False), g(64, 256, 64, 4, 3, False),
                 g(64, 128, 64, 4, 4, False), g(128, 128, 64, 8, 4, False)]
    out = []
    for b in bases:
        tiles = -(-n // b.block_n) * -(-m // b.block_m)
        kt = k // b.block_k
        splits = [1] + [s_ for s_ in (2, 4, 8, 16) if tiles * s_ <= 8 * sms and kt // s_ >= 2]
        if m > 512:
            splits = splits[:2]
        out += [dataclasses.replace(b, split_k=s_) for s_ in splits]
    return out


def tune(shapes, ms) -> list[dict]:
    """Time every candidate config (trtllm layout) per (shape, M); report best vs heuristic vs bf16."""
    import dataclasses

    from mxfp8_convert.runtime.triton_mxfp8 import choose_config

    rows = []
    for name, n, k in shapes:
        w, q, code = random_weight(n, k, "trtllm")
        wc = MXFP8Weight.from_canonical(q, code, "cutlass")
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flops = 2 * m * n * k
            t_bf16 = time_bf16(x, wbf)
            res = []
            for cfg in candidates(m, n, k):
                try:
                    res.append((time_mx(x, w, cfg), cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                    print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
            res.sort(key=lambda r: r[0])
            heur = choose_config(m, n, k, x.device)
            t_heur = time_mx(x, w, heur)
            best_t, best = res[0]
            extra = {}
            if m >= 2048:  # same config on the cutlass layout
                extra["cutlass_ms"] = time_mx(x, wc, best)
            if best.split_k > 1:  # the two-kernel split-K reduction instead of the serial one
                extra["two_kernel_ms"] = time_mx(x, w, dataclasses.replace(best, serial_reduce=False))
            row = {"shape": name, "m": m, "n": n, "k": k, "bf16_ms": t_bf16, "best_ms": best_t,
                   "best": best.to_dict(), "heuristic_ms": t_heur, "heuristic": heur.to_dict(),
                   "all": [(t, c.to_dict()) for t, c in res], **extra}
            rows.append(row)
            b = best
            print(f"{name:32s} M={m:5d} bf16 {flops / t_bf16 / 1e9:6.1f} TF/s {t_bf16 * 1e3:8.1f} us | best "
                  f"{flops / best_t / 1e9:6.1f} x{t_bf16 / best_t:.2f} [{b.block_n}x{b.block_m}x{b.block_k} s{b.split_k} "
                  f"f{int(b.fuse_quant)} w{b.num_warps} st{b.num_stages}] | heur x{t_bf16 / t_heur:.2f}"
                  + "".join(f" | {key[:-3]} x{t_bf16 / val:.2f}" for key, val in extra.items()), flush=True)
        del w, wc, wbf
        torch.cuda.empty_cache()
    return rows


DECODE_MS = (1, 2, 4, 16)


def decode_variants(m: int, n: int, k: int, sweep: bool | str) -> dict:
    """Configs timed per (shape, M): the rule (``choose_config``) and, with ``sweep``, alternatives
    (``old``: the tile kernel's small-M config, i.e. the path before the decode and GEMV kernels);
    ``sweep="grid"``: a grid of GEMV configs (rows per program x programs per SM x quantization)."""
    from mxfp8_convert.runtime.triton_mxfp8 import (
        GEMV_MAX_M,
        choose_config,
        decode_config,
        gemv_config,
    )

    dev = torch.device("cuda")
    out = {"rule": choose_config(m, n, k, dev)}
    if not sweep:
        return out
    if sweep == "pdl":  # the rule's PDL options (ninth session), each taken away in turn
        import dataclasses

        rule, rep = out["rule"], dataclasses.replace
        if rule.wgmma and rule.pdl:
            out["nopdl"] = rep(rule, pdl=False, prefetch=False, x_prefetch=False, red_release=False)
            out["-prefetch"] = rep(rule, prefetch=False, x_prefetch=False)  # every load after the dependency wait
            # the activations' lines asked of L2 before the wait too, or not; with deeper rings (more
            # of the weight requested before the wait)
            xpf = ("-" if rule.x_prefetch else "+") + "xprefetch"
            out[xpf] = rep(rule, x_prefetch=not rule.x_prefetch)
            for stages in (3, 4):
                out[f"st{stages}"] = rep(rule, num_stages=stages)
                out[f"{xpf}.st{stages}"] = rep(out[xpf], num_stages=stages)
            if rule.phys_partials:  # second reduction kernel
                out["-release"] = rep(rule, red_release=False)  # the next GEMM launches when it exits
                out["-phys"] = rep(rule, phys_partials=False)  # partials in logical row order
                from mxfp8_convert.runtime.triton_mxfp8 import _red_chunk  # wgmma_config's chunk

                out["-chunk"] = rep(rule, red_chunk=_red_chunk(rule.split_k))
                out["eighth"] = rep(out["-chunk"], prefetch=False, x_prefetch=False, red_release=False,
                                    phys_partials=False)
        return out
    if sweep == "split":  # M = 9..16, second-kernel reduction: other splits, programs of 64 or 128 rows
        import dataclasses

        from mxfp8_convert.runtime.triton_mxfp8 import (
            CLUSTER_SIZES,
            _launch_options,
            _no_empty_splits,
        )

        rule = out["rule"]
        if rule.wgmma and m > 8 and rule.split_k > 1 and not (rule.cluster or rule.serial_reduce):
            for bn in (64, 128):  # each with the rule's launch options for its reduction (chunk, release, ...)
                width = dataclasses.replace(rule, block_n=bn, num_warps=bn // 16)
                for split in sorted({_no_empty_splits(k // 128, s) for s in range(2, 17)}):
                    if (bn, split) != (rule.block_n, rule.split_k) and split >= 2:
                        out[f"b{bn}.s{split}"] = _launch_options(dataclasses.replace(width, split_k=split), m, dev)
                for size in (s for s in CLUSTER_SIZES if s <= 8):  # the splits of a row tile as one cluster
                    if size * 2 <= k // 128:
                        out[f"b{bn}.cl{size}"] = _launch_options(
                            dataclasses.replace(width, split_k=size, cluster=True), m, dev)
        return out
    if sweep != "wgmma":
        out["old"] = choose_config(m, n, k, dev, decode=False)
    else:  # the Gluon kernel: the rule, cluster reductions x programs per SM
        import dataclasses

        from mxfp8_convert.runtime.triton_mxfp8 import (
            gemv_rule,
            wgmma_config,
            wgmma_pdl,
            wgmma_rule,
        )

        if (base := wgmma_rule(m, n, k, dev, cluster=False)) is not None:
            rep = dataclasses.replace
            out["wg.global"] = base  # the partials through global memory (the sixth session's rule)
            for stages in (3, 4):  # deeper TMA rings
                out[f"wg.global.st{stages}"] = rep(base, num_stages=stages)
            for waves in (1, 2, 3):  # the splits of a row tile as one cluster, summed through DSMEM
                cfg = wgmma_config(m, n, k, dev, waves=waves, fuse_quant=True, sw_ahead=2,
                                   max_split=16 if m >= 4 else 0, cluster=True)
                if cfg.cluster:
                    out[f"wg.cl{cfg.split_k}.w{waves}"] = rep(cfg, pdl=wgmma_pdl(m, cfg.split_k, dev))
                    if m > 8:  # clusters wait for room in one GPC: is it there with the neighbours launched early?
                        out[f"wg.cl{cfg.split_k}.w{waves}.nopdl"] = cfg
            if m > 8:  # clusters of 4 and 8 64-row programs, or of 128-row ones (two warpgroups sharing
                # each quantized activation tile)
                for size in (4, 8):
                    for bn in (64, 128):
                        cfg = wgmma_config(m, n, k, dev, waves=16, fuse_quant=True, sw_ahead=2, max_split=size,
                                           cluster=True, block_n=bn)
                        if cfg.cluster and cfg.split_k == size:
                            out[f"wg.b{bn}.cl{size}"] = rep(cfg, pdl=wgmma_pdl(m, cfg.split_k, dev))
        if (gemv := gemv_rule(m, n, k, dev)) is not None:
            out["gemv"] = gemv
        return out
    d = lambda **kw: decode_config(m, n, k, dev, **kw)  # noqa: E731
    out["dec.b64.w2"] = d(waves=2)  # the decode kernel (FP8 wgmma per 32-block)
    g = lambda **kw: gemv_config(m, n, k, dev, **kw)  # noqa: E731
    if sweep == "grid" and m <= GEMV_MAX_M:
        for bn in (16, 32, 64):
            for waves in (1, 2, 4, 8, 16):
                for fuse in (True, False):
                    out[f"gemv.b{bn}.w{waves}" + (".fuse" if fuse else ".perm")] = g(
                        block_n=bn, waves=waves, fuse_quant=fuse)
        out.update({"gemv.b32.w4.cvt": g(words=False), "gemv.b32.w8.cvt": g(words=False, waves=8),
                    "gemv.b32.w4.nw8": g(num_warps=8), "gemv.b64.w4.nw8": g(block_n=64, num_warps=8),
                    "gemv.b16.w4.nw2": g(block_n=16, num_warps=2), "gemv.b32.w4.bk512": g(block_k=512),
                    "gemv.b32.w4.bk128": g(block_k=128)})
    elif m <= GEMV_MAX_M:  # the CUDA-core GEMV kernel
        out.update({
            "gemv.b32": g(),
            "gemv.b16": g(block_n=16),
            "gemv.b32.w8": g(waves=8),
            "gemv.b32.bk512": g(block_k=512),
            "gemv.b32.perm": g(fuse_quant=False),
            "gemv.b32.perm.w8": g(fuse_quant=False, waves=8),
            "gemv.b16.perm": g(block_n=16, fuse_quant=False),
            "gemv.b64.perm.nw8": g(block_n=64, num_warps=8, fuse_quant=False),
            "gemv.b32.cvt": g(words=False),
            "gemv.b32.cvt.nofuse": g(words=False, fuse_quant=False),
        })
    return out


def _read_calls(ws, block: int, iters: int):
    """Calls of a kernel that only reads the weight bytes (int32 words, ``block`` x ``iters`` per
    program) and writes one word per program: the time floor of any kernel streaming them."""
    import triton
    import triton.language as tl

    global _read_kernel
    if "_read_kernel" not in globals():

        @triton.jit
        def _read_kernel(p, out, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
            base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
            acc = tl.zeros([BLOCK], tl.int32)
            for it in tl.static_range(ITERS):
                offs = base + it * BLOCK + tl.arange(0, BLOCK)
                acc ^= tl.load(p + offs, mask=offs < n_words, other=0)
            tl.store(out + tl.program_id(0), tl.sum(acc, 0))

    words = [w.data.view(torch.int32).view(-1) for w in ws]
    grid = triton.cdiv(words[0].numel(), block * iters)
    sink = torch.empty(grid, dtype=torch.int32, device=words[0].device)
    return lambda i: (lambda: _read_kernel[(grid,)](words[i], sink, words[i].numel(), BLOCK=block, ITERS=iters,
                                                    num_warps=8))


def _linear_calls(xs, wbfs):
    return lambda i: (lambda: torch.nn.functional.linear(xs[i], wbfs[i]))


def _mx_calls(xs, ws, cfg):
    from mxfp8_convert.runtime.triton_mxfp8 import triton_linear

    return lambda i: (lambda: triton_linear(xs[i], ws[i], config=cfg))


def decode_rows(shapes, ms, layouts, sweep: bool | str, hot: bool = False) -> list[dict]:
    """Decode timing: operand copies made once per shape, bf16 and every variant in the same run.
    ``hot``: every call reads one activation tensor (in L2 after the first, as in a model where
    the kernel before has just written it); the weights are still one copy per call."""
    from mxfp8_convert.runtime.triton_mxfp8 import triton_linear

    rows = []
    for name, n, k in shapes:
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        c_bf = n_copies(n * k * 2, 16 * n * 2)
        wbfs = [wbf] + [wbf.clone() for _ in range(c_bf - 1)]
        mx, ws = {}, {}
        c_mx = n_copies(n * k + n * k // 32, 16 * n * 2)
        for lay in layouts:
            w, q, code = random_weight(n, k, lay)
            mx[lay] = (w, q, code)
            ws[lay] = [w] + [MXFP8Weight(w.data.clone(), w.scale.clone(), lay) for _ in range(c_mx - 1)]
        wref = dequantize_mxfp8(q, code).double().t()
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xs = [x if hot else x.clone() for _ in range(max(c_bf, c_mx))]
            ref = fake_quantize_mxfp8(x).double() @ wref
            t_bf16 = time_graph(_linear_calls(xs, wbfs), c_bf)
            if sweep == "wgmma":  # the floor: a kernel that only reads the fp8 weight bytes
                t_read = min(time_graph(_read_calls(ws[layouts[0]], b, it), c_mx) for b, it in ((2048, 1), (4096, 4)))
                rows.append({"shape": name, "m": m, "n": n, "k": k, "layout": "-", "variant": "read-only",
                             "us": t_read * 1e3, "bf16_us": t_bf16 * 1e3, "ratio": t_bf16 / t_read,
                             "rel_err": 0.0, "unwritten": 0, "weight_tbps": n * k / t_read / 1e9})
                print(f"{name:32s} M={m:3d} reading the fp8 weight alone {t_read * 1e3:8.1f} us  "
                      f"bf16 {t_bf16 * 1e3:8.1f} us  x{t_bf16 / t_read:.2f} (the ceiling)", flush=True)
            for lay in layouts:
                first = None  # the rule's output: are the other variants' bits the same?
                for vname, cfg in decode_variants(m, n, k, sweep).items():
                    if lay != layouts[0] and vname not in ("rule", "old"):
                        continue  # alternatives on the first layout only (the layouts differ in row indexing)
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    try:
                        triton_linear(x, mx[lay][0], out=out, config=cfg)
                        t = time_graph(_mx_calls(xs, ws[lay], cfg), c_mx)
                    except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                        print(f"{name:32s} M={m:3d} {lay:8s} {vname:16s} FAILED {type(e).__name__}: {str(e)[:200]}",
                              flush=True)
                        continue
                    unwritten = int(out.isnan().sum())
                    err = float((out.double() - ref).norm() / ref.norm())
                    first = out if first is None else first
                    same = bool(torch.equal(out, first))
                    wbytes = n * k * 1.03125
                    rows.append({"shape": name, "m": m, "n": n, "k": k, "layout": lay, "variant": vname,
                                 "us": t * 1e3, "bf16_us": t_bf16 * 1e3, "ratio": t_bf16 / t, "rel_err": err,
                                 "unwritten": unwritten, "weight_tbps": wbytes / t / 1e9,
                                 "bf16_tbps": n * k * 2 / t_bf16 / 1e9, "same_bits_as_rule": same,
                                 "config": cfg.to_dict()})
                    r = rows[-1]
                    print(f"{name:32s} M={m:3d} {lay:8s} {vname:16s} {r['us']:8.1f} us  bf16 {r['bf16_us']:8.1f} us  "
                          f"x{r['ratio']:.2f}  {r['weight_tbps']:.2f} TB/s  err {err:.1e}"
                          + (f"  UNWRITTEN {unwritten}" if unwritten else "") + ("" if same else "  BITS DIFFER"),
                          flush=True)
            del xs, x
        del wbf, wbfs, mx, ws, wref
        torch.cuda.empty_cache()
    return rows


def decode_summary(rows: list[dict]) -> None:
    """Best variant per (shape, M) and the rule's ratio; last lines of the output."""
    from collections import defaultdict

    groups = defaultdict(list)
    for r in rows:
        groups[(r["shape"], r["m"])].append(r)
    print("\nshape                            M  | rule trtllm / cutlass | best variant (trtllm)")
    worst = {}
    for (shape, m), rs in groups.items():
        rule = {r["layout"]: r["ratio"] for r in rs if r["variant"] == "rule"}
        ceiling = next((r["ratio"] for r in rs if r["variant"] == "read-only"), None)
        tr = [r for r in rs if r["layout"] == "trtllm"]
        best = max(tr, key=lambda r: r["ratio"]) if tr else None
        worst[m] = min(worst.get(m, 9.9), *rule.values()) if rule else worst.get(m, 9.9)
        print(f"{shape:32s} {m:3d} | " + " / ".join(f"x{rule[lay]:.2f}" for lay in rule)
              + (f" | {best['variant']} x{best['ratio']:.2f} ({best['us']:.1f} us)" if best else "")
              + (f" | read-only x{ceiling:.2f}" if ceiling else ""))
    errs = [r["rel_err"] for r in rows]
    print(f"rel err: max {max(errs):.2e}; unwritten total {sum(r['unwritten'] for r in rows)}; "
          f"worst rule ratio per M: {worst}")


def load_bench(root: Path, layers: int = 8) -> dict:
    """Load a converted checkpoint onto the GPU vs load a canonical one and lay it out on the GPU."""
    from mxfp8_convert.backends import BACKENDS
    from tests.runtime.ckpt_writer import write_canonical_source, write_checkpoint

    shapes = {"self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (1024, 4096), "self_attn.v_proj": (1024, 4096),
              "self_attn.o_proj": (4096, 4096), "mlp.gate_proj": (14336, 4096), "mlp.up_proj": (14336, 4096),
              "mlp.down_proj": (4096, 14336)}
    canon, laid = {}, {}
    for i in range(layers):
        for mod, (n, k) in shapes.items():
            w, q, code = random_weight(n, k, "trtllm", seed=i)
            canon[f"model.layers.{i}.{mod}"] = (q.cpu(), code.cpu())
            laid[f"model.layers.{i}.{mod}"] = w.to("cpu")
    conv_dir = write_checkpoint(root / "converted", laid, backend="trtllm")
    src_dir = write_canonical_source(root / "canonical", canon)
    nbytes = sum(f.stat().st_size for f in conv_dir.glob("*.safetensors"))
    for d in (conv_dir, src_dir):  # warm the page cache for both, so both read from memory
        for f in d.glob("*.safetensors"):
            f.read_bytes()

    def load_converted():
        ck = load_checkpoint(conv_dir, device="cuda", engine="triton")
        torch.cuda.synchronize()
        return ck

    def load_canonical_and_layout():
        from safetensors import safe_open

        spec = BACKENDS["trtllm"]
        out = {}
        with safe_open(str(src_dir / "model.safetensors"), framework="pt", device="cuda") as f:
            for name in canon:
                q = f.get_tensor(f"{name}.weight")
                code = f.get_tensor(f"{name}.weight_scale_inv")
                out[name] = (spec.weight_forward(q.view(torch.uint8)), spec.scale_forward(code))
        torch.cuda.synchronize()
        return out

    times = {"converted": [], "canonical_plus_layout": []}
    for _ in range(3):
        for key, fn in (("converted", load_converted), ("canonical_plus_layout", load_canonical_and_layout)):
            torch.cuda.empty_cache()
            t0 = time.perf_counter()
            res = fn()
            times[key].append(time.perf_counter() - t0)
            del res
    # layout alone, on tensors already on the GPU
    spec = BACKENDS["trtllm"]
    gpu = {k: (q.cuda(), c.cuda()) for k, (q, c) in canon.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for q, c in gpu.values():
        spec.weight_forward(q.view(torch.uint8))
        spec.scale_forward(c)
    torch.cuda.synchronize()
    t_layout = time.perf_counter() - t0
    med = {k: sorted(v)[1] for k, v in times.items()}
    res = {"layers": layers, "bytes": nbytes, "times_s": times, "median_s": med, "layout_only_s": t_layout,
           "modules": len(canon)}
    print(f"load: {nbytes / 1e9:.2f} GB, {len(canon)} modules; converted {med['converted']:.3f} s, "
          f"canonical+layout {med['canonical_plus_layout']:.3f} s, layout alone on GPU {t_layout:.3f} s", flush=True)
    return res


def host_rows(shapes, ms) -> list[dict]:
    """Host (Python) microseconds per eager call, no GPU timing: the rule's choice
    (``choose_config``) against its memoized form (``default_config``, what a call without
    ``config`` uses), and a whole ``triton_linear`` call (choice + launches, the GPU left to run)
    with the cache kept against the cache emptied before each call. Median of 5 rounds of 200."""
    import statistics

    from mxfp8_convert.runtime.triton_mxfp8 import choose_config, default_config, triton_linear

    dev = torch.device("cuda")

    def per_call(fn, reps=200):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps * 1e6)
            torch.cuda.synchronize()
        return statistics.median(times)

    rows = []
    pdl = os.environ.get("MXFP8_PDL")
    for name, n, k in shapes:
        w, _, _ = random_weight(n, k, "trtllm")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            triton_linear(x, w, out=out)  # compiled and cached

            def cold(x=x, w=w, out=out):
                default_config.cache_clear()
                triton_linear(x, w, out=out)

            row = {"shape": name, "m": m, "n": n, "k": k,
                   "choose_us": per_call(lambda m=m, n=n, k=k: choose_config(m, n, k, dev)),
                   "memo_us": per_call(lambda m=m, n=n, k=k: default_config(m, n, k, dev, pdl)),
                   "call_us": per_call(lambda x=x, w=w, out=out: triton_linear(x, w, out=out)),
                   "call_nomemo_us": per_call(cold)}
            rows.append(row)
            print(f"{name:32s} M={m:3d} choose {row['choose_us']:6.1f} us  memoized {row['memo_us']:5.2f} us  "
                  f"call {row['call_us']:6.1f} us (rule each call: {row['call_nomemo_us']:6.1f} us)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["gemm", "tune", "load", "decode", "quant", "host"])
    p.add_argument("--sweep", action="store_true", help="decode: time alternative configs too")
    p.add_argument("--wgmma", action="store_true", help="decode: time the Gluon wgmma kernel's configs")
    p.add_argument("--grid", action="store_true", help="decode: time a grid of GEMV configs (M <= 4)")
    p.add_argument("--pdl-options", action="store_true",
                   help="decode: time the wgmma rule without each of its PDL options (weight prefetch, "
                   "early release by the reduction kernel, physical-order partials), with or without the "
                   "activations' L2 prefetch, and with 3- and 4-stage rings")
    p.add_argument("--split-options", action="store_true",
                   help="decode: time the wgmma rule's M = 9..16 second-kernel rows with the other splits, in "
                   "programs of 64 and 128 weight rows, summed by a second kernel or as clusters of 2-8")
    p.add_argument("--hot", action="store_true",
                   help="decode: one activation tensor for every call (hot in L2, as in a model), not one copy each")
    p.add_argument("--shapes", default="", help="only shapes whose name contains one of these (comma-separated)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--layouts", default="trtllm,cutlass", help="gemm, decode: layouts to time (comma-separated)")
    p.add_argument("--chunks", default="", help="gemm: also time the cuBLAS path with these workspaces "
                   "(M elements, comma-separated)")
    p.add_argument("--vs-tile", action="store_true",
                   help="gemm: also time the tile kernel and the cuBLAS path where the rule is the other one")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"env": environment(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": args.mode}
    print(json.dumps(result["env"]), flush=True)
    keys = [key for key in args.shapes.split(",") if key]
    shapes = [sh for sh in MODEL_SHAPES if not keys or any(key in sh[0] for key in keys)]
    if args.mode == "gemm":
        result["bf16_peak_tflops_8192"] = peak_bf16()
        print(f"bf16 8192^3: {result['bf16_peak_tflops_8192']:.1f} TF/s", flush=True)
        alts = {}
        if args.vs_tile:
            from mxfp8_convert.runtime.triton_mxfp8 import choose_config, cublas_config

            alts["tile"] = lambda m, n, k, dev: choose_config(m, n, k, dev, cublas=False)
            alts["cublas"] = cublas_config
        for mel in filter(None, args.chunks.split(",")):
            from mxfp8_convert.runtime.triton_mxfp8 import cublas_config

            rows_of = lambda n, k, mel=int(mel): min(n, max(128, mel * 2**20 // k // 128 * 128))  # noqa: E731
            alts[f"ws{mel}M"] = lambda m, n, k, dev, f=rows_of: cublas_config(m, n, k, dev, chunk_n=f(n, k))
        result["rows"] = gemm_rows(shapes, [int(m) for m in args.ms.split(",")], tuple(args.layouts.split(",")),
                                   alts=alts)
        gemm_summary(result["rows"])
    elif args.mode == "decode":
        ms = [int(m) for m in args.ms.split(",")] if args.ms != ",".join(map(str, MS)) else list(DECODE_MS)
        layouts = tuple(args.layouts.split(","))  # alternatives on the first
        sweep = ("grid" if args.grid else "wgmma" if args.wgmma else "pdl" if args.pdl_options
                 else "split" if args.split_options else args.sweep)
        result["hot"] = args.hot
        result["rows"] = decode_rows(shapes, ms, layouts, sweep, args.hot)
        (out / "bench_decode.json").write_text(json.dumps(result, indent=1))
        decode_summary(result["rows"])
    elif args.mode == "host":
        result["rows"] = host_rows(shapes, [int(m) for m in args.ms.split(",")])
    elif args.mode == "quant":
        result["rows"] = quant_share_rows(shapes, [int(m) for m in args.ms.split(",")])
    elif args.mode == "tune":
        result["rows"] = tune(shapes, [int(m) for m in args.ms.split(",")])
    else:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            result["load"] = load_bench(Path(tmp))
    (out / f"bench_{args.mode}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
