"""Text a worker wrote, made safe to show: the one sanitiser of every surface a person or a
model reads (top, ls, status, events, watch, grep, collect's text, the MCP server's text).

A worker's output and the names it gives its children are anyone's bytes: an escape
sequence in them could clear the user's terminal, retitle it, move its cursor or ring its
bell, and a bidi override could make a line read other than it is. What is shown is
therefore first stripped of escape sequences (CSI, OSC to BEL or ST, any other ESC pair);
then each control or formatting character left becomes ``?``. Raw bytes stay where a
program asks for them (``--json``, structured content, ``collect`` to a file).

Pure: no I/O.
"""

from __future__ import annotations

import re
import unicodedata

#: CSI (colours, cursor moves), OSC (titles, hyperlinks: to BEL or ST), and any other ESC pair.
ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b.?", re.S)
# Control, format (bidi overrides, zero-width), separators, surrogates, private use, unassigned.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def _shown(char: str) -> str:
    return "?" if unicodedata.category(char) in _UNPRINTABLE else char


def printable(text: str, limit: int | None = None) -> str:
    """`text` as it may stand on one line of a terminal: escape sequences removed, a tab as a
    space, any other control or formatting character (a newline too) as ``?``; at most
    `limit` characters (None: all)."""
    if limit is not None:
        text = text[: limit * 4]  # what the escapes removed can leave at least `limit`
    text = ESCAPE.sub("", text).replace("\t", " ")
    if limit is not None:
        text = text[:limit]
    return "".join(map(_shown, text))


def printable_lines(text: str) -> str:
    """`text` as it may reach a terminal or a model over several lines: as `printable`, but
    newlines and tabs are kept (a carriage return too is shown as ``?``, so a line cannot be
    overwritten)."""
    text = ESCAPE.sub("", text)
    return "".join(char if char in "\n\t" else _shown(char) for char in text)


def printable_bytes(data: bytes) -> str:
    """A worker's bytes as `printable_lines` text (invalid UTF-8 as U+FFFD)."""
    return printable_lines(data.decode("utf-8", errors="replace"))
