"""The Gluon wgmma decode kernel compiles for sm_90a without a GPU, with its MMAs in flight.

Gluon has no CPU interpreter, so its numerics are proven by the ``gpu`` tests on an H200
(tests/runtime/test_triton_gpu.py::test_wgmma_configs_agree). Here, on any machine, Triton
compiles the kernel for Hopper as it would at launch and we read the SASS: four FP8 wgmma per
K-tile issued before the first wait (``DEPBAR.LE gsb0, 0x3``), TMA loads, no local-memory spills,
and, with the activations quantized in the kernel, the proxy fence between the threads' stores of
the e4m3 tile and the wgmma that reads it.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

gluon_mxfp8 = pytest.importorskip("mxfp8_convert.runtime.gluon_mxfp8")


def _sass(bm: int, layout: str, serial: bool, fuse: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    n, k = 4096, 4096
    bk = gluon_mxfp8.BLOCK_K
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    wd = TensorDescriptor(w, [n, k], [k, 1], [64, bk], gl.NVMMASharedLayout.get_default_for([64, bk], gl.float8e4nv))
    x_smem = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float8e4nv)
    sig = {"w_desc": mangle_type(wd), "x_desc": "constexpr", "x_ptr": "*bf16", "s_ptr": "*i32", "xc_ptr": "*i32",
           "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32",
           "K": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_os": "i32", "scale_cp4": "i32",
           "split_k": "i32"}
    const = {"x_desc": None}
    if not fuse:  # e4m3 activations by TMA
        xq = torch.empty(16, k, dtype=torch.float8_e4m3fn)
        sig.update(x_desc=mangle_type(TensorDescriptor(xq, [16, k], [k, 1], [bm, bk], x_smem)), x_ptr="*fp8e4nv")
        const = {}
    const.update({"LAYOUT": gluon_mxfp8.LAYOUT_CODE[layout], "HAS_BIAS": True, "PARTIAL": True, "SERIAL": serial,
                  "FUSE_QUANT": fuse, "BM": bm, "X_SMEM": x_smem, "STAGES": 2, "SW_AHEAD": 3, "num_warps": 4})
    sig.update(dict.fromkeys(const, "constexpr"))
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("x_ptr", "s_ptr", "xc_ptr", "out_ptr", "ws_ptr", "K", "stride_xm")}
    src = GluonASTSource(fn=gluon_mxfp8._wgmma_decode_kernel, signature=sig, constexprs=const, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.metadata.shared <= 64 * 1024
    cubin = kernel.asm["cubin"]
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mxfp8_gluon_{os.getpid()}_{bm}_{layout}_{serial}_{fuse}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    try:
        return subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-quant", "e4m3-by-tma"])
@pytest.mark.parametrize("bm", [8, 16])
@pytest.mark.parametrize("layout,serial", [("trtllm", True), ("cutlass", False)])
def test_wgmma_kernel_compiles_for_sm90_with_mmas_in_flight(bm, layout, serial, fuse):
    sass = _sass(bm, layout, serial, fuse)
    assert len(re.findall(rf"QGMMA\.64x{bm}x32\.F32\.E4M3\.E4M3", sass)) == 4  # one per 32-block of the tile
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", sass)
    assert waits == ["3", "2", "1", "0"]  # each part waited for while the later ones still run
    # by TMA: weights and (not fused) activations, in the prologue and the loop
    assert len(re.findall(r"UTMALDG", sass)) == 2 * (1 if fuse else 2)
    # fused: the e4m3 tile written by the threads is made visible to the async proxy (wgmma)
    assert ("FENCE.VIEW.ASYNC.S" in sass) == fuse
    assert not re.search(r"\b(STL|LDL)\b", sass)  # no register spills


def test_launcher_refuses_what_the_kernel_cannot_read():
    """``wgmma_decode`` checks its arguments before anything is launched (so this runs on CPU):
    each refusal names the problem."""
    from mxfp8_convert.errors import LayoutError
    from mxfp8_convert.runtime.weight import MXFP8Weight

    n, k = 128, 256
    q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    w = MXFP8Weight.from_canonical(q, torch.full((n, k // 32), 127, dtype=torch.uint8), "trtllm", "proj")
    out = torch.empty(4, n, dtype=torch.bfloat16)

    def launch(x, **kw):
        gluon_mxfp8.wgmma_decode(x, w, None, out, None, None, split_k=1, **kw)

    with pytest.raises(LayoutError, match="dtype torch.int8"):
        launch(torch.zeros(4, k, dtype=torch.int8))
    with pytest.raises(LayoutError, match="need their codes"):
        launch(torch.zeros(4, k, dtype=torch.float8_e4m3fn))
    with pytest.raises(LayoutError, match="proj: .*M <= 16"):
        launch(torch.zeros(17, k, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="proj: .*M <= 16"):
        launch(torch.zeros(k, 4, dtype=torch.bfloat16).t())  # K not contiguous
    with pytest.raises(ValueError, match="sw_ahead=4"):
        launch(torch.zeros(4, k, dtype=torch.bfloat16), sw_ahead=4)
