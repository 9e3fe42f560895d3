"""Compile every Hopper kernel of this tree and of an older one for sm_90a on CPU and compare
their SASS, instruction by instruction (no GPU; nvcc's ptxas through Triton):

    git archive a5719ef | tar -x -C /tmp/a5719ef
    python tests/runtime/data/compare_sass.py /tmp/a5719ef

The old tree is the single-module ``runtime/triton_mxfp8.py`` (commit a5719ef). The Gluon kernel
goes through ``tests/runtime/test_gluon_compile.py``'s ``_sass`` in each tree; the Triton kernels
(tile, decode, GEMV, dequantization, quantization, reduction) through ``triton.compile`` with the
same signature and constexprs (the tile kernel of the old tree with ``W_IN_REGS=True``). Each
tree runs in its own process (both are named ``mxfp8_convert``). Prints the configs compared and
any that differ; exit status 1 if one does.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FAMILIES = {"tile": "_mxfp8_gemm_kernel", "decode": "_mxfp8_decode_kernel",
            "gemv": "_mxfp8_gemv_kernel", "dequant": "_dequantize_weight_kernel",
            "quantize": "_quantize_kernel", "reduce": "_splitk_reduce_kernel"}
I32 = "i32"
COMMON = dict.fromkeys(("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_os",
                        "scale_c", "scale_cp4", "split_k"), I32)


def _triton_cases() -> list:
    cases = []
    for layout in (0, 1, 2):
        s_ptr = "*i32" if layout < 2 else "*u8"
        for quant, partial, serial in ((True, True, True), (False, True, False),
                                       (True, False, False)):
            sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": s_ptr, "b_ptr": "*bf16",
                   "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32", **COMMON}
            const = dict(LAYOUT=layout, QUANT_X=quant, DOT_BF16=True, HAS_BIAS=True, BLOCK_N=64,
                         BLOCK_M=16, BLOCK_K=128, PARTIAL=partial, SERIAL=serial, GROUP_N=8)
            cases.append(("tile", sig, const, 4, 4))
        for fuse in (True, False):
            sig = {"x_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "xc_ptr": "*i32", "w_ptr": "*fp8e4nv",
                   "s_ptr": s_ptr, "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
                   "lock_ptr": "*i32", **COMMON}
            const = dict(LAYOUT=layout, FUSE_QUANT=fuse, FP8_DOT=True, HAS_BIAS=True, BLOCK_N=64,
                         BLOCK_M=16, BLOCK_K=256, PARTIAL=True, SERIAL=True,
                         SCALE_TILE=0 if layout == 2 else 2)
            cases.append(("decode", sig, const, 4, 5))
            sig = {"x_ptr": "*bf16" if fuse else "*fp32", "w_ptr": "*i32", "s_ptr": s_ptr,
                   "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
                   **COMMON}
            const = dict(LAYOUT=layout, FUSE_QUANT=fuse, HAS_BIAS=True, BLOCK_N=32, BLOCK_M=2,
                         BLOCK_K=256, PARTIAL=True, SERIAL=True, WORDS=True, X_PERM=not fuse)
            cases.append(("gemv", sig, const, 4, 1))
        sig = {"w_ptr": "*fp8e4nv", "s_ptr": s_ptr, "out_ptr": "*bf16", "N": I32, "n0": I32,
               "stride_wn": I32, "stride_on": I32, "scale_c": I32, "scale_cp4": I32}
        const = dict(LAYOUT=layout, DOT_BF16=True, BLOCK_N=64, BLOCK_K=256)
        cases.append(("dequant", sig, const, 4, 3))
    sig = {"x_ptr": "*bf16", "deq_ptr": "*bf16", "q_ptr": "*u8", "code_ptr": "*u8", "M": I32,
           "K": I32, "stride_xm": I32}
    const = dict(WRITE_DEQ=True, WRITE_Q=True, BLOCK_M=32, BLOCK_K=128, PERM_DEQ=False)
    cases.append(("quantize", sig, const, 4, 3))
    cases.append(("reduce", {"p_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "N": I32,
                             "total": I32, "stride_ps": I32, "split_k": I32},
                  dict(HAS_BIAS=True, BLOCK=1024, PDL=True, CHUNK=8, RELEASE=True, P32=True), 4, 3))
    return cases


GLUON_CASES = [
    *(dict(bm=bm, layout="trtllm", serial=serial, fuse=fuse, qm=qm, pdl=True, words=fuse)
      for bm, qm in ((8, 4), (8, 8), (16, 16)) for serial in (True, False)
      for fuse in (True, False)),
    dict(bm=16, layout="cutlass", serial=False, fuse=True, qm=16, pdl=True, words=True, cluster=8),
    dict(bm=16, layout="trtllm", serial=False, fuse=True, qm=16, pdl=True, words=True, block_n=128),
    dict(bm=16, layout="trtllm", serial=False, fuse=True, qm=16, pdl=True, words=True,
         prefetch=True, x_prefetch=True),
    dict(bm=8, layout="trtllm", serial=True, fuse=True, qm=2, pdl=False, words=False),
]


def _digest(sass: str) -> str:
    instructions = "\n".join(ln for ln in sass.splitlines() if "/*" in ln)
    return hashlib.sha256(instructions.encode()).hexdigest()


def dump(old: bool) -> dict:
    """SASS digests of every case in this process's tree."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.runtime.test_gluon_compile import _sass

    if old:
        mod = importlib.import_module("mxfp8_convert.runtime.triton_mxfp8")
        kernels = {fam: getattr(mod, name) for fam, name in FAMILIES.items()}
    else:
        pkg = "mxfp8_convert.runtime.hopper"
        kernels = {fam: getattr(importlib.import_module(f"{pkg}.{fam}"), name)
                   for fam, name in FAMILIES.items()}
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    out = {}
    for fam, sig, const, warps, stages in _triton_cases():
        fn = kernels[fam]
        if old and fam == "tile":
            const = {**const, "W_IN_REGS": True}
        types = {**sig, **dict.fromkeys(const, "constexpr")}
        order = [a for a in fn.arg_names if a in types]
        src = ASTSource(fn=fn, signature={a: types[a] for a in order},
                        constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"])
            f.flush()
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name],
                                  capture_output=True, text=True, check=True).stdout
        key = {k: v for k, v in const.items() if k != "W_IN_REGS"}
        out[f"{fam} {json.dumps(key, sort_keys=True)}"] = _digest(sass)
    for case in GLUON_CASES:
        out[f"wgmma {json.dumps(case, sort_keys=True)}"] = _digest(_sass(**case))
    return out


def main() -> None:
    if sys.argv[1] == "--dump":  # a child: --dump old|new FILE, sys.path set by the parent
        Path(sys.argv[3]).write_text(json.dumps(dump(sys.argv[2] == "old")))
        return
    old_root = Path(sys.argv[1]).resolve()
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side, root in (("old", old_root), ("new", ROOT)):
            dst = Path(tmp) / f"{side}.json"
            env = {**os.environ, "PYTHONPATH": str(root)}
            subprocess.run([sys.executable, __file__, "--dump", side, str(dst)], env=env, cwd=root,
                           check=True)
            digests[side] = json.loads(dst.read_text())
    differ = [k for k in digests["old"] if digests["old"][k] != digests["new"].get(k)]
    print(f"{len(digests['old'])} kernel configs compiled for sm_90a in both trees; "
          f"{len(differ)} differ")
    for k in differ:
        print(f"  DIFFERENT SASS: {k}")
    raise SystemExit(1 if differ or set(digests["old"]) != set(digests["new"]) else 0)


if __name__ == "__main__":
    main()
