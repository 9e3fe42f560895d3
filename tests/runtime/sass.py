"""SASS of kernels compiled on the CPU (Triton's bundled ``cuobjdump``), for the compile tests."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", re.M)


def cuobjdump_sass(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a compiled kernel's cubin (``kernel.asm["cubin"]``)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every SASS instruction, in order."""
    return [(int(a, 16), t) for a, t in _INSTRUCTION.findall(sass)]
