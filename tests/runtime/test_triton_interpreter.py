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

from pathlib import Path

import pytest
import torch

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime import MXFP8Weight, mxfp8_linear, quantize_mxfp8, reference_linear
from tests.runtime.interpreter import interp, run_interpreter_suite


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
    from mxfp8_convert.runtime.triton_mxfp8 import GemmConfig, triton_linear

    w, q, code, x = _case(layout, m, n, k)
    bias = torch.randn(n)
    ref = reference_linear(x, q, code, bias)
    configs = [
        GemmConfig(64, 16, 128, split_k=1, fuse_quant=True),
        GemmConfig(64, 32, 128, split_k=2, fuse_quant=False, serial_reduce=True),
        GemmConfig(128, 16, 64, split_k=3, fuse_quant=True, w_in_regs=False),
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
    from mxfp8_convert.runtime.triton_mxfp8 import triton_linear

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
    from mxfp8_convert.runtime.triton_mxfp8 import GemmConfig, decode_config

    w, q, code, x = _case(layout, m, n, k, seed=m)
    x, bias, ref = _scaled_case(x, q, code)
    configs = [
        GemmConfig(64, 16, 128, split_k=1, fuse_quant=True, decode=True),
        GemmConfig(32, 16, 256, split_k=3, fuse_quant=False, serial_reduce=True, decode=True),
        GemmConfig(128, 16, 64, split_k=2, fuse_quant=True, serial_reduce=False, decode=True),
        GemmConfig(64, 16, 256, split_k=2, fuse_quant=False, decode=True),
        GemmConfig(128, 16, 256, split_k=3, fuse_quant=True, serial_reduce=False, decode=True),
        GemmConfig(64, 16, 128, split_k=2, fuse_quant=False, decode=True),
        decode_config(m, n, k, torch.device("cpu")),
    ]
    _check_configs(configs, x, w, bias, ref)


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("m,n,k", [(1, 576, 512), (3, 224, 1024), (4, 160, 256), (2, 128, 768)])
def test_gemv_matches_reference(layout, m, n, k):
    """The CUDA-core GEMV kernel (M <= 4): row gather, 128x4 scale words, N tail, int32-word and
    generic e4m3 conversion (all 256 byte values occur: subnormals, both signs), fused and
    separate activation quantization, serial / two-kernel split-K, bias."""
    from mxfp8_convert.runtime.triton_mxfp8 import GemmConfig, gemv_config

    w, q, code, x = _case(layout, m, n, k, seed=m)
    qb = q.view(torch.uint8)
    qb[:2].view(-1)[:256] = torch.arange(256, dtype=torch.uint8).masked_fill_(  # every e4m3 byte
        (torch.arange(256) & 0x7F) == 0x7F, 0)  # but the NaNs
    w = MXFP8Weight.from_canonical(q, code, layout)
    x, bias, ref = _scaled_case(x, q, code)
    configs = [
        GemmConfig(32, 4, 256, split_k=1, fuse_quant=True, gemv=True),
        GemmConfig(64, 4, 128, split_k=3, fuse_quant=False, serial_reduce=True, gemv=True),
        GemmConfig(32, 4, 256, split_k=2, fuse_quant=False, serial_reduce=False, gemv=True, words=False),
        GemmConfig(16, 4, 512, split_k=2, fuse_quant=True, serial_reduce=True, gemv=True),
        gemv_config(m, n, k, torch.device("cpu")),
    ]
    _check_configs(configs, x, w, bias, ref)


@interp
def test_gemv_unaligned_weight_takes_the_generic_cast():
    """A weight view that is not 4-byte aligned cannot be read as int32 words: same result."""
    from mxfp8_convert.runtime.triton_mxfp8 import gemv_config, triton_linear

    w, q, code, x = _case("cutlass", 1, 128, 256)
    buf = torch.empty(128 * 256 + 1, dtype=torch.uint8)
    buf[1:] = w.data.view(torch.uint8).reshape(-1)
    shifted = MXFP8Weight(buf[1:].view(torch.float8_e4m3fn).view(128, 256), w.scale, "cutlass")
    assert shifted.data.data_ptr() % 4
    ref = reference_linear(x, q, code)
    for fuse in (True, False):
        out = triton_linear(x, shifted, config=gemv_config(1, 128, 256, torch.device("cpu"), fuse_quant=fuse))
        _close(out, ref)


def test_gemv_is_the_rule_for_one_or_two_rows():
    """The dispatch measured on the H200: M <= 2 -> GEMV (512-wide K-tiles for small weights,
    pre-permuted activations for M = 2 and for large weights), M >= 3 -> never GEMV."""
    from mxfp8_convert.runtime.triton_mxfp8 import GEMV_LARGE_WEIGHT, choose_config

    cpu = torch.device("cpu")
    small, mid, large = (1024, 4096), (4096, 4096), (18432, 7168)
    assert large[0] * large[1] >= GEMV_LARGE_WEIGHT
    assert choose_config(1, *small, cpu).block_k == 512 and choose_config(1, *small, cpu).fuse_quant
    one, two = choose_config(1, *mid, cpu), choose_config(2, *mid, cpu)
    assert one.gemv and one.fuse_quant and one.block_m == 1
    assert two.gemv and not two.fuse_quant and two.block_m == 2
    assert one.block_n == 16 and choose_config(1, 2560, 4096, cpu).block_n == 32  # many long rows: 16-row programs
    big = choose_config(1, *large, cpu)
    assert big.gemv and not big.fuse_quant
    for m in (3, 4, 16, 2048):
        assert not choose_config(m, *mid, cpu).gemv
    assert not choose_config(1, *mid, cpu, decode=False).gemv  # the tile kernel, for comparisons
    assert not choose_config(1, 576, 160, cpu).gemv  # K % 128 != 0: the tile kernel


@interp
@pytest.mark.parametrize("layout", ["trtllm", "cutlass", "canonical"])
@pytest.mark.parametrize("n,k", [(576, 512), (224, 256), (160, 1024)])
def test_dequantize_weight_matches_reference(layout, n, k):
    """The cuBLAS path's weight dequantization from the laid-out bytes: every e4m3 byte value,
    scales far apart, every row and sub-ranges that cut P32 groups and 128-row scale tiles."""
    from mxfp8_convert.runtime.reference import dequantize_mxfp8
    from mxfp8_convert.runtime.triton_mxfp8 import dequantize_weight

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
    from mxfp8_convert.runtime.triton_mxfp8 import cublas_config

    w, q, code, x = _case(layout, m, n, k, seed=m)
    x, bias, ref = _scaled_case(x, q, code)
    cpu = torch.device("cpu")
    configs = [cublas_config(m, n, k, cpu, chunk_n=c) for c in (0, 128, 100)]
    _check_configs(configs, x, w, bias, ref)


def test_wgmma_rule_needs_a_hopper_gpu():
    """The Gluon kernel has no CPU interpreter: off a CUDA device the rule never picks it."""
    from mxfp8_convert.runtime.triton_mxfp8 import choose_config, wgmma_rule

    cpu = torch.device("cpu")
    assert wgmma_rule(4, 18432, 7168, cpu) is None
    assert not any(choose_config(m, 18432, 7168, cpu).wgmma for m in (1, 2, 4, 16))


def test_wgmma_rule_table(monkeypatch):
    """The rule fitted on the H200 (``wgmma_rule``'s table), evaluated as on a Hopper GPU with 132
    SMs: which path each (M, weight size) gets, how far K is split, which kernel sums the partials
    and how many it loads per round trip, and where programmatic dependent launch is used (on by default, off with ``MXFP8_PDL=0`` or a
    CUDA build before 12.4)."""
    import mxfp8_convert.runtime.triton_mxfp8 as tri

    if tri._gluon() is None:
        pytest.skip("Triton's Gluon (triton >= 3.6) is not installed")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("MXFP8_PDL", raising=False)
    monkeypatch.setattr(tri, "_driver_cuda_version", lambda: (12, 8))
    dev = torch.device("cuda")

    def rule(m, n, k):  # the partials through global memory (the rule where no cluster is used)
        cfg = tri.wgmma_rule(m, n, k, dev, cluster=False)
        return None if cfg is None else (cfg.fuse_quant, cfg.sw_ahead, cfg.split_k, cfg.serial_reduce, cfg.pdl)

    def cluster(m, n, k):
        cfg = tri.wgmma_rule(m, n, k, dev)
        return cfg.cluster, cfg.split_k, cfg.pdl, cfg.fuse_quant, cfg.sw_ahead

    def expect(m, n, k, waves, serial=True, pdl=True):
        return (True, 2, tri.wgmma_config(m, n, k, dev, waves=waves).split_k, serial, pdl)

    # 4.2 / 10.5 / 16.8 / 24.9 / 37.7 / 132 M elements
    small, qwen_q, mid, qwen_mlp, large, huge = (1024, 4096), (4096, 2560), (4096, 4096), (9728, 2560), (24576, 1536), \
        (18432, 7168)
    assert rule(1, *small) == expect(1, *small, 2) and rule(16, *small) == expect(16, *small, 1, serial=False)
    for m in (1, 2, 4):  # the last program sums the partials
        assert rule(m, *small) == expect(m, *small, 2)
        for shape in (mid, qwen_mlp, large, huge):
            assert rule(m, *shape) == expect(m, *shape, 3)
    # from M = 5: a second kernel sums 2-8 partials (16.8 M: 7 splits; 4.2 M: 16; 132 M: 2 but huge)
    assert rule(8, *mid) == expect(8, *mid, 3, serial=False) and rule(5, *mid) == expect(5, *mid, 3, serial=False)
    assert rule(8, *small) == expect(8, *small, 2) and rule(8, *huge) == expect(8, *huge, 3)
    assert expect(8, *small, 2)[2] > tri.WGMMA_TWO_KERNEL_SPLIT and 1 < expect(8, *huge, 3)[2] <= 8
    assert rule(9, *qwen_q) == expect(9, *qwen_q, 2, serial=False) and expect(9, *qwen_q, 2)[2] == 5  # 5 x 4 K-tiles
    assert rule(16, *qwen_mlp) == expect(16, *qwen_mlp, 3, serial=False)
    # ... there K in splits of 4 K-tiles where that is 2-8 splits of at most 4 programs per SM:
    # 16.8 M (64 row tiles) and Qwen o_proj (40) 8 splits, where the waves give 5 and 7 of up to 7 and 5
    for m, shape in ((16, mid), (9, mid), (16, (2560, 4096))):
        assert rule(m, *shape) == (True, 2, 8, False, True) and expect(m, *shape, 2)[2] in (5, 7)
    # not Qwen gate_up (152 row tiles x 5 splits > 4 per SM: 3 splits), nor M <= 8
    assert expect(16, *qwen_mlp, 3)[2] == 3 and rule(8, *mid)[2] == 7
    # M = 9..16: a second kernel wherever K is split (132 M: 2 splits), but for more than 8 splits
    # of a small weight (DeepSeek kv_a, 4.1 M: 14)
    assert rule(16, *huge) == expect(16, *huge, 3, serial=False) and expect(16, *huge, 3)[2] == 2
    assert rule(16, 576, 7168) == expect(16, 576, 7168, 1) and expect(16, 576, 7168, 1)[2] == 14
    assert rule(16, *large) == expect(16, *large, 3, pdl=False)  # K unsplit at M > 8: no PDL
    assert expect(16, *large, 3)[2] == 1
    assert rule(17, *large) is None and rule(4, 4096, 4000) is None  # M > 16; K not a multiple of 128
    # the splits of a row tile as one cluster: at M <= 8 wherever K is split, ~3 programs per SM,
    # at most 8 splits, 16 where 8 x the row tiles leave a quarter of the SMs idle (kv_a: 9 tiles)
    for m in (1, 2, 5, 8):
        assert cluster(m, *mid) == (True, 7, True, True, 2)  # 64 row tiles: 396 / 64 -> 7
        assert cluster(m, *small) == (True, 8, True, True, 2)  # 16 row tiles: 25 -> 8
        assert cluster(m, 576, 7168)[:2] == (True, 16) and cluster(m, *huge)[:2] == (True, 2)
        assert tri.wgmma_rule(m, *large, dev) == tri.wgmma_rule(m, *large, dev, cluster=False)  # K unsplit
    # at M = 9..16 on weights of up to 32 row tiles, ~2 programs per SM, up to 16 splits
    assert cluster(16, *small)[:2] == (True, 16) and cluster(9, 576, 7168)[:2] == (True, 16)
    assert cluster(16, 1536, 7168)[:2] == (True, 8) and cluster(16, 2048, 7168)[:2] == (True, 8)  # 24, 32 tiles
    assert cluster(16, 1024, 2560)[:2] == (True, 8)  # Qwen k_proj: 20 K-tiles, at least 2 per split
    for shape in ((2560, 4096), mid, qwen_q, huge):  # 40 row tiles and more: through global memory
        assert tri.wgmma_rule(16, *shape, dev) == tri.wgmma_rule(16, *shape, dev, cluster=False)
    # ... but for 128-row programs (two warpgroups) in clusters of 4 where that makes 1.5-2 per SM:
    # N = 7168 (56 x 4 = 224 programs), whatever K from 1024 (DeepSeek expert.down, o_proj, mlp.down)
    for m in (9, 16):
        for k in (2048, 16384, 18432):
            cfg = tri.wgmma_rule(m, 7168, k, dev)
            assert (cfg.block_n, cfg.num_warps, cfg.cluster, cfg.split_k, cfg.pdl) == (128, 8, True, 4, True)
        glob = tri.wgmma_rule(m, 7168, 2048, dev, cluster=False)  # without clusters: the same programs and split,
        assert (glob.block_n, glob.split_k, glob.cluster) == (128, 4, False)  # summed by a second kernel
    assert tri.wgmma_rule(8, 7168, 2048, dev).block_n == 64  # M <= 8: 64-row clusters
    assert tri.wgmma_rule(16, 7168, 512, dev).block_n == 64  # 4 K-tiles: too few to split 4 ways
    for n in (6272, 8576):  # 49 x 4 = 196 programs (1.48 per SM); 67 x 4 = 268 (2.03); 50 and 66 x 4 fit
        cfg = tri.wgmma_rule(16, n, 2048, dev)
        assert not (cfg.cluster and cfg.block_n == 128)  # (67 x 3 = 201 through global memory, below)
    assert tri.wgmma_rule(16, 6400, 2048, dev).block_n == tri.wgmma_rule(16, 8448, 2048, dev).block_n == 128
    assert all(tri.wgmma_rule(16, n, k, dev).block_n == 64 for n, k in (small, qwen_q, large, huge))
    # where a second kernel sums the partials, 128-row programs: of the splits into at least 4 K-tiles
    # that make 1.5-2 of them per SM, the most even, then the larger (eleventh session): Llama q/o_proj
    # 8 splits (256 programs; 7 of up to 5 make 224), down_proj 8 (7 and 8 both even: the more),
    # gate_up 2 (224); Qwen gate_up 3 (228), down_proj 11 of up to 7 (220; 13 of up to 6 make 260)
    for m in (9, 16):
        for (n, k), split in ((mid, 8), ((4096, 14336), 8), ((14336, 4096), 2), (qwen_mlp, 3), ((2560, 9728), 11),
                              ((4352, 4096), 7)):  # 34 x 8 = 272 programs (2.06 per SM): 7 splits of 5 K-tiles
            for clusters in (True, False):
                cfg = tri.wgmma_rule(m, n, k, dev, cluster=clusters)
                assert (cfg.block_n, cfg.num_warps, cfg.split_k, cfg.cluster, cfg.serial_reduce) == (
                    128, 8, split, False, False), (m, n, k)
                assert cfg.pdl and cfg.red_release and cfg.phys_partials
                assert cfg.red_chunk == min(16, 1 << (split - 2).bit_length())  # next power of two of split - 1
        # not where only 3 K-tiles a split give 1.5-2 per SM (Qwen q_proj: 7 x 32 = 224; o_proj: 11 x 20
        # = 220), nor 144 x 2 = 288 (DeepSeek gate_up, 2.18 per SM): the 64-row rule's splits
        for (n, k), split in ((qwen_q, 5), ((2560, 4096), 8), (huge, 2)):
            cfg = tri.wgmma_rule(m, n, k, dev)
            assert (cfg.block_n, cfg.split_k) == (64, split), (m, n, k)
    assert tri.wgmma_rule(8, *mid, dev, cluster=False).block_n == 64  # M <= 8: 64-row programs
    assert expect(4, *mid, 2) != expect(4, *mid, 3)  # the waves are told apart
    # partials loaded per round trip: all of them up to 16 (at least 4)
    chunks = {tri.wgmma_rule(m, *shape, dev, cluster=False).split_k: tri.wgmma_rule(m, *shape, dev, cluster=False).red_chunk
              for m, shape in ((4, small), (8, mid), (4, huge), (16, small), (16, large))}
    assert chunks == {16: 16, 7: 8, 2: 4, 8: 8, 1: 4}, chunks
    # ... but a second kernel loads the partials after the first in one chunk: 4 of Qwen q_proj's 5
    assert tri.wgmma_rule(16, *qwen_q, dev).split_k == 5 and tri.wgmma_rule(16, *qwen_q, dev).red_chunk == 4
    assert tri.wgmma_config(2, 576, 7168, dev, waves=2).split_k == 28 and tri.wgmma_config(2, 576, 7168, dev).red_chunk == 16
    # from M = 4 at most 16 splits (DeepSeek kv_a, 56 K-tiles: 14), below as many as the waves give
    assert [tri.wgmma_rule(m, 576, 7168, dev, cluster=False).split_k for m in (2, 3, 4, 8)] == [28, 28, 14, 14]
    # with PDL: the weight's first tile loaded (and the activations' lines asked of L2) before the
    # wait; partials summed by a second kernel in physical row order, which lets the next kernel
    # launch once they are complete
    def options(m, n, k, cluster=False):
        cfg = tri.wgmma_rule(m, n, k, dev, cluster=cluster)
        assert cfg.x_prefetch == cfg.prefetch
        return cfg.prefetch, cfg.red_release, cfg.phys_partials

    assert options(16, *mid) == (True, True, True) and options(8, *mid) == (True, True, True)
    assert options(4, *mid) == (True, False, False) and options(16, *mid, cluster=True) == (True, True, True)
    assert options(8, *mid, cluster=True) == (True, False, False)  # a cluster: no second kernel
    assert options(16, *large) == (False, False, False)  # K unsplit at M > 8: no PDL
    monkeypatch.setenv("MXFP8_PDL", "strict")  # PDL with every memory access after the wait
    assert rule(16, *mid) == (True, 2, 8, False, True) and options(16, *mid) == (False, True, True)
    monkeypatch.setenv("MXFP8_PDL", "0")  # without PDL: the same configs unlaunched as dependents, GEMV at M = 1
    assert rule(4, *mid) == expect(4, *mid, 3, pdl=False) and rule(1, *small) is None
    assert options(16, *mid) == (False, False, True)
    monkeypatch.delenv("MXFP8_PDL")
    monkeypatch.setattr(tri, "gdc_wait", None)  # a Triton without programmatic dependent launch
    assert rule(4, *mid) == expect(4, *mid, 3, pdl=False)
    monkeypatch.setattr(tri, "gdc_wait", lambda: None)
    monkeypatch.setattr(tri, "_driver_cuda_version", lambda: (12, 2))  # a driver older than the toolkit
    assert rule(4, *mid) == expect(4, *mid, 3, pdl=False)
    monkeypatch.setattr(tri, "_driver_cuda_version", lambda: (13, 0))
    assert rule(4, *mid) == expect(4, *mid, 3)
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    monkeypatch.setattr(torch.version, "cuda", "12.2")
    assert rule(4, *mid) == expect(4, *mid, 3, pdl=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert rule(4, *mid) is None  # Hopper only


@interp
def test_default_config_is_chosen_once_per_shape(monkeypatch):
    """Without ``config``, a call takes the rule's choice from a cache keyed by shape, device and
    ``MXFP8_PDL`` (``default_config``): the rule runs once for repeated calls, again for another
    shape or another ``MXFP8_PDL``, and the outputs are those of the explicit config."""
    import mxfp8_convert.runtime.triton_mxfp8 as tri

    w, q, code, x = _case("trtllm", 2, 128, 256)
    calls = []
    real = tri.choose_config
    monkeypatch.setattr(tri, "choose_config", lambda *a, **kw: calls.append(a[:3]) or real(*a, **kw))
    monkeypatch.delenv("MXFP8_PDL", raising=False)
    tri.default_config.cache_clear()
    outs = [tri.triton_linear(x, w) for _ in range(3)]
    assert calls == [(2, 128, 256)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], tri.triton_linear(x, w, config=real(2, 128, 256, x.device)))
    tri.triton_linear(x[:1], w)  # another shape
    monkeypatch.setenv("MXFP8_PDL", "0")
    tri.triton_linear(x, w)
    assert calls == [(2, 128, 256), (1, 128, 256), (2, 128, 256)]


def test_cublas_is_the_rule_from_min_m():
    """The dispatch measured on the H200: M >= CUBLAS_MIN_M -> the cuBLAS path, with chunks of
    whole 128-row groups that fit the workspace; below, and with cublas=False, the tile kernel."""
    from mxfp8_convert.runtime.triton_mxfp8 import CUBLAS_MIN_M, DEQUANT_WORKSPACE, choose_config

    cpu = torch.device("cpu")
    assert not choose_config(CUBLAS_MIN_M - 1, 4096, 4096, cpu).cublas
    for m in (CUBLAS_MIN_M, 8192):
        cfg = choose_config(m, 4096, 4096, cpu)
        assert cfg.cublas and cfg.chunk_n == 4096  # fits: one chunk
        assert not choose_config(m, 4096, 4096, cpu, cublas=False).cublas
    big = choose_config(8192, 18432, 7168, cpu)
    assert big.chunk_n % 128 == 0 and big.chunk_n * 7168 <= DEQUANT_WORKSPACE < (big.chunk_n + 128) * 7168


@interp
def test_engine_entry_point():
    w, q, code, x = _case("trtllm", 3, 256, 256)
    out = mxfp8_linear(x.reshape(1, 3, 256), w, engine="triton")
    _close(out.reshape(3, 256), reference_linear(x, q, code))


@interp
def test_activation_quantization_bit_exact():
    from mxfp8_convert.runtime.triton_mxfp8 import quantize_activations

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
        assert torch.equal(got["deq"], q.float().reshape(9, 32, 32).mul(torch.exp2(code.float() - 127)[..., None]).reshape(9, 1024))


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

    import mxfp8_convert.runtime.triton_mxfp8 as tri

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
