"""Hostile checkpoints (issue 5): each ends in one ``Error:`` line (+ optional ``Hint:``) naming
the file or tensor, exit 1, no traceback, nothing at the destination, no temporary folder, the
source and everything beside it untouched, nothing read outside the model folder, no pickle
loaded. tests/test_cli.py already covers: index not JSON, index naming a missing shard, a shard
cut inside its data, a length prefix past the end, a scale of the wrong shape, K % 32 != 0 and
a folder of (harmless) pickles only; they are not repeated here.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mxfp8_convert.write as write_mod
from mxfp8_convert import convert
from mxfp8_convert.errors import SourceError
from mxfp8_convert.read import open_checkpoint, read_header
from tests.hostile import (
    INDEX,
    SHARD1,
    SHARD2,
    assert_clean_failure,
    audit,
    edit_header,
    evil_pickle,
    folder_files,
    hf_cache_repo,
    leftovers,
    rewrite_tensors,
    run_cli,
    small_model,
    split_st,
    st_bytes,
    tree_state,
    writes_outside,
)

EMBED = "model.embed_tokens.weight"  # SHARD1, offset 0
NORM_A = "model.layers.0.input_layernorm.weight"  # SHARD1, BF16 [128], right after EMBED
NORM_B = "model.layers.0.post_attention_layernorm.weight"  # SHARD1, BF16 [128], after NORM_A
UP = "model.layers.0.mlp.up_proj"
LAST_IN_SHARD1 = "model.layers.0.self_attn.v_proj.weight_scale_inv"
SECRET = b"outside the model folder: must never be read or copied\n"


# --- ways to break a checkpoint: f(src, outside) -------------------------------------------


def _raw_header(shard: str, raw: bytes):
    """Replace the header of ``shard`` by ``raw`` bytes (its tensor bytes stay)."""
    def mutate(src: Path, outside: Path) -> None:
        _, data = split_st((src / shard).read_bytes())
        (src / shard).write_bytes(st_bytes(raw, data))
    return mutate


def _header(shard: str, edit):
    def mutate(src: Path, outside: Path) -> None:
        edit_header(src / shard, edit)
    return mutate


def _entry(name: str, **fields):
    """Set fields of tensor ``name``'s header entry in SHARD1."""
    return _header(SHARD1, lambda h: h[name].update(fields))


def _bytes(rel: str, data: bytes):
    def mutate(src: Path, outside: Path) -> None:
        (src / rel).write_bytes(data)
    return mutate


def _cut(shard: str, keep):
    def mutate(src: Path, outside: Path) -> None:
        data = (src / shard).read_bytes()
        (src / shard).write_bytes(data[: keep(data)])
    return mutate


def _prefix(shard: str, n: int):
    def mutate(src: Path, outside: Path) -> None:
        data = bytearray((src / shard).read_bytes())
        data[:8] = struct.pack("<Q", n)
        (src / shard).write_bytes(bytes(data))
    return mutate


def _json(rel: str, edit):
    def mutate(src: Path, outside: Path) -> None:
        obj = json.loads((src / rel).read_text())
        edit(obj)  # in place
        (src / rel).write_text(json.dumps(obj))
    return mutate


def _weight_map(edit):
    return _json(INDEX, lambda idx: edit(idx["weight_map"]))


def _replace(rel: str, make):
    """Replace ``rel`` by ``make(path, outside)`` (a link, a folder, a pipe...)."""
    def mutate(src: Path, outside: Path) -> None:
        p = src / rel
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif os.path.lexists(p):
            p.unlink()
        make(p, outside)
    return mutate


def _sparse(rel: str, size: int):
    def mutate(src: Path, outside: Path) -> None:
        with open(src / rel, "r+b") as f:
            f.truncate(size)
    return mutate


def _tensors(edit):
    def mutate(src: Path, outside: Path) -> None:
        rewrite_tensors(src, edit)
    return mutate


def _dup_key_header(src: Path, outside: Path) -> None:
    raw, data = split_st((src / SHARD1).read_bytes())
    text = json.dumps(raw)
    (src / SHARD1).write_bytes(st_bytes(text[:-1].encode() + b", " + json.dumps(EMBED).encode()
                                        + b": " + json.dumps(raw[EMBED]).encode() + b"}", data))


def _dup_key_index(src: Path, outside: Path) -> None:
    text = (src / INDEX).read_text()
    twice = f'"weight_map": {{"{EMBED}": "{SHARD1}", '
    (src / INDEX).write_text(text.replace('"weight_map": {', twice, 1))


