"""MXFP8 quantize / dequantize / FP8-source conversion / error metrics (mxfp8_convert/quantize.py).

The quantizer is proved three independent ways:

* against FlashInfer's own host reference: the body of ``mxfp8_quantize_host`` and
  ``mxfp8_dequantize_host`` is cut verbatim out of the installed ``fp8Quantize.cpp`` and
  compiled with the bundled cutlass ``float_e4m3_t`` (FlashInfer's JIT build of that module needs
  a CUDA toolkit with cuBLAS, which a CPU box lacks; this needs only a C++ compiler and the CUDA
  runtime headers);
* against an independent float64/numpy formulation of docs/LAYOUTS.md section 1 (``ref_quantize``
  below: frexp for the exponents, ``np.rint`` for round-half-even, its own byte encoder);
* against hand-derived golden blocks at the edges (``448 * 2^k`` and one ulp either side, the
  fp32-subnormal ``amax / 448`` range, zeros, ``-0.0``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert._buffers import SCRATCH
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.quantize import (
    MXFP8Result,
    QuantError,
    block_fp8_to_mxfp8,
    check_finite,
    dequantize_mxfp8,
    per_tensor_fp8_to_mxfp8,
    quantization_error,
    quantize_mxfp8,
    quantize_mxfp8_with_error,
    reusing_buffers,
)
from tests.checkpoints import scratch_requests

F32_INV_448 = np.float32(1) / np.float32(448)  # the reference's ``1.f / 448.0f``
E4M3_NAN_BYTES = (0x7F, 0xFF)


# --- independent float64 formulation of docs/LAYOUTS.md section 1 ---------------------------------


def ref_codes(amax: np.ndarray) -> np.ndarray:
    """UE8M0 code = ceil(log2(fl32(amax * fl32(1/448)))) + 127, clamped to [0, 254]; 0 for 0."""
    v = (amax.astype(np.float64) * np.float64(F32_INV_448)).astype(np.float32).astype(np.float64)
    m, e = np.frexp(v)  # v = m * 2^e, m in [0.5, 1): ceil(log2 v) = e - 1 exactly when m == 0.5
    ceil_log2 = np.where(m == 0.5, e - 1, e)
    return np.where(v == 0, 0, np.clip(ceil_log2 + 127, 0, 254)).astype(np.int64)


def ref_e4m3_value(y: np.ndarray) -> np.ndarray:
    """Round-half-even, saturating float8_e4m3fn value of float64 ``y`` (sign kept on zeros)."""
    a = np.abs(y)
    _, e = np.frexp(np.where(a == 0, 1.0, a))
    ulp = np.exp2(np.maximum(e - 1, -6) - 3.0)  # 3 mantissa bits; subnormal ulp 2^-9
    r = np.minimum(np.rint(a / ulp) * ulp, 448.0)
    return np.copysign(r, y)


def ref_e4m3_byte(v: np.ndarray) -> np.ndarray:
    """Encode exact e4m3 values as bytes: sign | exponent (bias 7) | 3-bit mantissa."""
    a = np.abs(v)
    sign = np.signbit(v).astype(np.int64) << 7
    _, e = np.frexp(np.where(a == 0, 1.0, a))
    normal = a >= 2.0**-6
    exp_field = np.where(normal, e - 1 + 7, 0)
    mant = np.where(normal, a / np.exp2(e - 1.0) * 8 - 8, a / 2.0**-9)
    assert np.all(mant == np.round(mant)), "not an e4m3 value"
    return (sign | (exp_field << 3) | mant.astype(np.int64)).astype(np.uint8)


def ref_quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(q bytes [N, K], codes [N, K/32]) per the recipe, all in float64 / numpy."""
    xf = x.float().numpy().astype(np.float64)
    n, k = xf.shape
    blocks = xf.reshape(n, k // 32, 32)
    codes = ref_codes(np.abs(blocks).max(axis=-1))
    # Code 0 leaves x unscaled (the reference's ``inv_scale = 1``); else x * 2^(127 - code).
    inv = np.where(codes == 0, 1.0, np.exp2(127.0 - codes))
    q = ref_e4m3_byte(ref_e4m3_value(blocks * inv[..., None]))
    return q.reshape(n, k), codes.astype(np.uint8)


def assert_matches_ref(x: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_mxfp8(x, **kw)
    want_q, want_s = ref_quantize(x)
    np.testing.assert_array_equal(s.numpy(), want_s, err_msg="scale codes")
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want_q, err_msg="e4m3 bytes")
    return q, s


def block_of(first: float, rest: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    """One 1x32 block: ``first`` then 31 copies of ``rest``."""
    x = torch.full((1, 32), rest, dtype=torch.float64)
    x[0, 0] = first
    return x.to(dtype)


def f32_next_up(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(np.inf)))


def f32_next_down(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(0)))


def gaussian_blocks(n: int, k: int, seed: int, lo: int = -30, hi: int = 30) -> torch.Tensor:
    """Gaussian values with a random power-of-two magnitude per 1x32 block (fp32)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(lo, hi, (n, k // 32, 1), generator=g).double()
    x = torch.randn(n, k // 32, 32, generator=g, dtype=torch.float64) * torch.exp2(e)
    return x.reshape(n, k).float()


def random_e4m3(shape, seed: int) -> torch.Tensor:
    """Random e4m3 bytes without the two NaN encodings."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    b[(b == 0x7F) | (b == 0xFF)] = 0x3C
    return b.view(torch.float8_e4m3fn)


# --- golden edge cases (derived by hand) ------------------------------------------------------
# fl32(1/448) = (1/448)(1 + 4.5e-8), just above 1/448. Hence, for a block max of
#  * exactly 448*2^k: fl32(448*2^k * fl32(1/448)) = 2^k (the 4.5e-8 is below half an ulp of 1),
#    code 127+k, q = 448 = 0x7E;
#  * one fp32 ulp above (448*2^k*(1 + 2^-23/1.75)): the product is 1 + 1.13e-7 -> 1 + 2^-23, so
#    the code rounds up to 128+k and q = 224.00001 -> 224 = 1.75*2^7 = 0x76;
#  * one ulp below: the product 1 - 2.3e-8 rounds back to 1, code 127+k, q = 447.99997 -> 448
#    (rounds up to e4m3's max, never to NaN).


@pytest.mark.parametrize("k", [0, -3, 5, -100, -126, 100])
@pytest.mark.parametrize(
    ("nudge", "code_offset", "byte"),
    [(None, 127, 0x7E), (f32_next_up, 128, 0x76), (f32_next_down, 127, 0x7E)],
    ids=["exact", "ulp_above", "ulp_below"],
)
def test_block_max_at_448_times_power_of_two(k, nudge, code_offset, byte):
    amax = 448.0 * 2.0**k
    amax = nudge(amax) if nudge else amax
    x = block_of(amax, rest=2.0**k)
    q, s = assert_matches_ref(x)
    assert int(s[0, 0]) == code_offset + k
    assert int(q.view(torch.uint8)[0, 0]) == byte


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_zero_block_is_code_zero_and_zero_bytes(dtype):
    q, s = assert_matches_ref(torch.zeros(3, 64, dtype=dtype))
    assert not s.any() and not q.view(torch.uint8).any()


