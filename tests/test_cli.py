"""The CLI: exit codes, one-line errors on stderr, JSON on stdout, nothing left behind."""

from __future__ import annotations

import json
import struct
from dataclasses import replace

import pytest
import torch

from mxfp8_convert.synth import SynthSpec, write_checkpoint
from tests.checkpoints import leftovers, replace_tensor, tree_hashes
from tests.hostile import run_cli as run

SPEC = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=2)


@pytest.fixture()
def src(tmp_path):
    return write_checkpoint(tmp_path / "model", SPEC)


def assert_failed_cleanly(code, out, err, tmp_path, dest, expected_in_err):
    assert code == 1, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("Hint: ")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert expected_in_err in lines[0], lines[0]
    assert "Traceback" not in err and out == ""
    assert not dest.exists()
    assert leftovers(dest.parent) == []


def test_convert_json_is_one_document_on_stdout(capsys, src, tmp_path):
    code, out, err = run(capsys, src, "--backend", "trtllm", "-o", tmp_path / "o", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["backend"] == "trtllm" and doc["output"] == str(tmp_path / "o")
    assert doc["plan"]["modules_by_action"] == {"relayout": 7}
    assert (tmp_path / "o" / "mxfp8_convert.complete.json").exists()


def test_human_summary_and_dry_run(capsys, src, tmp_path):
    code, out, err = run(capsys, src, "--backend", "cutlass", "-o", tmp_path / "o", "--dry-run")
    assert code == 0 and "Dry run: nothing written" in out and "q_proj" in out
    assert not (tmp_path / "o").exists()


def test_version_and_help(capsys):
    from mxfp8_convert import __version__

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"mxfp8-convert {__version__}"
    code, out, _ = run(capsys, "convert", "--help")
    assert code == 0 and "Exit codes" in out and "--backend" in out


def test_usage_errors_exit_2(capsys, src, tmp_path):
    code, _, err = run(capsys, src, "--backend", "nope", "-o", tmp_path / "o")
    assert code == 2 and "nope" in err
    code, _, err = run(capsys, src, "-o", tmp_path / "o")
    assert code == 2 and "--backend" in err
    assert not (tmp_path / "o").exists()


def test_missing_folder(capsys, tmp_path):
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, tmp_path / "nope", "-b", "trtllm", "-o", dest), tmp_path,
                          dest, f"{tmp_path / 'nope'}: no such folder")


def test_unknown_format(capsys, src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, src, "-b", "trtllm", "-o", dest), tmp_path, dest,
                          "config.json: quant_method 'awq' is not supported")


def test_scale_shape_mismatch_names_the_tensor(capsys, src, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    shard = replace_tensor(src, name, torch.zeros(512, 4, dtype=torch.uint8))
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, src, "-b", "cutlass", "-o", dest), tmp_path, dest,
                          f"{shard}: scale '{name}' has shape [512, 4]; weight "
                          f"'model.layers.0.mlp.up_proj.weight' [512, 256] needs [512, 8]")


def test_k_not_multiple_of_32(capsys, src, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    replace_tensor(src, name, torch.zeros(512, 250, dtype=torch.uint8).view(torch.float8_e4m3fn))
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, src, "-b", "cutlass", "-o", dest), tmp_path, dest,
                          f"weight '{name}' has K=250, not a multiple of 32")


def test_malformed_index(capsys, src, tmp_path):
    (src / "model.safetensors.index.json").write_text("{not json")
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, src, "-b", "trtllm", "-o", dest), tmp_path, dest,
                          "model.safetensors.index.json: not valid JSON")


def test_index_naming_a_missing_shard(capsys, src, tmp_path):
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, src, "-b", "trtllm", "-o", dest), tmp_path, dest,
                          "model-00009-of-00009.safetensors: file not found")


def test_truncated_shard(capsys, src, tmp_path):
    shard = src / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, src, "-b", "trtllm", "-o", dest), tmp_path, dest,
                          "past the end of the")


