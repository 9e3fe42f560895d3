"""All terminal output of the CLI goes through here.

stdout carries only the result: a rich table for people, or exactly one JSON document with
``--json`` (RFC 8259: no NaN or Infinity; a failure prints the error document
``{"ok": false, "error": ..., "hint": ...}`` instead). Progress, warnings, hints and errors go
to stderr, so piping stdout always works. Colour and progress are off when stderr is not a
terminal or ``--json`` is set.
"""

from __future__ import annotations

import json
import math
import re
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


class Output:
    """The CLI's stdout and stderr. rich is imported the first time something is printed
    through it: a ``--json`` run that succeeds never needs it."""

    def __init__(self, *, as_json: bool = False, quiet: bool = False) -> None:
        self.as_json = as_json
        self.quiet = quiet
        self._files = (sys.stdout, sys.stderr)  # the streams of when the command started
        self._consoles: dict[int, Console] = {}

    def _console(self, i: int) -> Console:
        if i not in self._consoles:
            from rich.console import Console

            self._consoles[i] = Console(file=self._files[i], soft_wrap=True, highlight=False)
        return self._consoles[i]

    @property
    def out(self) -> Console:
        return self._console(0)

    @property
    def err(self) -> Console:
        return self._console(1)

    @property
    def interactive(self) -> bool:
        return not self.as_json and not self.quiet and sys.stderr.isatty()

    def result(self, doc: dict, render=None) -> None:
        """Print the result: one JSON document with --json, else ``render(console)``.

        Raises:
            ValueError: ``doc`` holds a NaN or an infinity (a bug: the error document is
                printed instead, so stdout still holds valid JSON).
        """
        if not self.as_json:
            if render is not None:
                render(self.out)
            return
        try:
            text = dumps(doc)
        except ValueError as e:
            self.error_document(f"internal error: result is not valid JSON ({e})",
                                "this is a bug in mxfp8-convert: please report it")
            raise
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def error_document(self, msg: str, hint: str | None = None) -> None:
        """The ``--json`` document of a failure, on stdout."""
        doc = {"ok": False, "error": msg, "hint": hint}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        sys.stdout.flush()

    def fail(self, msg: str, hint: str | None = None) -> None:
        """A failure: ``Error:`` / ``Hint:`` on stderr and, with --json, the error document."""
        self.error(msg, hint)
        if self.as_json:
            self.error_document(msg, hint)

    def info(self, msg: str) -> None:
        if not self.quiet and not self.as_json:
            self.err.print(msg, markup=False)

    def warn(self, msg: str) -> None:
        self.err.print(f"Warning: {msg}", markup=False)

    def error(self, msg: str, hint: str | None = None) -> None:
        self.err.print(f"Error: {msg}", markup=False)
        if hint:
            self.err.print(f"Hint: {hint}", markup=False)

    @contextmanager
    def progress(self):
        """Yield a callback for ``ProgressEvent``s: a byte-counting bar on a terminal, else a
        no-op."""
        if not self.interactive:
            yield lambda e: None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                       TransferSpeedColumn(), TimeRemainingColumn(), console=self.err,
                       transient=True)
        task = None

        def on_event(e) -> None:
            nonlocal task
            if task is None and e.bytes_total:
                task = bar.add_task(e.stage, total=e.bytes_total)
            if task is not None:
                desc = f"{e.stage} {e.shard}" if e.shard else e.stage
                bar.update(task, completed=e.bytes_done, description=desc)

        with bar:
            yield on_event


def table(title: str, columns: list[str], rows: list[list]) -> Table:
    """A rich table; without a header row when every column name is empty (key-value tables)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_header=any(columns))
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units, as pydantic's ``ByteSize.human_readable()`` writes them and
    ``size_bytes`` reads them back (``1.5KiB``, ``953.7MiB``). Written out here: importing
    pydantic took longer than a conversion's result table (BENCHMARKS.md, issue 25)."""
    num = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(num) < 1024:
            return f"{num:0.0f}{unit}" if unit == "B" else f"{num:0.1f}{unit}"
        num /= 1024
    return f"{num:0.1f}EiB"


#: bytes per unit, case-insensitive, as pydantic's ``ByteSize``: KB/MB/GB... (and K/M/G...)
#: powers of 1000, KiB/MiB/GiB... powers of 1024, ``bit`` units an eighth of their byte unit
_UNITS: dict[str, float] = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15, "eb": 10**18,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60,
}
_UNITS.update({k[:-1] + "bit": v / 8 for k, v in list(_UNITS.items()) if k != "b"})
_UNITS["bit"] = 1 / 8
_UNITS.update({k[0]: v for k, v in list(_UNITS.items()) if "i" not in k})
#: ``ByteSize``'s string pattern: a number, then an optional unit (matched at the start only)
_SIZE = re.compile(r"^\s*(\d*\.?\d+)\s*(\w+)?", re.IGNORECASE)
#: what pydantic's lax integer parsing takes from a string that is not of that pattern
_LAX_INT = re.compile(r"([+-]?)([0-9]+(?:_[0-9]+)*)(?:\.0+)?")


