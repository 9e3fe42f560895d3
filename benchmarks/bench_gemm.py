"""MXFP8 linear on Hopper (Triton engine) vs bf16 cuBLAS, and checkpoint load times.

Run on the GPU (never collected by pytest):

    # the rule vs bf16, model shapes x M
    python benchmarks/bench_gemm.py gemm   [--layouts L,..] [--out DIR]
    # M <= 16: the rule vs bf16, operand copies reused
    python benchmarks/bench_gemm.py decode [--hot] [--out DIR]
    python benchmarks/bench_gemm.py load   [--out DIR]   # converted vs canonical + layout at load
    # the activation-quantization pass's share of a GEMM
    python benchmarks/bench_gemm.py quant  [--out DIR]
    # Python time per eager call: config choice, launch
    python benchmarks/bench_gemm.py host   [--out DIR]

Every mode takes --ms 1,2,... and --shapes NAME,... (substrings of the model-shape names) and
writes ``bench_<mode>.json`` into --out (default ``$OUT``, else ``.``); ``benchmarks/results/``
keeps the runs BENCHMARKS.md reports. ``MXFP8_PDL=0`` / ``strict`` time the rule without PDL /
with every access after the PDL wait.

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
from mxfp8_convert.runtime.hopper.shapes import MODEL_SHAPES  # noqa: E402
from mxfp8_convert.runtime.reference import dequantize_mxfp8, fake_quantize_mxfp8  # noqa: E402

MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192)


def environment() -> dict:
    import triton

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(),
        "capability": torch.cuda.get_device_capability(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
    }
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
    from mxfp8_convert.runtime.hopper.launch import triton_linear

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
    q = (
        (torch.randn(n, k, device="cuda", generator=g) * 96)
        .clamp(-448, 448)
        .to(torch.float8_e4m3fn)
    )
    code = torch.randint(116, 126, (n, k // 32), device="cuda", generator=g).to(torch.uint8)
    return MXFP8Weight.from_canonical(q, code, layout), q, code


def rel_err(out, x, q, code) -> float:
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    return float((out.double() - ref).norm() / ref.norm())


def software_rounding():
    """The kernels as under Triton's interpreter: e4m3 rounding in fp32 arithmetic
    (``jit._round_e4m3``) instead of the GPU's conversion (``probe.e4m3_conversion``)."""
    from unittest import mock

    from mxfp8_convert.runtime.hopper import probe

    return mock.patch.object(probe, "interpreting", lambda: True)


def _quant_calls(xs, quantize):
    return lambda i: (lambda: quantize(xs[i]))


def quant_share_rows(shapes, ms) -> list[dict]:
    """Time the activation-quantization pass alone next to the whole GEMM (rule config, trtllm)
    and bf16: how much of a large-M GEMM the separate pass costs; then both again with the e4m3
    rounding in fp32 arithmetic (``software_rounding``) against the GPU's conversion."""
    from mxfp8_convert.runtime.hopper import choose_config, device_facts, quantize_activations

    rows = []
    for name, n, k in shapes:
        w, _, _ = random_weight(n, k, "trtllm")
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = choose_config(m, n, k, device_facts(x.device))
            copies = n_copies(m * k * 4, m * k * 2)
            xs = [x.clone() for _ in range(copies)]
            t_q = time_graph(_quant_calls(xs, quantize_activations), copies)
            t_mx, t_bf = time_mx(x, w, cfg), time_bf16(x, wbf)
            with software_rounding():
                t_q_sw = time_graph(_quant_calls(xs, quantize_activations), copies)
                t_mx_sw = time_mx(x, w, cfg)
            rows.append(
                {
                    "shape": name,
                    "m": m,
                    "n": n,
                    "k": k,
                    "quant_ms": t_q,
                    "gemm_ms": t_mx,
                    "bf16_ms": t_bf,
                    "quant_tbps": m * k * 4 / t_q / 1e9,
                    "quant_sw_ms": t_q_sw,
                    "gemm_sw_ms": t_mx_sw,
                    "config": cfg.to_dict(),
                }
            )
            print(
                f"{name:32s} M={m:5d} quantize {t_q * 1e3:7.1f} us "
                f"({m * k * 4 / t_q / 1e9:.2f} TB/s) = {t_q / t_mx:5.1%} of the MXFP8 GEMM "
                f"{t_mx * 1e3:7.1f} us; bf16 {t_bf * 1e3:7.1f} us: "
                f"x{t_bf / t_mx:.2f}, x{t_bf / (t_mx - t_q):.2f} without the pass; fp32 "
                f"rounding: quantize {t_q_sw * 1e3:7.1f} us, GEMM x{t_bf / t_mx_sw:.2f}",
                flush=True,
            )
            del xs
        del w, wbf
        torch.cuda.empty_cache()
    return rows


