"""End to end: synthetic sharded checkpoints of each dialect, converted to each backend."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from mxfp8_convert import FLASHINFER_LAYOUT_VERSION, convert
from mxfp8_convert.backends import BACKENDS, KERNEL_BACKENDS
from mxfp8_convert.plan import COMPLETE_MARKER, SWIZZLED_SUFFIX
from mxfp8_convert.synth import (
    MXFP8_DIALECTS,
    SynthSpec,
    linear_names,
    scale_suffix,
    write_checkpoint,
)
from tests.checkpoints import leftovers, load_all, marker, to_canonical, tree_hashes, xxh

SPEC = SynthSpec(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=2)
#: output shards of at most 0.5 MB: 4 of them (1.5 MB in all)
SHARD = 500_000


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    out = {}
    for dialect in MXFP8_DIALECTS:
        for sdt in (torch.uint8, torch.float8_e8m0fnu):
            spec = replace(SPEC, dialect=dialect, scale_dtype=sdt, seed=len(out))
            path = write_checkpoint(root / f"{dialect}-{len(out)}", spec)
            out[(dialect, str(sdt))] = (path, spec)
    return out


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dialect", MXFP8_DIALECTS)
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu], ids=["u8", "e8m0"])
def test_roundtrip_bytes_metadata_and_passthrough(sources, tmp_path, backend, dialect, scale_dtype):
    src, spec = sources[(dialect, str(scale_dtype))]
    before = tree_hashes(src)
    out = tmp_path / "out"
    result = convert(src, backend, out, max_shard_size=SHARD)
    assert tree_hashes(src) == before, "the source must never be modified"
    assert result.plan.format == dialect

    got, meta = load_all(out)
    want, _ = load_all(src)
    suffix = scale_suffix(dialect)
    modules = linear_names(spec)
    for module, n, k in modules:
        w, s = got[f"{module}.weight"], got[f"{module}.{SWIZZLED_SUFFIX}"]
        assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (n, k)
        assert s.dtype == torch.uint8 and tuple(s.shape) == (-(-n // 128), -(-k // 128), 512)
        assert f"{module}.{suffix}" not in got, "exactly one scale copy"
        cw, cs = to_canonical(backend, w, s, n, k)
        assert torch.equal(cw, want[f"{module}.weight"].view(torch.uint8)), module
        assert torch.equal(cs, want[f"{module}.{suffix}"].view(torch.uint8)), module
    linear = {f"{m}.weight" for m, _, _ in modules} | {f"{m}.{suffix}" for m, _, _ in modules}
    for name, t in want.items():
        if name not in linear:  # norms, embeddings, ignored lm_head: byte-identical
            assert got[name].dtype == t.dtype, name
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name

    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "LICENSE"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    card = (out / "README.md").read_text()  # our model card, the source's card kept below it
    assert card.startswith("---\n")
    assert "base_model_relation" not in card  # no Hub repo: no base_model
    assert f"- {backend}" in card
    assert (src / "README.md").read_text().strip().splitlines()[-1] in card
    assert not (out / "hf_quant_config.json").exists()

    m = marker(out)
    assert m["quant_method"] == "mxfp8_convert" and m["backend"] == backend
    assert m["weight_layout"] == BACKENDS[backend].weight_layout
    assert m["scale_layout"] == BACKENDS[backend].scale_layout
    assert m["flashinfer_layout_version"] == FLASHINFER_LAYOUT_VERSION
    assert m["source"]["dialect"] == dialect and m["source"]["fingerprint"].startswith("sha256:")
    assert "lm_head" in m["ignored_layers"]
    original = json.loads((src / "config.json").read_text())["quantization_config"]
    assert m["original_quantization_config"] == original
    for shard_meta in meta.values():
        assert json.loads(shard_meta["mxfp8_convert"]) == m
        records = json.loads(shard_meta["mxfp8_convert.tensors"])
        for name, rec in records.items():
            if rec["role"] == "weight_scale":
                n, c = rec["logical_shape"]
                assert rec["layout"] == BACKENDS[backend].scale_layout
                assert rec["tile_shape"] == list(got[name].shape)
                assert rec["padded_shape"] == [-(-n // 128) * 128, -(-c // 4) * 4]

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    assert sorted(set(index["weight_map"].values())) == [
        f"model-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    total = sum(t.numel() * t.element_size() for t in got.values())
    assert index["metadata"]["total_size"] == total
    for name, shard in index["weight_map"].items():
        assert name in load_all_shard(out / shard)

    done = json.loads((out / COMPLETE_MARKER).read_text())
    files = {p.name for p in out.iterdir()} - {COMPLETE_MARKER}
    assert set(done["files"]) == files
    for f, rec in done["files"].items():
        assert rec["xxh3_128"] == xxh(out / f) and rec["size"] == (out / f).stat().st_size
    assert leftovers(tmp_path) == []


def load_all_shard(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def test_weight_and_scale_in_different_shards_end_up_together(sources, tmp_path):
    src, _ = sources[("sglang_mxfp8", str(torch.uint8))]
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    mod = "model.layers.0.self_attn.o_proj"
    assert idx[f"{mod}.weight"] != idx[f"{mod}.weight_scale_inv"], "fixture must split the pair"
    convert(src, "trtllm", tmp_path / "out", max_shard_size=SHARD)
    out_idx = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    out_idx = out_idx["weight_map"]
    assert len(set(out_idx.values())) > 1
    assert out_idx[f"{mod}.weight"] == out_idx[f"{mod}.{SWIZZLED_SUFFIX}"]


def test_single_file_checkpoint(tmp_path):
    src = write_checkpoint(tmp_path / "one", SynthSpec(layers=1, shards=1))
    convert(src, "cutlass", tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_dry_run_writes_nothing(sources, tmp_path):
    src, _ = sources[("sglang_mxfp8", str(torch.uint8))]
    r = convert(src, "trtllm", tmp_path / "out", dry_run=True)
    assert r.dry_run and not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    assert r.plan.to_dict()["modules_by_action"] == {"relayout": len(linear_names(SPEC))}


def test_overwrite_replaces_a_complete_output(sources, tmp_path):
    src, _ = sources[("sglang_mxfp8", str(torch.uint8))]
    out = tmp_path / "out"
    convert(src, "trtllm", out)
    convert(src, "cutlass", out, overwrite=True)
    assert marker(out)["backend"] == "cutlass"
    assert leftovers(tmp_path) == []


def test_default_output_is_beside_the_model(sources):
    from mxfp8_convert import default_output

    src, _ = sources[("sglang_mxfp8", str(torch.uint8))]
    assert default_output(str(src), "trtllm") == src.resolve().parent / f"{src.name}-trtllm"


class _ShortWrites:
    """A raw output file whose write() takes at most 100,000 bytes at a time (POSIX allows a
    short write; the writer must write the rest)."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data) -> int:
        return self._f.write(memoryview(data).cast("B")[:100_000])

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.mark.parametrize("short", [False, True], ids=["whole-writes", "short-writes"])
@pytest.mark.parametrize("n, k", [(160, 8192), (128, 32768), (8192, 256), (160, 256)],
                         ids=["8KiB-rows", "32KiB-rows", "narrow-rows", "small-tensor"])
