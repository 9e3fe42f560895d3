"""``read._json_loads``: without a backslash in the text it parses without the repeated-key hook
and counts strings instead; what it returns, and the repeated keys it reports, must be what the
hook finds (an independent hook here, which keeps the keys seen twice with each object)."""

from __future__ import annotations

import json

import pytest

from mxfp8_convert.errors import SourceError
from mxfp8_convert.read import _json_loads, _repeated, _strings_and_depth


class _Seen(dict):
    """An object as the test's hook read it, with the keys it held more than once."""

    twice: list[str]


def _reference(text: str):
    def hook(pairs):
        d = _Seen(pairs)
        keys = [k for k, _ in pairs]
        d.twice = sorted({k for k in keys if keys.count(k) > 1})
        return d

    return json.loads(text, object_pairs_hook=hook)


def _same_repeats(got, want) -> bool:
    """Every object of the parsed value reports the repeated keys the test's hook saw."""
    if isinstance(want, dict):
        return sorted(set(_repeated(got))) == want.twice and all(
            _same_repeats(got[k], v) for k, v in want.items())
    if isinstance(want, list):
        return all(_same_repeats(g, w) for g, w in zip(got, want, strict=True))
    return True


TEXTS = [
    '{"a": 1, "b": {"c": "x:y", "d": [1, "}", {"e": null}]}}',
    '{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}, "metadata": {}}',
    '{"a": {"k": 1, "k": 2}, "b": [{"z": 0, "z": 0}], "a": 3}',
    '{"x": ":", "y": [":", ""], "": "empty key"}',
    '{"a": "\\u0041", "a": 1}',  # an escaped string: the hook's path
    '{"a\\"b": 1, "a\\"b": 2}',
    '"a top-level string"',
    '[1, 2, [3, [4, {"deep": ["s"]}]]]',
    '{"ü": "é", "ü": "é"}',
    '{}',
]


@pytest.mark.parametrize("text", TEXTS)
def test_values_and_repeated_keys_are_the_hooks(text):
    got = _json_loads(text.encode(), "f.json")
    want = _reference(text)
    assert got == want
    assert _same_repeats(got, want)


def test_strings_and_depth_count_keys_values_and_nesting():
    # keys a, c, e and values "b", "d"; object, list, object, list
    assert _strings_and_depth({"a": "b", "c": [1, "d", {"e": []}]}) == (5, 4)
    assert _strings_and_depth("s") == (1, 0)
    assert _strings_and_depth(3) == (0, 0)


@pytest.mark.parametrize("escaped", [False, True])
def test_nesting_past_the_limit_is_refused_on_both_paths(escaped):
    text = "[" * 5 + ('"\\n"' if escaped else "1") + "]" * 5
    assert _json_loads(text.encode(), "f.json", max_depth=5) is not None
    with pytest.raises(SourceError, match=r"^f\.json: nested more than 4 levels deep$"):
        _json_loads(text.encode(), "f.json", max_depth=4)
