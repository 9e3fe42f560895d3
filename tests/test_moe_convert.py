"""MoE checkpoints end to end: per-expert weights fused for the trtllm-gen MoE kernel, and back.

The fused bytes are checked against FlashInfer's own CPU-runnable MoE helpers applied per expert
(``flashinfer/fused_moe/core.py``, the way ``prepare_trtllm_fp8_block_weights`` applies them);
the CUDA-only ``block_scale_interleave`` step is the docs/LAYOUTS.md section 2 formula, as in
``tests/layouts/test_moe.py``.
"""

from __future__ import annotations

import importlib
import json
import shutil
import weakref
from dataclasses import replace

import pytest
import torch

from mxfp8_convert import convert
from mxfp8_convert.cli import main
from mxfp8_convert.convert import finalize
from mxfp8_convert.errors import IneligibleError, LayoutError
from mxfp8_convert.inspection import inspect_checkpoint
from mxfp8_convert.layouts.moe import moe_fc1_row_indices
from mxfp8_convert.plan import MOE_LAYOUT, expert_key
from mxfp8_convert.read import open_checkpoint
from mxfp8_convert.synth import (
    MXFP8_DIALECTS,
    SynthSpec,
    expert_names,
    scale_suffix,
    write_checkpoint,
)
from mxfp8_convert.verify import verify
from tests.checkpoints import flip_byte, load_all, marker, spec_swizzle_128x4

fi_core = pytest.importorskip("flashinfer.fused_moe.core")
transform_mod = importlib.import_module("mxfp8_convert.transform")  # where modules are computed

# H=256, I=128: FC2's K (=I) is not a multiple of 256, which trtllm's mm_mxfp8 would refuse for
# a dense linear, but the fused MoE kernel takes. The shared expert and attention stay dense.
SPEC = SynthSpec(layers=2, hidden=256, intermediate=256, heads=2, kv_heads=1, vocab=256, shards=3,
                 experts=4, moe_intermediate=128, shared_expert=True)
BLOCKS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
FUSED = ("w13_weight", "w13_weight_scale_swizzled", "w2_weight", "w2_weight_scale_swizzled")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    cases = {
        "sglang_mxfp8": SPEC,
        "e8m0": replace(SPEC, scale_dtype=torch.float8_e8m0fnu, seed=1),
        "compressed_tensors_mxfp8": replace(SPEC, dialect="compressed_tensors_mxfp8", seed=2),
        "w123": replace(SPEC, w123_names=True, seed=3),
        "dense": replace(SPEC, dialect="dense", seed=4),
        "block_fp8": replace(SPEC, dialect="block_fp8", seed=5),
        "block_fp8_requant": replace(SPEC, dialect="block_fp8", pow2_scales=False, seed=6),
    }
    return {name: (write_checkpoint(root / name, spec), spec) for name, spec in cases.items()}


# --- FlashInfer references, one expert at a time -------------------------------------------


def flashinfer_expert(w, s, block: str, e: int, names, scale_name: str) -> dict[str, torch.Tensor]:
    """Expert ``e``'s four fused pieces from canonical tensors ``w``/``s`` (name -> tensor), the
    way ``prepare_trtllm_fp8_block_weights`` lays them out (MXFP8 branch)."""
    gate, up, down = (f"{block}.{e}.{n}" for n in names)
    w13 = torch.cat([u8(w[f"{up}.weight"]), u8(w[f"{gate}.weight"])])
    s13 = torch.cat([u8(s[f"{up}.{scale_name}"]), u8(s[f"{gate}.{scale_name}"])])
    w2, s2 = u8(w[f"{down}.weight"]), u8(s[f"{down}.{scale_name}"])
    perm13 = fi_core._maybe_get_cached_w3_w1_permute_indices({}, w13, 128)
    perm13_sf = fi_core._maybe_get_cached_w3_w1_permute_indices({}, s13, 128, num_elts_per_sf=32)
    perm2 = fi_core.get_w2_permute_indices_with_cache({}, w2, 128)
    perm2_sf = fi_core.get_w2_permute_indices_with_cache({}, s2, 128, num_elts_per_sf=32)
    return {"w13_weight": w13[perm13],
            "w13_weight_scale_swizzled": spec_swizzle_128x4(s13[perm13_sf].contiguous()),
            "w2_weight": w2[perm2],
            "w2_weight_scale_swizzled": spec_swizzle_128x4(s2[perm2_sf].contiguous())}