def size_bytes(text: str) -> int | None:
    """``text`` (surrounding blanks ignored) as a number of bytes, or None where it is not a
    size: what ``TypeAdapter(ByteSize).validate_python(text.strip())`` returns or refuses,
    without importing pydantic (tests/test_cli_sizes.py compares the two)."""
    s = text.strip()
    m = _SIZE.match(s)
    if m is None:  # pydantic's other branch: a non-negative integer, e.g. "+5" or "-0"
        lax = _LAX_INT.fullmatch(s)
        if lax is None:
            return None
        n = int(lax.group(2).replace("_", ""))
        return None if lax.group(1) == "-" and n else n
    try:
        return int(s)  # ByteSize tries int() first ("1_000" too)
    except ValueError:
        pass
    scalar, unit = m.groups()
    mult = _UNITS.get((unit or "b").lower())
    if mult is None:
        return None
    try:
        return int(float(scalar) * mult)
    except OverflowError:
        return None


def _float(o: float) -> str:
    if o != o or o in (math.inf, -math.inf):
        raise ValueError("Out of range float values are not JSON compliant: " + repr(o))
    return float.__repr__(o)


def _key(k) -> str:
    """A dict key as ``json`` spells it (before quoting)."""
    if isinstance(k, str):
        return k
    if isinstance(k, float):
        return _float(k)
    if k is True or k is False or k is None:
        return {True: "true", False: "false", None: "null"}[k]
    if isinstance(k, int):
        return int.__repr__(k)
    raise TypeError(f"keys must be str, int, float, bool or None, not {k.__class__.__name__}")


def dumps(doc) -> str:
    """``json.dumps(doc, indent=2, default=str, allow_nan=False)``: the same text, and the same
    errors (``ValueError`` for NaN, Inf and circular references, ``TypeError`` for a key of
    another type), in a fraction of the time.

    The standard library encodes indented JSON in Python with a generator per object (its C
    encoder does not indent): ~1.3 s for the 16.9 MB ``inspect`` document of a DeepSeek-V3-sized
    checkpoint. Here plain recursion appends to one list, and strings, ints and the other common
    types are told apart by their exact type first; anything else takes the library's order of
    ``isinstance`` tests (subclasses of str, int and float, then ``str()`` of the object).

    A container met a second time at the same depth (one object in many places: ``inspect``'s
    modules of one shape share their ``backends`` document) is encoded once more, keeping its
    text, which every later place then reuses: the 16.9 MB document holds ~10^5 such places.
    """
    out: list[str] = []
    w = out.append
    enc = json.encoder.encode_basestring_ascii
    indents = ["\n" + "  " * i for i in range(40)]
    markers: dict[int, object] = {}
    seen: set[tuple[int, int]] = set()  # (id, depth) of the containers met so far
    texts: dict[tuple[int, int], str] = {}  # (id, depth) -> text, for those met twice

    def container(o, depth: int, encode) -> None:
        key = (id(o), depth)  # every object of ``doc`` lives until the end: ids stay unique
        text = texts.get(key)
        if text is not None:
            w(text)
        elif key not in seen:
            seen.add(key)
            encode(o, depth)
        else:
            start = len(out)
            encode(o, depth)
            text = texts[key] = "".join(out[start:])
            del out[start:]
            w(text)

    def newline(depth: int) -> str:
        while depth >= len(indents):
            indents.append(indents[-1] + "  ")
        return indents[depth]

    def value(o, depth: int) -> None:
        t = type(o)
        if t is str:
            w(enc(o))
        elif t is dict:
            container(o, depth, obj)
        elif t is list or t is tuple:
            container(o, depth, arr)
        elif o is None:
            w("null")
        elif o is True:
            w("true")
        elif o is False:
            w("false")
        elif t is int:
            w(int.__repr__(o))
        elif t is float:
            w(_float(o))
        elif isinstance(o, str):
            w(enc(o))
        elif isinstance(o, int):
            w(int.__repr__(o))
        elif isinstance(o, float):
            w(_float(o))
        elif isinstance(o, (list, tuple)):
            container(o, depth, arr)
        elif isinstance(o, dict):
            container(o, depth, obj)
        else:
            mark(o)
            value(str(o), depth)  # default=str
            del markers[id(o)]

    def mark(o) -> None:
        if id(o) in markers:
            raise ValueError("Circular reference detected")
        markers[id(o)] = o

    def obj(d: dict, depth: int) -> None:
        if not d:
            w("{}")
            return
        mark(d)
        sep = "," + newline(depth + 1)
        w("{" + sep[1:])
        first = True
        for k, v in d.items():
            if type(k) is not str:
                k = _key(k)
            if first:
                w(enc(k) + ": ")
                first = False
            else:
                w(sep + enc(k) + ": ")
            t = type(v)  # ``value``, with the commonest cases inline
            if t is str:
                w(enc(v))
            elif v is True:
                w("true")
            elif v is False:
                w("false")
            elif t is int:
                w(int.__repr__(v))
            elif not v and (t is list or t is dict):
                w("[]" if t is list else "{}")
            else:
                value(v, depth + 1)
        w(indents[depth] + "}")
        del markers[id(d)]

    def arr(a, depth: int) -> None:
        if not a:
            w("[]")
            return
        mark(a)
        sep = "," + newline(depth + 1)
        w("[" + sep[1:])
        first = True
        for v in a:
            if first:
                first = False
            else:
                w(sep)
            t = type(v)
            if t is str:
                w(enc(v))
            elif t is int:
                w(int.__repr__(v))
            else:
                value(v, depth + 1)
        w(indents[depth] + "]")
        del markers[id(a)]

    value(doc, 0)
    return "".join(out)
