"""A first conversion does not wait for transformers: the architecture's decisions are made in a
child process (architecture.decisions_later) while the conversion runs on a plan from the name
rules, kept only where the architecture's plan writes the same bytes (run.plan_guessing).

Checked against the decisions of transformers' model built the plain way in this process
(``architecture.architecture``), the cache entry today's path writes, and the output of a
conversion whose decisions were cached (no guess)."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import threading

import pytest

import mxfp8_convert.architecture as arch_mod
from mxfp8_convert import convert
from mxfp8_convert.run import PlanGuess, plan_conversion, plan_guessing
from tests import families as fam
from tests.test_architecture_cache import FAMILIES

pytest.importorskip("transformers")


def _queries(tensors: dict) -> list:
    """The tensors ``classify.dense_architecture`` asks about, in its order."""
    return [(n, tuple(t.shape)) for n, t in sorted(tensors.items())
            if str(t.dtype).split(".")[-1] in {"bfloat16", "float16", "float32"}
            and (t.dim() == 3 or (t.dim() == 2 and n.endswith(".weight")))]


def _entries(cache) -> dict[str, bytes]:
    root = cache / "mxfp8-convert" / "architecture"
    return {p.name: p.read_bytes() for p in root.glob("*.json")} if root.exists() else {}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_child_decides_as_transformers_built_here(tmp_path, monkeypatch, family):
    cfg, make = FAMILIES[family]()
    queries = _queries(make(cfg))
    assert queries
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "child"))
    pending = arch_mod.decisions_later(cfg, queries)
    assert isinstance(pending, arch_mod.Pending)
    made = pending.result()
    plain = arch_mod.architecture(cfg)  # transformers' model, built here the plain way
    assert plain.basis == "architecture"
    assert [made.decide(*q) for q in queries] == [plain.decide(*q) for q in queries]
    # the same cache entry as a miss of decisions() writes, and now a hit
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "here"))
    arch_mod.decisions(cfg, queries)
    assert _entries(tmp_path / "child") == _entries(tmp_path / "here") != {}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "child"))
    assert arch_mod.decisions_later(cfg, queries) is None


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_a_new_interpreter_decides_as_the_fork_does(monkeypatch, family):
    """Where the child is not forked (``Pending.FORK`` off the Linux), this file runs as a
    script in a new interpreter: the same decisions."""
    cfg, make = FAMILIES[family]()
    queries = _queries(make(cfg))
    monkeypatch.setattr(arch_mod.Pending, "FORK", False)
    made = arch_mod.decisions_later(cfg, queries).result()
    plain = arch_mod.architecture(cfg)
    assert [made.decide(*q) for q in queries] == [plain.decide(*q) for q in queries]


@pytest.mark.parametrize("config", [
    {"model_type": "no_such_model", "hidden_size": 8},  # unknown to transformers
    {"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4,  # rejected
     "head_dim": 0},
])
def test_the_name_rules_of_the_child_are_those_made_here(config):
    queries = [("model.layers.0.mlp.up_proj.weight", (16, 8)), ("lm_head.weight", (32, 8))]
    pending = arch_mod.decisions_later(config, queries)
    assert pending is not None
    made, plain = pending.result(), arch_mod.architecture(config)
    assert made.basis == plain.basis == "names"
    assert made == plain  # the same reason, the same decisions
    assert not any((arch_mod.cache_root() / "architecture").glob("*.json"))  # not cached


@pytest.mark.parametrize("fork", [True, False])
def test_a_child_that_fails_is_made_up_for_here(tmp_path, monkeypatch, fork):
    cfg = fam.llama_config()
    queries = _queries(fam.llama_dense(cfg))
    monkeypatch.setattr(arch_mod.Pending, "FORK", fork)
    if fork:  # the forked child fails as it starts
        monkeypatch.setattr(arch_mod, "_child", lambda folder: 1 / 0)
    else:  # the new interpreter exits 1 at once
        monkeypatch.setattr(sys, "executable", "/bin/false")
    made = arch_mod.decisions_later(cfg, queries).result()
    plain = arch_mod.architecture(cfg)
    assert [made.decide(*q) for q in queries] == [plain.decide(*q) for q in queries]
    assert arch_mod.decisions_later(cfg, queries) is None  # cached all the same


def test_no_child_where_the_decisions_answer_at_once(tmp_path, monkeypatch):
    cfg = fam.llama_config()
    queries = _queries(fam.llama_dense(cfg))
    assert arch_mod.decisions_later(None, queries) is None  # no config.json
    arch_mod.decisions(cfg, queries)
    assert arch_mod.decisions_later(cfg, queries) is None  # cached
    monkeypatch.setenv(arch_mod.NO_CACHE_ENV, "1")
    assert arch_mod.decisions_later(cfg, queries) is not None  # built every time


def _convert(src, out, events=None):
    """A conversion of the checkpoint opened anew, as in a new process."""
    return convert(src, "canonical", out, progress=events.append if events is not None else None)


def _same_folders(a, b) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], [])


@pytest.mark.parametrize("family, guessed", [("llama", True), ("bert", False)])
def test_a_first_conversion_writes_what_a_cached_one_writes(tmp_path, family, guessed):
    """llama: the name rules plan what the architecture plans, and the guess is kept; bert:
    they call ``cls.predictions.transform.dense`` a linear of the model, the architecture a
    linear outside it, so the conversion starts again on the architecture's plan."""
    cfg, make = FAMILIES[family]()
    src = fam.write(tmp_path / "src", cfg, make(cfg))
    events: list = []
    first = _convert(src, tmp_path / "first", events)
    assert [e.stage for e in events].count("reading") == (1 if guessed else 2)
    cached_events: list = []
    cached = _convert(src, tmp_path / "cached", cached_events)  # the decisions read back
    assert [e.stage for e in cached_events].count("reading") == 1
    _same_folders(tmp_path / "first", tmp_path / "cached")
    assert first.plan == cached.plan
    assert {m.decided_by for m in first.plan.modules} == {"architecture"}
    assert first.quantization_errors == cached.quantization_errors
    assert not list(tmp_path.glob(".*mxfp8-partial*"))  # no work folder left


