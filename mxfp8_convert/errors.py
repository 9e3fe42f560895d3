"""The one exception hierarchy of mxfp8-convert.

Every error a user can cause ends in one of these. Messages are one line, fact first, naming
the file, tensor or value; ``hint`` optionally says what to do next. The CLI maps them to
``Error: ...`` / ``Hint: ...`` on stderr and exit code 1 (see ``cli/_errors.py``). Anything else
that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class ConvertError(Exception):
    """Base class: a conversion, verification or load that cannot go on."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        # One line, always: a multi-line message would break the CLI's contract.
        super().__init__(" ".join(str(message).split()))
        self.hint = hint

    @property
    def message(self) -> str:
        return str(self)


class SourceError(ConvertError):
    """The source checkpoint is missing, unreadable, malformed or unsafe."""


class FormatError(ConvertError):
    """The source's quantization format is unknown, ambiguous or unsupported."""


class LayoutError(ConvertError):
    """A tensor's shape, dtype or bytes do not fit the layout asked for."""


class IneligibleError(LayoutError):
    """One or more tensors fail a backend's constraints (the message lists them)."""

    def __init__(self, message: str, *, offenders: list[str], hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.offenders = offenders


class BackendUnavailableError(ConvertError):
    """The runtime backend asked for cannot run here (missing package or wrong GPU)."""


class OutputError(ConvertError):
    """The destination cannot be written (exists, inside the source, disk full...)."""


class VerifyError(ConvertError):
    """A converted checkpoint does not match its marker or its source."""


class MarkerError(ConvertError):
    """A checkpoint's layout marker is missing or does not match what was asked for."""


class DiskFullError(OutputError):
    """The destination's disk (or quota) is full; finished files are kept for a resume."""