def _same_tensor_in_two_shards(src: Path, outside: Path) -> None:
    """SHARD2 gets its own NORM_A; the index still says SHARD1."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src / SHARD2), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[NORM_A] = torch.ones(128, dtype=torch.bfloat16)
    save_file(tensors, str(src / SHARD2), metadata={"format": "pt"})


def _shard_link_outside(src: Path, outside: Path) -> None:
    """SHARD1 becomes a link to an identical, valid copy outside the folder."""
    shutil.move(src / SHARD1, outside / SHARD1)
    os.symlink(outside / SHARD1, src / SHARD1)


def _shard_via(rel: str):
    """Move SHARD1 outside and point the index at it with path ``rel`` (may use {outside})."""
    def mutate(src: Path, outside: Path) -> None:
        shutil.move(src / SHARD1, outside / SHARD1)
        target = rel.format(outside=outside)
        def repoint(wm: dict) -> None:
            wm.update({k: target for k, v in wm.items() if v == SHARD1})

        _weight_map(repoint)(src, outside)
    return mutate


def _put(name: str, tensor: torch.Tensor):
    """Store ``tensor`` as ``name`` in SHARD1 (replacing the one there, if any)."""
    return _tensors(lambda t: t.update({name: (SHARD1, tensor)}))


def _shift_offsets(h: dict, by: int) -> None:
    """Move the last tensor of SHARD1's header ``by`` bytes further into the file."""
    h[LAST_IN_SHARD1].update(data_offsets=[o + by for o in h[LAST_IN_SHARD1]["data_offsets"]])


def _mkfifo(p: Path, outside: Path) -> None:
    os.mkfifo(p)


def _link_to(target: str):
    def make(p: Path, outside: Path) -> None:
        os.symlink(target.format(outside=outside, name=p.name), p)
    return make


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


_BIG_INT = b"1" * 5000  # Python refuses to parse > 4300 digits (ValueError, not JSONDecodeError)

