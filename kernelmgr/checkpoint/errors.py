"""The two ways a checkpoint operation ends badly, each with a message a user can act on.

``CheckpointFailed``: writing did not complete. Nothing changed: the previous checkpoint
(if any) is still the committed one, so the server must keep the kernel running.

``CheckpointRefused``: a checkpoint exists but is not trusted (bad HMAC, missing or
malformed file, another owner's or kernel's). It was moved to ``quarantine/`` and nothing
from it was unpickled.
"""

from __future__ import annotations

from pathlib import Path

from kernelmgr.core.errors import ElasticError


class CheckpointFailed(ElasticError):
    """Writing a checkpoint failed; the committed checkpoint is untouched."""


class CheckpointRefused(ElasticError):
    """A checkpoint failed verification and was not loaded.

    ``reason`` says why; ``quarantined`` is where it was moved (``None`` when there was
    nothing left to move, e.g. the directory had vanished).
    """

    def __init__(self, reason: str, quarantined: Path | None = None) -> None:
        where = f"; kept in {quarantined}" if quarantined is not None else ""
        super().__init__(f"checkpoint refused: {reason}{where}")
        self.reason = reason
        self.quarantined = quarantined
