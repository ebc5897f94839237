"""A file-system checkpoint store whose ``latest`` the test can hold, to stand in a window that is
otherwise a few milliseconds wide (the server reads a lost kernel's newest checkpoint in a thread
before it takes the kernel over).

Held only while ``<checkpoint root>/../latest-hold/armed`` exists: the read then touches
``entered`` and waits until the test creates ``release`` (``limit`` keeps a forgotten hold from
hanging the server). The checkpoint read itself is the real one.
"""

from __future__ import annotations

import time
from pathlib import Path

from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.core.manifest import Manifest


class HeldLatestStore(CheckpointStore):
    limit = 300.0

    def latest(self, owner: str, kernel_id: str) -> Manifest | None:
        hold = latest_hold(Path(self.root))
        if (hold / "armed").exists():
            (hold / "entered").touch()
            deadline = time.monotonic() + self.limit
            while not (hold / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return super().latest(owner, kernel_id)


def latest_hold(checkpoint_root: Path) -> Path:
    """The folder of the hold's files (beside the checkpoint root, never in it)."""
    return checkpoint_root.parent / "latest-hold"
