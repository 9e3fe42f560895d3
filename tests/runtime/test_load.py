"""load_checkpoint: reads docs/FORMAT.md checkpoints byte for byte and refuses what it cannot trust."""

from __future__ import annotations

import json

import pytest
import torch

from mxfp8_convert.errors import BackendUnavailableError, LayoutError, MarkerError, SourceError
from mxfp8_convert.runtime import (
    COMPLETE_MARKER,
    MXFP8Weight,
    load_checkpoint,
    quantize_mxfp8,
    read_marker,
)
from tests.runtime.ckpt_writer import make_marker, write_checkpoint

LAYOUTS = ("trtllm", "cutlass")


def _weights(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.layers.0.self_attn.kv_a_proj_with_mqa": (576, 512), "model.layers.0.mlp.up_proj": (256, 256)}
    return {name: MXFP8Weight.from_canonical(*quantize_mxfp8(torch.randn(n, k, generator=g)), layout, name)
            for name, (n, k) in shapes.items()}


def _other():
    return {"model.norm.weight": torch.ones(256, dtype=torch.bfloat16),
            "model.layers.0.mlp.up_proj.bias": torch.randn(256, dtype=torch.bfloat16)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shards", [1, 2])
def test_loads_bytes_as_stored(tmp_path, layout, shards):
    ws = _weights(layout)
    write_checkpoint(tmp_path / "ck", ws, _other(), backend=layout, shards=shards)
    ck = load_checkpoint(tmp_path / "ck", backend=layout)
    assert ck.backend == layout and ck.engine == "reference"
    assert set(ck.weights) == set(ws)
    for name, w in ws.items():
        got = ck.weights[name]
        assert got.layout == layout and got.shape == w.shape and got.name == name
        assert torch.equal(got.data.view(torch.uint8), w.data.view(torch.uint8))
        assert torch.equal(got.scale, w.scale)
    assert set(ck.tensors) == set(_other())


def test_keeps_canonical_modules(tmp_path):
    ws = _weights("trtllm")
    q, code = quantize_mxfp8(torch.randn(40, 96))
    ws["model.small"] = MXFP8Weight.from_canonical(q, code, "canonical", "model.small")
    write_checkpoint(tmp_path / "ck", ws, backend="trtllm", shards=2)
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.weights["model.small"].layout == "canonical"
    with pytest.raises((MarkerError, BackendUnavailableError)):
        load_checkpoint(tmp_path / "ck", engine="flashinfer")


def test_refuses_without_completion_marker(tmp_path):
    write_checkpoint(tmp_path / "ck", _weights("trtllm"), backend="trtllm", complete=False)
    with pytest.raises(MarkerError, match=COMPLETE_MARKER):
        load_checkpoint(tmp_path / "ck")


def test_refuses_plain_mxfp8_and_missing_marker(tmp_path):
    root = write_checkpoint(tmp_path / "ck", _weights("trtllm"), backend="trtllm")
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp8", "fmt": "e4m3"}
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MarkerError, match="not an mxfp8-convert output"):
        read_marker(root)
    del cfg["quantization_config"]
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MarkerError, match="no quantization_config"):
        read_marker(root)
    (root / "config.json").unlink()
    with pytest.raises(MarkerError, match="no config.json"):
        read_marker(root)
    with pytest.raises(SourceError):
        read_marker(tmp_path / "nowhere")


@pytest.mark.parametrize("key,value,match", [
    ("format_version", 3, "format_version"),
    ("format_version", 0, "format_version"),
    ("backend", "marlin", "unknown backend"),
    ("scale_layout", "128x4", "does not match backend"),
    ("weight_layout", "identity", "does not match backend"),
    ("epilogue_tile_m", 256, "epilogue_tile_m"),
    ("scale_suffix", "weight_scale_inv", "scale_suffix"),
])
def test_refuses_unknown_or_inconsistent_marker(tmp_path, key, value, match):
    marker = make_marker("trtllm", **{key: value})
    write_checkpoint(tmp_path / "ck", _weights("trtllm"), backend="trtllm", marker=marker)
    with pytest.raises(MarkerError, match=match):
        load_checkpoint(tmp_path / "ck")


