"""Hibernate and resume: the service the server calls, around the lifecycle controller.

The *order* of things — checkpoint committed before the process stops, process gone before
the slice is released, one operation per kernel, a delete cancelling what is in flight —
lives in :class:`~kernelmgr.core.controller.LifecycleController`. This module supplies what
it needs from jupyter_server (:class:`~kernelmgr.lifecycle.platform.JupyterKernelPlatform`)
and the facade the rest of the server uses (:class:`Hibernator`: validation with clear
messages, admission, metrics, events, logs). Loss and recovery have their own modules.

Hibernating a kernel, in order and never otherwise:

1. refuse unless the kernel is an elastic kernel, running and idle (a busy kernel is never
   interrupted to be saved);
2. ask the in-kernel agent for a checkpoint (a *silent* execute request: no execution count,
   no output, no history, works with no browser connected) and wait for it to commit;
3. only then stop the kernel process and release its GPU slice;
4. record the kernel as hibernated, on disk, so it survives a server restart.

If step 2 fails the kernel keeps running with its slice (507 when the disk is full), and the
reason is recorded on the kernel. The kernel manager object stays registered in
jupyter_server the whole time, so the kernel id, its sessions and websockets stay valid.

Resuming reverses it: wait for a slice (telling the caller while it waits, cancellable),
start the process again under the same id with ``ELASTIC_RESTORE=1`` so the agent restores
the checkpoint before anything else runs, wait — as long as the checkpoint's size needs —
until it answers, and mark it running. A resume that fails, times out or is cancelled by a
delete stops the process it launched.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kernelmgr.activity.jupyter import JupyterActivity
from kernelmgr.core.controller import (
    Committed,
    HibernateFailed,
    LifecycleController,
    LifecycleError,
    Notify,
    WaitCancelled,
)
from kernelmgr.core.errors import UnknownProfileError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.lifecycle import metrics
from kernelmgr.lifecycle.events import LifecycleEvents
from kernelmgr.lifecycle.host import KernelHost
from kernelmgr.lifecycle.loss import KernelLoss, lost_note
from kernelmgr.lifecycle.metrics import ReleasedSliceSeconds, size_label
from kernelmgr.lifecycle.platform import JupyterKernelPlatform, disk_full, kill_pid
from kernelmgr.lifecycle.records import KernelRecord, KernelRecords, RecordStore
from kernelmgr.lifecycle.recovery import Recovery
from kernelmgr.lifecycle.scheduler import run_bounded
from kernelmgr.lifecycle.storage import CheckpointSpace, CheckpointSpaceRefused

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime

#: What a user's interrupt of a resume waiting for a slice raises.
ResumeCancelled = WaitCancelled

__all__ = ["Hibernator", "ResumeCancelled"]


class Hibernator:
    """Hibernates and resumes the kernels of one elastic kernel manager."""

    def __init__(
        self,
        mkm: KernelHost,
        runtime: ElasticRuntime,
        state_file: RecordStore,
        checkpoint_timeout: float = 600.0,
        start_timeout: float = 120.0,
        activity: JupyterActivity | None = None,
        events: LifecycleEvents | None = None,
    ) -> None:
        self.mkm = mkm
        self.runtime = runtime
        self.activity = activity or JupyterActivity(runtime.kernels)
        self.events = events or LifecycleEvents(None)
        self.released = ReleasedSliceSeconds(runtime.kernels)
        self.start_timeout = start_timeout
        self._pruning: set[asyncio.Future[Any]] = set()
        self.records = KernelRecords(
            state_file, runtime.kernels, mkm.log, self._cwd_of, definition_of=self._definition_of
        )
        #: The checkpoint quota and reserve (a shared gateway sets ``space.quota_of`` per user).
        self.space = CheckpointSpace(
            runtime.checkpoints, runtime.max_checkpoint_bytes, runtime.checkpoint_reserve
        )
        self.platform = JupyterKernelPlatform(
            mkm, runtime, self.records, self.activity, checkpoint_timeout, self.space
        )
        self.controller = LifecycleController(
            runtime.kernels,
            runtime.allocator,
            runtime.profile,
            self.platform,
            start_timeout=start_timeout,
            states=runtime.states,
            queue=runtime.slice_queue,
            max_wait=runtime.max_slice_wait,
            held=runtime.slices_held,
            node_may_come=runtime.waits_for_a_node,
        )
        self.loss = KernelLoss(
            mkm, runtime, self.controller, self.platform, self.records, self.events, self._pruning
        )
        self.recovery = Recovery(mkm, runtime, self.controller, self.records)
        #: Kernels that ran in pods when the previous server stopped, until adoption decides.
        self.deferred = self.recovery.deferred
        #: Entered before a hibernated kernel takes a GPU slice again: (owner, GPU size, kernel
        #: id) -> a context manager that holds the kernel's place in its owner's quota until the
        #: resume has ended, or raises LifecycleError (403) saying why not. Entered with no
        #: await before it, so resumes sent at once see each other (a shared gateway's quotas).
        self.admission: Callable[[str, str | None, str], contextlib.AbstractContextManager[Any]] | None = None
        #: With several gateways: raises LifecycleError (503) unless this one holds the Lease, asked
        #: before a hibernation or a resume touches a kernel (a fenced gateway leaves them alone).
        self.fence: Callable[[], None] | None = None
        #: Called with the kernel id when a resume has finished (once per resume): the
        #: websocket layer attaches the notebooks that were opened while it slept.
        self.on_resumed: list[Callable[[str], Any]] = []

    # -- queries -------------------------------------------------------------------------

    def state_of(self, kernel_id: str) -> KernelState | None:
        return self.controller.state_of(kernel_id)

    def is_going_to_sleep(self, kernel_id: str) -> bool:
        """Hibernating now, checkpointing itself while its pod is stopped, or lost and not yet
        taken over: a message sent to the kernel must wait, or the stop (or the loss) would lose it."""
        record = self.runtime.kernels.get(kernel_id)
        return record is not None and (record.state is KernelState.HIBERNATING or record.stopping is not None)

    def is_hibernated(self, kernel_id: str) -> bool:
        return self.state_of(kernel_id) in (KernelState.HIBERNATED, KernelState.RESUMING)

    def kernel_info(self, kernel_id: str) -> dict[str, Any]:
        record = self.records.get(kernel_id)
        return dict(record.kernel_info) if record else {}

    # -- hibernate -----------------------------------------------------------------------

    async def hibernate(self, kernel_id: str, reason: str = "api") -> None:
        """Checkpoint, stop, release; raises :class:`LifecycleError` saying why not."""
        if self.fence is not None:
            self.fence()
        if kernel_id not in self.mkm:
            raise LifecycleError(f"no kernel with id {kernel_id!r}", status=404)
        record = self.runtime.kernels.get(kernel_id)
        if record is None:
            spec = self.mkm.get_kernel(kernel_id).kernel_name
            raise LifecycleError(
                f"kernel {kernel_id} (kernelspec {spec!r}) is not an elastic kernel; only kernels started "
                "from a GPU-size kernelspec (metadata.elastic.profile) can hibernate"
            )
        if kernel_id in self.mkm.starting_kernels:
            raise LifecycleError(
                f"kernel {kernel_id} is still starting: it can hibernate once it has answered its server"
            )
        size = size_label(record.profile)
        started = time.time()
        try:
            committed = await self.controller.hibernate(kernel_id, reason)
        except HibernateFailed as exc:
            message = exc.message
            # Refused for want of room before anything was written: a warning, not an error.
            refused = exc.__cause__ if isinstance(exc.__cause__, CheckpointSpaceRefused) else None
            said = "not hibernated" if refused else "hibernation failed"
            log = self.mkm.log.warning if refused else self.mkm.log.error
            log("Kernel %s: %s, it keeps running: %s", kernel_id, said, message)
            metrics.HIBERNATION_FAILURES.labels(reason, size).inc()
            self.events.emit("hibernate_failed", kernel_id, f"{said}: {message}", reason=reason, size=size)
            if refused is not None:
                raise CheckpointSpaceRefused(
                    f"kernel {kernel_id} was not hibernated, it keeps running: {message}",
                    refused.status,
                    refused.limit,
                    refused.detail,
                ) from None
            status = 507 if disk_full(message) else exc.status
            raise LifecycleError(
                f"hibernation of kernel {kernel_id} failed, it keeps running: {message}", status
            ) from None
        if committed is None:
            return  # it was hibernated already
        self._prune_later(record.owner, kernel_id)
        self.runtime.checkpoints.forget_cached(record.owner, kernel_id)
        self.records.remember(
            kernel_id,
            pid=None,
            hibernated_at=time.time(),
            checkpoint_id=committed.checkpoint_id,
            kernel_info=record.kernel_info,
            execution_count=record.execution_count or self.activity.get(kernel_id).execution_count,
        )
        took = time.time() - started
        metrics.HIBERNATIONS.labels(reason, size).inc()
        metrics.HIBERNATE_SECONDS.labels(size).observe(took)
        metrics.CHECKPOINT_BYTES.labels(size).observe(committed.size)
        released, record.released = record.released, None
        if released is not None:
            self.released.hibernated(record, size, sum(p.fraction for p in released.placements))
        self.events.emit(
            "hibernate",
            kernel_id,
            f"kernel hibernated ({reason}) in {took:.2f}s",
            reason=reason,
            size=size,
            duration_seconds=took,
            checkpoint_bytes=committed.size,
        )
        self.mkm.log.info(
            "Kernel %s hibernated (%s): checkpoint %s, %s bytes in %.3fs, slice %s released",
            kernel_id,
            reason,
            committed.checkpoint_id,
            committed.size,
            took,
            released.device_uuids if released else "-",
        )

    async def hibernate_all(
        self, kernel_ids: list[str], limit: int, reason: str = "server shutdown"
    ) -> list[str]:
        """Hibernate ``kernel_ids``, at most ``limit`` at once; returns the ids hibernated.

        For a server stop: it takes about (kernels / limit) checkpoints instead of their sum,
        without writing every checkpoint at the same time. A kernel that cannot hibernate (busy,
        disk full) is logged and left out.
        """
        done: list[str] = []

        async def one(kernel_id: str) -> None:
            try:
                await self.hibernate(kernel_id, reason)
                done.append(kernel_id)
            except LifecycleError as exc:
                self.mkm.log.warning("Not hibernated at shutdown: %s", exc.message)

        await run_bounded(kernel_ids, one, limit, self.mkm.log, "hibernation at shutdown")
        return done

    def _prune_later(self, owner: str, kernel_id: str) -> None:
        """Delete the superseded checkpoint in a worker thread, off the hibernate path."""

        async def prune() -> None:
            try:
                await asyncio.to_thread(self.runtime.checkpoints.prune, owner, kernel_id)
            except Exception:
                self.mkm.log.warning("could not prune old checkpoints of %s", kernel_id, exc_info=True)

        task = asyncio.ensure_future(prune())
        self._pruning.add(task)  # a strong reference until done: the loop keeps only weak ones
        task.add_done_callback(self._pruning.discard)

    # -- background checkpoints ------------------------------------------------------------

    async def checkpoint(self, kernel_id: str) -> Committed | None:
        """Checkpoint a running kernel in the background (it keeps running): what a lost pod
        resumes from. ``None`` when it was busy or not running; raises nothing for a failure,
        which is logged (the next one tries again)."""
        record = self.runtime.kernels.get(kernel_id)
        if record is None:
            return None
        try:
            committed = await self.controller.checkpoint(kernel_id)
        except LifecycleError as exc:
            self.mkm.log.warning("Background checkpoint of kernel %s failed: %s", kernel_id, exc.message)
            return None
        if committed is None:
            return None
        self.runtime.checkpoints.forget_cached(record.owner, kernel_id)
        self._prune_later(record.owner, kernel_id)
        self.records.remember(kernel_id, checkpoint_id=committed.checkpoint_id)
        metrics.BACKGROUND_CHECKPOINTS.labels(size_label(record.profile)).inc()
        self.mkm.log.info(
            "Kernel %s checkpointed in the background: %s, %d bytes",
            kernel_id,
            committed.checkpoint_id,
            committed.size,
        )
        return committed

    # -- resume --------------------------------------------------------------------------

    async def resume(
        self, kernel_id: str, reason: str = "api", notify: Notify | None = None, restore: bool = True
    ) -> None:
        """Bring a hibernated kernel back; concurrent callers share one resume.

        ``restore=False`` starts it empty (a restart of a hibernated kernel) and drops the checkpoint.
        A kernel whose pod is being stopped is resumed once the server has taken it over.
        """
        if self.fence is not None:
            self.fence()
        managed = self.runtime.kernels.get(kernel_id)
        stopping = managed.stopping if managed is not None else None
        if stopping is not None:
            try:
                await asyncio.wait_for(asyncio.shield(stopping), self.start_timeout)
            except TimeoutError:
                raise LifecycleError(
                    f"kernel {kernel_id}: its pod is still stopping after {self.start_timeout:g}s", 504
                ) from None
        state = self.state_of(kernel_id)
        if state is KernelState.RUNNING and not self.controller.in_flight(kernel_id):
            return
        if state is None:
            if kernel_id not in self.mkm:
                raise LifecycleError(f"no kernel with id {kernel_id!r}", status=404)
            raise LifecycleError(f"kernel {kernel_id} is not elastic; nothing to resume")
        if state in (KernelState.STARTING, KernelState.DEAD):
            raise LifecycleError(f"kernel {kernel_id} is {state.value}; nothing to resume")
        record = self.runtime.kernels.get(kernel_id)
        admitted = contextlib.ExitStack()
        if self.admission is not None and record is not None:  # hibernated, hibernating or resuming
            admitted.enter_context(self.admission(record.owner, record.profile, kernel_id))
        km: Any = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
        began = time.time()
        lost = record.loss if record is not None else None
        with admitted:  # the quota place is held until the resume has ended, either way
            if lost is not None and restore and record is not None:
                await self.loss.take_newer_checkpoint(kernel_id, record, lost)
            try:
                await self.controller.resume(kernel_id, reason, notify, restore)
            except Exception:  # failed or timed out (a cancelled resume is no failure)
                size = metrics.size_label(record.profile if record is not None else None)
                metrics.RESUME_FAILURES.labels(size).inc()
                raise
        if record is None or km is None:
            return
        if lost is not None and record.loss is lost and notify is not None:
            record.loss = None
            told = notify(lost_note(lost.why, lost.committed, lost.stop_began))
            if told is not None:
                await told
        if self.records.get(kernel_id) is not None and self.records[kernel_id].hibernated_at is None:
            return  # another caller's resume did the bookkeeping
        self.records.remember(kernel_id, pid=self.platform.pid_of(km), hibernated_at=None)
        # Waking up is activity: the idle clock starts again from now.
        self.activity.restarted(kernel_id)
        self.activity.get(kernel_id).last_execution_end = time.time()
        size = size_label(record.profile)
        took = time.time() - began
        metrics.RESUMES.labels(reason, size).inc()
        metrics.RESUME_SECONDS.labels(size).observe(took)
        metrics.RESUME_PATH_SECONDS.labels(size, record.launch_path).observe(took)
        self.released.woke(record)
        self.events.emit(
            "resume",
            kernel_id,
            f"kernel resumed ({reason}) in {took:.2f}s",
            reason=reason,
            size=size,
            duration_seconds=took,
        )
        self.mkm.log.info("Kernel %s resumed (%s) in %.2fs", kernel_id, reason, took)
        for hook in self.on_resumed:
            try:
                hook(kernel_id)
            except Exception:  # a hook must not turn a finished resume into a failed one
                self.mkm.log.exception("on_resumed hook failed for kernel %s", kernel_id)

    def cancel_resume(self, kernel_id: str) -> bool:
        """Stop waiting for a slice (the user interrupted). True if a wait was cancelled."""
        return self.controller.cancel_wait(kernel_id)

    async def stop_waiting(self, kernel_id: str) -> bool:
        """Stop a resume waiting for a slice and wait until the kernel is hibernated again."""
        return await self.controller.stop_waiting(kernel_id)

    async def cancel_operations(self, kernel_id: str) -> None:
        """Cancel a hibernation or resume in flight (the kernel is being deleted)."""
        await self.controller.cancel(kernel_id)

    # -- persistence ---------------------------------------------------------------------

    def track(self, kernel_id: str) -> None:
        """Persist a newly started elastic kernel (so a crashed server can find its checkpoint)."""
        km = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
        self.records.remember(kernel_id, pid=self.platform.pid_of(km) if km is not None else None)

    def recover(self) -> list[str]:
        """Re-list the kernels the previous server run left (see :class:`Recovery`)."""
        return self.recovery.recover()

    def recover_lost(self, record: KernelRecord, why: str) -> bool:
        """A kernel whose pod ended while no server ran: hibernated from its last checkpoint."""
        return self.recovery.recover_lost(record, why)

    def _definition_of(self, name: str) -> dict[str, Any] | None:
        try:
            return self.runtime.profile(name).to_dict()
        except UnknownProfileError:
            return None

    def _cwd_of(self, kernel_id: str) -> str | None:
        km = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
        return (getattr(km, "_launch_args", {}) or {}).get("cwd") if km is not None else None

    async def forget(self, kernel_id: str) -> None:
        """The kernel was shut down for good: drop its record, its operation slot and checkpoints.

        Every per-kernel fact is on the record (activity, culler state, GPU sample, released
        slice), so removing it forgets them (tests/test_forget_leaves_nothing.py). The files go in a
        worker thread (a GiB takes a while), but before this returns: a delete that answered 204
        has left nothing behind.
        """
        self.controller.forget(kernel_id)
        self.loss.stopped(kernel_id)
        managed = self.runtime.kernels.get(kernel_id)
        if managed is not None:
            self.released.woke(managed)  # its released seconds so far stay counted
            if managed.orphan_pid is not None:
                kill_pid(managed.orphan_pid)
        record = self.records.pop(kernel_id, None)
        managed = self.runtime.kernels.remove(kernel_id)
        owner = record.owner if record else managed.owner if managed else None
        self.records.save()
        if owner is not None:
            try:
                await asyncio.to_thread(self.runtime.checkpoints.remove, owner, kernel_id)
            except Exception:
                self.mkm.log.warning("could not remove the checkpoints of %s", kernel_id, exc_info=True)

    async def drain(self) -> None:
        """Wait for background removals and prunes, and write the registry (server exit)."""
        if self._pruning:
            await asyncio.wait(list(self._pruning), timeout=30)
        await asyncio.to_thread(self.records.writer.flush)
