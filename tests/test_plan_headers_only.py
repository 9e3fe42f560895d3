"""The plan is decided from headers: no module of ``mxfp8_convert/plan/`` imports torch or
anything that computes on tensors, or calls anything that reads tensor data or opens a file
(read from the source with ``ast``, imports inside functions included). The one fact about
data a plan needs comes from the reader (``read.pow2_scales``). And, run for real, planning a
quantized checkpoint (FP8 scales read and refused included) leaves torch unimported, and
planning or inspecting an MXFP8 one leaves numpy unimported too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import mxfp8_convert
from mxfp8_convert.synth import SynthSpec, write_checkpoint

PLAN = Path(mxfp8_convert.__file__).parent / "plan"
#: modules that compute on tensors (torch) or read tensor bytes
FORBIDDEN_MODULES = ("torch", "mxfp8_convert._lazy", "mxfp8_convert.quantize",
                     "mxfp8_convert.transform", "mxfp8_convert.runtime", "mxfp8_convert.write",
                     "safetensors", "mmap", "numpy")
#: what reads tensor data or opens files: the reader's data functions, and the builtins
DATA_CALLS = {"read_tensor", "read_small_tensors", "ShardReader", "open_source_file",
              "find_bytes", "chunk_ranges", "open", "pread", "fromfile", "memmap", "safe_open",
              "load_file", "read_bytes", "read_text"}


def _sources() -> list[Path]:
    files = sorted(PLAN.glob("*.py"))
    assert {p.stem for p in files} >= {"__init__", "model", "classify", "moe", "build", "shards"}
    return files


def _imported(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _called(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.append(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute)
                       else "")
    return out


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_plan_modules_import_no_torch_and_read_no_data(path):
    tree = ast.parse(path.read_text(), str(path))
    bad = [m for m in _imported(tree)
           if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_MODULES)]
    assert not bad, f"{path.name} imports {bad}"
    calls = [c for c in _called(tree) if c in DATA_CALLS]
    assert not calls, f"{path.name} calls {calls}"


def test_the_checks_see_what_they_look_for():
    """The two ast readers find an import of torch and a read_tensor call (so the test above
    cannot pass by finding nothing)."""
    tree = ast.parse("def f(ckpt, i):\n    import torch\n"
                     "    from mxfp8_convert.read import read_tensor\n"
                     "    return read_tensor(ckpt.root, i), open('x')\n")
    assert "torch" in _imported(tree) and "mxfp8_convert.read.read_tensor" in _imported(tree)
    assert {"read_tensor", "open"} <= set(_called(tree))


SCRIPT = """
import json, sys
from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.errors import ConvertError
from mxfp8_convert.formats import detect_source
from mxfp8_convert.plan import build_plan
from mxfp8_convert.read import open_checkpoint
out = {}
for path in sys.argv[1:]:
    ckpt = open_checkpoint(path)
    fmt = detect_source(ckpt.config, ckpt.quant_files, ckpt.tensors, None)
    try:
        plan = build_plan(ckpt, BACKENDS["trtllm"], fmt)
        out[path] = sorted({m.action for m in plan.modules})
    except ConvertError as e:
        out[path] = str(e)
print(json.dumps({"plans": out, "torch": "torch" in sys.modules}))
"""


def test_planning_a_quantized_checkpoint_imports_no_torch(tmp_path):
    spec = SynthSpec(layers=1, hidden=256, intermediate=512, vocab=256, shards=2)
    srcs = {"pow2": write_checkpoint(tmp_path / "pow2", replace(spec, dialect="block_fp8")),
            "requant": write_checkpoint(tmp_path / "requant",
                                        replace(spec, dialect="block_fp8", pow2_scales=False)),
            "mxfp8": write_checkpoint(tmp_path / "mx", replace(spec, dialect="sglang_mxfp8"))}
    bad = write_checkpoint(tmp_path / "bad", replace(spec, dialect="block_fp8"))
    _zero_first_scale(bad)
    r = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, srcs.values()), str(bad)],
                       capture_output=True, text=True, check=True)
    doc = json.loads(r.stdout)
    assert doc["torch"] is False
    plans = doc["plans"]
    assert plans[str(srcs["pow2"])] == ["lossless"]
    assert plans[str(srcs["requant"])] == ["requantize"]
    assert plans[str(srcs["mxfp8"])] == ["relayout"]
    assert "scale 0.0 at index [0, 0] is not a finite positive number" in plans[str(bad)]


def _zero_first_scale(root: Path) -> None:
    """Overwrite the first element of the first float32 block scale with +0.0, in place."""
    for f in sorted(root.glob("*.safetensors")):
        raw = bytearray(f.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, e in sorted(header.items()):
            if name.endswith("weight_scale_inv") and e["dtype"] == "F32":
                at = 8 + n + e["data_offsets"][0]
                raw[at:at + 4] = bytes(4)
                f.write_bytes(bytes(raw))
                return
    raise AssertionError("no float32 scale found")


NO_NUMPY = """
import sys
from mxfp8_convert.cli import main
code = main(sys.argv[1:])
print(code, "numpy" in sys.modules)
"""


@pytest.mark.parametrize("command", ["dry-run", "inspect"])
def test_planning_mxfp8_imports_no_numpy(tmp_path, command):
    """An MXFP8 source's plan and report come from headers alone: numpy (imported lazily by the
    byte paths and the FP8 scale test) stays unloaded, while the FP8 source, whose scales are
    read, does load it (so the check can tell)."""
    spec = SynthSpec(layers=1, hidden=256, intermediate=512, vocab=256, shards=2)
    seen = {}
    for dialect in ("sglang_mxfp8", "block_fp8"):
        src = write_checkpoint(tmp_path / dialect, replace(spec, dialect=dialect))
        args = ([str(src), "-b", "trtllm", "-o", str(tmp_path / "o"), "--dry-run", "--json"]
                if command == "dry-run" else ["inspect", str(src), "--json"])
        r = subprocess.run([sys.executable, "-c", NO_NUMPY, *args], capture_output=True,
                           text=True, check=True)
        seen[dialect] = r.stdout.splitlines()[-1]
    assert seen == {"sglang_mxfp8": "0 False", "block_fp8": "0 True"}