# (id, mutate, texts the Error line must hold)
HOSTILE = [
    # --- truncated shards and broken length prefixes
    ("empty-shard", _bytes(SHARD2, b""),
     [f"{SHARD2}: file is 0 bytes, too short to be safetensors"]),
    ("7-byte-shard", _cut(SHARD2, lambda d: 7), [f"{SHARD2}: file is 7 bytes, too short"]),
    ("cut-inside-header", _cut(SHARD2, lambda d: 8 + struct.unpack("<Q", d[:8])[0] // 2),
     [f"{SHARD2}: header length", "points past the end of the"]),
    ("cut-after-header", _cut(SHARD2, lambda d: 8 + struct.unpack("<Q", d[:8])[0]),
     [f"{SHARD2}: tensor", "past the end of the", "(truncated?)"]),
    ("length-2**64-1", _prefix(SHARD2, 2**64 - 1),
     [f"{SHARD2}: header length 18446744073709551615 points past the end"]),
    ("length-zero", _prefix(SHARD2, 0), [f"{SHARD2}: header is not valid JSON"]),
    ("length-short", _prefix(SHARD2, 5), [f"{SHARD2}: header is not valid JSON"]),
    # --- headers that are not (usable) JSON
    ("header-garbage", _raw_header(SHARD2, b"\xff\xfe" * 64),
     [f"{SHARD2}: header is not valid JSON"]),
    ("header-array", _raw_header(SHARD2, b"[1, 2]"), [f"{SHARD2}: header is not a JSON object"]),
    ("header-string", _raw_header(SHARD2, b'"x"'), [f"{SHARD2}: header is not a JSON object"]),
    ("header-5000-digit-int",
     _raw_header(SHARD2, b'{"a": {"dtype": "U8", "shape": [' + _BIG_INT + b"]}}"),
     [f"{SHARD2}: header is not valid JSON"]),
    ("header-nested-100k", _raw_header(SHARD2, b'{"a": ' + _deep(100_000) + b"}"),
     [f"{SHARD2}: header is not valid JSON"]),
    ("header-tensor-twice", _dup_key_header,
     [f"{SHARD1}: tensor '{EMBED}' is declared twice in the header"]),
    ("header-metadata-not-strings", _header(SHARD2, lambda h: h.update({"__metadata__": {"a": 1}})),
     [f"{SHARD2}: __metadata__ must map strings to strings"]),
    # --- entries
    ("entry-not-object", _header(SHARD1, lambda h: h.update({EMBED: 5})),
     [f"{SHARD1}: tensor '{EMBED}': header entry is not an object"]),
    ("entry-key-twice",
     _raw_header(SHARD2, b'{"x": {"dtype": "U8", "dtype": "U8", "shape": [0], '
                         b'"data_offsets": [0, 0]}}'),
     [f"{SHARD2}: tensor 'x': key 'dtype' appears twice"]),
    ("dtype-unknown", _entry(EMBED, dtype="F4"), [f"tensor '{EMBED}': unknown dtype 'F4'"]),
    ("dtype-list", _entry(EMBED, dtype=["BF16"]), [f"tensor '{EMBED}': unknown dtype ['BF16']"]),
    ("dtype-object", _entry(EMBED, dtype={"a": 1}), [f"tensor '{EMBED}': unknown dtype"]),
    ("dtype-missing", _header(SHARD1, lambda h: h[EMBED].pop("dtype")),
     [f"tensor '{EMBED}': unknown dtype None"]),
    ("name-with-newline", _header(SHARD1, lambda h: h.update({"a\nb": {"dtype": "??"}})),
     [f"{SHARD1}: tensor 'a\\nb': unknown dtype '??'"]),
    ("shape-negative", _entry(EMBED, shape=[-128, -128]),
     [f"tensor '{EMBED}': invalid shape [-128, -128]"]),
    ("shape-float", _entry(EMBED, shape=[128.0, 128]), [f"tensor '{EMBED}': invalid shape"]),
    ("shape-bool", _entry(EMBED, shape=[True, 128]), [f"tensor '{EMBED}': invalid shape"]),
    ("shape-string", _entry(EMBED, shape="128x128"), [f"tensor '{EMBED}': invalid shape"]),
    ("shape-2**60", _entry(EMBED, shape=[2**60]),
     [f"tensor '{EMBED}': invalid shape [1152921504606846976]"]),
    # declared enormous: rejected from the header, before any allocation (2**80 bytes)
    ("shape-2**40x2**40", _entry(EMBED, shape=[2**40, 2**40]),
     [f"tensor '{EMBED}': data_offsets span 32768 bytes but BF16 [1099511627776, 1099511627776] "
      "needs 2417851639229258349412352"]),
    ("shape-2**40x2**40-offsets-agree",
     _entry(EMBED, dtype="U8", shape=[2**40, 2**40], data_offsets=[0, 2**80]),
     [f"tensor '{EMBED}': data ends at byte", "past the end of the"]),
    ("offsets-reversed", _entry(EMBED, data_offsets=[32768, 0]),
     [f"tensor '{EMBED}': invalid data_offsets [32768, 0]"]),
    ("offsets-three", _entry(EMBED, data_offsets=[0, 1, 2]),
     [f"tensor '{EMBED}': invalid data_offsets"]),
    ("offsets-negative", _entry(EMBED, data_offsets=[-1, 32767]),
     [f"tensor '{EMBED}': invalid data_offsets"]),
    ("offsets-float", _entry(EMBED, data_offsets=[0.0, 32768.0]),
     [f"tensor '{EMBED}': invalid data_offsets"]),
    ("offsets-not-dtype-x-shape", _entry(EMBED, dtype="F32"),
     [f"tensor '{EMBED}': data_offsets span 32768 bytes but F32 [128, 128] needs 65536"]),
    ("offsets-overlap",
     _header(SHARD1, lambda h: h[NORM_B].update(data_offsets=h[NORM_A]["data_offsets"])),
     [f"{SHARD1}: tensor '{NORM_B}': data_offsets overlaps the previous tensor"]),
    ("offsets-hole", _header(SHARD1, lambda h: h.pop(EMBED)),
     [f"{SHARD1}: tensor '{NORM_A}': data_offsets leaves a hole before it"]),
    ("offsets-out-of-bounds",
     _header(SHARD1, lambda h: _shift_offsets(h, 512)),
     [f"tensor '{LAST_IN_SHARD1}': data ends at byte", "past the end of the", "(truncated?)"]),
    ("offsets-2**100", _entry(EMBED, data_offsets=[2**100, 2**100 + 32768]),
     [f"tensor '{EMBED}': data ends at byte"]),
    # --- shards that are not files, or lie elsewhere
    ("shard-is-folder", _replace(SHARD2, lambda p, o: p.mkdir()),
     [f"{SHARD2}: is a directory, not a safetensors file"]),
    ("shard-is-fifo", _replace(SHARD2, _mkfifo), [f"{SHARD2}: is not a regular file"]),
    ("shard-link-loop", _replace(SHARD2, _link_to("{name}")),
     [f"shard '{SHARD2}' cannot be resolved"]),
    ("shard-link-outside", _shard_link_outside,
     [f"shard '{SHARD1}' is a link that leads outside the model folder"]),
    ("shard-link-dev-zero", _replace(SHARD2, _link_to("/dev/zero")),
     [f"shard '{SHARD2}' is a link that leads outside"]),
    # --- the index
    ("index-array", _bytes(INDEX, b"[]"),
     [f"{INDEX}: 'weight_map' must be a non-empty object of name -> file"]),
    ("index-weight-map-empty", _json(INDEX, lambda i: i.update(weight_map={})),
     [f"{INDEX}: 'weight_map' must be"]),
    ("index-weight-map-list", _json(INDEX, lambda i: i.update(weight_map=[SHARD1])),
     [f"{INDEX}: 'weight_map' must be"]),
    ("index-file-not-string", _weight_map(lambda wm: wm.update({EMBED: 1})),
     [f"{INDEX}: 'weight_map' must be"]),
    ("index-tensor-twice", _dup_key_index,
     [f"{INDEX}: tensor '{EMBED}' is listed twice in weight_map"]),
    ("index-wrong-shard", _weight_map(lambda wm: wm.update({EMBED: SHARD2})),
     [f"{INDEX}: tensor '{EMBED}' is listed in {SHARD2} but stored in {SHARD1}"]),
    ("index-forgets-a-tensor", _weight_map(lambda wm: wm.pop(EMBED)),
     [f"{INDEX}: tensor '{EMBED}' of {SHARD1} is not in weight_map"]),
    ("index-ghost-tensor", _weight_map(lambda wm: wm.update({"ghost": SHARD1})),
     [f"{INDEX}: tensor 'ghost' is not in {SHARD1}"]),
    ("same-tensor-in-two-shards", _same_tensor_in_two_shards,
     [f"tensor '{NORM_A}' is stored twice: in {SHARD1} and {SHARD2}"]),
    ("index-dotdot", _shard_via(f"../outside/{SHARD1}"),
     [f"{INDEX}: shard '../outside/{SHARD1}' is not a path inside the model folder"]),
    ("index-absolute", _shard_via("{outside}/" + SHARD1),
     [f"{INDEX}: shard '/", "is not a path inside the model folder"]),
    ("index-dot-slash", _weight_map(lambda wm: wm.update({EMBED: "./" + SHARD1})),
     [f"{INDEX}: shard './{SHARD1}' is not a path inside the model folder"]),
    ("index-nul", _weight_map(lambda wm: wm.update({EMBED: "a\0.safetensors"})),
     [f"{INDEX}: shard 'a\\x00.safetensors' is not a path inside"]),
    ("index-names-config", _weight_map(lambda wm: wm.update({EMBED: "config.json"})),
     [f"{INDEX}: weight_map names 'config.json', which is not a .safetensors file"]),
    ("index-5000-digit-int",
     _bytes(INDEX, b'{"weight_map": {}, "metadata": {"total_size": ' + _BIG_INT + b"}}"),
     [f"{INDEX}: not valid JSON"]),
    ("index-not-utf8", _bytes(INDEX, b'{"weight_map": "\xff"}'), [f"{INDEX}: not valid JSON"]),
    ("index-nested-40", _json(INDEX, lambda i: i.update(metadata=json.loads(_deep(40)))),
     [f"{INDEX}: nested more than 32 levels deep"]),
    ("index-is-folder", _replace(INDEX, lambda p, o: p.mkdir()), [f"{INDEX}: is a directory"]),
    ("index-too-large", _sparse(INDEX, 100 * 2**20 + 1),
     [f"{INDEX}: 104857601 bytes is too large"]),
    ("index-link-outside", _replace(INDEX, _link_to("{outside}/secret.txt")),
     [f"file '{INDEX}' is a link that leads outside the model folder"]),
    # --- config.json / hf_quant_config.json
    ("config-not-json", _bytes("config.json", b"{'quant_method': 'mxfp8'}"),
     ["config.json: not valid JSON"]),
    ("config-array", _bytes("config.json", b"[]"), ["config.json: not a JSON object"]),
    ("config-5000-digit-int", _bytes("config.json", b'{"vocab_size": ' + _BIG_INT + b"}"),
     ["config.json: not valid JSON"]),
    ("config-not-utf8", _bytes("config.json", b'{"a": "\xc3\x28"}'),
     ["config.json: not valid JSON"]),
    ("config-nested-40", _json("config.json", lambda c: c.update(x=json.loads(_deep(40)))),
     ["config.json: nested more than 32 levels deep"]),
    ("config-nested-100k", _bytes("config.json", _deep(100_000)), ["config.json: not valid JSON"]),
    ("config-too-large", _sparse("config.json", 16 * 2**20 + 1),
     ["config.json: 16777217 bytes is too large"]),
    ("config-is-fifo", _replace("config.json", _mkfifo), ["config.json: is not a regular file"]),
    ("config-link-outside", _replace("config.json", _link_to("{outside}/secret.txt")),
     ["file 'config.json' is a link that leads outside the model folder"]),
    ("config-dangling-link", _replace("config.json", _link_to("missing.json")),
     ["config.json: file not found"]),
    ("config-dtype-list", _json("config.json", lambda c: c.update(torch_dtype=[])),
     ["config.json: torch_dtype is [], not a dtype name such as 'bfloat16'"]),
    ("config-text-dtype-object",
     _json("config.json", lambda c: (c.pop("torch_dtype", None),
                                     c.update(text_config={"dtype": {"a": 1}}))),
     ['config.json: text_config.dtype is {"a": 1}, not a dtype name']),
    ("hf-quant-config-not-json", _bytes("hf_quant_config.json", b"\x00\x01"),
     ["hf_quant_config.json: not valid JSON"]),
    # --- other files (copied byte for byte): links out, pipes
    ("tokenizer-link-outside", _replace("tokenizer.json", _link_to("{outside}/secret.txt")),
     ["file 'tokenizer.json' is a link that leads outside the model folder"]),
    ("tokenizer-link-outside-relative",
     _replace("tokenizer.json", _link_to("../outside/secret.txt")),
     ["file 'tokenizer.json' is a link that leads outside"]),
    ("folder-link-outside", _replace("extra", _link_to("{outside}")),
     ["folder 'extra' is a link that leads outside"]),
    ("readme-is-fifo", _replace("README.md", _mkfifo), ["README.md: is not a regular file"]),
    ("license-dangling-link", _replace("LICENSE", _link_to("NOPE")), ["LICENSE: cannot be read"]),
    # --- scales and weights that do not fit (plan.py checks them from the headers)
    ("scale-dtype-f32", _put(f"{UP}.weight_scale_inv", torch.zeros(256, 4)),
     [f"{SHARD1}: scale '{UP}.weight_scale_inv' has dtype F32; MXFP8 scales are U8 or F8_E8M0"]),
    ("scale-dtype-bf16", _put(f"{UP}.weight_scale_inv", torch.zeros(256, 4, dtype=torch.bfloat16)),
     [f"scale '{UP}.weight_scale_inv' has dtype BF16"]),
    ("scale-1d", _put(f"{UP}.weight_scale_inv", torch.zeros(1024, dtype=torch.uint8)),
     [f"scale '{UP}.weight_scale_inv' has shape [1024]; "
      f"weight '{UP}.weight' [256, 128] needs [256, 4]"]),
    ("weight-3d",
     _put(f"{UP}.weight", torch.zeros(2, 128, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)),
     [f"weight '{UP}.weight' has shape [2, 128, 128]; only 2-D linear weights are supported"]),
    ("scale-without-weight", _tensors(lambda t: t.pop(f"{UP}.weight")),
     [f"scale '{UP}.weight_scale_inv' has no weight"]),
    ("weight-without-scale", _tensors(lambda t: t.pop(f"{UP}.weight_scale_inv")),
     [f"weight '{UP}.weight' is float8_e4m3fn but has no scale"]),
]


@pytest.fixture()
def model(tmp_path):
    """(source model, a folder beside it holding a secret and what we move out)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    return small_model(tmp_path / "model"), outside


@pytest.mark.parametrize("mutate, expected", [pytest.param(m, e, id=i) for i, m, e in HOSTILE])
def test_hostile_input_fails_cleanly(capsys, tmp_path, model, mutate, expected):
    src, outside = model
    mutate(src, outside)
    before = tree_state(tmp_path)
    dest = tmp_path / "out"
    t0 = time.perf_counter()
    with audit() as events:
        result = run_cli(capsys, src, "-b", "cutlass", "-o", dest)
    assert time.perf_counter() - t0 < 10
    assert_clean_failure(result, dest, *expected)
    assert tree_state(tmp_path) == before  # the source and everything beside it untouched
    assert writes_outside(events, dest) == []
    read_outside = [p for kind, p in events
                    if kind == "read" and Path(os.path.realpath(p)).is_relative_to(outside)]
    assert read_outside == []
    assert not [e for e in events if e[0] == "unpickle"]


def test_every_hostile_input_is_rejected_by_open_checkpoint_or_the_plan(tmp_path):
    """The same inputs through the library: a ConvertError with a one-line message, no other
    type."""
    from mxfp8_convert.convert import plan_conversion
    from mxfp8_convert.errors import ConvertError

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    for i, (name, mutate, expected) in enumerate(HOSTILE):
        src = small_model(tmp_path / f"m{i}")
        mutate(src, outside)
        with pytest.raises(ConvertError) as exc:
            plan_conversion(src, "cutlass")
        assert "\n" not in str(exc.value) and expected[0] in str(exc.value), name
        if (outside / SHARD1).exists():
            (outside / SHARD1).unlink()


def test_source_tensor_named_like_an_output_tensor_is_refused(capsys, tmp_path):
    """A hostile extra tensor 'up_proj.weight_scale_swizzled' (7s) in SHARD2 must not end up as
    the scale a loader reads for up_proj."""
    src = small_model(tmp_path / "model")
    rewrite_tensors(src, lambda t: t.update(
        {f"{UP}.weight_scale_swizzled": (SHARD2, torch.full((2, 1, 512), 7, dtype=torch.uint8))}))
    dest = tmp_path / "out"
    assert_clean_failure(run_cli(capsys, src, "-b", "cutlass", "-o", dest), dest,
                         f"'{UP}.weight_scale_swizzled'")


# --- declared enormous, and actually enormous (sparse) ------------------------------------


def test_enormous_shape_is_rejected_from_the_header_without_reading_data(tmp_path):
    """[2**40, 2**40] U8 whose offsets agree: refused from the 100-byte header alone."""
    (tmp_path / "model.safetensors").write_bytes(st_bytes(
        {"w": {"dtype": "U8", "shape": [2**40, 2**40], "data_offsets": [0, 2**80]}}, b"\0" * 64))
    t0 = time.perf_counter()
    with pytest.raises(SourceError,
                       match=r"model.safetensors: tensor 'w': data ends at byte 12089258196146291"):
        read_header(tmp_path, "model.safetensors")
    assert time.perf_counter() - t0 < 1


def test_a_sparse_8_tib_shard_is_planned_from_headers_and_refused_for_space(capsys, tmp_path):
    """A real 8 TiB tensor (sparse file): the plan reads headers only, the space check refuses
    before anything is written; neither step touches the data."""
    m = small_model(tmp_path / "model")
    cfg_tensors = {"model.big.weight": {"dtype": "BF16", "shape": [2**21, 2**21],
                                        "data_offsets": [0, 2**43]}}
    raw = json.dumps(cfg_tensors).encode()
    shard = m / "model-00003-of-00003.safetensors"
    shard.write_bytes(st_bytes(raw))
    try:
        with open(shard, "r+b") as f:
            f.truncate(8 + len(raw) + 2**43)
    except OSError as e:
        pytest.skip(f"this filesystem cannot hold an 8 TiB sparse file ({e.strerror})")
    idx = json.loads((m / INDEX).read_text())
    idx["weight_map"]["model.big.weight"] = shard.name
    (m / INDEX).write_text(json.dumps(idx))
    dest = tmp_path / "out"
    t0 = time.perf_counter()
    code, out, err = run_cli(capsys, m, "-b", "cutlass", "-o", dest, "--dry-run", "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["total_bytes"] > 2**43
    result = run_cli(capsys, m, "-b", "cutlass", "-o", dest)
    assert time.perf_counter() - t0 < 10
    if shutil.disk_usage(tmp_path).free > 2**44:
        pytest.skip("more than 16 TiB free: the space check would let this through")
    assert_clean_failure(result, dest, f"{tmp_path}: ", "bytes free, the output needs")


# --- pickles -------------------------------------------------------------------------------


def test_pickles_only_are_never_unpickled_and_safetensors_is_required(capsys, tmp_path):
    m = tmp_path / "model"
    m.mkdir()
    canary = tmp_path / "UNPICKLED"
    evil_pickle(m / "pytorch_model-00001-of-00002.bin", canary)
    evil_pickle(m / "pytorch_model-00002-of-00002.bin", canary)
    evil_pickle(m / "consolidated.pt", canary)
    (m / "config.json").write_text('{"model_type": "llama"}')
    dest = tmp_path / "out"
    with audit() as events:
        result = run_cli(capsys, m, "-b", "trtllm", "-o", dest)
    assert_clean_failure(result, dest,
                         "only pickle weights (consolidated.pt, ...); safetensors is required")
    assert "pickles are never opened" in result[2]
    assert not canary.exists()
    opened = [p for kind, p in events if kind in ("read", "write") and p.endswith((".bin", ".pt"))]
    assert opened == [] and not [e for e in events if e[0] == "unpickle"]


def test_pickles_beside_safetensors_are_ignored_never_opened_and_not_copied(capsys, tmp_path):
    m = small_model(tmp_path / "model")
    canary = tmp_path / "UNPICKLED"
    pickles = ("pytorch_model.bin", "training_args.bin", "optimizer.pt",
               "original/consolidated.00.pth")
    for name in pickles:
        (m / name).parent.mkdir(exist_ok=True)
        evil_pickle(m / name, canary)
    dest = tmp_path / "out"
    with audit() as events:
        code, out, err = run_cli(capsys, m, "-b", "cutlass", "-o", dest, "--json")
    assert code == 0, err
    assert not canary.exists()
    touched = [p for kind, p in events if kind in ("read", "write")]
    assert [p for p in touched if p.endswith((".bin", ".pt", ".pth"))] == []
    assert not [e for e in events if e[0] == "unpickle"]
    copied = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
    assert not [c for c in copied if c.endswith((".bin", ".pt", ".pth"))]
    assert "tokenizer.json" in copied and json.loads(out)["plan"]["copied_files"] == sorted(
        ["LICENSE", "README.md", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json"])


def test_the_evil_pickle_is_really_evil(tmp_path):
    """The proof above means something only if unpickling would have created the canary."""
    import pickle

    canary = tmp_path / "UNPICKLED"
    pickle.loads(evil_pickle(tmp_path / "p.bin", canary).read_bytes())
    assert canary.exists()


# --- Hugging Face cache --------------------------------------------------------------------

REPO = "org/tiny-mxfp8"


@pytest.fixture()
def hf_cache(tmp_path):
    """A Hub cache holding REPO (every file a link into blobs/), laid out by huggingface_hub's
    rules."""
    files = folder_files(small_model(tmp_path / "plain"))
    files["sub/extra.txt"] = b"nested file: its link climbs three levels\n"
    cache = tmp_path / "hub"
    snapshot = hf_cache_repo(cache, REPO, files)
    return cache, snapshot, files


def test_hf_cache_snapshot_links_into_its_blobs_work(capsys, tmp_path, hf_cache):
    from huggingface_hub import scan_cache_dir

    cache, snapshot, files = hf_cache
    info = scan_cache_dir(cache)  # huggingface_hub itself accepts the layout
    (repo,) = info.repos
    names = {f.file_name for r in repo.revisions for f in r.files}
    assert repo.repo_id == REPO and names >= {"config.json", SHARD1}
    assert all((snapshot / rel).is_symlink() for rel in files)
    assert os.readlink(snapshot / SHARD1).startswith("../../blobs/")
    before = tree_state(cache)
    dest = tmp_path / "out"
    with audit() as events:
        code, out, err = run_cli(capsys, snapshot, "-b", "cutlass", "-o", dest, "--json")
    assert code == 0, err
    assert writes_outside(events, dest) == []
    assert tree_state(cache) == before
    assert (dest / "sub" / "extra.txt").read_bytes() == files["sub/extra.txt"]
    assert not any(p.is_symlink() for p in dest.rglob("*"))  # bytes copied, not links


def test_hf_cache_model_in_a_subfolder_of_a_snapshot(capsys, tmp_path):
    """Repos that keep a model under a subfolder: its links climb one level more, into the same
    blobs."""
    plain = folder_files(small_model(tmp_path / "plain"))
    files = {f"tiny/{rel}": data for rel, data in plain.items()}
    snapshot = hf_cache_repo(tmp_path / "hub", "org/multi", files)
    assert os.readlink(snapshot / "tiny" / SHARD1).startswith("../../../blobs/")
    dest = tmp_path / "out"
    code, out, err = run_cli(capsys, snapshot / "tiny", "-b", "cutlass", "-o", dest)
    assert code == 0, err


@pytest.mark.parametrize("target, why", [
    ("../../../../outside/secret.txt", "leaves the cache"),
    ("../../blobs/../../../outside/secret.txt", "climbs out through blobs/"),
    ("../../../models--org--other/blobs/{blob}", "another repo's blobs"),
    ("../../refs/main", "the repo folder, not its blobs"),
])
def test_hf_cache_links_elsewhere_are_refused(capsys, tmp_path, hf_cache, target, why):
    cache, snapshot, files = hf_cache
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_bytes(SECRET)
    other = hf_cache_repo(cache, "org/other", {"tokenizer.json": SECRET})
    blob = os.path.basename(os.readlink(other / "tokenizer.json"))
    (snapshot / "tokenizer.json").unlink()
    os.symlink(target.format(blob=blob), snapshot / "tokenizer.json")
    dest = tmp_path / "out"
    with audit() as events:
        result = run_cli(capsys, snapshot, "-b", "cutlass", "-o", dest)
    assert_clean_failure(result, dest,
                         "file 'tokenizer.json' is a link that leads outside the model folder")
    assert not [p for kind, p in events if kind == "read" and "tokenizer.json" in p]


def test_hf_cache_exemption_needs_a_snapshots_folder(tmp_path):
    """Only ``<repo>/snapshots/<rev>`` may link into ``<repo>/blobs``; a plain folder may not."""
    m = small_model(tmp_path / "repo" / "model")
    (tmp_path / "repo" / "blobs").mkdir()
    (tmp_path / "repo" / "blobs" / "x").write_bytes(SECRET)
    (m / "tokenizer.json").unlink()
    os.symlink("../blobs/x", m / "tokenizer.json")
    with pytest.raises(SourceError, match="'tokenizer.json' is a link that leads outside"):
        open_checkpoint(m)


def test_links_inside_the_folder_are_fine(capsys, tmp_path):
    m = small_model(tmp_path / "model")
    os.rename(m / "tokenizer.json", m / "real-tokenizer.json")
    os.symlink("real-tokenizer.json", m / "tokenizer.json")
    dest = tmp_path / "out"
    code, out, err = run_cli(capsys, m, "-b", "cutlass", "-o", dest)
    assert code == 0, err
    assert (dest / "tokenizer.json").read_bytes() == (m / "real-tokenizer.json").read_bytes()


# --- out of disk space -----------------------------------------------------------------------


@pytest.fixture()
def tiny_tmpfs(tmp_path):
    """``mount(size)`` -> a fresh tmpfs of ``size`` bytes (root only; skipped where refused)."""
    mounted = []

    def mount(size: int) -> Path:
        if not sys.platform.startswith("linux") or shutil.which("mount") is None:
            pytest.skip("tmpfs test needs Linux and mount(8); ENOSPC is injected by the next test")
        mnt = tmp_path / "tmpfs"
        mnt.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)]
        r = subprocess.run(mount, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); "
                        "ENOSPC is still exercised by test_enospc_injected_*")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=False)


def _fill(fs: Path, name: str) -> None:
    """Another process takes every free byte of ``fs`` (writes until the kernel says ENOSPC)."""
    fd = os.open(fs / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        chunk = b"\x5a" * 65536
        while True:
            try:
                if os.write(fd, chunk) == 0:
                    break
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


def test_enospc_on_a_real_full_filesystem(capsys, tmp_path, tiny_tmpfs):
    """A real tmpfs that fills up (another process takes the rest) just as the first shard
    starts: the kernel's ENOSPC ends in one line, exit 1, nothing of ours left, the other
    files on that disk untouched. convert()'s own space check passes: there was room at start."""
    src = small_model(tmp_path / "model")
    fs = tiny_tmpfs(8 << 20)
    (fs / "precious.bin").write_bytes(b"\xa5" * 4096)  # someone else's file on the same disk
    dest = fs / "out"
    filled = []

    def other_process(path: str) -> None:
        if not filled and path.endswith(".safetensors") and f"/.{dest.name}.mxfp8-" in path:
            _fill(fs, "ballast.bin")
            filled.append(path)

    with audit(on_write=other_process) as events:
        result = run_cli(capsys, src, "-b", "cutlass", "-o", dest)
    assert filled, "the first shard was never opened for writing"
    line = assert_clean_failure(result, dest, "no space left on device", f"{fs}/.out.mxfp8-")
    assert "free disk space or choose another -o" in result[2]
    assert sorted(os.listdir(fs)) == ["ballast.bin", "precious.bin"], line
    assert (fs / "precious.bin").read_bytes() == b"\xa5" * 4096
    assert set((fs / "ballast.bin").read_bytes()) == {0x5A}
    assert writes_outside(events, dest) == []
    (fs / "ballast.bin").unlink()
    assert shutil.disk_usage(fs).free >= (8 << 20) - 2 * 4096  # the half-written output is gone


class _Disk:
    """A pretend disk with ``left`` bytes free (None: unlimited, just count): writes beyond it
    fail with ENOSPC as a full disk does (a short write first, then the error)."""

    def __init__(self, left: int | None) -> None:
        self.left, self.used, self.hit = left, 0, 0

    def take(self, n: int) -> int:
        if self.left is None:
            self.used += n
            return n
        if self.left <= 0:
            self.hit += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        k = min(n, self.left)
        self.left -= k
        self.used += k
        return k


class _FullFile:
    def __init__(self, f, disk: _Disk, raw: bool) -> None:
        self._f, self._disk, self._raw = f, disk, raw

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        k = self._disk.take(mv.nbytes)
        written = self._f.write(mv[:k])
        if k < mv.nbytes and not self._raw:  # a buffered file writes all or raises
            self._disk.take(1)
        return written

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def _inject_full_disk(monkeypatch, disk: _Disk) -> None:
    real_open, real_copy = open, os.copy_file_range

    def full_open(file, mode="r", buffering=-1, *args, **kwargs):
        f = real_open(file, mode, buffering, *args, **kwargs)
        return _FullFile(f, disk, raw=buffering == 0) if any(c in mode for c in "wax+") else f

    def full_copy(src_fd, dst_fd, count, offset_src=None, *args):
        return real_copy(src_fd, dst_fd, disk.take(count), offset_src, *args)

    monkeypatch.setattr(write_mod, "open", full_open, raising=False)
    monkeypatch.setattr(os, "copy_file_range", full_copy)


@pytest.fixture(scope="module")
def output_size(tmp_path_factory):
    """Bytes a successful conversion of the small model writes, counted by the injection."""
    tmp = tmp_path_factory.mktemp("size")
    src = small_model(tmp / "model")
    disk = _Disk(None)
    with pytest.MonkeyPatch.context() as mp:
        _inject_full_disk(mp, disk)
        convert(src, "cutlass", tmp / "out")
    assert disk.used > 0
    return disk.used


@pytest.mark.parametrize("fraction", [0.0, 0.001,
                                      0.3, 0.7, 0.95, 0.9999, "last-byte"])
def test_enospc_injected_anywhere_in_the_output(
    capsys, tmp_path, output_size, monkeypatch, fraction
):
    """ENOSPC from write() or copy_file_range() at any point (header, tensor bytes, copied
    files, JSON, completion marker): one line, exit 1, no destination, the source untouched,
    no half-written file; what was finished stays in the work folder (each file as its manifest
    records it, nothing else) and the same command, with room again, resumes and keeps it."""
    from mxfp8_convert.write import file_digest

    src = small_model(tmp_path / "model")
    before = tree_state(src)
    disk = _Disk(output_size - 1 if fraction == "last-byte" else int(fraction * output_size))
    _inject_full_disk(monkeypatch, disk)
    dest = tmp_path / "out"
    with audit() as events:
        code, out, err = run_cli(capsys, src, "-b", "cutlass", "-o", dest)
    assert disk.hit >= 1
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and "Traceback" not in err and len(lines) == 2, err
    assert lines[0].startswith("Error: ") and "no space left on device" in lines[0], err
    assert f"{tmp_path}/.out.mxfp8-" in lines[0] and not dest.exists()
    assert tree_state(src) == before
    assert writes_outside(events, dest) == []
    work = tmp_path / ".out.mxfp8-partial"
    if leftovers(tmp_path) == []:
        assert lines[1] == "Hint: free disk space or choose another -o"
        return
    assert leftovers(tmp_path) == [work.name]
    assert lines[1].startswith("Hint: free disk space and rerun the same command: it resumes"), err
    files = json.loads((work / "mxfp8_convert.partial.json").read_text())["files"]
    assert files and sorted(os.listdir(work)) == sorted([*files, "mxfp8_convert.partial.json"])
    for rel, rec in files.items():
        assert (work / rel).stat().st_size == rec["size"]
        assert file_digest(work / rel) == rec["xxh3_128"]
    kept = {rel: (work / rel).stat().st_ino for rel in files}
    monkeypatch.undo()
    code, out, err = run_cli(capsys, src, "-b", "cutlass", "-o", dest)
    assert code == 0, err
    assert {rel: (dest / rel).stat().st_ino for rel in kept} == kept, "finished files were redone"
    assert leftovers(tmp_path) == []


def test_enospc_injection_lets_a_roomy_disk_succeed(capsys, tmp_path, output_size, monkeypatch):
    """The injection itself is sound: with room to spare the conversion completes, every byte
    having gone through it (paths in the manifests differ in length from run to run, hence
    the margin)."""
    src = small_model(tmp_path / "model")
    disk = _Disk(output_size + 65536)
    _inject_full_disk(monkeypatch, disk)
    code, out, err = run_cli(capsys, src, "-b", "cutlass", "-o", tmp_path / "out")
    assert code == 0, err
    assert disk.hit == 0 and abs(disk.used - output_size) < 65536
    assert leftovers(tmp_path) == []
