"""The faster planning prints the documents it printed before: ``--dry-run --json`` and
``inspect --json`` of this tree against those of the tree at ``REFERENCE_COMMIT`` (main before
the scales were read in runs, module plans became tuples and the collector was paused),
extracted with ``git archive`` and run in its own process: code independent of the code under
test. Every source dialect, every backend, MoE fused and kept, a laid-out source, lossless and
requantized FP8, and a refused option (its error document)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.synth import ALL_DIALECTS, SynthSpec, write_checkpoint
from tests.checkpoints import REPO, package_at

REFERENCE_COMMIT = "da31712"  # main before the planning work of issue 25's planning rows
SPEC = SynthSpec(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=3)
MOE = replace(SPEC, experts=4, moe_intermediate=256, shared_expert=True)
#: runs CLI commands in one process and prints their exit codes and stdout as one JSON list
DRIVER = """
import contextlib, io, json, sys
from mxfp8_convert.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    out.append([code, buf.getvalue()])
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return package_at(REFERENCE_COMMIT, tmp_path_factory.mktemp("reference"))


def _documents(tree: Path, commands: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-P", "-c", DRIVER, json.dumps(commands)], env=env,
                       capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, r.stderr
    docs = []
    for code, text in json.loads(r.stdout):
        text = re.sub(r'\n  "seconds": [0-9.e-]+,', "", text)  # wall time of the run
        json.loads(text)
        docs.append((code, text))  # the text itself: byte for byte
    return docs


def _commands(src: Path, out: Path, backends, extra=()) -> list[list[str]]:
    cmds = [[str(src), "--backend", b, "--dry-run", "--json", "-o", str(out), *extra]
            for b in backends]
    return cmds + [["inspect", str(src), "--json"]]


CASES = [(d, SPEC, ()) for d in ALL_DIALECTS] + [
    ("sglang_mxfp8", MOE, ()),
    ("sglang_mxfp8", MOE, ("--moe", "keep")),
    ("block_fp8", MOE, ()),
    ("block_fp8", replace(MOE, pow2_scales=False), ()),
    ("fp8", replace(SPEC, pow2_scales=False), ("--on-ineligible", "keep")),
    ("sglang_mxfp8", SPEC, ("--ignore", "no.such.module")),  # an error document
]


def _id(dialect: str, spec: SynthSpec, extra) -> str:
    moe = "-moe" if spec.experts else ""
    return f"{dialect}{moe}{'' if spec.pow2_scales else '-requant'}{''.join(extra)}"


@pytest.mark.parametrize(("dialect", "spec", "extra"), CASES, ids=[_id(*c) for c in CASES])
def test_documents_equal_the_reference(tmp_path, reference, dialect, spec, extra):
    src = write_checkpoint(tmp_path / "src", replace(spec, dialect=dialect))
    cmds = _commands(src, tmp_path / "out", BACKENDS, extra)
    want = _documents(reference, cmds, tmp_path)
    assert _documents(REPO, cmds, tmp_path) == want
    if "--ignore" in extra:
        assert all(code == 1 and json.loads(doc)["ok"] is False for code, doc in want[:-1])
    else:
        assert all(code == 0 for code, _ in want)


def test_a_laid_out_source_documents_equal_the_reference(tmp_path, reference):
    src = write_checkpoint(tmp_path / "src", MOE)
    _documents(REPO, [[str(src), "--backend", "trtllm", "--json", "-o", str(tmp_path / "mid")]],
               tmp_path)
    cmds = _commands(tmp_path / "mid", tmp_path / "out", [b for b in BACKENDS if b != "trtllm"])
    want = _documents(reference, cmds, tmp_path)
    assert all(code == 0 for code, _ in want)
    assert _documents(REPO, cmds, tmp_path) == want
