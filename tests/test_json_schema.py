"""The --json documents' field names are a contract (README "JSON output"): pinned here."""

from __future__ import annotations

import json

import pytest

from mxfp8_convert.synth import SynthSpec, write_checkpoint
from tests.hostile import run_cli

CONVERT = {"tool_version", "source", "output", "backend", "format", "dry_run", "seconds",
           "bytes_written", "quantization_errors", "part", "plan"}
PLAN = {"source", "backend", "format", "total_bytes", "modules_by_action", "kept_canonical",
        "source_fingerprint", "copied_files", "marker", "modules", "shards", "moe_layers",
        "unquantized", "dropped_tensors", "kv_cache_scales"}
MODULE = {"name", "shape", "action", "layout", "reason", "source_kind", "source_backend",
          "decided_by", "weight", "scale"}
SHARD = {"name", "nbytes", "tensors"}
TENSOR = {"name", "role", "dtype", "shape", "layout", "source", "nbytes"}
VERIFY = {"ok", "path", "backend", "source", "files_checked", "tensors_checked",
          "modules_compared", "mismatches"}
MISMATCH = {"where", "what", "position"}
UNQUANTIZED = {"name", "shape", "kind", "why", "decided_by"}
INSPECT = {"path", "format", "kind", "backend", "complete", "tp_compat", "shards",
           "bytes_by_role", "count_by_role", "conversion", "modules", "moe_layers"}
INSPECT_MODULE = {"name", "shape", "weight_dtype", "layout", "backends"}


def _json(capsys, *args) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, *args)
    return code, json.loads(out)


@pytest.fixture()
def src(tmp_path):
    spec = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256)
    return write_checkpoint(tmp_path / "src", spec)


def test_convert_and_verify_documents(capsys, src, tmp_path):
    code, doc = _json(capsys, src, "-b", "trtllm", "-o", tmp_path / "o", "--json")
    assert code == 0 and set(doc) == CONVERT
    assert set(doc["plan"]) == PLAN
    assert set(doc["plan"]["modules"][0]) == MODULE
    assert doc["plan"]["unquantized"]
    assert all(set(u) == UNQUANTIZED for u in doc["plan"]["unquantized"])
    assert set(doc["plan"]["shards"][0]) == SHARD
    assert set(doc["plan"]["shards"][0]["tensors"][0]) == TENSOR
    code, doc = _json(capsys, "verify", tmp_path / "o", "--source", src, "--json")
    assert code == 0 and set(doc) == VERIFY
    (tmp_path / "o" / "config.json").write_text("{}")
    code, doc = _json(capsys, "verify", tmp_path / "o", "--json")
    assert code == 1 and set(doc["mismatches"][0]) == MISMATCH


def test_inspect_document(capsys, src):
    code, doc = _json(capsys, "inspect", src, "--json")
    assert code == 0 and set(doc) == INSPECT and set(doc["modules"][0]) == INSPECT_MODULE
    assert set(doc["modules"][0]["backends"]["trtllm"]) == {"ok", "why_not"}
