"""All terminal output of the CLI goes through here.

stdout carries only the result: a rich table for people, or exactly one JSON document with
``--json`` (RFC 8259: no NaN or Infinity; a failure prints the error document
``{"ok": false, "error": ..., "hint": ...}`` instead). Progress, warnings, hints and errors go
to stderr, so piping stdout always works. Colour and progress are off when stderr is not a
terminal or ``--json`` is set.
"""

from __future__ import annotations

import json
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
            text = json.dumps(doc, indent=2, sort_keys=False, default=str, allow_nan=False)
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
    """``n`` bytes in binary units, as pydantic's ``ByteSize`` writes and ``parse_size`` reads
    them (``1.5KiB``, ``953.7MiB``)."""
    from pydantic import ByteSize

    return ByteSize(n).human_readable()
