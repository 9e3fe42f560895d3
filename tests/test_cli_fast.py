"""``cli._fast.convert_args`` reads the common ``convert`` command lines without Typer: each
line it takes must give ``run_convert`` exactly what Typer's own parsing gives it (Typer is the
oracle here), and every line Typer refuses it must leave to Typer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import pytest

import mxfp8_convert.cli as cli
from mxfp8_convert.cli._fast import convert_args, inspect_args
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from tests.checkpoints import tree_hashes

ROOT = Path(__file__).resolve().parents[1]


#: per command: the fast path's reader, the body Typer's command calls, its positional names
COMMANDS = {"convert": (convert_args, "run_convert", ("model", "backend")),
            "inspect": (inspect_args, "run_inspect", ("model",))}


def typer_reading(args: list[str], command: str = "convert") -> dict | None:
    """What Typer's ``command`` passes to its body (``run_convert``, ``run_inspect``) for
    ``command ARGS``, or None where Typer refuses the line (a usage error) or does not run it
    (``--help``)."""
    from mxfp8_convert.cli import _app

    _, body, names = COMMANDS[command]
    got = []
    real = getattr(_app, body)
    setattr(_app, body, lambda *pos, **kw: got.append({**dict(zip(names, pos, strict=True)),
                                                        **kw}))
    try:
        code = _app.app(args=[command, *args], prog_name="mxfp8-convert", standalone_mode=False)
    except _app.UsageError:
        return None
    finally:
        setattr(_app, body, real)
    assert code in (None, 0)
    return got[0] if got else None


def check(args: list[str], command: str = "convert") -> dict | None:
    fast = COMMANDS[command][0](list(args))
    want = typer_reading(list(args), command)
    if fast is not None:
        assert want is not None, f"{args}: Typer refuses what the fast path took"
        assert fast == want, args
    return fast


@pytest.mark.parametrize("args", [
    ["m", "--backend", "trtllm"],
    ["m", "-b", "cutlass", "-o", "out", "--quiet"],
    ["--backend=canonical", "m", "--output=o", "--json", "--overwrite", "--fresh", "--debug"],
    ["m", "-b", "trtllm", "--dry-run", "--workers", "2", "--max-shard-size", "4GiB", "-q"],
    ["m", "-b", "trtllm", "--on-ineligible", "keep", "--moe", "keep", "--revision", "main",
     "--source-format", "sglang_mxfp8", "--quantize-towers", "--allow-no-quantized"],
    ["m", "-b", "trtllm", "--max-shard-size=1.5 GB", "--workers=3"],
])
def test_the_fast_path_takes_these_lines_as_typer_reads_them(args):
    assert check(args) is not None


@pytest.mark.parametrize("args", [
    ["m"], ["-b", "trtllm"], ["m", "n", "-b", "trtllm"], ["m", "-b", "TRTLLM"],
    ["m", "-b", "trtllm", "-b", "cutlass"], ["m", "-b", "trtllm", "--workers", "0"],
    ["m", "-b", "trtllm", "--workers", "01"], ["m", "-b", "trtllm", "--workers", "+1"],
    ["m", "-b", "trtllm", "-o"], ["m", "-b", "trtllm", "-o", "-q"], ["m", "-b", "trtllm", "-ox"],
    ["m", "-b", "trtllm", "-o=x"], ["m", "-b", "trtllm", "--json=1"], ["m", "-b", "trtllm", "--"],
    ["m", "-b", "trtllm", "--help"], ["m", "-b", "trtllm", "--ignore", "lm_head"],
    ["m", "-b", "trtllm", "--max-shard-size", "0"], ["m", "-b", "trtllm", "--max-shard-size", "x"],
    ["m", "-b", "trtllm", "--num-parts", "2", "--part", "0"], ["m", "-b", "trtllm", "-qj"],
    ["", "-b", "trtllm"], ["m", "-b", "trtllm", "-o", ""], ["-", "-b", "trtllm"],
])
def test_the_fast_path_leaves_other_lines_to_typer(args):
    assert check(args) is None


def test_the_fast_path_declines_while_click_completes(monkeypatch):
    monkeypatch.setenv("_MXFP8_CONVERT_COMPLETE", "bash_complete")
    assert convert_args(["m", "-b", "trtllm"]) is None


_TOKENS = ["m", "n", "out", "-b", "--backend", "trtllm", "cutlass", "canonical", "-o",
           "--output", "--json", "--quiet", "-q", "--dry-run", "--overwrite", "--fresh", "--debug",
           "--workers", "1", "2", "0", "--max-shard-size", "5GB", "2GiB", "--moe", "fuse", "keep",
           "--on-ineligible", "error", "--revision", "--source-format", "sglang_mxfp8", "block_fp8",
           "--backend=trtllm", "--workers=2", "-", "--", "--ignore", "x", "=", "-o=o"]


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(_TOKENS), max_size=9))
def test_any_line_the_fast_path_takes_typer_reads_the_same(args):
    check(args)


# --- inspect ---------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["m"], ["m", "--json"], ["--json", "m", "--debug"], ["m", "--source-format", "block_fp8"],
    ["m", "--revision=main", "--source-format=sglang_mxfp8", "--json"],
])
def test_the_fast_path_takes_these_inspect_lines_as_typer_reads_them(args):
    assert check(args, "inspect") is not None


@pytest.mark.parametrize("args", [
    [], ["m", "n"], ["m", "--json", "--json"], ["m", "--help"], ["m", "--source-format", "x"],
    ["m", "--revision"], ["m", "--revision", "-r"], ["m", "-b", "trtllm"], ["m", "--json=1"],
    ["", "--json"], ["m", "--"],
])
def test_the_fast_path_leaves_other_inspect_lines_to_typer(args):
    assert check(args, "inspect") is None


_INSPECT_TOKENS = ["m", "n", "--json", "--debug", "--revision", "main", "--source-format",
                   "block_fp8", "sglang_mxfp8", "nope", "--source-format=block_fp8", "-", "--",
                   "-b", "=", "--help", "--revision=v1"]


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.lists(st.sampled_from(_INSPECT_TOKENS), max_size=7))
def test_any_inspect_line_the_fast_path_takes_typer_reads_the_same(args):
    check(args, "inspect")


def test_inspect_on_the_fast_path_never_imports_typer_or_pydantic(tmp_path):
    src = write_checkpoint(tmp_path / "model", SPEC)
    for extra in ([], ["--json"]):
        r = _program(["inspect", src, *extra])
        probe = json.loads(r.stderr.strip().splitlines()[-1])
        assert probe == {"code": 0, "loaded": []}, r.stderr
        # Typer's path (it alone reads a repeated flag) prints the same
        slow = _program(["inspect", src, "--debug", "--debug", *extra])
        assert json.loads(slow.stderr.strip().splitlines()[-1]) == {
            "code": 0, "loaded": ["pydantic", "typer", "typer._adapters"]}
        assert slow.stdout == r.stdout and r.stdout
        if extra:
            assert json.loads(r.stdout)["path"] == str(src)


# --- the program on the fast path ------------------------------------------------------------

SPEC = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=2)

PROBE = """
import json, sys
from mxfp8_convert.cli import main
code = main(sys.argv[1:])
loaded = [m for m in ("pydantic", "typer", "typer._adapters") if m in sys.modules]
print(json.dumps({"code": code, "loaded": loaded}), file=sys.stderr)
"""


def _program(args, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], env=env,
                          capture_output=True, text=True, **kw)


@pytest.mark.parametrize("extra", [[], ["--json"], ["--dry-run"]])
def test_a_conversion_on_the_fast_path_never_imports_typer_or_pydantic(tmp_path, extra):
    src = write_checkpoint(tmp_path / "model", SPEC)
    r = _program([src, "--backend", "trtllm", "-o", tmp_path / "o", *extra])
    probe = json.loads(r.stderr.strip().splitlines()[-1])
    assert probe == {"code": 0, "loaded": []}, r.stderr
    assert ((tmp_path / "o" / "mxfp8_convert.complete.json").exists()) != ("--dry-run" in extra)
    if "--json" in extra:
        assert json.loads(r.stdout)["output"] == str(tmp_path / "o")
    # Typer's path (it alone reads "--workers=01") prints the same result
    slow = _program([src, "--backend", "trtllm", "-o", tmp_path / "p", "--workers=01", *extra])
    assert json.loads(slow.stderr.strip().splitlines()[-1])["loaded"] == [
        "pydantic", "typer", "typer._adapters"]
    assert slow.stdout.replace(str(tmp_path / "p"), "OUT").split("\n")[:3] == \
        r.stdout.replace(str(tmp_path / "o"), "OUT").split("\n")[:3]


@pytest.mark.parametrize("workers", ["1", "01"])  # the fast path, and Typer's
def test_a_closed_stdout_ends_the_program_with_1_and_a_complete_output(tmp_path, workers):
    src = write_checkpoint(tmp_path / "model", SPEC)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r, w = os.pipe()
    os.close(r)  # nobody reads the result
    try:
        proc = subprocess.run([sys.executable, "-m", "mxfp8_convert", str(src), "-b", "cutlass",
                               "-o", str(tmp_path / "o"), f"--workers={workers}"], env=env,
                              stdout=w, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(w)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (tmp_path / "o" / "mxfp8_convert.complete.json").exists()


PRELOAD = """
import json, sys, threading, time
import mxfp8_convert.cli as cli
cli._run.PRELOAD_AFTER = int(sys.argv[1])
seen = {}
class Finder:  # which thread first asks for each module the end of a conversion imports
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in cli._run.CARD_MODULES + cli._run.TABLE_MODULES and name not in seen:
            seen[name] = threading.current_thread().name
            if seen[name] == "mxfp8-preload":
                time.sleep(0.3)  # a slow import: still running when the writes end
