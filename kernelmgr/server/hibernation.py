"""Hibernate and resume: the orchestration around the in-kernel checkpoint agent.

Hibernating a kernel is, in order and never otherwise:

1. refuse unless the kernel is an elastic kernel, running and idle (a busy kernel is never
   interrupted to be saved);
2. ask the in-kernel agent for a checkpoint (a *silent* execute request: no execution count,
   no output, no history, works with no browser connected) and wait for it to commit;
3. only then stop the kernel process and release its GPU slice;
4. record the kernel as hibernated, on disk, so it survives a server restart.

If step 2 fails the kernel keeps running with its slice, and the reason is recorded on the
kernel. The kernel manager object stays registered in jupyter_server the whole time, so the
kernel id, its sessions and its websocket connections stay valid.

Resuming reverses it: wait for a slice of the kernel's size (telling the caller while it
waits, cancellable), start the kernel process again under the same id and connection with
``ELASTIC_RESTORE=1`` so the agent restores the checkpoint before anything else runs, wait
until it answers, and mark it running.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from jupyter_core.utils import ensure_async

from kernelmgr.activity.jupyter import JupyterActivity
from kernelmgr.checkpoint.agent import CHECKPOINT_CODE
from kernelmgr.core.errors import CapacityError, ElasticError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.server import metrics
from kernelmgr.server.events import LifecycleEvents
from kernelmgr.server.metrics import ReleasedSliceSeconds, size_label
from kernelmgr.server.persistence import KernelRecord, KernelStateFile

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime
    from kernelmgr.server.kernelmanager import ElasticMappingKernelManager


Notify = Callable[[str], Awaitable[None] | None]

#: How long a hibernation request waits for a kernel reported busy to report idle.
BUSY_GRACE_SECONDS = 1.0


class HibernationError(ElasticError):
    """Hibernation or resume was refused or failed; ``status`` is the HTTP status to use."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class ResumeCancelled(HibernationError):
    """The user interrupted while the kernel waited for a GPU slice."""


