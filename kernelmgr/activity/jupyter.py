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
from typing import Any

from kernelmgr.core.activity import ExecutionActivity
from kernelmgr.core.kernels import KernelRegistry

__all__ = ["ExecutionActivity", "JupyterActivity"]


class JupyterActivity:
    """Execution activity of the elastic kernels, fed with IOPub messages.

    Each kernel's timestamps are on its record (``ManagedKernel.activity``), so they go with it;
    a kernel without a record (not elastic) is not tracked.
    """

    def __init__(self, kernels: KernelRegistry, clock: Callable[[], float] = time.time) -> None:
        self.kernels = kernels
        self.clock = clock
        self._lock = threading.Lock()
        self._internal: set[str] = set()

    def get(self, kernel_id: str) -> ExecutionActivity:
        """The kernel's activity; for a kernel with no record, an empty one that is not kept."""
        record = self.kernels.get(kernel_id)
        return record.activity if record is not None else ExecutionActivity(started=self.clock())

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
        now = self.clock()
        activity = self.get(kernel_id)
        activity.iopub_heard = now
        if parent.get("msg_type") != "execute_request" or parent.get("msg_id") in self._internal:
            return
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
        """A new process (start, restart, resume) is up: nothing runs in it, and a kernel that
        never ran a cell is idle from now (not from its registration, before a slow launch)."""
        activity = self.get(kernel_id)
        activity.busy_since = None
        activity.started = self.clock()
