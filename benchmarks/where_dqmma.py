"""Where the dequantizing wgmma kernel's time goes at serving batches (H200, issue 26).

    python3 benchmarks/where_dqmma.py [--ms 64,128] [--shapes a,b] [--out DIR]
        [--children nox,now] [--no-tiles]

In one run, trtllm layout, the 19 model shapes:

1. ``l2``: the L2 -> SM read rate of the chip (a Triton kernel summing an L2-resident buffer
   over every SM, 8 to 48 MB) and its HBM copy rate, the two ceilings the kernel meets;
2. ``rows``: bf16 ``F.linear``, the serving rule's config and (unless ``--no-tiles``) the
   one-chain kernel with 128 and 256 weight rows a program (two and four warpgroups sharing each
   activation box), each with the bytes it moves through L2 (the weight once, the activations
   once per weight-row tile, the split-K partials written and read) over its time;
3. ``--children`` (a child process each, so that Triton compiles the patched kernel): the rule's
   one-chain configs with one helper of ``dqmma.py`` replaced (:func:`patch`): ``nox`` / ``now``
   the activations' / the weight's TMA loads left out (the MMAs read what the ring holds);
   ``cvt1`` the conversion cut to one ``prmt`` a pair, ``nolds`` no fragment load and no
   conversion; ``swhot`` every scale-word load reads K-tile 0's words (cache hits after the
   first); ``pre`` each block's fragment loaded before the wait for the previous block's wgmma;
   ``d2`` / ``d3`` two / three wgmma groups in flight; ``acc2``, ``acc2d2``,
   ``acc4d3`` the 32-blocks into two or four accumulators in turn (and that depth).

Variants that skip loads or the conversion compute garbage and are only timed; the others are
checked against the float64 reference. Writes ``where_dqmma.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHARED = 220 * 1024
#: the variants whose output is the product (checked against the reference), the rule's included
COMPUTES = ("", "pre", "d2", "d3", "acc2", "acc2d2", "acc4d3")


def patch(variant: str) -> None:
    """Replace dqmma's TMA issue helpers before anything compiles (``nox`` / ``now``)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from mxfp8_convert.runtime.hopper import dqmma
    from mxfp8_convert.runtime.hopper.wgmma import _tma_load

    if variant == "nox":
        @gluon.jit
        def issue_w(w_desc, x_desc, w_s, bar, stage, p0, k0, pred):
            mbarrier.expect(bar, w_desc.block_type.nbytes, pred=pred)
            _tma_load(w_desc, [p0, k0], bar, w_s.index(stage), pred=pred)

        @gluon.jit
        def issue_x(x_desc, x_s, bar, stage, m0, k0, pred):
            pass

        dqmma._issue_w, dqmma._issue_x = issue_w, issue_x
    elif variant in ("d2", "d3"):
        dqmma._dqmma_kernel = _deep_kernel(int(variant[1]))
    elif variant.startswith("acc"):  # acc2, acc2d2, acc4d3: accumulators and depth
        accs, _, depth = variant[3:].partition("d")
        dqmma._dqmma_kernel = _deep_kernel(int(depth or 1), accs=int(accs))
    elif variant in ("cvt1", "nolds"):
        dqmma._dq_block = _light_block(variant)
    elif variant == "pre":
        dqmma._ktile = _early_load_ktile()
    elif variant == "swhot":
        @gluon.jit
        def scale_words(sw_ptrs, kt):
            return gl.load(sw_ptrs)

        dqmma._scale_words = scale_words
    elif variant == "now":
        @gluon.jit
        def issue_w(w_desc, x_desc, w_s, bar, stage, p0, k0, pred):
            mbarrier.expect(bar, 2 * x_desc.block_type.nbytes, pred=pred)

        dqmma._issue_w = issue_w
    else:
        raise ValueError(variant)