def test_negative_zero_keeps_its_sign_bit():
    # The reference converts -0.0 * inv_scale = -0.0 to e4m3 with its sign: byte 0x80.
    x = torch.zeros(1, 64)
    x[0, :32] = -0.0  # an all-(-0) block: amax 0 -> code 0
    x[0, 32:] = 1.0
    x[0, 40] = -0.0  # a -0 inside a normal block
    q, s = assert_matches_ref(x)
    b = q.view(torch.uint8)[0]
    assert s.tolist() == [[0, 119]]  # 1.0 / 448 -> ceil -> 2^-8 -> 119
    assert b[:32].tolist() == [0x80] * 32
    assert int(b[40]) == 0x80 and int(b[41]) == 0x78  # 1.0 * 2^8 = 256: exponent field 15 -> 0x78


def test_fp32_subnormal_scale_range():
    # amax/448 below fp32's normal range. 448*2^-127 gives exactly 2^-127 (fp32 subnormal,
    # mantissa 0x400000): code 0, and code 0 keeps x unscaled, so the block is all zero bytes
    # (FlashInfer's quirk; an exact encoding would have been q = 448 at code 0).
    q, s = assert_matches_ref(block_of(448.0 * 2.0**-127, rest=-(2.0**-130)))
    assert int(s[0, 0]) == 0
    assert q.view(torch.uint8)[0].tolist() == [0x00] + [0x80] * 31
    # 384*2^-126 / 448 = (6/7)*2^-126 is subnormal but above 2^-127: code 1, q = 384 = 0x7C.
    q, s = assert_matches_ref(block_of(384.0 * 2.0**-126))
    assert int(s[0, 0]) == 1 and int(q.view(torch.uint8)[0, 0]) == 0x7C
    # amax itself subnormal (2^-140) -> code 0, zero bytes.
    q, s = assert_matches_ref(block_of(2.0**-140))
    assert int(s[0, 0]) == 0 and not q.view(torch.uint8).any()


def test_bf16_subnormal_inputs():
    x = (torch.arange(64).reshape(1, 64) - 32).to(torch.float64) * 2.0**-133  # bf16 subnormals
    assert_matches_ref(x.to(torch.bfloat16))


