"""One owner of every kernel's lifecycle: each path that changes it goes through here.

A kernel's life used to be spread over the registry, the allocator, the hibernator's locks
and tasks, the culler and the websocket queue, and under races they drifted apart: a
resume kept running after the kernel was deleted, a full disk left a kernel ``hibernating``
for good. :class:`LifecycleController` is the single place that

* allows one operation per kernel at a time (hibernate, resume, remove), each run as its own
  task so that a delete can cancel it, and concurrent callers of the same resume share it;
* moves the :class:`~kernelmgr.core.lifecycle.Lifecycle` only through its table, and in an
  order that keeps the invariants below whatever fails or is cancelled;
* asks a :class:`KernelPlatform` (the adapter: one for local processes and pods alike) to do the
  work: checkpoint, stop, kill, launch, release the slice.

Invariants (``tests/test_lifecycle_properties.py`` drives random interleavings against them):

1. a kernel's slice is released only once no process of it is left, and a kernel with a
   process holds a slice;
2. a process is stopped for hibernation only after its checkpoint is committed, and a
   committed checkpoint is discarded only when the kernel is removed for good;
3. once no operation is in flight, no kernel is ``hibernating`` or ``resuming``;
4. a removed kernel has no process, no slice and no checkpoint.

Pure asyncio and the core model: no jupyter, tornado or Kubernetes import.

Long because the controller's operations and ``KernelStates``, the one writer of states, stay in
one module: the architecture test allows state writes here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from kernelmgr.core.allocator import SliceAllocator
from kernelmgr.core.errors import CapacityError, ElasticError
from kernelmgr.core.kernels import Committed, KernelRegistry, ManagedKernel
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.core.queue import Held, SliceQueue
from kernelmgr.core.waiting import SliceWaits, WaitTimedOut

S = KernelState

Notify = Callable[[str], Awaitable[None] | None]

#: A restore reads the checkpoint at no less than this rate before its wait times out.
RESTORE_BYTES_PER_SECOND_FLOOR = 20 << 20


class LifecycleError(ElasticError):
    """An operation was refused or failed; ``status`` is the HTTP status that says so."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class HibernateFailed(LifecycleError):
    """The checkpoint was attempted and failed; the kernel keeps running with its slice."""


class WaitCancelled(LifecycleError):
    """The user interrupted a resume that was waiting for a GPU slice."""


class KernelRemoved(LifecycleError):
    """The kernel was deleted while an operation on it was in flight."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=404)


class KernelPlatform(Protocol):
    """What the controller needs done; one implementation per way of running kernels."""

    async def ensure_idle(self, kernel_id: str) -> None:
        """Return once the kernel runs no cell; raise :class:`LifecycleError` if it stays busy."""

    async def checkpoint(self, kernel_id: str) -> Committed:
        """Have the kernel write and commit a checkpoint; raise :class:`LifecycleError` on failure."""

    async def stop(self, kernel_id: str) -> None:
        """Stop the process gracefully (its checkpoint is committed); the slice stays taken."""

    async def kill(self, kernel_id: str) -> None:
        """Stop the process now, whatever it is doing; nothing if there is none."""

    async def launch(self, kernel_id: str, restore: Committed | None, timeout: float) -> None:
        """Start the process (taking the slice; a pod within its own launch budget) and wait until
        it serves, within ``timeout`` counted from when it runs ("kernel restored")."""

    def release_slice(self, kernel_id: str) -> None:
        """Give the kernel's slice back (idempotent)."""

    async def discard_checkpoints(self, kernel_id: str) -> None:
        """Delete every checkpoint of the kernel (it is removed for good)."""

    def persist(self, kernel_id: str) -> None:
        """Record the kernel's state durably, best effort (must not raise)."""


@dataclass(frozen=True)
class Transition:
    """A kernel's state changed; ``before`` is ``None`` when it was registered in ``after``."""

    record: ManagedKernel
    before: KernelState | None
    after: KernelState
    reason: str
    #: ``dead`` for good: no restarter brings it back (a crash's ``dead`` may be restarted).
    final: bool = False


