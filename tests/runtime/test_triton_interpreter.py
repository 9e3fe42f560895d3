"""The Triton (Hopper) engine on CPU, through Triton's interpreter, at small shapes.

``TRITON_INTERPRET`` must be set before triton is imported, so a plain ``pytest tests/`` run
executes ``test_interpreter_suite``, which re-runs this file in a fresh ``python -m pytest``
with ``TRITON_INTERPRET=1``; there the other tests run and the spawner skips itself.

Under the interpreter the kernel's dot runs on float32 copies of the same exact dequantized
values (the interpreter's bf16 arithmetic is wrong), so the layout indexing, the gather of P32
rows, the 128x4 scale offsets, split-K and the fused quantization are all checked here; the bf16
tensor-core path is checked by the ``gpu`` tests on an H200.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime import MXFP8Weight, mxfp8_linear, quantize_mxfp8, reference_linear
from mxfp8_convert.runtime.hopper.config import GemmConfig, Kernel
from mxfp8_convert.runtime.hopper.rules import TUNED, DeviceFacts, choose_config
from tests.runtime.interpreter import interp, run_interpreter_suite
from tests.runtime.regroup_oracle import regrouped_by_torch

CPU = DeviceFacts(sms=4, capability=None)  # what probe.device_facts gives under the interpreter


def test_interpreter_suite():
    run_interpreter_suite(str(Path(__file__)), "not suite")


def _case(layout, m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, code = quantize_mxfp8(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).bfloat16()
    return MXFP8Weight.from_canonical(q, code, layout), q, code, x


def _close(out, ref):
    """Same function up to fp32 summation order: at most one bf16 ulp apart, rarely."""
    d = (out.float() - ref.float()).abs()
    assert (d <= ref.float().abs() * 2.0**-7 + 1e-6).all(), float(d.max())
    assert (d > 0).float().mean() < 0.05


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("m,n,k", [(1, 576, 512), (19, 128, 256)])
def test_matches_reference(layout, m, n, k):
    from mxfp8_convert.runtime.hopper.launch import triton_linear

    w, q, code, x = _case(layout, m, n, k)
    bias = torch.randn(n)
    ref = reference_linear(x, q, code, bias)
    configs = [
        GemmConfig(64, 16, 128, split_k=1, fuse_quant=True),
        GemmConfig(64, 32, 128, split_k=2, fuse_quant=False, serial_reduce=True),
        GemmConfig(128, 16, 64, split_k=3, fuse_quant=True),
    ]
    for cfg in configs:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        triton_linear(x, w, bias, out=out, config=cfg)
        assert not out.isnan().any(), cfg
        _close(out, ref)


def _scaled_case(x, q, code):
    """Activations whose 32-blocks have very different scales, a bias, and the reference output."""
    x = x * torch.logspace(-4, 4, x.shape[1]).bfloat16()
    bias = torch.randn(q.shape[0])
    return x, bias, reference_linear(x, q, code, bias)


def _check_configs(configs, x, w, bias, ref):
    """Every config whose K-tile divides K: each output element written, equal to ``ref`` up to
    summation order, twice (the split-K arrival counters must have re-armed)."""
    from mxfp8_convert.runtime.hopper.launch import triton_linear

    m, k = x.shape
    for cfg in configs:
        if k % cfg.block_k:
            continue
        for _ in range(2):
            out = torch.full((m, ref.shape[1]), float("nan"), dtype=torch.bfloat16)
            triton_linear(x, w, bias, out=out, config=cfg)
            assert not out.isnan().any(), cfg
            _close(out, ref)


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("m,n,k", [(1, 576, 512), (5, 224, 256), (16, 160, 1024)])
def test_decode_matches_reference(layout, m, n, k):
    """The decode kernel (FP8 dot per 32-block, scales applied to the accumulator): row gather,
    128x4 scale words (per 32-block, [BN, BK/128] tiles, split 256-wide tiles), N tail, fused and
    separate activation quantization, serial / two-kernel split-K."""
    from mxfp8_convert.runtime.hopper.rules import decode_config

    w, q, code, x = _case(layout, m, n, k, seed=m)
    x, bias, ref = _scaled_case(x, q, code)
    dec = Kernel.DECODE
    configs = [
        GemmConfig(64, 16, 128, dec, split_k=1, fuse_quant=True),
        GemmConfig(32, 16, 256, dec, split_k=3, fuse_quant=False, serial_reduce=True),
        GemmConfig(128, 16, 64, dec, split_k=2, fuse_quant=True, serial_reduce=False),
        GemmConfig(64, 16, 256, dec, split_k=2, fuse_quant=False),
        GemmConfig(128, 16, 256, dec, split_k=3, fuse_quant=True, serial_reduce=False),
        GemmConfig(64, 16, 128, dec, split_k=2, fuse_quant=False),
        decode_config(m, n, k, CPU),
    ]
    _check_configs(configs, x, w, bias, ref)


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("m,n,k", [(1, 576, 512), (3, 224, 1024), (4, 160, 256), (2, 128, 768)])
def test_gemv_matches_reference(layout, m, n, k):
    """The CUDA-core GEMV kernel (M <= 4): row gather, 128x4 scale words, N tail, int32-word and
    generic e4m3 conversion (all 256 byte values occur: subnormals, both signs), fused and
    separate activation quantization, serial / two-kernel split-K, bias."""
    from mxfp8_convert.runtime.hopper.rules import gemv_config

    w, q, code, x = _case(layout, m, n, k, seed=m)
    qb = q.view(torch.uint8)
    qb[:2].view(-1)[:256] = torch.arange(256, dtype=torch.uint8).masked_fill_(  # every e4m3 byte
        (torch.arange(256) & 0x7F) == 0x7F, 0)  # but the NaNs
    w = MXFP8Weight.from_canonical(q, code, layout)
    x, bias, ref = _scaled_case(x, q, code)
    gemv = Kernel.GEMV
    configs = [
        GemmConfig(32, 4, 256, gemv, split_k=1, fuse_quant=True),
        GemmConfig(64, 4, 128, gemv, split_k=3, fuse_quant=False, serial_reduce=True),
        GemmConfig(32, 4, 256, gemv, split_k=2, fuse_quant=False, serial_reduce=False, words=False),
        GemmConfig(16, 4, 512, gemv, split_k=2, fuse_quant=True, serial_reduce=True),
        gemv_config(m, n, k, CPU),
    ]
    _check_configs(configs, x, w, bias, ref)


@interp
def test_gemv_unaligned_weight_takes_the_generic_cast():
    """A weight view that is not 4-byte aligned cannot be read as int32 words: same result."""
    from mxfp8_convert.runtime.hopper.launch import triton_linear
    from mxfp8_convert.runtime.hopper.rules import gemv_config

    w, q, code, x = _case("cutlass", 1, 128, 256)
    buf = torch.empty(128 * 256 + 1, dtype=torch.uint8)
    buf[1:] = w.data.view(torch.uint8).reshape(-1)
    shifted = MXFP8Weight(buf[1:].view(torch.float8_e4m3fn).view(128, 256), w.scale, "cutlass")
    assert shifted.data.data_ptr() % 4
    ref = reference_linear(x, q, code)
    for fuse in (True, False):
        out = triton_linear(x, shifted, config=gemv_config(1, 128, 256, CPU, fuse_quant=fuse))
        _close(out, ref)


def test_gemv_is_the_rule_for_one_or_two_rows():
    """The dispatch measured on the H200: M <= 2 -> GEMV (512-wide K-tiles for small weights,
    pre-permuted activations for M = 2 and for large weights), M >= 3 -> never GEMV."""
    cpu = CPU
    small, mid, large = (1024, 4096), (4096, 4096), (18432, 7168)
    assert large[0] * large[1] >= TUNED.gemv_large_weight
    assert choose_config(1, *small, cpu).block_k == 512 and choose_config(1, *small, cpu).fuse_quant
    one, two = choose_config(1, *mid, cpu), choose_config(2, *mid, cpu)
    assert one.kind is Kernel.GEMV and one.fuse_quant and one.block_m == 1
    assert two.kind is Kernel.GEMV and not two.fuse_quant and two.block_m == 2
    # many long rows: 16-row programs
    assert one.block_n == 16 and choose_config(1, 2560, 4096, cpu).block_n == 32
    big = choose_config(1, *large, cpu)
    assert big.kind is Kernel.GEMV and not big.fuse_quant
    for m in (3, 4, 16, 2048):
        assert choose_config(m, *mid, cpu).kind is not Kernel.GEMV
    assert choose_config(1, 576, 160, cpu).kind is Kernel.TILE  # K % 128 != 0: the tile kernel


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("n,k", [(576, 512), (224, 256), (160, 1024)])
def test_dequantize_weight_matches_reference(layout, n, k):
    """The cuBLAS path's weight dequantization from the laid-out bytes: every e4m3 byte value,
    scales far apart, every row and sub-ranges that cut P32 groups and 128-row scale tiles."""
    from mxfp8_convert.runtime.hopper.launch import dequantize_weight
    from mxfp8_convert.runtime.reference import dequantize_mxfp8

    w, q, code, _ = _case(layout, 1, n, k, seed=n)
    q.view(torch.uint8)[:2].view(-1)[:256] = torch.arange(256, dtype=torch.uint8).masked_fill_(
        (torch.arange(256) & 0x7F) == 0x7F, 0)  # every e4m3 byte but the NaNs
    code[:, ::2] -= 40
    code[:, 1::3] += 60
    w = MXFP8Weight.from_canonical(q, code, layout)
    ref = dequantize_mxfp8(q, code)
    assert torch.equal(dequantize_weight(w), ref)
    for start, stop in ((37, 101), (0, 31), (n - 33, n), (129, 129)):
        assert torch.equal(dequantize_weight(w, start, stop), ref[start:stop])
    out = torch.full((2 * n, k), float("nan"))[::2]  # a strided row view
    dequantize_weight(w, out=out)
    assert torch.equal(out, ref)
    with pytest.raises(LayoutError, match=r"row range \[5, 3\)"):
        dequantize_weight(w, 5, 3)


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("m,n,k", [(19, 576, 512), (3, 160, 1024)])
def test_cublas_path_matches_reference(layout, m, n, k):
    """Large M: activations quantized once, the weight dequantized chunk by chunk (one chunk,
    128-row chunks, chunks that are not a multiple of 32 rows), products written into column
    slices of the output, bias."""
    from mxfp8_convert.runtime.hopper.rules import cublas_config

    w, q, code, x = _case(layout, m, n, k, seed=m)
    x, bias, ref = _scaled_case(x, q, code)
    configs = [cublas_config(m, n, k, chunk_n=c) for c in (0, 128, 100)]
    _check_configs(configs, x, w, bias, ref)


def _check_regrouped(got_q, got_s, q, code):
    """The bytes and scales of the independent regroup, and the values of the 32-block operands
    exactly wherever the shifted value is a normal e4m3 number (else within 2^-10 of the
    scale)."""
    want_q, want_s = regrouped_by_torch(q, code)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=0, equal_nan=True)
    per32 = q.double() * torch.exp2(code.double() - 127).repeat_interleave(32, dim=1)
    scale = got_s.double().repeat_interleave(128, dim=1)
    value = got_q.double() * scale
    ok = torch.isfinite(scale)
    normal = ok & (per32.abs() >= 2.0**-6 * scale)  # q * 2^(c - cmax) a normal e4m3 number
    assert torch.equal(value[normal], per32[normal])
    assert ((value - per32).abs()[ok] <= 2.0**-10 * scale[ok]).all()
    assert (~normal & ok & (per32 != value)).any()  # the case exercises the rounded elements


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("n,k", [(576, 512), (160, 1024)])
def test_regroup_weight_matches_torch(layout, n, k):
    """The block-128 path's weight regroup from the laid-out bytes: logical row order, every e4m3
    byte value, codes up to 40 apart within a 128-block, a NaN code (its block's scale NaN)."""
    from mxfp8_convert.runtime.hopper.launch import regroup_weight

    w, q, code, _ = _case(layout, 1, n, k, seed=n)
    q.view(torch.uint8)[:2].view(-1)[:256] = torch.arange(256, dtype=torch.uint8).masked_fill_(
        (torch.arange(256) & 0x7F) == 0x7F, 0)  # every e4m3 byte but the NaNs
    code[:, ::2] -= 20
    code[:, 1::3] += 20
    code[7, 5] = 255
    got_q, got_s = regroup_weight(MXFP8Weight.from_canonical(q, code, layout))
    assert got_s.shape == (k // 128, n) and got_s.is_contiguous()
    assert got_s[1, 7].isnan() and not got_s[0, 7].isnan()
    _check_regrouped(got_q, got_s.t(), q, code)


@interp
@pytest.mark.parametrize("m,k", [(37, 512), (3, 384)])
def test_regroup_activations_matches_torch(m, k):
    """The block-128 path's activations: FlashInfer's per-32 quantization (the reference
    quantizer's bytes and codes), then the regroup; scales as the [M, K/128] operand with strides
    (1, M); a tail in M."""
    from mxfp8_convert.runtime.hopper.launch import regroup_activations

    g = torch.Generator().manual_seed(m)
    apart = torch.exp2(-12.0 * (torch.arange(k) // 32 % 2))  # 32-blocks 2^12 apart
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k) * apart).bfloat16()
    x[1, :128] = 0.0
    got_q, got_s = regroup_activations(x)
    assert got_s.shape == (m, k // 128) and got_s.stride() == (1, m)
    q, code = quantize_mxfp8(x)
    _check_regrouped(got_q, got_s, q, code)
    with pytest.raises(LayoutError, match="K % 128"):
        regroup_activations(x[:, :k - 32].contiguous())


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("m,n,k", [(19, 576, 512), (3, 160, 1024)])
def test_block128_path_matches_reference(layout, m, n, k):
    """The block-128 path's plumbing (the product of the regrouped operands taken by torch under
    the interpreter): one chunk, 128-row chunks, chunks that cut P32 groups, column slices of the
    output, bias; activations whose 32-blocks are far apart. Chunks that are no multiple of 16
    rows (what cuBLAS takes) are refused."""
    w, q, code, x = _case(layout, m, n, k, seed=m)
    x, bias, ref = _scaled_case(x, q, code)
    configs = [GemmConfig(64, 0, 256, Kernel.BLOCK128, fuse_quant=False, chunk_n=c)
               for c in (0, 128, 112)]
    _check_configs(configs, x, w, bias, ref)
    from mxfp8_convert.runtime.hopper.launch import triton_linear

    with pytest.raises(LayoutError, match="multiples of 16"):
        triton_linear(x, w, config=dataclasses.replace(configs[0], chunk_n=100))


@interp
def test_default_config_is_chosen_once_per_shape(monkeypatch):
    """Without ``config``, a call takes the rule's choice from a cache keyed by shape, device and
    ``MXFP8_PDL`` (``default_config``): the rule runs once for repeated calls, again for another
    shape or another ``MXFP8_PDL``, and the outputs are those of the explicit config."""
    import mxfp8_convert.runtime.hopper.launch as tri

    w, q, code, x = _case("trtllm", 2, 128, 256)
    calls = []
    real = tri.choose_config
    monkeypatch.setattr(tri, "choose_config",
                        lambda *a, **kw: calls.append(a[:3]) or real(*a, **kw))
    monkeypatch.delenv("MXFP8_PDL", raising=False)
    tri.default_config.cache_clear()
    outs = [tri.triton_linear(x, w) for _ in range(3)]
    assert calls == [(2, 128, 256)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], tri.triton_linear(x, w, config=real(2, 128, 256, CPU)))
    tri.triton_linear(x[:1], w)  # another shape
    monkeypatch.setenv("MXFP8_PDL", "0")
    tri.triton_linear(x, w)
    assert calls == [(2, 128, 256), (1, 128, 256), (2, 128, 256)]


def test_cublas_is_the_rule_from_min_m():
    """The dispatch measured on the H200: M >= cublas_min_m -> the cuBLAS path, with chunks of
    whole 128-row groups that fit the workspace; below, the tile kernel."""
    cpu, min_m, workspace = CPU, TUNED.cublas_min_m, TUNED.dequant_workspace
    assert choose_config(min_m - 1, 4096, 4096, cpu).kind is Kernel.TILE
    for m in (min_m, 8192):
        cfg = choose_config(m, 4096, 4096, cpu)
        assert cfg.kind is Kernel.CUBLAS and cfg.chunk_n == 4096  # fits: one chunk
    big = choose_config(8192, 18432, 7168, cpu)
    assert big.chunk_n % 128 == 0 and big.chunk_n * 7168 <= workspace < (big.chunk_n + 128) * 7168


@interp
def test_engine_entry_point():
    w, q, code, x = _case("trtllm", 3, 256, 256)
    out = mxfp8_linear(x.reshape(1, 3, 256), w, engine="triton")
    _close(out.reshape(3, 256), reference_linear(x, q, code))


@interp
def test_activation_quantization_bit_exact():
    from mxfp8_convert.runtime.hopper.launch import quantize_activations

    x = torch.randn(9, 1024) * torch.logspace(-30, 30, 1024)
    x[2, 64:96] = 0.0
    x[3, :32] = -0.0
    x[4, 96:128] = torch.tensor([17.0, 19.0, 21.0, 448.0] * 8)  # ties to even
    for dtype in (torch.float32, torch.bfloat16):
        xt = x.to(dtype)
        got = quantize_activations(xt, codes=True)
        q, code = quantize_mxfp8(xt)
        assert torch.equal(got["code"], code)
        assert torch.equal(got["q"].view(torch.uint8), q.view(torch.uint8))
        scales = torch.exp2(code.float() - 127)[..., None]
        assert torch.equal(got["deq"], q.float().reshape(9, 32, 32).mul(scales).reshape(9, 1024))


@interp
def test_activation_quantization_keeps_nan():
    """A NaN activation quantizes to an e4m3 NaN (torch's float8 cast of NaN, sign kept), as the
    GPU's conversion gives; it sets no block scale, so the rest of its block is quantized as if it
    were 0."""
    from mxfp8_convert.runtime.hopper.launch import quantize_activations

    x = torch.randn(3, 256)
    x[1, 40], x[2, 200] = float("nan"), -float("nan")
    got = quantize_activations(x, codes=True)
    q, code = quantize_mxfp8(torch.nan_to_num(x, nan=0.0))
    nan = torch.tensor([float("nan"), -float("nan")])
    nan_bytes = nan.to(torch.float8_e4m3fn).view(torch.uint8)
    gq = got["q"].view(torch.uint8)
    assert gq[1, 40] == nan_bytes[0] and gq[2, 200] == nan_bytes[1]
    finite = ~x.isnan()
    assert torch.equal(gq[finite], q.view(torch.uint8)[finite])
    assert torch.equal(got["code"], code)
    assert got["deq"].isnan().sum() == 2 and got["deq"][1, 40].isnan()


_NAN_PATHS = {  # (M, N, K) = (3, 128, 512)
    "tile-fused": GemmConfig(64, 16, 128, split_k=2, fuse_quant=True),
    "tile-separate": GemmConfig(64, 16, 128, split_k=2, fuse_quant=False),
    "decode-fused": GemmConfig(64, 16, 128, Kernel.DECODE, split_k=2, fuse_quant=True),
    "gemv-fused": GemmConfig(32, 4, 256, Kernel.GEMV, split_k=2, fuse_quant=True),
    "gemv-separate": GemmConfig(32, 4, 256, Kernel.GEMV, split_k=2, fuse_quant=False),
    "cublas": GemmConfig(64, 0, 256, Kernel.CUBLAS, fuse_quant=False, chunk_n=128),
    "cublas-chunks": GemmConfig(64, 0, 256, Kernel.CUBLAS, fuse_quant=False, chunk_n=64),
    "block128": GemmConfig(64, 0, 256, Kernel.BLOCK128, fuse_quant=False, chunk_n=0),
    "block128-chunks": GemmConfig(64, 0, 256, Kernel.BLOCK128, fuse_quant=False, chunk_n=64),
}


@interp
@pytest.mark.parametrize("path", sorted(_NAN_PATHS))
def test_nan_activation_makes_its_row_nan(path):
    """A NaN activation makes its whole output row NaN on every path, as on the CPU reference
    (and bf16 ``F.linear``), and leaves the other rows as they were: no path hides it as +-448.
    (The decode kernel fed separately quantized activations reads them as float8, which the
    interpreter converts with NaN as 480: that case is the GPU test's.)"""
    from mxfp8_convert.runtime.hopper.launch import triton_linear

    w, q, code, x = _case("trtllm", 3, 128, 512, seed=5)
    x[1, 40] = float("nan")
    ref = reference_linear(x, q, code)
    assert ref[1].isnan().all() and not ref[[0, 2]].isnan().any()
    out = torch.zeros(3, 128, dtype=torch.bfloat16)
    triton_linear(x, w, out=out, config=_NAN_PATHS[path])
    assert out[1].isnan().all()
    _close(out[[0, 2]], ref[[0, 2]])


@interp
@pytest.mark.parametrize("has_bias,chunk", [(False, 4), (True, 2), (True, 8)])
def test_reduction_maps_physical_rows_of_a_trtllm_weight(has_bias, chunk):
    """The split-K reduction kernel fed partials in the trtllm weight's physical row order (``p32``,
    as the wgmma kernel stores them with ``phys_partials``) writes each sum to its logical row:
    physical row p of a 32-row group holds logical row 4 * (p % 8) + p // 8. The same sums, bit
    for bit, as partials stored in logical order; bias by logical row; 3 rows x 96 columns, 5
    splits (the first, then 2, 4 or 8 per round trip: two chunks, one, one with masked loads), over
    two programs."""
    import dataclasses

    import mxfp8_convert.runtime.hopper.launch as tri

    m, n, splits = 3, 96, 5
    logical = torch.randn(splits, m, n)
    p = torch.arange(n)
    lrow = p - p % 32 + 4 * (p % 8) + p % 32 // 8
    assert sorted(lrow.tolist()) == list(range(n))
    physical = logical[:, :, lrow]  # physical row p holds logical row lrow[p]
    bias = torch.randn(n)
    cfg = dataclasses.replace(tri.GemmConfig(64, 16, 128, split_k=splits), red_chunk=chunk)
    outs = []
    for ws, p32 in ((logical, False), (physical, True)):
        out = torch.full((m, n), float("nan"))
        tri._reduce_splits(ws, bias if has_bias else out, out, cfg, has_bias, p32=p32, block=128)
        outs.append(out)
    expected = logical[0].clone()
    for s in range(1, splits):
        expected += logical[s]
    if has_bias:
        expected += bias
    assert torch.equal(outs[0], expected) and torch.equal(outs[1], expected)
