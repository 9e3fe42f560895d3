"""Every source format (SPEC section 4) to every target, and the way back to canonical."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from mxfp8_convert import convert
from mxfp8_convert.backends import KERNEL_BACKENDS
from mxfp8_convert.errors import ConvertError, LayoutError
from mxfp8_convert.quantize import dequantize_mxfp8, quantize_mxfp8
from mxfp8_convert.synth import (
    FP8_DIALECTS,
    SynthSpec,
    linear_names,
    scale_suffix,
    write_checkpoint,
)
from tests.checkpoints import load_all, to_canonical

# DeepSeek-style: an MLA-shaped module (N = 576) and one whose K (160) is not a multiple of 128
MLA = (("model.layers.0.self_attn.kv_a_proj_with_mqa", 576, 256),
       ("model.layers.0.self_attn.kv_b_proj", 512, 160))
SMALL = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256)
SPEC = replace(SMALL, extra_modules=MLA)


def laid_out_canonical(backend: str, got: dict, module: str, n: int, k: int):
    """``module``'s weight and scale in a laid-out output, inverted to canonical bytes."""
    w, s = got[f"{module}.weight"], got[f"{module}.weight_scale_swizzled"]
    return to_canonical(backend, w, s, n, k)


def _spec(dialect, **kw):
    from dataclasses import replace

    return replace(SPEC, dialect=dialect, **kw)


def _source_dequant(dialect, w, scale, n, k):
    """The source's own float32 values (SPEC section 4: scale is a multiplier)."""
    wf = w.to(torch.float32)
    if "block" in dialect:
        rows = torch.arange(n) // 128
        cols = torch.arange(k) // 128
        return wf * scale[rows][:, cols]
    return wf * scale.reshape(-1, 1) if scale.numel() > 1 else wf * scale.reshape(())


@pytest.mark.parametrize("backend", [*KERNEL_BACKENDS, "canonical"])
@pytest.mark.parametrize("dialect", FP8_DIALECTS)
def test_lossless_fp8_keeps_bytes_and_values(tmp_path, dialect, backend):
    src = write_checkpoint(tmp_path / "src", _spec(dialect, pow2_scales=True))
    r = convert(src, backend, tmp_path / "out", on_ineligible="keep")
    assert set(r.plan.to_dict()["modules_by_action"]) == {"lossless"}
    assert r.quantization_errors == {}
    got, _ = load_all(tmp_path / "out")
    want, _ = load_all(src)
    for module, n, k in linear_names(_spec(dialect)):
        m = next(x for x in r.plan.modules if x.name == module)
        if m.layout == "canonical":
            q, s = got[f"{module}.weight"].view(torch.uint8), got[f"{module}.weight_scale_inv"]
        else:
            q, s = laid_out_canonical(backend, got, module, n, k)
        w = want[f"{module}.weight"]
        assert torch.equal(q, w.view(torch.uint8)), f"{module}: e4m3 bytes must be kept"
        ref = _source_dequant(dialect, w, want[f"{module}.{scale_suffix(dialect)}"], n, k)
        assert torch.equal(dequantize_mxfp8(q.view(torch.float8_e4m3fn), s), ref), module


@pytest.mark.parametrize("dialect", FP8_DIALECTS)
def test_non_pow2_fp8_is_requantized_and_reports_error(tmp_path, dialect):
    src = write_checkpoint(tmp_path / "src", _spec(dialect, pow2_scales=False))
    r = convert(src, "cutlass", tmp_path / "out")
    modules = linear_names(_spec(dialect))
    assert r.plan.to_dict()["modules_by_action"] == {"requantize": len(modules)}
    assert set(r.quantization_errors) == {m for m, _, _ in modules}
    got, _ = load_all(tmp_path / "out")
    want, _ = load_all(src)
    for module, n, k in modules:
        source_scale = want[f"{module}.{scale_suffix(dialect)}"]
        ref = _source_dequant(dialect, want[f"{module}.weight"], source_scale, n, k)
        q, s = laid_out_canonical("cutlass", got, module, n, k)
        eq, es = quantize_mxfp8(ref)
        assert torch.equal(q, eq.view(torch.uint8)) and torch.equal(s, es), module
        deq = dequantize_mxfp8(q.view(torch.float8_e4m3fn), s).double()
        rel = float((deq - ref.double()).norm() / ref.double().norm())
        rec = r.quantization_errors[module]
        assert rec["action"] == "requantize" and rec["rel_fro"] == pytest.approx(rel, rel=1e-6)
        # e4m3 rounding is at most 2^-4 relative per element, so SQNR >= 20 log10(16) = 24.1 dB
        assert rec["sqnr_db"] == pytest.approx(-20 * math.log10(rel), rel=1e-6)
        assert rec["sqnr_db"] > 24.0
    done = json.loads((tmp_path / "out" / "mxfp8_convert.complete.json").read_text())
    assert done["quantization_errors"] == r.quantization_errors