def _light_block(variant: str):
    """A 32-block's fragment made with less work, to time what the conversion costs:
    ``cvt1`` loads the fragment from shared memory as the kernel does and makes each bf16 pair
    with one ``prmt`` (no shift, mask or scale multiply); ``nolds`` loads nothing and makes the
    fragment from the rows' scale codes alone (no shared-memory load, no conversion)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    if variant == "cvt1":
        @gluon.jit
        def block(w_tile, word, j: gl.constexpr, a_l: gl.constexpr, FAST: gl.constexpr):
            q = w_tile.slice(j * 32, 32, dim=1).load(a_l)
            qi = q.to(gl.int8, bitcast=True)
            return gl.inline_asm_elementwise(
                "{ .reg .b32 t; cvt.u32.u16 t, $1; prmt.b32 $0, t, 0, 0x9180; }", "=r,h", [qi],
                dtype=gl.bfloat16, is_pure=True, pack=2)
        return block

    @gluon.jit
    def block(w_tile, word, j: gl.constexpr, a_l: gl.constexpr, FAST: gl.constexpr):
        BN: gl.constexpr = w_tile.shape[0]
        code = ((word >> (8 * j)) & 0xFF) - 120
        v = gl.expand_dims(code.to(gl.float32), 1)
        v, z = gl.broadcast(v, gl.zeros([BN, 32], gl.float32, a_l))
        return (v + z).to(gl.bfloat16)
    return block


def _early_load_ktile():
    """The kernel's K-tile with each 32-block's fragment loaded from shared memory before the
    wait for the previous block's wgmma, not after it (``pre``): the load's latency under the
    wait; the conversion as the kernel's."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from mxfp8_convert.runtime.hopper import dqmma as d

    _dq_convert, _issue = d._dq_convert, d._issue

    @gluon.jit
    def ktile(w_desc, x_desc, w_s, x_s, bars, acc, a, sw_word, i, kt0, n_it, p0, m0,
              a_l: gl.constexpr, STAGES: gl.constexpr, FAST: gl.constexpr):
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        w_tile = w_s.index(stage)
        q = w_tile.slice(0, 32, dim=1).load(a_l)
        for j in gl.static_range(4):
            a_next = _dq_convert(q, sw_word, j, FAST)
            xb = x_s.index(2 * stage + j // 2).slice((j % 2) * 32, 32, dim=1).permute((1, 0))
            acc = warpgroup_mma(a_next, xb, acc, is_async=True)
            if j < 3:
                q = w_tile.slice((j + 1) * 32, 32, dim=1).load(a_l)
            acc, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))
            a = a_next
            if j == 0:
                nxt = i + STAGES - 1
                _issue(w_desc, x_desc, w_s, x_s, bars.index(nxt % STAGES), nxt % STAGES, p0,
                       m0, (kt0 + nxt) * 128, nxt < n_it)
        return acc, a
    return ktile


