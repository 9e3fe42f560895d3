"""Where the Gluon wgmma decode kernel's time goes: the kernel with parts taken out, timed side by
side with the kernel itself (``wgmma_rule(cluster=False)``: the partials through global memory) in
the same CUDA-graph harness as ``bench_gemm.py`` (H200 only).

    python benchmarks/ablate_wgmma.py [--ms 8,16] [--shapes NAME,..] [--out DIR]

Each variant is ``gluon_mxfp8._wgmma_decode_kernel`` (fused quantization, bf16 words, that
rule's grid, ring and reduction) with some of these removed: a copy of its body as
of the seventh session (the shipped kernel carries no ablation switches; ``abl.full``, timed next
to the rule, shows whether the copy still matches it). The outputs of the ablated variants are
wrong by construction, only their times mean something:

- ``x:const``: the activations are not loaded (the quantization runs on a constant tile);
- ``x:none``: no activation path at all (no load, quantization, proxy fence or CTA barrier);
- ``mma:none``: no wgmma and no rescale (the weight tiles are still waited for);
- ``red:none``: no split-K partials and no reduction (each split stores its own result).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gemm import n_copies, random_weight, time_graph  # noqa: E402
from mxfp8_convert.runtime import MXFP8Weight  # noqa: E402
from tests.runtime.shapes import MODEL_SHAPES  # noqa: E402


def _kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from mxfp8_convert.runtime import gluon_mxfp8 as g
    from mxfp8_convert.runtime.triton_mxfp8 import _pow2_f32, _scale_row_base

    @gluon.jit
    def ablated(
        w_desc, x_ptr, s_ptr, out_ptr, ws_ptr, lock_ptr, M, N, K, stride_xm, stride_om, stride_os, scale_cp4,
        split_k, LAYOUT: gl.constexpr, PARTIAL: gl.constexpr, SERIAL: gl.constexpr, BM: gl.constexpr,
        QM: gl.constexpr, X_SMEM: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr, RED_CHUNK: gl.constexpr,
        X: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr,
    ):
        if PDL:
            g._gdc_wait_and_release()
        BN: gl.constexpr = w_desc.block_type.shape[0]
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BM, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        pid_n = gl.program_id(0)
        k_tiles = K // 128
        per_split = gl.cdiv(k_tiles, split_k)
        kt0 = gl.program_id(1) * per_split
        n_it = gl.minimum(kt0 + per_split, k_tiles) - kt0
        p0 = pid_n * BN
        w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 128], w_desc.layout)
        x_s = gl.allocate_shared_memory(gl.float8e4nv, [2, BM, 128], X_SMEM)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], g.mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            g.mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES - 1):
            g._issue_tile(w_desc, None, w_s, x_s, bars.index(s), s, p0, (kt0 + s) * 128, s < n_it, False)
        rows = p0 + gl.arange(0, BN, layout=row_l)
        sw_ptrs = s_ptr + _scale_row_base(rows, 0, scale_cp4, LAYOUT)
        cols = gl.arange(0, BM, layout=col_l)
        acc = gl.zeros([BN, BM], gl.float32, acc_l)
        zero = gl.zeros([BN, BM], gl.float32, acc_l)
        last = kt0 + n_it - 1
        sw_word = gl.load(sw_ptrs + kt0 * 128)
        sw_1 = gl.load(sw_ptrs + gl.minimum(kt0 + 1, last) * 128)
        x4_l: gl.constexpr = gl.BlockedLayout([BM // QM, 1, 1, QM], [1, QM, 1, 32 // QM], [1, 1, num_warps, 1],
                                              [3, 2, 1, 0])
        xs_s = gl.allocate_shared_memory(gl.float32, [2, 4, BM], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        xs_rows = g._reinterpret(xs_s, gl.float32, [8, BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        z_l: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [num_warps, 1], [1, 0])
        for b in gl.static_range(2):
            xs_s.index(b).store(gl.zeros([4, BM], gl.float32, z_l))
        xl_l: gl.constexpr = gl.SliceLayout(0, gl.BlockedLayout([1, 1, 1, QM // 2], [1, QM, 1, 32 // QM],
                                                                [1, 1, num_warps, 1], [3, 2, 1, 0]))
        xr = gl.arange(0, QM, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl_l)))
        xb4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl_l)))
        xe = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl_l)))
        xrb = gl.expand_dims(gl.expand_dims(xr.to(gl.int64) * stride_xm, 1) + gl.expand_dims(xb4 * 16, 0), 2)
        x_ptrs = x_ptr + xrb + gl.expand_dims(gl.expand_dims(xe, 0), 1)
        x_mask = (xrb + gl.expand_dims(gl.expand_dims(xe, 0), 1)) < M * stride_xm
        if X == 2:
            xt = gl.load(x_ptrs + kt0 * 64, mask=x_mask, other=0)
        else:
            xt = gl.full([QM, 4, 16], 0x3F803F80, gl.int32, xl_l) + kt0
        for i in range(n_it):
            stage = i % STAGES
            nxt = i + STAGES - 1
            g._issue_tile(w_desc, None, w_s, x_s, bars.index(nxt % STAGES), nxt % STAGES, p0, (kt0 + nxt) * 128,
                          nxt < n_it, False)
            kn = gl.minimum(kt0 + i + 1, last)
            sw_new = gl.load(sw_ptrs + gl.minimum(kt0 + i + 2, last) * 128)
            xb = i % 2
            if X == 2:
                xt_next = gl.load(x_ptrs + kn * 64, mask=x_mask, other=0)
            else:
                xt_next = xt + 1
            if X >= 1:
                g._quantize_tile(xt, x_s.index(xb), xs_s.index(xb), x4_l)
                g.fence_async_shared()
                g._cta_barrier()
            sx0 = xs_rows.index(xb * 4 + 0).load(col_l)
            sx1 = xs_rows.index(xb * 4 + 1).load(col_l)
            sx2 = xs_rows.index(xb * 4 + 2).load(col_l)
            sx3 = xs_rows.index(xb * 4 + 3).load(col_l)
            g.mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
            if MMA:
                p_0 = g._part(w_s, x_s, stage, xb, zero, 0)
                p_1 = g._part(w_s, x_s, stage, xb, zero, 1)
                p_2 = g._part(w_s, x_s, stage, xb, zero, 2)
                p_3 = g._part(w_s, x_s, stage, xb, zero, 3)
                p_0 = g.warpgroup_mma_wait(num_outstanding=3, deps=(p_0,))
                acc = g._rescale(acc, p_0, sw_word, sx0, 0)
                p_1 = g.warpgroup_mma_wait(num_outstanding=2, deps=(p_1,))
                acc = g._rescale(acc, p_1, sw_word, sx1, 1)
                p_2 = g.warpgroup_mma_wait(num_outstanding=1, deps=(p_2,))
                acc = g._rescale(acc, p_2, sw_word, sx2, 2)
                p_3 = g.warpgroup_mma_wait(num_outstanding=0, deps=(p_3,))
                acc = g._rescale(acc, p_3, sw_word, sx3, 3)
            else:  # keep the scale words and activation scales alive
                acc = acc + gl.expand_dims(_pow2_f32(sw_word & 0xFF), 1) * gl.expand_dims(sx0 + sx1 + sx2 + sx3, 0)
            sw_word, sw_1 = sw_1, sw_new
            xt = xt_next
        for s in gl.static_range(STAGES):
            g.mbarrier.invalidate(bars.index(s))
        mask = gl.expand_dims(rows < N, 1) & gl.expand_dims(cols < M, 0)
        off = gl.expand_dims(cols.to(gl.int64), 0) * stride_om + gl.expand_dims(rows, 1)
        ws_off = gl.expand_dims(cols.to(gl.int64), 0) * N + gl.expand_dims(rows, 1)
        if PARTIAL:
            gl.store(ws_ptr + gl.program_id(1).to(gl.int64) * stride_os + ws_off, acc, mask=mask)
            if SERIAL:
                g._cta_barrier()
                arrived = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
                if arrived == split_k - 1:
                    total = gl.zeros([BN, BM], gl.float32, acc_l)
                    for sp in range(0, split_k, RED_CHUNK):
                        for j in gl.static_range(RED_CHUNK):
                            total = total + gl.load(ws_ptr + (sp + j) * stride_os + ws_off,
                                                    mask=mask & (sp + j < split_k), other=0.0, cache_modifier=".cg")
                    gl.store(out_ptr + off, total.to(out_ptr.dtype.element_ty), mask=mask)
                    gl.atomic_xchg(lock_ptr + pid_n, 0)
        else:
            gl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return ablated


_ABLATED = None


def ablated_call(x, weight: MXFP8Weight, out, cfg, *, x_mode: int, mma: bool, red: bool):
    """One call of the ablated kernel (+ the reduction kernel where the rule has one and ``red``)."""
    global _ABLATED
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mxfp8_convert.runtime import gluon_mxfp8 as g
    from mxfp8_convert.runtime.triton_mxfp8 import _reduce_splits, _split_k_buffers

    if _ABLATED is None:
        _ABLATED = _kernel()
    m, k = x.shape
    n = weight.shape[0]
    bm = 8 if m <= 8 else 16
    w_desc = TensorDescriptor(weight.data, [n, k], [k, 1], [64, 128], g._smem_layout(64))
    run_cfg = cfg if red else dataclasses.replace(cfg, split_k=1)
    tiles = -(-n // 64)
    partial, serial, ws, lock = _split_k_buffers(out, run_cfg, tiles)
    _ABLATED[(tiles, cfg.split_k)](
        w_desc, x.view(torch.int32), weight.scale.view(torch.int32), out, ws, lock, m, n, k, x.stride(0) // 2,
        out.stride(0), m * n, (k // 32 + 3) // 4, cfg.split_k,
        LAYOUT=g.LAYOUT_CODE[weight.layout], PARTIAL=partial, SERIAL=serial, BM=bm, QM=1 << (m - 1).bit_length(),
        X_SMEM=g._smem_layout(bm), STAGES=cfg.num_stages, PDL=cfg.pdl, RED_CHUNK=cfg.red_chunk, X=x_mode,
        MMA=mma, num_warps=4, **({"launch_pdl": True} if cfg.pdl else {}),
    )
    if partial and not serial:
        _reduce_splits(ws, out, out, cfg, False, pdl=cfg.pdl)


VARIANTS = {  # name: (x_mode, mma, red)
    "abl.full": (2, True, True),
    "x:const": (1, True, True),
    "x:none": (0, True, True),
    "mma:none": (2, False, True),
    "x:none,mma:none": (0, False, True),
    "red:none": (2, True, False),
    "x:none,mma:none,red:none": (0, False, False),
}


def _row(name: str, m: int, n: int, k: int, cfg, ws: list, wbfs: list) -> dict:
    """bf16, the kernel with ``cfg`` and every variant at one (shape, M), in one run."""
    from mxfp8_convert.runtime.triton_mxfp8 import triton_linear

    c, c_bf = len(ws), len(wbfs)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(c, c_bf))]
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(c)]
    t = {"bf16": time_graph(lambda i: (lambda: torch.nn.functional.linear(xs[i], wbfs[i])), c_bf),
         "rule": time_graph(lambda i: (lambda: triton_linear(xs[i], ws[i], out=outs[i], config=cfg)), c)}
    for vname, (xm, mma, red) in VARIANTS.items():
        t[vname] = time_graph(lambda i, xm=xm, mma=mma, red=red: (
            lambda: ablated_call(xs[i], ws[i], outs[i], cfg, x_mode=xm, mma=mma, red=red)), c)
    row = {"shape": name, "m": m, "split_k": cfg.split_k, "serial": cfg.serial_reduce,
           "us": {key: v * 1e3 for key, v in t.items()}}
    print(f"{name:32s} M={m:2d} s{cfg.split_k}{'' if cfg.serial_reduce else '-2k'} "
          + " ".join(f"{key} {v:.2f}" for key, v in row["us"].items()), flush=True)
    return row


def main() -> None:
    from mxfp8_convert.runtime.triton_mxfp8 import wgmma_rule

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="8,16")
    p.add_argument("--shapes", default="")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    keys = [s for s in args.shapes.split(",") if s]
    shapes = [sh for sh in MODEL_SHAPES if not keys or any(key in sh[0] for key in keys)]
    dev = torch.device("cuda")
    rows = []
    for name, n, k in shapes:
        w = random_weight(n, k, "trtllm")[0]
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        c = n_copies(n * k + n * k // 32, 16 * n * 2)
        c_bf = n_copies(n * k * 2, 16 * n * 2)
        ws = [w] + [MXFP8Weight(w.data.clone(), w.scale.clone(), "trtllm") for _ in range(c - 1)]
        wbfs = [wbf] + [wbf.clone() for _ in range(c_bf - 1)]
        for m in (int(v) for v in args.ms.split(",")):
            cfg = wgmma_rule(m, n, k, dev, cluster=False)  # the copy sums partials through global memory
            if cfg is not None:
                rows.append(_row(name, m, n, k, cfg, ws, wbfs))
        del ws, wbfs
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablate_wgmma.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
