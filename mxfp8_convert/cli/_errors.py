"""Map exceptions to one-line messages and exit codes, most specific first.

Exit codes: 0 success, 1 failed conversion or verification, 2 usage error (Typer's default),
130 interrupted (SIGINT), 143 terminated (SIGTERM). Exceptions not in the table are bugs and
keep their traceback. With ``--json`` every failure, usage errors and bugs included, also prints
one error document on stdout: ``{"ok": false, "error": MESSAGE, "hint": HINT or null}``.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from contextlib import contextmanager

from mxfp8_convert.errors import ConvertError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143


class Exit(SystemExit):
    """The exit code ``handle_errors`` decided on: raised as ``SystemExit``, which Typer lets
    through to ``main`` as it does ``typer.Exit``, so the program needs no Typer to exit."""


class Interrupted(BaseException):
    """Raised by the CLI's SIGINT handler. A BaseException, as KeyboardInterrupt is, so that no
    ``except Exception`` swallows it and every cleanup runs; but not a KeyboardInterrupt, which
    Typer turns into a silent exit 130 wherever it lands outside ``handle_errors``."""


class Terminated(Interrupted):
    """Raised by the SIGTERM handler so cleanup runs as for Ctrl-C."""


def _oserror(e: OSError) -> str:
    where = f"{e.filename}: " if getattr(e, "filename", None) else ""
    return f"{where}{e.strerror or e}"


#: (exception type, exit code, message function), most specific first
ERROR_TABLE: list[tuple[type[BaseException], int, Callable[[BaseException], str]]] = [
    (ConvertError, EXIT_FAILED, lambda e: str(e)),
    (Terminated, EXIT_SIGTERM, lambda e: "terminated"),
    (Interrupted, EXIT_SIGINT, lambda e: "interrupted"),
    (KeyboardInterrupt, EXIT_SIGINT, lambda e: "interrupted"),
    (MemoryError, EXIT_FAILED, lambda e: "out of memory"),
    (OSError, EXIT_FAILED, _oserror),
]


#: hints for errors that carry none of their own
HINTS = {
    EXIT_SIGINT: "rerun the same command to resume from the files already finished",
    EXIT_SIGTERM: "rerun the same command to resume from the files already finished",
}
BUG_HINT = "this is a bug in mxfp8-convert: rerun with --debug and report the traceback"


@contextmanager
def handle_errors(out, *, debug: bool = False):
    """Turn known exceptions into ``Error: ...`` (+ ``Hint: ...``) on stderr and an exit code;
    with ``--json``, also the error document on stdout. Unknown exceptions are re-raised."""
    debug = debug or bool(os.environ.get("MXFP8_CONVERT_DEBUG"))
    try:
        yield
    except Exit:
        raise
    except BaseException as e:  # noqa: BLE001 - the table decides; unknown ones re-raise
        for kind, code, message in ERROR_TABLE:
            if isinstance(e, kind):
                if debug:
                    traceback.print_exc()
                out.fail(message(e), getattr(e, "hint", None) or HINTS.get(code))
                raise Exit(code) from None
        if out.as_json:
            out.error_document(f"internal error: {type(e).__name__}: {e}", BUG_HINT)
        raise
