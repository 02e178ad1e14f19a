"""Bounded JSON parsing: the same value as json.loads, TooDeep exactly past the bound."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar import _jsontext as jsontext


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


# Strings full of brackets: they count against the shortcut without nesting anything.
leaves = st.none() | st.integers() | st.text(alphabet='{[]}ab"\\', max_size=8)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=30,
)


@given(values, st.integers(1, 8), st.booleans())
def test_loads_is_json_loads_bounded_by_depth(value: Any, bound: int, as_bytes: bool) -> None:
    text = json.dumps(value)
    given_text: str | bytes = text.encode() if as_bytes else text
    if depth(value) > bound:
        with pytest.raises(jsontext.TooDeep):
            jsontext.loads(given_text, bound)
    else:
        assert jsontext.loads(given_text, bound) == json.loads(text)


@pytest.mark.parametrize("kind", ["[", '{"a":'])
def test_the_default_bound_holds_one_level_past_it(kind: str) -> None:
    closing = "]" if kind == "[" else "}"
    inside = jsontext.MAX_DEPTH
    ok = kind * inside + "1" + closing * inside
    assert depth(jsontext.loads(ok)) == inside
    deep = kind * (inside + 1) + "1" + closing * (inside + 1)
    with pytest.raises(jsontext.TooDeep, match="flatten it"):
        jsontext.loads(deep)
