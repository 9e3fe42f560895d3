"""Modules computed side by side (``ShardTransform(in_flight=...)``): the output, the errors and
their order are those of computing one module at a time; a failure is the same one line, and no
helper thread outlives the conversion."""

from __future__ import annotations

import importlib
import json
import threading
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

import mxfp8_convert.transform as transform_mod
from mxfp8_convert import convert
from mxfp8_convert._buffers import SCRATCH
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from tests.checkpoints import leftovers, scratch_requests, tree_hashes

convert_mod = importlib.import_module("mxfp8_convert.convert")  # the package exports convert()
CANONICAL_MODULE = transform_mod.canonical_module

SPEC = SynthSpec(layers=3, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=2,
                 dialect="dense")


def _helpers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("mxfp8-module")]


def _convert(monkeypatch, src, out, backend: str, in_flight: int):
    """Convert with ``in_flight`` modules at once; return the result and the threads that
    computed the modules."""
    monkeypatch.setattr(convert_mod, "_in_flight", lambda plan, w, k, m: in_flight)
    where = []

    def spy(*args):
        where.append(threading.current_thread().name)
        return CANONICAL_MODULE(*args)

    monkeypatch.setattr(transform_mod, "canonical_module", spy)
    return convert(src, backend, out, max_shard_size=400_000), where


@pytest.mark.parametrize("backend", ["canonical", "trtllm"])
def test_side_by_side_writes_the_serial_bytes_and_errors(tmp_path, monkeypatch, backend):
    src = write_checkpoint(tmp_path / "src", SPEC)
    serial, where1 = _convert(monkeypatch, src, tmp_path / "one", backend, 1)
    parallel, where3 = _convert(monkeypatch, src, tmp_path / "three", backend, 3)
    assert set(where1) == {threading.current_thread().name}  # one at a time, in this thread
    assert {w.rsplit("_", 1)[0] for w in where3} == {"mxfp8-module"}  # all on helpers
    assert len(where3) == len(where1) == 3 * 7
    assert tree_hashes(tmp_path / "three") == tree_hashes(tmp_path / "one")
    assert list(parallel.quantization_errors.items()) == list(serial.quantization_errors.items())
    # the marker's errors, in the order they were recorded, are the same too
    one = json.loads((tmp_path / "one" / "mxfp8_convert.complete.json").read_text())
    three = json.loads((tmp_path / "three" / "mxfp8_convert.complete.json").read_text())
    assert json.dumps(three) == json.dumps(one)
    assert _helpers() == []


