"""The Triton engine on a real GPU (Hopper): model shapes, both layouts, M from 1 to 8192.

Oracle: float64 product of the *same quantized operands* (activations quantized with the torch
reference recipe, weight dequantized from the canonical bytes the layout was made from). The
kernel's only freedom is fp32 summation order and the final bf16 rounding, so
||out - ref|| / ||ref|| sits near 2e-3 (bf16 half-ulp, 2^-9, times ~1/sqrt(3)); we require <= 1e-2.
Outputs are poisoned with NaN first so an unwritten element fails the test.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from mxfp8_convert.runtime import MXFP8Weight, mxfp8_linear
from mxfp8_convert.runtime.hopper.shapes import MODEL_SHAPES
from mxfp8_convert.runtime.reference import dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8

pytestmark = pytest.mark.gpu
LAYOUTS = ("trtllm", "cutlass")
# MXFP8_GPU_TEST_MAX_M=16 keeps the decode sizes only (a short device run)
MS = tuple(m for m in (1, 2, 4, 16, 32, 48, 80, 100, 300, 2048, 8192)
           if m <= int(os.environ.get("MXFP8_GPU_TEST_MAX_M", "1000000")))


def _triton():
    """The Hopper package (``triton_linear``, the config builders, ``device_facts``, ...)."""
    pytest.importorskip("triton")
    import mxfp8_convert.runtime.hopper as tri

    return tri


def _gluon():
    """The Gluon kernel's module, or None where Gluon is missing."""
    from mxfp8_convert.runtime.hopper.probe import gluon

    return gluon()


def _facts():
    from mxfp8_convert.runtime.hopper.probe import device_facts

    return device_facts(torch.device("cuda"))


