"""``torch`` and ``numpy``, imported when first used.

Laying an MXFP8 checkpoint out for a kernel only moves bytes, and importing torch costs
seconds on a small machine (BENCHMARKS.md, "Design decisions (conversion)"). The modules on
that path name torch through this proxy, so only the paths that compute on tensors import it.
Code that must not import torch by accident asks ``torch_loaded()`` before ``isinstance`` checks.

numpy likewise (BENCHMARKS.md, issue 25's planning rows): planning an MXFP8 checkpoint
(``--dry-run``, ``inspect``) reads headers only and never needs it; the byte paths and the FP8
scale test do.
"""

from __future__ import annotations

import sys


class _LazyTorch:
    __slots__ = ()

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<torch, imported on first use>"


torch = _LazyTorch()


class _LazyModule:
    """Module ``name``, imported at the first attribute asked of it; each attribute is then
    kept on the proxy, so later uses cost what a module attribute costs (hot loops use them)."""

    def __init__(self, name: str) -> None:
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str):
        import importlib

        value = getattr(importlib.import_module(self._name), attr)
        self.__dict__[attr] = value  # module attributes do not change
        return value

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


numpy = _LazyModule("numpy")


def torch_loaded() -> bool:
    """Whether torch has been imported (by us or by the caller)."""
    return "torch" in sys.modules