def test_refuses_backend_mismatch(tmp_path):
    write_checkpoint(tmp_path / "ck", _weights("cutlass"), backend="cutlass")
    with pytest.raises(MarkerError, match="laid out for cutlass, but trtllm was asked for"):
        load_checkpoint(tmp_path / "ck", backend="trtllm")


def test_refuses_engine_that_cannot_run_it(tmp_path):
    write_checkpoint(tmp_path / "ck", _weights("trtllm"), backend="trtllm")
    with pytest.raises(BackendUnavailableError, match="SM100"):
        load_checkpoint(tmp_path / "ck", engine="flashinfer")  # CPU device


def test_refuses_shard_marker_mismatch_or_absence(tmp_path):
    bad = make_marker("cutlass")
    write_checkpoint(tmp_path / "a", _weights("trtllm"), backend="trtllm", shards=2, shard_marker=bad)
    with pytest.raises(MarkerError, match="shard marker differs"):
        load_checkpoint(tmp_path / "a")
    root = write_checkpoint(tmp_path / "b", _weights("trtllm"), backend="trtllm")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(root / "model.safetensors"))
    save_file(tensors, str(root / "model.safetensors"))  # metadata gone
    with pytest.raises(MarkerError, match="no mxfp8_convert marker"):
        load_checkpoint(root)


def test_refuses_bad_tensor_shapes(tmp_path):
    ws = _weights("trtllm")
    name = "model.layers.0.mlp.up_proj"
    w = ws[name]
    ws[name] = MXFP8Weight(w.data, w.scale, "trtllm", name)
    root = write_checkpoint(tmp_path / "ck", ws, backend="trtllm")
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(root / "model.safetensors"), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[f"{name}.weight_scale_swizzled"] = tensors[f"{name}.weight_scale_swizzled"][:, :1].contiguous()
    save_file(tensors, str(root / "model.safetensors"), metadata=meta)
    with pytest.raises(LayoutError, match="scale of a"):
        load_checkpoint(root)
    del tensors[f"{name}.weight"]
    save_file(tensors, str(root / "model.safetensors"), metadata=meta)
    with pytest.raises(LayoutError, match="scale without its weight"):
        load_checkpoint(root)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reads_the_real_converters_output(tmp_path, layout):
    """End to end with mxfp8_convert.convert (written independently against the same contract)."""
    convert = pytest.importorskip("mxfp8_convert.convert").convert
    synth = pytest.importorskip("mxfp8_convert.synth")
    src = synth.write_checkpoint(tmp_path / "src", synth.SynthSpec(
        extra_modules=(("model.layers.0.self_attn.kv_a_proj_with_mqa", 576, 256),)))
    convert(str(src), layout, tmp_path / "out")
    ck = load_checkpoint(tmp_path / "out", backend=layout)
    from safetensors import safe_open

    from mxfp8_convert.runtime.reference import reference_linear

    with safe_open(str(next(src.glob("*00001*.safetensors"))), "pt") as f:
        names = [k for k in f.keys() if k.endswith(".weight_scale_inv")]
    assert len(ck.weights) == len(synth.linear_names(synth.SynthSpec(
        extra_modules=(("model.layers.0.self_attn.kv_a_proj_with_mqa", 576, 256),))))
    src_tensors = {}
    for path in src.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            src_tensors.update({k: f.get_tensor(k) for k in f.keys()})
    x = torch.randn(3, 256).bfloat16()
    for name, w in ck.weights.items():
        if w.shape[1] != 256:
            continue
        q, code = src_tensors[f"{name}.weight"], src_tensors[f"{name}.weight_scale_inv"]
        from mxfp8_convert.runtime import mxfp8_linear

        assert torch.equal(mxfp8_linear(x, w), reference_linear(x, q, code)), name
    assert names is not None


def test_reads_format_version_1_as_well(tmp_path):
    """Version 1 differs only by the missing tp_compat: same tensors, same bytes."""
    marker = make_marker("trtllm", format_version=1)
    write_checkpoint(tmp_path / "ck", _weights("trtllm"), backend="trtllm", marker=marker)
    assert load_checkpoint(tmp_path / "ck").marker["format_version"] == 1