def random_weight(
    n: int, k: int, layout: str, seed: int
) -> tuple[MXFP8Weight, torch.Tensor, torch.Tensor]:
    """A random laid-out weight on the GPU and the canonical (q, code) it was laid out from."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (
        (torch.randn(n, k, device="cuda", generator=g) * 96)
        .clamp(-448, 448)
        .to(torch.float8_e4m3fn)
    )
    code = torch.randint(116, 126, (n, k // 32), device="cuda", generator=g).to(torch.uint8)
    return MXFP8Weight.from_canonical(q, code, layout), q, code


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _check_twice(tri, x, w, bias, ref, cfg) -> torch.Tensor:
    """``cfg`` writes every output element within 1e-2 of ``ref``, twice (split-K arrival counters
    and reused workspaces must re-arm), the same bits both times; returns the output."""
    outs = []
    for _ in range(2):
        out = torch.full(
            (x.shape[0], ref.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16
        )
        tri.triton_linear(x, w, bias, out=out, config=cfg)
        assert not out.isnan().any(), cfg
        assert rel_err(out, ref) <= 1e-2, cfg
        outs.append(out)
    assert torch.equal(*outs), cfg
    return outs[0]


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,n,k", MODEL_SHAPES, ids=[s[0] for s in MODEL_SHAPES])
def test_model_shapes(name, n, k, layout, m):
    tri = _triton()
    w, q, code = random_weight(n, k, layout, seed=n * 7 + k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    tri.triton_linear(x, w, out=out)
    assert not out.isnan().any(), f"{name}: {int(out.isnan().sum())} output elements never written"
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    err = rel_err(out, ref)
    assert err <= 1e-2, f"{name} {layout} M={m}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activation_quantization_bit_exact(dtype):
    tri = _triton()
    top = 4 if dtype == torch.float16 else 6  # stay finite in fp16
    x = torch.randn(300, 4096, device="cuda") * torch.logspace(-6, top, 4096, device="cuda")
    x[5, 64:96] = 0  # an all-zero block: code 0, bytes 0
    x[7, :32] = -0.0
    x = x.to(dtype)
    got = tri.quantize_activations(x, codes=True)
    q, code = quantize_mxfp8(x)
    assert torch.equal(got["code"], code)
    assert torch.equal(got["q"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["deq"].float(), dequantize_mxfp8(q, code))


@pytest.mark.parametrize("layout", [*LAYOUTS, "canonical"])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("block_n", [64, 128])
def test_configs_agree(layout, fuse, block_n):
    """The tile kernel's variants: fused/separate quantization, 64- and 128-row weight tiles,
    split-K with the serial (last-CTA) or the two-kernel reduction, repeated so the arrival
    counters must re-arm."""
    tri = _triton()
    n, k = 576, 7168
    w, q, code = random_weight(n, k, layout, seed=3)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(37, k, device="cuda", dtype=torch.bfloat16)
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t() + bias.double()
    for split, serial in ((1, True), (3, True), (3, False), (7, True)):
        cfg = tri.GemmConfig(block_n, 64, 128, split_k=split, fuse_quant=fuse,
                             num_warps=block_n // 16, num_stages=3, serial_reduce=serial)
        out = torch.full((37, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        tri.triton_linear(x, w, bias, out=out, config=cfg)
        assert not out.isnan().any()
        assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("layout", [*LAYOUTS, "canonical"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_decode_configs_agree(layout, m):
    """The decode kernel's variants: fused / separate activation quantization, 32/64/128-row
    tiles (mma.sync / wgmma), 128- and 256-wide K-tiles (both scale-load schemes), N tail
    (576 = 4.5 x 128), serial and two-kernel split-K, bias, each run twice so the arrival
    counters must re-arm."""
    tri = _triton()
    n, k = 576, 7168
    w, q, code = random_weight(n, k, layout, seed=5 + m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t() + bias.double()
    dev = torch.device("cuda")
    facts = tri.device_facts(dev)
    variants = [  # (block_n, block_k, warps, fused quantization, waves, serial): each feature once
        (64, 256, 4, False, 2, True),
        (64, 256, 4, True, 3, True),
        (128, 256, 4, False, 3, True),
        (64, 256, 4, False, 0.01, True),
        (64, 256, 4, False, 3, False),
        (128, 128, 8, True, 4, False),
        (32, 128, 4, True, 4, True),
        (64, 128, 4, False, 4, True),
    ]
    for bn, bk, warps, fuse, waves, serial in variants:
        cfg = tri.decode_config(
            m,
            n,
            k,
            facts,
            block_n=bn,
            block_k=bk,
            num_warps=warps,
            fuse_quant=fuse,
            waves=waves,
            serial_reduce=serial,
        )
        _check_twice(tri, x, w, bias, ref, cfg)


@pytest.mark.parametrize("layout", [*LAYOUTS, "canonical"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_configs_agree(layout, m):
    """The CUDA-core GEMV kernel's variants: int32-word and generic fp8 conversion, fused /
    separate activation quantization, 32/64-row tiles, 256/512-wide K-tiles, N tail (576),
    serial and two-kernel split-K, bias; each run twice so the arrival counters must re-arm."""
    tri = _triton()
    n, k = 576, 7168
    w, q, code = random_weight(n, k, layout, seed=11 + m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = (
        torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        * torch.logspace(-3, 3, k, device="cuda").bfloat16()
    )
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t() + bias.double()
    dev = torch.device("cuda")
    facts = tri.device_facts(dev)
    variants = [  # (block_n, block_k, warps, fused quantization, waves, serial, words)
        (32, 256, 4, True, 4, True, True),
        (32, 256, 4, False, 4, True, True),
        (64, 256, 4, True, 8, True, True),
        (32, 512, 4, True, 0.01, True, True),
        (32, 256, 4, True, 4, False, True),
        (32, 256, 4, True, 4, True, False),
    ]
    for bn, bk, warps, fuse, waves, serial, words in variants:
        cfg = tri.gemv_config(
            m,
            n,
            k,
            facts,
            block_n=bn,
            block_k=bk,
            num_warps=warps,
            fuse_quant=fuse,
            waves=waves,
            serial_reduce=serial,
            words=words,
        )
        _check_twice(tri, x, w, bias, ref, cfg)


@pytest.mark.parametrize("layout,n", [("trtllm", 576), ("trtllm", 544), ("cutlass", 544)])
@pytest.mark.parametrize("m", [1, 3, 5, 9, 16, 24, 32])
def test_wgmma_configs_agree(layout, n, m):
    """The Gluon wgmma decode kernel: activations quantized inside it or by a separate kernel,
    scale words loaded one to three K-tiles ahead (with 0.01 waves a single program runs all of
    K), 8- and 16-column MMAs (M <= 8 / <= 16), TMA ring depths, split-K with the serial (last
    program) and the two-kernel reduction (partials in logical or physical row order), N tail (544 =
    8.5 x 64: TMA zero-fills rows past N),
    physical-to-logical row mapping on the store (trtllm), bias, programmatic dependent launch
    (both kernels, one after the other; the weight's first tile loaded before the wait, the second
    kernel letting the next launch early), 4, 8 or 16 partials summed per round trip; each config
    twice (the arrival counters must re-arm). The activations span 2^-10..2^10 across K, so every
    32-block has its
    own code. The kernel's own quantization (of M rows rounded up to 1, 2, 4, 8 or 16; the other
    MMA columns read zeros) gives the bits of the quantization kernel's, whether the bf16
    activations are loaded as int32 words of two (M >= 2) or element by element: the three paths'
    outputs are equal, bit for bit, config by config."""
    tri = _triton()
    if _gluon() is None:
        pytest.skip("Triton's Gluon is not installed")
    k = 7168
    w, q, code = random_weight(n, k, layout, seed=23 + m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = (
        torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        * torch.logspace(-3, 3, k, device="cuda").bfloat16()
    )
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t() + bias.double()
    dev = torch.device("cuda")
    facts = tri.device_facts(dev)
    configs = (
        (3, 2, True, 1, False),
        (2, 0.01, True, 2, False),
        (6, 4, True, 3, False),
        (3, 2, False, 2, False),
        (2, 3, True, 2, True),
        (2, 3, False, 2, True),
    )  # ..., programmatic dependent launch
    for stages, waves, serial, ahead, pdl in configs:
        cfgs = [
            tri.wgmma_config(
                m,
                n,
                k,
                facts,
                stages=stages,
                waves=waves,
                serial_reduce=serial,
                fuse_quant=fuse,
                sw_ahead=ahead,
                pdl=pdl,
            )
            for fuse in (True, False)
        ]
        cfgs.append(dataclasses.replace(cfgs[0], x_words=False))  # bf16 loaded element by element
        if pdl:  # the weight's first tile loaded before the wait; a second kernel's early release;
            # the activations' lines asked of L2 before the wait (words, or elements)
            cfgs.append(dataclasses.replace(cfgs[0], prefetch=True, red_release=not serial))
            cfgs += [
                dataclasses.replace(cfgs[-1], x_prefetch=True, x_words=words)
                for words in (True, False)
            ]
        if (
            not serial
        ):  # partials in the trtllm weight's physical row order, mapped by the second kernel
            cfgs += [dataclasses.replace(c, phys_partials=True) for c in (cfgs[0], cfgs[-1])]
        outs = [_check_twice(tri, x, w, bias, ref, cfg) for cfg in cfgs]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), (stages, waves, serial, ahead, pdl)
    # the splits as one cluster, summed through DSMEM: the bits of the serial reduction where the
    # K-tiles split the same way (56 = 8 x 7), within 1e-2 of the reference for 16 uneven splits
    serial8 = _check_twice(
        tri,
        x,
        w,
        bias,
        ref,
        tri.wgmma_config(m, n, k, facts, waves=2, fuse_quant=True, max_split=8),
    )
    cl8 = tri.wgmma_config(
        m, n, k, facts, waves=2, fuse_quant=True, max_split=8, cluster=True, pdl=True
    )
    assert cl8.cluster and cl8.split_k == 8
    assert torch.equal(_check_twice(tri, x, w, bias, ref, cl8), serial8)
    if tri.pdl_enabled(dev):  # the weight and the activations' lines prefetched before the wait
        assert torch.equal(
            _check_twice(
                tri, x, w, bias, ref, dataclasses.replace(cl8, prefetch=True, x_prefetch=True)
            ),
            serial8,
        )
    # activations quantized by the kernel before (read by TMA): the same bits
    assert torch.equal(
        _check_twice(tri, x, w, bias, ref, dataclasses.replace(cl8, fuse_quant=False)), serial8
    )
    cl16 = tri.wgmma_config(m, n, k, facts, waves=2, fuse_quant=True, max_split=16, cluster=True)
    assert cl16.cluster and cl16.split_k == 16
    _check_twice(tri, x, w, bias, ref, cl16)
    if m >= 3:  # 128-row programs (two warpgroups sharing each activation tile): each row's bits as
        # in a 64-row program, for every reduction (N = 544 and 576: TMA zero-fills a partial tile)
        for cfg in (cl8, dataclasses.replace(cl8, cluster=False, pdl=False)):
            wide = dataclasses.replace(cfg, block_n=128, num_warps=8)
            assert torch.equal(_check_twice(tri, x, w, bias, ref, wide), serial8), wide
        for serial in (True, False):
            cfg = tri.wgmma_config(
                m, n, k, facts, waves=1, fuse_quant=True, serial_reduce=serial, block_n=128
            )
            assert cfg.block_n == 128 and cfg.split_k > 1
            assert torch.equal(
                _check_twice(tri, x, w, bias, ref, cfg),
                _check_twice(
                    tri, x, w, bias, ref, dataclasses.replace(cfg, block_n=64, num_warps=4)
                ),
            )
            if not serial and tri.pdl_enabled(
                dev
            ):  # with the rule's options for a second kernel (M = 9..16)
                opts = dataclasses.replace(
                    cfg, pdl=True, prefetch=True, red_release=True, phys_partials=True
                )
                assert torch.equal(_check_twice(tri, x, w, bias, ref, opts), _check_twice(
                    tri, x, w, bias, ref, dataclasses.replace(opts, block_n=64, num_warps=4)))
        unsplit = tri.wgmma_config(m, n, k, facts, waves=0.01, fuse_quant=True, block_n=128)
        assert torch.equal(
            _check_twice(tri, x, w, bias, ref, unsplit),
            _check_twice(
                tri, x, w, bias, ref, dataclasses.replace(unsplit, block_n=64, num_warps=4)
            ),
        )
    # partials loaded 4, 8 or 16 (the default here: 28 splits) per round trip: the same sums
    chunked = [
        _check_twice(
            tri,
            x,
            w,
            bias,
            ref,
            tri.wgmma_config(m, n, k, facts, waves=2, fuse_quant=True, red_chunk=chunk),
        )
        for chunk in (0, 4, 8)
    ]
    assert torch.equal(chunked[0], chunked[1]) and torch.equal(chunked[0], chunked[2])


def test_wgmma_cluster_launch_and_its_fallback():
    """A cluster config's kernel is launched as clusters of its split (Triton compiles it for one
    CTA; ``wgmma.py`` makes its launcher ask for the clusters), and the same kernel launched
    without clusters computes the whole K in each program: the right result either way, and in
    fp32 (written by the kernel itself) not the same bits, which shows the clusters were real."""
    _triton()
    gluon = _gluon()
    if gluon is None:
        pytest.skip("Triton's Gluon is not installed")
    m, n, k = 4, 1024, 4096
    w, q, code = random_weight(n, k, "cutlass", seed=43)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()

    def run():
        out = torch.full((m, n), float("nan"), device="cuda")
        gluon.wgmma_decode(x, w, None, out, None, None, split_k=8, sw_ahead=2, cluster=True)
        assert rel_err(out, ref) <= 1e-2
        return out

    clustered = run()
    assert torch.equal(run(), clustered)
    index = gluon._wgmma_decode_kernel.arg_names.index("CLUSTER")
    compiled = [
        kern
        for cache in gluon._wgmma_decode_kernel.device_caches.values()
        for kern in cache[0].values()
        if kern.src.constants.get((index,)) == 8
    ]
    assert compiled and all(kern.packed_metadata[1] == 8 for kern in compiled)
    for kern in compiled:  # as if the launcher were not told
        kern.packed_metadata = (kern.packed_metadata[0], 1, *kern.packed_metadata[2:])
    try:
        alone = run()
    finally:
        for kern in compiled:
            gluon._launch_as_clusters(kern, 8)
    # one program summing all 32 K-tiles, not 8 partials of 4: other fp32 sums
    assert not torch.equal(alone, clustered)


@pytest.mark.parametrize("m", [1, 8, 16])
def test_wgmma_pdl_chain_reads_each_previous_output(m):
    """Programmatic dependent launch: in a chain of GEMMs, each feeding the next (directly, or
    through a torch kernel between them), queued without a synchronization, every kernel reads
    the finished output of the one before: the chain's outputs equal, bit for bit, those of the
    same chain synchronized after each kernel; also with the next input's lines asked of L2
    before the wait (``x_prefetch``), while the kernel before is still writing them."""
    tri = _triton()
    dev = torch.device("cuda")
    facts = tri.device_facts(dev)
    if _gluon() is None or not tri.pdl_enabled(dev):
        pytest.skip("needs Triton's Gluon and programmatic dependent launch")
    dims = (7168, 1536, 4096, 1024, 2048)  # K of each GEMM, then its N = the next one's K
    ws = [
        random_weight(n, k, "trtllm", seed=41 + i)[0]
        for i, (k, n) in enumerate(zip(dims, dims[1:], strict=False))
    ]
    rule = [tri.choose_config(m, w.shape[0], w.shape[1], facts) for w in ws]
    assert all(c.kind is tri.Kernel.WGMMA and c.pdl and c.split_k > 1 for c in rule)
    xs = [torch.randn(m, dims[0], device="cuda", dtype=torch.bfloat16) for _ in range(6)]

    def chain(x, sync, between, cfgs):
        for w, cfg in zip(ws, cfgs, strict=True):
            x = tri.triton_linear(x, w, config=cfg)
            if between:  # a torch kernel (no PDL) writes the next GEMM's input
                x = x / x.abs().amax()
            if sync:
                torch.cuda.synchronize()
        return x

    for xpf in (False, True):
        cfgs = [dataclasses.replace(c, prefetch=True, x_prefetch=xpf) for c in rule]
        for between in (False, True):
            expected = [chain(x, True, between, cfgs) for x in xs]
            got = [chain(x, False, between, cfgs) for x in xs]
            torch.cuda.synchronize()
            for e, g in zip(expected, got, strict=True):
                assert e.isfinite().all() and torch.equal(e, g), (between, xpf)


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_wgmma_activation_dtypes(dtype, m):
    """fp16/fp32 activations quantized inside the wgmma kernel (``_launch_wgmma`` hands them to
    it as it does bf16 ones): within 1e-2 of the reference and, bit for bit, the output of the
    same config fed by the quantization kernel; also in programs of 128 rows (from M = 3), whose
    eight warps load the elements as the 64-row program's four do."""
    tri = _triton()
    if _gluon() is None:
        pytest.skip("Triton's Gluon is not installed")
    n, k = 576, 7168
    w, q, code = random_weight(n, k, "trtllm", seed=31)
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 3, k, device="cuda")).to(dtype)
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    dev = torch.device("cuda")
    facts = tri.device_facts(dev)
    fused = _check_twice(
        tri, x, w, None, ref, tri.wgmma_config(m, n, k, facts, fuse_quant=True, sw_ahead=2)
    )
    before = _check_twice(
        tri, x, w, None, ref, tri.wgmma_config(m, n, k, facts, fuse_quant=False, sw_ahead=2)
    )
    assert torch.equal(fused, before)
    if m >= 3:
        wide = tri.wgmma_config(
            m, n, k, facts, fuse_quant=True, sw_ahead=2, block_n=128, max_split=8
        )
        narrow = dataclasses.replace(wide, block_n=64, num_warps=4)
        assert torch.equal(
            _check_twice(tri, x, w, None, ref, wide), _check_twice(tri, x, w, None, ref, narrow)
        )


