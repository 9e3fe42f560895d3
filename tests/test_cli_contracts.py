"""CLI contracts: every backend in human mode, valid JSON, error documents, usage errors (exit 2)
with Typer's own messages, summary tables, dry runs, and re-fusing a ``--moe keep`` output."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.synth import SynthSpec, linear_names, write_checkpoint
from tests.checkpoints import load_all, replace_tensor, tree_hashes
from tests.hostile import run_cli as run

SPEC = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=2)
FORMAT_NAMES = (
    "mxfp8_convert",
    "modelopt_mxfp8",
    "compressed_tensors_mxfp8",
    "sglang_mxfp8",
    "block_fp8",
    "compressed_tensors_block_fp8",
    "fp8",
    "compressed_tensors_fp8",
    "dense",
)


def strict_json(text: str):
    """RFC 8259: no NaN / Infinity (Python's json accepts them unless told otherwise)."""

    def refuse(constant):
        raise AssertionError(f"not valid JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def error_document(out: str) -> dict:
    doc = strict_json(out)
    assert set(doc) == {"ok", "error", "hint"} and doc["ok"] is False, doc
    return doc


def header_rows(out: str) -> list[str]:
    """Rich's header rows made only of blanks (the empty header of a key-value table)."""
    return [ln for ln in out.splitlines() if re.fullmatch(r"[┃│](\s+[┃│])+", ln)]


@pytest.fixture()
def src(tmp_path):
    return write_checkpoint(tmp_path / "model", SPEC)


# --- every backend, human output -------------------------------------------------------------


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_backend_in_human_mode(capsys, src, tmp_path, backend):
    dest = tmp_path / "o"
    code, out, err = run(capsys, src, "-b", backend, "-o", dest)
    assert code == 0, err
    spec = BACKENDS[backend]
    want = (
        f"{backend} (weight {spec.weight_layout}, scale {spec.scale_layout})"
        if spec.laid_out
        else "canonical (plain MXFP8: weight_scale_inv uint8 [N, K/32])"
    )
    assert re.search(rf"│ backend\s+│ {re.escape(want)}\s+│", out), out
    assert (dest / "mxfp8_convert.complete.json").is_file() and header_rows(out) == []


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_finalize_of_parts_in_human_mode(capsys, src, tmp_path, backend):
    dest = tmp_path / "o"
    for i in range(2):
        code, out, err = run(capsys, src, "-b", backend, "-o", dest, "--num-parts", 2, "--part", i)
        assert code == 0, err
        assert out.strip() == (
            f"Part {i} of 2 done ({out.split('(')[1].split(')')[0]}); "
            "run `mxfp8-convert finalize OUT` once every part has run."
        )
    code, out, err = run(capsys, "finalize", dest)
    assert code == 0, err
    assert out.startswith("Converted") and re.search(rf"│ backend\s+│ {backend} \(", out), out
    assert (dest / "mxfp8_convert.complete.json").is_file()


# --- tables and labels -------------------------------------------------------------------------


def test_summary_tables_have_no_empty_header_row(capsys, src, tmp_path):
    code, out, _ = run(capsys, src, "-b", "trtllm", "-o", tmp_path / "o")
    assert code == 0 and out.startswith("Converted\n┌") and header_rows(out) == []
    code, out, _ = run(capsys, "verify", tmp_path / "o")
    assert code == 0 and out.startswith("Verify\n┌") and header_rows(out) == []
    code, out, _ = run(capsys, "inspect", src)
    assert code == 0 and out.startswith("Checkpoint\n┌") and header_rows(out) == []
    assert "┃ module" in out  # tables with real column names keep their header


def test_dense_quantization_is_labelled_quantized(capsys, tmp_path):
    model = write_checkpoint(
        tmp_path / "dense",
        SynthSpec(layers=1, hidden=256, intermediate=512, vocab=256, dialect="dense"),
    )
    code, out, err = run(capsys, model, "-b", "cutlass", "-o", tmp_path / "o")
    assert code == 0, err
    assert re.search(r"│ quantized\s+│ 7 modules; worst SQNR \d+\.\d dB \(rel\. error", out), out
    assert "requantized" not in out


def test_fp8_requantization_is_labelled_requantized(capsys, tmp_path):
    model = write_checkpoint(
        tmp_path / "fp8",
        SynthSpec(
            layers=1, hidden=256, intermediate=512, vocab=256, dialect="fp8", pow2_scales=False
        ),
    )
    code, out, err = run(capsys, model, "-b", "cutlass", "-o", tmp_path / "o")
    assert code == 0, err
    assert re.search(r"│ requantized\s+│ 7 modules; worst SQNR", out), out


@pytest.mark.parametrize("dialect", ["block_fp8", "fp8", "dense"])
def test_inspect_names_the_source_scheme_not_canonical(capsys, tmp_path, dialect):
    model = write_checkpoint(
        tmp_path / dialect,
        SynthSpec(layers=1, hidden=256, intermediate=512, vocab=256, dialect=dialect),
    )
    code, out, _ = run(capsys, "inspect", model, "--json")
    assert code == 0
    layouts = {m["layout"] for m in strict_json(out)["modules"]}
    assert layouts == {dialect}
    code, out, _ = run(capsys, "inspect", model)
    assert code == 0 and "canonical" not in out.split("Linear modules")[1]


# --- dry run -----------------------------------------------------------------------------------


def test_dry_run_counts_every_output_tensor_by_role(capsys, src, tmp_path):
    code, out, err = run(capsys, src, "-b", "trtllm", "-o", tmp_path / "dry", "--dry-run")
    assert code == 0, err
    assert not (tmp_path / "dry").exists()
    rows = re.findall(
        r"│ (\w+)\s+│ (\w+)\s+│ (\w+)\s+│ (\d+)\s+│",
        out.split("Tensors by role")[1].split("Shards")[0],
    )
    printed = {(role, layout, dtype): int(n) for role, layout, dtype, n in rows}
    # the real output, read back: every tensor's role from its name and shard records
    assert run(capsys, src, "-b", "trtllm", "-o", tmp_path / "o")[0] == 0
    tensors, meta = load_all(tmp_path / "o")
    records = {
        k: v for m in meta.values() for k, v in json.loads(m["mxfp8_convert.tensors"]).items()
    }
    real: dict[tuple[str, str, str], int] = {}
    dtypes = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}
    for name, t in tensors.items():
        rec = records.get(name, {"role": "passthrough", "layout": "copy"})
        key = (rec["role"], rec["layout"], dtypes[t.dtype])
        real[key] = real.get(key, 0) + 1
    assert printed == real


def test_dry_run_prints_one_row_per_repeated_module(capsys, tmp_path, monkeypatch):
    """Modules that differ only in their layer index are one row with their count (a DeepSeek-V3
    plan is ~45k modules); one whose shape differs keeps a row of its own."""
    monkeypatch.setenv("COLUMNS", "250")
    src = write_checkpoint(tmp_path / "m", SynthSpec(layers=3, hidden=256, intermediate=512,
                                                     heads=4, kv_heads=2, vocab=256, shards=1))
    # layer 1's up_proj gets a different shape: 512 -> 256 rows
    replace_tensor(src, "model.layers.1.mlp.up_proj.weight",
                   torch.zeros(256, 256, dtype=torch.float8_e4m3fn))
    replace_tensor(src, "model.layers.1.mlp.up_proj.weight_scale_inv",
                   torch.full((256, 8), 127, dtype=torch.uint8))
    code, out, err = run(capsys, src, "-b", "cutlass", "-o", tmp_path / "dry", "--dry-run",
                         "--json")
    assert code == 0, err
    modules = [m["name"] for m in json.loads(out)["plan"]["modules"]]
    code, out, err = run(capsys, src, "-b", "cutlass", "-o", tmp_path / "dry", "--dry-run")
    assert code == 0, err
    plan = out.split("Plan: ")[1].split("└")[0]  # the plan table alone
    rows = dict(re.findall(r"│ (model\.\S+)\s+│ (\d+)\s+│", plan))
    for leaf in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"):
        assert rows[f"model.layers.*.{leaf}"] == "3", rows
    assert rows["model.layers.*.mlp.up_proj"] == "2" and rows["model.layers.1.mlp.up_proj"] == "1"
    assert sum(int(n) for n in rows.values()) == len(modules) == 21


def test_inspect_prints_one_row_per_repeated_module(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    spec = SynthSpec(layers=3, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                     shards=1)
    src = write_checkpoint(tmp_path / "m", spec)
    code, out, err = run(capsys, "inspect", src)
    assert code == 0, err
    rows = dict(re.findall(r"│ (model\.\S+)\s+│ (\d+)\s+│",
                           out.split("Linear modules")[1].split("└")[0]))
    first_layer = [m for m, _, _ in linear_names(spec) if m.startswith("model.layers.0.")]
    assert rows == {m.replace(".0.", ".*.", 1): "3" for m in first_layer}


def test_dry_run_does_not_refuse_an_existing_output(capsys, src, tmp_path):
    dest = tmp_path / "o"
    assert run(capsys, src, "-b", "cutlass", "-o", dest)[0] == 0
    before = tree_hashes(dest)
    code, out, err = run(capsys, src, "-b", "cutlass", "-o", dest, "--dry-run")
    assert code == 0, err
    assert (
        f"Dry run: nothing written. Output would be {dest} "
        "(it exists: a real run needs --overwrite)"
        in out
    )
    code, out, _ = run(capsys, src, "-b", "cutlass", "-o", dest, "--dry-run", "--json")
    assert code == 0 and strict_json(out)["dry_run"] is True
    assert tree_hashes(dest) == before
    code, _, err = run(capsys, src, "-b", "cutlass", "-o", dest)  # a real run still refuses
    assert code == 1 and f"Error: {dest}: already exists" in err


# --- usage errors: Typer's enums, exit 2 --------------------------------------------------------


@pytest.mark.parametrize(
    "option,choices",
    [
        ("--backend", "'trtllm', 'cutlass', 'canonical'"),
        ("--on-ineligible", "'error', 'keep'"),
        ("--moe", "'fuse', 'keep'"),
        ("--source-format", ", ".join(f"'{n}'" for n in FORMAT_NAMES)),
    ],
)
def test_bad_choice_is_a_usage_error(capsys, src, tmp_path, option, choices):
    args = [src, "-o", tmp_path / "o", option, "nope"] + (
        ["-b", "trtllm"] if option != "--backend" else []
    )
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert f"Invalid value for '{option}'" in err and f"'nope' is not one of {choices}." in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_inspect_bad_source_format_is_a_usage_error(capsys, src):
    code, _, err = run(capsys, "inspect", src, "--source-format", "nope")
    assert (
        code == 2 and "Invalid value for '--source-format'" in err and "'nope' is not one of" in err
    )


def test_num_parts_zero(capsys, src, tmp_path):
    code, out, err = run(
        capsys, src, "-b", "trtllm", "-o", tmp_path / "o", "--num-parts", 0, "--part", 0
    )
    assert code == 2 and out == ""
    assert "Invalid value for --num-parts: 0 is not a number of parts (at least 1)" in err
    assert "0..-1" not in err


# --- --json: valid JSON, error documents ---------------------------------------------------------


def test_all_zero_linear_gives_valid_json_and_marker(capsys, tmp_path):
    model = write_checkpoint(
        tmp_path / "dense",
        SynthSpec(layers=1, hidden=256, intermediate=512, vocab=256, dialect="dense"),
    )
    name = "model.layers.0.mlp.up_proj"
    replace_tensor(model, f"{name}.weight", torch.zeros(512, 256, dtype=torch.bfloat16))
    dest = tmp_path / "o"
    code, out, err = run(capsys, model, "-b", "trtllm", "-o", dest, "--json")
    assert code == 0, err
    errors = strict_json(out)["quantization_errors"]
    assert errors[name] == {"action": "quantize", "rel_fro": 0.0, "sqnr_db": None}
    assert all(isinstance(e["sqnr_db"], float) for n, e in errors.items() if n != name)
    marker = strict_json((dest / "mxfp8_convert.complete.json").read_text())
    assert marker["quantization_errors"][name] == {
        "action": "quantize",
        "rel_fro": 0.0,
        "sqnr_db": None,
    }
    code, out, err = run(capsys, "verify", dest, "--source", model, "--json")
    assert code == 0 and strict_json(out)["ok"] is True, err
    code, out, err = run(capsys, model, "-b", "cutlass", "-o", tmp_path / "h")
    assert code == 0 and "; worst SQNR " in out, err


def test_json_error_document_for_every_command(capsys, src, tmp_path):
    missing = tmp_path / "nope"
    for args in (
        [missing, "-b", "trtllm", "-o", tmp_path / "o"],
        ["inspect", missing],
        ["verify", missing],
        ["finalize", tmp_path / "o"],
    ):
        code, out, err = run(capsys, *args, "--json")
        doc = error_document(out)
        assert code == 1, args
        lines = err.strip().splitlines()
        assert lines[0] == f"Error: {doc['error']}", args
        assert (lines[1:] == [f"Hint: {doc['hint']}"]) if doc["hint"] else lines[1:] == [], args
    code, out, err = run(capsys, missing, "-b", "trtllm", "-o", tmp_path / "o", "--json")
    assert error_document(out) == {
        "ok": False,
        "error": f"{missing}: no such folder",
        "hint": "pass a model folder or a Hub repo id (org/name)",
    }


def test_json_usage_error_document(capsys, src, tmp_path):
    code, out, err = run(capsys, src, "-b", "nope", "-o", tmp_path / "o", "--json")
    doc = error_document(out)
    assert code == 2
    assert (
        doc["error"].startswith("Invalid value for '--backend' / '-b': ")
        and "'nope' is not one of" in doc["error"]
    )
    assert doc["hint"] == "see `mxfp8-convert convert --help`"
    assert "Invalid value for '--backend'" in err
    code, out, err = run(capsys, src, "-b", "trtllm", "--num-parts", 0, "--part", 0, "--json")
    assert code == 2
    assert (
        error_document(out)["error"]
        == "Invalid value for --num-parts: 0 is not a number of parts (at least 1)"
    )
    code, out, _ = run(capsys, "verify", "--json")  # missing argument
    assert code == 2 and error_document(out)["error"] == "Missing argument 'OUT'."


def test_json_failed_verification_is_one_document(capsys, src, tmp_path):
    dest = tmp_path / "o"
    assert run(capsys, src, "-b", "trtllm", "-o", dest)[0] == 0
    (dest / "config.json").write_text("{}")
    code, out, err = run(capsys, "verify", dest, "--json")
    doc = strict_json(out)
    assert code == 1 and doc["ok"] is False and doc["mismatches"]
    assert doc["error"].startswith("verification failed: ") and doc["hint"] is None
    assert err.strip() == f"Error: {doc['error']}"


# --- a --moe keep trtllm output fused later ---------------------------------------------


def test_moe_keep_output_can_be_fused_later(capsys, tmp_path):
    model = write_checkpoint(tmp_path / "moe", SynthSpec(layers=1, experts=4, moe_intermediate=256))
    keep, fused, direct = tmp_path / "keep", tmp_path / "fused", tmp_path / "direct"
    assert run(capsys, model, "-b", "trtllm", "--moe", "keep", "-o", keep)[0] == 0
    code, out, err = run(capsys, keep, "-b", "trtllm", "-o", fused, "--json")
    assert code == 0, err
    doc = strict_json(out)
    assert [m["name"] for m in doc["plan"]["moe_layers"]] == ["model.layers.0.mlp.experts"]
    assert run(capsys, model, "-b", "trtllm", "-o", direct)[0] == 0
    got, _ = load_all(fused)
    want, _ = load_all(direct)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    code, out, err = run(capsys, "verify", fused, "--source", keep)
    assert code == 0 and "│ result           │ OK" in out, err
    # nothing left to do: refused as before
    code, _, err = run(capsys, fused, "-b", "trtllm", "-o", tmp_path / "again")
    assert code == 1 and f"Error: {fused}: already laid out for trtllm" in err