def canonical_reference(sources, name, tmp_path):
    """Per-expert canonical MXFP8 of a source: its own bytes for MXFP8 dialects, else what the
    ``canonical`` backend makes of it (the same quantization the fused path runs)."""
    src, spec = sources[name]
    if spec.dialect in MXFP8_DIALECTS:
        t, _ = load_all(src)
        return t, scale_suffix(spec.dialect)
    convert(src, "canonical", tmp_path / "canonical")
    t, _ = load_all(tmp_path / "canonical")
    return t, "weight_scale_inv"


# --- bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sglang_mxfp8", "e8m0", "compressed_tensors_mxfp8", "w123",
                                  "dense", "block_fp8", "block_fp8_requant"])
def test_fused_bytes_equal_flashinfer_per_expert(sources, tmp_path, same_bytes, name):
    src, spec = sources[name]
    result = convert(src, "trtllm", tmp_path / "out")
    got, meta = load_all(tmp_path / "out")
    ref, scale_name = canonical_reference(sources, name, tmp_path)
    e_count, h, i = spec.experts, spec.hidden, spec.moe_intermediate
    for block in BLOCKS:
        want = [flashinfer_expert(ref, ref, block, e, expert_names(spec), scale_name)
                for e in range(e_count)]
        for suffix in FUSED:
            t = got[f"{block}.{suffix}"]
            same_bytes(t.reshape(e_count, -1), torch.stack([w[suffix].reshape(-1) for w in want]),
                       f"{block}.{suffix}")
        assert got[f"{block}.w13_weight"].dtype == torch.float8_e4m3fn
        assert tuple(got[f"{block}.w13_weight"].shape) == (e_count, 2 * i, h)
        tiles13 = (e_count, 2 * i // 128, h // 128, 512)
        assert tuple(got[f"{block}.w13_weight_scale_swizzled"].shape) == tiles13
        assert tuple(got[f"{block}.w2_weight"].shape) == (e_count, h, i)
        tiles2 = (e_count, h // 128, i // 128, 512)
        assert tuple(got[f"{block}.w2_weight_scale_swizzled"].shape) == tiles2
    assert not any(expert_key(n.rsplit(".", 1)[0]) for n in got), (
        "exactly one copy: no per-expert tensors left")
    assert "model.layers.0.mlp.gate.weight" in got  # the router passes through
    assert "model.layers.0.mlp.shared_experts.up_proj.weight_scale_swizzled" in got  # dense rules
    assert verify(tmp_path / "out", src).ok
    # requantized: one error per expert projection
    if spec.dialect == "dense" or not spec.pow2_scales:
        assert f"{BLOCKS[1]}.3.{expert_names(spec)[2]}" in result.quantization_errors


def test_records_marker_and_placement(sources, tmp_path):
    src, spec = sources["sglang_mxfp8"]
    result = convert(src, "trtllm", tmp_path / "out", max_shard_size=200_000)
    m = marker(tmp_path / "out")["moe"]
    assert m["layout"] == MOE_LAYOUT and m["layers"] == list(BLOCKS)
    assert m["experts_suffixes"] == {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    assert m["fc1"] == "cat([up, gate]) rows interleaved then P32" and m["fc2"] == "P32"
    src_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out_index = tmp_path / "out" / "model.safetensors.index.json"
    out_map = json.loads(out_index.read_text())["weight_map"]
    experts = "model.layers.0.mlp.experts"
    assert src_map[f"{experts}.0.gate_proj.weight"] != src_map[f"{experts}.1.up_proj.weight"], (
        "the fixture must spread an expert over shards")
    assert len(set(out_map.values())) > 2
    shards = {layer.name: layer.shard for layer in result.plan.moe}
    for block in BLOCKS:  # each fused weight beside its scale; the plan says where FC1 went
        assert out_map[f"{block}.w13_weight"] == out_map[f"{block}.w13_weight_scale_swizzled"]
        assert out_map[f"{block}.w2_weight"] == out_map[f"{block}.w2_weight_scale_swizzled"]
        assert shards[block] == out_map[f"{block}.w13_weight"]
    _, meta = load_all(tmp_path / "out")
    records = {k: v for shard in meta.values()
               for k, v in json.loads(shard["mxfp8_convert.tensors"]).items()}
    block = BLOCKS[0]
    common = {"layout": MOE_LAYOUT, "experts": 4, "hidden": 256, "intermediate": 128}
    assert records[f"{block}.w13_weight"] == {
        "role": "moe_fc1_weight", "shape": [4, 256, 256], **common}
    assert records[f"{block}.w13_weight_scale_swizzled"] == {
        "role": "moe_fc1_scale", "logical_shape": [4, 256, 8], "tile_shape": [4, 2, 2, 512],
        **common}
    assert records[f"{block}.w2_weight"] == {
        "role": "moe_fc2_weight", "shape": [4, 256, 128], **common}
    assert records[f"{block}.w2_weight_scale_swizzled"] == {
        "role": "moe_fc2_scale", "logical_shape": [4, 256, 4], "tile_shape": [4, 2, 1, 512],
        **common}
    convert(src, "cutlass", tmp_path / "cut")
    assert marker(tmp_path / "cut")["moe"] is None


# --- the way back ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sglang_mxfp8", "w123"])
def test_canonical_round_trip_is_byte_identical(sources, tmp_path, name):
    src, spec = sources[name]
    convert(src, "trtllm", tmp_path / "trt")
    convert(tmp_path / "trt", "canonical", tmp_path / "back")
    want, _ = load_all(src)
    got, _ = load_all(tmp_path / "back")
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(u8(got[k]), u8(t)), k
    assert f"{BLOCKS[0]}.2.{expert_names(spec)[1]}.weight_scale_inv" in got
    original = json.loads((src / "config.json").read_text())["quantization_config"]
    assert marker(tmp_path / "back") == original
    assert verify(tmp_path / "back", tmp_path / "trt").ok


@pytest.mark.parametrize("name, first, then", [("sglang_mxfp8", "trtllm", "cutlass"),
                                               ("sglang_mxfp8", "cutlass", "trtllm"),
                                               ("dense", "cutlass", "trtllm")])
def test_a_laid_out_source_converts_as_the_direct_conversion(sources, tmp_path, name, first,
                                                              then):
    """From trtllm the fused experts are un-fused; from cutlass each expert is un-laid, then
    the experts are fused."""
    src, _ = sources[name]
    convert(src, first, tmp_path / "first")
    convert(tmp_path / "first", then, tmp_path / "via")
    convert(src, then, tmp_path / "direct")
    via, _ = load_all(tmp_path / "via")
    direct, _ = load_all(tmp_path / "direct")
    assert set(via) == set(direct)
    assert all(torch.equal(u8(via[k]), u8(direct[k])) for k in via)
    assert verify(tmp_path / "via", tmp_path / "first").ok


def test_split_conversion_equals_one_run(sources, tmp_path):
    src, _ = sources["sglang_mxfp8"]  # fused tensors read experts from other shards than their own
    for i in (1, 0, 2):
        convert(src, "trtllm", tmp_path / "parts", part=(i, 3))
    finalize(tmp_path / "parts")
    convert(src, "trtllm", tmp_path / "one")
    a, _ = load_all(tmp_path / "parts")
    b, _ = load_all(tmp_path / "one")
    assert a.keys() == b.keys() and all(torch.equal(u8(a[k]), u8(b[k])) for k in a)


# --- constraints and --moe keep -------------------------------------------------------------


def test_shape_violations_are_listed_before_any_work(tmp_path):
    src = write_checkpoint(tmp_path / "src", replace(SPEC, moe_intermediate=96))
    with pytest.raises(IneligibleError) as e:
        convert(src, "trtllm", tmp_path / "out")
    assert e.value.offenders == [
        f"{b} [E=4, H=256, I=96]: I=96 is not a multiple of 128 "
        "(FC2 scale columns I/32 % 4, FlashInfer's MXFP8 prepare check); "
        "2I=192 is not a multiple of 128 (FC1 P32 scale rows)" for b in BLOCKS]
    assert str(e.value).startswith("2 tensor(s) or MoE block(s) do not fit backend trtllm: ")
    assert "--moe keep" in e.value.hint
    assert not (tmp_path / "out").exists()
    r = convert(src, "trtllm", tmp_path / "kept", on_ineligible="keep")
    assert r.plan.moe == () and marker(tmp_path / "kept")["moe"] is None
    reasons = {m.reason for m in r.plan.modules if expert_key(m.name)}
    assert len(reasons) == 1
    assert reasons.pop().startswith("fused MoE: I=96 is not a multiple of 128")
    assert verify(tmp_path / "kept", src).ok


def test_moe_keep_leaves_experts_canonical_per_expert(sources, tmp_path):
    src, _ = sources["sglang_mxfp8"]
    r = convert(src, "trtllm", tmp_path / "out", moe="keep")
    got, meta = load_all(tmp_path / "out")
    want, _ = load_all(src)
    name = f"{BLOCKS[1]}.3.down_proj"
    assert torch.equal(u8(got[f"{name}.weight"]), u8(want[f"{name}.weight"]))
    assert torch.equal(got[f"{name}.weight_scale_inv"], want[f"{name}.weight_scale_inv"])
    assert not any(n.endswith(FUSED) for n in got) and marker(tmp_path / "out")["moe"] is None
    assert {m.reason for m in r.plan.modules if expert_key(m.name)} == {"--moe keep"}
    assert r.plan.moe_mode == "keep" and r.plan.to_dict()["moe_layers"] == []
    assert verify(tmp_path / "out", src).ok


def test_incomplete_experts_are_refused(sources, tmp_path):
    src, _ = sources["sglang_mxfp8"]
    with pytest.raises(LayoutError,
                       match=r"model.layers.\d.mlp.experts: expert \d has no up projection"):
        convert(src, "trtllm", tmp_path / "out", ignore=["*.experts.2.up_proj"])
    convert(src, "trtllm", tmp_path / "out", ignore=["*.experts.2.up_proj"], moe="keep")


# --- verify and inspect ---------------------------------------------------------------------


@pytest.mark.parametrize("physical_row", [5, 8 + 32])  # an up row, a gate row
def test_verify_names_expert_row_and_col_of_a_flipped_byte(sources, tmp_path, physical_row):
    src, spec = sources["sglang_mxfp8"]
    out = tmp_path / "out"
    convert(src, "trtllm", out)
    assert verify(out, src).ok
    e, col, h, i = 2, 17, spec.hidden, spec.moe_intermediate
    flip_byte(out, f"{BLOCKS[1]}.w13_weight", (e * 2 * i + physical_row) * h + col)
    row = int(moe_fc1_row_indices(i)[physical_row])  # row of cat([up, gate])
    proj, row = ("up_proj", row) if row < i else ("gate_proj", row - i)
    assert proj == ("up_proj" if physical_row == 5 else "gate_proj")
    mismatches = verify(out, src, check_hashes=False).mismatches
    assert [str(m) for m in mismatches] == [
        f"{BLOCKS[1]}.{e}.{proj}.weight: differs from the source's canonical MXFP8 "
        f"(expert, row, col) at [{e}, {row}, {col}]"]


def test_verify_catches_scale_and_record_tampering(sources, tmp_path):
    src, _ = sources["sglang_mxfp8"]
    out = tmp_path / "out"
    convert(src, "trtllm", out)
    # expert 3, tile (0, 0), byte 0
    flip_byte(out, f"{BLOCKS[0]}.w2_weight_scale_swizzled", 512 * 2 * 3)
    [m] = verify(out, src, check_hashes=False).mismatches
    assert (m.where, m.position) == (f"{BLOCKS[0]}.3.down_proj.scale", [3, 0, 0])
    info = open_checkpoint(out).tensors[f"{BLOCKS[0]}.w2_weight"]
    raw = (out / info.file).read_bytes()
    old, new = b'"intermediate\\":128,\\"layout', b'"intermediate\\":256,\\"layout'  # JSON in JSON
    assert old in raw  # the first is w13_weight's record (sorted keys)
    (out / info.file).write_bytes(raw.replace(old, new, 1))
    found = {m.where: m.what for m in verify(out, check_hashes=False).mismatches}
    assert found[f"{BLOCKS[0]}.w13_weight"] == (
        "F8_E4M3 [4, 256, 256], but moe_fc1_weight of E=4, H=256, I=256 is F8_E4M3 [4, 512, 256]")
    assert found[f"{BLOCKS[0]}.w2_weight"] == (
        "the four fused tensors of this block record different E, H, I")


def test_inspect_shows_moe_blocks(sources, tmp_path, capsys):
    src, _ = sources["sglang_mxfp8"]
    rep = inspect_checkpoint(src)
    blocks = [(m.name, m.experts, m.hidden, m.intermediate, m.stored, m.why_not)
              for m in rep.moe]
    assert blocks == [(b, 4, 256, 128, "per-expert", []) for b in BLOCKS]
    assert "8 experts fused into 2 MoE blocks" in rep.actions["trtllm"]
    bad = write_checkpoint(tmp_path / "bad", replace(SPEC, moe_intermediate=96))
    assert inspect_checkpoint(bad).moe[0].why_not[0].startswith("I=96 is not a multiple of 128")
    convert(src, "trtllm", tmp_path / "out")
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["stored"] for m in doc["moe_layers"]] == ["fused (trtllm)"] * 2
    assert doc["count_by_role"]["moe_fc1_weight"] == 2


def test_cli_moe_option(sources, tmp_path, capsys):
    src, _ = sources["sglang_mxfp8"]
    args = [str(src), "-b", "trtllm", "-o", str(tmp_path / "o")]
    assert main([*args, "--dry-run", "--json", "--moe", "keep"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["moe_layers"] == []
    assert doc["plan"]["modules_by_action"] == {"relayout": 14, "keep": 24}
    assert main([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in doc["plan"]["moe_layers"]] == list(BLOCKS)
    assert main([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--moe", "nope"]) == 2
    assert "'nope' is not one of 'fuse', 'keep'." in capsys.readouterr().err


# --- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense", "block_fp8"])
def test_at_most_one_expert_in_memory(sources, tmp_path, monkeypatch, name):
    """Every canonical weight the converter computes goes through ``canonical_module``; watch
    each one's lifetime (weakref) and record which experts are alive at once. (MXFP8 sources are
    laid out from the mapping, computing nothing: ``test_fused_moe_memory_bounded`` bounds them.)
    """
    alive: dict[int, tuple[str, int]] = {}
    seen: list[set] = []
    real = transform_mod.canonical_module

    def watched(m, *args):
        q, s, err = real(m, *args)
        key = expert_key(m.name)
        if key is not None:
            alive[id(q)] = key[:2]
            weakref.finalize(q, alive.pop, id(q), None)
            seen.append(set(alive.values()))
        return q, s, err

    monkeypatch.setattr(transform_mod, "canonical_module", watched)
    src, spec = sources[name]
    convert(src, "trtllm", tmp_path / "out")
    assert len(seen) >= 3 * spec.experts * spec.layers
    assert max(len(experts) for experts in seen) == 1, (
        "canonical weights of two experts were alive at once")


def _sparse_moe(root, experts: int, hidden: int, inter: int):
    """A one-layer Qwen3-MoE-style SGLang MXFP8 checkpoint whose bytes are all holes: e4m3 +0
    weights and UE8M0 code-0 scales (both valid), so it costs no disk whatever its size."""
    tensors = []
    for e in range(experts):
        for proj, n, k in (("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                           ("down_proj", hidden, inter)):
            p = f"model.layers.0.mlp.experts.{e}.{proj}"
            tensors += [(f"{p}.weight", "F8_E4M3", [n, k]),
                        (f"{p}.weight_scale_inv", "U8", [n, k // 32])]
    tensors.append(("model.layers.0.mlp.gate.weight", "BF16", [experts, hidden]))
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        size = shape[0] * shape[1] * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    root.mkdir()
    with open(root / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + pos)
    q = {"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32],
         "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}
    (root / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": hidden, "num_hidden_layers": 1, "num_experts": experts,
        "moe_intermediate_size": inter, "quantization_config": q}))
    return root


#: run by a fresh interpreter: the converter's peak RSS from ``os.wait4``. A child's ru_maxrss
#: counts the image it was forked from until exec, so it must not be forked from pytest's.
_MEASURE = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)
"""


def _peak_rss(src, out) -> int:
    """Peak RSS (bytes) of a fresh converter process fusing ``src``'s experts."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "mxfp8_convert", str(src), "--backend", "trtllm", "-o",
           str(out), "--quiet"]
    code, rss = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True,
                               text=True, check=True).stdout.split()
    assert code == "0"
    assert (out / "model.safetensors").stat().st_size > src.joinpath("model.safetensors").stat(
    ).st_size - 2**20  # every expert written (its header differs)
    shutil.rmtree(out)  # up to 1 GB: not left in pytest's kept temporary folders
    return int(rss)


def test_fused_moe_memory_bounded(tmp_path):
    """Fusing the experts of an MXFP8 source holds no fused tensor and no expert per expert
    made: a layer of 24 experts of 42 MiB (DeepSeek-V3's H and I; 1 GiB of weights) peaks
    within 64 MiB of a layer of 2 (the converter's pool, at most four 32 MiB buffers, is in
    both), and no torch is imported (its libraries alone are ~100 MiB). A fused tensor or one
    allocation per expert kept by the allocator would add hundreds of MiB."""
    h, i = 7168, 2048
    expert = 3 * h * i
    small = _peak_rss(_sparse_moe(tmp_path / "e2", 2, h, i), tmp_path / "o2")
    big = _peak_rss(_sparse_moe(tmp_path / "e24", 24, h, i), tmp_path / "o24")
    assert 22 * expert > 900 * 2**20  # the extra experts: far more than the allowance
    assert big - small < 64 * 2**20, (big / 2**20, small / 2**20)
    assert big < 400 * 2**20, big / 2**20  # issue 25's floor for the fused MoE


@pytest.mark.parametrize("name", ["sglang_mxfp8", "e8m0"])
def test_mxfp8_fusion_never_imports_torch(sources, tmp_path, name):
    """Fusing the experts of an MXFP8 source only moves bytes (numpy layouts): torch stays
    unloaded, and the fused tensors are those of the in-process conversion (which the tests
    above check against FlashInfer's helpers)."""
    import subprocess
    import sys

    src, _ = sources[name]
    code = ("import sys; from mxfp8_convert import convert; "
            f"convert({str(src)!r}, 'trtllm', {str(tmp_path / 'sub')!r}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    convert(src, "trtllm", tmp_path / "in")
    got, _ = load_all(tmp_path / "sub")
    want, _ = load_all(tmp_path / "in")
    assert sorted(got) == sorted(want)
    assert {f"{b}.{f}" for b in BLOCKS for f in FUSED} <= set(got)
    for k in want:
        assert torch.equal(u8(got[k]), u8(want[k])), k