@pytest.mark.parametrize("m", [3, 16])
def test_wgmma_unaligned_bf16_rows(m):
    """bf16 activations whose rows are not 4-byte aligned (an odd element offset, or an odd row
    stride) cannot be read as int32 words: the kernel loads them element by element, with the
    bits of the aligned words."""
    tri = _triton()
    if _gluon() is None:
        pytest.skip("Triton's Gluon is not installed")
    n, k = 576, 2048
    w, q, code = random_weight(n, k, "trtllm", seed=37)
    x = (
        torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        * torch.logspace(-3, 3, k, device="cuda").bfloat16()
    )
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    cfg = tri.wgmma_config(m, n, k, _facts(), fuse_quant=True, sw_ahead=2)
    aligned = _check_twice(tri, x, w, None, ref, cfg)
    for pad, start in ((2, 1), (1, 0)):  # odd offset (even stride); odd stride
        buf = torch.zeros(m, k + pad, device="cuda", dtype=torch.bfloat16)
        buf[:, start:start + k] = x
        xv = buf[:, start:start + k]
        assert xv.data_ptr() % 4 or xv.stride(0) % 2
        assert torch.equal(_check_twice(tri, xv, w, None, ref, cfg), aligned)
        # in programs of 128 rows (two warpgroups) too
        wide = dataclasses.replace(cfg, block_n=128, num_warps=8)
        assert torch.equal(
            _check_twice(tri, xv, w, None, ref, wide), _check_twice(tri, x, w, None, ref, wide)
        )


