"""Colour in the CLI's output: on a terminal only, never in a pipe, a file or a script's capture.

Why: in ``jupyter elastic list`` the state is what a user scans for (which kernel holds a GPU,
which is asleep, which was lost), and an error line should not look like the output around it.
Off where the stream is not a terminal, where ``NO_COLOR`` is set (https://no-color.org) or the
terminal says it has none (``TERM=dumb``); the text is the same either way, widths included.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TextIO

#: SGR codes per kernel state: running green, asleep cyan, on the way yellow, lost red.
STATE_CODES: Mapping[str, str] = {
    "running": "32",
    "hibernated": "36",
    "starting": "33",
    "hibernating": "33",
    "resuming": "33",
    "lost": "31",
    "failed": "31",
}
ERROR_CODE = "31"


def wanted(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` gets colour."""
    env = os.environ if env is None else env
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False
    return tty and not env.get("NO_COLOR") and env.get("TERM", "") != "dumb"


def paint(text: str, code: str | None) -> str:
    """``text`` in the colour ``code`` (an SGR number), as it is without one."""
    return f"\x1b[{code}m{text}\x1b[0m" if code and text else text


def state(text: Any) -> str:
    """A kernel state, in its colour."""
    return paint(str(text), STATE_CODES.get(str(text)))


__all__ = ["ERROR_CODE", "STATE_CODES", "paint", "state", "wanted"]
