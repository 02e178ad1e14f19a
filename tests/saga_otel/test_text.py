"""printable(): outside text shown on a terminal, never obeyed."""

from __future__ import annotations

from saga_otel._text import printable


def test_what_steers_a_terminal_or_reorders_text_is_shown_as_escapes() -> None:
    assert printable("get_order") == "get_order"
    assert printable("crédit 信用 ✓") == "crédit 信用 ✓"  # printable beyond ASCII stays
    assert printable("delete\x1b[8m") == "delete\\x1b[8m"
    assert printable("a\tb\nc\x7f\x9b") == "a\\x09b\\x0ac\\x7f\\x9b"
    assert printable("safe\u202eexe.txt\u200b") == "safe\\u202eexe.txt\\u200b"
    assert printable("\U000e0001tag") == "\\U000e0001tag"
