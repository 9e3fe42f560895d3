"""All terminal output of the CLI goes through here.

stdout carries only the result: a rich table for people, or exactly one JSON document with
``--json``. Progress, warnings, hints and errors go to stderr, so piping stdout always works.
Colour and progress are off when stderr is not a terminal or ``--json`` is set.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table


class Output:
    def __init__(self, *, as_json: bool = False, quiet: bool = False) -> None:
        self.as_json = as_json
        self.quiet = quiet
        self.out = Console(file=sys.stdout, soft_wrap=True, highlight=False)
        self.err = Console(file=sys.stderr, soft_wrap=True, highlight=False)

    @property
    def interactive(self) -> bool:
        return not self.as_json and not self.quiet and sys.stderr.isatty()

    def result(self, doc: dict, render=None) -> None:
        """Print the result: one JSON document with --json, else ``render(console)``."""
        if self.as_json:
            sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
            sys.stdout.flush()
        elif render is not None:
            render(self.out)

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
        """Yield a callback for ``ProgressEvent``s: a byte-counting bar on a terminal, else a no-op."""
        if not self.interactive:
            yield lambda e: None
            return
        bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                       TransferSpeedColumn(), TimeRemainingColumn(), console=self.err, transient=True)
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
    t = Table(title=title, title_justify="left")
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