def peak_bf16() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench(lambda: a @ b) / 1e9


def gemm_rows(shapes, ms, layouts=("trtllm", "cutlass"), save=None) -> list[dict]:
    """The rule's config vs bf16 per shape, M and layout (``save(rows)`` after each shape)."""
    from mxfp8_convert.runtime.hopper import choose_config, device_facts, triton_linear

    rows = []
    facts = device_facts(torch.device("cuda"))
    for name, n, k in shapes:
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        mx = {lay: random_weight(n, k, lay) for lay in layouts}
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = time_bf16(x, wbf)
            flops = 2 * m * n * k
            for lay, (w, q, code) in mx.items():
                cfg = choose_config(m, n, k, facts)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                triton_linear(x, w, out=out, config=cfg)
                t = time_mx(x, w, cfg)
                rows.append({"shape": name, "m": m, "n": n, "k": k, "layout": lay, "ms": t,
                             "tflops": flops / t / 1e9, "bf16_ms": t_bf16,
                             "bf16_tflops": flops / t_bf16 / 1e9, "ratio": t_bf16 / t,
                             "rel_err": rel_err(out, x, q, code),
                             "unwritten": int(out.isnan().sum()), "config": cfg.to_dict()})
                r = rows[-1]
                print(
                    f"{name:32s} M={m:5d} {lay:8s} {r['tflops']:7.1f} TF/s  "
                    f"bf16 {r['bf16_tflops']:7.1f}  x{r['ratio']:.2f}  err {r['rel_err']:.1e}  "
                    f"{t * 1e3:8.1f} us"
                    + (f"  UNWRITTEN {r['unwritten']}" if r["unwritten"] else ""),
                    flush=True,
                )
            del x
        del wbf, mx
        torch.cuda.empty_cache()
        if save:
            save(rows)
    return rows


def gemm_summary(rows: list[dict]) -> dict:
    """Per M: min / median / max ratio to bf16, rows >= 0.5x and >= 1.2x; printed and returned."""
    from statistics import median

    summary = {}
    for m in sorted({r["m"] for r in rows}):
        v = [r["ratio"] for r in rows if r["m"] == m]
        summary[m] = {"min": min(v), "median": median(v), "max": max(v), "rows": len(v),
                      "ge_0.5": sum(x >= 0.5 for x in v), "ge_1.2": sum(x >= 1.2 for x in v),
                      "max_rel_err": max(r["rel_err"] for r in rows if r["m"] == m),
                      "unwritten": sum(r["unwritten"] for r in rows if r["m"] == m)}
        s_ = summary[m]
        print(f"M={m:5d} min {s_['min']:.2f} median {s_['median']:.2f} max {s_['max']:.2f}  "
              f">=0.5x {s_['ge_0.5']}/{len(v)}  >=1.2x {s_['ge_1.2']}/{len(v)}  "
              f"max err {s_['max_rel_err']:.1e}")
    return summary


DECODE_MS = (1, 2, 4, 16)


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
    return lambda i: (
        lambda: _read_kernel[(grid,)](
            words[i], sink, words[i].numel(), BLOCK=block, ITERS=iters, num_warps=8
        )
    )


def _linear_calls(xs, wbfs):
    return lambda i: (lambda: torch.nn.functional.linear(xs[i], wbfs[i]))


def _mx_calls(xs, ws, cfg):
    from mxfp8_convert.runtime.hopper.launch import triton_linear

    return lambda i: (lambda: triton_linear(xs[i], ws[i], config=cfg))


