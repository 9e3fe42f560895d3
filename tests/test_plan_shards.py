"""Output shards: packed and named as huggingface_hub's ``split_torch_state_dict_into_shards``
(what transformers' ``save_pretrained`` calls) packs and names them, with a module's weight and
scale (and a fused MoE projection and its scale) kept in one file; indexed as Hub checkpoints
are; never empty; and verify, the runtime loader, resume and parts working on them.

The reference is huggingface_hub itself, fed one tensor per group (a module, a copied tensor)
of the group's size, in the order this test derives from the source's own layout.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards

from mxfp8_convert import convert
from mxfp8_convert.cli import main
from mxfp8_convert.convert import finalize, plan_conversion
from mxfp8_convert.errors import FormatError
from mxfp8_convert.plan.shards import shard_size_bytes
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from mxfp8_convert.verify import verify
from tests.checkpoints import load_all

SPEC = SynthSpec(layers=3, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=3)
MOE = replace(SPEC, experts=4, moe_intermediate=256, shared_expert=True)
NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


def _groups_in_source_order(src: Path, plan) -> list[list[str]]:
    """Output tensor names grouped as the converter must keep them (a module's tensors; a fused
    MoE projection's weight and scale; a copied tensor alone), ordered by where the group's
    first source tensor sits in the source: file name, then offset. Written from the source
    files' headers and the output names alone."""
    where = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, e in _header(f).items():
            if name != "__metadata__":
                where[name] = (f.name, e["data_offsets"][0])
    groups: dict[str, list[str]] = {}
    firsts: dict[str, tuple] = {}
    for shard in plan.shards:
        for t in shard.tensors:
            if t.role.startswith("moe_fc"):
                key = f"{t.module}/{t.role[:7]}"
                layer = next(m for m in plan.moe if m.name == t.module)
                first = (layer.gate if t.role.startswith("moe_fc1") else layer.down)[0].weight.name
            elif t.module is not None:
                key, first = t.module, f"{t.module}.weight"
            else:
                key, first = t.name, t.name
            groups.setdefault(key, []).append(t.name)
            firsts[key] = where[first]
    return [groups[k] for k in sorted(groups, key=lambda k: (firsts[k], k))]


def _reference(plan, groups: list[list[str]], max_bytes: int) -> dict[str, list[str]]:
    """huggingface_hub's split of one tensor per group, of the group's size: file -> groups."""
    size = {t.name: t.nbytes for s in plan.shards for t in s.tensors}
    state = {g[0]: torch.empty(sum(size[n] for n in g), dtype=torch.uint8) for g in groups}
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_bytes)
    members = {g[0]: g for g in groups}
    return {f: sorted(n for k in keys for n in members[k])
            for f, keys in split.filename_to_tensors.items()}


@pytest.mark.parametrize(("spec", "backend", "max_bytes"), [
    (SPEC, "trtllm", 300_000), (SPEC, "cutlass", 700_000), (SPEC, "trtllm", 10**9),
    (SPEC, "trtllm", 100_000),  # groups over the bound: alone, where met
    (MOE, "trtllm", 200_000), (MOE, "cutlass", 150_000), (replace(SPEC, dialect="block_fp8"),
                                                          "canonical", 250_000),
])
def test_shards_are_packed_and_named_as_huggingface_hub_does(tmp_path, spec, backend, max_bytes):
    src = write_checkpoint(tmp_path / "src", spec)
    _, plan = plan_conversion(src, backend, max_shard_size=max_bytes)
    want = _reference(plan, _groups_in_source_order(src, plan), max_bytes)
    got = {s.name: sorted(t.name for t in s.tensors) for s in plan.shards}
    assert got == want
    assert all(s.tensors for s in plan.shards)
    if max_bytes < plan.nbytes:
        assert len(got) > 1


def test_a_group_larger_than_the_bound_gets_a_shard_of_its_own(tmp_path):
    """The embedding (256 x 256 BF16, 128 KiB) alone is over the bound: alone in its shard, as
    huggingface_hub puts it; every other shard within the bound."""
    src = write_checkpoint(tmp_path / "src", SPEC)
    _, plan = plan_conversion(src, "trtllm", max_shard_size=100_000)
    over = [s for s in plan.shards if s.nbytes > 100_000]
    assert over and all(len({t.module or t.name for t in s.tensors}) == 1 for s in over)
    assert any(s.tensors[0].name == "model.embed_tokens.weight" for s in over)


