"""A tiny Llama-style model, end to end: quantize, lay out, write, load, ``load_into``, run.

Two oracles:

- *emulation* (exact): the same bf16 model whose linears run ``reference_linear`` on the canonical
  (never laid out) bytes. The runtime must match it bit for bit, since every step is exact
  except one float32 matmul per layer done the same way.
- *dequantized weights* (approximate): the float32 model with each weight replaced by its exact
  dequantization and full-precision activations. The runtime differs from it by the MXFP8
  rounding of every linear's input (e4m3: 3 mantissa bits, relative error up to 2^-4 per element,
  ~2-3 % RMS) plus bf16 activations between layers; through 2 layers and 8 linears that gives a
  logits error of a few percent at most, so we require ||d|| / ||ref|| <= 0.08 and top-1
  agreement on >= 90 % of positions (measured here: 0.012 and 100 %, both layouts).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxfp8_convert.runtime import (
    MXFP8Linear,
    MXFP8Weight,
    load_checkpoint,
    load_into,
    reference_linear,
)
from mxfp8_convert.runtime.reference import dequantize_mxfp8
from tests.runtime.ckpt_writer import write_checkpoint
from tests.runtime.tiny_llama import TinyLlama

CFG = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-5}


class EmulatedLinear(nn.Module):
    def __init__(self, q, code):
        super().__init__()
        self.q, self.code = q, code

    def forward(self, x):
        return reference_linear(x, self.q, self.code)


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _source_model(seed=0):
    torch.manual_seed(seed)
    model = TinyLlama(CFG)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1)
        for norm in [m for m in model.modules() if m.__class__.__name__ == "RMSNorm"]:
            norm.weight.uniform_(0.5, 1.5)
    return model


def _write(tmp_path, model, layout, shards):
    quantized = {n: MXFP8Weight.quantize(m.weight.detach().float(), layout, n)
                 for n, m in _linears(model).items()}
    other = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()
             if k.rsplit(".", 1)[0] not in quantized}
    root = write_checkpoint(tmp_path / layout, quantized, other, backend=layout, shards=shards,
                            config=CFG)
    return root, {n: w.canonical() for n, w in quantized.items()}


@pytest.mark.parametrize("layout,shards", [("trtllm", 2), ("cutlass", 1)])
def test_tiny_llama_end_to_end(tmp_path, layout, shards):
    src = _source_model()
    root, canon = _write(tmp_path, src, layout, shards)
    ids = torch.randint(0, CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))

    ck = load_checkpoint(root, backend=layout)
    model = TinyLlama(ck.config).to(torch.bfloat16)
    report = load_into(model, ck)
    assert sorted(report.replaced) == sorted(canon)
    assert "lm_head.weight" in report.copied and not report.missing and not report.unexpected
    assert all(isinstance(m, MXFP8Linear) for n, m in model.named_modules() if n in canon)
    logits = model(ids)
    assert torch.isfinite(logits).all()

    emulated = TinyLlama(CFG).to(torch.bfloat16)
    emulated.load_state_dict({k: v for k, v in ck.tensors.items()}, strict=False)
    for name, (q, code) in canon.items():
        _swap(emulated, name, EmulatedLinear(q, code))
    assert torch.equal(logits, emulated(ids))

    dequant = TinyLlama(CFG)
    dequant.load_state_dict({k: v.float() for k, v in ck.tensors.items()}, strict=False)
    with torch.no_grad():
        for name, (q, code) in canon.items():
            dequant.get_submodule(name).weight.copy_(dequantize_mxfp8(q, code))
    ref = dequant(ids)
    rel = float((logits - ref).detach().norm() / ref.detach().norm())
    top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    assert rel <= 0.08, rel
    assert top1 >= 0.9, top1


@pytest.mark.parametrize("layout", ["trtllm", "cutlass"])
def test_model_from_real_converter(tmp_path, layout):
    """Synthetic SGLang-MXFP8 source -> mxfp8_convert.convert -> TinyLlama(config.json) ->
    logits."""
    convert = pytest.importorskip("mxfp8_convert.convert").convert
    synth = pytest.importorskip("mxfp8_convert.synth")
    src = synth.write_checkpoint(tmp_path / "src", synth.SynthSpec())
    convert(str(src), layout, tmp_path / "out")
    ck = load_checkpoint(tmp_path / "out", backend=layout)
    model = TinyLlama(ck.config).to(torch.bfloat16)
    report = load_into(model, ck)
    assert len(report.replaced) == 14 and "lm_head.weight" in report.copied
    ids = torch.arange(12).reshape(1, 12)
    logits = model(ids)
    assert torch.isfinite(logits).all()

    from safetensors import safe_open

    tensors = {}
    for path in src.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    emulated = TinyLlama(ck.config).to(torch.bfloat16)
    emulated.load_state_dict({k: v for k, v in ck.tensors.items()}, strict=False)
    for name in report.replaced:
        linear = EmulatedLinear(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"])
        _swap(emulated, name, linear)
    assert torch.equal(logits, emulated(ids))


def test_load_into_strict_reports_mismatch(tmp_path):
    from mxfp8_convert.errors import LayoutError

    root, _ = _write(tmp_path, _source_model(), "cutlass", 1)
    ck = load_checkpoint(root)
    cfg = {**CFG, "num_hidden_layers": 1}
    with pytest.raises(LayoutError, match="unexpected"):
        load_into(TinyLlama(cfg), ck)
    report = load_into(TinyLlama(cfg), load_checkpoint(root), strict=False)
    assert report.unexpected and len(report.replaced) == 7
    wrong = {**CFG, "intermediate_size": 1024}
    with pytest.raises(LayoutError, match="model expects"):
        load_into(TinyLlama(wrong), load_checkpoint(root))