def decode_rows(shapes, ms, layouts, floor: bool = False, hot: bool = False) -> list[dict]:
    """Decode timing (M <= 16): operand copies made once per shape, bf16 and the rule in the same
    run. ``floor``: also a kernel that only reads the fp8 weight bytes (the ceiling of any kernel
    streaming them). ``hot``: every call reads one activation tensor (in L2 after the first, as
    in a model where the kernel before has just written it); the weights are one copy per call."""
    from mxfp8_convert.runtime.hopper import choose_config, device_facts, triton_linear

    facts = device_facts(torch.device("cuda"))
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
            ws[lay] = [w] + [
                MXFP8Weight(w.data.clone(), w.scale.clone(), lay) for _ in range(c_mx - 1)
            ]
        wref = dequantize_mxfp8(q, code).double().t()
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xs = [x if hot else x.clone() for _ in range(max(c_bf, c_mx))]
            ref = fake_quantize_mxfp8(x).double() @ wref
            t_bf16 = time_graph(_linear_calls(xs, wbfs), c_bf)
            if floor:
                t_read = min(time_graph(_read_calls(ws[layouts[0]], b, it), c_mx)
                             for b, it in ((2048, 1), (4096, 4)))
                rows.append({"shape": name, "m": m, "n": n, "k": k, "layout": "-",
                             "variant": "read-only", "us": t_read * 1e3, "bf16_us": t_bf16 * 1e3,
                             "ratio": t_bf16 / t_read, "rel_err": 0.0, "unwritten": 0,
                             "weight_tbps": n * k / t_read / 1e9})
                print(
                    f"{name:32s} M={m:3d} reading the fp8 weight alone {t_read * 1e3:8.1f} us  "
                    f"bf16 {t_bf16 * 1e3:8.1f} us  x{t_bf16 / t_read:.2f} (the ceiling)",
                    flush=True,
                )
            cfg = choose_config(m, n, k, facts)
            for lay in layouts:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                triton_linear(x, mx[lay][0], out=out, config=cfg)
                t = time_graph(_mx_calls(xs, ws[lay], cfg), c_mx)
                unwritten = int(out.isnan().sum())
                err = float((out.double() - ref).norm() / ref.norm())
                rows.append(
                    {
                        "shape": name,
                        "m": m,
                        "n": n,
                        "k": k,
                        "layout": lay,
                        "variant": "rule",
                        "us": t * 1e3,
                        "bf16_us": t_bf16 * 1e3,
                        "ratio": t_bf16 / t,
                        "rel_err": err,
                        "unwritten": unwritten,
                        "weight_tbps": n * k * 1.03125 / t / 1e9,
                        "bf16_tbps": n * k * 2 / t_bf16 / 1e9,
                        "config": cfg.to_dict(),
                    }
                )
                print(
                    f"{name:32s} M={m:3d} {lay:8s} {t * 1e3:8.1f} us  bf16 {t_bf16 * 1e3:8.1f} us  "
                    f"x{t_bf16 / t:.2f}  err {err:.1e}"
                    + (f"  UNWRITTEN {unwritten}" if unwritten else ""),
                    flush=True,
                )
            del xs, x
        del wbf, wbfs, mx, ws, wref
        torch.cuda.empty_cache()
    return rows


def load_bench(root: Path, layers: int = 8) -> dict:
    """Load a converted checkpoint onto the GPU vs load a canonical one and lay it out on the
    GPU."""
    from safetensors.torch import save_file

    from mxfp8_convert import convert
    from mxfp8_convert.backends import BACKENDS

    shapes = {
        "self_attn.q_proj": (4096, 4096),
        "self_attn.k_proj": (1024, 4096),
        "self_attn.v_proj": (1024, 4096),
        "self_attn.o_proj": (4096, 4096),
        "mlp.gate_proj": (14336, 4096),
        "mlp.up_proj": (14336, 4096),
        "mlp.down_proj": (4096, 14336),
    }
    canon = {}
    for i in range(layers):
        for mod, (n, k) in shapes.items():
            _, q, code = random_weight(n, k, "trtllm", seed=i)
            canon[f"model.layers.{i}.{mod}"] = (q.cpu(), code.cpu())
    src_dir = root / "canonical"  # an SGLang-dialect MXFP8 source (weight + weight_scale_inv)
    src_dir.mkdir()
    tensors = {f"{name}.{part}": t.contiguous() for name, (q, code) in canon.items()
               for part, t in (("weight", q), ("weight_scale_inv", code))}
    save_file(tensors, str(src_dir / "model.safetensors"))
    qc = {
        "quant_method": "mxfp8",
        "fmt": "e4m3",
        "weight_block_size": [1, 32],
        "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic",
    }
    (src_dir / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "quantization_config": qc}))
    conv_dir = root / "converted"
    convert(src_dir, "trtllm", conv_dir)  # the converter itself lays the checkpoint out
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
        for key, fn in (
            ("converted", load_converted),
            ("canonical_plus_layout", load_canonical_and_layout),
        ):
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
    res = {
        "layers": layers,
        "bytes": nbytes,
        "times_s": times,
        "median_s": med,
        "layout_only_s": t_layout,
        "modules": len(canon),
    }
    print(
        f"load: {nbytes / 1e9:.2f} GB, {len(canon)} modules; converted {med['converted']:.3f} s, "
        f"canonical+layout {med['canonical_plus_layout']:.3f} s, "
        f"layout alone on GPU {t_layout:.3f} s",
        flush=True,
    )
    return res


