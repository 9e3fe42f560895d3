"""Run a test file's Triton tests under Triton's CPU interpreter, in a subprocess.

TRITON_INTERPRET must be set before triton is imported, so each file's ``test_interpreter_suite``
re-runs the file with it set; the tests marked ``interp`` run only in that process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[2]
interp = pytest.mark.skipif(
    not INTERPRETING, reason="runs inside test_interpreter_suite's TRITON_INTERPRET=1 process")


def run_interpreter_suite(test_file: str, select: str) -> None:
    """Run ``pytest test_file -k select`` with TRITON_INTERPRET=1; fail unless all of it passed."""
    if INTERPRETING:
        pytest.skip("this is the interpreter run")
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
        # Triton 3.6's interpreter cannot iterate a range bounded by program_id (seen on the H200
        # image); compiled kernels are unaffected. The test setup installs Triton 3.9.
        pytest.skip(f"the interpreter tests need Triton >= 3.9, found {triton.__version__}")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
