"""``read._fast_header`` accepts exactly what the checked parse (``read._parse_entries``)
accepts, with the same tensors, for entries of every rank (the 2-D shapes take an unrolled
check) and dims that are not valid (bools, floats, negative, past 2**48)."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert import read
from mxfp8_convert.dtypes import ST_DTYPES
from mxfp8_convert.errors import SourceError

dims = st.sampled_from([0, 1, 3, 32, 2**48 - 1, 2**48, -1, True, 1.0, "2"])
entries = st.tuples(
    st.sampled_from(["F8_E4M3", "BF16", "U8", "F32", "nope"]),
    st.lists(dims, max_size=3),
    st.sampled_from(["exact", "short", "long"]),
)


def _header(spec: list) -> tuple[dict, int]:
    """A header of the entries, offsets laid end to end (off by one where asked), and its
    data size."""
    header, pos = {}, 0
    for i, (dtype, shape, fit) in enumerate(spec):
        size = ST_DTYPES[dtype][1] if dtype in ST_DTYPES else 1
        ints = all(type(d) is int for d in shape)
        n = min(size * math.prod(shape), 64) if ints else 4  # past 64: the offsets cannot fit
        n = max(0, n + {"exact": 0, "short": -1, "long": 1}[fit])
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    return header, pos


@settings(max_examples=400, deadline=None)
@given(st.lists(entries, min_size=1, max_size=3))
def test_the_fast_parse_accepts_what_the_checked_parse_accepts(spec):
    header, data = _header(spec)
    raw = json.dumps(header).encode()
    start, size = 8 + len(raw), 8 + len(raw) + data
    try:
        want = read._parse_entries("x", json.loads(raw), data_start=start, size=size)
    except SourceError:
        want = None
    fast = read._fast_header("x", raw, data_start=start, size=size)
    if want is None:
        assert fast is None
    else:  # no backslash, no repeated key: nothing sends a valid header to the checked path
        assert fast is not None and fast[1] == want and list(fast[1]) == list(want)


def test_a_valid_header_of_every_rank_is_read_by_the_fast_parse():
    header = {"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
              "v": {"dtype": "U8", "shape": [3], "data_offsets": [4, 7]},
              "m": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [7, 19]},
              "e": {"dtype": "F8_E4M3", "shape": [2, 1, 2], "data_offsets": [19, 23]}}
    raw = json.dumps(header).encode()
    meta, got = read._fast_header("x", raw, data_start=8 + len(raw), size=8 + len(raw) + 23)
    assert meta == {}
    assert {n: (t.dtype, t.shape, t.begin - 8 - len(raw), t.nbytes) for n, t in got.items()} == {
        "s": ("F32", (), 0, 4), "v": ("U8", (3,), 4, 3), "m": ("BF16", (2, 3), 7, 12),
        "e": ("F8_E4M3", (2, 1, 2), 19, 4)}
    assert all(type(t) is read.TensorInfo for t in got.values())
