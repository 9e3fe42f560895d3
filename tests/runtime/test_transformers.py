"""``load_into`` on real transformers decoders built from config with random weights.

Each architecture (Llama; Qwen2 with q/k/v biases and tied embeddings; Qwen3-MoE; Mixtral, whose
checkpoint names ``block_sparse_moe`` where transformers 5 names ``mlp``) is saved by
transformers itself (``save_pretrained``: the Hub's tensor names), converted by the real
converter from that dense checkpoint, loaded with ``load_checkpoint`` and put into a fresh model
built from the output's config.json with ``load_into``.

Oracle: the *dequantized model*, i.e. the source model in float32 whose every weight the
conversion quantized is replaced by ``dq(q(W))``, with ``q`` FlashInfer's recipe
(``mxfp8_convert.quantize.quantize_mxfp8``, the converter's quantizer, itself checked against
FlashInfer) and ``dq`` written out here (``e4m3 * 2^(code - 127)`` per 1x32 block). Both models
then hold exactly the same weight values; what differs is that the MXFP8 model quantizes each
linear's input to MXFP8 (e4m3: 3 mantissa bits, so a relative rounding error of at most 2^-4 per
element, about 2-3 % RMS) and rounds each linear's output to bf16 (2^-9), as the kernels do.

Tolerance: ``||logits - ref|| / ||ref|| <= 0.15``. The weights are drawn with unit gain
(``std = 1/sqrt(K)``), so that every linear and expert moves the residual stream as much as the
embeddings do and an error in any one of them shows in the logits. One MXFP8 linear is then
~2.5 % off its unquantized-input value; the errors of the 2 x 4-7 linears add roughly in
quadrature along the residual stream, and with MoE the router sees slightly different hidden
states, so that a near-tie can send a token to another expert. Measured (float32 and bf16 models,
both backends): 0.042-0.049 for Llama, Qwen2 and Qwen3-MoE, up to 0.072 for Mixtral. 0.15 is
twice the worst of these, and below any single wrong module: one linear's rows left P32-shuffled
(a loader ignoring the trtllm layout) or two experts' ``down_proj`` swapped gives 0.26-0.51 for
every module of every model tried; each test re-checks that on its own model (``_control``).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # a test dependency (pyproject.toml)
from torch import nn

from mxfp8_convert import convert
from mxfp8_convert.errors import BackendUnavailableError, LayoutError
from mxfp8_convert.quantize import quantize_mxfp8
from mxfp8_convert.runtime import MXFP8Linear, MXFP8Weight, load_checkpoint, load_into
from mxfp8_convert.runtime.experts import MXFP8Experts

SMALL = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
CONFIGS = {
    "llama": transformers.LlamaConfig(**SMALL, intermediate_size=512, head_dim=64),
    "qwen2": transformers.Qwen2Config(**SMALL, intermediate_size=512, tie_word_embeddings=True),
    "qwen3_moe": transformers.Qwen3MoeConfig(
        **SMALL,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=64,
    ),
    "mixtral": transformers.MixtralConfig(
        **SMALL, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2
    ),
}
REL = 0.15


def _source(tmp_path, arch: str, seed: int = 0):
    """A random model of ``arch`` saved by transformers in bf16; returns (folder, float32 model)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch])
    with torch.no_grad():  # unit-gain weights: every layer moves the residual stream as much as
        for name, p in model.named_parameters():  # the embeddings do, so every layer shows
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)  # Qwen2's q/k/v biases: large enough to matter
            elif p.dim() >= 2:  # embeddings, linears, routers, [E, rows, K] experts
                p.normal_(0, 1 if "embed" in name else p.shape[-1] ** -0.5)
    model = model.to(torch.bfloat16)
    root = tmp_path / f"src-{arch}"
    model.save_pretrained(root)
    return root, model.float().eval()


def _dq(w: torch.Tensor) -> torch.Tensor:
    """dq(q(w)) along the last dim, the dequantization written out: e4m3 * 2^(code - 127)."""
    q, code = quantize_mxfp8(w.reshape(-1, w.shape[-1]))
    blocks = q.float().reshape(q.shape[0], -1, 32) * torch.exp2(code.float() - 127).unsqueeze(-1)
    return blocks.reshape(w.shape)


