"""Sweep of the dequantizing wgmma kernel's configs against bf16 on the model shapes (H200).

    python3 benchmarks/sweep_dqmma.py [--ms 32,64,...] [--shapes a,b] [--out DIR] [--check]
        [--narrow]

For each M and shape: bf16 F.linear and every candidate config (block_n, block_m, stages,
split_k) of ``Kernel.DQMMA`` timed as ``bench_gemm.py`` times (CUDA-graph replays over rotating
operand copies), trtllm layout; the best config per row and its ratio are printed and written to
``sweep_dqmma.json``; ``--narrow``: only the rule's config, the one-chain kernel at its rule
and the warp-specialized tiles (:func:`candidates`). ``--check`` first compares the kernel with
a float64 reference (both layouts, bias, split-K) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm import (  # noqa: E402
    n_copies,
    random_weight,
    rel_err,
    time_bf16,
    time_graph,
)

from mxfp8_convert.runtime import MXFP8Weight  # noqa: E402
from mxfp8_convert.runtime.hopper.config import GemmConfig, Kernel, cdiv  # noqa: E402
from mxfp8_convert.runtime.hopper.launch import triton_linear  # noqa: E402
from mxfp8_convert.runtime.hopper.shapes import MODEL_SHAPES  # noqa: E402

SMEM = 220 * 1024


def stages_for(bm: int) -> list[int]:
    return {16: [3, 5], 32: [3, 5], 64: [3, 5], 128: [3, 4], 256: [2, 3]}[bm]


def splits_for(tiles: int, k_tiles: int, sms: int = 132) -> list[int]:
    out = {1}
    for w in (1, 2):
        for s in (-(-w * sms // tiles), w * sms // tiles):  # up to / at most w waves
            s = max(1, min(s, k_tiles // 2))
            out.add(cdiv(k_tiles, cdiv(k_tiles, s)))  # no empty split
    return sorted(out)


def ws_stages(bn: int, bm: int) -> int:
    """The deepest ring of the specialized kernel within ~200 KB of shared memory (at most 8)."""
    return min(8, 200 * 1024 // (bn * 128 + bm * 64 * 2 * 2))


def candidates(m: int, n: int, k: int, facts) -> list[GemmConfig]:
    """The rule's config, the unspecialized kernel at its own rule, the specialized kernel's
    tiles (128 weight rows: two consumer warpgroups; the M rows rounded up to a power of two,
    up to 128 or 256 tokens a program) at the deepest ring, split-K to about one
    or two waves, and the cuBLAS path from M = 256."""
    from mxfp8_convert.runtime.hopper.rules import choose_config, cublas_config, dqmma_config

    out = [choose_config(m, n, k, facts), dqmma_config(m, n, k, facts)]
    p2 = 1 << (m - 1).bit_length()
    for bn in (128,):
        bms = (min(p2, 128),) if m <= 128 else (128, 256)
        if m == 128:
            bms = (128, 64)
        for bm in bms:
            for waves in (1.0, 2.0):
                out.append(dqmma_config(m, n, k, facts, block_n=bn, block_m=bm,
                                        stages=ws_stages(bn, bm), waves=waves,
                                        specialized=True))
    if m >= 256:  # the cuBLAS path (the weight dequantized chunk by chunk)
        out.append(cublas_config(m, n, k))
    return distinct(out)


def distinct(configs: list[GemmConfig]) -> list[GemmConfig]:
    """``configs`` in order without repeats."""
    seen, uniq = set(), []
    for c in configs:
        key = tuple(sorted(c.to_dict().items()))
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq


def all_candidates(m: int, n: int, k: int, facts) -> list[GemmConfig]:
    """Every config of the 13:15 sweep (one-chain dqmma tiles, splits and rings; the FP8
    kernel's variants at M = 32; the cuBLAS path from M = 256), then :func:`candidates`."""
    bms = {32: (32,), 64: (64, 32), 128: (128, 64), 256: (256, 128), 512: (256, 128),
           2048: (256, 128), 8192: (256, 128)}.get(m, (min(256, 1 << (m - 1).bit_length()),))
    out = []
    for bn in (64, 128):
        for bm in bms:
            tiles = cdiv(n, bn) * cdiv(m, bm)
            for st in stages_for(bm):
                for sp in splits_for(tiles, k // 128) if m < 2048 else (1,):
                    out.append(GemmConfig(bn, bm, 128, Kernel.DQMMA, split_k=sp, num_stages=st,
                                          num_warps=bn // 16, fuse_quant=False))
    if m >= 256:  # the cuBLAS path (the weight dequantized chunk by chunk)
        from mxfp8_convert.runtime.hopper.rules import cublas_config

        out.append(cublas_config(m, n, k))
    if m <= 32:  # the FP8 wgmma kernel (activations quantized inside)
        from mxfp8_convert.runtime.hopper.rules import launch_options, wgmma_config

        seen = set()
        # 128-row programs (one an SM) and 64-row ones (three an SM by registers): splits that
        # make at most 1, 2 or 3 programs an SM, a second kernel summing
        for bn, fits in ((128, (1,)), (64, (1, 2, 3))):
            for per_sm in fits:
                cap = max(1, per_sm * facts.sms // cdiv(n, bn))
                c = wgmma_config(m, n, k, facts, waves=16, fuse_quant=True, sw_ahead=2,
                                 max_split=min(16, cap), block_n=bn, serial_reduce=False)
                c = launch_options(dataclasses.replace(c, serial_reduce=c.split_k == 1), m,
                                   facts)
                key = tuple(sorted(c.to_dict().items()))
                if key not in seen:
                    seen.add(key)
                    out.append(c)
        for bn in (64, 128):
            for waves in (1, 2, 3, 4):
                for cl in (False, True):
                    for serial in (True, False):
                        if cl and not serial:
                            continue
                        c = wgmma_config(m, n, k, facts, waves=waves, fuse_quant=True,
                                         sw_ahead=2, max_split=16, cluster=cl, block_n=bn,
                                         serial_reduce=serial)
                        c = launch_options(c, m, facts)
                        key = tuple(sorted(c.to_dict().items()))
                        if key not in seen:
                            seen.add(key)
                            out.append(c)
    seen = set()
    uniq = []
    for c in out + candidates(m, n, k, facts):
        key = tuple(sorted(c.to_dict().items()))
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq


def label(c: GemmConfig) -> str:
    if c.kind is Kernel.CUBLAS:
        return "cublas"
    if c.kind is Kernel.DQMMA:
        ws = "ws" if c.specialized else "dq"
        return f"{ws}{c.block_n}x{c.block_m}/st{c.num_stages}/s{c.split_k}{'+pdl' if c.pdl else ''}"
    red = "cl" if c.cluster else ("ser" if c.serial_reduce else "2k")
    return f"wg{c.block_n}/s{c.split_k}{red}{'+pdl' if c.pdl else ''}"


def check() -> bool:
    ok = True
    for (n, k) in ((4096, 4096), (1024, 2560), (576, 7168), (7168, 2048)):
        for lay in ("trtllm", "cutlass"):
            w, q, code = random_weight(n, k, lay, seed=n + k)
            for m in (17, 32, 100, 300):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                wg = []
                if m <= 32:
                    from mxfp8_convert.runtime.hopper.probe import device_facts
                    from mxfp8_convert.runtime.hopper.rules import launch_options, wgmma_config

                    facts = device_facts(torch.device("cuda"))
                    for bn, cl, ser in ((64, False, True), (128, False, False), (64, True, True)):
                        wg.append(launch_options(wgmma_config(
                            m, n, k, facts, waves=2, fuse_quant=True, sw_ahead=2, max_split=16,
                            cluster=cl, block_n=bn, serial_reduce=ser), m, facts))
                for cfg in (
                    *wg,
                    GemmConfig(
                        128,
                        128 if m > 64 else 64,
                        128,
                        Kernel.DQMMA,
                        split_k=1,
                        num_stages=3,
                        num_warps=8,
                    ),
                    GemmConfig(64, 32, 128, Kernel.DQMMA, split_k=4, num_stages=4, num_warps=4),
                    GemmConfig(128, 256, 128, Kernel.DQMMA, split_k=2, num_stages=2, num_warps=8),
                    *(GemmConfig(bn, bm, 128, Kernel.DQMMA, split_k=sp, num_stages=st,
                                 num_warps=4, fuse_quant=False, specialized=True)
                      for bn, bm, st, sp in ((128, 32, 8, 1), (128, 64, 6, 3), (64, 64, 8, 2),
                                             (128, 128, 4, 2), (128, 256, 2, 1))),
                ):
                    for b in (None, bias):
                        out = torch.full((m, n), float("nan"), device="cuda",
                                         dtype=torch.bfloat16)
                        try:
                            triton_linear(x, w, b, out=out, config=cfg)
                            torch.cuda.synchronize()
                        except Exception:
                            traceback.print_exc()
                            print(f"FAIL launch n={n} k={k} {lay} m={m} {label(cfg)}")
                            return False
                        ref_out = out.float() - (b.float() if b is not None else 0)
                        e = rel_err(ref_out, x, q, code)
                        bad = int(out.isnan().sum())
                        if e > 1e-2 or bad:
                            ok = False
                            print(f"FAIL n={n} k={k} {lay} m={m} {label(cfg)} "
                                  f"bias={b is not None} err={e:.2e} unwritten={bad}")
    print("check", "ok" if ok else "FAILED", flush=True)
    return ok


PDL_VARIANTS = ("off", "chain")


def pdl_variant(cfg: GemmConfig, variant: str) -> GemmConfig:
    """The rule's dqmma config without PDL (``off``), or as a chain of programmatic dependent
    launches (``chain``: quantization, kernel with the weight's first tiles before its wait,
    reduction, each releasing the next at its start)."""
    on = variant != "off"
    return dataclasses.replace(cfg, pdl=on, prefetch=on, red_release=on and cfg.split_k > 1)


def mx_copies(x, w):
    """Rotating copies of the MXFP8 weight ``w`` and of ``x`` (operands from HBM), kept to
    time several configs on them: ``(weights, activations, count)``."""
    (m, k), n = x.shape, w.shape[0]
    cm = n_copies(n * k + n * k // 32 + m * k * 2, m * n * 2)
    ws = [MXFP8Weight(w.data.clone(), w.scale.clone(), w.layout) for _ in range(cm)]
    return ws, [x.clone() for _ in range(cm)], cm


def pdl_sweep(ms: list[int], shapes, out: Path, t0: float, budget: float) -> None:
    """Every row where the rule takes dqmma (trtllm): the rule's config in each of
    :data:`PDL_VARIANTS`, timed side by side with bf16, each checked against the float64
    reference (written to ``sweep_pdl.json``)."""
    from mxfp8_convert.runtime.hopper.probe import device_facts
    from mxfp8_convert.runtime.hopper.rules import choose_config

    facts = device_facts(torch.device("cuda"))
    rows = []
    for name, n, k in shapes:
        if time.time() - t0 > budget:
            print("budget spent", flush=True)
            break
        todo = [m for m in ms if choose_config(m, n, k, facts).kind is Kernel.DQMMA]
        if not todo:
            continue
        w, q, code = random_weight(n, k, "trtllm")
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in todo:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf = time_bf16(x, wbf)
            ws, xs, cm = mx_copies(x, w)
            rule = choose_config(m, n, k, facts)
            row = {"shape": name, "m": m, "n": n, "k": k, "bf16_ms": t_bf,
                   "config": rule.to_dict(), "variants": {}}
            for v in PDL_VARIANTS:
                cfg = pdl_variant(rule, v)
                t = time_graph(lambda i, c=cfg, xs=xs, ws=ws: (
                    lambda: triton_linear(xs[i], ws[i], config=c)), cm)
                o = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                triton_linear(x, w, out=o, config=cfg)
                row["variants"][v] = {"ms": t, "ratio": t_bf / t, "rel_err": rel_err(o, x, q, code),
                                      "unwritten": int(o.isnan().sum())}
            del ws, xs
            rows.append(row)
            progs = cdiv(n, rule.block_n) * cdiv(m, rule.block_m) * rule.split_k
            cols = [f"{v} {r['ms'] * 1e3:6.1f} x{r['ratio']:.2f}"
                    + (" BAD" if r["rel_err"] > 1e-2 or r["unwritten"] else "")
                    for v, r in row["variants"].items()]
            print(f"{name:32s} M={m:4d} progs {progs:4d} bf16 {t_bf * 1e3:6.1f} us  "
                  + "  ".join(cols), flush=True)
        del w, wbf
        torch.cuda.empty_cache()
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep_pdl.json").write_text(json.dumps(rows, indent=1))
    for m in ms:
        for v in PDL_VARIANTS:
            r = [row["variants"][v]["ratio"] for row in rows if row["m"] == m]
            if r:
                print(f"M={m:4d} {v:10s} min {min(r):.2f} median {median(r):.2f} "
                      f"max {max(r):.2f} ({len(r)} rows)")


def tokens_configs(m: int, n: int, k: int, facts) -> list[GemmConfig]:
    """The one-chain dqmma kernel's programs of 128 tokens (64 or 128 weight rows: one or two
    warpgroups), rings of 2 (two programs an SM by shared memory), 3 or 4 (one), K split to about
    one or two waves, with the rule's launch options (:func:`rules.dqmma_launch`)."""
    from mxfp8_convert.runtime.hopper.rules import dqmma_config, dqmma_launch

    out, seen = [], set()
    for bn in (64, 128):
        for st in (2, 3, 4):
            for waves in (1.0, 2.0):
                c = dqmma_launch(dqmma_config(m, n, k, facts, block_n=bn, block_m=128, stages=st,
                                              waves=waves), n, k, facts)
                key = tuple(sorted(c.to_dict().items()))
                if key not in seen:
                    seen.add(key)
                    out.append(c)
    return out


def _stage_bytes(bm: int) -> int:
    """Shared memory of one ring stage of a 64-row program of ``bm`` tokens: the ``[64, 128]``
    weight box and two ``[bm, 64]`` bf16 activation boxes."""
    return 64 * 128 + 2 * bm * 64 * 2


def occupancy_configs(m: int, n: int, k: int, facts, specialized: bool = False
                      ) -> list[GemmConfig]:
    """The one-chain dqmma kernel's 64-row programs (64 tokens, and 128 from M = 65) in rings of
    2 and 3, K split so that about 1, 2, 3 or 4 programs share each SM, as many as the ring's
    shared memory lets share one, with the rule's launch options: what more warpgroups an SM
    buy at serving batches, where the kernel waits on latency (issue 26). ``specialized``: and
    the same programs of the warp-specialized kernel (a producer warp, one consumer)."""
    from mxfp8_convert.runtime.hopper.config import no_empty_splits
    from mxfp8_convert.runtime.hopper.rules import dqmma_config, dqmma_launch

    out, seen = [], set()
    k_tiles = k // 128
    for bm, st, spec in itertools.product((64, 128) if m > 64 else (64,), (2, 3),
                                          (False, True) if specialized else (False,)):
        tiles = cdiv(n, 64) * cdiv(m, bm)
        fit = min(4, SMEM // (st * _stage_bytes(bm)))
        for per_sm in range(1, fit + 1):
            split = max(1, min(round(per_sm * facts.sms / tiles), k_tiles // 2))
            base = dqmma_config(m, n, k, facts, block_n=64, block_m=bm, stages=st,
                                specialized=spec)
            c = dqmma_launch(dataclasses.replace(
                base, split_k=no_empty_splits(k_tiles, split)), n, k, facts)
            key = tuple(sorted(c.to_dict().items()))
            if key not in seen:
                seen.add(key)
                out.append(c)
    return out


def ws_wave_configs(m: int, n: int, k: int, facts) -> list[GemmConfig]:
    """M = 129..512: the warp-specialized kernel's 128-row programs of 256 tokens (ring of 2)
    unsplit and with ``dqmma_config``'s split (K to one wave of them where they are fewer than
    half the SMs), its 128-row programs of 128 tokens (ring of 4) split likewise, and the
    one-chain kernel's default (64-row programs, one an SM), with the rule's launch options:
    which programs fill the SMs best where the activations are re-read per row tile."""
    from mxfp8_convert.runtime.hopper.rules import dqmma_config, dqmma_launch

    wide = dqmma_config(m, n, k, facts, block_n=128, block_m=256, stages=2, specialized=True)
    out = [dataclasses.replace(wide, split_k=1), wide,
           dqmma_config(m, n, k, facts, block_n=128, block_m=128, stages=4, specialized=True),
           dqmma_config(m, n, k, facts)]
    return distinct([dqmma_launch(c, n, k, facts) for c in out])


def tokens_sweep(ms: list[int], shapes, out: Path, t0: float, budget: float,
                 configs=tokens_configs, save: str = "sweep_tokens.json") -> None:
    """M = 65..512 (trtllm): bf16, the rule's config (and without its PDL chain; up to M = 128
    the 64-token programs of ``dqmma_config``'s default) and :func:`tokens_configs` side by
    side, each checked against the float64 reference (``sweep_tokens.json``)."""
    from mxfp8_convert.runtime.hopper.probe import device_facts
    from mxfp8_convert.runtime.hopper.rules import choose_config, dqmma_config, dqmma_launch

    facts = device_facts(torch.device("cuda"))
    rows = []
    for name, n, k in shapes:
        if time.time() - t0 > budget:
            print("budget spent", flush=True)
            break
        w, q, code = random_weight(n, k, "trtllm")
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf = time_bf16(x, wbf)
            ws, xs, cm = mx_copies(x, w)
            rule = choose_config(m, n, k, facts)
            runs = [("rule", rule)] + [(label(c), c) for c in configs(m, n, k, facts)]
            if rule.pdl:  # and the rule's config without the PDL chain
                runs.append(("rule-nopdl", pdl_variant(rule, "off")))
            if m <= 128:  # and 64-token programs (dqmma_config's default tile)
                runs.append(("dq64tok", dqmma_launch(dqmma_config(m, n, k, facts), n, k, facts)))
            row = {"shape": name, "m": m, "n": n, "k": k, "bf16_ms": t_bf, "variants": {}}
            for key, cfg in runs:
                t = time_graph(lambda i, c=cfg, xs=xs, ws=ws: (
                    lambda: triton_linear(xs[i], ws[i], config=c)), cm)
                o = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                triton_linear(x, w, out=o, config=cfg)
                row["variants"][key] = {"ms": t, "ratio": t_bf / t, "config": cfg.to_dict(),
                                        "rel_err": rel_err(o, x, q, code),
                                        "unwritten": int(o.isnan().sum())}
            del ws, xs
            rows.append(row)
            cols = [f"{v} {r['ms'] * 1e3:5.1f} x{r['ratio']:.2f}"
                    + (" BAD" if r["rel_err"] > 1e-2 or r["unwritten"] else "")
                    for v, r in row["variants"].items()]
            print(f"{name:32s} M={m:3d} bf16 {t_bf * 1e3:5.1f} us  " + "  ".join(cols),
                  flush=True)
        del w, wbf
        torch.cuda.empty_cache()
        out.mkdir(parents=True, exist_ok=True)
        (out / save).write_text(json.dumps(rows, indent=1))
    for m in ms:
        sub = [r for r in rows if r["m"] == m]
        if not sub:
            continue
        best = [max(v["ratio"] for k_, v in r["variants"].items() if k_ != "rule") for r in sub]
        rule = [r["variants"]["rule"]["ratio"] for r in sub]
        both = [max(a, b) for a, b in zip(best, rule, strict=True)]
        print(f"M={m:3d} rule min {min(rule):.2f} median {median(rule):.2f}; candidates' best min "
              f"{min(best):.2f} median {median(best):.2f}; per-row best min {min(both):.2f} "
              f"median {median(both):.2f} ({len(sub)} rows)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="32,64,128,256,512,2048")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--budget", type=float, default=400.0)
    ap.add_argument("--pdl", action="store_true",
                    help="only the rule's dqmma rows, without PDL and as two PDL chains")
    ap.add_argument("--launch", action="store_true",
                    help="dqmma candidates with the rule's launch options (PDL by weight size)")
    ap.add_argument("--narrow", action="store_true",
                    help="only the rule, the one-chain rule and the specialized tiles")
    ap.add_argument("--tokens", action="store_true",
                    help="the rule against the one-chain kernel's 128-token programs")
    ap.add_argument("--occupancy", action="store_true",
                    help="the rule against 64-row programs at 1..4 an SM (rings of 2, 3)")
    ap.add_argument("--ws-wave", action="store_true",
                    help="the rule against the specialized kernel's 128-row programs, unsplit "
                         "and split to one wave, and the one-chain default")
    ap.add_argument("--specialized", action="store_true",
                    help="with --occupancy: the warp-specialized kernel's programs too")
    a = ap.parse_args()
    t0 = time.time()
    if a.check and not check():
        return 1
    print(f"[{time.time() - t0:.0f} s] sweep", flush=True)
    ms = [int(v) for v in a.ms.split(",")]
    pats = a.shapes.split(",") if a.shapes else []
    shapes = [s for s in MODEL_SHAPES if not pats or any(p in s[0] for p in pats)]
    if a.pdl:
        pdl_sweep(ms, shapes, Path(a.out), t0, a.budget)
        return 0
    if a.tokens:
        tokens_sweep(ms, shapes, Path(a.out), t0, a.budget)
        return 0
    if a.ws_wave:
        tokens_sweep(ms, shapes, Path(a.out), t0, a.budget, ws_wave_configs, "sweep_ws_wave.json")
        return 0
    if a.occupancy:
        tokens_sweep(ms, shapes, Path(a.out), t0, a.budget,
                     functools.partial(occupancy_configs, specialized=a.specialized),
                     "sweep_occupancy.json")
        return 0
    rows = []
    from mxfp8_convert.runtime.hopper.probe import device_facts

    facts = device_facts(torch.device("cuda"))
    for name, n, k in shapes:
        if time.time() - t0 > a.budget:
            print("budget spent", flush=True)
            break
        w, q, code = random_weight(n, k, "trtllm")
        wbf = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        xmax = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = xmax[:m].contiguous()
            t_bf = time_bf16(x, wbf)
            ws, xs, cm = mx_copies(x, w)
            res = []
            cands = (candidates if a.narrow else all_candidates)(m, n, k, facts)
            if a.launch:
                from mxfp8_convert.runtime.hopper.rules import dqmma_launch

                cands = [dqmma_launch(c, n, k, facts) if c.kind is Kernel.DQMMA else c
                         for c in cands]
            for cfg in cands:
                try:
                    t = time_graph(lambda i, c=cfg, xs=xs, ws=ws: (
                        lambda: triton_linear(xs[i], ws[i], config=c)), cm)
                except Exception as e:  # noqa: BLE001
                    print(f"  {label(cfg)}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                res.append((t, cfg))
            del ws, xs
            if not res:
                continue
            res.sort(key=lambda r: r[0])
            t, cfg = res[0]
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            triton_linear(x, w, out=out, config=cfg)
            err = rel_err(out, x, q, code)
            rows.append({"shape": name, "m": m, "n": n, "k": k, "bf16_ms": t_bf, "ms": t,
                         "ratio": t_bf / t, "rel_err": err, "unwritten": int(out.isnan().sum()),
                         "config": cfg.to_dict(),
                         "all": [{"ms": tt, "ratio": t_bf / tt, "config": c.to_dict()}
                                 for tt, c in res]})
            top = ", ".join(f"{label(c)} x{t_bf / tt:.2f}" for tt, c in res[:4])
            print(f"{name:32s} M={m:5d} bf16 {t_bf * 1e3:7.1f} us  best {t * 1e3:7.1f} us "
                  f"x{t_bf / t:.2f} err {err:.1e}  [{top}]", flush=True)
        del w, wbf
        torch.cuda.empty_cache()
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "sweep_dqmma.json").write_text(json.dumps(rows, indent=1))
    for m in ms:
        v = [r["ratio"] for r in rows if r["m"] == m]
        if v:
            print(f"M={m:5d} best-config ratio min {min(v):.2f} median {median(v):.2f} "
                  f"max {max(v):.2f} ({len(v)} shapes)")
    print(f"[{time.time() - t0:.0f} s] done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
