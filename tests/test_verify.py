"""verify and inspect: library and CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mxfp8_convert import convert
from mxfp8_convert.cli import main
from mxfp8_convert.errors import SourceError, VerifyError
from mxfp8_convert.inspection import inspect_checkpoint
from mxfp8_convert.layouts import p32_row_indices
from mxfp8_convert.read import open_checkpoint
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from mxfp8_convert.verify import Mismatch, verify
from tests.checkpoints import flip_byte

SPEC = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                 extra_modules=(("model.layers.0.self_attn.kv_a_proj_with_mqa", 576, 256),))


@pytest.fixture()
def converted(tmp_path):
    src = write_checkpoint(tmp_path / "src", SPEC)
    convert(src, "trtllm", tmp_path / "out")
    return src, tmp_path / "out"


@pytest.mark.parametrize("dialect,pow2", [("sglang_mxfp8", True), ("block_fp8", True),
                                          ("block_fp8", False),
                                          ("fp8", False), ("dense", True)])
@pytest.mark.parametrize("backend", ["trtllm", "cutlass", "canonical"])
def test_verify_passes_for_every_kind_of_source(tmp_path, dialect, pow2, backend):
    src = write_checkpoint(tmp_path / "src", replace(SPEC, dialect=dialect, pow2_scales=pow2))
    convert(src, backend, tmp_path / "out", on_ineligible="keep")
    report = verify(tmp_path / "out", src)
    assert report.ok, [str(m) for m in report.mismatches]
    assert report.modules_compared == 8 and report.files_checked > 0


def test_tampered_weight_names_tensor_and_logical_position(converted):
    src, out = converted
    name = "model.layers.0.mlp.up_proj.weight"
    physical_row, col, k = 37, 11, 256
    flip_byte(out, name, physical_row * k + col)
    report = verify(out, src, check_hashes=False)
    logical_row = int(p32_row_indices(512)[physical_row])
    assert [str(m) for m in report.mismatches] == [
        f"model.layers.0.mlp.up_proj.weight: differs from the source's canonical MXFP8 (row, col) "
        f"at [{logical_row}, {col}]"]
    hashed = verify(out, src)
    assert any("xxh3_128 hash differs" in str(m) for m in hashed.mismatches)


def test_tampered_scale_and_passthrough(converted):
    src, out = converted
    flip_byte(out, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_swizzled", 0)
    flip_byte(out, "model.norm.weight", 2)
    whats = {m.where: m for m in verify(out, src, check_hashes=False).mismatches}
    assert whats["model.layers.0.self_attn.kv_a_proj_with_mqa.scale"].position == [0, 0]
    assert whats["model.norm.weight"].what == "pass-through tensor differs from the source"
    assert whats["model.norm.weight"].position == [1]  # bf16 element 1 holds byte 2


def test_missing_completion_marker(converted, capsys):
    _, out = converted
    (out / "mxfp8_convert.complete.json").unlink()
    with pytest.raises(VerifyError, match="no mxfp8_convert.complete.json: incomplete"):
        verify(out)
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and "incomplete" in err and "Traceback" not in err


def test_cli_verify_json_and_exit_codes(converted, capsys):
    src, out = converted
    assert main(["verify", str(out), "--source", str(src), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["modules_compared"] == 8
    flip_byte(out, "model.layers.0.mlp.down_proj.weight", 5)
    assert main(["verify", str(out), "--source", str(src), "--json", "--no-hashes"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert not doc["ok"] and doc["mismatches"][0]["where"] == "model.layers.0.mlp.down_proj.weight"
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("Error: verification failed: model.layers.0.mlp.down_proj.weight")


def test_wrong_source_is_reported(converted, tmp_path):
    _, out = converted
    # same structure, other bytes: the headers-v1 fingerprint agrees, the byte comparison does not
    other = write_checkpoint(tmp_path / "other", replace(SPEC, seed=99))
    report = verify(out, other, check_hashes=False)
    assert not report.ok
    assert report.mismatches[0].what == "differs from the source's canonical MXFP8 (row, col)"
    # other structure: the fingerprint says so first
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(cfg))
    report = verify(out, other, check_hashes=False)
    assert report.mismatches[0].what == "fingerprint differs from the one recorded at conversion"


def test_record_shape_mismatch_is_caught(converted):
    _, out = converted
    # rewrite the shard metadata's records with a wrong logical shape (same byte length header)
    ckpt = open_checkpoint(out)
    info = ckpt.tensors["model.layers.0.mlp.up_proj.weight_scale_swizzled"]
    raw = (out / info.file).read_bytes()
    old = b'logical_shape\\":[512,8]'  # JSON inside JSON: the quote is escaped
    new = b'logical_shape\\":[512,9]'
    assert raw.count(old) >= 1
    (out / info.file).write_bytes(raw.replace(old, new, 1))
    report = verify(out, check_hashes=False)
    assert any("scale of [512, 9] is U8" in m.what for m in report.mismatches)


def test_inspect_source_and_output(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", replace(SPEC, intermediate=288))
    rep = inspect_checkpoint(src)
    assert rep.format == "sglang_mxfp8" and rep.backend is None and rep.shards == 2
    down = next(m for m in rep.modules if m.name.endswith("down_proj"))
    assert down.backends["trtllm"] == ["K=288 is not a multiple of 256"]
    assert down.backends["cutlass"] == []
    assert rep.count_by_role["weight"] == 8 and rep.count_by_role["weight_scale"] == 8
    assert rep.actions["trtllm"].startswith("not possible") is False
    assert "keep" in rep.actions["trtllm"]
    convert(src, "cutlass", tmp_path / "out")
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "mxfp8_convert" and doc["backend"] == "cutlass"
    assert doc["complete"] is True
    assert all(m["layout"] == "cutlass" for m in doc["modules"])
    assert doc["conversion"]["cutlass"].startswith("not possible")


# --- the completion marker covers the whole folder (issue 22 item 7) -------------------------
def _rewrite_completion(out, **changes):
    p = out / "mxfp8_convert.complete.json"
    done = json.loads(p.read_text())
    done.update(changes)
    p.write_text(json.dumps(done))
    return done


def test_empty_files_map_no_longer_passes(converted):
    _, out = converted
    listed = sorted(json.loads((out / "mxfp8_convert.complete.json").read_text())["files"])
    _rewrite_completion(out, files={})
    report = verify(out)
    assert not report.ok
    assert sorted(m.where for m in report.mismatches) == listed
    assert {m.what for m in report.mismatches} == {"not listed in the completion marker"}
    assert main(["verify", str(out), "--no-hashes"]) == 1


def test_a_file_the_marker_does_not_list_is_refused(converted):
    _, out = converted
    (out / "sub").mkdir()
    (out / "sub" / "extra.safetensors").write_bytes(b"x")
    (out / "link").symlink_to(out / "config.json")
    assert verify(out, check_hashes=False).mismatches == [
        Mismatch("link", "not listed in the completion marker"),
        Mismatch("sub/extra.safetensors", "not listed in the completion marker")]


def test_no_hashes_still_catches_a_size_change(converted):
    _, out = converted
    shard = next(iter(sorted(out.glob("*.safetensors"))))
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0")
    assert verify(out, check_hashes=False).mismatches == [
        Mismatch(shard.name, f"size {size + 1} != recorded {size}")]


def test_a_corrupted_byte_is_caught_by_the_hashes(converted):
    _, out = converted
    flip_byte(out, "model.norm.weight", 0)
    shard = open_checkpoint(out).tensors["model.norm.weight"].file
    expected = Mismatch(shard, "xxh3_128 hash differs from the completion marker")
    assert verify(out).mismatches == [expected]
    assert verify(out, check_hashes=False).ok  # what --no-hashes skips, its help says


def test_a_listed_link_leading_out_of_the_folder_is_refused(converted, tmp_path):
    _, out = converted
    outside = tmp_path / "decoy.json"
    outside.write_bytes((out / "config.json").read_bytes())  # same bytes: size and hash agree
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(outside)
    outside = "^file 'config.json' is a link that leads outside the model folder$"
    with pytest.raises(SourceError, match=outside):
        verify(out)


def test_completion_marker_with_escaping_paths_is_refused(converted):
    _, out = converted
    for rel in ("/etc/hostname", "../src/config.json"):
        _rewrite_completion(out, files={rel: {"size": 1, "xxh3_128": "0" * 32}})
        with pytest.raises(VerifyError, match="not a path inside the folder"):
            verify(out)
