"""Bounded, non-blocking scheduling of slow per-kernel jobs (hibernations).

A checkpoint can take minutes (a large state, a slow disk, an object whose pickling is slow).
Awaited inline, one such checkpoint would hold up every other kernel's warning and
hibernation behind it; started all at once, fifty of them would write fifty checkpoints in
parallel, pickling fifty states into memory and saturating the disk. So slow jobs go through
a :class:`BoundedScheduler`:

* :meth:`~BoundedScheduler.schedule` returns at once — the caller (the culler's tick) goes
  on with the other kernels;
* at most ``limit`` jobs run at the same time; the rest wait, first scheduled first run;
* one job per key: a kernel whose hibernation is queued or running is not scheduled again;
* a finished job is forgotten as it finishes (nothing grows with the kernels ever seen).

:func:`kernelmgr.server.shutdown.hibernate_on_shutdown` uses the same bound for the server's
hibernate-on-shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable

#: Hibernations at once when nothing configures it (``CullPolicy.max_concurrent_hibernations``).
DEFAULT_LIMIT = 4

Job = Callable[[], Awaitable[object]]


class BoundedScheduler:
    """Runs keyed coroutine jobs in the background, at most ``limit`` at once, one per key."""

    def __init__(self, limit: int, log: logging.Logger | None = None, what: str = "job") -> None:
        if limit < 1:
            raise ValueError(f"the concurrency limit must be at least 1, got {limit}")
        self.limit = limit
        self.log = log or logging.getLogger(__name__)
        self.what = what
        #: The most jobs that ever ran at the same time (tests and diagnostics read it).
        self.peak = 0
        self._slots = asyncio.Semaphore(limit)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._running: set[str] = set()

    # -- state -----------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        """Is a job for ``key`` queued or running?"""
        return key in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def running(self) -> frozenset[str]:
        """Keys whose job holds a slot now."""
        return frozenset(self._running)

    @property
    def waiting(self) -> frozenset[str]:
        """Keys whose job waits for a slot."""
        return frozenset(self._tasks.keys() - self._running)

    # -- scheduling ------------------------------------------------------------------------

    def schedule(self, key: str, job: Job) -> bool:
        """Run ``job()`` when a slot is free; False (and nothing scheduled) if ``key`` is in flight.

        Never awaits: the caller goes on at once. An exception from the job is logged, not
        raised: a job reports its own failures where they belong (the culler's back-off).
        """
        if key in self._tasks:
            return False
        task = asyncio.ensure_future(self._run(key, job))
        self._tasks[key] = task
        task.add_done_callback(lambda done: self._finished(key, done))
        return True

    async def _run(self, key: str, job: Job) -> None:
        try:
            async with self._slots:
                self._running.add(key)
                self.peak = max(self.peak, len(self._running))
                try:
                    await job()
                except Exception:
                    self.log.exception("%s of %s failed", self.what, key)
                finally:
                    self._running.discard(key)
        finally:
            # Forgotten as the job ends, not a loop turn later in a done callback: the key
            # may be scheduled again at once.
            self._finished(key, asyncio.current_task())

    def _finished(self, key: str, task: asyncio.Future[None] | None) -> None:
        if task is not None and self._tasks.get(key) is task:
            del self._tasks[key]

    def cancel_waiting(self) -> list[str]:
        """Cancel the jobs that have not started (a running job is never cut off midway)."""
        cancelled = sorted(self.waiting)
        for key in cancelled:
            self._tasks[key].cancel()
        return cancelled

    async def join(self) -> None:
        """Wait until nothing is queued or running, including jobs scheduled meanwhile."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)


async def run_bounded(
    keys: Iterable[str],
    job: Callable[[str], Awaitable[object]],
    limit: int,
    log: logging.Logger | None = None,
    what: str = "job",
) -> None:
    """``job(key)`` for every key, at most ``limit`` at once; returns when all are done."""
    scheduler = BoundedScheduler(limit, log, what)
    for key in keys:
        scheduler.schedule(key, functools.partial(job, key))
    await scheduler.join()
