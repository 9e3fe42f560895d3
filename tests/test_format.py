"""``mxfp8_convert/format.py`` against docs/FORMAT.md, written out here by hand.

The expected markers and completion records below are literal JSON copied from FORMAT.md's
sections 1a and 2 (an independent writer): ``format.py`` must produce exactly them, parse them
back to the same dicts, and refuse each broken variant with one line naming the file.
"""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest

from mxfp8_convert.errors import MarkerError, OutputError, VerifyError
from mxfp8_convert.format import (
    Completion,
    Marker,
    MoeMarker,
    canonical_config,
    make_marker,
    read_json,
)

PACKAGE = Path(__file__).resolve().parents[1] / "mxfp8_convert"

#: FORMAT.md section 2, the trtllm example with a fused MoE entry (section 3a)
TRTLLM_MARKER = {
    "quant_method": "mxfp8_convert",
    "format_version": 2,
    "backend": "trtllm",
    "weight_layout": "p32_rows",
    "scale_layout": "pad128_p32_128x4",
    "epilogue_tile_m": 128,
    "block_size": 32,
    "weight_dtype": "float8_e4m3fn",
    "scale_dtype": "uint8",
    "scale_suffix": "weight_scale_swizzled",
    "flashinfer_layout_version": "0.7.2.post1",
    "tool": {"name": "mxfp8-convert", "version": "0.1.0"},
    "source": {"dialect": "sglang_mxfp8", "fingerprint": "sha256:" + "ab" * 32,
               "fingerprint_method": "headers-v1"},
    "ignored_layers": ["lm_head", "model.layers.0.mlp.gate"],
    "moe": {
        "layout": "trtllm_fused_moe",
        "kernel": "trtllm_fp8_block_scale_moe (Fp8QuantizationType.MxFp8, "
                  "use_shuffled_weight=True, weight_layout=MajorK)",
        "fc1": "cat([up, gate]) rows interleaved then P32",
        "fc2": "P32",
        "scales": "same rows, 128x4",
        "tensors": {"moe_fc1_weight": "w13_weight", "moe_fc1_scale": "w13_weight_scale_swizzled",
                    "moe_fc2_weight": "w2_weight", "moe_fc2_scale": "w2_weight_scale_swizzled"},
        "experts_suffixes": {"gate": "w1", "up": "w3", "down": "w2"},
        "layers": ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"],
    },
    "tp_compat": [1, 2, 4, 8],
    "kv_cache_scheme": None,
    "original_quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]},
}
CUTLASS_MARKER = {**copy.deepcopy(TRTLLM_MARKER), "backend": "cutlass", "weight_layout": "identity",
                  "scale_layout": "128x4", "moe": None}
#: FORMAT.md section 1a
COMPLETION = {
    "format_version": 2, "backend": "trtllm", "tool_version": "0.1.0",
    "source_fingerprint": "sha256:" + "cd" * 32,
    "source_format": "sglang_mxfp8", "quantize_towers": False,
    "quantization_errors": {"model.layers.0.mlp.up_proj": {"action": "requantize", "rel_fro": 0.035,
                                                            "sqnr_db": 29.1}},
    "files": {"model-00001-of-00002.safetensors": {"size": 123, "xxh3_128": "0123456789abcdef" * 2},
              "sub/tokenizer.json": {"size": 0, "xxh3_128": "f" * 32}},
}


def test_make_marker_writes_format_md_section_2():
    moe = MoeMarker(experts_suffixes={"gate": "w1", "up": "w3", "down": "w2"},
                    layers=("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"))
    got = make_marker("trtllm", dialect="sglang_mxfp8", fingerprint="sha256:" + "ab" * 32,
                      tool_version="0.1.0", moe=moe, tp_compat=[1, 2, 4, 8],
                      ignored_layers=["model.layers.0.mlp.gate", "lm_head", "lm_head"],
                      original={"quant_method": "mxfp8", "weight_block_size": [1, 32]})
    assert got.to_dict() == TRTLLM_MARKER
    assert list(got.to_dict()) == list(TRTLLM_MARKER)  # the order FORMAT.md shows
    plain = make_marker("cutlass", dialect="sglang_mxfp8", fingerprint="sha256:" + "ab" * 32,
                        tool_version="0.1.0", ignored_layers=["lm_head", "model.layers.0.mlp.gate"],
                        tp_compat=(1, 2, 4, 8),
                        original={"quant_method": "mxfp8", "weight_block_size": [1, 32]})
    assert plain.to_dict() == CUTLASS_MARKER