def test_per_channel_fp8(tmp_path):
    src = write_checkpoint(tmp_path / "src", _spec("fp8", per_channel=True, pow2_scales=True))
    r = convert(src, "trtllm", tmp_path / "out", on_ineligible="keep")
    assert set(r.plan.to_dict()["modules_by_action"]) == {"lossless"}
    got, _ = load_all(tmp_path / "out")
    # a static activation scale: dropped (MXFP8 activations are quantized dynamically), and said
    assert "model.layers.0.self_attn.q_proj.input_scale" not in got
    assert "model.layers.0.self_attn.q_proj.input_scale" in r.plan.to_dict()["dropped_tensors"]


def test_dense_bf16_is_quantized_with_flashinfer_recipe(tmp_path):
    src = write_checkpoint(tmp_path / "src", _spec("dense"))
    r = convert(src, "trtllm", tmp_path / "out", on_ineligible="keep")
    got, _ = load_all(tmp_path / "out")
    want, _ = load_all(src)
    modules = linear_names(_spec("dense"))
    assert r.plan.to_dict()["modules_by_action"] == {"quantize": len(modules)}
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want[name]), name
    module, n, k = modules[0]
    q, s = laid_out_canonical("trtllm", got, module, n, k)
    eq, es = quantize_mxfp8(want[f"{module}.weight"])
    assert torch.equal(q, eq.view(torch.uint8)) and torch.equal(s, es)
    assert all(v["action"] == "quantize" for v in r.quantization_errors.values())
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["original_quantization_config"] is None and cfg["source"]["dialect"] == "dense"


def test_dense_ignore_patterns(tmp_path):
    src = write_checkpoint(tmp_path / "src", _spec("dense"))
    r = convert(src, "cutlass", tmp_path / "out", ignore=["*.mlp.*"], on_ineligible="keep")
    names = {m.name for m in r.plan.modules}
    assert names and not any(".mlp." in n for n in names)
    got, _ = load_all(tmp_path / "out")
    assert got["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_nan_in_dense_source_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    src = write_checkpoint(tmp_path / "src", _spec("dense", layers=1))
    shard = next(p for p in sorted(src.glob("*.safetensors"))
                 if "model.layers.0.mlp.up_proj.weight" in load_file(p))
    t = load_file(shard)
    t["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(t, shard)
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: "
                                          r"non-finite value nan at row 3, column 5"):
        convert(src, "cutlass", tmp_path / "out", on_ineligible="keep")
    assert not (tmp_path / "out").exists()


def test_nan_byte_in_mxfp8_weight_and_255_scale(tmp_path):
    from safetensors.torch import load_file, save_file

    src = write_checkpoint(tmp_path / "src", SMALL)
    name = "model.layers.0.mlp.down_proj.weight"
    shard = next(p for p in sorted(src.glob("*.safetensors")) if name in load_file(p))
    t = load_file(shard)
    orig = t[name].clone()
    t[name].view(torch.uint8)[7, 9] = 0xFF
    save_file(t, shard)
    for backend in KERNEL_BACKENDS:
        with pytest.raises(LayoutError, match=r"down_proj\.weight' holds NaN .* at \[7, 9\]"):
            convert(src, backend, tmp_path / "out")
    t[name] = orig
    t["model.layers.0.mlp.down_proj.weight_scale_inv"][1, 2] = 255
    save_file(t, shard)
    with pytest.raises(LayoutError, match=r"down_proj\.weight_scale_inv' holds NaN "
                                          r"\(UE8M0 byte 255\) at \[1, 2\]"):
        convert(src, "trtllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_canonical_roundtrip_is_byte_identical(tmp_path, backend):
    spec = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                     extra_modules=(("model.layers.0.self_attn.kv_a_proj_with_mqa", 576, 256),))
    src = write_checkpoint(tmp_path / "src", spec)
    convert(src, backend, tmp_path / "laid")
    convert(tmp_path / "laid", "canonical", tmp_path / "back")
    got, meta = load_all(tmp_path / "back")
    want, _ = load_all(src)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
    back = tmp_path / "back"
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (src / "config.json").read_text())
    assert all("mxfp8_convert" not in m for m in meta.values())
    assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # the README is a plain-MXFP8 model card that keeps the source's own card (not nested twice)
    card = (tmp_path / "back" / "README.md").read_text()
    assert card.count("## Original model card") == 1 and "Made by mxfp8_convert.synth" in card