sys.meta_path.insert(0, Finder)
import mxfp8_convert.publish as publish
run = sys.modules["mxfp8_convert.run"]
real_card = run.write_model_card
alive = []  # whether the preload thread still runs when the end of the conversion starts
def card(*a, **kw):
    alive.append(any(t.name == "mxfp8-preload" for t in threading.enumerate()))
    return real_card(*a, **kw)
run.write_model_card = card
code = cli.main(sys.argv[2:])
print(json.dumps({"code": code, "seen": seen, "switch": sys.getswitchinterval(),
                  "alive": alive}), file=sys.stderr)
"""


@pytest.mark.parametrize("as_json", [False, True])
def test_the_end_of_a_conversion_is_imported_on_a_thread_during_the_writes(tmp_path, as_json):
    """Once ``PRELOAD_AFTER`` bytes are written, the model card's modules (and, for people, the
    result table's) are imported on the preload thread, which has ended when the card is
    written; the output is byte for byte the one written without it, the result text the same,
    the switch interval restored."""
    src = write_checkpoint(tmp_path / "model", SPEC)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = {}
    out = tmp_path / "o"  # one path for both: the table prints (and folds) it
    for after in (0, 1 << 60):  # at the first chunk; never
        args = [src, "-b", "trtllm", "-o", out, *(["--json"] if as_json else [])]
        r = subprocess.run([sys.executable, "-c", PRELOAD, str(after), *map(str, args)],
                           env=env, capture_output=True, text=True)
        probe = json.loads(r.stderr.strip().splitlines()[-1])
        assert probe["code"] == 0 and probe["switch"] == 0.005, r.stderr
        assert probe["alive"] == [False], probe
        runs[after] = probe["seen"], tree_hashes(out), r.stdout
        out.rename(tmp_path / f"o{after}")
    seen, files, text = runs[0]
    want = set(cli._run.CARD_MODULES) | (set() if as_json else set(cli._run.TABLE_MODULES))
    assert {m for m, thread in seen.items() if thread == "mxfp8-preload"} == want, seen
    assert set(runs[1 << 60][0].values()) == {"MainThread"}
    assert files == runs[1 << 60][1]
    strip = (lambda t: {k: v for k, v in json.loads(t).items() if k != "seconds"}) if as_json \
        else (lambda t: [ln for ln in t.splitlines() if "time" not in ln])
    assert strip(text) == strip(runs[1 << 60][2])