#: Called after every transition, on the thread that made it; must not raise (logged if it does).
Observer = Callable[[Transition], None]


class KernelStates:
    """The one writer of every kernel's lifecycle state.

    The controller's operations (hibernate, resume, loss, removal) move states through it, and
    so do the facts provisioners report: a start began, the process serves, it ended. Nothing
    else calls :meth:`~kernelmgr.core.lifecycle.Lifecycle.move` (tests/test_architecture.py).
    Side effects of a transition (jupyter_server's execution state) observe it through
    ``observers`` instead of being written on each path.
    """

    def __init__(self, registry: KernelRegistry) -> None:
        self.registry = registry
        self.observers: list[Observer] = []

    def _moved(
        self, record: ManagedKernel, before: KernelState | None, reason: str, final: bool = False
    ) -> None:
        transition = Transition(record, before, record.state, reason, final)
        for observer in list(self.observers):
            try:
                observer(transition)
            except Exception:  # an observer must not undo a transition that has happened
                logging.getLogger(__name__).exception("transition observer failed for %s", record.kernel_id)

    def move(self, record: ManagedKernel, state: KernelState, reason: str) -> None:
        before = record.state
        record.lifecycle.move(state, reason)
        self._moved(record, before, reason)

    def adopted(
        self, kernel_id: str, kernelspec: str, profile: str | None, owner: str, state: KernelState
    ) -> ManagedKernel:
        """A kernel a previous server left is listed again in ``state`` (no process started)."""
        record = self.registry.register(kernel_id, kernelspec, profile, owner, state=state)
        self._moved(record, None, "adopted")
        return record

    def starting(self, kernel_id: str, kernelspec: str, profile: str | None, owner: str) -> ManagedKernel:
        """A launch begins: a new kernel is registered ``starting``; a restart goes back to it; a
        resume's launch keeps ``resuming`` (the controller decides how a resume ends)."""
        record = self.registry.register(kernel_id, kernelspec, profile, owner)
        record.taken_over = None  # a new process: what the last one's end left no longer applies
        record.stop_began = None
        if record.state not in (S.RESUMING, S.STARTING):
            self.move(record, S.STARTING, "launch")
        return record

    def start_refused(self, record: ManagedKernel, why: str) -> None:
        """A new kernel's start was refused before anything ran (no slice): dead and forgotten."""
        self.move(record, S.DEAD, why)
        record.last_error = why
        self.registry.remove(record.kernel_id)

    def launched(self, kernel_id: str, how: str) -> None:
        """The kernel's process serves: count the launch; a starting kernel is now running."""
        record = self.registry.get(kernel_id)
        if record is not None:
            record.launches += 1
            record.restarting = False
            if record.state is S.STARTING:
                self.move(record, S.RUNNING, how)

    def ended(self, kernel_id: str, reason: str) -> None:
        """The process of a starting or running kernel is gone (crash, kill, failed launch).

        During a hibernation or a resume the controller owns the state and decides what a stopped
        kernel means (hibernated, back to running, resume failed), so those states stay.
        """
        record = self.registry.get(kernel_id)
        if record is not None and record.state in (S.STARTING, S.RUNNING):
            self.move(record, S.DEAD, reason)

    def dead(self, record: ManagedKernel, reason: str) -> None:
        """The kernel is gone for good, from whatever state allows it."""
        if record.lifecycle.can(S.DEAD):
            before = record.state
            record.lifecycle.move(S.DEAD, reason)
            self._moved(record, before, reason, final=True)

    def restart_requested(self, kernel_id: str, restart: bool) -> None:
        """Its process was asked to end, for a restart (``restart``: the process comes back, the
        slice stays) or for good."""
        record = self.registry.get(kernel_id)
        if record is not None:
            record.restarting = restart

    def stop_seen(self, record: ManagedKernel, began: float | None) -> None:
        """Kubernetes began stopping the running kernel's pod at ``began`` (the first sighting counts)."""
        if record.stop_began is None:
            record.stop_began = began

    def taken_over(self, record: ManagedKernel, why: str) -> None:
        """Its process or pod vanished and the server took it over (:class:`LossReports`): no exit
        is reported until the next launch."""
        record.taken_over = why


