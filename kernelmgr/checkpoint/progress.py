"""How far a restore has read its checkpoint, in a small file the server can look at.

A large checkpoint takes seconds to read back, and a notebook that waits that long with no
sign of life looks hung. The in-kernel agent reports its progress through a file beside the
checkpoints (``restore-progress.json``) rather than a message: the kernel does not serve
requests until the restore is over, and the server only has to read one small file when a
client asks for the kernel's model, so nothing is sent while nobody looks.

The file is replaced whole (a rename), at most every :data:`INTERVAL` seconds; it is not
fsynced, since it is worthless after a crash. Its ``time`` tells a reader whether it belongs
to the resume in progress or to an earlier one.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelmgr.checkpoint.safedir import SafeDir, opened

RESTORE_PROGRESS = "restore-progress.json"
#: The same for a checkpoint being written (``read_bytes``: bytes written so far, ``total_bytes``:
#: the writer's estimate before pickling), so a hibernation shows how far it has got.
CHECKPOINT_PROGRESS = "checkpoint-progress.json"

#: Seconds between two writes of the progress file while reading.
INTERVAL = 0.2


class ProgressFile:
    """Writes ``{checkpoint_id, read_bytes, total_bytes, time}``, throttled, never raising.

    A failed write (a full disk) only costs the progress display, never the restore.
    """

    def __init__(
        self, kernel_dir: Path, clock: Callable[[], float] = time.time, name: str = RESTORE_PROGRESS
    ) -> None:
        self.path = kernel_dir / name
        self.clock = clock
        self._last = 0.0

    def __call__(self, checkpoint_id: str, read_bytes: int, total_bytes: int) -> None:
        now = self.clock()
        if read_bytes < total_bytes and now - self._last < INTERVAL:
            return
        self._last = now
        payload = {
            "checkpoint_id": checkpoint_id,
            "read_bytes": read_bytes,
            "total_bytes": total_bytes,
            "time": now,
        }
        tmp = self.path.parent / f".{self.path.name}.tmp"
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(payload), encoding="utf-8")
            os.replace(tmp, self.path)


#: The file is a few numbers; the server reads no more than this of it (a kernel writes it).
PROGRESS_CAP = 64 * 1024


def read_progress(
    kernel_dir: Path | SafeDir, since: float, name: str = RESTORE_PROGRESS
) -> dict[str, Any] | None:
    """The progress written at or after ``since`` (epoch seconds), or ``None``.

    Read without following a link, and at most :data:`PROGRESS_CAP` bytes.
    """
    try:
        with opened(kernel_dir) as directory:
            progress = json.loads(directory.read(name, PROGRESS_CAP))
    except (OSError, ValueError):
        return None
    if not isinstance(progress, dict) or not isinstance(progress.get("time"), int | float):
        return None
    if progress["time"] < since:
        return None  # an earlier resume's
    return progress
