"""Sizes on the command line and in human output follow one convention (pydantic's ByteSize):
KB/MB/GB are powers of 1000 (SI), KiB/MiB/GiB powers of 1024 (IEC 80000-13)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import pytest
import typer

from mxfp8_convert.cli import parse_size
from mxfp8_convert.cli._output import human_bytes, size_bytes


@pytest.mark.parametrize(("text", "n"), [
    ("123", 123), ("500MB", 500 * 10**6), ("1.5G", 1500 * 10**6), ("1.5 gb", 1500 * 10**6),
    ("8GiB", 8 * 2**30), ("0.5KiB", 512), ("2TiB", 2 * 2**40), (" 10k ", 10_000),
])
def test_parse_size_si_and_iec(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "x", "-1", "8 GiBs", "1e3 MB!"])
def test_parse_size_refuses(text):
    with pytest.raises(typer.BadParameter, match=f"^{text!r} is not a size like 8GiB or 500MB$"):
        parse_size(text)


@pytest.mark.parametrize(("n", "text"), [
    (0, "0B"), (512, "512B"), (1536, "1.5KiB"), (10**9, "953.7MiB"), (2**30, "1.0GiB"),
    (3 * 2**40, "3.0TiB"),
])
def test_human_bytes_says_binary_units_by_their_names(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize("n", [1, 1023, 1024, 3 * 2**20, 7 * 2**30, 5 * 2**40])
def test_what_human_bytes_prints_parse_size_reads_back(n):
    """The old pair printed n/1024**3 as "GB" and read "GB" as 10**9 (a 7 % disagreement)."""
    got = parse_size(human_bytes(n))
    assert abs(got - n) <= 0.05 * n, (n, human_bytes(n), got)


# --- the same as pydantic's ByteSize, without importing it (the oracle here) ----------------

_ODD = ["+5", "-0", "-5", "+5.0", "+5.5", "+ 5", "+5_0", "5_0", "1__0", "_1", "5.", ".5", "+.5",
        "5.0.0", "1.5e3", "0x10", "1.5gbit", "3 kibit", "0.1b", "1 B", "1e999", "9" * 400 + "EiB",
        "\u0663", "+\u0663", "12abc", "-0.0", "+00", "1\t\nGiB", "  ", "1.5 GB ", "2k", "2ki"]


@pytest.mark.parametrize("text", _ODD)
def test_size_bytes_reads_what_pydantic_reads(text):
    _same_as_pydantic(text)


@hypothesis.settings(max_examples=600, deadline=None)
@hypothesis.given(st.text(alphabet="0123456789._+- \tkKmMgGtTpPeEiIbBtx", max_size=10))
def test_size_bytes_reads_what_pydantic_reads_on_any_text(text):
    _same_as_pydantic(text)


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(st.one_of(st.integers(0, 2**70), st.sampled_from(
    [1023, 1024, 1024**2 - 52, 1024**2 - 51, 1024**3 * 1023.96, 2**60, 2**70])))
def test_human_bytes_writes_what_pydantic_writes(n):
    from pydantic import ByteSize

    assert human_bytes(int(n)) == ByteSize(int(n)).human_readable()


def _same_as_pydantic(text: str) -> None:
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        want = int(TypeAdapter(ByteSize).validate_python(text.strip()))
    except ValidationError:
        want = None
    assert size_bytes(text) == want, text