class LossReports(Protocol):
    """Where provisioners report a running kernel's process or pod going without being asked.

    The server that owns the kernels provides it (the lifecycle's
    :class:`~kernelmgr.lifecycle.loss.KernelLoss`), found like the runtime on the provisioner's
    parents (``kernel_losses``); none: nothing takes a vanished kernel over.
    """

    def stopping(self, kernel_id: str) -> None:
        """Kubernetes began stopping the kernel's pod, and the kernel checkpoints itself: until it
        is taken over or gone, what notebooks send is held."""

    def vanished(self, kernel_id: str, why: str, stop_began: float | None = None) -> bool:
        """The kernel is gone (``why``; ``stop_began``: when it was told to stop, ``0.0``: its
        newest checkpoint was written at SIGTERM): ``True`` if the server takes it over
        (hibernated from its last checkpoint), ``False`` if it has none."""

    def died(self, kernel_id: str, why: str) -> None:
        """The kernel's process or pod ended on its own and is not taken over (a crash, an
        out-of-memory kill): the cell it was running is answered now, with ``why``, instead of
        staying "running" in the notebook while jupyter_server's restarter starts it again."""


def restore_timeout(base: float, checkpoint_bytes: int) -> float:
    """How long a resume may take: a start plus reading the checkpoint at a slow disk's rate."""
    return base + checkpoint_bytes / RESTORE_BYTES_PER_SECOND_FLOOR


