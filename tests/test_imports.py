"""The package's import graph, read from the source (ast): no cycle among ``mxfp8_convert``'s
modules, counting imports made inside functions too, and ``layouts/`` importing nothing of the
package but the error and lazy-import modules (and other ``layouts`` modules)."""

from __future__ import annotations

import ast
from pathlib import Path

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


def test_layouts_import_only_errors_and_lazy():
    allowed = {f"{PKG}.errors", f"{PKG}._lazy", f"{PKG}"}
    for name, deps in GRAPH.items():
        if name == f"{PKG}.layouts" or name.startswith(f"{PKG}.layouts."):
            bad = {d for d in deps if d not in allowed and not d.startswith(f"{PKG}.layouts")}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_hopper_rules_import_neither_torch_nor_triton():
    """The rules are testable without a GPU stack: config.py and rules.py import no torch/triton."""
    for mod in ("config", "rules"):
        tree = ast.parse(MODULES[f"{PKG}.runtime.hopper.{mod}"].read_text())
        nodes = list(ast.walk(tree))
        names = {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom)}
        assert not names & {"torch", "triton"}, (mod, names)
