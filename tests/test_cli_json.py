"""``cli._output.dumps`` writes exactly what ``json.dumps(doc, indent=2, default=str,
allow_nan=False)`` writes (the ``--json`` contract), and fails as it fails."""

from __future__ import annotations

import enum
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert.cli._output import dumps


class Color(str, enum.Enum):
    red = "red"


class Level(enum.IntEnum):
    high = 3


class Opaque:
    def __str__(self) -> str:
        return "opaque \u00e9\n"


def _reference(doc) -> str:
    return json.dumps(doc, indent=2, sort_keys=False, default=str, allow_nan=False)


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([Color.red, Level.high, Opaque(), 2**80, -0.0, 1e300]),
)
keys = st.one_of(st.text(), st.integers(), st.booleans(), st.none(),
                 st.floats(allow_nan=False, allow_infinity=False))
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.tuples(inner, inner),
                            st.dictionaries(keys, inner, max_size=5)),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(documents)
def test_the_text_is_the_standard_librarys(doc):
    assert dumps(doc) == _reference(doc)


def test_deep_nesting_and_empty_containers():
    doc: object = {"a": [], "b": {}, "c": ()}
    for i in range(60):  # past the indents ``dumps`` keeps ready
        doc = [i, doc] if i % 2 else {"k": doc, "n": None}
    assert dumps(doc) == _reference(doc)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_float_out_of_range_fails_as_it_does_there(bad):
    for doc in ({"x": [1, bad]}, {bad: 1}, bad):
        with pytest.raises(ValueError) as want:
            _reference(doc)
        with pytest.raises(ValueError) as got:
            dumps(doc)
        assert str(got.value) == str(want.value)


def test_circular_references_and_bad_keys_fail_as_they_do_there():
    loop: list = [1]
    loop.append({"again": loop})
    for doc, error in ((loop, ValueError), ({(1, 2): 3}, TypeError)):
        with pytest.raises(error) as want:
            _reference(doc)
        with pytest.raises(error) as got:
            dumps(doc)
        assert str(got.value) == str(want.value)


@st.composite
def shared_documents(draw):
    """Documents that hold a few objects in many places, at one depth and at several."""
    parts = draw(st.lists(documents, min_size=1, max_size=4))
    return draw(st.recursive(
        st.sampled_from(parts),
        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                st.dictionaries(st.text(max_size=3), inner, max_size=4)),
        max_leaves=20,
    ))


@settings(max_examples=300, deadline=None)
@given(shared_documents())
def test_objects_in_many_places_are_written_in_each(doc):
    assert dumps(doc) == _reference(doc)


def test_a_shared_object_at_two_depths_gets_each_depths_indent():
    why = {"ok": False, "why_not": ["N=100 is not a multiple of 128"]}
    shape = [100, 256]
    modules = [{"shape": shape, "backends": {"trtllm": why, "cutlass": why}} for _ in range(3)]
    doc = {"modules": modules, "first": why, "deep": [[[why, shape]]], "again": modules}
    assert dumps(doc) == _reference(doc)
    assert _reference(doc).count('"N=100 is not a multiple of 128"') == 14


def test_a_shared_object_that_fails_fails_the_same_each_time():
    bad = {"x": [1.0, math.nan]}
    loop: list = [1]
    loop.append({"again": loop})
    for doc in ([{"a": 1}, bad, bad], {"p": loop, "q": loop}):
        with pytest.raises(ValueError) as want:
            _reference(doc)
        with pytest.raises(ValueError) as got:
            dumps(doc)
        assert str(got.value) == str(want.value)
