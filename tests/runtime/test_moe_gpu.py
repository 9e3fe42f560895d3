"""The fused-MoE triton engine on a real GPU (Hopper): DeepSeek-V3 expert sizes, skewed routing.

Oracles: float64 MoE on the GPU from the *canonical* bytes the laid-out experts were made from
(``moe_from_dequantized``), so the layout reading of the engines is checked independently.
Bounds (tests/runtime/test_moe.py says why): vs the staged oracle (GEMM outputs rounded to bf16,
as these kernels store them) rel <= 5e-3; vs the oracle (float32 FC1 into SwiGLU) rel <= 3e-2.
Timing at these sizes is benchmarks/bench_moe_runtime.py's job.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mxfp8_convert.runtime import mxfp8_fused_moe
from mxfp8_convert.runtime.moe import TRITON_METHODS, moe_from_dequantized, triton_fused_moe

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda"  # the functions below also run on CPU under TRITON_INTERPRET=1 with DEVICE = "cpu"


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_moe_runtime", ROOT / "benchmarks" / "bench_moe_runtime.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(out, x, ids, w, mats, e):
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and not out.isnan().any()
    staged = moe_from_dequantized(x, ids, w, mats, e, bf16_gemm_outputs=True,
                                  out_dtype=torch.float64)
    oracle = moe_from_dequantized(x, ids, w, mats, e, out_dtype=torch.float64)
    rs = float((out.double() - staged).norm() / staged.norm())
    ro = float((out.double() - oracle).norm() / oracle.norm())
    assert rs <= 5e-3 and ro <= 3e-2, (rs, ro)
    return rs, ro


@pytest.fixture(scope="module")
def deepseek():
    pytest.importorskip("triton")
    bench = _bench()
    experts, canon = bench.build_experts(256, 7168, 2048, DEVICE, seed=1)
    yield bench, experts, bench.canonical_matrices(canon)
    del experts, canon
    torch.cuda.empty_cache()


@pytest.mark.parametrize("method", TRITON_METHODS)
@pytest.mark.parametrize("tokens", [1, 256])
def test_deepseek_sizes(deepseek, method, tokens):
    bench, experts, mats = deepseek
    x, ids, w = bench.random_routing(tokens, 256, 8, 7168, DEVICE, seed=tokens)
    out = triton_fused_moe(x, ids, w, experts, method=method)
    _check(out, x, ids, w, mats, 256)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_skewed_routing(method):
    """Most pairs on expert 0 (hundreds of rows: the large-M tiles), a few experts idle."""
    bench = _bench()
    e, h, i, k, t = 16, 1024, 512, 4, 300
    experts, canon = bench.build_experts(e, h, i, DEVICE, seed=2)
    x, _, w = bench.random_routing(t, e, k, h, DEVICE, seed=3)
    r = torch.arange(t, device=DEVICE)
    # experts 13-15 idle
    ids = torch.stack([torch.zeros_like(r), 1 + r % 12, 1 + (r + 4) % 12, 1 + (r + 8) % 12], 1)
    out = triton_fused_moe(x, ids, w, experts, method=method)
    _check(out, x, ids, w, bench.canonical_matrices(canon), e)


def test_grouped_configs_agree():
    from mxfp8_convert.runtime.hopper.grouped_moe import GroupedConfig

    bench = _bench()
    e, h, i, k, t = 32, 2048, 768, 8, 200
    experts, canon = bench.build_experts(e, h, i, DEVICE, seed=4)
    x, ids, w = bench.random_routing(t, e, k, h, DEVICE, seed=5)
    mats = bench.canonical_matrices(canon)
    for cfg in (GroupedConfig(64, 16, 128, 4, 4), GroupedConfig(64, 32, 128, 4, 4),
                GroupedConfig(64, 64, 128, 4, 4), GroupedConfig(128, 128, 64, 8, 3),
                GroupedConfig(128, 16, 64, 4, 3)):
        out = triton_fused_moe(x, ids, w, experts, method="grouped", grouped_config=cfg)
        _check(out, x, ids, w, mats, e)


def test_auto_engine_is_triton_on_hopper():
    from mxfp8_convert.errors import BackendUnavailableError

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    bench = _bench()
    experts, canon = bench.build_experts(8, 256, 128, DEVICE, seed=6)
    x, ids, w = bench.random_routing(7, 8, 2, 256, DEVICE, seed=7)
    out = mxfp8_fused_moe(x, ids, w, experts)
    _check(out, x, ids, w, bench.canonical_matrices(canon), 8)
    with pytest.raises(BackendUnavailableError):
        mxfp8_fused_moe(x, ids, w, experts, engine="flashinfer")