def host_rows(shapes, ms) -> list[dict]:
    """Host (Python) microseconds per eager call, no GPU timing: the rule's choice
    (``choose_config`` on freshly probed facts) against its memoized form (``default_config``, what
    a call without
    ``config`` uses), and a whole ``triton_linear`` call (choice + launches, the GPU left to run)
    with the cache kept against the cache emptied before each call. Median of 5 rounds of 200."""
    import statistics

    from mxfp8_convert.runtime.hopper import (
        choose_config,
        default_config,
        device_facts,
        triton_linear,
    )

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

            row = {
                "shape": name,
                "m": m,
                "n": n,
                "k": k,
                "choose_us": per_call(
                    lambda m=m, n=n, k=k: choose_config(m, n, k, device_facts(dev))
                ),
                "memo_us": per_call(lambda m=m, n=n, k=k: default_config(m, n, k, dev, pdl)),
                "call_us": per_call(lambda x=x, w=w, out=out: triton_linear(x, w, out=out)),
                "call_nomemo_us": per_call(cold),
            }
            rows.append(row)
            print(
                f"{name:32s} M={m:3d} choose {row['choose_us']:6.1f} us  "
                f"memoized {row['memo_us']:5.2f} us  "
                f"call {row['call_us']:6.1f} us (rule each call: {row['call_nomemo_us']:6.1f} us)",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["gemm", "load", "decode", "quant", "host"])
    p.add_argument("--floor", action="store_true",
                   help="decode: also time a kernel that only reads the fp8 weight bytes")
    p.add_argument("--hot", action="store_true",
                   help="decode: one activation tensor for every call (hot in L2, as in a model)")
    p.add_argument(
        "--shapes",
        default="",
        help="only shapes whose name contains one of these (comma-separated)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument(
        "--layouts",
        default="trtllm,cutlass",
        help="gemm, decode: layouts to time (comma-separated)",
    )
    p.add_argument("--ms", default="")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"env": environment(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": args.mode,
              "command": " ".join(["python", "benchmarks/bench_gemm.py", *sys.argv[1:]]),
              "mxfp8_pdl": os.environ.get("MXFP8_PDL")}
    print(json.dumps(result["env"]), flush=True)
    keys = [key for key in args.shapes.split(",") if key]
    shapes = [sh for sh in MODEL_SHAPES if not keys or any(key in sh[0] for key in keys)]
    ms = (
        [int(m) for m in args.ms.split(",")]
        if args.ms
        else list(DECODE_MS if args.mode == "decode" else MS)
    )
    layouts = tuple(args.layouts.split(","))
    if args.mode == "gemm":
        result["bf16_peak_tflops_8192"] = peak_bf16()
        print(f"bf16 8192^3: {result['bf16_peak_tflops_8192']:.1f} TF/s", flush=True)
        def save(rows):  # after each shape: a run stopped at its time limit keeps its rows
            (out / "bench_gemm.json").write_text(json.dumps({**result, "rows": rows}, indent=1))

        result["rows"] = gemm_rows(shapes, ms, layouts, save)
        result["summary"] = gemm_summary(result["rows"])
    elif args.mode == "decode":
        result["hot"] = args.hot
        result["rows"] = decode_rows(shapes, ms, layouts, args.floor, args.hot)
        result["summary"] = gemm_summary([r for r in result["rows"] if r["variant"] == "rule"])
    elif args.mode == "host":
        result["rows"] = host_rows(shapes, ms)
    elif args.mode == "quant":
        result["rows"] = quant_share_rows(shapes, ms)
    else:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            result["load"] = load_bench(Path(tmp))
    (out / f"bench_{args.mode}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
