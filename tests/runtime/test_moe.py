"""The fused-MoE runtime (``runtime/moe.py``) on CPU: reference, SM100 arguments, Triton
interpreter.

A tiny Qwen3-MoE-style layer (E=4 experts, top-2 with renormalized softmax weights, H=I=256,
SwiGLU experts without bias) is quantized from bf16 with ``quantize.quantize_mxfp8`` (FlashInfer's
recipe), laid out for the trtllm-gen MXFP8 fused MoE (``layouts/moe.py``) and run.

Tolerances, and why:

- reference engine (from the laid-out bytes) vs the same math on the canonical bytes: **bit-exact**.
  Dequantizing the laid-out rows and putting them back in logical order gives the very same float32
  matrices, so every later operation is identical.
- reference vs an independent per-token loop written here from the canonical weights: the loop sums
  in another order (float64, then one rounding to float32 for FC1), so at most a few elements may
  differ by one MXFP8/bf16 rounding step: >= 99 % of outputs bit-equal and rel. error <= 1e-3.
- MXFP8 layer vs the same layer with unquantized activations: rel. error <= 0.07 (measured ~0.048):
  e4m3 keeps 3 mantissa bits, and x and the SwiGLU output are each quantized once.
- MXFP8 layer vs the original bf16 layer: rel. error <= 0.10 (measured ~0.067): weights quantized
  too (~0.047 alone).
- triton engine (Triton interpreter) vs the "staged" oracle (FC1/FC2 outputs rounded to bf16, as the
  dense kernel writes them): >= 99 % bit-equal, rel. <= 2e-3 (fp32 summation order only).
- triton engine vs the oracle (float32 FC1 into the activation, like trtllm's fused epilogue):
  rel. <= 0.03 (measured ~0.016). Rounding FC1 to bf16 before SwiGLU moves some activations across
  an e4m3 rounding boundary, and each such flip is a full e4m3 step (2^-3 relative) in that element.
  Any two correct implementations that round differently before a requantization differ this much.

relative error = ||out - ref||_F / ||ref||_F throughout.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.quantize import dequantize_mxfp8 as dequantize_weight
from mxfp8_convert.quantize import quantize_mxfp8 as quantize_weight
from mxfp8_convert.runtime import MXFP8MoEWeights, mxfp8_fused_moe
from mxfp8_convert.runtime.moe import (
    expert_matrices,
    moe_from_dequantized,
    reference_fused_moe,
    trtllm_routed_moe_args,
)
from mxfp8_convert.runtime.reference import fake_quantize_mxfp8, quantize_mxfp8
from tests.runtime.interpreter import INTERPRETING, interp, run_interpreter_suite


# --------------------------------------------------------------------------------------------
# The tiny Qwen3-MoE-style layer
# --------------------------------------------------------------------------------------------
class TinyMoE:
    """bf16 canonical weights, a router, tokens, routing, and the laid-out MXFP8 experts."""

    def __init__(self, e=4, h=256, i=256, t=37, k=2, seed=0, std=0.06):
        g = torch.Generator().manual_seed(seed)
        self.e, self.h, self.i, self.t, self.k = e, h, i, t, k
        self.gate = (torch.randn(e, i, h, generator=g) * std).bfloat16()  # gate_proj (w1)
        self.up = (torch.randn(e, i, h, generator=g) * std).bfloat16()  # up_proj (w3)
        self.down = (torch.randn(e, h, i, generator=g) * std).bfloat16()  # down_proj (w2)
        router = torch.randn(e, h, generator=g) * std
        self.x = torch.randn(t, h, generator=g).bfloat16()
        probs = (self.x.float() @ router.t()).softmax(-1)  # Qwen3-MoE: softmax, top-k, renormalize
        w, ids = torch.topk(probs, k)
        self.topk_weights, self.topk_ids = w / w.sum(-1, keepdim=True), ids
        # canonical MXFP8 (FlashInfer's recipe), stacked per expert
        self.q = {n: self._quantize(getattr(self, n), n) for n in ("gate", "up", "down")}
        self.experts = MXFP8MoEWeights.from_canonical(self.q["up"], self.q["gate"], self.q["down"],
                                                      "tiny.mlp.experts")

    @property
    def routed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, topk_ids, topk_weights)``: the first three arguments of every MoE call."""
        return self.x, self.topk_ids, self.topk_weights

    @staticmethod
    def _quantize(w, name):
        pairs = [quantize_weight(w[j], name=f"{name}.{j}") for j in range(w.shape[0])]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def dq(self, name, e):
        q, s = self.q[name]
        return dequantize_weight(q[e], s[e])

    def canonical_matrices(self, e):
        """``(w13 [2I, H] rows [up; gate], w2 [H, I])`` dequantized from the canonical bytes."""
        return torch.cat([self.dq("up", e), self.dq("gate", e)]), self.dq("down", e)