@dataclass
class _Slot:
    """The controller's per-kernel bookkeeping; dropped with the kernel."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task[Committed | None] | None = None
    operation: str = ""
    cancel_wait: asyncio.Event = field(default_factory=asyncio.Event)
    removed: bool = False


class LifecycleController:
    """Hibernate, resume and remove kernels, one operation per kernel at a time."""

    def __init__(
        self,
        registry: KernelRegistry,
        allocator: SliceAllocator,
        profile: Callable[[str], GpuProfile],
        platform: KernelPlatform,
        start_timeout: float = 120.0,
        busy_retry: float = 0.5,
        states: KernelStates | None = None,
        queue: SliceQueue | None = None,
        max_wait: float = 0.0,
        held: Held | None = None,
        node_may_come: Callable[[GpuProfile], bool] | None = None,
    ) -> None:
        self.registry = registry
        self.states = states or KernelStates(registry)
        self.allocator = allocator
        self.profile = profile
        self.platform = platform
        self.start_timeout = start_timeout
        self.busy_retry = busy_retry
        #: Who gets the next free slice (resumes here, queued starts in the server); ``max_wait``
        #: bounds a resume's wait (0: none).
        self.waits = SliceWaits(
            queue if queue is not None else SliceQueue(), allocator, profile, held, poll=busy_retry
        )
        self.queue = self.waits.queue
        self.max_wait = max_wait
        #: Whether a size that fits nowhere now goes to a pod left Pending for a node the cluster
        #: autoscaler adds (``ElasticKernels.scale_up_wait``) instead of the queue.
        self.node_may_come = node_may_come
        self._slots: dict[str, _Slot] = {}

    # -- queries ---------------------------------------------------------------------------

    def state_of(self, kernel_id: str) -> KernelState | None:
        record = self.registry.get(kernel_id)
        return record.state if record else None

    def in_flight(self, kernel_id: str) -> str:
        """The operation running on ``kernel_id`` now (``""`` when none)."""
        slot = self._slots.get(kernel_id)
        return slot.operation if slot and slot.task and not slot.task.done() else ""

    def busy_kernels(self) -> list[str]:
        return [kernel_id for kernel_id in self._slots if self.in_flight(kernel_id)]

    def slot_count(self) -> int:
        """Kernels with bookkeeping (bounded by the kernels that exist; tests check it)."""
        return len(self._slots)

    # -- operations --------------------------------------------------------------------------

    async def hibernate(self, kernel_id: str, reason: str) -> Committed | None:
        """Checkpoint, stop, release. ``None`` if it was hibernated already."""
        return await self._run(kernel_id, "hibernate", lambda: self._hibernate(kernel_id, reason))

    async def resume(
        self, kernel_id: str, reason: str, notify: Notify | None = None, restore: bool = True
    ) -> None:
        """Bring a hibernated kernel back; callers arriving during the same resume share it."""
        slot = self._slots.get(kernel_id)
        if slot is not None and slot.task is not None and not slot.task.done():
            if slot.operation == "resume":
                await self._join(kernel_id, slot.task)
                return
            await asyncio.wait([slot.task])  # a hibernation (or adoption) finishes first
        await self._run(kernel_id, "resume", lambda: self._resume(kernel_id, reason, notify, restore))

    def cancel_wait(self, kernel_id: str) -> bool:
        """The user interrupted: stop waiting for a slice. True if a resume was waiting."""
        slot = self._slots.get(kernel_id)
        if slot is None or slot.operation != "resume" or slot.task is None or slot.task.done():
            return False
        slot.cancel_wait.set()
        self.waits.wake(kernel_id)
        return True

    def nudge(self) -> None:
        """Capacity may have come free (a slice was released): every waiter looks again now
        instead of at its next poll."""
        self.waits.nudge()

    async def stop_waiting(self, kernel_id: str) -> bool:
        """:meth:`cancel_wait`, then wait until the resume has given up (the kernel is hibernated
        again), so a caller answers with the settled state. True if a resume was waiting."""
        slot = self._slots.get(kernel_id)
        if not self.cancel_wait(kernel_id) or slot is None or slot.task is None:
            return False
        await asyncio.wait([slot.task])
        return True

    async def cancel(self, kernel_id: str) -> None:
        """Cancel the operation in flight (for a delete) and wait until it has cleaned up.

        A cancelled hibernation leaves the kernel running (its process untouched); a
        cancelled resume leaves it hibernated (the process it launched killed, the slice free).
        """
        slot = self._slots.get(kernel_id)
        if slot is None:
            return
        slot.removed = True
        task = slot.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    async def remove(self, kernel_id: str) -> None:
        """Forget a kernel for good: no process, no slice, no checkpoint, no record."""
        await self.cancel(kernel_id)
        slot = self._slot(kernel_id)
        slot.removed = True
        async with slot.lock:
            record = self.registry.get(kernel_id)
            await self.platform.kill(kernel_id)
            self.platform.release_slice(kernel_id)
            if record is not None:
                self.states.dead(record, "removed")
            await self.platform.discard_checkpoints(kernel_id)
            self.registry.remove(kernel_id)
        self._slots.pop(kernel_id, None)

    def forget(self, kernel_id: str) -> None:
        """Drop the bookkeeping of a kernel whose process is already gone (it was shut down)."""
        slot = self._slots.pop(kernel_id, None)
        if slot is not None and slot.task is not None and not slot.task.done():
            slot.task.cancel()

    def adopt_orphan(self, kernel_id: str, wait_for_exit: Callable[[], Awaitable[Committed | None]]) -> None:
        """A kernel left running by a previous server is checkpointing itself: wait for it.

        The kernel is ``hibernating`` until its process exits; then ``hibernated`` with the
        checkpoint it wrote, or removed if it never committed one. A resume waits for this.
        """
        record = self.registry.get(kernel_id)
        if record is None:
            return

        async def adopt() -> Committed | None:
            committed = await wait_for_exit()
            if committed is None:
                self._move(record, S.DEAD, "ended with the previous server before any checkpoint")
                self.registry.remove(kernel_id)
                return None
            record.committed = committed
            self._move(record, S.HIBERNATED, "recovered")
            return committed

        slot = self._slot(kernel_id)
        slot.operation = "adopt"
        slot.task = asyncio.ensure_future(adopt())

    async def checkpoint(self, kernel_id: str) -> Committed | None:
        """Checkpoint a running, idle kernel and leave it running (a background checkpoint).

        ``None`` when it is not running or is busy: a background checkpoint never waits for a
        cell, and never stands in the way of one (the kernel stays ``running`` throughout).
        """

        async def body() -> Committed | None:
            record = self._require(kernel_id)
            if record.state is not S.RUNNING:
                return None
            try:
                await self.platform.ensure_idle(kernel_id)
            except LifecycleError:
                return None
            committed = await self.platform.checkpoint(kernel_id)
            record.committed = committed
            return committed

        return await self._run(kernel_id, "checkpoint", body)

    async def lost(self, kernel_id: str, why: str, committed: Committed) -> Committed | None:
        """A running kernel vanished (its pod deleted, evicted, gone with its node): hibernate it.

        Nothing can be checkpointed any more, so it becomes ``hibernated`` with ``committed``, its
        last checkpoint, and the next resume restores that; whatever it did since is gone, which the
        caller tells the user. ``None`` if an operation of ours owned the kernel meanwhile.
        """

        async def body() -> Committed | None:
            record = self._require(kernel_id)
            if record.state is not S.RUNNING:
                return None
            self._move(record, S.HIBERNATING, f"lost: {why}")
            try:
                await self.platform.kill(kernel_id)  # whatever is left of it
            finally:
                self.platform.release_slice(kernel_id)
                record.committed = committed
                self._move(record, S.HIBERNATED, f"lost: {why}")
            return committed

        return await self._run(kernel_id, "lost", body)

    # -- the steps ---------------------------------------------------------------------------

    async def _run(
        self, kernel_id: str, operation: str, body: Callable[[], Awaitable[Committed | None]]
    ) -> Committed | None:
        if kernel_id not in self._slots:
            self._require(kernel_id)  # no bookkeeping for kernels that do not exist (or no longer do)
        slot = self._slot(kernel_id)
        async with slot.lock:
            if slot.removed:
                raise KernelRemoved(f"kernel {kernel_id} was deleted")
            slot.operation = operation
            slot.cancel_wait.clear()
            task: asyncio.Task[Committed | None] = asyncio.ensure_future(body())
            slot.task = task
            try:
                return await self._join(kernel_id, task)
            finally:
                if slot.task is task:
                    slot.operation = ""

    async def _join(self, kernel_id: str, task: asyncio.Task[Committed | None]) -> Committed | None:
        """Await ``task`` without letting a caller's own cancellation cancel it."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise KernelRemoved(
                    f"kernel {kernel_id} was deleted while this operation was in progress"
                ) from None
            raise

    async def _hibernate(self, kernel_id: str, reason: str) -> Committed | None:
        record = self._require(kernel_id)
        if record.state is S.HIBERNATED:
            return None
        if record.state is not S.RUNNING:
            raise LifecycleError(
                f"kernel {kernel_id} is {record.state.value}; only a running kernel can hibernate"
            )
        await self.platform.ensure_idle(kernel_id)
        if record.state is not S.RUNNING:  # it died (or was restarted) while we waited
            raise LifecycleError(
                f"kernel {kernel_id} is {record.state.value}; only a running kernel can hibernate"
            )
        started = time.time()
        self._move(record, S.HIBERNATING, reason)
        try:
            committed = await self.platform.checkpoint(kernel_id)
            if committed.created < started - 1:
                raise LifecycleError("the agent reported success but no new checkpoint was committed", 500)
        except asyncio.CancelledError:
            if record.state is S.HIBERNATING:
                self._move(record, S.RUNNING, "hibernation cancelled")
            raise
        except Exception as exc:
            message = exc.message if isinstance(exc, ElasticError) else f"{type(exc).__name__}: {exc}"
            if record.state is S.HIBERNATING:  # else the process died and was restarted meanwhile
                self._move(record, S.RUNNING, f"hibernation failed: {message}")
            record.last_error = message
            status = exc.status if isinstance(exc, LifecycleError) else 500
            raise HibernateFailed(message, status) from exc
        # The checkpoint is committed: only now may the process and the slice go.
        record.committed = committed
        try:
            await self.platform.stop(kernel_id)
        except BaseException:
            await self.platform.kill(kernel_id)  # committed already: nothing is lost by a kill
            raise
        finally:
            self.platform.release_slice(kernel_id)
            self._move(record, S.HIBERNATED, reason)
            record.last_error = ""
            self.nudge()
        return committed

    async def _resume(self, kernel_id: str, reason: str, notify: Notify | None, restore: bool) -> None:
        record = self._require(kernel_id)
        if record.state is S.RUNNING:
            return None
        if record.state is not S.HIBERNATED:
            raise LifecycleError(f"kernel {kernel_id} is {record.state.value}; nothing to resume")
        self._move(record, S.RESUMING, reason)
        launched = False
        try:
            await self._wait_for_slice(kernel_id, record, notify)
            record.waiting_for_slice = False
            committed = record.committed if restore else None
            if not restore:
                await self.platform.discard_checkpoints(kernel_id)
                record.committed = None
            timeout = restore_timeout(self.start_timeout, committed.size if committed else 0)
            launched = True
            await self.platform.launch(kernel_id, committed, timeout)
        except BaseException as exc:
            record.waiting_for_slice = False
            if launched:  # whatever it got to, no process may outlive a failed resume
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.platform.kill(kernel_id))
            self.platform.release_slice(kernel_id)
            message = exc.message if isinstance(exc, ElasticError) else f"{type(exc).__name__}: {exc}"
            self._move(record, S.HIBERNATED, f"resume failed: {message}")
            if isinstance(exc, LifecycleError | asyncio.CancelledError):
                raise
            raise LifecycleError(f"resume of kernel {kernel_id} failed: {message}", 500) from exc
        finally:
            self.queue.settle(kernel_id)
            self.nudge()
        self._move(record, S.RUNNING, reason)
        return None

    async def _wait_for_slice(self, kernel_id: str, record: ManagedKernel, notify: Notify | None) -> None:
        """Wait in the slice queue until it is this kernel's turn and its size fits (the cell is
        told once, with its place); an interrupt cancels."""
        if record.profile is None:
            return
        profile = self.profile(record.profile)
        slot = self._slot(kernel_id)
        if self.node_may_come is not None and self.node_may_come(profile):
            # Its pod waits Pending (the autoscaler sees it); kube-scheduler's order, not the queue's.
            message = (
                f"No node has a free GPU slice of size {profile.display_name}: this kernel's pod "
                "waits for the cluster to add a node (ElasticKernels.scale_up_wait), then resumes."
            )
            said = notify(message) if notify is not None else None
            if said is not None:
                await said
            return

        def told(place: int | None, why: str) -> Awaitable[None] | None:
            record.waiting_for_slice = True
            if notify is None:
                return None
            return notify(
                f"Waiting for a GPU slice of size {profile.display_name} to resume this kernel: {why} "
                f"It is number {place} in the queue. Interrupt the kernel to stop waiting."
            )

        try:
            await self.waits.wait(
                kernel_id,
                record.owner,
                profile,
                self.max_wait,
                "ElasticKernels.max_slice_wait",
                told,
                slot.cancel_wait,
            )
        except WaitTimedOut as exc:
            raise LifecycleError(f"Resume of kernel {kernel_id}: {exc.message}", 409) from None
        except CapacityError as exc:
            raise LifecycleError(exc.message) from None
        if slot.cancel_wait.is_set():
            raise WaitCancelled(f"resume of kernel {kernel_id} cancelled while waiting for a GPU slice")

    # -- helpers ---------------------------------------------------------------------------

    def _slot(self, kernel_id: str) -> _Slot:
        slot = self._slots.get(kernel_id)
        if slot is None:
            slot = self._slots[kernel_id] = _Slot()
        return slot

    def _require(self, kernel_id: str) -> ManagedKernel:
        record = self.registry.get(kernel_id)
        if record is None:
            raise LifecycleError(f"kernel {kernel_id} is not an elastic kernel", status=409)
        return record

    def _move(self, record: ManagedKernel, state: KernelState, reason: str) -> None:
        self.states.move(record, state, reason)
        self.platform.persist(record.kernel_id)
