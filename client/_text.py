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

import codecs
import re
import unicodedata

#: CSI (colours, cursor moves), OSC (titles, hyperlinks: to BEL or ST), and any other ESC pair.
ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b.?", re.S)
#: An escape sequence whole: what `ESCAPE` takes but with its end (a stream's chunk may not).
_WHOLE_ESCAPE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[^\[\]]", re.S
)
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


class PrintableStream:
    """One stream of a worker's bytes (its stdout, say) as `printable_lines` text, chunk by
    chunk as a journal hands it over: a character or an escape sequence cut between two
    chunks is held back until the next completes it, so neither shows as debris (an OSC
    title's text, a U+FFFD). At most `HOLD` characters are held; `end` gives what is."""

    #: An unfinished escape sequence longer than this is let go (and removed, unfinished).
    HOLD = 4096

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""

    def feed(self, data: bytes) -> str:
        """The text of `data` that can be shown now."""
        text = self._held + self._decoder.decode(data)
        self._held = ""
        start = text.rfind("\x1b")
        if start != -1 and len(text) - start <= self.HOLD and _unfinished(text, start):
            text, self._held = text[:start], text[start:]
        return printable_lines(text)

    def end(self) -> str:
        """What is still held, as it may be shown: the stream ended there."""
        text, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return printable_lines(text)


def _unfinished(text: str, start: int) -> bool:
    """Whether the escape sequence at `start` runs to the end of `text` without its end: more
    of it may come (a malformed one, cut short by what follows, is not waited for)."""
    found = ESCAPE.match(text, start)
    assert found is not None  # ESCAPE matches any ESC
    return found.end() == len(text) and not _WHOLE_ESCAPE.fullmatch(text, start)