def test_header_length_past_end(capsys, src, tmp_path):
    shard = src / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    shard.write_bytes(bytes(data))
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, src, "-b", "trtllm", "-o", dest), tmp_path, dest,
                          "model-00001-of-00002.safetensors: header length")


def test_ineligible_lists_every_offender_and_keep_records_them(capsys, tmp_path):
    # K = 288 (9 x 32): fine for cutlass, not a multiple of 256 for trtllm; two such modules
    src = write_checkpoint(tmp_path / "m", replace(SPEC, intermediate=288))
    dest = tmp_path / "o"
    code, out, err = run(capsys, src, "-b", "trtllm", "-o", dest)
    assert_failed_cleanly(code, out, err, tmp_path, dest, "1 tensor(s) do not fit backend trtllm")
    assert "model.layers.0.mlp.down_proj.weight [256, 288]: K=288 is not a multiple of 256" in err
    assert "--on-ineligible keep" in err

    code, out, err = run(capsys, src, "-b", "trtllm", "-o", dest, "--on-ineligible", "keep",
                         "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"]["kept_canonical"] == ["model.layers.0.mlp.down_proj"]
    from safetensors import safe_open

    # one output shard (the model is far below --max-shard-size): named and unindexed as
    # transformers writes it
    assert not (dest / "model.safetensors.index.json").exists()
    shard = "model.safetensors"
    with safe_open(str(dest / shard), "pt") as f:
        recs = json.loads(f.metadata()["mxfp8_convert.tensors"])
        rec = recs["model.layers.0.mlp.down_proj.weight"]
        assert rec["layout"] == "canonical"
        # docs/FORMAT.md section 3: kept-canonical records say why
        assert rec["reason"] == "K=288 is not a multiple of 256"
        assert recs["model.layers.0.mlp.down_proj.weight_scale_inv"]["reason"] == rec["reason"]
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv").shape == (256, 9)


def test_existing_destination_needs_overwrite(capsys, src, tmp_path):
    dest = tmp_path / "o"
    dest.mkdir()
    (dest / "keep.txt").write_text("precious")
    code, out, err = run(capsys, src, "-b", "trtllm", "-o", dest)
    assert code == 1 and "already exists" in err and "--overwrite" in err
    assert (dest / "keep.txt").read_text() == "precious"


def test_destination_inside_source_refused(capsys, src, tmp_path):
    before = tree_hashes(src)
    dest = src / "out"
    code, out, err = run(capsys, src, "-b", "trtllm", "-o", dest)
    assert code == 1 and "must not be the source folder or lie inside it" in err
    assert not dest.exists() and tree_hashes(src) == before


