"""The platform's notes in a notebook (the restore report after a resume, idle warnings), marked.

Why: what a kernel or the server sends as a cell's output is saved with the notebook, so the
platform's own notes ended up in the user's ``.ipynb``, under cells they have nothing to do with.
A front end that shows these notes its own way (JupyterLab with this project's extension: as
notifications) says so on each kernel connection it opens, and the server then leaves the marked
outputs out of that connection (``ElasticWebsocketConnection.notes_in_notebook``). Any other
front end keeps getting them in the notebook, the only place it would show them.

Here, not in the server: the kernel's agent marks its report with the same key.
"""

from __future__ import annotations

import json
from typing import Any

from kernelmgr.checkpoint.outbox import DELIM

#: The key in an output's metadata that marks it as the platform's note (its value: which note).
METADATA_KEY = "jupyter_elastic_kernels"
#: What a front end sends on the control channel of each kernel connection to say it shows the
#: platform's notes itself. The server takes it; it never reaches the kernel and gets no reply.
SHOWN_BY_FRONTEND = "elastic_notes_shown_request"


def metadata(note: str) -> dict[str, Any]:
    """The metadata (a display's own, in its content) of an output that is the platform's ``note``."""
    return {METADATA_KEY: {"note": note}}


def is_note(frames: list[Any]) -> bool:
    """Whether a serialized IOPub message (its ZMQ frames) is a display marked as a note."""
    # The cheap tests first (almost every message fails them, none is parsed), and no copy of a
    # frame but the few before the delimiter, the header and a display's content.
    try:
        at = next(i for i, frame in enumerate(frames) if bytes(frame) == DELIM)
        if b"display_data" not in bytes(frames[at + 2]):
            return False
        content = bytes(frames[at + 5])
    except (StopIteration, IndexError, TypeError):
        return False
    if METADATA_KEY.encode() not in content:
        return False
    try:
        return isinstance(json.loads(content).get("metadata", {}).get(METADATA_KEY), dict)
    except (ValueError, AttributeError):
        return False


__all__ = ["METADATA_KEY", "SHOWN_BY_FRONTEND", "is_note", "metadata"]
