"""``torch``, imported when first used.

Laying an MXFP8 checkpoint out for a kernel only moves bytes, and importing torch takes
1.5-2.5 s on a small machine (more than half of converting 4 GB; BENCHMARKS.md). The modules on
that path name torch through this proxy, so only the paths that compute on tensors import it.
Code that must not import torch by accident asks ``torch_loaded()`` before ``isinstance`` checks.
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


def torch_loaded() -> bool:
    """Whether torch has been imported (by us or by the caller)."""
    return "torch" in sys.modules