@pytest.mark.parametrize("layout,n", [("trtllm", 576), ("trtllm", 544), ("cutlass", 544)])
@pytest.mark.parametrize("m", [17, 64, 100, 257])
def test_dqmma_configs_agree(layout, n, m):
    """The dequantizing wgmma kernel (issue 26): 64- and 128-row programs (one or two
    warpgroups), 32..256 tokens a program (one or several M tiles; rows past M are TMA's zero
    fill), TMA ring depths 2..4, K unsplit or split (fp32 partials in the weight's physical row
    order, summed by the reduction kernel, which adds the bias), N tails (544 = 8.5 x 64), the
    physical-to-logical row mapping (trtllm); the kernel as one warpgroup chain and
    warp-specialized (a TMA producer warp, one or two consumer warpgroups on mbarrier rings);
    with and without the chain of programmatic dependent launches (quantization, kernel with
    the weight's first tiles before its wait, reduction); each config twice, the same bits both
    times. The activations span 2^-10..2^10 across K and the weight codes vary per 32-block, so
    a scale applied to the wrong block, row or K-tile fails the 1e-2 bound. Each row's MMAs run
    in the same K order in every variant, so for one tile width and split all of them give the
    same bits."""
    tri = _triton()
    if torch.cuda.get_device_capability()[0] != 9 or _gluon() is None:
        pytest.skip("needs Hopper and Triton's Gluon")
    k = 7168
    w, q, code = random_weight(n, k, layout, seed=31 + m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
         * torch.logspace(-3, 3, k, device="cuda").bfloat16())
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    facts = _facts()
    for b, r in ((None, ref), (bias, ref + bias.double())):
        by_split = {}
        for spec in (False, True):
            for bn in (64, 128):
                for bm, stages in ((32, 4), (64, 3), (128, 3), (256, 2)):
                    for split, pdl in ((1, False), (7, False), *(
                            ((1, True), (7, True)) if bm in (32, 128) else ())):
                        cfg = tri.dqmma_config(m, n, k, facts, block_n=bn, block_m=bm,
                                               stages=stages, specialized=spec)
                        cfg = dataclasses.replace(cfg, split_k=split, pdl=pdl, prefetch=pdl,
                                                  red_release=pdl and split > 1)
                        out = _check_twice(tri, x, w, b, r, cfg)
                        by_split.setdefault((bm, split), []).append(out)
        for outs in by_split.values():  # every variant of a tile shape: each row's bits alike
            for o in outs[1:]:
                assert torch.equal(outs[0], o)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("specialized", [False, True])