def _dequantized(model: nn.Module, replaced: list[str]) -> nn.Module:
    """The float32 source model with every quantized weight replaced by ``dq(q(W))``."""
    with torch.no_grad():
        for name in replaced:
            mod = model.get_submodule(name)
            params = (
                [mod.weight] if isinstance(mod, nn.Linear) else [mod.gate_up_proj, mod.down_proj]
            )
            for p in params:
                p.copy_(_dq(p.detach()))
    return model


def _fresh(out, dtype):
    """A model built from the output's config.json (its marker dropped), as a user would."""
    cfg = {
        k: v
        for k, v in json.loads((out / "config.json").read_text()).items()
        if k != "quantization_config"
    }
    config = transformers.AutoConfig.for_model(**cfg)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _rel(logits: torch.Tensor, ref: torch.Tensor) -> float:
    return float((logits.float() - ref).norm() / ref.norm())


def _control(ref_model: nn.Module, name: str, ids: torch.Tensor, ref: torch.Tensor) -> float:
    """The error of one wrong module (rows P32-shuffled, or experts 0 and 1 swapped) in the
    reference model: what the tolerance must tell from a right answer."""
    from mxfp8_convert.layouts import p32_shuffle_rows

    mod = ref_model.get_submodule(name)
    p = mod.weight if isinstance(mod, nn.Linear) else mod.down_proj
    saved = p.detach().clone()
    with torch.no_grad():
        p.copy_(
            p32_shuffle_rows(saved)
            if isinstance(mod, nn.Linear)
            else saved[[1, 0, *range(2, len(saved))]]
        )
        wrong = ref_model(ids).logits
        p.copy_(saved)
    return _rel(wrong, ref)


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_load_into_real_transformers_model(tmp_path, arch, backend):
    src, source_model = _source(tmp_path, arch)
    out = tmp_path / "out"
    result = convert(str(src), backend, out)
    quantized = sum(result.to_dict()["plan"]["modules_by_action"].values())
    moe = CONFIGS[arch].model_type in ("qwen3_moe", "mixtral")
    assert bool(result.plan.moe) == (moe and backend == "trtllm")  # fused only for trtllm

    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        ck = load_checkpoint(out, backend=backend)
        model = _fresh(out, dtype)
        report = load_into(
            model, ck
        )  # strict: nothing missing (inv_freq, tied lm_head), nothing unexpected
        assert not report.missing and not report.unexpected
        experts = [n for n in report.replaced if isinstance(model.get_submodule(n), MXFP8Experts)]
        linears = [n for n in report.replaced if isinstance(model.get_submodule(n), MXFP8Linear)]
        assert len(experts) == (SMALL["num_hidden_layers"] if moe else 0)
        per_block = 3 * model.get_submodule(experts[0]).num_experts if experts else 0
        assert (
            len(linears) + per_block * len(experts) == quantized
        )  # every converted module is in use
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.dtype == dtype and torch.isfinite(logits).all()
        results[dtype] = (logits, report.replaced)

    ref_model = _dequantized(source_model, results[torch.float32][1])
    with torch.no_grad():
        ref = ref_model(ids).logits
    for dtype, (logits, _) in results.items():
        rel = _rel(logits, ref)
        assert rel <= REL, (arch, backend, dtype, rel)
    last = [
        n
        for n in results[torch.float32][1]
        if n.startswith(f"model.layers.{SMALL['num_hidden_layers'] - 1}.")
    ]
    assert (
        _control(ref_model, sorted(last)[0], ids, ref) > 1.5 * REL
    )  # the tolerance tells a wrong module


