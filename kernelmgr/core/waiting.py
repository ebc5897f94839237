"""Waiting for a GPU slice: the loop around the :class:`~kernelmgr.core.queue.SliceQueue` that
resumes (in the lifecycle controller) and queued starts (in the server) share.

A waiter looks again when :meth:`SliceWaits.nudge` says capacity may have come free, and at
least every ``poll`` seconds, because slices also come free where nothing nudges (a kernel shut
down by jupyter_server, a node added). Pure asyncio: no jupyter, tornado or Kubernetes import.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from kernelmgr.core.allocator import SliceAllocator
from kernelmgr.core.errors import CapacityError
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.core.queue import Held, SliceQueue

#: Called once when the waiter first has to wait, with its place in the queue.
OnWait = Callable[[int | None, str], Awaitable[None] | None]


class WaitTimedOut(CapacityError):
    """The wait outlasted its limit; the message says how long, where it was, and the setting."""


class SliceWaits:
    """The kernels waiting for a slice, each until it is its turn and its size fits."""

    def __init__(
        self,
        queue: SliceQueue,
        allocator: SliceAllocator,
        profile: Callable[[str], GpuProfile],
        held: Held | None = None,
        poll: float = 0.5,
    ) -> None:
        self.queue = queue
        self.allocator = allocator
        self.profile = profile
        self.held: Held = held or dict
        self.poll = poll
        self._wakes: dict[str, asyncio.Event] = {}

    def nudge(self) -> None:
        """Capacity may have come free: every waiter looks again now."""
        for wake in self._wakes.values():
            wake.set()

    def position(self, key: str) -> int | None:
        return self.queue.position(key, self.held)

    def no_fit(self, profile: GpuProfile) -> str:
        """Why ``profile`` has to wait: the allocator's reason, or the queue ahead of it."""
        try:
            self.allocator.check(profile)
        except CapacityError as exc:
            return exc.message
        return "other kernels ahead in the queue go first."

    async def wait(
        self,
        key: str,
        owner: str,
        profile: GpuProfile,
        max_wait: float,
        setting: str,
        on_wait: OnWait | None = None,
        cancelled: asyncio.Event | None = None,
    ) -> None:
        """Return once ``key`` may take its slice (its claim then lasts until the caller's
        :meth:`SliceQueue.settle`). Raises :class:`CapacityError` at once if the size can never
        fit, :class:`WaitTimedOut` past ``max_wait`` seconds (0: no limit; ``setting`` names it in
        the message), and returns early, without a slice, when ``cancelled`` is set (the caller
        checks it)."""
        queue = self.queue
        wake = self._wakes[key] = asyncio.Event()
        began = time.monotonic()
        told = False

        def fits(size: str) -> bool:
            # Warm slices count as free: the launch takes one, or warm workloads give theirs back.
            return self.allocator.fits(self.profile(size), warm_gives_way=True)

        def claimed(other: str) -> bool:
            return self.allocator.slice_of(other) is not None

        try:
            while True:
                wake.clear()
                if queue.may_take(key, fits, claimed, self.held) and fits(profile.name):
                    queue.granted(key, time.monotonic(), self.held)
                    return
                if not self.allocator.ever_fits(profile):
                    raise CapacityError(self.no_fit(profile))
                queue.join(key, owner, profile.name, time.monotonic(), profile.queue_priority)
                waited = time.monotonic() - began
                if max_wait and waited >= max_wait:
                    raise WaitTimedOut(
                        f"No GPU slice of size {profile.display_name} came free in {waited:.0f} s "
                        f"({setting}); the kernel was number {self.position(key)} in the queue. "
                        "Try again later, or ask for a smaller size."
                    )
                if not told and on_wait is not None:
                    told = True
                    pending = on_wait(self.position(key), self.no_fit(profile))
                    if pending is not None:
                        await pending
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=self.poll)
                if cancelled is not None and cancelled.is_set():
                    queue.leave(key)
                    return
        except BaseException:
            queue.leave(key)
            raise
        finally:
            if self._wakes.get(key) is wake:
                del self._wakes[key]

    def wake(self, key: str) -> None:
        """Make ``key`` look again now (its wait was cancelled)."""
        event = self._wakes.get(key)
        if event is not None:
            event.set()
