"""The common ``convert`` and ``inspect`` command lines, read without Typer's parser.

Typer (0.29) coerces every option through a pydantic ``TypeAdapter``: importing pydantic and
building one adapter per option cost each run a noticeable share of its start-up, before the
conversion's first write (measured in BENCHMARKS.md, issue 25). ``convert_args`` and
``inspect_args`` read the command lines made only of the options below, each given once in its
plainest spelling (``--opt value``, ``--opt=value``, a flag), with values Typer would take as they
are, and return ``run_convert``'s or ``run_inspect``'s arguments; for anything else (help, another
command or option, a repeated option, a value starting with ``-``, a value Typer would coerce or
refuse) it returns None, and Typer parses the command line as before, with its own messages.
tests/test_cli_fast.py checks every accepted line against Typer's own reading.
"""

from __future__ import annotations

import os
import re

from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.cli._output import size_bytes
from mxfp8_convert.formats import FORMATS
from mxfp8_convert.plan import MOE_MODES, ON_INELIGIBLE

#: ``run_convert``'s arguments as ``convert_cmd`` passes them for options not given
DEFAULTS = {
    "output": None, "overwrite": False, "dry_run": False, "source_format": None,
    "on_ineligible": "error", "ignore": None, "revision": None, "fresh": False,
    "push_to_hub": None, "private": False, "push_branch": None, "part": None, "workers": 1,
    "max_memory": None, "moe": "fuse", "quantize_towers": False, "allow_no_quantized": False,
    "max_shard_size": size_bytes("5GB"), "as_json": False, "quiet": False, "debug": False,
}

#: the flags taken here: spelling -> argument
FLAGS = {
    "--overwrite": "overwrite", "--dry-run": "dry_run", "--fresh": "fresh",
    "--quantize-towers": "quantize_towers", "--allow-no-quantized": "allow_no_quantized",
    "--json": "as_json", "--quiet": "quiet", "-q": "quiet", "--debug": "debug",
}
#: the options with a value taken here: spelling -> argument
VALUES = {
    "--backend": "backend", "-b": "backend", "--output": "output", "-o": "output",
    "--source-format": "source_format", "--on-ineligible": "on_ineligible", "--moe": "moe",
    "--revision": "revision", "--workers": "workers", "--max-shard-size": "max_shard_size",
}
#: values of the choice options, as Typer's enums take them (case-sensitive)
CHOICES = {
    "backend": frozenset(BACKENDS), "source_format": frozenset(f.name for f in FORMATS),
    "on_ineligible": frozenset(ON_INELIGIBLE), "moe": frozenset(MOE_MODES),
}
_WORKERS = re.compile(r"[1-9][0-9]{0,5}")
#: Click's shell completion runs instead of the command when this variable is set
COMPLETE_VAR = "_MXFP8_CONVERT_COMPLETE"


def convert_args(args: list[str]) -> dict | None:
    """``run_convert``'s keyword arguments (MODEL as ``model``) for ``mxfp8-convert convert
    ARGS``, or None where Typer must read ``args``."""
    given = _read(args, FLAGS, VALUES)
    if given is None or "backend" not in given:
        return None
    return {**DEFAULTS, **given}


#: ``inspect``: its flags, options with a value, and ``run_inspect``'s defaults
INSPECT_FLAGS = {"--json": "as_json", "--debug": "debug"}
INSPECT_VALUES = {"--source-format": "source_format", "--revision": "revision"}
INSPECT_DEFAULTS = {"source_format": None, "revision": None, "as_json": False, "debug": False}


def inspect_args(args: list[str]) -> dict | None:
    """``run_inspect``'s keyword arguments (PATH as ``model``) for ``mxfp8-convert inspect
    ARGS``, or None where Typer must read ``args``."""
    given = _read(args, INSPECT_FLAGS, INSPECT_VALUES)
    return None if given is None else {**INSPECT_DEFAULTS, **given}


def _read(args: list[str], flags: dict[str, str], values: dict[str, str]) -> dict | None:
    """The arguments given on a command line of one positional argument (``model``), the
    ``flags`` and the options with a value in ``values``, each once; None where Typer decides."""
    if COMPLETE_VAR in os.environ:
        return None
    given: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg or arg.startswith("-") and arg not in flags and arg.split("=")[0] not in values:
            return None  # "", "-", "--", an option not taken here, a flag given a value
        if arg in flags:
            name, value = flags[arg], True
        elif arg.startswith("-"):
            spelling, eq, value = arg.partition("=")
            if not eq:
                if i == len(args):
                    return None
                value = args[i]
                i += 1
            if not spelling.startswith("--") and eq:  # -o=x: Click reads "=x"
                return None
            name = values[spelling]
            if not value or value.startswith("-"):
                return None
            value = _value(name, value)
            if value is None:
                return None
        elif "model" not in given:
            name, value = "model", arg
        else:
            return None  # a second argument
        if name in given:
            return None
        given[name] = value
    return given if "model" in given else None


def _value(name: str, text: str):
    """An option's value as ``convert_cmd`` passes it on, or None (Typer decides)."""
    if name in CHOICES:
        return text if text in CHOICES[name] else None
    if name == "workers":
        return int(text) if _WORKERS.fullmatch(text) else None
    if name == "max_shard_size":
        n = size_bytes(text)
        return n if n is not None and n > 0 else None
    return text
