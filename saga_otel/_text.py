"""Outside text made safe to show a person on a terminal."""

from __future__ import annotations


def _escape(c: str) -> str:
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character ``str.isprintable()`` refuses shown as an escape:
    ``\\x1b`` for ESC (terminal control sequences), ``\\u202e`` for a bidi override
    (what a person reads reordered), ``\\x0a`` for a newline (a table row broken).

    For names and values from outside (an MCP server's tool names) printed on a
    terminal: they are shown, never obeyed.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)