def test_make_marker_refuses_the_canonical_backend():
    with pytest.raises(MarkerError,
                       match="^backend 'canonical' has no kernel layout, so no marker$"):
        make_marker("canonical", dialect="dense", fingerprint="sha256:0", tool_version="0")


@pytest.mark.parametrize("marker", [TRTLLM_MARKER, CUTLASS_MARKER])
def test_marker_parses_and_writes_back_the_same_dict(marker):
    m = Marker.parse(copy.deepcopy(marker), "out/config.json")
    assert m.to_dict() == marker
    assert json.dumps(m.to_dict(), sort_keys=True) == json.dumps(marker, sort_keys=True)


def test_marker_without_moe_keys_reads_them_as_null():
    """Markers written without ``moe`` / ``original_quantization_config`` (FORMAT.md: both may
    be null) read as null; every other key is required."""
    d = {k: v for k, v in CUTLASS_MARKER.items()
         if k not in ("moe", "original_quantization_config")}
    m = Marker.parse(d, "out/config.json")
    assert m.moe is None and m.original_quantization_config is None


def test_version_1_marker_reads_without_tp_compat():
    """Version 1 (FORMAT.md section 2): the same keys but ``tp_compat``, which reads as null."""
    d = {**_without(CUTLASS_MARKER, "tp_compat"), "format_version": 1}
    m = Marker.parse(d, "out/config.json")
    assert m.format_version == 1 and m.tp_compat is None
    assert Completion.parse({**COMPLETION, "format_version": 1}, "c.json").format_version == 1


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


BAD_MARKERS = [
    (None, "out/config.json: no quantization_config: not an mxfp8-convert output"),
    ({**TRTLLM_MARKER, "quant_method": "mxfp8"},
     "out/config.json: quant_method is 'mxfp8', not 'mxfp8_convert': not an mxfp8-convert output"),
    ({**TRTLLM_MARKER, "format_version": 3},
     "out/config.json: format_version 3 is not supported (this release reads 1, 2)"),
    (_without(TRTLLM_MARKER, "format_version"),
     "out/config.json: format_version None is not supported (this release reads 1, 2)"),
    ({**TRTLLM_MARKER, "tp_compat": [1, "2"]},
     "out/config.json: tp_compat: [1, '2'] is not a list of integers"),
    ({**TRTLLM_MARKER, "backend": "marlin"},
     "out/config.json: unknown backend 'marlin' (known: trtllm, cutlass)"),
    ({**TRTLLM_MARKER, "backend": "canonical"},
     "out/config.json: unknown backend 'canonical' (known: trtllm, cutlass)"),
    ({**TRTLLM_MARKER, "scale_layout": "128x4"},
     "out/config.json: marker scale_layout='128x4' does not match backend trtllm "
     "('pad128_p32_128x4')"),
    ({**CUTLASS_MARKER, "weight_layout": "p32_rows"},
     "out/config.json: marker weight_layout='p32_rows' does not match backend cutlass "
     "('identity')"),
    ({**TRTLLM_MARKER, "scale_suffix": "weight_scale_inv"},
     "out/config.json: marker scale_suffix='weight_scale_inv' does not match backend trtllm "
     "('weight_scale_swizzled')"),
    ({**TRTLLM_MARKER, "block_size": "32"}, "out/config.json: block_size: '32' is not an integer"),
    (_without(TRTLLM_MARKER, "source"), "out/config.json: no 'source'"),
    ({**TRTLLM_MARKER, "tool": {"name": "mxfp8-convert"}}, "out/config.json: tool: no 'version'"),
    ({**TRTLLM_MARKER, "ignored_layers": "lm_head"},
     "out/config.json: ignored_layers: 'lm_head' is not a list of strings"),
    ({**TRTLLM_MARKER, "moe": {**TRTLLM_MARKER["moe"], "layout": "sglang_moe"}},
     "out/config.json: fused MoE layout 'sglang_moe' is not 'trtllm_fused_moe'"),
    ({**TRTLLM_MARKER, "moe": _without(TRTLLM_MARKER["moe"], "layers")},
     "out/config.json: moe: no 'layers'"),
    ({**TRTLLM_MARKER, "moe": [1]}, "out/config.json: moe: [1] is not an object"),
    ({**TRTLLM_MARKER, "original_quantization_config": "fp8"},
     "out/config.json: original_quantization_config: 'fp8' is not an object or null"),
]


