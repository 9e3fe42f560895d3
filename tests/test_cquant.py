"""The quantizer's C accelerator (mxfp8_convert/_cquant.c) against its torch path.

Each input is quantized three ways: with the extension, with it turned off (the torch path the
package falls back to, ``quantize._CQUANT = None``), and by ``ref_quantize`` of
tests/test_quantize.py (an independent float64/numpy formulation). The e4m3 bytes, the UE8M0
codes and the error's float64 sums (the floats themselves, compared with ``==``) must agree.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert import quantize as Q
from mxfp8_convert.errors import LayoutError
from tests.checkpoints import REPO
from tests.test_quantize import gaussian_blocks, random_e4m3, ref_quantize

OFF = os.environ.get("MXFP8_CONVERT_NO_C", "") not in ("", "0")
#: without the extension (no compiler, or turned off) there is no second path to compare
needs_c = pytest.mark.skipif(Q._CQUANT is None, reason="the C accelerator is not built or off")

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
FINITE_E4M3 = torch.sort(E4M3_VALUES[torch.isfinite(E4M3_VALUES) & (E4M3_VALUES >= 0)]).values


def test_extension_is_built_where_a_compiler_is():
    # `pip install -e .` (make install) builds it wherever a C compiler exists; a checkout
    # without a compiler runs the torch path, and this test has nothing to check there.
    if OFF:
        pytest.skip("turned off with MXFP8_CONVERT_NO_C")
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the torch path is the quantizer")
    assert Q._CQUANT is not None, "mxfp8_convert/_cquant.c is not built: run `pip install -e .`"


def test_environment_variable_turns_it_off():
    code = "from mxfp8_convert import quantize as Q; print(Q._CQUANT is None)"
    absent = str(importlib.util.find_spec("mxfp8_convert._cquant") is None)
    for value, off in (("1", "True"), ("yes", "True"), ("0", absent), ("", absent)):
        env = {**os.environ, "MXFP8_CONVERT_NO_C": value, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-P", "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        assert out == off, value


def torch_path(fn, *args, **kw):
    """``fn`` with the C accelerator turned off."""
    saved, Q._CQUANT = Q._CQUANT, None
    try:
        return fn(*args, **kw)
    finally:
        Q._CQUANT = saved


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(x: torch.Tensor, *, chunk_rows=None, ref: bool = True) -> Q.QuantError:
    """C path == torch path (bytes, codes, error sums) and == ``ref_quantize``; the error."""
    assert Q._CQUANT is not None
    q, s, err = Q.quantize_mxfp8_with_error(x, chunk_rows=chunk_rows)
    tq, ts, terr = torch_path(Q.quantize_mxfp8_with_error, x, chunk_rows=chunk_rows)
    pq, ps = Q.quantize_mxfp8(x, chunk_rows=chunk_rows)
    for got in (q, pq):
        assert torch.equal(bits(got), bits(tq)), "e4m3 bytes"
    assert torch.equal(s, ts) and torch.equal(ps, ts), "codes"
    assert (err.rel_fro, err.sqnr_db) == (terr.rel_fro, terr.sqnr_db)
    assert repr(err.rel_fro) == repr(terr.rel_fro)  # the marker writes the repr
    if ref:
        want_q, want_s = ref_quantize(x)
        np.testing.assert_array_equal(ts.numpy(), want_s)
        np.testing.assert_array_equal(bits(tq).numpy(), want_q)
    return err


@needs_c
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("lo", "hi"), [(-30, 30), (-150, -100), (-140, 120), (-8, 8)])
def test_gaussian_blocks_every_exponent(dtype, lo, hi):
    x = gaussian_blocks(61, 1056, seed=lo * 7 + hi, lo=lo, hi=hi)  # odd rows, K = 33 blocks
    if dtype == torch.float16:
        x = x.clamp(-65000, 65000)
    assert_same(x.to(dtype), chunk_rows=None)
    assert_same(x.to(dtype), chunk_rows=5)


@needs_c
def test_chunks_of_2_20_elements_and_a_ragged_last_chunk():
    # the default chunk (2**20 elements) over K not dividing it, so chunks hold whole rows and
    # the last chunk is short; the float64 sums add chunk after chunk in both paths
    x = gaussian_blocks(700, 3072, seed=3, lo=-20, hi=20).to(torch.bfloat16)
    assert_same(x, ref=False)


@needs_c
def test_zeros_negative_zeros_and_subnormals():
    x = torch.zeros(6, 128)
    x[1] = -0.0
    x[2, :64] = torch.tensor(np.float32(1e-45)).item()  # the smallest float32 subnormal
    x[2, 64:] = -float(np.float32(2.0**-127))
    x[3] = torch.linspace(-2.0**-130, 2.0**-130, 128)
    x[4] = float(np.float32(2.0**-126)) * torch.arange(128) / 128
    x[5, ::2] = -0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_same(x.to(dtype))
    bf = torch.arange(1, 129, dtype=torch.int16).view(torch.bfloat16).reshape(1, 128)
    assert_same(bf)  # bf16 subnormals
    fp = torch.arange(1, 1025, dtype=torch.int16).view(torch.float16).reshape(8, 128)
    assert_same(fp)  # every fp16 subnormal
    assert_same(-fp)


@needs_c
def test_ties_and_neighbours_at_every_e4m3_rounding_boundary():
    # each block holds 448 (so its scale is 2^0 and the values reach the cast unscaled) and
    # the midpoints between consecutive e4m3 values, one float32 ulp either side, both signs
    mids = ((FINITE_E4M3[1:] + FINITE_E4M3[:-1]) / 2).numpy().astype(np.float32)
    vals = np.concatenate([mids, np.nextafter(mids, np.float32(0)),
                           np.nextafter(mids, np.float32(np.inf)), FINITE_E4M3.numpy()])
    vals = np.concatenate([vals, -vals])
    vals = np.concatenate([vals, np.zeros((-len(vals)) % 31, np.float32)]).reshape(-1, 31)
    x = torch.from_numpy(np.concatenate([vals, np.full((len(vals), 1), 448, np.float32)], 1))
    x = x.reshape(-1, 32)  # one block a row: an odd row count
    assert_same(x)  # ref_quantize rounds half to even with np.rint
    assert bool((Q.quantize_mxfp8(x)[1] == 127).all())


@needs_c
def test_values_near_saturation_and_the_largest_floats():
    fmax = float(torch.finfo(torch.float32).max)
    x = torch.tensor([448.0, -448.0, float(np.nextafter(np.float32(448), np.float32(1e9))),
                      464.0, -479.9, 480.0, 1e30, fmax, -fmax, 2.0**127, 3.0 * 2.0**126])
    blocks = torch.zeros(len(x), 32)
    blocks[:, 0] = x
    blocks[:, 1:] = x[:, None] * torch.linspace(-1, 1, 31)
    assert_same(blocks)  # 11 rows of one block
    assert_same(blocks[:7].to(torch.bfloat16))  # the float32 maxima are Inf in bf16


@needs_c
@pytest.mark.parametrize("code", [245, 246, 247, 254])
def test_codes_around_the_float32_exact_limit(code):
    # a chunk whose largest code is above _F32_EXACT_MAX_CODE (246) gets its error from the
    # float64 dequantization; one chunk of each kind in one tensor
    amax = 448.0 * 2.0 ** (code - 127)
    x = gaussian_blocks(8, 256, seed=code, lo=-3, hi=3)
    x[4:, 0] = amax if math.isfinite(amax) and amax < 3.4e38 else float(
        torch.finfo(torch.float32).max)
    err = assert_same(x, chunk_rows=4)
    want = Q.quantization_error(x, *Q.quantize_mxfp8(x), chunk_rows=4)
    assert (err.rel_fro, err.sqnr_db) == (want.rel_fro, want.sqnr_db)
    assert int(Q.quantize_mxfp8(x)[1].max()) == min(code, 247)


@needs_c
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_values_raise_the_same_message(bad, dtype):
    x = torch.ones(9, 96, dtype=dtype)
    x[7, 40] = bad
    x[8, 3] = bad
    messages = []
    for fn in (Q.quantize_mxfp8_with_error, Q.quantize_mxfp8):
        for run in (fn, lambda x, fn=fn, **kw: torch_path(fn, x, **kw)):
            with pytest.raises(LayoutError) as e:
                run(x, name="w", chunk_rows=3)
            messages.append(str(e.value))
    assert len(set(messages)) == 1
    assert messages[0].startswith(f"w: non-finite value {bad} at row 7, column 40")


@needs_c
def test_same_sums_on_a_fresh_thread_with_one_torch_thread():
    # what a conversion does: torch.set_num_threads(1), modules quantized on helper threads.
    # MKL's dot products sum in an order set by the thread count a thread has taken from torch
    # (the C path must let torch set it, as the torch path's own ops do, before its dots)
    x = gaussian_blocks(512, 2048, seed=12, lo=-10, hi=10)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        errors = []
        for fn in (Q.quantize_mxfp8_with_error,
                   lambda x: torch_path(Q.quantize_mxfp8_with_error, x)):
            t = threading.Thread(target=lambda fn=fn: errors.append(fn(x)[2]))
            t.start()
            t.join()
        errors.append(torch_path(Q.quantize_mxfp8_with_error, x)[2])  # this thread, 1 thread
    finally:
        torch.set_num_threads(before)
    assert errors[0] == errors[1] == errors[2]


@needs_c
def test_non_contiguous_and_empty_inputs():
    x = gaussian_blocks(64, 128, seed=9).t()  # [128, 64], not contiguous
    assert not x.is_contiguous()
    assert_same(x)
    q, s, err = Q.quantize_mxfp8_with_error(torch.zeros(0, 64))
    assert q.shape == (0, 64) and s.shape == (0, 2) and err.rel_fro == 0.0


@needs_c
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    blocks=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    chunk=st.sampled_from([None, 1, 2, 3]),
    data=st.data(),
)
def test_arbitrary_bit_patterns(rows, blocks, dtype, chunk, data):
    # any finite pattern of the dtype's bits (NaN and Inf patterns set to zero)
    n = rows * blocks * 32
    width = 32 if dtype == torch.float32 else 16
    raw = data.draw(st.lists(st.integers(0, (1 << width) - 1), min_size=n, max_size=n))
    ints = torch.tensor(raw, dtype=torch.int64)
    if width == 32:
        ints = torch.where(ints >= 1 << 31, ints - (1 << 32), ints).to(torch.int32)
    else:
        ints = torch.where(ints >= 1 << 15, ints - (1 << 16), ints).to(torch.int16)
    x = ints.view(dtype).reshape(rows, blocks * 32).clone()
    x[~torch.isfinite(x)] = 0
    assert_same(x, chunk_rows=chunk)


@needs_c
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lo=st.integers(-150, 110), span=st.integers(0, 30))
def test_random_gaussians(seed, lo, span):
    x = gaussian_blocks(5, 160, seed=seed, lo=lo, hi=min(lo + span + 1, 124))  # finite
    assert_same(x)
    assert_same(x.to(torch.bfloat16))


@needs_c
def test_fp8_requantization_same_bytes_and_error():
    w = random_e4m3((203, 384), seed=51)
    scale = torch.rand(2, 3, generator=torch.Generator().manual_seed(6)) + 0.1
    per_row = torch.rand(203, generator=torch.Generator().manual_seed(7)) * 3 + 0.01
    for fn, sc, kw in ((Q.block_fp8_to_mxfp8, scale, {"chunk_rows": 64}),
                       (Q.block_fp8_to_mxfp8, scale, {}),
                       (Q.per_tensor_fp8_to_mxfp8, per_row, {}),
                       (Q.per_tensor_fp8_to_mxfp8, torch.tensor(0.37), {"chunk_rows": 7})):
        got, want = fn(w, sc, **kw), torch_path(fn, w, sc, **kw)
        assert not got.lossless
        assert torch.equal(bits(got.q), bits(want.q)) and torch.equal(got.s, want.s)
        assert got.error == want.error


def assert_same_fp8(fn, w, scale, **kw) -> Q.MXFP8Result:
    got, want = fn(w, scale, **kw), torch_path(fn, w, scale, **kw)
    assert not got.lossless
    assert torch.equal(bits(got.q), bits(want.q)) and torch.equal(got.s, want.s)
    assert got.error == want.error
    return got


@needs_c
@pytest.mark.parametrize("block", [(128, 128), (32, 96), (7, 32), (128, 48)])
def test_block_fp8_every_byte_and_block_shape(block):
    # every non-NaN e4m3 byte in every row; K = 384 is a ragged multiple of 96 (and of 48,
    # whose blocks split 1x32 blocks: that shape keeps the torch dequantization)
    g = torch.Generator().manual_seed(block[1])
    b = torch.arange(256, dtype=torch.uint8)
    b = b[(b != 0x7F) & (b != 0xFF)]
    w = torch.cat([b, b[:130]]).repeat(203, 1)
    w = w[:, torch.randperm(384, generator=g)].contiguous().view(torch.float8_e4m3fn)
    shape = (-(-203 // block[0]), -(-384 // block[1]))
    scale = torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    scale = scale * (torch.rand(shape, generator=g) + 0.5)
    got = assert_same_fp8(Q.block_fp8_to_mxfp8, w, scale, block=block, chunk_rows=50)
    bn, bk = block
    src = w.float() * scale.repeat_interleave(bn, 0)[:203].repeat_interleave(bk, 1)[:, :384]
    want_q, want_s = ref_quantize(src)  # independent, from the source values
    np.testing.assert_array_equal(got.s.numpy(), want_s)
    np.testing.assert_array_equal(bits(got.q).numpy(), want_q)


@needs_c
def test_fp8_requantization_extreme_scales_and_overflow():
    w = random_e4m3((64, 256), seed=52)
    for scale in (2.0**-140 * 3, 2.0**100 * 1.3, 3.0e35):  # subnormal products; codes > 246
        assert_same_fp8(Q.per_tensor_fp8_to_mxfp8, w, torch.tensor(scale), chunk_rows=16)
    big = torch.full((64,), 1.0)
    big[40] = 3.0e38  # 448 * 3e38 overflows float32: the torch path's message, both ways
    w[40] = torch.tensor(0.5).to(torch.float8_e4m3fn)  # 1.5e38: finite
    w[40, 7] = torch.tensor(448.0).to(torch.float8_e4m3fn)
    messages = []
    for run in (Q.per_tensor_fp8_to_mxfp8,
                lambda *a, **kw: torch_path(Q.per_tensor_fp8_to_mxfp8, *a, **kw)):
        with pytest.raises(LayoutError) as e:
            run(w, big, name="w", chunk_rows=16)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith("w: non-finite value inf at row 40, column 7")


@needs_c
def test_the_kernel_rejects_mismatched_buffers():
    q = np.empty(64, np.uint8)
    s = np.empty(2, np.uint8)
    src = np.zeros(64, np.int16)
    d = np.empty(64, np.float64)
    assert Q._CQUANT.quantize(src, 0, q, s, d, d.copy()) == 0
    with pytest.raises(ValueError, match="sizes do not fit"):
        Q._CQUANT.quantize(src[:32], 0, q, s)
    with pytest.raises(ValueError, match="sizes do not fit"):
        Q._CQUANT.quantize(src, 2, q, s)  # fp32 needs 4 bytes a value
    with pytest.raises(ValueError, match="source kind"):
        Q._CQUANT.quantize(src, 4, q, s)
    with pytest.raises(ValueError, match="together"):
        Q._CQUANT.quantize(src, 0, q, s, d)
    with pytest.raises(ValueError, match="multipliers"):
        Q._CQUANT.quantize(q, 3, q.copy(), s)
    with pytest.raises(ValueError, match="sizes do not fit"):
        Q._CQUANT.quantize(q, 3, q.copy(), s, None, None, np.ones(1, np.float32))
    with pytest.raises(TypeError, match="writable"):
        Q._CQUANT.quantize(src, 0, bytes(64), s)
