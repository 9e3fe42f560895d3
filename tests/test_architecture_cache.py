"""The architecture's decisions, cached across runs (architecture.decisions): a hit gives the
plan a fresh build gives, for every family the README lists, without importing transformers;
anything the decisions depend on changing, or a cache file that is not exactly its entry,
builds the architecture again."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest

import mxfp8_convert.architecture as arch_mod
from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.formats import detect_source
from mxfp8_convert.plan import build_plan
from mxfp8_convert.read import open_checkpoint
from mxfp8_convert.run import plan_conversion
from tests import families as fam
from tests.checkpoints import Referable

pytest.importorskip("transformers")

FAMILIES = {
    "llama": lambda: (fam.llama_config(), fam.llama_dense),
    "qwen2_vl": lambda: (fam.qwen2_vl_config(), fam.qwen2_vl_bf16),
    "qwen2_moe": lambda: (fam.qwen2_moe_config(), fam.qwen2_moe_bf16),
    "bert": lambda: (fam.bert_config(), fam.bert_fp32),
    "llama4": lambda: (fam.llama4_config(), fam.llama4_bf16),
    "gpt_oss": lambda: (fam.gpt_oss_config(), fam.gpt_oss_bf16),
}


@pytest.fixture
def builds(monkeypatch):
    """Counts the architectures built (each a transformers model on the meta device)."""
    calls = []
    real = arch_mod.architecture

    def spy(config):
        calls.append(config.get("model_type") if isinstance(config, dict) else None)
        return real(config)

    monkeypatch.setattr(arch_mod, "architecture", spy)
    return calls


def _plan(src) -> dict:
    """A plan of the checkpoint opened anew: as in a new process, nothing of an earlier plan
    answers but the cache (``SourceCheckpoint.memo`` goes with its checkpoint)."""
    return plan_conversion(src, "canonical", on_ineligible="keep")[1].to_dict()


def _entries() -> list:
    root = arch_mod.cache_root() / "architecture"
    return sorted(root.glob("*.json")) if root.exists() else []


def _llama(tmp_path, **keys):
    cfg = fam.llama_config(**keys)
    return fam.write(tmp_path / "src", cfg, fam.llama_dense(fam.llama_config()))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_hit_plans_what_a_fresh_build_plans(tmp_path, builds, family):
    cfg, tensors = FAMILIES[family]()
    src = fam.write(tmp_path / "src", cfg, tensors(cfg))
    cold = _plan(src)
    assert builds == [cfg["model_type"]] and len(_entries()) == 1
    warm = _plan(src)
    assert builds == [cfg["model_type"]]  # not built again
    assert warm == cold
    assert {m["decided_by"] for m in warm["modules"]} == {"architecture"}


def test_a_hit_does_not_import_transformers(tmp_path):
    src = _llama(tmp_path)
    code = ("import sys; from mxfp8_convert.run import plan_conversion; "
            "p = plan_conversion(sys.argv[1], 'canonical')[1]; "
            "print(len(p.modules), 'transformers' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = [subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True,
                           env=env, check=True).stdout.split() for _ in range(2)]
    linears = str(len(fam.llama_linears(fam.llama_config())))
    assert runs == [[linears, "True"], [linears, "False"]]


@pytest.mark.parametrize("change", ["config", "tensors", "transformers", "torch", "code"])
def test_what_the_decisions_depend_on_changing_builds_again(tmp_path, builds, monkeypatch,
                                                             change):
    src = _llama(tmp_path)
    cold = _plan(src)
    if change == "config":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    elif change == "tensors":  # one more layer's weights, under the same config
        fam.write(tmp_path / "src", fam.llama_config(),
                  fam.llama_dense(fam.llama_config(num_hidden_layers=3)))
    elif change in ("transformers", "torch"):
        real = arch_mod._installed
        monkeypatch.setattr(arch_mod, "_installed",
                            lambda d: [*real(d)[:2], "0" * 64] if d == change else real(d))
    else:  # this module's source
        real_bytes = arch_mod.Path.read_bytes
        monkeypatch.setattr(arch_mod.Path, "read_bytes", lambda p: real_bytes(p) + (
            b"#" if str(p) == arch_mod.__file__ else b""))
    again = _plan(src)
    assert len(builds) == 2 and len(_entries()) == 2
    if change not in ("config", "tensors"):
        assert again == cold


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "wrong key", "bad kind",
                                    "short", "other tensor"])
def test_a_damaged_entry_is_ignored_and_made_again(tmp_path, builds, damage):
    src = _llama(tmp_path)
    cold = _plan(src)
    (entry,) = _entries()
    good = entry.read_text()
    doc = json.loads(good)
    if damage == "garbage":
        entry.write_bytes(b"\x00\xffnot json")
    elif damage == "empty":
        entry.write_text("")
    elif damage == "truncated":
        entry.write_text(good[: len(good) // 2])
    elif damage == "wrong key":
        entry.write_text(json.dumps({**doc, "key": "0" * 64}))
    elif damage == "bad kind":
        doc["decisions"][0][1] = "quantize me"
        entry.write_text(json.dumps(doc))
    elif damage == "short":
        entry.write_text(json.dumps({**doc, "decisions": doc["decisions"][:-1]}))
    else:
        doc["decisions"][0][0] = "model.layers.0.mlp.other_proj.weight"
        entry.write_text(json.dumps(doc))
    assert _plan(src) == cold
    assert len(builds) == 2
    assert entry.read_text() == good  # made again, whole


def test_an_unusable_cache_folder_is_passed_over(tmp_path, builds, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    src = _llama(tmp_path)
    first = _plan(src)
    assert _plan(src) == first and len(builds) == 2
    assert blocker.read_text() == ""


@pytest.mark.parametrize("value", ["1", "yes"])
def test_no_cache_reads_and_writes_nothing(tmp_path, builds, monkeypatch, value):
    src = _llama(tmp_path)
    first = _plan(src)  # cached
    assert len(_entries()) == 1
    entry = _entries()[0]
    before = entry.read_bytes()
    monkeypatch.setenv("MXFP8_CONVERT_NO_CACHE", value)
    assert _plan(src) == first and _plan(src) == first
    assert len(builds) == 3  # built every time, the entry not read
    entry.unlink()
    assert _plan(_llama(tmp_path / "other", hidden_act="gelu")) and _entries() == []
    monkeypatch.setenv("MXFP8_CONVERT_NO_CACHE", "0")  # "0" means use it, as unset does
    assert _plan(src) == first and len(builds) == 5 and _entries()[0].read_bytes() == before


def test_in_memory_the_decisions_go_with_their_checkpoint(tmp_path, builds, monkeypatch):
    """Every plan of one checkpoint object asks for its decisions once; once the caller drops
    the checkpoint, nothing holds them (a built architecture holds the model's modules)."""
    src = _llama(tmp_path)
    made = []
    real = arch_mod.decisions

    def spy(*args):
        d = real(*args)
        made.append(weakref.ref(d))
        return d

    monkeypatch.setattr(arch_mod, "decisions", spy)
    ckpt = Referable.of(open_checkpoint(src))
    fmt = detect_source(ckpt.config, ckpt.quant_files, ckpt.tensors)
    plans = [build_plan(ckpt, BACKENDS[b], fmt, on_ineligible="keep") for b in BACKENDS]
    assert len(made) == 1 and builds == ["llama"] and made[0]() is not None
    held = weakref.ref(ckpt)
    del ckpt
    gc.collect()
    assert held() is None and made[0]() is None
    assert all(p.modules for p in plans)  # the plans are still here


def test_the_cache_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert arch_mod.cache_root() == tmp_path / "c" / "mxfp8-convert"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # XDG: only absolute paths count
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert arch_mod.cache_root() == tmp_path / "home" / ".cache" / "mxfp8-convert"


def test_name_rules_are_not_cached(tmp_path, builds):
    cfg = {**fam.llama_config(), "model_type": "llama_from_the_future"}
    src = fam.write(tmp_path / "src", cfg, fam.llama_dense(fam.llama_config()))
    plans = [_plan(src), _plan(src)]
    assert plans[0] == plans[1] and len(builds) == 2 and _entries() == []


def test_the_output_config_is_the_sources_whether_built_or_cached(tmp_path):
    from mxfp8_convert import convert

    # Llama-3.x's rope_scaling: transformers' config adds rope_theta to the dict it is given
    rope = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    src = _llama(tmp_path, rope_scaling=rope, rope_theta=500000.0)
    source = json.loads((src / "config.json").read_text())
    outs = []
    for run in ("built", "cached"):
        convert(src, "canonical", tmp_path / run)
        out = json.loads((tmp_path / run / "config.json").read_text())
        assert out.pop("quantization_config")["quant_method"] == "mxfp8"
        assert out == source
        outs.append((tmp_path / run / "config.json").read_bytes())
    assert outs[0] == outs[1]