def test_rows_are_shuffled_in_the_writers_one_pass(tmp_path, monkeypatch, short, n, k):
    """P32 rows of any width are shuffled block by block in the writer's pass straight from the
    source mapping (large tensors on the writer thread, small ones gathered): the bytes are
    torch's p32_shuffle_rows of the source and the marker's hash that of the file, also when
    every write() is short."""
    import mxfp8_convert.write as write_mod
    from mxfp8_convert.layouts import p32_shuffle_rows

    if short:
        real_open = open

        def short_open(file, mode="r", buffering=-1, *args, **kwargs):  # the shards' raw files
            f = real_open(file, mode, buffering, *args, **kwargs)
            return _ShortWrites(f) if buffering == 0 else f

        monkeypatch.setattr(write_mod, "open", short_open, raising=False)
    module = "model.layers.0.mlp.wide_proj"
    spec = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                     extra_modules=((module, n, k),))
    src = write_checkpoint(tmp_path / "src", spec)
    convert(src, "trtllm", tmp_path / "out")
    got, _ = load_all(tmp_path / "out")
    want, _ = load_all(src)
    for name, t in want.items():
        if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            shuffled = p32_shuffle_rows(t.view(torch.uint8))
            assert torch.equal(got[name].view(torch.uint8), shuffled), name
    done = json.loads((tmp_path / "out" / COMPLETE_MARKER).read_text())
    for f, rec in done["files"].items():
        assert rec["xxh3_128"] == xxh(tmp_path / "out" / f), f


