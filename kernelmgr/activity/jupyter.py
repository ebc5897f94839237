"""Jupyter activity per kernel: when cells started and finished, and since when it is busy.

jupyter_server keeps one ``last_activity`` timestamp that any IOPub message moves (a widget
heartbeat, a completion reply while typing…). The cull policy needs something sharper —
*executions* — so this tracker reads the same IOPub stream the server already watches and
records only execution starts (``execute_input``), busy/idle transitions caused by
``execute_request``, and nothing else. Requests the server itself sends (the silent
checkpoint) are registered as internal and ignored, so hibernating never counts as use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ExecutionActivity:
    """Timestamps (epoch seconds) of one kernel's executions."""

    started: float
    last_execution_start: float | None = None
    last_execution_end: float | None = None
    busy_since: float | None = None
    #: The execution count of the latest cell (so a resumed kernel continues the numbering).
    execution_count: int = 0

    @property
    def last_execution(self) -> float | None:
        stamps = [s for s in (self.last_execution_start, self.last_execution_end) if s is not None]
        return max(stamps) if stamps else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "last_execution_start": self.last_execution_start,
            "last_execution_end": self.last_execution_end,
            "busy_since": self.busy_since,
        }


class JupyterActivity:
    """Execution activity of every kernel, fed with IOPub messages."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._kernels: dict[str, ExecutionActivity] = {}
        self._internal: set[str] = set()

    def get(self, kernel_id: str) -> ExecutionActivity:
        with self._lock:
            activity = self._kernels.get(kernel_id)
            if activity is None:
                activity = self._kernels[kernel_id] = ExecutionActivity(started=self.clock())
            return activity

    def forget(self, kernel_id: str) -> None:
        with self._lock:
            self._kernels.pop(kernel_id, None)

    def internal(self, msg_id: str) -> None:
        """Ignore everything caused by this request (the server's own)."""
        with self._lock:
            self._internal.add(msg_id)
            if len(self._internal) > 10_000:  # bounded: old ids are long answered
                self._internal.clear()
                self._internal.add(msg_id)

    def observe(
        self, kernel_id: str, msg_type: str, parent: dict[str, Any], content: dict[str, Any] | None
    ) -> None:
        """Account one IOPub message (``content`` is only needed for status and execute_input)."""
        if parent.get("msg_type") != "execute_request" or parent.get("msg_id") in self._internal:
            return
        now = self.clock()
        activity = self.get(kernel_id)
        if msg_type == "execute_input":
            activity.last_execution_start = now
            count = (content or {}).get("execution_count")
            if isinstance(count, int):
                activity.execution_count = count
        elif msg_type == "status" and content is not None:
            state = content.get("execution_state")
            if state == "busy":
                activity.busy_since = now
            elif state == "idle":
                activity.last_execution_end = now
                activity.busy_since = None

    def restarted(self, kernel_id: str) -> None:
        """A new process (start, restart, resume): nothing is running in it."""
        activity = self.get(kernel_id)
        activity.busy_since = None