def loop_layer(m: TinyMoE, mats, *, quantized: bool) -> torch.Tensor:
    """Per token, per slot, written from the semantics (independent of runtime/moe.py), float64."""
    fq = fake_quantize_mxfp8 if quantized else (lambda v: v.float())
    out = torch.zeros(m.t, m.h, dtype=torch.float64)
    for t in range(m.t):
        a = fq(m.x[t : t + 1]).double()
        for j in range(m.k):
            e = int(m.topk_ids[t, j])
            gate_w, up_w, down_w = mats(e)
            x1 = (a @ up_w.double().t()).float()  # linear half
            x2 = (a @ gate_w.double().t()).float()  # gate half
            h = (F.silu(x2) * x1).bfloat16()
            out[t] += float(m.topk_weights[t, j]) * (fq(h).double() @ down_w.double().t())[0]
    return out.bfloat16()


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module")
def tiny() -> TinyMoE:
    return TinyMoE()


# --------------------------------------------------------------------------------------------
# Weights and validation
# --------------------------------------------------------------------------------------------
def test_layout_round_trips_bytes(tiny):
    can = tiny.experts.canonical()
    for name in ("up", "gate", "down"):
        for got, want in zip(can[name], tiny.q[name], strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    ex = tiny.experts
    assert ex.w13.shape == (4, 512, 256) and ex.w13_scale.shape == (4, 4, 2, 512)
    assert ex.w2.shape == (4, 256, 256) and ex.w2_scale.shape == (4, 2, 2, 512)
    s13, s2 = ex.kernel_scales()
    assert s13.shape == (4, 512, 8) and s2.shape == (4, 256, 8)
    assert s13.data_ptr() == ex.w13_scale.data_ptr() and s2.data_ptr() == ex.w2_scale.data_ptr()


def test_weights_validation(tiny):
    ex = tiny.experts
    fields = dict(w13=ex.w13, w13_scale=ex.w13_scale, w2=ex.w2, w2_scale=ex.w2_scale, hidden=256,
                  intermediate=256)
    bad = [
        ({"w13": ex.w13.view(torch.uint8)}, "float8_e4m3fn"),
        ({"w13": ex.w13[:, :256]}, "shape"),
        ({"w2": ex.w2.transpose(1, 2)}, "contiguous"),
        ({"w13_scale": ex.kernel_scales()[0]}, "linear scale's shape"),  # never taken for tiles
        ({"w13_scale": ex.w13_scale.reshape(4, -1)}, "128x4 tiles"),
        ({"w2_scale": ex.w2_scale.float()}, "uint8"),
        ({"hidden": 192}, "multiple of 128"),
        ({"intermediate": 320}, "multiple of 128"),
    ]
    for change, match in bad:
        with pytest.raises(LayoutError, match=match) as info:
            MXFP8MoEWeights(**{**fields, **change})
        assert "\n" not in str(info.value)
    e8 = MXFP8MoEWeights(**{**fields, "w2_scale": ex.w2_scale.view(torch.float8_e8m0fnu)})
    assert e8.w2_scale.dtype == torch.uint8


def test_input_validation(tiny):
    ex, x, ids, w = tiny.experts, tiny.x, tiny.topk_ids, tiny.topk_weights
    cases = [
        ((x[:, :128], ids, w), "hidden_states"),
        ((x.to(torch.int8), ids, w), "hidden_states"),
        ((x, ids.float(), w), "topk_ids"),
        ((x, ids[:5], w[:5]), "topk_ids"),
        ((x, ids, w[:, :1]), "topk_weights"),
        ((x, ids + 3, w), r"outside \[0, 4\)"),
        ((x, ids - 1, w), r"outside \[0, 4\)"),
    ]
    for args, match in cases:
        with pytest.raises(LayoutError, match=match):
            mxfp8_fused_moe(*args, ex)
    with pytest.raises(LayoutError, match="activation"):
        mxfp8_fused_moe(x, ids, w, ex, activation="gelu")
    empty = mxfp8_fused_moe(x[:0], ids[:0], w[:0], ex)
    assert empty.shape == (0, 256) and empty.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# Reference engine: the oracle
# --------------------------------------------------------------------------------------------
def test_laid_out_matrices_equal_canonical(tiny):
    for e in range(tiny.e):
        w13, w2 = expert_matrices(tiny.experts, e)
        c13, c2 = tiny.canonical_matrices(e)
        assert torch.equal(w13, c13) and torch.equal(w2, c2), f"expert {e}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_from_laid_out_is_exact(seed):
    m = TinyMoE(seed=seed)
    out = mxfp8_fused_moe(m.x, m.topk_ids, m.topk_weights, m.experts, engine="reference")
    assert out.dtype == torch.bfloat16 and out.shape == (m.t, m.h)
    assert torch.equal(out, moe_from_dequantized(*m.routed, m.canonical_matrices, m.e))
    assert torch.equal(out, mxfp8_fused_moe(*m.routed, m.experts))  # auto on CPU


def test_reference_matches_independent_loop(tiny):
    out = reference_fused_moe(tiny.x, tiny.topk_ids, tiny.topk_weights, tiny.experts)
    mats = lambda e: (tiny.dq("gate", e), tiny.dq("up", e), tiny.dq("down", e))  # noqa: E731
    loop = loop_layer(tiny, mats, quantized=True)
    assert (out == loop).float().mean() >= 0.99 and rel(out, loop) <= 1e-3, rel(out, loop)
    # teeth: the loop tells up from gate (swapping the halves changes the output completely)
    swapped = MXFP8MoEWeights.from_canonical(tiny.q["gate"], tiny.q["up"], tiny.q["down"])
    assert rel(reference_fused_moe(tiny.x, tiny.topk_ids, tiny.topk_weights, swapped), loop) > 0.5


def test_mxfp8_layer_close_to_bf16_layer(tiny):
    out = reference_fused_moe(tiny.x, tiny.topk_ids, tiny.topk_weights, tiny.experts)
    dq_weights = loop_layer(tiny, lambda e: (tiny.dq("gate", e), tiny.dq("up", e),
                                             tiny.dq("down", e)), quantized=False)
    bf16 = loop_layer(tiny, lambda e: (tiny.gate[e].float(), tiny.up[e].float(),
                                       tiny.down[e].float()), quantized=False)
    assert rel(out, dq_weights) <= 0.07, rel(out, dq_weights)
    assert rel(out, bf16) <= 0.10, rel(out, bf16)
    # and the shared helper with quantize_activations=False is that dequantized-weights layer
    unq = moe_from_dequantized(*tiny.routed, tiny.canonical_matrices, tiny.e,
                               quantize_activations=False)
    assert rel(unq, dq_weights) <= 1e-3


def test_quantize_constructor_matches_flashinfer_recipe(tiny):
    built = MXFP8MoEWeights.quantize(tiny.up, tiny.gate, tiny.down)
    for f in ("w13", "w13_scale", "w2", "w2_scale"):
        want = getattr(tiny.experts, f).view(torch.uint8)
        assert torch.equal(getattr(built, f).view(torch.uint8), want), f


# --------------------------------------------------------------------------------------------
# A converted checkpoint (mxfp8-convert's fused MoE output, docs/FORMAT.md section 3a)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (SGLang MXFP8: 2 layers, E=4, H=I=256, router in bf16), converted
    for trtllm (experts fused), and loaded back with ``load_checkpoint``."""
    from mxfp8_convert import synth

    if "experts" not in synth.SynthSpec.__dataclass_fields__:
        pytest.skip("synth.SynthSpec has no experts option (no converter MoE support)")
    from mxfp8_convert import convert
    from mxfp8_convert.runtime import load_checkpoint

    spec = synth.SynthSpec(layers=2, hidden=256, intermediate=256, heads=2, kv_heads=1, vocab=256,
                           shards=2, experts=4, moe_intermediate=256)
    root = tmp_path_factory.mktemp("moe_ckpt")
    src = synth.write_checkpoint(root / "src", spec)
    convert(src, "trtllm", root / "out")
    return src, load_checkpoint(root / "out", engine="reference"), spec


def _converted_case(converted, block: str, seed: int = 0):
    """Experts of ``block`` from the checkpoint, routed tokens (the checkpoint's router, Qwen3
    style), and the same experts' matrices dequantized from the *source* checkpoint's bytes."""
    from tests.checkpoints import load_all

    src, ckpt, spec = converted
    experts = MXFP8MoEWeights.from_checkpoint(ckpt, block)
    router = ckpt.tensors[block.removesuffix(".experts") + ".gate.weight"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(23, spec.hidden, generator=g).bfloat16()
    w, ids = torch.topk((x.float() @ router.float().t()).softmax(-1), 2)
    w = w / w.sum(-1, keepdim=True)
    source, _ = load_all(src)

    def dq(e, proj):
        name = f"{block}.{e}.{proj}"
        return dequantize_weight(source[f"{name}.weight"], source[f"{name}.weight_scale_inv"])

    def mats(e):
        return torch.cat([dq(e, "up_proj"), dq(e, "gate_proj")]), dq(e, "down_proj")

    return experts, x, ids, w, mats


def test_converted_checkpoint_layer(converted):
    from mxfp8_convert.errors import MarkerError
    from mxfp8_convert.runtime.moe import moe_blocks

    _, ckpt, spec = converted
    blocks = moe_blocks(ckpt)
    assert blocks == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for block in blocks:
        experts, x, ids, w, mats = _converted_case(converted, block)
        shape = (experts.num_experts, experts.hidden, experts.intermediate)
        assert shape == (4, spec.hidden, spec.moe_intermediate)
        out = mxfp8_fused_moe(x, ids, w, experts)  # auto: the reference engine on CPU
        assert torch.equal(out, moe_from_dequantized(x, ids, w, mats, experts.num_experts)), block
    with pytest.raises(MarkerError, match="not a fused MoE block"):
        MXFP8MoEWeights.from_checkpoint(ckpt, "model.layers.0.mlp")


@interp
def test_interp_converted_checkpoint(converted):
    from mxfp8_convert.runtime.moe import triton_fused_moe

    experts, x, ids, w, mats = _converted_case(converted, "model.layers.1.mlp.experts", seed=1)
    staged = moe_from_dequantized(x, ids, w, mats, experts.num_experts, bf16_gemm_outputs=True)
    for method in ("loop", "grouped"):
        out = triton_fused_moe(x, ids, w, experts, method=method)
        same = (out == staged).float().mean()
        assert same >= 0.99 and rel(out, staged) <= 2e-3, (method, rel(out, staged))


# --------------------------------------------------------------------------------------------
# SM100 engine, up to the kernel launch
# --------------------------------------------------------------------------------------------
class ReachedLaunch(Exception):
    """Raised where FlashInfer would build/load the compiled trtllm-gen MoE module and launch."""


class Recorder:
    """Stands in for the compiled module: records the positional arguments, then stops."""

    def __init__(self):
        self.args: tuple | None = None

    def trtllm_fp8_block_scale_moe(self, *args):
        self.args = args
        raise ReachedLaunch


def _fi():
    fi = pytest.importorskip("flashinfer")
    core = pytest.importorskip("flashinfer.fused_moe.core")
    runners = pytest.importorskip("flashinfer.fused_moe.runners")
    return fi, core, runners


def _op_param_names(core) -> list[str]:
    """Parameter names of the registered op ``trtllm_fp8_block_scale_moe_op``, from FlashInfer's
    source."""
    src = inspect.getsource(core._get_trtllm_moe_sm100_module_impl)
    sig = re.search(r"def trtllm_fp8_block_scale_moe_op\((.*?)\)\s*->", src, re.S)
    assert sig, ("FlashInfer's trtllm_fp8_block_scale_moe_op not found: "
                 "re-read core.py for this version")
    return [p.split(":")[0].strip() for p in sig.group(1).split(",") if p.strip()]


@pytest.fixture
def launch(monkeypatch):
    """Run ``trtllm_fp8_block_scale_routed_moe`` (its Python checks included) up to the module call.

    Returns ``call(args) -> dict``: the op's arguments by name, as the wrapper would pass them.
    Only ``get_trtllm_moe_sm100_module`` (CUDA device lookup, JIT build and load) is replaced.
    """
    fi, core, _ = _fi()
    names = _op_param_names(core)
    rec = Recorder()
    monkeypatch.setattr(core, "get_trtllm_moe_sm100_module", lambda: rec)

    def call(args: dict) -> dict:
        with pytest.raises(ReachedLaunch):
            fi.fused_moe.trtllm_fp8_block_scale_routed_moe(**args)
        assert len(rec.args) == len(names), (len(rec.args), names)
        return dict(zip(names, rec.args, strict=True))

    return call


def _cpu_mxfp8_quantize(x, is_sf_swizzled_layout=True, **_):
    """CPU stand-in for ``flashinfer.mxfp8_quantize``: same recipe, same flat uint8 scale
    buffer."""
    assert is_sf_swizzled_layout is False, (
        "the MXFP8 MoE launcher reads linear (token-major) scales")
    q, code = quantize_mxfp8(x)
    return q, code.reshape(-1)


def _args(m: TinyMoE, **kw) -> dict:
    q, code = quantize_mxfp8(m.x)
    return trtllm_routed_moe_args(q, code, m.topk_ids.to(torch.int32).contiguous(),
                                  m.topk_weights.float().contiguous(), m.experts, **kw)


def flashinfer_checks(op: dict, m: TinyMoE) -> None:
    """Every check FlashInfer applies to these arguments before a kernel runs, on CPU.

    1. Python, ``flashinfer/fused_moe/runners.py`` (the MoE layer API's launch boundary for the
       same kernel): ``_validate_prerouted_inputs`` and
       ``TrtllmFp8BlockRunner._validate_fp8_tensors``
       (exact MXFP8 shapes: hidden scale ``[T, H/32]`` uint8, weight scales ``[E, 2I, H/32]`` and
       ``[E, H, I/32]`` uint8, weights ``[E, 2I, H]`` / ``[E, H, I]`` e4m3).
    2. C++, transcribed from ``data/csrc/trtllm_fused_moe_kernel_launcher.cu`` (0.7.2.post1):
       ``trtllm_fp8_block_scale_moe`` entry checks, ``Fp8BlockScaleLauncher::check_routing``,
       ``check_moe`` and ``FusedMoeLauncher::check_weights_shape`` for MxFp8 + MajorK.
    """
    _, core, runners = _fi()
    from flashinfer.fused_moe import Fp8QuantizationType
    from flashinfer.fused_moe.api import MoEActivationPack, QuantFormat, SwiGLU

    hs, sf = op["hidden_states"], op["hidden_states_scale"]
    ids, w = op["topk_ids"], op["expert_weights"]
    t, h = hs.shape
    act = MoEActivationPack(hs, sf, ids, w,
                            routing_input_mode=core.RoutingInputMode.UnpackedPrecomputed)
    runners._validate_prerouted_inputs(act, t, op["top_k"], "mxfp8-convert",
                                       require_contiguous=True,
                                       allowed_weights_dtypes=(torch.bfloat16, torch.float32))
    runner = types.SimpleNamespace(_pair=(QuantFormat.MXFP8, QuantFormat.MXFP8),
                                   _num_weight_rows=op["local_num_experts"],
                                   _intermediate_size=op["intermediate_size"],
                                   config=types.SimpleNamespace(activation=SwiGLU()))
    view = {n: op[n] for n in ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights",
                               "gemm2_weights_scale")}
    runners.TrtllmFp8BlockRunner._validate_fp8_tensors(runner, act, view, h)

    # --- C++ launcher checks (MxFp8, unpacked pre-computed routing, gated activation) ---
    e4m3, u8 = torch.float8_e4m3fn, torch.uint8
    k, n_exp, inter = op["top_k"], op["num_experts"], op["intermediate_size"]
    assert op["routing_input_mode"] == core.RoutingInputMode.UnpackedPrecomputed
    assert op["routing_logits"] is None
    assert hs.dtype in (torch.float16, torch.bfloat16, e4m3)
    assert Fp8QuantizationType(op["fp8_quantization_type"]) == Fp8QuantizationType.MxFp8
    assert sf.dtype == u8, "hidden_states_scale must be uint8"
    assert op["gemm1_weights"].dtype == e4m3 and op["gemm2_weights"].dtype == e4m3
    assert op["gemm1_weights_scale"].dtype == u8 and op["gemm2_weights_scale"].dtype == u8
    assert op["use_shuffled_weight"] is True, "use_shuffled_weight must be true for MxFp8"
    assert op["weight_layout"] == 0, "weight_layout must be 0 (MajorK) for MxFp8"
    # check_routing
    assert ids.dim() == 2 and ids.shape == (t, k) and ids.dtype == torch.int32
    assert w.dtype in (torch.bfloat16, torch.float32) and w.dim() == 2 and w.shape == (t, k)
    assert 0 < k <= n_exp and 0 < op["local_num_experts"] <= n_exp
    assert 0 <= op["local_expert_offset"]
    assert op["local_expert_offset"] + op["local_num_experts"] <= n_exp
    assert op["routing_method_type"] != 2  # not DeepSeekV3: then no groups
    assert (op["n_group"] or 0) <= 1 and (op["topk_group"] or 0) <= 1
    assert n_exp % 4 == 0 and n_exp > k
    # check_moe (MxFp8) and check_weights_shape (MajorK, gated: intermediate_size_factor 2)
    assert hs.dtype == e4m3, "hidden_states must be fp8"
    g1, g2 = op["gemm1_weights"], op["gemm2_weights"]
    assert g1.dim() == 3 and g1.shape[1] % 2 == 0 and g1.shape[1] == 2 * inter and g1.shape[2] == h
    assert g2.dim() == 3 and g2.shape[1] == h and g2.shape[2] == inter
    assert op["gemm1_bias"] is None and op["gemm2_bias"] is None and op["gemm1_lora_delta"] is None
    assert op["num_fused_shared_experts"] == 0


def test_routed_args_reach_launch(launch, tiny):
    _fi()
    from flashinfer.fused_moe import (
        ActivationType,
        Fp8QuantizationType,
        RoutingMethodType,
        WeightLayout,
    )

    args = _args(tiny)
    op = launch(args)
    ex = tiny.experts
    e, h, i, t, k = tiny.e, tiny.h, tiny.i, tiny.t, tiny.k
    # exactly our tensors, no copies: weights and the tile bytes viewed as FlashInfer's shapes
    assert op["gemm1_weights"] is ex.w13 and op["gemm2_weights"] is ex.w2
    s1, s2 = op["gemm1_weights_scale"], op["gemm2_weights_scale"]
    assert s1.shape == (e, 2 * i, h // 32) and s1.dtype == torch.uint8
    assert s1.data_ptr() == ex.w13_scale.data_ptr()
    assert s2.shape == (e, h, i // 32) and s2.dtype == torch.uint8
    assert s2.data_ptr() == ex.w2_scale.data_ptr()
    assert torch.equal(s1.reshape(-1), ex.w13_scale.reshape(-1))
    assert torch.equal(s2.reshape(-1), ex.w2_scale.reshape(-1))
    q, code = quantize_mxfp8(tiny.x)
    assert op["hidden_states"].dtype == torch.float8_e4m3fn and op["hidden_states"].shape == (t, h)
    assert torch.equal(op["hidden_states"].view(torch.uint8), q.view(torch.uint8))
    assert op["hidden_states_scale"].shape == (t, h // 32)
    assert torch.equal(op["hidden_states_scale"], code)
    assert op["topk_ids"].dtype == torch.int32
    assert torch.equal(op["topk_ids"], tiny.topk_ids.to(torch.int32))
    assert op["expert_weights"].dtype == torch.float32
    assert torch.equal(op["expert_weights"], tiny.topk_weights.float())
    expected = {
        "routing_logits": None, "routing_bias": None, "output": None,
        "num_experts": e, "top_k": k, "n_group": None, "topk_group": None, "intermediate_size": i,
        "local_expert_offset": 0, "local_num_experts": e, "routed_scaling_factor": None,
        "routing_method_type": int(RoutingMethodType.TopK), "use_shuffled_weight": True,
        "weight_layout": int(WeightLayout.MajorK), "do_finalize": True,
        "fp8_quantization_type": Fp8QuantizationType.MxFp8, "num_fused_shared_experts": 0,
        "activation_type": int(ActivationType.Swiglu), "valid_hidden_size": None,
        "valid_intermediate_size": None, "routing_replay_out": None,
    }
    for name, want in expected.items():
        assert op[name] == want if want is not None else op[name] is None, (name, op[name], want)
    flashinfer_checks(op, tiny)


def _rejected(launch, m, args):
    """The wrapper refuses ``args``, or FlashInfer's checks refuse what reaches the launch."""
    try:
        op = launch(args)
    except Exception as e:  # noqa: BLE001 - any refusal before the launch is what we want
        assert not isinstance(e, ReachedLaunch)
        return
    with pytest.raises((AssertionError, ValueError, TypeError)):
        flashinfer_checks(op, m)


def test_checks_have_teeth(launch, tiny):
    from flashinfer.fused_moe import Fp8QuantizationType

    good = _args(tiny)
    ex = tiny.experts
    ids, w = good["topk_ids"]
    q, code = quantize_mxfp8(tiny.x)
    from mxfp8_convert.layouts import swizzle_128x4

    bad = {
        "4-D scale tiles": {"gemm1_weights_scale": ex.w13_scale},
        "flat scale buffer": {"gemm2_weights_scale": ex.w2_scale.reshape(-1)},
        "FC1 scale as [E, 2I/32, H/32]": {
            "gemm1_weights_scale": ex.w13_scale.view(tiny.e, -1, 8)[:, :128]},
        "swizzled activation scales": {"hidden_states_scale": swizzle_128x4(code).reshape(-1)},
        "transposed activation scales": {"hidden_states_scale": code.t().contiguous()},
        "bf16 activations": {"hidden_states": tiny.x},
        "BlockMajorK": {"weight_layout": 2},
        "unshuffled weights flag": {"use_shuffled_weight": False},
        "DeepSeek FP8 type": {"fp8_quantization_type": Fp8QuantizationType.DeepSeekFp8},
        "wrong intermediate size": {"intermediate_size": tiny.i // 2},
        "int64 ids": {"topk_ids": (ids.long(), w)},
        "float64 weights": {"topk_ids": (ids, w.double())},
        "FC2 in FC1's place": {"gemm1_weights": ex.w2},
        "DeepSeekV3 routing without groups": {"routing_method_type": 2},
    }
    for why, change in bad.items():
        try:
            _rejected(launch, tiny, {**good, **change})
        except pytest.fail.Exception:
            raise AssertionError(
                f"{why}: reached the kernel launch and passed every check") from None


def test_engine_path_reaches_launch(launch, monkeypatch, tiny):
    """The engine itself: its quantize call, argument building, FlashInfer's checks."""
    fi, _, _ = _fi()
    from mxfp8_convert.runtime.moe import flashinfer_fused_moe

    monkeypatch.setattr(fi, "mxfp8_quantize", _cpu_mxfp8_quantize)
    seen = {}
    original = fi.fused_moe.trtllm_fp8_block_scale_routed_moe

    def spy(**kw):
        seen.update(kw)
        return original(**kw)

    monkeypatch.setattr(fi.fused_moe, "trtllm_fp8_block_scale_routed_moe", spy)
    with pytest.raises(ReachedLaunch):
        flashinfer_fused_moe(tiny.x, tiny.topk_ids, tiny.topk_weights, tiny.experts)
    assert seen["hidden_states_scale"].shape == (tiny.t, tiny.h // 32)
    assert seen["topk_ids"][0].dtype == torch.int32 and seen["topk_ids"][1].dtype == torch.float32


def test_flashinfer_engine_refused_on_cpu(tiny):
    from mxfp8_convert.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="SM100"):
        mxfp8_fused_moe(tiny.x, tiny.topk_ids, tiny.topk_weights, tiny.experts, engine="flashinfer")


def test_our_preflight(tiny):
    _fi()
    q, code = quantize_mxfp8(tiny.x)
    ids, w = tiny.topk_ids.to(torch.int32), tiny.topk_weights.float()
    with pytest.raises(LayoutError, match="token-major"):
        trtllm_routed_moe_args(q, code.reshape(-1), ids, w, tiny.experts)
    with pytest.raises(LayoutError, match="float8_e4m3fn"):
        trtllm_routed_moe_args(tiny.x, code, ids, w, tiny.experts)
    with pytest.raises(LayoutError, match="int32"):
        trtllm_routed_moe_args(q, code, ids.long(), w, tiny.experts)
    with pytest.raises(LayoutError, match="E % 4"):
        three = TinyMoE(e=3, t=4, i=128, h=128)
        trtllm_routed_moe_args(*quantize_mxfp8(three.x), three.topk_ids.to(torch.int32),
                               three.topk_weights.float(), three.experts)


# --------------------------------------------------------------------------------------------
# Triton engine under the interpreter
# --------------------------------------------------------------------------------------------
def test_interpreter_suite():
    run_interpreter_suite(str(Path(__file__)), "interp_")


def _check_triton(m: TinyMoE, out: torch.Tensor) -> None:
    staged = moe_from_dequantized(*m.routed, m.canonical_matrices, m.e, bf16_gemm_outputs=True)
    oracle = reference_fused_moe(*m.routed, m.experts)
    assert not out.isnan().any()
    assert (out == staged).float().mean() >= 0.99 and rel(out, staged) <= 2e-3, rel(out, staged)
    assert rel(out, oracle) <= 0.03, rel(out, oracle)


@interp
def test_interp_loop_matches_oracles(tiny):
    from mxfp8_convert.runtime.hopper.config import GemmConfig
    from mxfp8_convert.runtime.moe import triton_fused_moe

    _check_triton(tiny, triton_fused_moe(*tiny.routed, tiny.experts, method="loop"))
    # split-K with both reductions, fused / separate quantization, both MMA orientations
    configs = [
        (GemmConfig(64, 16, 128, split_k=2, fuse_quant=True, serial_reduce=True),
         GemmConfig(128, 16, 64, split_k=1, fuse_quant=False)),
        (GemmConfig(128, 32, 64, split_k=3, fuse_quant=False, serial_reduce=False),
         GemmConfig(64, 16, 128, split_k=2, fuse_quant=True, serial_reduce=False)),
    ]
    for cfg in configs:
        _check_triton(tiny, triton_fused_moe(*tiny.routed, tiny.experts, configs=cfg))


@interp
def test_interp_grouped_matches_oracles(tiny):
    """One launch per GEMM (SwiGLU + requantization in FC1's epilogue): every tile shape, and
    bit-equal to the per-expert path (same roundings; fp32 sums of exact products here)."""
    from mxfp8_convert.runtime.hopper.grouped_moe import GroupedConfig
    from mxfp8_convert.runtime.moe import triton_fused_moe

    loop = triton_fused_moe(*tiny.routed, tiny.experts, method="loop")
    configs = (None, GroupedConfig(64, 32, 128), GroupedConfig(128, 16, 64),
               GroupedConfig(128, 128, 64, 8, 3))
    for cfg in configs:
        out = triton_fused_moe(*tiny.routed, tiny.experts, method="grouped", grouped_config=cfg)
        _check_triton(tiny, out)
        assert torch.equal(out, loop), cfg


@interp
def test_interp_uneven_routing_and_small_intermediate():
    """E=8, top-3, I=128 (FC2 K=128: fine for the MoE, not for mm_mxfp8's trtllm K % 256),
    an idle expert and one expert taking most tokens (several M tiles)."""
    from mxfp8_convert.runtime.moe import triton_fused_moe

    m = TinyMoE(e=8, h=256, i=128, t=40, k=3, seed=5)
    ids = torch.stack([torch.zeros(m.t, dtype=torch.long), torch.arange(m.t) % 6 + 1,
                       torch.full((m.t,), 6)], 1)
    ids[::7, 2] = 1  # expert 7 idle, expert 0 has every token
    ids[::7, 1] = 2
    m.topk_ids = ids
    for method in ("loop", "grouped"):
        _check_triton(m, triton_fused_moe(*m.routed, m.experts, method=method))


@interp
def test_interp_engine_entry_point(tiny):
    out = mxfp8_fused_moe(tiny.x, tiny.topk_ids, tiny.topk_weights, tiny.experts, engine="triton")
    _check_triton(tiny, out)


@pytest.mark.skipif(INTERPRETING, reason="compiles for a GPU target; not under the interpreter")
@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_kernel_compiles_for_hopper(swiglu):
    """The grouped kernel lowers to wgmma for sm_90a without spills (offline: no GPU needed).

    Integer arguments carry the divisibility-by-16 hint the JIT gives them at run time (every
    N, K and stride here is a multiple of 16); without it the weight loads are not pipelined.
    """
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip(f"Triton {triton.__version__} has no ASTSource/GPUTarget compile API")
    from mxfp8_convert.runtime.hopper.grouped_moe import _grouped_mxfp8_kernel

    try:  # the ptxas Triton itself uses for sm_90 (3.9 ships two; the legacy one is too old)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = Path(get_ptxas(90).path)
    except (ImportError, AttributeError, RuntimeError):
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip("Triton's bundled ptxas not found")
    sig = {"a_ptr": "*bf16", "src_ptr": "*i32", "w_ptr": "*fp8e4nv", "s_ptr": "*i32",
           "out_ptr": "*bf16",
           "sched_ptr": "*i32", "num_tiles": "i32", "N": "i32", "K": "i32", "stride_a": "i32",
           "w_expert_stride": "i32", "s_expert_words": "i32", "scale_cp4": "i32"}
    const = {"GATHER": swiglu, "SWIGLU": swiglu, "DOT_BF16": True, "BLOCK_N": 64, "BLOCK_M": 16,
             "BLOCK_K": 128}
    sig.update(dict.fromkeys(const, "constexpr"))
    attrs = {(j,): [["tt.divisibility", 16]] for j in (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11)}
    source = ASTSource(fn=_grouped_mxfp8_kernel, signature=sig, constexprs=const, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 4})
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"grouped_moe_{os.getpid()}_{int(swiglu)}.ptx"
    path.write_text(ptx)
    try:
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", os.devnull],
                           capture_output=True, text=True, timeout=300)
    finally:
        path.unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "0 bytes spill stores" in r.stderr, r.stderr[-2000:]