def _deep_kernel(depth: int, accs: int = 1):
    """The one-chain kernel with ``depth`` wgmma groups in flight behind each issue (``d2``,
    ``d3``; the kernel's own: one): a 32-block's fragment stays live until the wait ``depth``
    blocks later, and a stage is refilled after block ``depth - 1``'s wait (when the previous
    K-tile's last wgmma has retired). ``accs`` 2 or 4 (``acc2``, ``acc2d2``, ``acc4d3``): the
    32-blocks go to that many accumulators in turn, summed before the epilogue, so consecutive
    wgmmas do not depend on each other's result."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from mxfp8_convert.runtime.hopper import dqmma as d
    from mxfp8_convert.runtime.hopper.jit import _scale_row_base

    _dq_block, _issue, _issue_w, _issue_x = d._dq_block, d._issue, d._issue_w, d._issue_x
    _epilogue, _gdc_wait_and_release = d._epilogue, d._gdc_wait_and_release
    DEPTH = gl.constexpr(depth)
    ACCS = gl.constexpr(accs)

    @gluon.jit
    def ktile(w_desc, x_desc, w_s, x_s, bars, acc, acc1, acc2, acc3, a1, a2, a3, sw_word, i,
              kt0, n_it, p0, m0, a_l: gl.constexpr, STAGES: gl.constexpr, FAST: gl.constexpr,
              D: gl.constexpr, A2: gl.constexpr):
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        w_tile = w_s.index(stage)
        for j in gl.static_range(4):
            a_next = _dq_block(w_tile, sw_word, j, a_l, FAST)
            xb = x_s.index(2 * stage + j // 2).slice((j % 2) * 32, 32, dim=1).permute((1, 0))
            if A2 == 4 and j == 3:
                acc3 = warpgroup_mma(a_next, xb, acc3, is_async=True)
            elif A2 == 4 and j == 2:
                acc2 = warpgroup_mma(a_next, xb, acc2, is_async=True)
            elif A2 >= 2 and j % 2 == 1:
                acc1 = warpgroup_mma(a_next, xb, acc1, is_async=True)
            else:
                acc = warpgroup_mma(a_next, xb, acc, is_async=True)
            if D == 3:
                acc, acc1, acc2, acc3, a1 = warpgroup_mma_wait(
                    num_outstanding=3, deps=(acc, acc1, acc2, acc3, a1))
                a1 = a2
            elif D == 2:
                acc, acc1, acc2, acc3, a2 = warpgroup_mma_wait(
                    num_outstanding=2, deps=(acc, acc1, acc2, acc3, a2))
            else:
                acc, acc1, acc2, acc3, a3 = warpgroup_mma_wait(
                    num_outstanding=1, deps=(acc, acc1, acc2, acc3, a3))
            a2 = a3
            a3 = a_next
            if j == D - 1:
                nxt = i + STAGES - 1
                _issue(w_desc, x_desc, w_s, x_s, bars.index(nxt % STAGES), nxt % STAGES, p0,
                       m0, (kt0 + nxt) * 128, nxt < n_it)
        return acc, acc1, acc2, acc3, a1, a2, a3

    @gluon.jit
    def kernel(
        w_desc, x_desc, s_ptr, b_ptr, out_ptr, ws_ptr,
        M, N, K, stride_om, stride_os, scale_cp4, split_k,
        LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
        STAGES: gl.constexpr, FAST: gl.constexpr, PDL: gl.constexpr, PREFETCH: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        if PDL and not PREFETCH:
            _gdc_wait_and_release()
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BM: gl.constexpr = x_desc.block_type.shape[0]
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        srow_l: gl.constexpr = gl.SliceLayout(1, a_l)
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        m_tiles = gl.cdiv(M, BM)
        pid_n = gl.program_id(0) // m_tiles
        m0 = (gl.program_id(0) % m_tiles) * BM
        split = gl.program_id(1)
        k_tiles = K // 128
        per_split = gl.cdiv(k_tiles, split_k)
        kt0 = split * per_split
        n_it = gl.minimum(kt0 + per_split, k_tiles) - kt0
        last = kt0 + n_it - 1
        p0 = pid_n * BN
        w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 128], w_desc.layout)
        x_s = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BM, 64], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES - 1):
            _issue_w(w_desc, x_desc, w_s, bars.index(s), s, p0, (kt0 + s) * 128, s < n_it)
            if not PREFETCH:
                _issue_x(x_desc, x_s, bars.index(s), s, m0, (kt0 + s) * 128, s < n_it)
        srows = p0 + gl.arange(0, BN, layout=srow_l)
        sw_ptrs = s_ptr + _scale_row_base(srows, 0, scale_cp4, LAYOUT)
        sw_word = gl.load(sw_ptrs + kt0 * 128)
        sw_1 = gl.load(sw_ptrs + gl.minimum(kt0 + 1, last) * 128)
        if PDL and PREFETCH:
            _gdc_wait_and_release()
            for s in gl.static_range(STAGES - 1):
                _issue_x(x_desc, x_s, bars.index(s), s, m0, (kt0 + s) * 128, s < n_it)
        acc = gl.zeros([BN, BM], gl.float32, acc_l)
        a1 = gl.zeros([BN, 32], gl.bfloat16, a_l)
        a2 = gl.zeros([BN, 32], gl.bfloat16, a_l)
        a3 = gl.zeros([BN, 32], gl.bfloat16, a_l)
        acc1 = gl.zeros([BN, BM], gl.float32, acc_l)
        acc2 = gl.zeros([BN, BM], gl.float32, acc_l)
        acc3 = gl.zeros([BN, BM], gl.float32, acc_l)
        acc, acc1, acc2, acc3, a1, a2, a3 = ktile(
            w_desc, x_desc, w_s, x_s, bars, acc, acc1, acc2, acc3, a1, a2, a3, sw_word, 0, kt0,
            n_it, p0, m0, a_l, STAGES, FAST, DEPTH, ACCS)
        sw_word, sw_1 = sw_1, gl.load(sw_ptrs + gl.minimum(kt0 + 2, last) * 128)
        for i in range(1, n_it):
            sw_new = gl.load(sw_ptrs + gl.minimum(kt0 + i + 2, last) * 128)
            acc, acc1, acc2, acc3, a1, a2, a3 = ktile(
                w_desc, x_desc, w_s, x_s, bars, acc, acc1, acc2, acc3, a1, a2, a3, sw_word, i,
                kt0, n_it, p0, m0, a_l, STAGES, FAST, DEPTH, ACCS)
            sw_word, sw_1 = sw_1, sw_new
        acc, acc1, acc2, acc3, a1, a2, a3 = warpgroup_mma_wait(
            num_outstanding=0, deps=(acc, acc1, acc2, acc3, a1, a2, a3))
        if ACCS == 2:
            acc = acc + acc1
        if ACCS == 4:
            acc = (acc + acc1) + (acc2 + acc3)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        _epilogue(acc, gl.arange(0, BN, layout=row_l), p0, m0, b_ptr, out_ptr, ws_ptr, split, M,
                  N, stride_om, stride_os, LAYOUT, HAS_BIAS, PARTIAL, num_warps)

    return kernel


def l2_rates() -> dict:
    """GB/s of an L2-resident read by every SM at several buffer sizes, and of an HBM copy."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, out_ptr, n, reps, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], tl.float32)
        for _ in range(reps):
            for off in range(pid * BLOCK, n, step):
                acc += tl.load(x_ptr + off + tl.arange(0, BLOCK))
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {}
    for mb in (8, 16, 24, 32, 48):
        n = mb * 2**20 // 4
        x = torch.randn(n, device="cuda")
        grid = sms * 8
        out = torch.empty(grid * 2048, device="cuda")
        reps = 40
        _read[(grid,)](x, out, n, reps, BLOCK=2048, num_warps=4)
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _read[(grid,)](x, out, n, reps, BLOCK=2048, num_warps=4)
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        res[f"l2_read_{mb}MB_GBps"] = n * 4 * reps / median(ts) / 1e9
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    torch.cuda.synchronize()
    res["hbm_copy_GBps"] = 2 * 2**30 * 10 / (a.elapsed_time(b) / 1e3) / 1e9
    return res