def test_a_nan_is_named_by_its_source_row_and_column(tmp_path):
    """A NaN in a P32-shuffled weight is reported at its [row, col] in the source (the check
    runs on the source bytes, before the shuffle), in any block of the tensor."""
    from safetensors.torch import load_file, save_file

    from mxfp8_convert.errors import LayoutError

    src = _wide_mxfp8(tmp_path / "src", 8192)
    path = src / "model.safetensors"
    tensors = load_file(str(path))
    w = tensors["model.layers.0.mlp.down_proj.weight"].view(torch.uint8).clone()
    w[77, 4321] = 0x7F
    w[100, 5] = 0xFF  # a later one: the first in source order is named
    tensors["model.layers.0.mlp.down_proj.weight"] = w.view(torch.float8_e4m3fn)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(LayoutError, match=r"down_proj.weight' holds NaN .* at \[77, 4321\]"):
        convert(src, "trtllm", tmp_path / "out")
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def _wide_mxfp8(root, k=8192):
    """An SGLang MXFP8 model whose one linear has ``k``-byte rows."""
    from safetensors.torch import save_file

    root.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({
        "model.layers.0.mlp.down_proj.weight":
            torch.randint(0, 126, (128, k), dtype=torch.uint8, generator=g)
            .view(torch.float8_e4m3fn),
        "model.layers.0.mlp.down_proj.weight_scale_inv":
            torch.randint(110, 130, (128, k // 32), dtype=torch.uint8, generator=g),
        "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
    }, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic"}}))
    return root


@pytest.mark.parametrize("k", [8192, 256], ids=["wide-rows", "narrow-rows"])
@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_mxfp8_conversion_never_imports_torch(tmp_path, backend, k):
    """Laying MXFP8 out only moves bytes: torch (seconds to import) stays unloaded for wide and
    narrow trtllm rows alike, and the output equals the torch layouts'."""
    import subprocess
    import sys

    from mxfp8_convert.backends import BACKENDS

    src = _wide_mxfp8(tmp_path / "src", k)
    code = ("import sys; from mxfp8_convert import convert; import mxfp8_convert.cli; "
            f"convert({str(src)!r}, {backend!r}, {str(tmp_path / 'out')!r}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    got, _ = load_all(tmp_path / "out")
    want, _ = load_all(src)
    spec = BACKENDS[backend]
    w, s = "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"
    assert torch.equal(got[w].view(torch.uint8), spec.weight_forward(want[w].view(torch.uint8)))
    laid = got["model.layers.0.mlp.down_proj.weight_scale_swizzled"].view(torch.uint8)
    assert torch.equal(laid.flatten(), spec.scale_forward(want[s].view(torch.uint8)).flatten())


@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_unchanged_bytes_are_written_from_the_source_mapping(tmp_path, monkeypatch, backend):
    """Unchanged tensor bytes (cutlass weights, passthrough tensors) are written from the source
    mapping, not copied in the kernel (copy_file_range ran slower beside the early writeback):
    no copy_file_range call, and the bytes and hashes are the source's."""
    import os

    src = _wide_mxfp8(tmp_path / "src")
    calls = []
    monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a) or 0)
    convert(src, backend, tmp_path / "out")
    assert calls == []
    got, _ = load_all(tmp_path / "out")
    want, _ = load_all(src)
    assert torch.equal(got["model.norm.weight"], want["model.norm.weight"])
    if backend == "cutlass":
        w = "model.layers.0.mlp.down_proj.weight"
        assert torch.equal(got[w].view(torch.uint8), want[w].view(torch.uint8))
    files = json.loads((tmp_path / "out" / COMPLETE_MARKER).read_text())["files"]
    assert files["model.safetensors"]["xxh3_128"] == xxh(tmp_path / "out" / "model.safetensors")


@pytest.mark.parametrize("backend", ["trtllm", "cutlass"])
def test_written_pages_are_handed_to_writeback_while_a_shard_is_written(tmp_path, monkeypatch,
                                                                       backend, mount_fs):
    """Where the file system refuses O_DIRECT (a ramfs), every WRITEBACK_BYTES written, the
    shard's pages are handed to writeback and the clean ones dropped (POSIX_FADV_DONTNEED)
    before the shard is closed: each advice covers the bytes written since the one before it
    and, again, those of the one before that (written back by then, so now dropped), never the
    whole file again; the bytes and hashes are those of a run without it, and the fd is still
    open when advised."""
    import os

    import mxfp8_convert.write as write

    src = _wide_mxfp8(tmp_path / "src")
    convert(src, backend, tmp_path / "plain")
    fs = mount_fs("ramfs")
    real, calls = os.posix_fadvise, []

    def spy(fd, offset, length, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice,
                      os.fstat(fd).st_size))
        return real(fd, offset, length, advice)

    # the advice thread's jobs run as they are queued: when they run does not race the writes
    class Inline:
        def submit(self, fn, *args):
            fn(*args)

        def shutdown(self, wait=True):
            pass

    pool = write.ThreadPoolExecutor
    monkeypatch.setattr(write, "ThreadPoolExecutor",
                        lambda **kw: Inline() if kw.get("thread_name_prefix") == "mxfp8-flush"
                        else pool(**kw))
    monkeypatch.setattr(os, "posix_fadvise", spy)
    monkeypatch.setattr(write, "WRITEBACK_BYTES", 1)  # after every write
    convert(src, backend, fs / "advised")
    shard = "model.safetensors"
    size = json.loads((tmp_path / "plain" / COMPLETE_MARKER).read_text())["files"][shard]["size"]
    mine = [c for c in calls if c[0].endswith(shard)]
    assert len(mine) >= 3 and all(c[3] == os.POSIX_FADV_DONTNEED for c in mine)
    assert mine[0][1] == mine[1][1] == 0
    assert all(c[1] + c[2] == c[4] for c in mine)  # up to all the file holds when advised
    # two windows each
    assert all(c[1] == before[1] + before[2] for before, c in zip(mine, mine[2:], strict=False))
    assert min(c[4] for c in mine) < size  # while the shard was still being written
    a = json.loads((tmp_path / "plain" / COMPLETE_MARKER).read_text())["files"]
    b = json.loads((fs / "advised" / COMPLETE_MARKER).read_text())["files"]
    assert a == b and b[shard]["xxh3_128"] == xxh(fs / "advised" / shard)


@pytest.mark.parametrize("backend", ["trtllm", "cutlass", "canonical"])
def test_a_nan_scale_is_named_by_its_position(tmp_path, backend):
    """UE8M0 byte 255 in an MXFP8 source scale (checked with memchr on the mapped bytes) is
    refused, naming the scale and its first [row, col]."""
    from safetensors.torch import load_file, save_file

    from mxfp8_convert.errors import LayoutError

    src = _wide_mxfp8(tmp_path / "src", 8192)
    path = src / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    s = tensors[name].clone()
    s[90, 200] = 255
    s[91, 3] = 255
    tensors[name] = s
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(LayoutError, match=r"weight_scale_inv' holds NaN \(UE8M0 byte 255\) "
                                          r"at \[90, 200\]"):
        convert(src, backend, tmp_path / "out")