def test_largest_finite_float32_uses_code_247():
    # amax = fp32 max ~ 2^128 -> 2^128/448 -> ceil -> 2^120 -> code 247 (the 254 clamp cannot
    # be reached from finite fp32); q = 255.99998 rounds to 256 = 0x78.
    fmax = float(torch.finfo(torch.float32).max)
    q, s = assert_matches_ref(block_of(fmax, rest=-fmax))
    assert int(s[0, 0]) == 247
    assert q.view(torch.uint8)[0, :2].tolist() == [0x78, 0xF8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_gaussian_blocks_match_float64_formulation(dtype):
    lo, hi = (-14, 14) if dtype == torch.float16 else (-140, 120)
    x = gaussian_blocks(64, 512, seed=1, lo=lo, hi=hi).to(dtype)
    assert_matches_ref(x)


def test_chunking_does_not_change_bytes():
    x = gaussian_blocks(37, 96, seed=2)
    q1, s1 = quantize_mxfp8(x, chunk_rows=1)
    q7, s7 = quantize_mxfp8(x, chunk_rows=7)
    qa, sa = quantize_mxfp8(x)
    assert torch.equal(q1.view(torch.uint8), qa.view(torch.uint8)) and torch.equal(s1, sa)
    assert torch.equal(q7.view(torch.uint8), qa.view(torch.uint8)) and torch.equal(s7, sa)
    with pytest.raises(LayoutError, match="chunk_rows"):
        quantize_mxfp8(x, chunk_rows=0)


def test_ue8m0_rounding_rule_at_fp32_exponent_0xfe():
    # Unreachable from finite fp32 weights (amax/448 < 2^120) but part of float_to_ue8m0:
    # exponent field 0xFE never rounds up (code 254 is the clamp), exactly 2^127 is 254 too.
    from mxfp8_convert.quantize import _ue8m0_ceil_codes

    v = torch.tensor(
        [2.0**127, 1.5 * 2.0**127, 2.0**126 * 1.01, 2.0**-127, 2.0**-149, 0.0, 1.0, 1.0000001]
    )
    assert _ue8m0_ceil_codes(v).tolist() == [254, 254, 254, 0, 0, 0, 127, 128]


def test_big_tensors_are_processed_in_bounded_chunks(monkeypatch):
    import mxfp8_convert.quantize as qmod

    quantized, summed = [], []
    real_quantize, real_error = qmod._quantize_chunk, qmod._error_sums
    real_c = qmod._c_chunk  # the C accelerator's chunks, where it is built (test_cquant.py)
    monkeypatch.setattr(qmod, "_CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(
        qmod,
        "_quantize_chunk",
        lambda xf, *a: (quantized.append(xf.numel()), real_quantize(xf, *a))[1],
    )
    monkeypatch.setattr(
        qmod, "_c_chunk", lambda x, *a: (quantized.append(x.numel()), real_c(x, *a))[1]
    )
    monkeypatch.setattr(
        qmod, "_error_sums", lambda ref, *a: (summed.append(ref.numel()), real_error(ref, *a))[1]
    )
    x = gaussian_blocks(300, 256, seed=23)
    q, s = quantize_mxfp8(x)
    quantization_error(x, q, s)
    quantize_mxfp8_with_error(x)
    block_fp8_to_mxfp8(random_e4m3((300, 256), seed=23), torch.full((3, 2), 0.3))
    chunks = -(-300 // 16)  # 4096 // 256 = 16 rows
    assert len(quantized) == 3 * chunks and max(quantized) == 16 * 256
    assert len(summed) == chunks and max(summed) == 16 * 256  # quantization_error's own


def test_non_contiguous_input():
    x = gaussian_blocks(64, 64, seed=3)
    assert_matches_ref(x.t())


def test_output_shapes_dtypes_and_empty():
    q, s = quantize_mxfp8(torch.randn(5, 96, dtype=torch.bfloat16))
    assert (q.shape, q.dtype, s.shape, s.dtype) == (
        (5, 96),
        torch.float8_e4m3fn,
        (5, 3),
        torch.uint8,
    )
    assert q.is_contiguous() and s.is_contiguous()
    q, s = quantize_mxfp8(torch.zeros(0, 64))
    assert q.shape == (0, 64) and s.shape == (0, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_names_tensor_and_position(bad):
    x = torch.ones(4, 64)
    x[2, 37] = bad
    with pytest.raises(
        LayoutError, match=r"^layers\.0\.w: non-finite value .* at row 2, column 37"
    ):
        quantize_mxfp8(x, name="layers.0.w", chunk_rows=3)


def test_rejects_bad_shapes_and_dtypes():
    with pytest.raises(LayoutError, match="w: K = 48 is not a multiple of 32"):
        quantize_mxfp8(torch.ones(2, 48), name="w")
    with pytest.raises(LayoutError, match="2-D"):
        quantize_mxfp8(torch.ones(64), name="w")
    with pytest.raises(LayoutError, match="float64"):
        quantize_mxfp8(torch.ones(2, 64, dtype=torch.float64), name="w")


# --- FlashInfer's own references --------------------------------------------------------------

_HARNESS_MAIN = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <vector>
#include "cutlass/float8.h"
%(verbatim)s
static void quant_block(const float* fp32_ptr, uint8_t* fp8_ptr, uint8_t* sf) {
  const int sf_vec_size = 32;
  %(quant_head)s
  *sf = scale_ue8m0;
  %(quant_loop)s
}
static void dequant_block(const uint8_t* fp8_ptr, uint8_t fp8_scale, float* float_ptr) {
  const int sf_vec_size = 32;
  %(dequant)s
}
static std::vector<uint8_t> slurp(const char* path, size_t n) {
  std::vector<uint8_t> b(n); FILE* f = fopen(path, "rb");
  fread(b.data(), 1, n, f); fclose(f); return b;
}
static void spill(const char* path, const void* p, size_t n) {
  FILE* f = fopen(path, "wb"); fwrite(p, 1, n, f); fclose(f);
}
int main(int argc, char** argv) {  // q NBLOCKS IN.f32 OUT.q OUT.s | d NBLOCKS IN.q IN.s OUT.f32
  long nb = atol(argv[2]);
  if (argv[1][0] == 'q') {
    auto x = slurp(argv[3], nb * 128);
    std::vector<uint8_t> q(nb * 32), s(nb);
    for (long i = 0; i < nb; ++i)
      quant_block(reinterpret_cast<float*>(x.data()) + i * 32, &q[i * 32], &s[i]);
    spill(argv[4], q.data(), q.size()); spill(argv[5], s.data(), s.size());
  } else {
    auto q = slurp(argv[3], nb * 32); auto s = slurp(argv[4], nb);
    std::vector<float> y(nb * 32);
    for (long i = 0; i < nb; ++i) dequant_block(&q[i * 32], s[i], &y[i * 32]);
    spill(argv[5], y.data(), y.size() * 4);
  }
  return 0;
}
"""


def _balanced_from(src: str, start: int) -> str:
    """Text from ``start`` through the ``}`` closing the first ``{`` after it."""
    depth, i = 0, src.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            return src[start : i + 1]
        i += 1


def _cut_host_reference(src: str) -> dict[str, str]:
    """Cut FlashInfer's host quantize/dequantize bodies out of fp8Quantize.cpp, verbatim."""
    ue = src.index("inline uint8_t float_to_ue8m0")
    head = src.index("float local_amax = 0.0f;")
    store = src.index("scale_ue8m08sf_ptr[computeSFIndex", head)
    loop = src.index("for (int ki = 0;", store)
    deq = src.index("float scale_float;")
    return {
        "verbatim": _balanced_from(src, ue),
        "quant_head": src[head:store],
        "quant_loop": _balanced_from(src, loop),
        "dequant": src[deq : src.index("for (int ki = 0;", deq)]
        + _balanced_from(src, src.index("for (int ki = 0;", deq)),
    }


def _cuda_header_dirs(data: Path) -> list[str] | None:
    """Include dirs that provide cuda_runtime_api.h / cuda_fp8.h (+ nv/target) for cutlass."""
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    for root in candidates:
        inc = Path(root, "include")
        if root and (inc / "cuda_runtime_api.h").exists() and (inc / "nv" / "target").exists():
            return [str(inc)]
    triton = importlib.util.find_spec("triton")
    if triton and triton.origin:
        inc = Path(triton.origin).parent / "backends" / "nvidia" / "include"
        if (inc / "cuda_runtime_api.h").exists():
            return [str(inc), str(data / "cccl" / "libcudacxx" / "include")]
    return None


@pytest.fixture(scope="module")
def fi_host(tmp_path_factory):
    """FlashInfer's host quantize/dequantize as callables, compiled from the installed source."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        pytest.skip("FlashInfer is not installed")
    data = Path(spec.origin).parent / "data"
    cpp = data / "csrc" / "nv_internal" / "tensorrt_llm" / "thop" / "fp8Quantize.cpp"
    from mxfp8_convert.backends import FLASHINFER_LAYOUT_VERSION

    pinned = importlib.metadata.version("flashinfer-python") == FLASHINFER_LAYOUT_VERSION
    try:
        parts = _cut_host_reference(cpp.read_text())
    except (OSError, ValueError) as exc:
        (pytest.fail if pinned else pytest.skip)(
            f"cannot cut the host reference out of {cpp}: {exc}"
        )
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    headers = _cuda_header_dirs(data)
    if cxx is None or headers is None:
        pytest.skip(
            "needs a C++ compiler and CUDA runtime headers to build FlashInfer's host reference"
        )
    work = tmp_path_factory.mktemp("fi_host")
    (work / "harness.cpp").write_text(_HARNESS_MAIN % parts)
    inc = [f"-I{data / 'cutlass' / 'include'}", *(f"-I{h}" for h in headers)]
    build = subprocess.run(
        [cxx, "-O2", "-std=c++17", *inc, str(work / "harness.cpp"), "-o", str(work / "harness")],
        capture_output=True,
        text=True,
    )
    if build.returncode:
        pytest.skip(f"host reference did not compile: {build.stderr[-500:]}")

    def run(mode: str, blocks: int, *files: str) -> None:
        subprocess.run(
            [str(work / "harness"), mode, str(blocks), *(str(work / f) for f in files)], check=True
        )

    def quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = x.shape
        x.float().contiguous().numpy().tofile(work / "x.f32")
        run("q", n * k // 32, "x.f32", "q", "s")
        q = torch.from_numpy(np.fromfile(work / "q", dtype=np.uint8).reshape(n, k))
        return q, torch.from_numpy(np.fromfile(work / "s", dtype=np.uint8).reshape(n, k // 32))

    def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        q.view(torch.uint8).contiguous().numpy().tofile(work / "q")
        s.contiguous().numpy().tofile(work / "s")
        run("d", n * k // 32, "q", "s", "y")
        return torch.from_numpy(np.fromfile(work / "y", dtype=np.float32).reshape(n, k))

    return quant, dequant


def edge_case_rows() -> torch.Tensor:
    """One 1x32 block per row covering every edge above, plus random magnitudes."""
    rows = []
    for k in (-127, -126, -120, -3, 0, 5, 100, 119):
        for amax in (448.0 * 2.0**k, f32_next_up(448.0 * 2.0**k), f32_next_down(448.0 * 2.0**k)):
            rows.append(block_of(amax, rest=-amax / 3))
    fmax = float(torch.finfo(torch.float32).max)
    for first, rest in [
        (0.0, 0.0),
        (-0.0, -0.0),
        (384.0 * 2.0**-126, 1e-40),
        (2.0**-140, -(2.0**-149)),
        (fmax, -fmax),
    ]:
        rows.append(block_of(first, rest))
    return torch.cat(rows)


def test_quantize_matches_flashinfer_host_reference(fi_host):
    quant, _ = fi_host
    for x in (edge_case_rows(), gaussian_blocks(256, 64, seed=4, lo=-150, hi=120)):
        q, s = quantize_mxfp8(x)
        want_q, want_s = quant(x)
        assert torch.equal(s, want_s), "scale codes differ from mxfp8_quantize_host"
        assert torch.equal(q.view(torch.uint8), want_q), (
            "e4m3 bytes differ from mxfp8_quantize_host"
        )
        assert_matches_ref(x)  # and the independent float64 formulation agrees with both


def test_dequantize_matches_flashinfer_host_reference(fi_host):
    _, dequant = fi_host
    q = random_e4m3((64, 128), seed=5)
    s = torch.randint(
        1, 247, (64, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(dequantize_mxfp8(q, s), dequant(q, s))
    # Code 0: we follow the OCP MX spec (2^-127); FlashInfer's host helper uses a 0.0 scale.
    # Nothing quantize_mxfp8 emits can tell them apart (its code-0 blocks are all +-0).
    s0 = torch.zeros(64, 4, dtype=torch.uint8)
    assert torch.equal(dequant(q, s0), q.float() * 0.0)
    assert torch.equal(dequantize_mxfp8(q, s0), q.float() * 2.0**-127)
    qz, sz = quantize_mxfp8(torch.randn(8, 64) * 2.0**-130)
    assert not sz.any()
    assert torch.equal(dequantize_mxfp8(qz, sz), dequant(qz, sz))


def test_matches_flashinfer_pure_torch_quantizer_on_gaussian_bf16(flashinfer_ref):
    # A second FlashInfer quantizer (pure torch, log2-based ceil; the same rule away from the
    # one-ulp edges): the fused-MoE backend's weight quantizer.
    ref = flashinfer_ref(
        "flashinfer.experimental.cake_mxfp8_megamoe_ep16.backend:_quantize_mxfp8_block32"
    )
    x = gaussian_blocks(128, 512, seed=6, lo=-20, hi=20).bfloat16()
    q, s = quantize_mxfp8(x)
    rq, rs = ref(x[None])
    assert torch.equal(s, rs[0])
    assert torch.equal(q.view(torch.uint8), rq[0].view(torch.uint8))


# --- dequantize -------------------------------------------------------------------------------


def test_dequantize_golden():
    # 0x38 = 1.0, 0xC4 = -3.0 (exp 8-7 = 1, mantissa 4/8), 0x01 = 2^-9 (smallest subnormal).
    q = torch.tensor([[0x38] * 32 + [0xC4] * 31 + [0x01]], dtype=torch.uint8)
    s = torch.tensor([[128, 125]], dtype=torch.uint8)  # 2^1 and 2^-2
    out = dequantize_mxfp8(q, s)
    assert out.dtype == torch.float32 and out.shape == (1, 64)
    assert out[0, :32].tolist() == [2.0] * 32
    assert out[0, 32:63].tolist() == [-0.75] * 31 and out[0, 63].item() == 2.0**-11


def test_dequantize_accepts_e8m0_scales_and_bf16_output():
    q = random_e4m3((16, 64), seed=7)
    s = torch.randint(
        100, 150, (16, 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    want = dequantize_mxfp8(q, s)
    assert torch.equal(dequantize_mxfp8(q, s.view(torch.float8_e8m0fnu)), want)
    assert torch.equal(dequantize_mxfp8(q.view(torch.uint8), s), want)
    got = dequantize_mxfp8(q, s, out_dtype=torch.bfloat16, chunk_rows=3)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def test_dequantize_scale_255_names_tensor():
    q = random_e4m3((4, 64), seed=8)
    s = torch.full((4, 2), 127, dtype=torch.uint8)
    s[3, 1] = 255
    with pytest.raises(
        LayoutError,
        match=r"^mlp\.down\.weight: scale byte 255 \(UE8M0 NaN\) at row 3, scale column 1$",
    ):
        dequantize_mxfp8(q, s, name="mlp.down.weight")


def test_dequantize_e4m3_nan_byte_names_tensor():
    q = torch.full((4, 64), 0x38, dtype=torch.uint8)
    q[1, 5] = 0xFF
    with pytest.raises(LayoutError, match=r"^w: e4m3 NaN byte at row 1, column 5$"):
        dequantize_mxfp8(q, torch.full((4, 2), 127, dtype=torch.uint8), name="w", chunk_rows=1)


def test_dequantize_rejects_mismatched_scale_shape_and_bad_dtype():
    q = random_e4m3((4, 64), seed=9)
    with pytest.raises(LayoutError, match=r"w: scale shape \[4, 3\]"):
        dequantize_mxfp8(q, torch.zeros(4, 3, dtype=torch.uint8), name="w")
    with pytest.raises(LayoutError, match="uint8 or float8_e8m0fnu"):
        dequantize_mxfp8(q, torch.zeros(4, 2, dtype=torch.int32), name="w")
    with pytest.raises(LayoutError, match="float32 or bfloat16"):
        dequantize_mxfp8(q, torch.zeros(4, 2, dtype=torch.uint8), out_dtype=torch.float16)


def half_ulp_bound(x: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Per-element bound on |deq - x|: half an e4m3 ulp of x * 2^(127-code), scaled back."""
    scale = np.exp2(codes.astype(np.float64) - 127)[..., None]
    y = np.abs(x) / scale
    _, e = np.frexp(np.where(y == 0, 1.0, y))
    return 0.5 * np.exp2(np.maximum(e - 1, -6) - 3.0) * scale


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 3),
    exps=st.lists(st.integers(-135, 120), min_size=1, max_size=4),
    data=st.data(),
)
def test_round_trip_within_half_ulp(rows, exps, data):
    nb = len(exps)
    vals = data.draw(
        st.lists(st.floats(-1.0, 1.0, width=32), min_size=rows * nb * 32, max_size=rows * nb * 32)
    )
    x64 = (
        np.array(vals, dtype=np.float64).reshape(rows, nb, 32)
        * np.exp2(np.array(exps, dtype=np.float64))[None, :, None]
    )
    x = torch.from_numpy(x64.astype(np.float32).reshape(rows, nb * 32))
    q, s = quantize_mxfp8(x)
    deq = dequantize_mxfp8(q, s).double().numpy().reshape(rows, nb, 32)
    xb = x.double().numpy().reshape(rows, nb, 32)
    codes = s.numpy()
    nonzero = codes > 0
    err = np.abs(deq - xb)
    assert np.all(err[nonzero] <= half_ulp_bound(xb, codes)[nonzero])
    # Code 0 blocks are below 448 * 2^-127 (flushed to +-0 by the recipe).
    assert np.all(np.abs(xb[~nonzero]) <= 448.0 * 2.0**-127 * (1 + 2.0**-22))
    assert np.all(deq[~nonzero] == 0)
    # The scale is the smallest power of two that fits: the block max uses the top binade.
    amax = np.abs(xb).max(axis=-1)
    tight = codes > 1
    assert np.all(amax[tight] / np.exp2(codes[tight] - 127.0) > 224.0 * (1 - 2.0**-22))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_trip_half_precision(dtype):
    x = gaussian_blocks(32, 256, seed=10, lo=-8, hi=8).to(dtype)
    q, s = quantize_mxfp8(x)
    xb = x.double().numpy()
    err = np.abs(dequantize_mxfp8(q, s).double().numpy() - xb)
    assert s.min() > 0  # no flushed blocks at these magnitudes
    assert np.all(err.reshape(32, 8, 32) <= half_ulp_bound(xb.reshape(32, 8, 32), s.numpy()))


# --- quantization_error ----------------------------------------------------------------------


def test_quantization_error_golden():
    # 1.0625 is a tie between e4m3 1.0 and 1.125 -> even -> 1.0
    # (code 120 = 2^-7: 1.0625/448 -> 2^-8.7).
    ref = torch.full((2, 32), 1.0625)
    q, s = quantize_mxfp8(ref)
    assert dequantize_mxfp8(q, s).unique().tolist() == [1.0]
    e = quantization_error(ref, q, s)
    assert e.rel_fro == pytest.approx(1 / 17, rel=1e-12)  # 0.0625 / 1.0625
    assert e.sqnr_db == pytest.approx(20 * math.log10(17), rel=1e-12)


def test_quantization_error_exact_and_zero_cases():
    ref = torch.full((1, 32), 3.0)
    q, s = quantize_mxfp8(ref)
    assert quantization_error(ref, q, s) == QuantError(rel_fro=0.0, sqnr_db=math.inf)
    zero = torch.zeros(1, 32)
    qz, sz = quantize_mxfp8(zero)
    assert quantization_error(zero, qz, sz) == QuantError(0.0, math.inf)
    assert quantization_error(zero, q, s) == QuantError(math.inf, -math.inf)


def assert_error_close(got: QuantError, want: QuantError) -> None:
    assert got.rel_fro == pytest.approx(want.rel_fro, rel=1e-12)
    assert got.sqnr_db == pytest.approx(want.sqnr_db, rel=1e-12)


def test_quantization_error_matches_numpy_and_is_chunk_independent():
    ref = gaussian_blocks(50, 128, seed=11, lo=-4, hi=4)
    q, s = quantize_mxfp8(ref)
    deq = q.double().numpy() * np.exp2(np.repeat(s.numpy().astype(np.float64), 32, axis=1) - 127)
    r = ref.double().numpy()
    err2, ref2 = np.sum((deq - r) ** 2), np.sum(r**2)
    e = quantization_error(ref, q, s, chunk_rows=7)
    assert e.rel_fro == pytest.approx(math.sqrt(err2 / ref2), rel=1e-9)
    assert e.sqnr_db == pytest.approx(10 * math.log10(ref2 / err2), rel=1e-9)
    assert 25 < e.sqnr_db < 40  # e4m3 with per-32 scales: ~31 dB on Gaussian data
    assert_error_close(quantization_error(ref, q, s), e)


def test_quantization_error_is_float64_beyond_float32_range():
    # fp32 max quantizes to 256 * 2^120 = 2^128 (see test_largest_finite_float32_uses_code_247),
    # which is inf in float32 but exact in float64: each error is 2^128 - fmax = 2^104.
    fmax = float(torch.finfo(torch.float32).max)
    ref = block_of(fmax, rest=-fmax)
    q, s = quantize_mxfp8(ref)
    assert torch.isinf(dequantize_mxfp8(q, s)).all()
    e = quantization_error(ref, q, s)
    assert e.rel_fro == 2.0**104 / fmax
    assert e.sqnr_db == pytest.approx(20 * math.log10(fmax / 2.0**104), rel=1e-12)


def test_quantization_error_rejects_bad_reference():
    q, s = quantize_mxfp8(torch.ones(2, 32))
    with pytest.raises(LayoutError, match=r"reference shape \[2, 64\]"):
        quantization_error(torch.ones(2, 64), q, s, name="w")
    with pytest.raises(LayoutError, match=r"^w: non-finite value nan at index \[1, 3\]"):
        quantization_error(
            torch.ones(2, 32).index_put_(
                (torch.tensor(1), torch.tensor(3)), torch.tensor(float("nan"))
            ),
            q,
            s,
            name="w",
        )


# --- quantize_mxfp8_with_error: one pass, the same bytes and the same float64 sums -----------


def numpy_error(ref: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> tuple[float, float]:
    """(rel_fro, sqnr_db) computed independently, all in numpy float64."""
    deq = q.double().numpy() * np.exp2(np.repeat(s.numpy().astype(np.float64), 32, axis=1) - 127)
    r = ref.double().numpy()
    err2, ref2 = np.sum((deq - r) ** 2), np.sum(r**2)
    return math.sqrt(err2 / ref2), 10 * math.log10(ref2 / err2)


WIDE = [  # (name, tensor): data for the fused path, each in bfloat16, float16 and float32
    ("gaussian", lambda: gaussian_blocks(96, 256, seed=31)),
    ("code-0 and subnormal blocks", lambda: gaussian_blocks(64, 512, seed=32, lo=-150, hi=-100)),
    ("every exponent", lambda: gaussian_blocks(64, 512, seed=33, lo=-140, hi=120)),
    ("zeros, -0.0 and ties", lambda: torch.cat([torch.zeros(3, 64), torch.full((3, 64), -0.0),
                                                 torch.full((3, 64), 1.0625)])),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk_rows", [None, 7])
@pytest.mark.parametrize(("label", "make"), WIDE, ids=[w[0] for w in WIDE])
def test_with_error_is_quantize_and_quantization_error_bit_for_bit(label, make, chunk_rows, dtype):
    x = make().to(dtype)
    if dtype == torch.float16:
        x = x.float().clamp(-60000, 60000).to(dtype)
    q, s, err = quantize_mxfp8_with_error(x, chunk_rows=chunk_rows)
    q0, s0 = quantize_mxfp8(x)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    assert err == quantization_error(x, q0, s0, chunk_rows=chunk_rows)  # the same bits
    if torch.count_nonzero(x) and err.rel_fro > 0:
        want_rel, want_db = numpy_error(x, q0, s0)
        assert err.rel_fro == pytest.approx(want_rel, rel=1e-12)
        assert err.sqnr_db == pytest.approx(want_db, rel=1e-12)


def test_residual_is_the_exact_float64_difference():
    # The float32 path's claim (quantize._residual_f32): deq - x is exact for codes <= 246,
    # checked against float64 over every exponent float32 weights reach, and subnormals.
    from mxfp8_convert.quantize import _F32_EXACT_MAX_CODE, _quantize_chunk, _residual_f32

    for seed, (lo, hi) in enumerate([(-150, -120), (-60, 60), (60, 118)]):
        x = gaussian_blocks(128, 256, seed=40 + seed, lo=lo, hi=hi)
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty((128, 8), dtype=torch.uint8)
        codes = _quantize_chunk(x, q, s, "w", 0)
        assert int(codes.max()) <= _F32_EXACT_MAX_CODE
        deq = q.double().numpy() * np.exp2(np.repeat(s.numpy().astype(np.float64), 32, 1) - 127)
        assert np.array_equal(_residual_f32(x, q, codes).double().numpy(), deq - x.double().numpy())


def test_e4m3_pair_table_holds_every_pair_of_values():
    from mxfp8_convert.quantize import _E4M3_PAIRS_F32

    b = torch.arange(1 << 16, dtype=torch.int32)
    pairs = torch.stack([b & 0xFF, b >> 8], 1).to(torch.uint8)  # little-endian uint16 -> bytes
    want = pairs.view(torch.float8_e4m3fn).float().numpy()
    got = _E4M3_PAIRS_F32.view(np.float32).reshape(-1, 2)
    assert np.array_equal(got, want, equal_nan=True)


def test_with_error_beyond_float32_range_takes_the_float64_path():
    fmax = float(torch.finfo(torch.float32).max)  # code 247: the float32 path would overflow
    q, s, err = quantize_mxfp8_with_error(block_of(fmax, rest=-fmax))
    assert int(s[0, 0]) == 247
    assert err.rel_fro == 2.0**104 / fmax  # see test_quantization_error_is_float64_beyond_...


def test_with_error_exact_zero_and_bad_input():
    assert quantize_mxfp8_with_error(torch.full((1, 32), 3.0))[2] == QuantError(0.0, math.inf)
    assert quantize_mxfp8_with_error(torch.zeros(2, 64))[2] == QuantError(0.0, math.inf)
    q, s, err = quantize_mxfp8_with_error(torch.zeros(0, 64))
    assert q.shape == (0, 64) and s.shape == (0, 2) and err == QuantError(0.0, math.inf)
    x = torch.ones(4, 64)
    x[3, 33] = float("inf")
    with pytest.raises(LayoutError, match=r"^w: non-finite value inf at row 3, column 33"):
        quantize_mxfp8_with_error(x, name="w", chunk_rows=2)
    with pytest.raises(LayoutError, match="float64"):
        quantize_mxfp8_with_error(torch.ones(2, 64, dtype=torch.float64), name="w")


def test_fp8_requantize_error_is_quantization_error_of_its_source_values():
    w = random_e4m3((200, 384), seed=50)
    scale = torch.rand(2, 3, generator=torch.Generator().manual_seed(5)) + 0.1
    r = block_fp8_to_mxfp8(w, scale, chunk_rows=64)
    src = w.float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)
    assert r.error == quantization_error(src, r.q, r.s, chunk_rows=64)


# --- block FP8 (DeepSeek) ---------------------------------------------------------------------


def expand_block_scale(
    scale: torch.Tensor, n: int, k: int, bn: int = 128, bk: int = 128
) -> torch.Tensor:
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


@pytest.mark.parametrize(("n", "k"), [(576, 160), (256, 256), (130, 32), (1, 7168 + 32)])
def test_block_fp8_power_of_two_scales_are_lossless(n, k):
    w = random_e4m3((n, k), seed=n + k)
    g = torch.Generator().manual_seed(k)
    e = torch.randint(-30, 30, (-(-n // 128), -(-k // 128)), generator=g)
    scale_inv = torch.exp2(e.float())
    res = block_fp8_to_mxfp8(w, scale_inv, name="attn.kv_a.weight")
    assert res.lossless and res.error is None
    assert res.q is w  # bytes kept, no copy
    assert res.s.shape == (n, k // 32) and res.s.dtype == torch.uint8
    # each 1x32 block gets its 128x128 block's exponent: code = 127 + e[r//128, (32c)//128]
    want = 127 + e[torch.arange(n) // 128][:, torch.arange(k // 32) * 32 // 128]
    assert torch.equal(res.s.long(), want)
    source = w.float() * expand_block_scale(scale_inv, n, k)  # DeepSeek's weight_dequant
    assert torch.equal(dequantize_mxfp8(res.q, res.s), source)


def test_block_fp8_extreme_exponents_are_lossless():
    # 2^-127 (an fp32 subnormal) maps to code 0, 2^127 to code 254: both ends of UE8M0.
    w = random_e4m3((256, 128), seed=12)
    scale_inv = torch.tensor([[2.0**-127], [2.0**127]], dtype=torch.float32)
    res = block_fp8_to_mxfp8(w, scale_inv)
    assert res.lossless
    assert res.s[:128].unique().tolist() == [0] and res.s[128:].unique().tolist() == [254]
    assert torch.equal(
        dequantize_mxfp8(res.q, res.s), w.float() * expand_block_scale(scale_inv, 256, 128)
    )


@pytest.mark.parametrize(
    "odd_scale",
    [1.5, 0.0123, 2.0**-130, 2.0**-127 * 1.5],
    ids=["non_pow2", "typical", "pow2_below_ue8m0", "subnormal_non_pow2"],
)
def test_block_fp8_other_scales_requantize_and_report_error(odd_scale):
    n, k = 200, 160
    w = random_e4m3((n, k), seed=13)
    scale_inv = torch.full((2, 2), 0.5)
    scale_inv[1, 0] = odd_scale
    res = block_fp8_to_mxfp8(w, scale_inv, chunk_rows=64)
    assert not res.lossless and isinstance(res.error, QuantError)
    source = w.float() * expand_block_scale(scale_inv, n, k)
    q, s = quantize_mxfp8(source)
    assert torch.equal(res.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(res.s, s)
    assert_error_close(res.error, quantization_error(source, q, s))
    assert res.error.rel_fro < 0.1


def test_block_fp8_block_not_multiple_of_32_requantizes():
    w = random_e4m3((32, 64), seed=14)
    scale_inv = torch.exp2(torch.randint(-3, 3, (1, 4)).float())  # 1x16 blocks, powers of two
    res = block_fp8_to_mxfp8(w, scale_inv, block=(32, 16))
    assert not res.lossless
    source = w.float() * expand_block_scale(scale_inv, 32, 64, 32, 16)
    assert_error_close(res.error, quantization_error(source, res.q, res.s))


@pytest.mark.parametrize(
    ("bad", "shown"), [(0.0, "0.0"), (-1.0, "-1.0"), (float("nan"), "nan"), (float("inf"), "inf")]
)
def test_block_fp8_bad_scale_names_tensor(bad, shown):
    w = random_e4m3((256, 256), seed=15)
    scale_inv = torch.ones(2, 2)
    scale_inv[1, 0] = bad
    with pytest.raises(
        LayoutError,
        match=rf"^q_proj\.weight_scale_inv: scale {shown} at index \[1, 0\] "
        r"is not a finite positive number",
    ):
        block_fp8_to_mxfp8(w, scale_inv, name="q_proj.weight")


def test_block_fp8_rejects_bad_inputs():
    w = random_e4m3((256, 256), seed=16)
    with pytest.raises(
        LayoutError, match=r"w_scale_inv: shape \[2, 1\] does not fit weight \[256, 256\]"
    ):
        block_fp8_to_mxfp8(w, torch.ones(2, 1), name="w", scale_name="w_scale_inv")
    with pytest.raises(LayoutError, match="K = 48"):
        block_fp8_to_mxfp8(random_e4m3((4, 48), seed=1), torch.ones(1, 1), name="w")
    with pytest.raises(LayoutError, match="float8_e4m3fn"):
        block_fp8_to_mxfp8(w.float(), torch.ones(2, 2), name="w")
    with pytest.raises(LayoutError, match="block"):
        block_fp8_to_mxfp8(w, torch.ones(2, 2), block=(0, 128), name="w")
    nan_w = w.view(torch.uint8).clone()
    nan_w[7, 9] = 0x7F
    with pytest.raises(LayoutError, match=r"^w: non-finite value nan at index \[7, 9\]"):
        block_fp8_to_mxfp8(nan_w.view(torch.float8_e4m3fn), torch.ones(2, 2), name="w")


# --- per-tensor / per-channel FP8 -------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_per_tensor_power_of_two_is_lossless(shape):
    w = random_e4m3((96, 64), seed=17)
    res = per_tensor_fp8_to_mxfp8(w, torch.tensor(0.25).reshape(shape))
    assert res.lossless and res.q is w
    assert res.s.unique().tolist() == [125]  # 0.25 = 2^-2 -> 125
    assert torch.equal(dequantize_mxfp8(res.q, res.s), w.float() * 0.25)


@pytest.mark.parametrize("shape", ["n", "n1"])
def test_per_channel_power_of_two_is_lossless(shape):
    n = 96
    w = random_e4m3((n, 64), seed=18)
    e = torch.randint(-10, 10, (n,), generator=torch.Generator().manual_seed(18))
    scale = torch.exp2(e.float())
    res = per_tensor_fp8_to_mxfp8(w, scale if shape == "n" else scale[:, None])
    assert res.lossless
    assert torch.equal(res.s, (127 + e).to(torch.uint8)[:, None].expand(n, 2))
    assert torch.equal(dequantize_mxfp8(res.q, res.s), w.float() * scale[:, None])


@pytest.mark.parametrize("per_channel", [False, True])
def test_per_tensor_non_power_of_two_requantizes(per_channel):
    n = 70
    w = random_e4m3((n, 96), seed=19)
    scale = torch.linspace(0.001, 0.01, n) if per_channel else torch.tensor([0.0037])
    res = per_tensor_fp8_to_mxfp8(w, scale, chunk_rows=16)
    assert not res.lossless
    source = w.float() * (scale[:, None] if per_channel else scale)
    q, s = quantize_mxfp8(source)
    assert torch.equal(res.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(res.s, s)
    assert_error_close(res.error, quantization_error(source, q, s))


def test_per_tensor_bad_scales_name_tensor():
    w = random_e4m3((8, 64), seed=20)
    with pytest.raises(
        LayoutError, match=r"^o_proj\.weight_scale: shape \[4\] is neither per-tensor"
    ):
        per_tensor_fp8_to_mxfp8(w, torch.ones(4), name="o_proj.weight")
    with pytest.raises(LayoutError, match=r"^o_proj\.weight_scale: scale 0\.0 at index \[\]"):
        per_tensor_fp8_to_mxfp8(w, torch.tensor(0.0), name="o_proj.weight")
    bad = torch.ones(8)
    bad[5] = -2.0
    with pytest.raises(LayoutError, match=r"^ws: scale -2\.0 at index \[5\]"):
        per_tensor_fp8_to_mxfp8(w, bad, name="o_proj.weight", scale_name="ws")


def test_fp8_sources_empty_weight():
    w = torch.zeros(0, 64, dtype=torch.float8_e4m3fn)
    res = per_tensor_fp8_to_mxfp8(w, torch.tensor(0.3))
    assert res.lossless and res.s.shape == (0, 2)


# --- helpers and dataclasses ------------------------------------------------------------------


def test_check_finite():
    check_finite(torch.ones(3, 4), "ok")
    check_finite(torch.ones(3, 4, dtype=torch.float8_e4m3fn), "ok")
    x = torch.ones(10, 3)
    x[9, 2] = float("-inf")
    with pytest.raises(LayoutError, match=r"^emb: non-finite value -inf at index \[9, 2\]"):
        check_finite(x, "emb", chunk_rows=4)
    with pytest.raises(LayoutError, match=r"scalar: non-finite value nan at index \[0\]"):
        check_finite(torch.tensor(float("nan")), "scalar")
    with pytest.raises(LayoutError, match="floating"):
        check_finite(torch.ones(2, dtype=torch.int32), "ints")


def test_result_dataclass_validates_and_serialises():
    q, s = quantize_mxfp8(torch.ones(2, 64))
    res = MXFP8Result(q, s, lossless=False, error=QuantError(0.5, 6.0))
    assert res.to_dict() == {
        "shape": [2, 64],
        "lossless": False,
        "error": {"rel_fro": 0.5, "sqnr_db": 6.0},
    }
    with pytest.raises(LayoutError, match="scale shape"):
        MXFP8Result(q, s[:, :1], lossless=True, error=None)
    with pytest.raises(LayoutError, match="error exactly when"):
        MXFP8Result(q, s, lossless=True, error=QuantError(0.0, math.inf))
    with pytest.raises(LayoutError, match="e4m3 q and uint8 s"):
        MXFP8Result(q.float(), s, lossless=True, error=None)


def test_module_stays_pure():
    # STYLE.md section 1: tensor math only; no disk, rich or flashinfer in this module.
    src = Path(__file__).parents[1].joinpath("mxfp8_convert", "quantize.py").read_text()
    imports = set(re.findall(r"^\s*(?:from|import)\s+([\w.]+)", src, re.M))
    assert imports <= {
        "__future__",
        "math",
        "os",  # only os.environ: the MXFP8_CONVERT_NO_C switch (asserted below)
        "collections.abc",
        "contextlib",
        "dataclasses",
        "numpy",  # tensor math too: the e4m3 table lookup
        "torch",
        "mxfp8_convert.errors",
        "mxfp8_convert._buffers",  # per-thread scratch buffers, no threads started
        "mxfp8_convert._cquant",  # the C accelerator (optional; no disk either)
    }
    assert "open(" not in src and "torch.cuda" not in src
    assert set(re.findall(r"\bos\.(\w+)", src)) == {"environ"}


@pytest.mark.gpu
def test_cuda_matches_cpu():
    x = gaussian_blocks(256, 512, seed=21, lo=-140, hi=120)
    q, s = quantize_mxfp8(x)
    qc, sc = quantize_mxfp8(x.cuda())
    assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(sc.cpu(), s)
    assert torch.equal(dequantize_mxfp8(qc, sc).cpu(), dequantize_mxfp8(q, s))
    w = random_e4m3((576, 160), seed=22)
    scale_inv = torch.rand(5, 2) + 0.1
    res, resc = block_fp8_to_mxfp8(w, scale_inv), block_fp8_to_mxfp8(w.cuda(), scale_inv.cuda())
    assert torch.equal(resc.q.cpu().view(torch.uint8), res.q.view(torch.uint8))
    assert_error_close(resc.error, res.error)


# --- working buffers per thread (_buffers.Scratch) -------------------------------------------


def test_results_do_not_share_the_reused_working_buffers():
    # inside reusing_buffers() a thread's chunk buffers serve call after call: what a call
    # returned must not change when the next call (another shape, dtype and chunking) runs
    a = gaussian_blocks(96, 512, seed=61).to(torch.bfloat16)
    b = gaussian_blocks(300, 256, seed=62, lo=-140, hi=120)
    with reusing_buffers():
        qa, sa, ea = quantize_mxfp8_with_error(a)
        kept = (qa.view(torch.uint8).clone(), sa.clone())
        quantize_mxfp8_with_error(b, chunk_rows=7)
        quantize_mxfp8(b)
    assert torch.equal(qa.view(torch.uint8), kept[0]) and torch.equal(sa, kept[1])
    want_q, want_s = ref_quantize(a)  # the numpy recipe, independent of the code under test
    assert np.array_equal(qa.view(torch.uint8).numpy(), want_q) and np.array_equal(sa, want_s)
    want_rel, want_db = numpy_error(a, qa, sa)
    assert ea.rel_fro == pytest.approx(want_rel, rel=1e-12)
    assert ea.sqnr_db == pytest.approx(want_db, rel=1e-12)
    assert qa.is_contiguous() and sa.is_contiguous()


#: the quantizer's public calls that measure their error (so they use the scratch on either
#: path, the C accelerator's or torch's), on 4 chunks of 64 rows
MEASURED = {
    "dense": lambda: quantize_mxfp8_with_error(gaussian_blocks(256, 256, seed=81), chunk_rows=64),
    "block_fp8": lambda: block_fp8_to_mxfp8(random_e4m3((256, 256), seed=82),
                                            torch.full((2, 2), 0.3), chunk_rows=64),
    "fp8": lambda: per_tensor_fp8_to_mxfp8(random_e4m3((256, 256), seed=83), torch.tensor(0.3),
                                           chunk_rows=64),
}


@pytest.mark.parametrize("call", sorted(MEASURED))
def test_a_call_leaves_its_thread_no_buffers(monkeypatch, call):
    """A library caller's thread (its main thread, or one of its own) holds no working buffers
    once a call returns; inside the call they serve every chunk."""
    asked = scratch_requests(monkeypatch)
    left = []

    def on_a_thread():
        MEASURED[call]()
        left.append(dict(SCRATCH.buffers))

    t = threading.Thread(target=on_a_thread)
    t.start()
    t.join()
    MEASURED[call]()
    assert left == [{}] and SCRATCH.buffers == {}
    for life in {a[0] for a in asked}:  # each thread: a buffer per key, made once for 4 chunks
        keys = [key for th, key, _, _ in asked if th == life]
        made = [key for th, key, _, new in asked if th == life and new]
        assert sorted(made) == sorted(set(keys)) and len(keys) == 4 * len(made)
    assert len({a[0] for a in asked}) == 2 and asked


def test_reusing_buffers_keeps_them_from_call_to_call_then_releases_them(monkeypatch):
    asked = scratch_requests(monkeypatch)
    x = gaussian_blocks(256, 256, seed=84)
    with reusing_buffers():
        first = quantize_mxfp8_with_error(x, chunk_rows=64)
        with reusing_buffers():  # nested: the outer block still holds them
            quantize_mxfp8_with_error(x, chunk_rows=64)
        assert SCRATCH.buffers
        again = quantize_mxfp8_with_error(x, chunk_rows=64)
    assert SCRATCH.buffers == {}
    keys = {key for _, key, _, _ in asked}
    assert len(asked) == 3 * 4 * len(keys)  # three calls of four chunks each
    assert sum(new for *_, new in asked) == len(keys)  # made by the first chunk of the first
    assert torch.equal(again[0].view(torch.uint8), first[0].view(torch.uint8))
    assert again[2] == first[2] == quantization_error(x, first[0], first[1], chunk_rows=64)


def test_threads_side_by_side_give_the_serial_results():
    # two threads quantizing at once, each with its own working buffers: the same bytes and
    # the same float64 sums as one call after the other, and the numpy recipe's bytes
    from concurrent.futures import ThreadPoolExecutor

    xs = [gaussian_blocks(64 + 32 * i, 256 * (1 + i % 3), seed=70 + i, lo=-60, hi=60)
          .to(torch.bfloat16 if i % 2 else torch.float32) for i in range(8)]
    serial = [quantize_mxfp8_with_error(x, chunk_rows=16) for x in xs]
    with ThreadPoolExecutor(2) as pool:
        parallel = list(pool.map(lambda x: quantize_mxfp8_with_error(x, chunk_rows=16), xs))
    for x, (q0, s0, e0), (q1, s1, e1) in zip(xs, serial, parallel, strict=True):
        assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s1, s0)
        assert e1 == e0 == quantization_error(x, q0, s0, chunk_rows=16)
        want_q, want_s = ref_quantize(x)
        assert np.array_equal(q1.view(torch.uint8).numpy(), want_q)
        assert np.array_equal(s1.numpy(), want_s)
