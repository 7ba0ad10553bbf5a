"""Text from outside -- the wire, a peer's name, a server's reply -- made safe to print.

Every line the peer writes goes through :func:`clean` (``peer.options.log`` and the
logging handler the command installs), so no peer can move the cursor, clear the
screen, set the window title, write the clipboard (OSC 52), forge a line with a newline
or reorder text with a bidirectional control on another member's terminal. Control
characters (C0, DEL, C1), zero-width and bidirectional formatting characters are shown
as escapes (``\\x1b``, ``\\u202e``) instead of being sent to the terminal.
"""

from __future__ import annotations

import re

__all__ = ["clean"]

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def clean(text: object, limit: int | None = None) -> str:
    """``text`` with every unsafe character escaped, cut at ``limit`` characters."""
    s = _UNSAFE.sub(_escape, str(text))
    if limit is not None and len(s) > limit:
        return s[:limit] + "..."
    return s
