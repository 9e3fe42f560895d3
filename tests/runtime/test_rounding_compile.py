"""The activation quantization kernel and the block-128 path's regroup kernels, compiled for
sm_90a without a GPU, round to e4m3 by the GPU's conversion (``cvt.rn.satfinite.e4m3x2.f32``,
SASS ``F2FP.SATFINITE.E4M3.F32.PACK_AB``, two elements an instruction) instead of the fp32
magic-number arithmetic that Triton's interpreter needs (``jit._round_e4m3``). That both give the
same bytes is proven on the GPU against torch's float8 cast
(``test_triton_gpu.py::test_block128_path_agrees``, ``test_activation_quantization_bit_exact``);
here, that the GPU build takes the conversion and is the shorter program."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - older Triton
    pytest.skip(f"Triton {triton.__version__} has no ASTSource/GPUTarget compile API",
                allow_module_level=True)

from mxfp8_convert.runtime.hopper import quantize, regroup  # noqa: E402
from mxfp8_convert.runtime.hopper.jit import FP_FUSION, LAYOUT_CODE  # noqa: E402
from tests.runtime.sass import cuobjdump_sass, instructions  # noqa: E402

ACT = (regroup._regroup_activations_kernel,
       {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "M": "i32", "K": "i32",
        "stride_xm": "i32"},
       {"BLOCK_M": 32, "BLOCK_K": 512})
WEIGHT = (regroup._regroup_weight_kernel,
          {"w_ptr": "*fp8e4nv", "s_ptr": "*i32", "q_ptr": "*u8", "o_ptr": "*fp32", "N": "i32",
           "n0": "i32", "stride_wn": "i32", "scale_c": "i32", "scale_cp4": "i32"},
          {"BLOCK_N": 64, "BLOCK_K": 256})

QUANT = (quantize._quantize_kernel,
         {"x_ptr": "*bf16", "deq_ptr": "*bf16", "q_ptr": "*u8", "code_ptr": "*u8", "M": "i32",
          "K": "i32", "stride_xm": "i32"},
         {"WRITE_DEQ": True, "WRITE_Q": True, "BLOCK_M": 32, "BLOCK_K": 128, "PERM_DEQ": False,
          "PDL": False})


def _sass(fn, sig: dict, const: dict) -> list[str]:
    """The kernel's SASS instructions, compiled as ``launch`` launches it (4 warps)."""
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("x_ptr", "deq_ptr", "q_ptr", "code_ptr", "s_ptr", "w_ptr", "o_ptr", "K",
                       "stride_xm")
             if a in sig}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "enable_fp_fusion": FP_FUSION})
    return [t for _, t in instructions(cuobjdump_sass(kernel.asm["cubin"]))]


@pytest.mark.parametrize("kernel,layout", [(QUANT, None), (ACT, None), (WEIGHT, "trtllm"),
                                           (WEIGHT, "cutlass"), (WEIGHT, "canonical")],
                         ids=["quantize", "regroup-activations", "regroup-weight-trtllm",
                              "regroup-weight-cutlass", "regroup-weight-canonical"])
def test_kernels_round_by_the_gpus_e4m3_conversion(kernel, layout):
    fn, sig, const = kernel
    if layout is not None:
        const = {**const, "LAYOUT": LAYOUT_CODE[layout]}
    hw = _sass(fn, sig, {**const, "HW_ROUND": True})
    sw = _sass(fn, sig, {**const, "HW_ROUND": False})
    elements = const["BLOCK_K"] * const.get("BLOCK_M", const.get("BLOCK_N")) // 128  # a thread's
    packs = sum("F2FP.SATFINITE.E4M3.F32.PACK_AB" in t for t in hw)
    # one pack per two outputs of a conversion: the regrouped activations are rounded twice
    # (FlashInfer's 32-block values, then the 128-block regroup); the quantization kernel rounds
    # once and converts its rounded values to bytes again (exact); the weight is rounded once
    roundings = {regroup._regroup_activations_kernel: 2, quantize._quantize_kernel: 2}.get(fn, 1)
    assert packs == elements * roundings // 2
    assert not any("F2FP.SATFINITE.E4M3" in t for t in sw)
    assert len(hw) < len(sw) / 2, (len(hw), len(sw))
