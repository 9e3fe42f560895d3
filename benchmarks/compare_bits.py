"""The Hopper package's outputs, bit for bit, against those of an older tree (one GPU run).

    python benchmarks/compare_bits.py OLD_ROOT [--out DIR] [--quick]

OLD_ROOT holds the old ``mxfp8_convert`` package (``OLD_ROOT/mxfp8_convert``; the single-module
``runtime/triton_mxfp8.py`` of commit a5719ef). Each tree runs in a process of its own (both
are named ``mxfp8_convert``): the old one first, which also writes the cases, then this one. A
case is a model shape (``runtime/hopper/shapes.py``), a layout, M and a config: the rule's
(``config=None``, and the config it chose must be the new rule's too) or one of each kernel
kind built by the old builders (tile, decode, GEMV with fused or pre-permuted activations,
cuBLAS, wgmma through global memory, wgmma with activations quantized before). The same seeds
give both trees the same operands; outputs are compared by SHA-256 of their bytes (NaN-poisoned
first). Writes ``compare_bits.json`` (cases, mismatches) into --out (default ``$OUT``, else
``.``); exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULE_MS = (1, 2, 3, 4, 5, 8, 9, 16, 256, 2048)
QUICK_MS = (1, 4, 16, 2048)
LAYOUTS = ("trtllm", "cutlass")
OLD_KINDS = ("decode", "gemv", "cublas", "wgmma")  # a5719ef's exclusive booleans; none: tile


def _shapes() -> list[tuple[str, int, int]]:
    if os.environ.get("COMPARE_BITS_TINY"):  # a check of this script on CPU, under the interpreter
        return [("tiny", 160, 512)]
    ns: dict = {}
    exec((ROOT / "mxfp8_convert/runtime/hopper/shapes.py").read_text(), ns)  # plain data
    return ns["MODEL_SHAPES"]


def _old_cases(tri, m: int, n: int, k: int, dev) -> dict:
    """Config name -> old config, built by the old module's own builders (None: the rule)."""
    cases = {"rule": None}
    if m in (4, 16):
        cases["tile"] = tri.choose_config(m, n, k, dev, decode=False, cublas=False)
        cases["decode"] = tri.decode_config(m, n, k, dev)
        cases["cublas"] = tri.cublas_config(m, n, k, dev)
        glob = tri.wgmma_rule(m, n, k, dev, cluster=False)
        if glob is not None:
            cases["wgmma-global"] = glob
            cases["wgmma-quantized-before"] = tri.wgmma_config(m, n, k, dev, sw_ahead=2)
    if m in (1, 2, 4):
        cases["gemv-fused"] = tri.gemv_config(m, n, k, dev)
        cases["gemv-permuted"] = tri.gemv_config(m, n, k, dev, fuse_quant=False)
    return cases


def _device():
    import torch

    return torch.device("cpu" if os.environ.get("COMPARE_BITS_TINY") else "cuda")