def test_pickles_only(capsys, tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    dest = tmp_path / "o"
    assert_failed_cleanly(*run(capsys, m, "-b", "trtllm", "-o", dest), tmp_path, dest,
                          "only pickle weights (pytorch_model.bin); safetensors is required")


def test_push_to_hub_verifies_then_uploads(capsys, src, tmp_path, monkeypatch):
    import mxfp8_convert.publish as publish

    calls = []
    monkeypatch.setattr(publish, "push_to_hub",
                        lambda *a, **k: calls.append((a, k)) or "https://hub/commit/1")
    code, out, err = run(capsys, src, "-b", "trtllm", "-o", tmp_path / "o",
                         "--push-to-hub", "me/tiny-trtllm", "--private", "--push-branch", "v1",
                         "--json")
    assert code == 0, err
    assert calls == [((str(tmp_path / "o"), "me/tiny-trtllm"), {"private": True, "revision": "v1"})]
    doc = json.loads(out)
    assert doc["push"] == {"repo_id": "me/tiny-trtllm", "branch": "v1", "private": True,
                           "commit_url": "https://hub/commit/1"}
    # named in the card's snippet
    assert "me/tiny-trtllm" in (tmp_path / "o" / "README.md").read_text()


def test_push_refused_when_verification_fails(capsys, src, tmp_path, monkeypatch):
    import mxfp8_convert.publish as publish
    import mxfp8_convert.verify as verify_mod

    calls = []
    monkeypatch.setattr(publish, "push_to_hub", lambda *a, **k: calls.append(a))
    mismatch = verify_mod.Mismatch("t.weight", "differs", [1, 2])
    report = verify_mod.VerifyReport("x", "trtllm", mismatches=[mismatch])
    monkeypatch.setattr(verify_mod, "verify", lambda *a, **k: report)
    code, out, err = run(capsys, src, "-b", "trtllm", "-o", tmp_path / "o", "--push-to-hub", "me/x")
    assert code == 1 and calls == []
    assert err.strip() == "Error: not pushed: verification failed: t.weight: differs at [1, 2]"


def test_push_flag_combinations_are_usage_errors(capsys, src, tmp_path):
    code, _, err = run(capsys, src, "-b", "trtllm", "-o", tmp_path / "o", "--private")
    assert code == 2 and "--push-to-hub" in err
    code, _, err = run(capsys, src, "-b", "trtllm", "-o", tmp_path / "o", "--push-to-hub", "me/x",
                       "--dry-run")
    assert code == 2 and not (tmp_path / "o").exists()


PROGRAM = """
import atexit, gc, sys
atexit.register(lambda: sys.stderr.write(f"frozen {gc.get_freeze_count()}\\n"))
sys.argv = ["mxfp8-convert", *sys.argv[1:]]
from mxfp8_convert.cli import script
script()
"""


def test_the_program_exits_with_mains_code_and_freezes_what_it_built(capsys, src, tmp_path):
    """``cli.script`` (the console script, ``python -m mxfp8_convert``) prints what ``main``
    prints and exits with its code, having moved what is left out of the shutdown collections
    (``gc.freeze``); ``main`` itself never freezes, for callers that go on running."""
    import gc
    import subprocess
    import sys

    before = gc.get_freeze_count()
    code, out, _ = run(capsys, "inspect", src, "--json")
    assert code == 0 and json.loads(out)["format"]
    assert gc.get_freeze_count() == before
    ok = subprocess.run([sys.executable, "-c", PROGRAM, "inspect", str(src), "--json"],
                        capture_output=True, text=True)
    bad = subprocess.run([sys.executable, "-c", PROGRAM, "inspect", str(tmp_path / "none")],
                         capture_output=True, text=True)
    assert (ok.returncode, ok.stdout) == (0, out)
    assert int(ok.stderr.split("frozen ")[-1]) > 0
    assert bad.returncode == 1 and "Error: " in bad.stderr
    version = subprocess.run([sys.executable, "-m", "mxfp8_convert", "--version"],
                             capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("mxfp8-convert ")


COLLECTOR = """
import atexit, gc, sys
atexit.register(lambda: sys.stderr.write(f"collector {gc.isenabled()}\\n"))
sys.argv = ["mxfp8-convert", *sys.argv[1:]]
from mxfp8_convert.cli import script
script()
"""


def test_planning_commands_leave_the_collector_paused_to_the_end_of_the_program(
    capsys, src, tmp_path
):
    """A dry run and ``inspect`` plan only: the program keeps the cycle collector off from
    opening the checkpoint to its exit (no collection walks the plan between the steps); a
    conversion keeps it on; called in-process, every command leaves it on."""
    import gc
    import subprocess
    import sys

    commands = {
        "dry": lambda out: [str(src), "-b", "trtllm", "-o", str(out), "--dry-run", "--json"],
        "inspect": lambda out: ["inspect", str(src), "--json"],
        "convert": lambda out: [str(src), "-b", "trtllm", "-o", str(out), "--json"],
    }
    seen = {}
    for name, argv in commands.items():
        r = subprocess.run([sys.executable, "-c", COLLECTOR, *argv(tmp_path / f"{name}-p")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        seen[name] = r.stderr.strip().splitlines()[-1]
        code, _, err = run(capsys, *argv(tmp_path / f"{name}-in"))
        assert code == 0 and gc.isenabled(), err
    assert seen == {"dry": "collector False", "inspect": "collector False",
                    "convert": "collector True"}