def test_converted_shards_index_verify_and_load(tmp_path):
    """The written output: files named and indexed as Hub checkpoints (total_size the sum of
    the tensors' bytes, weight_map naming the file each tensor is in, read from the files), no
    shard over the bound, verify and the runtime loader take it, same tensors as one shard."""
    from mxfp8_convert.runtime.load import load_checkpoint

    src = write_checkpoint(tmp_path / "src", MOE)
    out = tmp_path / "out"
    convert(src, "trtllm", out, max_shard_size=200_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    held = {name: f for f in files for name in _header(out / f) if name != "__metadata__"}
    assert index["weight_map"] == dict(sorted(held.items()))
    sizes = {}
    for f in files:
        h = _header(out / f)
        sizes[f] = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in h.items()
                       if k != "__metadata__")
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert all(0 < s for s in sizes.values())
    assert verify(out, src).ok
    convert(src, "trtllm", tmp_path / "one")
    one = tmp_path / "one"
    assert sorted(one.glob("*.safetensors")) == [one / "model.safetensors"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    a, _ = load_all(out)
    b, _ = load_all(tmp_path / "one")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    sharded, single = (load_checkpoint(p, engine="reference") for p in (out, tmp_path / "one"))
    assert sharded.weights.keys() == single.weights.keys() and len(sharded.weights) > 4
    assert sharded.tensors.keys() == single.tensors.keys()


def test_parts_split_the_output_shards_and_finalize(tmp_path):
    src = write_checkpoint(tmp_path / "src", SPEC)
    out = tmp_path / "out"
    for i in (1, 0):
        convert(src, "cutlass", out, part=(i, 2), max_shard_size=300_000)
    r = finalize(out)
    assert len(r.plan.shards) > 3 and verify(out, src).ok
    convert(src, "cutlass", tmp_path / "one", max_shard_size=300_000)
    assert (out / "model.safetensors.index.json").read_bytes() == (
        tmp_path / "one" / "model.safetensors.index.json").read_bytes()


def test_another_max_shard_size_does_not_resume_the_work_of_the_first(tmp_path):
    from tests.checkpoints import Stop, interrupt_after

    src = write_checkpoint(tmp_path / "src", SPEC)
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(src, "cutlass", out, max_shard_size=300_000, progress=interrupt_after(1))
    with pytest.raises(Exception, match=r"other parameters \(max_shard_size\)"):
        convert(src, "cutlass", out, max_shard_size=400_000)


@pytest.mark.parametrize(("text", "bytes_"), [("5GB", 5 * 10**9), ("4GiB", 4 * 2**30),
                                               ("500MB", 5 * 10**8), ("123", 123),
                                               (7_000, 7_000)])
def test_sizes_read_as_transformers_reads_them(text, bytes_):
    from huggingface_hub.serialization._base import parse_size_to_int

    assert shard_size_bytes(text) == bytes_
    if isinstance(text, str) and text[-2:] in ("GB", "MB"):
        assert parse_size_to_int(text) == bytes_  # huggingface_hub's own reading


@pytest.mark.parametrize("bad", ["lots", "0", "-1GB", 0, True])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(FormatError, match="--max-shard-size"):
        shard_size_bytes(bad)


def test_cli_max_shard_size(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", SPEC)
    assert main([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--max-shard-size",
                 "lots"]) == 2
    assert "'lots' is not a size like 8GiB or 500MB" in capsys.readouterr().err
    assert main([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--max-shard-size", "0"]) == 2
    assert not (tmp_path / "o").exists()
    assert main([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--max-shard-size", "300KB",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = [s["name"] for s in doc["plan"]["shards"]]
    assert len(names) > 3 and all(NAME.fullmatch(n) for n in names)
    assert all(s["nbytes"] <= 300_000 for s in doc["plan"]["shards"])