def test_dqmma_bit_conversion_matches_the_fp32_path(layout, specialized):
    """The dequantizing kernel's bit conversion (e4m3 bytes moved into bf16 ``q * 2^-120``, one
    bf16 multiply by ``2^(code - 7)``) gives the fp32 path's bits for every non-NaN e4m3 byte
    (subnormals and both zeros included) and every scale code up to 134, and both equal the
    reference's ``bf16(q * 2^(code - 127))``: the activations are one-hot rows, so each output
    element is one dequantized weight element (exact in fp32, then in bf16). A weight with a
    code above 134 is read by the fp32 path (``fast_conversion``), exactly too."""
    if torch.cuda.get_device_capability()[0] != 9 or _gluon() is None:
        pytest.skip("needs Hopper and Triton's Gluon")
    from mxfp8_convert.runtime.hopper import dqmma

    n, k = 256, 256
    byte = (torch.arange(n).view(-1, 1) * 37 + torch.arange(k).view(1, -1)) % 256
    byte[(byte & 0x7F) == 0x7F] = 0x80  # e4m3 NaN: never in a quantized weight; -0 instead
    q = byte.to(torch.uint8).view(torch.float8_e4m3fn).cuda()
    assert len(set(byte.flatten().tolist())) == 254
    xd = torch.eye(k, device="cuda", dtype=torch.bfloat16)  # MXFP8-exact (one 1.0 a row)
    for top in (134, 140):
        blocks = torch.arange(n).view(-1, 1) * (k // 32) + torch.arange(k // 32).view(1, -1)
        code = (blocks % (top + 1)).to(torch.uint8).cuda()
        assert int(code.max()) == top
        w = MXFP8Weight.from_canonical(q, code, layout)
        assert dqmma.fast_conversion(w.scale) == (top <= dqmma.FAST_MAX_CODE)
        want = dequantize_mxfp8(q, code).t().to(torch.bfloat16)  # [K tokens, N]
        normal = (want.float().abs() >= 2.0 ** -126) | (want == 0)
        outs = []
        for fast in (None, False) if top <= 134 else (None,):
            out = torch.full((k, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            dqmma.dqmma(xd, w, None, out, None, split_k=1, block_n=128, block_m=128, stages=2,
                        specialized=specialized, fast=fast)
            assert not out.isnan().any()
            # exact where the value is normal (the MMA may flush subnormal operands; its fp32
            # sum of -0 and +0 products is +0, so values, not bits)
            assert torch.equal(out[normal].float(), want[normal].float())
            outs.append(out)
        for o in outs[1:]:  # bit path and fp32 path: the same bits, subnormal results included
            assert torch.equal(outs[0].view(torch.int16), o.view(torch.int16))


def test_dqmma_rejects_what_it_cannot_read():
    tri = _triton()
    if torch.cuda.get_device_capability()[0] != 9 or _gluon() is None:
        pytest.skip("needs Hopper and Triton's Gluon")
    from mxfp8_convert.errors import LayoutError
    from mxfp8_convert.runtime.hopper import dqmma

    w, q, code = random_weight(256, 512, "trtllm", seed=5)
    xd = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="split_k=5"):  # 4 K-tiles: a split would be empty
        dqmma.dqmma(xd, w, None, out, None, split_k=5, block_n=64, block_m=64, stages=2)
    with pytest.raises(LayoutError, match="bf16"):
        dqmma.dqmma(xd.float(), w, None, out, None, split_k=1, block_n=64, block_m=64, stages=2)
    # a canonical weight (no 128x4 scale words) takes the rule without the Gluon kernels
    wc, qc, cc = random_weight(256, 512, "canonical", seed=6)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    got = tri.triton_linear(x, wc)
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(qc, cc).double().t()
    assert rel_err(got, ref) <= 1e-2


@pytest.mark.parametrize("layout", [*LAYOUTS, "canonical"])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_cublas_path_agrees(layout, bias_dtype):
    """The large-M path (weight dequantized by our kernel, bf16 GEMM by cuBLAS): one chunk,
    chunks of 128 rows and of 1000 rows (576 = 4.5 x 128: an N tail in every case, output
    column slices written in place), bias, twice (the workspace is reused)."""
    tri = _triton()
    n, k, m = 576 * 3, 7168, 1100
    w, q, code = random_weight(n, k, layout, seed=17)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda", dtype=bias_dtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    if bias is not None:
        ref += bias.to(torch.bfloat16).double()
    assert torch.equal(tri.dequantize_weight(w).float(), dequantize_mxfp8(q, code))
    assert torch.equal(tri.dequantize_weight(w, 37, 901).float(), dequantize_mxfp8(q, code)[37:901])
    for chunk in (0, 128, 1000):
        cfg = tri.cublas_config(m, n, k, chunk_n=chunk)
        _check_twice(tri, x, w, bias, ref, cfg)


@pytest.mark.parametrize("layout", [*LAYOUTS, "canonical"])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16])
def test_block128_path_agrees(layout, bias_dtype):
    """The block-128 path (both operands regrouped by our kernels, cuBLAS's FP8 GEMM with 1x128
    scales): the regrouped bytes and scales are torch's (``regroup_oracle``); the output within
    1e-2 of the float64 product of the 32-block operands and within bf16 rounding of the product
    of the regrouped ones; one chunk (straight into ``out``), chunks of 128 and of 1008 rows
    (column slices; cuBLAS takes multiples of 16), bias, twice; weight codes up to 30 apart
    within a 128-block."""
    from tests.runtime.regroup_oracle import regrouped_by_torch

    tri = _triton()
    n, k, m = 576 * 3, 7168, 1100
    w, q, code = random_weight(n, k, layout, seed=19)
    code[:, ::4] -= 20
    code[:, 1::4] += 10
    w = MXFP8Weight.from_canonical(q, code, layout)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda", dtype=bias_dtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = tri.regroup_weight(w)
    want_q, want_s = regrouped_by_torch(q, code)
    assert torch.equal(wq.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(ws, want_s.t().contiguous())
    xq, xs = tri.regroup_activations(x)
    q_x, code_x = quantize_mxfp8(x)
    want_q, want_s = regrouped_by_torch(q_x, code_x)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(xs, want_s)
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    regrouped = ((xq.double() * xs.double().repeat_interleave(128, 1))
                 @ (wq.double() * ws.double().t().repeat_interleave(128, 1)).t())
    if bias is not None:
        ref += bias.double()
        regrouped += bias.double()
    for chunk in (0, 128, 1008):
        cfg = tri.GemmConfig(64, 0, 256, tri.Kernel.BLOCK128, fuse_quant=False, chunk_n=chunk)
        out = _check_twice(tri, x, w, bias, ref, cfg)
        assert rel_err(out, regrouped) <= 3e-3, chunk


@pytest.mark.parametrize("m", [1, 3, 16, 32, 64, 300, 2048, 8192])
def test_nan_activation_makes_its_row_nan(m):
    """A NaN activation makes its whole output row NaN, as bf16 ``F.linear`` does, and leaves
    the other rows within 1e-2 of the float64 reference: on the rule's kernel at each M (GEMV,
    decode, Gluon FP8, dqmma, cuBLAS and block-128 paths), the decode kernel with separately
    quantized activations at M <= 16, and the cuBLAS and block-128 paths above."""
    tri = _triton()
    n, k = 2048, 4096
    w, q, code = random_weight(n, k, "trtllm", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bad = m // 2
    x[bad, 100] = float("nan")
    keep = torch.arange(m, device="cuda") != bad
    ref = fake_quantize_mxfp8(x[keep]).double() @ dequantize_mxfp8(q, code).double().t()
    configs = [None]
    if m <= 16:
        configs.append(tri.GemmConfig(64, 16, 128, tri.Kernel.DECODE, split_k=2, fuse_quant=False))
    else:
        configs.append(tri.cublas_config(m, n, k))
        if _facts().block_fp8:
            configs.append(tri.GemmConfig(64, 0, 256, tri.Kernel.BLOCK128, fuse_quant=False))
    for cfg in configs:
        out = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
        tri.triton_linear(x, w, out=out, config=cfg)
        assert out[bad].isnan().all(), cfg
        assert not out[keep].isnan().any(), cfg
        if m > 1:
            assert rel_err(out[keep], ref) <= 1e-2, cfg


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,n,k", MODEL_SHAPES[::3], ids=[s[0] for s in MODEL_SHAPES[::3]])
def test_tile_kernel_at_large_m(name, n, k, layout):
    """The tile kernel stays valid at M >= cublas_min_m (``tile_config``)."""
    tri = _triton()
    m = 2048
    w, q, code = random_weight(n, k, layout, seed=n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cfg = tri.tile_config(m, n, k, _facts())
    assert cfg.kind is tri.Kernel.TILE
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    tri.triton_linear(x, w, out=out, config=cfg)
    assert not out.isnan().any()
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    assert rel_err(out, ref) <= 1e-2


def test_decode_is_the_rule_where_measured_faster():
    tri = _triton()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need SM89+")
    facts = dataclasses.replace(_facts(), gluon=False)  # as without the Gluon kernel
    decode, gemv = tri.Kernel.DECODE, tri.Kernel.GEMV
    assert tri.choose_config(3, 24576, 1536, facts).kind is decode  # DeepSeek q_b_proj
    assert tri.choose_config(4, 18432, 7168, facts).kind is decode  # DeepSeek mlp.gate_up_proj
    assert tri.choose_config(16, 18432, 7168, facts).kind is not decode
    assert tri.choose_config(4, 4096, 4096, facts).kind is not decode
    assert tri.choose_config(1, 9728, 2560, facts).kind is gemv  # M = 1 without the wgmma kernel


def test_wgmma_is_the_rule_where_measured_faster():
    """On Hopper with Gluon, the rule (checked in full on CPU by test_hopper_rules.py) holds on
    this device's probed facts; a weight the kernel cannot read by TMA falls back."""
    tri = _triton()
    if torch.cuda.get_device_capability()[0] != 9 or _gluon() is None:
        pytest.skip("needs Hopper and Triton's Gluon")
    pdl = tri.pdl_enabled(torch.device("cuda"))
    facts = _facts()
    wgmma = tri.Kernel.WGMMA
    assert (
        tri.choose_config(1, 1024, 4096, facts).kind is wgmma
    ) == pdl  # 4.2 M elements: else the GEMV kernel
    for m in (1, 2, 8, 16):
        cfg = tri.choose_config(m, 18432, 7168, facts)
        assert cfg.kind is wgmma and cfg.fuse_quant and cfg.sw_ahead == 2 and cfg.pdl == pdl
    # M <= 8: the splits of a row tile as one cluster (7 of a 16.8 M weight, 16 of DeepSeek kv_a's)
    assert (
        tri.choose_config(4, 4096, 4096, facts).cluster
        and tri.choose_config(8, 4096, 4096, facts).split_k == 7
    )
    assert (
        tri.choose_config(2, 576, 7168, facts).cluster
        and tri.choose_config(2, 576, 7168, facts).split_k == 16
    )
    # M = 16: clusters on up to 32 row tiles, else a second kernel sums the partials
    assert (
        tri.choose_config(16, 1024, 4096, facts).cluster
        and tri.choose_config(16, 576, 7168, facts).cluster
    )
    cfg = tri.choose_config(16, 4096, 4096, facts)
    assert cfg.kind is wgmma and not cfg.cluster and cfg.split_k > 1 and not cfg.serial_reduce
    assert (cfg.block_n, cfg.split_k) == (
        128,
        8,
    )  # 1.94 programs of 128 rows per SM, 4 K-tiles each
    # with PDL the weight's first tile is loaded (and the activations' lines asked of L2) before the
    # wait, and the second kernel (summing physical-order partials) lets the next kernel launch
    # once the partials are complete
    assert (cfg.prefetch, cfg.x_prefetch, cfg.red_release, cfg.phys_partials) == (
        pdl,
        pdl,
        pdl,
        True,
    )
    # ... but on N = 7168 (DeepSeek expert.down, o_proj, mlp.down): 128-row programs in clusters of
    # 4
    cfg = tri.choose_config(16, 7168, 2048, facts)
    assert (
        cfg.kind is wgmma
        and cfg.cluster
        and cfg.block_n == 128
        and cfg.num_warps == 8
        and cfg.split_k == 4
    )
    assert not tri.choose_config(16, 24576, 1536, facts).pdl  # K unsplit at M > 8
    assert tri.choose_config(17, 18432, 7168, facts).kind is not wgmma
    w, q, code = random_weight(4096, 4096, "canonical", seed=2)  # no 128x4 scale words: falls back
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    out = tri.triton_linear(x, w)
    ref = fake_quantize_mxfp8(x).double() @ dequantize_mxfp8(q, code).double().t()
    assert rel_err(out, ref) <= 1e-2


def test_auto_engine_is_triton_on_hopper():
    from mxfp8_convert.runtime import auto_engine

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    assert auto_engine("cuda") == "triton"
    w, q, code = random_weight(256, 512, "trtllm", seed=1)
    x = torch.randn(2, 5, 512, device="cuda", dtype=torch.bfloat16)
    out = mxfp8_linear(x, w)
    assert out.shape == (2, 5, 256) and out.dtype == torch.bfloat16


def test_flashinfer_engine_refused_on_hopper():
    from mxfp8_convert.errors import BackendUnavailableError

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    w, _, _ = random_weight(256, 512, "trtllm", seed=1)
    with pytest.raises(BackendUnavailableError, match="engine='triton'|SM100|runs on"):
        mxfp8_linear(torch.randn(4, 512, device="cuda"), w, engine="flashinfer")


def test_block_fp8_on_this_gpu():
    """A Hopper with a CUDA 12.9+ torch has cuBLAS's 1x128 recipe (torch's own tests run it
    there), so its prefill rule is the block-128 path."""
    from mxfp8_convert.runtime.hopper import probe
    from mxfp8_convert.runtime.hopper.rules import TUNED, choose_config

    tri = _triton()
    dev = torch.device("cuda")
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    want = torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9)
    assert probe.block_fp8(dev) is want
    kind = choose_config(TUNED.block128_min_m, 4096, 4096, probe.device_facts(dev)).kind
    assert (kind is tri.Kernel.BLOCK128) is want
