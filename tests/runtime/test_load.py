"""load_checkpoint: reads docs/FORMAT.md checkpoints byte for byte and refuses what it cannot
trust."""

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
from tests.runtime.ckpt_writer import make_marker, write_checkpoint, write_completion

LAYOUTS = ("trtllm", "cutlass")


def _weights(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.layers.0.self_attn.kv_a_proj_with_mqa": (576, 512),
              "model.layers.0.mlp.up_proj": (256, 256)}
    return {name: MXFP8Weight.from_canonical(*quantize_mxfp8(torch.randn(n, k, generator=g)),
                                             layout, name)
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
    write_checkpoint(tmp_path / "a", _weights("trtllm"), backend="trtllm", shards=2,
                     shard_marker=bad)
    with pytest.raises(MarkerError, match="shard marker differs"):
        load_checkpoint(tmp_path / "a")
    root = write_checkpoint(tmp_path / "b", _weights("trtllm"), backend="trtllm")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(root / "model.safetensors"))
    save_file(tensors, str(root / "model.safetensors"))  # metadata gone
    write_completion(root, "trtllm")  # as if written so: the marker check is what refuses it
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
    scale = f"{name}.weight_scale_swizzled"
    tensors[scale] = tensors[scale][:, :1].contiguous()
    save_file(tensors, str(root / "model.safetensors"), metadata=meta)
    write_completion(root, "trtllm")
    with pytest.raises(LayoutError, match="scale of a"):
        load_checkpoint(root)
    del tensors[f"{name}.weight"]
    save_file(tensors, str(root / "model.safetensors"), metadata=meta)
    write_completion(root, "trtllm")
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


# --- the completion marker is checked in full (issue 22 item 7) -------------------------------
def _sealed(tmp_path, shards=2):
    return write_checkpoint(tmp_path / "ck", _weights("trtllm"), _other(), backend="trtllm",
                            shards=shards)


def _index(root):
    return json.loads((root / "model.safetensors.index.json").read_text())


def _point_index_at(root, shard, target):
    """Make the index send every tensor of ``shard`` to ``target``, then re-seal the folder."""
    index = _index(root)
    index["weight_map"] = {k: (target if v == shard else v) for k, v in index["weight_map"].items()}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    write_completion(root, "trtllm")


def test_refuses_a_size_change_of_any_listed_file(tmp_path):
    root = _sealed(tmp_path)
    with open(root / "model-00002-of-00002.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(MarkerError, match=r"model-00002-of-00002.safetensors: (\d+) bytes, "
                                          r"mxfp8_convert.complete.json records \d+$"):
        load_checkpoint(root)
    root = _sealed(tmp_path / "b")
    (root / "config.json").write_text((root / "config.json").read_text() + " ")
    with pytest.raises(MarkerError, match="config.json: .* bytes"):
        load_checkpoint(root)


def test_hash_check_catches_a_flipped_byte(tmp_path):
    root = _sealed(tmp_path)
    shard = root / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor's bytes: the size is unchanged
    shard.write_bytes(bytes(data))
    with pytest.raises(MarkerError,
                       match=f"^{shard}: xxh3_128 differs from mxfp8_convert.complete.json$"):
        load_checkpoint(root, check_hashes=True)
    load_checkpoint(root)  # the default checks sizes only


def test_refuses_missing_or_unlisted_files(tmp_path):
    root = _sealed(tmp_path)
    done = json.loads((root / COMPLETE_MARKER).read_text())
    del done["files"]["model-00001-of-00002.safetensors"]
    (root / COMPLETE_MARKER).write_text(json.dumps(done))
    with pytest.raises(MarkerError, match="model-00001-of-00002.safetensors: "
                                          "not listed in mxfp8_convert.complete.json$"):
        load_checkpoint(root)
    root = _sealed(tmp_path / "b")
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MarkerError, match="model-00002-of-00002.safetensors: "
                                          "listed in mxfp8_convert.complete.json "
                                          "but missing or not a file$"):
        load_checkpoint(root)
    root = _sealed(tmp_path / "c")
    (root / COMPLETE_MARKER).write_text(json.dumps({"format_version": 1, "complete": True}))
    with pytest.raises(MarkerError, match="not a format_version 1/2 completion marker"):
        load_checkpoint(root)


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_refuses_index_entries_outside_the_folder(tmp_path, how):
    """An index entry naming a shard outside the folder is refused, and that shard never read,
    even when it is a valid checkpoint shard (a decoy outside the folder)."""
    decoy = write_checkpoint(tmp_path / "decoy", _weights("trtllm", seed=1), backend="trtllm",
                             shards=2)
    root = _sealed(tmp_path)
    outside = decoy / "model-00001-of-00002.safetensors"
    target = str(outside) if how == "absolute" else "../decoy/model-00001-of-00002.safetensors"
    _point_index_at(root, "model-00001-of-00002.safetensors", target)
    with pytest.raises(SourceError,
                       match=f"shard '{target}' is not a path inside the model folder$"):
        load_checkpoint(root)


def test_refuses_a_shard_that_is_a_link_out_of_the_folder(tmp_path):
    decoy = write_checkpoint(tmp_path / "decoy", _weights("trtllm"), _other(), backend="trtllm",
                             shards=2)
    root = _sealed(tmp_path)
    shard = root / "model-00001-of-00002.safetensors"
    shard.unlink()
    # the same bytes: size and hash agree
    shard.symlink_to(decoy / "model-00001-of-00002.safetensors")
    with pytest.raises(SourceError, match="shard 'model-00001-of-00002.safetensors' "
                                          "is a link that leads outside the model folder$"):
        load_checkpoint(root, check_hashes=True)


def test_a_link_inside_the_folder_loads(tmp_path):
    root = _sealed(tmp_path)
    (root / "blobs").mkdir()
    shard = root / "model-00001-of-00002.safetensors"
    shard.rename(root / "blobs" / "x")
    shard.symlink_to("blobs/x")
    write_completion(root, "trtllm")
    assert set(load_checkpoint(root, check_hashes=True).weights) == set(_weights("trtllm"))