def traffic(cfg, m: int, n: int, k: int) -> int:
    """Bytes a dqmma config moves through L2: the weight and its scales once, the bf16
    activations once per weight-row tile, split-K partials written and read."""
    from mxfp8_convert.runtime.hopper.config import cdiv

    b = n * k + n * k // 32 + cdiv(n, cfg.block_n) * m * k * 2
    if cfg.split_k > 1:
        b += 2 * cfg.split_k * m * n * 4
    return b


def one_chain(m: int, n: int, k: int, facts, block_n: int):
    """The one-chain kernel with ``block_n`` rows a program, the M rows (up to 128) a program,
    the deepest ring that fits, K split to one wave, the rule's launch options."""
    from mxfp8_convert.runtime.hopper.rules import dqmma_config, dqmma_launch

    bm = min(128, 1 << (m - 1).bit_length())
    stages = min(4, SHARED // (block_n * 128 + 2 * bm * 64 * 2))
    cfg = dqmma_config(m, n, k, facts, block_n=block_n, block_m=bm, stages=stages, waves=1.0)
    return dqmma_launch(cfg, n, k, facts)


def rows(ms: list[int], shapes, variant: str, budget: float, t0: float,
         tiles: bool = True) -> list[dict]:
    from bench_gemm import random_weight, rel_err, time_bf16, time_graph
    from sweep_dqmma import label, mx_copies

    from mxfp8_convert.runtime.hopper.config import Kernel
    from mxfp8_convert.runtime.hopper.launch import triton_linear
    from mxfp8_convert.runtime.hopper.probe import device_facts
    from mxfp8_convert.runtime.hopper.rules import choose_config

    facts = device_facts(torch.device("cuda"))
    out = []
    for name, n, k in shapes:
        if time.time() - t0 > budget:
            print("budget spent", flush=True)
            break
        w, q, code = random_weight(n, k, "trtllm")
        wbf = None if variant else torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            rule = choose_config(m, n, k, facts)
            if variant and (rule.kind is not Kernel.DQMMA or rule.specialized):
                continue
            runs = [("rule", rule)]
            if not variant and tiles:
                runs += [(f"bn{bn}", one_chain(m, n, k, facts, bn)) for bn in (128, 256)]
            row = {"shape": name, "m": m, "n": n, "k": k, "variants": {}}
            if wbf is not None:
                row["bf16_ms"] = time_bf16(x, wbf)
            ws, xs, cm = mx_copies(x, w)
            for key, cfg in runs:
                try:
                    t = time_graph(lambda i, c=cfg, xs=xs, ws=ws: (
                        lambda: triton_linear(xs[i], ws[i], config=c)), cm)
                except Exception as e:  # noqa: BLE001
                    print(f"  {key} {label(cfg)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                v = {"ms": t, "config": cfg.to_dict(), "label": label(cfg)}
                if cfg.kind is Kernel.DQMMA:
                    v["l2_GBps"] = traffic(cfg, m, n, k) / (t * 1e-3) / 1e9
                if variant in COMPUTES:  # one that computes the product
                    o = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    triton_linear(x, w, out=o, config=cfg)
                    v["rel_err"] = rel_err(o, x, q, code)
                    v["unwritten"] = int(o.isnan().sum())
                    if "bf16_ms" in row:
                        v["ratio"] = row["bf16_ms"] / t
                row["variants"][key] = v
            del ws, xs
            out.append(row)
            cols = "  ".join(
                f"{kk} {vv['label']} {vv['ms'] * 1e3:5.1f}us"
                + (f" x{vv['ratio']:.2f}" if "ratio" in vv else "")
                + (f" L2 {vv['l2_GBps'] / 1e3:.1f}TB/s" if "l2_GBps" in vv else "")
                + (" BAD" if vv.get("rel_err", 0) > 1e-2 or vv.get("unwritten") else "")
                for kk, vv in row["variants"].items())
            print(f"{variant or 'main':4s} {name:30s} M={m:3d} {cols}", flush=True)
        del w, wbf
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,128")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variant", default="")
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--children", default="nox,now", help="patched variants, in child processes")
    ap.add_argument("--no-tiles", action="store_true", help="not the 128/256-row programs")
    a = ap.parse_args()
    t0 = time.time()
    from mxfp8_convert.runtime.hopper.shapes import MODEL_SHAPES

    ms = [int(v) for v in a.ms.split(",")]
    pats = a.shapes.split(",") if a.shapes else []
    shapes = [s for s in MODEL_SHAPES if not pats or any(p in s[0] for p in pats)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.variant:  # a child: the patched kernel's rows only
        patch(a.variant)
        res = rows(ms, shapes, a.variant, a.budget, t0)
        (out / f"where_{a.variant}.json").write_text(json.dumps(res))
        return 0
    doc = {"l2": l2_rates()}
    print(json.dumps(doc["l2"]), flush=True)
    doc["rows"] = rows(ms, shapes, "", a.budget, t0, tiles=not a.no_tiles)
    kids = [v for v in a.children.split(",") if v]
    for v in kids:
        cmd = [sys.executable, __file__, "--ms", a.ms, "--out", str(out), "--variant", v,
               "--budget", str(a.budget / 2)] + (["--shapes", a.shapes] if a.shapes else [])
        subprocess.run(cmd, check=False)
        p = out / f"where_{v}.json"
        doc[v] = json.loads(p.read_text()) if p.exists() else []
        p.unlink(missing_ok=True)
    (out / "where_dqmma.json").write_text(json.dumps(doc, indent=1))
    kid = {v: {(x["shape"], x["m"]): x["variants"]["rule"] for x in doc[v]} for v in kids}
    print("\nus: rule " + " ".join(kids) + "; rule's L2 TB/s; ratios to bf16")

    def f(t):
        return f"{t * 1e3:5.1f}" if t else "    -"

    for r in doc["rows"]:
        key, v = (r["shape"], r["m"]), r["variants"]
        for name in kids:  # a product-computing child's ratio, against this row's bf16
            c = kid[name].get(key)
            if c is not None and "rel_err" in c:
                v[name] = {**c, "ratio": r["bf16_ms"] / c["ms"]}
        times = " / ".join(f(kid[n].get(key, {}).get("ms")) for n in kids)
        bad = [n for n in v if v[n].get("rel_err", 0) > 1e-2 or v[n].get("unwritten")]
        print(f"{r['shape']:30s} M={r['m']:3d} {f(v['rule']['ms'])} / {times}  "
              f"L2 {v['rule'].get('l2_GBps', 0) / 1e3:4.1f}  "
              + " ".join(f"{n} x{v[n]['ratio']:.2f}" for n in v if "ratio" in v[n])
              + (f" BAD {bad}" if bad else ""))
    for m in ms:
        sub = [r["variants"] for r in doc["rows"] if r["m"] == m]
        names = sorted({n for v in sub for n in v if "ratio" in v[n]})
        for key in names:
            rs = [v[key]["ratio"] for v in sub if key in v and "ratio" in v[key]]
            print(f"M={m} {key}: min {min(rs):.2f} median {median(rs):.2f} ({len(rs)})")
        best = [max(v[n]["ratio"] for n in v if "ratio" in v[n]) for v in sub]
        if best:
            print(f"M={m} best of all: min {min(best):.2f} median {median(best):.2f}")
    (out / "where_dqmma.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