class Hibernator:
    """Hibernates and resumes the kernels of one elastic kernel manager."""

    def __init__(
        self,
        mkm: ElasticMappingKernelManager,
        runtime: ElasticRuntime,
        state_file: KernelStateFile,
        checkpoint_timeout: float = 600.0,
        start_timeout: float = 120.0,
        activity: JupyterActivity | None = None,
        events: LifecycleEvents | None = None,
    ) -> None:
        self.mkm = mkm
        self.runtime = runtime
        self.state_file = state_file
        self.activity = activity or JupyterActivity()
        self.events = events or LifecycleEvents(None)
        self.released = ReleasedSliceSeconds()
        self.checkpoint_timeout = checkpoint_timeout
        self.start_timeout = start_timeout
        self._locks: dict[str, asyncio.Lock] = {}
        self._pruning: set[asyncio.Future[None]] = set()
        self._resumes: dict[str, asyncio.Task[None]] = {}
        self._cancel: dict[str, asyncio.Event] = {}
        self.records: dict[str, KernelRecord] = {}

    # -- queries -------------------------------------------------------------------------

    def state_of(self, kernel_id: str) -> KernelState | None:
        record = self.runtime.kernels.get(kernel_id)
        return record.state if record else None

    def is_going_to_sleep(self, kernel_id: str) -> bool:
        """Hibernating now: a message sent to the kernel must wait, or the stop would lose it."""
        return self.state_of(kernel_id) is KernelState.HIBERNATING

    def is_hibernated(self, kernel_id: str) -> bool:
        return self.state_of(kernel_id) in (KernelState.HIBERNATED, KernelState.RESUMING)

    def kernel_info(self, kernel_id: str) -> dict[str, Any]:
        record = self.records.get(kernel_id)
        return dict(record.kernel_info) if record else {}

    # -- hibernate -----------------------------------------------------------------------

    async def hibernate(self, kernel_id: str, reason: str = "api") -> None:
        """Checkpoint, stop, release; raises :class:`HibernationError` saying why not."""
        lock = self._locks.setdefault(kernel_id, asyncio.Lock())
        async with lock:
            await self._hibernate_locked(kernel_id, reason)

    async def _hibernate_locked(self, kernel_id: str, reason: str) -> None:
        if kernel_id not in self.mkm:
            raise HibernationError(f"no kernel with id {kernel_id!r}", status=404)
        record = self.runtime.kernels.get(kernel_id)
        if record is None:
            spec = self.mkm.get_kernel(kernel_id).kernel_name
            raise HibernationError(
                f"kernel {kernel_id} (kernelspec {spec!r}) is not an elastic kernel; only kernels started "
                "from a GPU-size kernelspec (metadata.elastic.profile) can hibernate"
            )
        if record.state is KernelState.HIBERNATED:
            return
        if record.state is not KernelState.RUNNING:
            raise HibernationError(
                f"kernel {kernel_id} is {record.state.value}; only a running kernel can hibernate"
            )
        km: Any = self.mkm.get_kernel(kernel_id)
        # The server learns "idle" from its own IOPub subscription, which can trail the
        # notebook's by a few milliseconds: give a cell that just finished a moment.
        deadline = time.monotonic() + BUSY_GRACE_SECONDS
        while getattr(km, "execution_state", "unknown") == "busy" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        execution_state = getattr(km, "execution_state", "unknown")
        if execution_state != "idle":
            raise HibernationError(
                f"kernel {kernel_id} is {execution_state}: it can hibernate once the running cell finishes "
                "(or after you interrupt it)"
            )

        started = time.time()
        record.lifecycle.move(KernelState.HIBERNATING, reason)
        self._remember(kernel_id, pid=self._pid(km))
        try:
            kernel_info = await self._checkpoint(km)
            manifest = self.runtime.checkpoints.latest(record.owner, kernel_id)
            if manifest is None or manifest.created < started - 1:
                raise HibernationError("the agent reported success but no new checkpoint was committed", 500)
        except Exception as exc:
            message = exc.message if isinstance(exc, ElasticError) else f"{type(exc).__name__}: {exc}"
            if record.state is KernelState.HIBERNATING:  # else the process died and was restarted
                record.lifecycle.move(KernelState.RUNNING, f"hibernation failed: {message}")
            record.last_error = message
            self._remember(kernel_id)
            self.mkm.log.error("Hibernation of kernel %s failed; it keeps running: %s", kernel_id, message)
            metrics.HIBERNATION_FAILURES.labels(reason, size_label(record.profile)).inc()
            self.events.emit(
                "hibernate_failed",
                kernel_id,
                f"hibernation failed: {message}",
                reason=reason,
                size=size_label(record.profile),
            )
            status = exc.status if isinstance(exc, HibernationError) else 500
            if "No space left on device" in message or "no space left" in message.lower():
                status = 507
            raise HibernationError(
                f"hibernation of kernel {kernel_id} failed, it keeps running: {message}", status
            ) from None

        # The checkpoint is committed: only now may the process and the slice go.
        checkpointed = time.time()
        await self._stop_process(km)
        stopped = time.time()
        self._prune_later(record.owner, kernel_id)
        released = self.runtime.allocator.release(kernel_id)
        record.lifecycle.move(KernelState.HIBERNATED, reason)
        record.last_error = ""
        km.execution_state = "hibernated"
        self._remember(
            kernel_id,
            pid=None,
            hibernated_at=time.time(),
            checkpoint_id=manifest.checkpoint_id,
            kernel_info=kernel_info,
            execution_count=self.activity.get(kernel_id).execution_count,
        )
        size = size_label(record.profile)
        took = time.time() - started
        checkpoint_bytes = int(manifest.summary().get("bytes") or 0)
        metrics.HIBERNATIONS.labels(reason, size).inc()
        metrics.HIBERNATE_SECONDS.labels(size).observe(took)
        metrics.CHECKPOINT_BYTES.labels(size).observe(checkpoint_bytes)
        if released is not None:
            self.released.hibernated(kernel_id, size, sum(p.fraction for p in released.placements))
        self.events.emit(
            "hibernate",
            kernel_id,
            f"kernel hibernated ({reason}) in {took:.2f}s",
            reason=reason,
            size=size,
            duration_seconds=took,
            checkpoint_bytes=checkpoint_bytes,
        )
        self.mkm.log.info(
            "Kernel %s hibernated (%s): checkpoint %s, %s bytes in %.3fs, process stopped in %.3fs, "
            "slice %s released",
            kernel_id,
            reason,
            manifest.checkpoint_id,
            manifest.summary().get("bytes"),
            checkpointed - started,
            stopped - checkpointed,
            released.device_uuids if released else "-",
        )

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

    @staticmethod
    async def _stop_process(km: Any) -> None:
        """Stop the kernel gracefully (its atexit handlers flush the user's files), keeping
        its id, ports and connection file for the resume.

        The same steps as ``shutdown_kernel(restart=True)`` minus the interrupt (the kernel
        is idle) and with a 10 ms poll instead of 100 ms: a stop is on the hibernate path.
        """
        km.shutting_down = True
        km.stop_restarter()
        await km._async_request_shutdown(restart=True)
        await km._async_finish_shutdown(pollinterval=0.01, restart=True)
        await km._async_cleanup_resources(restart=True)

    async def _checkpoint(self, km: Any) -> dict[str, Any]:
        """Run the agent's checkpoint through a private client; returns the kernel_info content."""
        client = km.client()
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        pid = self._pid(km)
        try:
            info_id = client.kernel_info()
            info = await self._reply(client, info_id, 30, km, pid)
            msg_id = client.execute(CHECKPOINT_CODE, silent=True, store_history=False, allow_stdin=False)
            self.activity.internal(msg_id)  # the server's own request is not the user's activity
            reply = await self._reply(client, msg_id, self.checkpoint_timeout, km, pid)
        finally:
            client.stop_channels()
        content = reply["content"]
        if content.get("status") != "ok":
            raise HibernationError(
                f"{content.get('ename', 'Error')}: {content.get('evalue', '')}".strip(), 500
            )
        return dict(info["content"])

    async def _reply(
        self, client: Any, msg_id: str, timeout: float, km: Any, pid: int | None
    ) -> dict[str, Any]:
        """The shell reply to ``msg_id``; fails fast if the kernel process dies meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HibernationError(f"the kernel did not answer within {timeout:g}s", 504)
            try:
                msg: dict[str, Any] = await client.get_shell_msg(timeout=min(1.0, remaining))
            except Exception:  # queue.Empty from jupyter_client: no message this second
                if self._pid(km) != pid or not await ensure_async(km.is_alive()):
                    raise HibernationError(
                        "the kernel process died while writing its checkpoint; the previous checkpoint "
                        "(if any) is unchanged",
                        500,
                    ) from None
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg

    # -- resume --------------------------------------------------------------------------

    async def resume(
        self, kernel_id: str, reason: str = "api", notify: Notify | None = None, restore: bool = True
    ) -> None:
        """Bring a hibernated kernel back; concurrent callers share one resume.

        ``restore=False`` starts it empty (a restart of a hibernated kernel) and drops the checkpoint.
        """
        state = self.state_of(kernel_id)
        if state is KernelState.HIBERNATING:
            async with self._locks.setdefault(kernel_id, asyncio.Lock()):
                pass  # let the hibernation finish (or fail), then look again
            state = self.state_of(kernel_id)
        if state is KernelState.RUNNING:
            return
        if state not in (KernelState.HIBERNATED, KernelState.RESUMING):
            if kernel_id not in self.mkm:
                raise HibernationError(f"no kernel with id {kernel_id!r}", status=404)
            raise HibernationError(
                f"kernel {kernel_id} is {state.value if state else 'not elastic'}; nothing to resume"
            )
        task = self._resumes.get(kernel_id)
        if task is None or task.done():
            task = asyncio.ensure_future(self._resume(kernel_id, reason, notify, restore))
            self._resumes[kernel_id] = task
        await asyncio.shield(task)

    def cancel_resume(self, kernel_id: str) -> bool:
        """Stop waiting for a slice (the user interrupted). True if a wait was cancelled."""
        event = self._cancel.get(kernel_id)
        if event is None:
            return False
        event.set()
        return True

    async def _resume(self, kernel_id: str, reason: str, notify: Notify | None, restore: bool) -> None:
        began = time.time()
        lock = self._locks.setdefault(kernel_id, asyncio.Lock())
        async with lock:
            record = self.runtime.kernels.get(kernel_id)
            if record is None or record.state is KernelState.RUNNING:
                return
            record.lifecycle.move(KernelState.RESUMING, reason)
            self._remember(kernel_id)
            km: Any = self.mkm.get_kernel(kernel_id)
            cancel = self._cancel.setdefault(kernel_id, asyncio.Event())
            cancel.clear()
            try:
                await self._wait_for_slice(kernel_id, record.profile, notify, cancel)
                record.restore_on_start = restore
                record.restore_checkpoint = self._verified_checkpoint(kernel_id) if restore else None
                if not restore:
                    self.runtime.checkpoints.remove(record.owner, kernel_id)
                await self._start(km, kernel_id if restore else None)
            except BaseException as exc:
                record.restore_on_start = False
                record.restore_checkpoint = None
                self.runtime.allocator.release(kernel_id)
                record.lifecycle.move(KernelState.HIBERNATED, f"resume failed: {exc}")
                km.execution_state = "hibernated"
                self._remember(kernel_id)
                if isinstance(exc, HibernationError | asyncio.CancelledError):
                    raise
                raise HibernationError(f"resume of kernel {kernel_id} failed: {exc}", 500) from exc
            finally:
                self._cancel.pop(kernel_id, None)
            record.lifecycle.move(KernelState.RUNNING, reason)
            km.execution_state = "idle"
            self._remember(kernel_id, pid=self._pid(km), hibernated_at=None)
            # Waking up is activity: the idle clock starts again from now.
            self.activity.restarted(kernel_id)
            self.activity.get(kernel_id).last_execution_end = time.time()
            size = size_label(record.profile)
            took = time.time() - began
            metrics.RESUMES.labels(reason, size).inc()
            metrics.RESUME_SECONDS.labels(size).observe(took)
            self.released.woke(kernel_id)
            self.events.emit(
                "resume",
                kernel_id,
                f"kernel resumed ({reason}) in {took:.2f}s",
                reason=reason,
                size=size,
                duration_seconds=took,
            )
            self.mkm.log.info("Kernel %s resumed (%s) in %.2fs", kernel_id, reason, took)

    async def _wait_for_slice(
        self, kernel_id: str, profile_name: str | None, notify: Notify | None, cancel: asyncio.Event
    ) -> None:
        if profile_name is None:
            return
        profile = self.runtime.profile(profile_name)
        told = False
        while True:
            try:
                self.runtime.allocator.check(profile)
                return
            except CapacityError as exc:
                if not self.runtime.allocator.ever_fits(profile):
                    raise HibernationError(exc.message) from None
                if not told and notify is not None:
                    told = True
                    waiting = notify(
                        f"Waiting for a GPU slice of size {profile.display_name} to resume this kernel: "
                        f"{exc.message} Interrupt the kernel to stop waiting."
                    )
                    if waiting is not None:
                        await waiting
            try:
                await asyncio.wait_for(cancel.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                continue
            raise ResumeCancelled(f"resume of kernel {kernel_id} cancelled while waiting for a GPU slice")

    async def _start(self, km: Any, continue_count_of: str | None) -> None:
        launch_args = dict(getattr(km, "_launch_args", {}) or {})
        while True:
            try:
                await km.start_kernel(**launch_args)
                break
            except CapacityError:  # lost the slice to another start after the check
                await asyncio.sleep(0.5)
        client = km.client()
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        try:
            # One kernel_info round trip proves the kernel serves requests (the agent has
            # restored by then: it runs at extension load, before the first request).
            await self._reply(client, client.kernel_info(), self.start_timeout, km, self._pid(km))
            record = self.records.get(continue_count_of) if continue_count_of else None
            if record is not None and record.execution_count > 0:
                # The notebook's cell numbers go on where they stopped (silently: no output).
                code = f"get_ipython().execution_count = {record.execution_count + 1}"
                msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False)
                self.activity.internal(msg_id)
                await self._reply(client, msg_id, self.start_timeout, km, self._pid(km))
                self.activity.get(record.kernel_id).execution_count = record.execution_count
        finally:
            client.stop_channels()

    # -- persistence ---------------------------------------------------------------------

    def track(self, kernel_id: str) -> None:
        """Persist a newly started elastic kernel (so a crashed server can find its checkpoint)."""
        km = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
        self._remember(kernel_id, pid=self._pid(km) if km is not None else None)

    def recover(self) -> list[str]:
        """Re-register the kernels a previous server run left hibernated (or hibernating).

        A kernel whose record says it was running or hibernating when the server stopped is
        adopted only if it has a committed checkpoint (its agent checkpoints itself when the
        server disappears); otherwise it is gone, which is logged, and its record dropped.
        Runs once at server start, before requests are served (so no session is dropped for
        a kernel not yet re-registered); it blocks only while orphaned kernels finish.
        Returns the ids adopted.
        """
        try:
            previous = self.state_file.load()
        except ValueError as exc:
            self.mkm.log.error("%s", exc)
            return []
        adopted: list[str] = []
        for kernel_id, record in previous.items():
            if record.pid is not None and record.state != KernelState.HIBERNATED.value:
                self._wait_for_exit(record.pid)
            try:
                manifest = self.runtime.checkpoints.latest(record.owner, kernel_id)
            except Exception as exc:  # refused (integrity) or unreadable: kept aside by the store
                self.mkm.log.error("Kernel %s cannot be recovered: %s", kernel_id, exc)
                manifest = None
            if manifest is None:
                self.mkm.log.warning(
                    "Kernel %s (%s) ended with the previous server before any checkpoint; it is gone",
                    kernel_id,
                    record.state,
                )
                continue
            if record.profile is not None and record.profile not in self.runtime.profiles:
                self.mkm.log.error(
                    "Kernel %s was hibernated with GPU size %r, which is no longer configured; "
                    "its checkpoint is kept on disk but the kernel is not listed",
                    kernel_id,
                    record.profile,
                )
                continue
            if record.state != KernelState.HIBERNATED.value or record.checkpoint_id is None:
                # A kernel the server had not stopped may have checkpointed itself since: take the
                # committed one. A hibernated kernel keeps the id verified when it hibernated, so an
                # older checkpoint put back while the server was down is refused on resume.
                record.checkpoint_id = manifest.checkpoint_id
            record.state = KernelState.HIBERNATED.value
            record.pid = None
            self.mkm.adopt_hibernated(record)
            self.records[kernel_id] = record
            adopted.append(kernel_id)
        self.state_file.save(self.records)
        if adopted:
            self.mkm.log.info("Recovered %d hibernated kernel(s): %s", len(adopted), ", ".join(adopted))
        return adopted

    @staticmethod
    def _wait_for_exit(pid: int, timeout: float = 60.0) -> None:
        """Give an orphaned kernel time to finish checkpointing itself and exit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                return  # not ours (pid reused by another user's process)
            if _is_zombie(pid):
                return
            time.sleep(0.2)

    def _verified_checkpoint(self, kernel_id: str) -> str | None:
        """The checkpoint id verified when ``kernel_id`` hibernated (or was recovered)."""
        record = self.records.get(kernel_id)
        return record.checkpoint_id if record is not None else None

    @staticmethod
    def _pid(km: Any) -> int | None:
        process = getattr(getattr(km, "provisioner", None), "process", None)
        return getattr(process, "pid", None)

    def _remember(self, kernel_id: str, **changes: Any) -> None:
        """Update the on-disk record of ``kernel_id`` from the registry (plus ``changes``)."""
        managed = self.runtime.kernels.get(kernel_id)
        if managed is None:
            return
        record = self.records.get(kernel_id)
        if record is None:
            km = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
            cwd = (getattr(km, "_launch_args", {}) or {}).get("cwd") if km is not None else None
            record = KernelRecord(
                kernel_id=kernel_id,
                kernelspec=managed.kernelspec,
                profile=managed.profile,
                owner=managed.owner,
                state=managed.state.value,
                cwd=cwd,
            )
            self.records[kernel_id] = record
        record.state = managed.state.value
        record.reason = managed.lifecycle.reason
        for key, value in changes.items():
            setattr(record, key, value)
        self.state_file.save(self.records)

    def forget(self, kernel_id: str) -> None:
        """The kernel was shut down for good: drop its record and its checkpoints."""
        self.released.woke(kernel_id)
        self.activity.forget(kernel_id)
        record = self.records.pop(kernel_id, None)
        managed = self.runtime.kernels.remove(kernel_id)
        owner = record.owner if record else managed.owner if managed else None
        self.state_file.save(self.records)
        if owner is not None:
            self.runtime.checkpoints.remove(owner, kernel_id)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