def test_moe_keep_output_loads_per_expert(tmp_path):
    """A --moe keep trtllm output (canonical per-expert experts) serves the same MoE blocks."""
    src, source_model = _source(tmp_path, "qwen3_moe")
    fused, keep = tmp_path / "fused", tmp_path / "keep"
    convert(str(src), "trtllm", fused)
    convert(str(src), "trtllm", keep, moe="keep")
    ids = torch.randint(0, SMALL["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(2))
    logits = {}
    for root in (fused, keep):
        model = _fresh(root, torch.float32)
        report = load_into(model, load_checkpoint(root))
        kinds = {
            model.get_submodule(n).kind
            for n in report.replaced
            if isinstance(model.get_submodule(n), MXFP8Experts)
        }
        assert kinds == {"fused" if root == fused else "per-expert"}
        with torch.no_grad():
            logits[root] = model(ids).logits
    assert _rel(logits[keep], logits[fused]) <= REL


def test_experts_never_silently_random(tmp_path):
    src, _ = _source(tmp_path, "qwen3_moe")
    out = tmp_path / "out"
    convert(str(src), "trtllm", out)
    ck = load_checkpoint(out)
    block = ck.marker["moe"]["layers"][0]
    ck.marker["moe"]["layers"].remove(block)  # a checkpoint without this block's experts
    for name in [n for n in ck.tensors if n.startswith(block + ".")]:
        ck.tensors.pop(name)
    with pytest.raises(LayoutError) as e:
        load_into(_fresh(out, torch.float32), ck, strict=False)
    assert str(e.value) == (
        f"{block}: the checkpoint holds no experts for this MoE block "
        "(1 block(s) in all); they would stay as initialized"
    )


def test_fused_block_refused_where_the_model_has_no_experts_module(tmp_path):
    src, _ = _source(tmp_path, "qwen3_moe")
    out = tmp_path / "out"
    convert(str(src), "trtllm", out)
    model = _fresh(out, torch.float32)
    block = "model.layers.0.mlp.experts"
    parent = model.get_submodule("model.layers.0.mlp")
    parent.experts = nn.ModuleList(nn.Module() for _ in range(4))  # per-expert modules, older style
    with pytest.raises(LayoutError) as e:
        load_into(model, load_checkpoint(out), strict=False)
    assert str(e.value) == (
        f"{block}: the checkpoint holds this MoE block fused (trtllm), but the model "
        "has a ModuleList, not an experts module"
    )


def test_experts_of_another_activation_refused(tmp_path):
    src, _ = _source(tmp_path, "qwen3_moe")
    out = tmp_path / "out"
    convert(str(src), "trtllm", out)
    # before the edit: the loader refuses a file the marker does not describe
    ckpt = load_checkpoint(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LayoutError) as e:
        load_into(_fresh(out, torch.float32), ckpt, strict=False)
    assert str(e.value) == (
        "model.layers.0.mlp.experts: the checkpoint holds these experts in MXFP8 (fused), "
        "but the model's experts have an activation other than silu(gate) * up over "
        "[gate; up]; MXFP8 experts run SwiGLU experts without biases only"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_returns_the_input_dtype(dtype):
    torch.manual_seed(0)
    w = torch.randn(256, 512)
    b = torch.randn(256)
    layer = MXFP8Linear(MXFP8Weight.quantize(w, "cutlass"), b)
    x = torch.randn(3, 512).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 256)
    assert torch.equal(y.float(), y.float().to(torch.bfloat16).float())  # bf16 values, cast
    ref = x.float() @ _dq(w).t() + b  # unquantized input: MXFP8 rounding of x apart
    assert float((y.float() - ref).norm() / ref.norm()) <= 0.05


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64]
)
def test_linear_refuses_other_input_dtypes(dtype):
    layer = MXFP8Linear(MXFP8Weight.quantize(torch.randn(256, 512), "cutlass", "model.up_proj"))
    with pytest.raises(LayoutError) as e:
        layer(torch.zeros(3, 512, dtype=dtype))
    assert str(e.value) == f"model.up_proj: input dtype {dtype} is not bf16, fp16 or fp32"


def test_model_to_dtype_keeps_the_mxfp8_bytes():
    layer = MXFP8Linear(MXFP8Weight.quantize(torch.randn(256, 512), "cutlass"))
    before = layer.mx_weight.data.view(torch.uint8).clone()
    layer.to(torch.bfloat16)
    assert layer.weight_data.dtype == torch.uint8 and torch.equal(
        layer.mx_weight.data.view(torch.uint8), before
    )


def test_cuda_without_cuda_is_our_error(tmp_path, monkeypatch):
    if torch.cuda.is_available():  # a GPU machine: as if it had none
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    src, _ = _source(tmp_path, "llama")
    convert(str(src), "cutlass", tmp_path / "out")
    with pytest.raises(BackendUnavailableError) as e:
        load_checkpoint(tmp_path / "out", device="cuda")
    why = (
        f"this torch ({torch.__version__}) is built without CUDA"
        if torch.version.cuda is None
        else "torch finds no CUDA GPU"
    )
    assert str(e.value) == f"device cuda is not available: {why}"
    assert e.value.hint == "use device='cpu' (the reference engine), or install a CUDA torch"
