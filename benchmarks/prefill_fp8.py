"""FP8 tensor-core paths at prefill (M >= 2048) on Hopper, against the cuBLAS path and bf16
(issue 26's last floor: M in {2048, 8192} >= 0.85x every row, median >= 1.0x).

    python3 benchmarks/prefill_fp8.py [--ms 2048,8192] [--shapes a,b] [--modes 0,1,2] [--out DIR]
    python3 benchmarks/prefill_fp8.py --modes "" --block128 --out DIR   # the block-128 path
    TRITON_INTERPRET=1 python3 benchmarks/prefill_fp8.py --check-only   # CPU: the math

SM90 has no block-scaled MMA: with UE8M0 scales on every 32 elements of K for both operands, an
FP8 wgmma can only run 32 deep at a time into a fresh fp32 tile ``P``, which is then promoted,
``acc += P * 2^(ea[m] + eb[n])``. The Triton kernel here does that per 32-block of each K-tile,
in three modes:

* ``0`` (fmul): the promotion as two CUDA-core operations an element, ``s = sa[m] * sb[n]`` and
  ``acc = P * s + acc``;
* ``1`` (smma): the scale tile ``S = sa (x) sb`` computed by a second MMA (bf16, 16 deep, one
  non-zero column of ``sa`` and row of ``sb``: exact products of powers of two), so that the
  promotion is one FMA an element and the outer product runs on the tensor cores;
* ``2`` (ceiling): no promotion at all, ``acc = A @ B + acc`` over the raw e4m3 bytes: wrong
  numbers, timed only, the rate of the same loop and loads with nothing but the MMA.

``--block128`` times the product's block-128 path instead (``runtime/hopper/regroup.py``: both
operands regrouped to one scale per 128 of K, cuBLAS's 1x128 FP8 GEMM) in one chunk, its GEMM
alone on operands regrouped beforehand, and its passes (activations, weight, both) alone; then
the path and its passes again with the e4m3 rounding done in fp32 arithmetic, as under Triton's
interpreter (``-sw``), against the GPU's conversion that the product uses (the check first
asserts that both give the same bytes).

Rows (trtllm layout, the model shapes of ``runtime/hopper/shapes.py``): bf16 ``F.linear``, the
rule's path, the cuBLAS path (``rules.cublas_config``) and each mode x tile, timed as
``bench_gemm.py`` does (CUDA-graph replays over rotating operand copies; the activation
quantization counted). Every path is checked against the float64 reference of the same quantized
operands first. Writes ``prefill_fp8.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from statistics import median

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mxfp8_convert.runtime import MXFP8Weight  # noqa: E402
from mxfp8_convert.runtime.hopper.jit import FP_FUSION, LAYOUT_CODE, _pow2_f32  # noqa: E402
from mxfp8_convert.runtime.hopper.launch import (  # noqa: E402
    _quantize_codes,
    _scale_geometry,
    _scale_operand,
)
from mxfp8_convert.runtime.hopper.shapes import MODEL_SHAPES  # noqa: E402

#: (BM, BN, warps, stages, 32-blocks an iteration)
TILES = ((128, 128, 8, 4, 4), (128, 256, 8, 3, 4), (256, 128, 8, 3, 4), (128, 128, 8, 4, 2))


@triton.jit
def _bf16_pow2(code):
    """bf16 ``2^(code-127)`` (code 0: the subnormal 2^-127)."""
    return tl.where(code == 0, 0x40, code << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _prefill_kernel(
    a_ptr, ca_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om,
    scale_c, scale_cp4,
    LAYOUT: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SUB: tl.constexpr, GROUP_M: tl.constexpr, DOT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group
    pid_n = (pid % width) // group

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows = tl.minimum(offs_n, N - 1)
    if LAYOUT == 1:  # trtllm: logical row l lives at physical row 32*(l//32) + 8*(l%4) + (l%32)//4
        rows = (rows // 32) * 32 + 8 * (rows % 4) + (rows % 32) // 4
    k32 = tl.arange(0, 32)
    a_ptrs = a_ptr + rows_m[:, None] * stride_am + k32[None, :]  # [BM, 32]
    w_ptrs = w_ptr + rows.to(tl.int64)[None, :] * stride_wn + k32[:, None]  # [32, BN]
    ca_ptrs = ca_ptr + rows_m * (K // 32)
    if LAYOUT == 2:
        s_row = s_ptr + rows.to(tl.int64) * scale_c
    else:  # 128x4: (r//128)*(Cp/4)*512 + (r%32)*16 + ((r%128)//32)*4 bytes, in int32 words
        s_row = (s_ptr + (rows // 128).to(tl.int64) * (scale_cp4 * 128) + (rows % 32) * 4
                 + (rows % 128) // 32)
    col = tl.arange(0, 16)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, K // (32 * SUB)):
        if LAYOUT != 2:
            word = tl.load(s_row + (kt * SUB // 4) * 128)
        for j in tl.static_range(SUB):
            kb = kt * SUB + j
            a = tl.load(a_ptrs + kb * 32)
            b = tl.load(w_ptrs + kb * 32)
            if MODE == 2:
                acc = tl.dot(a, b, acc)
            else:
                ea = tl.load(ca_ptrs + kb)
                if LAYOUT == 2:
                    eb = tl.load(s_row + kb).to(tl.int32)
                else:
                    eb = (word >> (8 * ((kt * SUB + j) % 4))) & 0xFF
                p = tl.dot(a, b)
                if MODE == 0:
                    s = _pow2_f32(ea)[:, None] * _pow2_f32(eb)[None, :]
                elif DOT_BF16:
                    sa = tl.where(col[None, :] == 0, _bf16_pow2(ea)[:, None], 0.0)
                    sb = tl.where(col[:, None] == 0, _bf16_pow2(eb)[None, :], 0.0)
                    s = tl.dot(sa.to(tl.bfloat16), sb.to(tl.bfloat16))
                else:  # the interpreter: its bf16 casts truncate; the same products in fp32
                    sa = tl.where(col[None, :] == 0, _pow2_f32(ea)[:, None], 0.0)
                    sb = tl.where(col[:, None] == 0, _pow2_f32(eb)[None, :], 0.0)
                    s = tl.dot(sa, sb, input_precision="ieee")
                acc = p * s + acc
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def prefill_linear(x: torch.Tensor, w: MXFP8Weight, mode: int, tile) -> torch.Tensor:
    bm, bn, warps, stages, sub = tile
    m, k = x.shape
    n = w.shape[0]
    if k % (32 * sub):
        raise ValueError(f"K={k} is not a multiple of {32 * sub}")
    xq, xc = _quantize_codes(x)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    c, cp4 = _scale_geometry(w)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _prefill_kernel[grid](
        xq, xc, w.data, _scale_operand(w), out, m, n, k, xq.stride(0), w.data.stride(0),
        out.stride(0), c, cp4, LAYOUT=LAYOUT_CODE[w.layout], MODE=mode, BM=bm, BN=bn, SUB=sub,
        GROUP_M=8, DOT_BF16=x.device.type == "cuda", num_warps=warps, num_stages=stages,
        enable_fp_fusion=FP_FUSION)
    return out


_SIDE: dict[int, torch.cuda.Stream] = {}


def piped_linear(x: torch.Tensor, w: MXFP8Weight, chunks: int, priority: int) -> torch.Tensor:
    """The cuBLAS path with its passes overlapped: the activations quantized in ``chunks`` row
    blocks on a side stream (``priority``), block j + 1 while cuBLAS multiplies block j; the
    weight dequantized on the main stream while block 0 is quantized."""
    from mxfp8_convert.runtime.hopper.launch import dequantize_weight, quantize_activations

    m, k = x.shape
    side = _SIDE.setdefault(priority, torch.cuda.Stream(priority=priority))
    main = torch.cuda.current_stream()
    out = torch.empty((m, w.shape[0]), dtype=torch.bfloat16, device=x.device)
    step = ((m + chunks - 1) // chunks + 127) // 128 * 128
    bounds = [(r, min(r + step, m)) for r in range(0, m, step)]
    side.wait_stream(main)
    blocks, events = [], []

    def quantize(j):
        with torch.cuda.stream(side):
            a = quantize_activations(x[bounds[j][0]:bounds[j][1]])["deq"]
            a.record_stream(main)
            ev = torch.cuda.Event()
            ev.record(side)
        blocks.append(a)
        events.append(ev)

    quantize(0)
    wd = dequantize_weight(w)
    for j, (r0, r1) in enumerate(bounds):
        if j + 1 < len(bounds):
            quantize(j + 1)
        main.wait_event(events[j])
        torch.mm(blocks[j], wd.t(), out=out[r0:r1])
    return out


def block128_piped(x: torch.Tensor, w: MXFP8Weight, chunks: int) -> torch.Tensor:
    """The block-128 path with the activations regrouped in ``chunks`` row blocks on a side
    stream, block j + 1 while cuBLAS multiplies block j; the weight regrouped on the main stream
    meanwhile."""
    from mxfp8_convert.runtime.hopper.launch import regroup_activations, regroup_weight

    m = x.shape[0]
    side = _SIDE.setdefault(0, torch.cuda.Stream())
    main = torch.cuda.current_stream()
    out = torch.empty((m, w.shape[0]), dtype=torch.bfloat16, device=x.device)
    step = ((m + chunks - 1) // chunks + 127) // 128 * 128
    bounds = [(r, min(r + step, m)) for r in range(0, m, step)]
    side.wait_stream(main)
    blocks = []
    with torch.cuda.stream(side):
        for r0, r1 in bounds:
            xq, xsc = regroup_activations(x[r0:r1])
            ev = torch.cuda.Event()
            ev.record(side)
            blocks.append((xq, xsc, ev))
    wq, wsc = regroup_weight(w)
    for (r0, r1), (xq, xsc, ev) in zip(bounds, blocks, strict=True):
        main.wait_event(ev)
        xq.record_stream(main)
        xsc.record_stream(main)
        torch._scaled_mm(xq, wq.t(), scale_a=xsc, scale_b=wsc, out_dtype=torch.bfloat16,
                         out=out[r0:r1])
    return out


def time_block128(xs, ws, copies, piped: bool) -> dict[str, float]:
    """The regrouped path whole, its cuBLAS GEMM alone (operands regrouped beforehand) and its
    two regroup passes alone; the path and its passes again with fp32-arithmetic rounding."""
    from bench_gemm import software_rounding, time_graph

    from mxfp8_convert.runtime.hopper.config import GemmConfig, Kernel
    from mxfp8_convert.runtime.hopper.launch import (
        regroup_activations,
        regroup_weight,
        triton_linear,
    )

    n, k = ws[0].shape
    cfg = GemmConfig(64, 0, 256, Kernel.BLOCK128, fuse_quant=False, chunk_n=n)
    t = {"block128": time_graph(
        lambda i: (lambda: triton_linear(xs[i], ws[i], config=cfg)), copies)}
    ops = [(regroup_activations(xs[i]), regroup_weight(ws[i])) for i in range(copies)]

    def gemm(i):
        (xq, xsc), (wq, wsc) = ops[i]
        return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xsc, scale_b=wsc,
                                        out_dtype=torch.bfloat16)

    t["block128-gemm"] = time_graph(gemm, copies)
    for chunks in (2, 4) if piped else ():
        t[f"block128-piped{chunks}"] = time_graph(
            lambda i, c=chunks: (lambda: block128_piped(xs[i], ws[i], c)), copies)
    ops.clear()
    t["block128-act"] = time_graph(lambda i: (lambda: regroup_activations(xs[i])), copies)
    t["block128-weight"] = time_graph(lambda i: (lambda: regroup_weight(ws[i])), copies)
    t["block128-passes"] = time_graph(
        lambda i: (lambda: (regroup_activations(xs[i]), regroup_weight(ws[i]))), copies)
    with software_rounding():
        t["block128-sw"] = time_graph(
            lambda i: (lambda: triton_linear(xs[i], ws[i], config=cfg)), copies)
        t["block128-act-sw"] = time_graph(lambda i: (lambda: regroup_activations(xs[i])), copies)
        t["block128-weight-sw"] = time_graph(lambda i: (lambda: regroup_weight(ws[i])), copies)
    return t


def check(device: str, modes=(0, 1)) -> list[dict]:
    """Modes 0 and 1 against the float64 reference of the same quantized operands, both layouts,
    a tail in M and N; one line each."""
    from bench_gemm import rel_err, software_rounding

    rows = []
    g = torch.Generator(device=device).manual_seed(1)
    m, n, k = (40, 160, 256) if device == "cpu" else (300, 1056, 1024)
    tiles = ((32, 32, 4, 2, 4),) if device == "cpu" else TILES
    for layout in ("trtllm", "cutlass"):
        q = ((torch.randn(n, k, device=device, generator=g) * 96).clamp(-448, 448)
             .to(torch.float8_e4m3fn))
        code = torch.randint(116, 126, (n, k // 32), device=device, generator=g).to(torch.uint8)
        w = MXFP8Weight.from_canonical(q, code, layout)
        x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
        for mode in (mo for mo in modes if mo in (0, 1)):
            for tile in tiles:
                err = rel_err(prefill_linear(x, w, mode, tile), x, q, code)
                rows.append({"layout": layout, "mode": mode, "tile": tile, "rel_err": err})
                print(f"check {layout} mode {mode} {tile}: rel_err {err:.2e}", flush=True)
        if device == "cuda":
            from mxfp8_convert.runtime.hopper.config import GemmConfig, Kernel
            from mxfp8_convert.runtime.hopper.launch import triton_linear

            for chunk in (n, 256, 112):
                cfg = GemmConfig(64, 0, 256, Kernel.BLOCK128, fuse_quant=False, chunk_n=chunk)
                err = rel_err(triton_linear(x, w, config=cfg), x, q, code)
                rows.append({"layout": layout, "block128": chunk, "rel_err": err})
                print(f"check {layout} block128 chunk {chunk}: rel_err {err:.2e}", flush=True)
            from mxfp8_convert.runtime.hopper.launch import regroup_activations, regroup_weight

            hw = regroup_activations(x), regroup_weight(w)
            with software_rounding():
                sw = regroup_activations(x), regroup_weight(w)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       and torch.equal(sa, sb) for (a, sa), (b, sb) in zip(hw, sw, strict=True))
            rows.append({"layout": layout, "regroup_hw_equals_sw": same})
            print(f"check {layout} regroup: GPU rounding bytes == fp32 rounding bytes: {same}",
                  flush=True)
            for chunks in (2, 4):
                err = rel_err(block128_piped(x, w, chunks), x, q, code)
                rows.append({"layout": layout, "block128_piped": chunks, "rel_err": err})
                print(f"check {layout} block128 piped {chunks}: rel_err {err:.2e}", flush=True)
            for chunks in (1, 2, 4):
                err = rel_err(piped_linear(x, w, chunks, -1), x, q, code)
                rows.append({"layout": layout, "piped": chunks, "rel_err": err})
                print(f"check {layout} piped {chunks}: rel_err {err:.2e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="2048,8192")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--modes", default="0,1,2")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--piped", default="", help="CHUNKS:PRIORITY,... (e.g. 2:0,4:-1)")
    ap.add_argument("--block128", action="store_true",
                    help="time the regrouped 1x128 FP8 cuBLAS path, its GEMM and its passes")
    ap.add_argument("--block128-piped", action="store_true",
                    help="with --block128: also its activations regrouped on a side stream")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    modes = [int(v) for v in args.modes.split(",") if v]
    result = {"check": check(device, modes)}
    if args.check_only:
        return
    from bench_gemm import n_copies, random_weight, time_bf16, time_graph, time_mx

    from mxfp8_convert.runtime.hopper.probe import device_facts
    from mxfp8_convert.runtime.hopper.rules import choose_config, cublas_config

    wanted = [s for s in args.shapes.split(",") if s]
    shapes = [s for s in MODEL_SHAPES if not wanted or any(w in s[0] for w in wanted)]
    rows = []
    for name, n, k in shapes:
        w, _q, _code = random_weight(n, k, "trtllm")
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf = time_bf16(x, wbf)
            t_rule = time_mx(x, w, None)
            t_cublas = time_mx(x, w, cublas_config(m, n, k))
            row = {"shape": name, "n": n, "k": k, "m": m, "bf16_ms": t_bf, "rule_ms": t_rule,
                   "rule": choose_config(m, n, k, device_facts(x.device)).kind.value,
                   "rule_ratio": t_bf / t_rule, "cublas_ratio": t_bf / t_cublas, "modes": {}}
            copies = n_copies(w.data.numel() + w.scale.numel() + x.numel() * 2, m * n * 2)
            ws = [MXFP8Weight(w.data.clone(), w.scale.clone(), w.layout) for _ in range(copies)]
            xs = [x.clone() for _ in range(copies)]
            for mode in modes:
                for tile in TILES:
                    if k % (32 * tile[4]):
                        continue
                    t = time_graph(
                        lambda i, mode=mode, tile=tile, xs=xs, ws=ws: (
                            lambda: prefill_linear(xs[i], ws[i], mode, tile)), copies)
                    row["modes"][f"{mode}:{'x'.join(map(str, tile))}"] = t_bf / t
            for spec in (v for v in args.piped.split(",") if v):
                chunks, prio = (int(v) for v in spec.split(":"))
                t = time_graph(lambda i, c=chunks, p=prio, xs=xs, ws=ws: (
                    lambda: piped_linear(xs[i], ws[i], c, p)), copies)
                row["modes"][f"piped:{spec}"] = t_bf / t
            if args.block128:
                for key, t in time_block128(xs, ws, copies, args.block128_piped).items():
                    row["modes"][key] = t_bf / t
            del ws, xs
            best = {mo: max((r for key, r in row["modes"].items()
                             if key.split(":")[0] == str(mo)), default=0.0)
                    for mo in modes + (["piped"] if args.piped else [])
                    + (["block128", "block128-gemm", "block128-act", "block128-weight",
                       "block128-passes", "block128-sw", "block128-act-sw",
                       "block128-weight-sw"] if args.block128 else [])
                    + (["block128-piped2", "block128-piped4"] if args.block128_piped else [])}
            row["best"] = best
            rows.append(row)
            print(f"{name} M={m}: bf16 {t_bf * 1e3:.1f} us, rule ({row['rule']}) "
                  f"x{row['rule_ratio']:.2f}, cuBLAS path x{row['cublas_ratio']:.2f}, "
                  + ", ".join(f"mode {mo} x{r:.2f}" for mo, r in best.items()), flush=True)
            result["rows"] = rows
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "prefill_fp8.json").write_text(json.dumps(result, indent=1))
    for m in sorted({r["m"] for r in rows}):
        sel = [r for r in rows if r["m"] == m]
        print(f"M={m}: rule min / median x{min(r['rule_ratio'] for r in sel):.2f} / "
              f"{median(r['rule_ratio'] for r in sel):.2f}, cuBLAS path median "
              f"x{median(r['cublas_ratio'] for r in sel):.2f}; "
              + ", ".join(f"mode {mo} best median x{median(r['best'][mo] for r in sel):.2f}"
                          for mo in best))


if __name__ == "__main__":
    main()