def test_a_failing_module_is_one_clear_error_and_no_helper_is_left(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src", SPEC)
    # a NaN in a module computed ahead, while earlier ones are still being written
    shard = next(p for p in sorted(src.glob("*.safetensors"))
                 if "model.layers.2.mlp.up_proj.weight" in load_file(p))
    tensors = load_file(shard)
    tensors["model.layers.2.mlp.up_proj.weight"][5, 70] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    messages = []
    for n in (1, 3):
        with pytest.raises(LayoutError) as e:
            _convert(monkeypatch, src, tmp_path / f"out{n}", "trtllm", n)
        messages.append(str(e.value))
        assert _helpers() == []
        assert not (tmp_path / f"out{n}").exists() and leftovers(tmp_path) == []
    assert messages[0] == messages[1]
    assert messages[0].startswith("model.layers.2.mlp.up_proj.weight: non-finite value nan at "
                                  "row 5, column 70")


@pytest.mark.parametrize(("cores", "workers", "threads", "in_flight"), [
    (2, 1, 1, 2),  # the 2-core machine: both cores quantize, one op thread each
    (2, 2, 1, 1),  # two workers already keep both busy
    (3, 2, 1, 1),
    (4, 1, 3, 1),  # ops on 3 threads: as before (MKL's dot products split by thread count)
    (1, 1, 1, 1),
])
def test_modules_in_flight_only_where_ops_run_on_one_thread(monkeypatch, cores, workers, threads,
                                                            in_flight):
    monkeypatch.setattr(convert_mod.os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)
    real, before = torch.get_num_threads, torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    with convert_mod._compute_threads(workers) as got:
        assert got == in_flight
    assert seen == [threads, 64]
    assert real() == before  # the real setting was never touched


def test_modules_in_flight_fit_the_memory_budget(tmp_path):
    from mxfp8_convert.run import plan_conversion

    _, plan = plan_conversion(write_checkpoint(tmp_path / "src", replace(SPEC, layers=1)),
                              "canonical")
    module = max(m.n * m.k * 2 for m in plan.modules)  # 512 x 256 bf16
    # one written, two computed, two more queued (QUEUED_AHEAD), and two helpers' scratch
    need = convert_mod.WORKER_BASE_BYTES + 5 * module + 2 * (30 << 20)
    assert convert_mod._in_flight(plan, 1, 2, need) == 2
    assert convert_mod._in_flight(plan, 1, 2, need - 1) == 1
    assert convert_mod._in_flight(plan, 1, 2, None) == 2


def test_helpers_compute_ahead_while_the_tensors_before_the_modules_are_copied(tmp_path,
                                                                             monkeypatch):
    # The shard's first tensors are copies (the embeddings): the helpers start on the modules
    # meanwhile, and take more than the two they compute at once (QUEUED_AHEAD), without
    # waiting for this thread to reach them; the bytes are the serial ones.
    src = write_checkpoint(tmp_path / "src", SPEC)
    monkeypatch.setattr(convert_mod, "_in_flight", lambda plan, w, k, m: 1)
    serial = convert(src, "canonical", tmp_path / "one")  # one output shard: all its modules
    started: list[str] = []
    lock = threading.Condition()

    def spy(m, *args):
        with lock:
            started.append(m.name)
            lock.notify_all()
        return CANONICAL_MODULE(m, *args)

    real_copy = transform_mod.ShardTransform._copy
    seen = []

    def copy(self, info, sink, *, check_nan):
        if not seen:  # the first copy: no module has been taken by this thread yet
            with lock:
                seen.append(lock.wait_for(lambda: len(started) >= 3, timeout=20))
        yield from real_copy(self, info, sink, check_nan=check_nan)

    monkeypatch.setattr(convert_mod, "_in_flight", lambda plan, w, k, m: 2)
    monkeypatch.setattr(transform_mod, "canonical_module", spy)
    monkeypatch.setattr(transform_mod.ShardTransform, "_copy", copy)
    parallel = convert(src, "canonical", tmp_path / "two")
    assert seen[0] is True  # three modules started before the first copy went on
    assert tree_hashes(tmp_path / "two") == tree_hashes(tmp_path / "one")
    assert list(parallel.quantization_errors.items()) == list(serial.quantization_errors.items())
    assert _helpers() == []


@pytest.mark.parametrize("workers, in_flight", [(1, 1), (1, 3), (2, 1)])
def test_the_quantizer_buffers_serve_every_module_and_go_with_the_conversion(
        tmp_path, monkeypatch, workers, in_flight):
    """Every thread that quantizes (this one, a worker's, a helper) makes each working buffer
    once, reusing it for the modules after (each module here is one chunk, below 2**20
    elements), and this thread holds none once the conversion returns."""
    src = write_checkpoint(tmp_path / "src", SPEC)
    monkeypatch.setattr(convert_mod, "_in_flight", lambda plan, w, k, m: in_flight)
    asked = scratch_requests(monkeypatch)
    convert(src, "canonical", tmp_path / "out", workers=workers)
    assert SCRATCH.buffers == {}
    biggest: dict = {}
    for thread, key, numel, new in asked:  # a buffer is made only for a request bigger than any
        assert new == (numel > biggest.get((thread, key), 0))  # before on that thread: none is
        biggest[thread, key] = max(numel, biggest.get((thread, key), 0))  # released between
    assert max(n for _, _, n, _ in asked) < 1 << 20
    assert len(asked) > 2 * sum(new for *_, new in asked)  # most modules reused buffers