@pytest.mark.parametrize(("marker", "message"), BAD_MARKERS)
def test_marker_refusals_are_one_line_naming_the_file(marker, message):
    with pytest.raises(MarkerError) as e:
        Marker.parse(copy.deepcopy(marker), "out/config.json")
    assert str(e.value) == message


def test_marker_refusal_in_the_callers_error_class():
    with pytest.raises(VerifyError, match="^out/config.json: unknown backend 'x'"):
        Marker.parse({**TRTLLM_MARKER, "backend": "x"}, "out/config.json", error=VerifyError)


def test_canonical_config_is_plain_sglang_mxfp8():
    assert canonical_config(None, ["lm_head", "b", "lm_head"]) == {
        "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic", "ignored_layers": ["b", "lm_head"]}
    own = {"quant_method": "mxfp8", "weight_block_size": [1, 32], "x": 1,
           "ignored_layers": ["lm_head"]}
    assert canonical_config(own, ["lm_head"]) is own
    # an SGLang source's config comes back with the exact modules this output leaves unquantized
    assert canonical_config(own, ["lm_head", "model.layers.0.mlp.down_proj"]) == {
        **own, "ignored_layers": ["lm_head", "model.layers.0.mlp.down_proj"]}
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    assert canonical_config(None, [], kv)["kv_cache_scheme"] == kv


def test_completion_parses_and_writes_back_the_same_dict():
    c = Completion.parse(copy.deepcopy(COMPLETION), "out/mxfp8_convert.complete.json")
    assert c.to_dict() == COMPLETION and list(c.to_dict()) == list(COMPLETION)
    assert c.files["sub/tokenizer.json"].size == 0


def _files(files: dict) -> dict:
    return {**COMPLETION, "files": files}


_REC = {"size": 1, "xxh3_128": "0" * 32}
BAD_COMPLETIONS = [
    ([], "[] is not an object"),
    (_without(COMPLETION, "files"), "no 'files'"),
    ({**COMPLETION, "format_version": 3}, "format_version 3 is not one of 1, 2"),
    ({**COMPLETION, "backend": "marlin"}, "unknown backend 'marlin'"),
    (_files([]), "files: [] is not an object"),
    (_files({"/etc/passwd": _REC}), "files: '/etc/passwd' is not a path inside the folder"),
    (_files({"../x.safetensors": _REC}),
     "files: '../x.safetensors' is not a path inside the folder"),
    (_files({"a/../b": _REC}), "files: 'a/../b' is not a path inside the folder"),
    (_files({"./a": _REC}), "files: './a' is not a path inside the folder"),
    (_files({"a": {"size": 1}}), "files: 'a': no 'xxh3_128'"),
    (_files({"a": {"size": "1", "xxh3_128": "0" * 32}}), "files: 'a': size: '1' is not an integer"),
    (_files({"a": {"size": 1, "xxh3_128": "0" * 31}}),
     "files: 'a': file record: size 1 / xxh3_128 '" + "0" * 31
     + "' is not a size and a 32-digit hex digest"),
    (_files({"a": {"size": -1, "xxh3_128": "0" * 32}}),
     "files: 'a': file record: size -1 / xxh3_128 '" + "0" * 32
     + "' is not a size and a 32-digit hex digest"),
]