def test_a_guess_is_made_only_where_the_architecture_would_be_built(tmp_path):
    cfg = fam.llama_config()
    src = fam.write(tmp_path / "src", cfg, fam.llama_dense(cfg))
    _, plan, guess = plan_guessing(src, "canonical")
    try:
        assert {m.decided_by for m in plan.modules} == {"names"}
        assert guess.final() == plan_conversion(src, "canonical")[1]
    finally:
        guess.close()
    assert plan_guessing(src, "canonical")[2] is None  # cached now: the plan is final


def test_an_interrupted_guess_leaves_nothing_to_resume(tmp_path, monkeypatch):
    cfg = fam.llama_config()
    src = fam.write(tmp_path / "src", cfg, fam.llama_dense(cfg))

    def interrupted(self):  # Ctrl-C while waiting for the architecture's plan
        raise KeyboardInterrupt

    monkeypatch.setattr(arch_mod.Pending, "done", lambda self: False)  # not confirmed early
    monkeypatch.setattr(PlanGuess, "final", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _convert(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no work folder kept


def test_a_first_conversion_never_imports_transformers_here(tmp_path):
    cfg = fam.llama_config()
    src = fam.write(tmp_path / "src", cfg, fam.llama_dense(cfg))
    code = ("import sys; from mxfp8_convert import convert; "
            "r = convert(sys.argv[1], 'canonical', sys.argv[2]); "
            "print(sorted({m.decided_by for m in r.plan.modules}), 'transformers' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, check=True).stdout.split()
    assert out == ["['architecture']", "False"]
    entries = list((arch_mod.cache_root() / "architecture").glob("*.json"))
    assert len(entries) == 1 and json.loads(entries[0].read_text())["format"] == 1


def test_a_process_with_other_threads_starts_a_new_interpreter(monkeypatch):
    """A fork copies the locks other threads hold; with a thread running, the child is a new
    interpreter (no fork at all), and its decisions are the same."""
    cfg = fam.llama_config()
    queries = _queries(fam.llama_dense(cfg))
    monkeypatch.setenv(arch_mod.NO_CACHE_ENV, "1")
    forks = []
    monkeypatch.setattr(arch_mod.os, "fork", lambda: forks.append(1) or -1)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        pending = arch_mod.decisions_later(cfg, queries)
        pending.start()
        assert isinstance(pending._proc, subprocess.Popen)
        made = pending.result()
    finally:
        stop.set()
        other.join()
    plain = arch_mod.architecture(cfg)
    assert forks == []
    assert [made.decide(*q) for q in queries] == [plain.decide(*q) for q in queries]