def _operands(n: int, k: int, m: int, layout: str, seed: int, weight_cls, bias: bool):
    import torch

    dev = _device()
    g = torch.Generator(device=dev).manual_seed(seed)
    q = (torch.randn(n, k, device=dev, generator=g) * 96).clamp(-448, 448).to(torch.float8_e4m3fn)
    code = torch.randint(116, 126, (n, k // 32), device=dev, generator=g).to(torch.uint8)
    x = torch.randn(m, k, device=dev, generator=g, dtype=torch.float32)
    x = (x * torch.logspace(-3, 3, k, device=dev)).bfloat16()
    b = torch.randn(n, device=dev, generator=g).bfloat16() if bias else None
    return weight_cls.from_canonical(q, code, layout), x, b


def _digest(out) -> tuple[str, int]:
    import torch

    nan = int(out.isnan().sum())
    data = out.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest(), nan


def run_old(ms, dump: Path) -> None:
    """This process imports the old tree (PYTHONPATH=OLD_ROOT): cases, configs and digests."""
    import mxfp8_convert.runtime.triton_mxfp8 as tri
    import torch

    from mxfp8_convert.runtime import MXFP8Weight

    dev = _device()
    pdl_env = os.environ.get("MXFP8_PDL")
    rows = []
    for si, (shape, n, k) in enumerate(_shapes()):
        for layout in LAYOUTS:
            for m in ms:
                for name, cfg in _old_cases(tri, m, n, k, dev).items():
                    bias = name != "rule"
                    seed = si * 1000 + m * 2 + (layout == "cutlass")
                    w, x, b = _operands(n, k, m, layout, seed, MXFP8Weight, bias)
                    out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                    tri.triton_linear(x, w, b, out=out, config=cfg)
                    used = cfg or tri.default_config(m, n, k, dev, pdl_env)
                    digest, nan = _digest(out)
                    rows.append({"shape": shape, "n": n, "k": k, "m": m, "layout": layout,
                                 "case": name, "bias": bias, "seed": seed,
                                 "config": used.to_dict(), "sha256": digest, "nan": nan})
        print(f"old: {shape} done", flush=True)
    dump.write_text(json.dumps(rows))


def _new_config(old: dict):
    """An a5719ef config dict as this package's GemmConfig (one kind instead of five booleans)."""
    from mxfp8_convert.runtime.hopper.config import GemmConfig, Kernel

    d = dict(old)
    kinds = [kind for kind in OLD_KINDS if d.pop(kind)]
    if d.pop("w_in_regs") is not True or len(kinds) > 1:
        raise SystemExit(f"config without a counterpart here: {old}")
    return GemmConfig(**d, kind=Kernel(kinds[0] if kinds else "tile"))


def run_new(dump: Path, result: Path) -> int:
    """This process imports this tree: the same cases, compared with the old digests."""
    import torch

    from mxfp8_convert.runtime import MXFP8Weight
    from mxfp8_convert.runtime.hopper import default_config, triton_linear

    dev = _device()
    pdl_env = os.environ.get("MXFP8_PDL")
    old_rows = json.loads(dump.read_text())
    bad, kinds = [], {}
    for r in old_rows:
        want = _new_config(r["config"])
        m, n, k = r["m"], r["n"], r["k"]
        if r["case"] == "rule":  # trtllm/cutlass weights: the Gluon kernel reads them as they lie
            cfg, got_cfg = None, default_config(m, n, k, dev, pdl_env)
        else:
            cfg = got_cfg = want
        w, x, b = _operands(n, k, m, r["layout"], r["seed"], MXFP8Weight, r["bias"])
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        triton_linear(x, w, b, out=out, config=cfg)
        digest, nan = _digest(out)
        kinds[want.kind.value] = kinds.get(want.kind.value, 0) + 1
        problems = []
        if got_cfg != want:
            problems.append(f"config {got_cfg.to_dict()} != old {r['config']}")
        if digest != r["sha256"]:
            problems.append("output bits differ")
        if nan or r["nan"]:
            problems.append(f"unwritten elements: new {nan}, old {r['nan']}")
        if problems:
            where = {key: r[key] for key in ("shape", "m", "layout", "case")}
            bad.append({**where, "problems": problems})
            print(f"MISMATCH {r['shape']} M={m} {r['layout']} {r['case']}: {problems}", flush=True)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "none (interpreter)"
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": gpu,
               "cases": len(old_rows), "by_kind": kinds, "mismatches": bad,
               "mxfp8_pdl": pdl_env}
    result.write_text(json.dumps(summary, indent=1))
    print(f"{len(old_rows)} cases ({kinds}), {len(bad)} mismatches", flush=True)
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old_root", type=Path)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--quick", action="store_true", help=f"M in {QUICK_MS} only")
    p.add_argument("--side", choices=["old", "new"], help=argparse.SUPPRESS)
    p.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    ms = QUICK_MS if args.quick else RULE_MS
    if args.side == "old":
        return run_old(ms, args.dump)
    if args.side == "new":
        raise SystemExit(run_new(args.dump, args.out / "compare_bits.json"))
    old_root = args.old_root.resolve()
    if not (old_root / "mxfp8_convert/runtime/triton_mxfp8.py").is_file():
        raise SystemExit(f"{old_root}: no mxfp8_convert/runtime/triton_mxfp8.py (the old tree)")
    args.out.mkdir(parents=True, exist_ok=True)
    dump = args.out / "compare_bits_old.json"
    me = [sys.executable, str(Path(__file__).resolve()), str(old_root), "--out", str(args.out),
          "--dump", str(dump)] + (["--quick"] if args.quick else [])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if not dump.is_file():  # gpu_check.sh may have run the old side already, beside the tests
        subprocess.run([*me, "--side", "old"], env={**env, "PYTHONPATH": str(old_root)},
                       cwd=old_root, check=True)
    new_env = {**env, "PYTHONPATH": str(ROOT)}
    rc = subprocess.run([*me, "--side", "new"], env=new_env, cwd=ROOT).returncode
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
