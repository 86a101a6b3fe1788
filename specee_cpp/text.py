"""Text at the edge. Every prompt, message and stop string is Unicode text; what cannot be
(bytes that are not UTF-8 on a command line or a terminal, which Python carries as
surrogate escapes, or a lone surrogate such as a JSON client's ``"\\ud800"``) is refused
with its position, the same in the CLI, chat, the Python API and the server. Refused rather
than replaced: a silently altered prompt gives a different answer than the one asked."""
from __future__ import annotations

from .errors import SpeceeError


def utf8(text: str, what: str = "text") -> bytes:
    """``text`` encoded as UTF-8; where it cannot be, one line naming ``what`` and where."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if 0xDC80 <= code <= 0xDCFF:   # a byte that did not decode, carried by surrogateescape
            why = f"byte 0x{code - 0xDC00:02x} is not UTF-8"
        else:
            why = f"U+{code:04X} is a lone surrogate, not a character"
        raise SpeceeError(f"{what} is not valid text: {why} (at character {e.start})") from None


def checked(text: str, what: str = "text") -> str:
    """``text`` itself if it encodes as UTF-8 (``utf8``'s error otherwise)."""
    utf8(text, what)
    return text
