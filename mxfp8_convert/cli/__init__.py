"""The ``mxfp8-convert`` command line: thin commands over the library API.

``mxfp8-convert MODEL --backend trtllm`` is the ``convert`` command; ``verify`` and ``inspect``
are subcommands. Exit codes: 0 done, 1 conversion/verification failed, 2 usage error,
130/143 interrupted.

This module is the program: it reads the common convert and inspect command lines itself
(``_fast``) and imports the Typer app (``_app``: options, help, usage errors) only for the
others, since Typer's parsing imports pydantic (BENCHMARKS.md, issue 25). ``app``,
``parse_size`` and the commands are still reached here (``mxfp8_convert.cli.app``).
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import sys

from mxfp8_convert.cli import _run
from mxfp8_convert.cli._errors import Interrupted, Terminated
from mxfp8_convert.cli._fast import convert_args, inspect_args
from mxfp8_convert.cli._output import Output
from mxfp8_convert.cli._run import run_convert, run_inspect

SUBCOMMANDS = ("convert", "verify", "inspect", "finalize")


def _on_signal(signum, frame) -> None:
    raise Terminated() if signum == getattr(signal, "SIGTERM", None) else Interrupted()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point. Without a subcommand, arguments go to ``convert``.

    SIGINT and SIGTERM end the run with 130 / 143 and one ``Error:`` line wherever they land,
    also before or after a command's own error handling (parsing, printing the result).
    """
    from mxfp8_convert.cli._errors import EXIT_SIGINT, EXIT_SIGTERM, HINTS

    args = list(sys.argv[1:] if argv is None else argv)
    sigs = [s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None)) if s is not None]
    previous = {s: signal.signal(s, _on_signal) for s in sigs}
    try:
        if args and args[0] not in SUBCOMMANDS and args[0] not in ("--help", "-h", "--version"):
            args.insert(0, "convert")
        kwargs, run = _fast(args)
        if kwargs is not None:
            return _run_fast(run, kwargs)
        from mxfp8_convert.cli import _app

        _app.app(args=args, prog_name="mxfp8-convert", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except (KeyboardInterrupt, Interrupted) as e:
        code = EXIT_SIGTERM if isinstance(e, Terminated) else EXIT_SIGINT
        what = "terminated" if code == EXIT_SIGTERM else "interrupted"
        Output(as_json="--json" in args).error(what, getattr(e, "hint", None) or HINTS[code])
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def _fast(args: list[str]):
    """A command line ``_fast`` reads (``convert`` and ``inspect``): the body's keyword
    arguments and the body, or None (and None) where Typer reads it."""
    if args and args[0] == "convert":
        return convert_args(args[1:]), run_convert
    if args and args[0] == "inspect":
        return inspect_args(args[1:]), run_inspect
    return None, None


def _run_fast(run, kwargs: dict) -> int:
    """A command's body on a command line read by ``_fast``, ending as Typer ends a command in
    its standalone mode: 130 for a KeyboardInterrupt (Typer's silent exit), 1 for a closed
    stdout (EPIPE: what is left to print goes nowhere); ``handle_errors``' exit codes reach
    ``main`` as they do from Typer (``SystemExit``)."""
    try:
        run(**kwargs)
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError):
                pass
        return 1
    return 0


def script() -> None:
    """The ``mxfp8-convert`` program: ``main()``, then the process ends with its exit code.

    What the command built (a DeepSeek-V3-sized plan is ~10^5 header entries, module plans and
    document nodes) is moved out of the cycle collector's reach first (``gc.freeze``): the
    interpreter's shutdown collections would walk all of it once more only to free it
    (BENCHMARKS.md, issue 25); it is freed by reference counting as before.
    ``main()`` itself leaves the collector as it found it, for callers that go on running.
    """
    _run.PROGRAM = True
    code = main()
    gc.freeze()
    raise SystemExit(code)


#: names of the Typer app module (``_app``) reached from here, imported on first use
_APP_NAMES = frozenset({"app", "parse_size", "convert_cmd", "verify_cmd", "inspect_cmd",
                        "finalize_cmd", "EPILOG", "Backend", "SourceFormat", "OnIneligible",
                        "MoEMode", "JsonErrorCommand", "UsageError"})


def __getattr__(name: str):
    if name in _APP_NAMES:
        from mxfp8_convert.cli import _app

        return getattr(_app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
