"""The package's import graph, read from the source (ast): no cycle among ``mxfp8_convert``'s
modules, counting imports made inside functions too; ``layouts/`` importing nothing of the
package but the error and lazy-import modules (and other ``layouts`` modules), and no library
(numpy and torch only through the lazy proxies, so that planning imports neither); the
pipeline's layers in order (transform below the orchestration, parts and ``run`` below
``convert``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mxfp8_convert

ROOT = Path(mxfp8_convert.__file__).parent
PKG = "mxfp8_convert"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The package modules ``name`` imports (a package's ``__init__`` counts as the package)."""
    path = MODULES[name]
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # "from pkg import sub" names a submodule where one exists
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycle() -> list[str] | None:
    """One import cycle among the package's modules, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in GRAPH:
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(GRAPH[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(GRAPH[nxt])))
    return None


def test_the_graph_is_read():
    """The reader sees real edges (an empty graph would pass the tests below)."""
    assert "mxfp8_convert.runtime.hopper.jit" in GRAPH["mxfp8_convert.runtime.hopper.wgmma"]
    assert "mxfp8_convert.runtime.hopper.wgmma" in GRAPH["mxfp8_convert.runtime.hopper.probe"]
    assert "mxfp8_convert.errors" in GRAPH["mxfp8_convert.layouts.swizzle"]


def test_no_import_cycle():
    assert _cycle() is None, " -> ".join(_cycle())


def test_cycle_finder_finds_one():
    GRAPH["mxfp8_convert.errors"].add("mxfp8_convert.layouts.swizzle")
    try:
        assert _cycle() == ["mxfp8_convert.errors", "mxfp8_convert.layouts.swizzle",
                            "mxfp8_convert.errors"] or _cycle()[0] == _cycle()[-1]
    finally:
        GRAPH["mxfp8_convert.errors"].discard("mxfp8_convert.layouts.swizzle")


def _layouts() -> list[str]:
    return [n for n in MODULES if n == f"{PKG}.layouts" or n.startswith(f"{PKG}.layouts.")]


def _libraries(name: str) -> set[str]:
    """Top-level names of everything outside the package that module ``name`` imports."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
    return found - {PKG, "__future__"}


def test_layouts_import_only_errors_and_lazy():
    allowed = {f"{PKG}.errors", f"{PKG}._lazy"}
    assert len(_layouts()) >= 5  # the package and its modules are seen
    for name in _layouts():
        bad = {d for d in GRAPH[name] if d not in allowed and not d.startswith(f"{PKG}.layouts")}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_layouts_import_no_library():
    """Layout math is pure: numpy and torch only through ``_lazy`` (moving MXFP8 bytes never
    imports torch; planning, which imports the layouts' shape functions, imports neither)."""
    for name in _layouts():
        assert not _libraries(name), f"{name} imports {sorted(_libraries(name))}"


def test_the_layers_are_connected():
    """The orchestration does reach each layer (else the order test above proves nothing)."""
    for low in ("transform", "run", "parts", "write", "layouts"):
        assert _reaches(f"{PKG}.convert", f"{PKG}.{low}"), low


def test_library_reader_sees_imports():
    assert "numpy" in _libraries(f"{PKG}.quantize")
    assert "xxhash" in _libraries(f"{PKG}.transform")


def _reaches(start: str, target: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n == target:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(GRAPH[n])
    return False


@pytest.mark.parametrize("low, high", [
    ("transform", "write"),  # transform produces bytes from source views; write puts them on disk
    ("transform", "convert"),
    ("transform", "parts"),
    ("transform", "run"),
    ("run", "convert"),  # convert orchestrates; run and parts are what it (and finalize) use
    ("parts", "convert"),
    ("layouts", "transform"),
])
def test_pipeline_layers_in_order(low, high):
    """``low`` never imports ``high``, directly or through another module."""
    assert f"{PKG}.{low}" in MODULES and f"{PKG}.{high}" in MODULES
    assert not _reaches(f"{PKG}.{low}", f"{PKG}.{high}"), f"{low} reaches {high}"


def test_transform_imports_neither_rich_nor_flashinfer():
    assert not _libraries(f"{PKG}.transform") & {"rich", "flashinfer", "typer"}


def test_hopper_rules_import_neither_torch_nor_triton():
    """The rules are testable without a GPU stack: config.py and rules.py import no torch/triton."""
    for mod in ("config", "rules"):
        tree = ast.parse(MODULES[f"{PKG}.runtime.hopper.{mod}"].read_text())
        nodes = list(ast.walk(tree))
        names = {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom)}
        assert not names & {"torch", "triton"}, (mod, names)
