"""Background checkpoints: a kernel that is lost (its pod deleted, its node gone) resumes from
minutes ago, not from its last hibernation.

A local kernel that outlives a crashed server checkpoints itself (its watchdog); a pod can vanish
with no warning at all, so the server checkpoints running kernels every
``ElasticKernels.background_checkpoint_interval`` seconds. The cost is bounded: only an idle
kernel (a busy one is skipped, never waited for) that ran a cell since its last checkpoint, at
most ``CullPolicy.max_concurrent_hibernations`` at a time, through the same one-operation-per-kernel
controller as hibernation (a hibernation asked meanwhile waits for it; the kernel stays ``running``
throughout, so the notebook is not held). The checkpoint's own request is the server's, not the
user's activity, so it never resets an idle clock.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tornado import ioloop

from kernelmgr.core.lifecycle import KernelState
from kernelmgr.lifecycle.scheduler import BoundedScheduler

if TYPE_CHECKING:
    from kernelmgr.lifecycle.service import Hibernator


class BackgroundCheckpoints:
    """Checkpoints running kernels that changed since their last checkpoint, every ``interval``."""

    def __init__(
        self,
        hibernator: Hibernator,
        interval: float,
        max_concurrent: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.hibernator = hibernator
        self.interval = interval
        self.clock = clock
        self.jobs = BoundedScheduler(max_concurrent, hibernator.mkm.log, "background checkpoint")
        self._callback: ioloop.PeriodicCallback | None = None

    def due(self) -> list[str]:
        """The kernels to checkpoint now: running, with a cell run since their last checkpoint
        (or ever, without one), and no checkpoint for ``interval`` seconds."""
        h = self.hibernator
        now = self.clock()
        found = []
        for record in h.runtime.kernels.all():
            if record.state is not KernelState.RUNNING or record.kernel_id in self.jobs:
                continue
            ran = h.activity.get(record.kernel_id).last_execution_end
            committed = record.committed
            last = committed.created if committed is not None else None
            if ran is None or (last is not None and (ran <= last or now - last < self.interval)):
                continue
            found.append(record.kernel_id)
        return found

    def tick(self) -> list[str]:
        """Schedule the due checkpoints (they run in the background); returns their kernel ids."""
        due = self.due()
        for kernel_id in due:
            self.jobs.schedule(kernel_id, functools.partial(self._run, kernel_id))
        return due

    async def _run(self, kernel_id: str) -> None:
        await self.hibernator.checkpoint(kernel_id)

    def _tick(self) -> None:
        self.tick()

    def start(self) -> None:
        # Often enough that a kernel is checkpointed within about a quarter interval of being due.
        period = max(1.0, min(self.interval / 4, 60.0))
        self._callback = ioloop.PeriodicCallback(self._tick, period * 1000)
        self._callback.start()

    async def close(self) -> None:
        if self._callback is not None:
            self._callback.stop()
        self.jobs.cancel_waiting()
        await self.jobs.join()