@pytest.mark.parametrize(("record", "detail"), BAD_COMPLETIONS)
def test_completion_refusals(record, detail):
    with pytest.raises(MarkerError) as e:
        Completion.parse(copy.deepcopy(record), "out/mxfp8_convert.complete.json")
    assert str(e.value) == ("out/mxfp8_convert.complete.json: not a format_version 1/2 completion "
                            f"marker ({detail})")


def test_completion_read_from_a_folder(tmp_path):
    (tmp_path / "mxfp8_convert.complete.json").write_text(json.dumps(COMPLETION))
    assert Completion.read(tmp_path).to_dict() == COMPLETION
    with pytest.raises(OutputError,
                       match=r"^.*/nowhere/mxfp8_convert.complete.json: no completion marker$"):
        Completion.read(tmp_path / "nowhere", error=OutputError)


@pytest.mark.parametrize(("raw", "reason"), [
    (b"{not json", r"\(JSONDecodeError: .*\)"),
    (b"[1, 2]", r"\(not a JSON object\)"),
    (b'{"a": "\xc3\x28"}', r"\(UnicodeDecodeError: .*\)"),
    (b"[" * 100_000 + b"]" * 100_000, r"\(RecursionError: .*\)"),
])
def test_read_json_refuses_what_is_not_a_json_object(tmp_path, raw, reason):
    p = tmp_path / "config.json"
    p.write_bytes(raw)
    with pytest.raises(MarkerError, match=f"^{p}: unreadable config.json {reason}$"):
        read_json(p, "config.json")
    with pytest.raises(MarkerError, match=f"^{tmp_path}/index.json: no index$"):
        read_json(tmp_path / "index.json", "index")


#: names of the contract (FORMAT.md), spelled out here; ``format.py`` is their one home
CONTRACT_NAMES = (
    "mxfp8_convert.complete.json", "mxfp8_convert.partial", "mxfp8_convert.tensors",
    "weight_scale_swizzled", "weight_scale_inv", "model.safetensors.index.json", "trtllm_fused_moe",
    "w13_weight", "w2_weight", "p32_rows", "pad128_p32_128x4", "0.7.2.post1", "headers-v1",
    ".mxfp8-partial",
)
#: ``synth.py`` writes *source* checkpoints of other tools' dialects (SGLang's
#: ``weight_scale_inv``, a Hub index) on its own, as an independent writer for the tests
INDEPENDENT_WRITERS = ("synth.py",)


def _strings(tree: ast.AST):
    """Every string constant of a module except docstrings, with its line."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value


def test_contract_names_are_written_only_in_format_py():
    copies = [f"{p.relative_to(PACKAGE)}:{line}: {name!r}"
              for p in sorted(PACKAGE.rglob("*.py"))
              if p.name != "format.py" and p.name not in INDEPENDENT_WRITERS
              for line, text in _strings(ast.parse(p.read_text()))
              for name in CONTRACT_NAMES if name in text]
    assert copies == []
    text = (PACKAGE / "format.py").read_text()
    assert all(name in text for name in CONTRACT_NAMES)


REPO = PACKAGE.parent


def test_the_product_cites_no_file_outside_the_repository():
    """docs/FORMAT.md stands alone: its links lead to files of the repository; and nothing in
    the package, docs, examples, benchmarks or tests points at a SPEC.md (which is not in it)."""
    import re

    docs = REPO / "docs"
    text = (docs / "FORMAT.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links and all(not link.startswith(("http", "/")) and (docs / link).resolve().is_file()
                         and REPO in (docs / link).resolve().parents for link in links), links
    assert "../" not in text
    folders = ("mxfp8_convert", "docs", "examples", "benchmarks", "tests")
    cited = [f"{p.relative_to(REPO)}" for folder in folders
             for p in sorted((REPO / folder).rglob("*")) if p.suffix in (".py", ".md")
             and "SPEC.md" in p.read_text() and p != Path(__file__)]
    if "SPEC" in (REPO / "README.md").read_text():
        cited.append("README.md")
    assert cited == []