def test_laid_out_to_other_backend_equals_direct(tmp_path):
    src = write_checkpoint(tmp_path / "src", SMALL)
    convert(src, "trtllm", tmp_path / "t")
    convert(tmp_path / "t", "cutlass", tmp_path / "t2c")
    convert(src, "cutlass", tmp_path / "c")
    a, _ = load_all(tmp_path / "t2c")
    b, _ = load_all(tmp_path / "c")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_same_backend_twice_is_refused(tmp_path):
    src = write_checkpoint(tmp_path / "src", SMALL)
    convert(src, "trtllm", tmp_path / "t")
    with pytest.raises(ConvertError, match="already laid out for trtllm"):
        convert(tmp_path / "t", "trtllm", tmp_path / "t2")


def test_mxfp8_source_to_canonical_normalises_e8m0_scales(tmp_path):
    spec = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                     dialect="compressed_tensors_mxfp8", scale_dtype=torch.float8_e8m0fnu)
    src = write_checkpoint(tmp_path / "src", spec)
    convert(src, "canonical", tmp_path / "c")
    got, _ = load_all(tmp_path / "c")
    want, _ = load_all(src)
    s = got["model.layers.0.mlp.up_proj.weight_scale_inv"]
    assert s.dtype == torch.uint8
    assert torch.equal(s, want["model.layers.0.mlp.up_proj.weight_scale"].view(torch.uint8))
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "mxfp8" and cfg["weight_block_size"] == [1, 32]
    assert cfg["ignored_layers"] == ["lm_head"]


@pytest.mark.parametrize("libc", [True, False], ids=["memchr", "mmap.find"])
def test_nan_byte_scan_finds_the_first_of_either_byte_across_blocks(tmp_path, monkeypatch, libc):
    """ShardReader.find_byte scans block by block with libc memchr (GIL released), or with
    mmap.find where there is no libc memchr: the first 0x7F or 0xFF in the range, wherever the
    block boundaries fall, and -1 for a clean range."""
    import numpy as np

    import mxfp8_convert.read as read

    calls = []
    if libc:
        real = read._memchr
        assert real is not None
        monkeypatch.setattr(read, "_memchr", lambda *a: calls.append(a) or real(*a))
    else:
        monkeypatch.setattr(read, "_memchr", None)
    monkeypatch.setattr(read, "SCAN_BLOCK", 64)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 0x7F, 1000, dtype=np.uint8)
    data[[130, 700]] = 0xFF
    data[[128 + 65, 500]] = 0x7F
    (tmp_path / "f").write_bytes(data.tobytes())
    r = read.ShardReader(tmp_path, "f", 1000)
    try:
        nan = bytes([0x7F, 0xFF])
        spans = [(0, 1000), (3, 200), (129, 64), (131, 400), (194, 306), (501, 199), (701, 299),
                 (0, 0)]
        for begin, n in spans:
            hits = np.flatnonzero((data[begin:begin + n] & 0x7F) == 0x7F)
            want = begin + int(hits[0]) if hits.size else -1
            assert r.find_byte(begin, n, nan) == want, (begin, n)
    finally:
        r.close()
    assert bool(calls) == libc
    assert all(size <= 64 for _, _, size in calls)
