"""JSON text from the outside, parsed with a bound on nesting.

Arguments, escalation cards, stacks, cursors and API bodies are small, shallow
documents; one nested thousands of levels deep is hostile, and would otherwise
surface as a RecursionError (a 500) in whichever later step walks it.
"""

from __future__ import annotations

import json
from typing import Any, Final

MAX_DEPTH: Final = 32


class TooDeep(ValueError):
    """Nested deeper than MAX_DEPTH (a ValueError, so "not valid JSON" handlers catch it)."""


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` that raises ValueError (TooDeep) for documents nested past ``max_depth``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"JSON nested deeper than {max_depth} levels: flatten it") from None
    if may_nest_past(text, max_depth):
        check_depth(value, max_depth)
    return value


def may_nest_past(text: str | bytes, max_depth: int = MAX_DEPTH) -> bool:
    """Whether ``text`` has enough brackets to nest past ``max_depth``: each level opens
    one, so a text with no more (the usual small document; a bracket inside a string
    only counts against it) needs no depth walk."""
    if isinstance(text, str):
        return text.count("{") + text.count("[") > max_depth
    return text.count(b"{") + text.count(b"[") > max_depth


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise TooDeep when containers nest past ``max_depth`` (iterative: no recursion)."""
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise TooDeep(f"JSON nested deeper than {max_depth} levels: flatten it")
        todo.extend((child, depth + 1) for child in children)
