"""Text from files, shown to people: names and values a checkpoint holds, which anyone may have
written. Characters that do not print are written out (a right-to-left override would turn the
text after it around, a zero-width space make two names look alike), and a terminal table is
aligned by the columns a character takes (two for East Asian wide ones), not by its length."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """``text`` with each character that does not print written out as Python's repr writes it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def width(text: str) -> int:
    """The columns ``text`` (printable) takes in a terminal: 2 for wide and full-width
    characters, 0 for combining marks, 1 for the rest."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def pad(text: str, columns: int) -> str:
    """``text`` followed by spaces to ``columns`` columns."""
    return text + " " * max(0, columns - width(text))
