"""Hibernate and resume in jupyter_server: the adapter around the lifecycle controller.

The *order* of things — checkpoint committed before the process stops, process gone before
the slice is released, one operation per kernel, a delete cancelling what is in flight —
lives in :class:`~kernelmgr.core.controller.LifecycleController`. This module supplies what
it needs from jupyter_server (:class:`JupyterKernelPlatform`: talk to the in-kernel agent
through a private client, stop and start the same ``KernelManager`` under the same id and
connection, release the slice, persist the registry) and the facade the rest of the server
uses (:class:`Hibernator`: validation with clear messages, metrics, events, logs).

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
import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jupyter_core.utils import ensure_async

from kernelmgr.activity.jupyter import JupyterActivity
from kernelmgr.checkpoint.agent import CHECKPOINT_CODE
from kernelmgr.core.controller import (
    Committed,
    HibernateFailed,
    LifecycleController,
    LifecycleError,
    Notify,
    WaitCancelled,
)
from kernelmgr.core.errors import CapacityError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.server import metrics
from kernelmgr.server.events import LifecycleEvents
from kernelmgr.server.metrics import ReleasedSliceSeconds, size_label
from kernelmgr.server.persistence import KernelRecord, KernelStateFile, WriteBehind
from kernelmgr.server.starting import BIND_ERROR, BIND_RETRIES, check_agent, stderr_tail

#: The pod provisioner's entry-point name (kernels in pods can outlive the server).
KUBERNETES_PROVISIONER = "elastic-kubernetes-provisioner"

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime
    from kernelmgr.core.allocator import Slice
    from kernelmgr.core.kernels import ManagedKernel
    from kernelmgr.server.kernelmanager import ElasticMappingKernelManager

#: How long a hibernation request waits for a kernel reported busy to report idle.
BUSY_GRACE_SECONDS = 1.0
#: How long a kernel that looks "starting" gets to answer kernel_info before a hibernation is refused.
STARTING_PROBE_SECONDS = 5.0

#: The names the rest of the server (handlers, culler, websocket) catches.
HibernationError = LifecycleError


class KernelDied(LifecycleError):
    """The kernel process ended while the server waited for its reply."""


ResumeCancelled = WaitCancelled

__all__ = ["HibernationError", "Hibernator", "JupyterKernelPlatform", "ResumeCancelled"]


def committed_of(manifest: Any) -> Committed:
    """What the controller knows of a committed checkpoint (id, time, size) from its manifest."""
    return Committed(manifest.checkpoint_id, manifest.created, int(manifest.summary().get("bytes") or 0))


def saved_at_stop(committed: Committed, stop_began: float | None) -> bool:
    """Whether ``committed`` was written after the kernel was told to stop (at its SIGTERM)."""
    return stop_began is not None and committed.created >= stop_began


def lost_note(why: str, committed: Committed, stop_began: float | None = None) -> str:
    """What the notebook is told when a lost kernel resumes: why, and from when its state is.

    ``stop_began``: when Kubernetes began stopping the pod, if it did (not a node that vanished);
    ``0.0`` from the local provisioner, whose kernel's exit status says it checkpointed at SIGTERM.
    A checkpoint committed since is the one the kernel wrote at SIGTERM, after its last cell
    finished, so nothing that ran is missing. (The two times come from different clocks, the
    API server's and the kernel's; a skew of more than the time between a kernel's last
    checkpoint and its pod's deletion would misname one, which synchronised clocks do not have.)
    """
    taken = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(committed.created))
    if saved_at_stop(committed, stop_began):
        return (
            f"This kernel was stopped ({why}). The kernel checkpointed itself first ({taken}) "
            "and was restored from that checkpoint: every cell that had finished is in it."
        )
    return (
        f"This kernel was lost ({why}). It was restored from its checkpoint of {taken}; "
        "whatever ran after that is not in it."
    )


@dataclass
class LostKernel:
    """A kernel hibernated because its pod vanished: why, from which checkpoint, and when
    Kubernetes began stopping it (``None`` when it did not: a node that vanished)."""

    why: str
    committed: Committed
    stop_began: float | None = None


def _disk_full(message: str) -> bool:
    return "no space left" in message.lower()


class JupyterKernelPlatform:
    """:class:`~kernelmgr.core.controller.KernelPlatform` for jupyter_server's kernel managers.

    Works for whatever provisioner starts the process: it only uses the ``KernelManager``
    (start, stop, kill, a private client) and the runtime (allocator, checkpoint store).
    """

    def __init__(self, hibernator: Hibernator) -> None:
        self.h = hibernator
        #: Kernel ids → the kernel_info reply taken just before the checkpoint.
        self.kernel_info: dict[str, dict[str, Any]] = {}
        #: Kernel ids → the kernel's own cell number at the checkpoint. The IOPub activity
        #: watcher's count can lag: it reads a different socket than the user's websocket,
        #: so a hibernate sent right after a reply may arrive before its execute_input.
        self.execution_counts: dict[str, int] = {}
        #: Kernel ids → the slice given back by the last hibernation (for the metrics).
        self.released: dict[str, Slice] = {}
        #: Kernels a previous server left running (pid): they checkpoint themselves and exit.
        self.orphans: dict[str, int] = {}

    def _km(self, kernel_id: str) -> Any:
        return self.h.mkm.get_kernel(kernel_id) if kernel_id in self.h.mkm else None

    async def ensure_idle(self, kernel_id: str) -> None:
        km = self._km(kernel_id)
        # The server learns "idle" from its own IOPub subscription, which can trail the
        # notebook's by a few milliseconds: give a cell that just finished a moment.
        deadline = time.monotonic() + BUSY_GRACE_SECONDS
        while getattr(km, "execution_state", "unknown") == "busy" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        execution_state = getattr(km, "execution_state", "unknown")
        if execution_state == "starting":
            execution_state = await self._state_after_kernel_info(km)
        if execution_state == "starting":
            raise LifecycleError(f"kernel {kernel_id} is still starting: it can hibernate once it is up")
        if execution_state != "idle":
            raise LifecycleError(
                f"kernel {kernel_id} is {execution_state}: it can hibernate once the running cell finishes "
                "(or after you interrupt it)"
            )

    async def _state_after_kernel_info(self, km: Any) -> str:
        """The state of a kernel jupyter_server still calls "starting", after asking it kernel_info.

        ipykernel publishes its first "idle" only around a request, so a kernel started through
        ``/api/kernels`` that no client has talked to stays "starting" however long it has been up,
        and neither a user nor the culler could hibernate it. A kernel_info round trip makes it
        publish busy/idle, which the server's own IOPub watcher records.
        """
        client = km.client()
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        deadline = time.monotonic() + STARTING_PROBE_SECONDS
        try:
            # Asked again while no status arrives: a kernel that has only just started may publish
            # before the server's IOPub subscription is joined (ZeroMQ drops those messages).
            while getattr(km, "execution_state", "unknown") == "starting":
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await self.h._reply(client, client.kernel_info(), remaining, km, self.h._pid(km))
                seen_by = time.monotonic() + 0.25
                while getattr(km, "execution_state", "unknown") == "starting" and time.monotonic() < seen_by:
                    await asyncio.sleep(0.02)
        except HibernationError:  # not up yet (or gone): still starting, as far as anyone can tell
            return "starting"
        finally:
            client.stop_channels()
        return str(getattr(km, "execution_state", "unknown"))

    async def checkpoint(self, kernel_id: str) -> Committed:
        km = self._km(kernel_id)
        record = self.h.runtime.kernels.get(kernel_id)
        if km is None or record is None:
            raise LifecycleError(f"kernel {kernel_id} is gone", 404)
        if not getattr(km.provisioner, "checkpoints_persist", True):
            raise LifecycleError(
                f"kernel {kernel_id} runs in a pod whose checkpoints would die with it: set "
                "c.ElasticKubernetesProvisioner.checkpoint_claim to a PersistentVolumeClaim shared with "
                "this server (mounted at ElasticKernels.checkpoint_root)",
                409,
            )
        self.h._remember(kernel_id, pid=self.h._pid(km))
        try:
            self.kernel_info[kernel_id], self.execution_counts[kernel_id] = await self._run_checkpoint(km)
        except KernelDied:
            committed = await self._committed_by_the_kernel(record.owner, kernel_id)
            if committed is None:
                raise
            self.h.mkm.log.warning(
                "Kernel %s exited during its checkpoint after committing checkpoint %s itself "
                "(at SIGTERM, or its server watchdog's); taking that one",
                kernel_id,
                committed.checkpoint_id,
            )
            return committed
        except LifecycleError as exc:
            if _disk_full(exc.message):
                raise LifecycleError(exc.message, 507) from None
            raise
        collect = getattr(km.provisioner, "collect_checkpoint", None)
        if collect is not None:  # a Kubernetes warm pod keeps it in its emptyDir until taken
            try:
                await collect()
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise LifecycleError(f"the server's checkpoint volume is full: {exc}", 507) from None
                raise LifecycleError(f"the checkpoint could not be stored: {exc}", 500) from None
            except RuntimeError as exc:
                raise LifecycleError(str(exc), 500) from None
        manifest = await asyncio.to_thread(self.h.runtime.checkpoints.latest, record.owner, kernel_id)
        if manifest is None:
            raise LifecycleError("the agent reported success but no checkpoint was committed", 500)
        return committed_of(manifest)

    async def _committed_by_the_kernel(self, owner: str, kernel_id: str) -> Committed | None:
        """A checkpoint the kernel committed on its own before it exited, newer than any the server
        knew of; ``None`` if there is none.

        A kernel commits one on its own only when no cell is running (at SIGTERM, or when its
        watchdog thinks the server died) and exits right after, so that checkpoint holds every
        cell the kernel finished: the state a hibernation would have saved.
        """
        return await self.h.newer_checkpoint(owner, kernel_id, self.h.controller.committed.get(kernel_id))

    async def _run_checkpoint(self, km: Any) -> tuple[dict[str, Any], int]:
        """Run the agent's checkpoint through a private client.

        Returns the kernel_info content and the number of the last cell the user ran (a
        silent execute's reply carries it without counting itself).
        """
        client = km.client()
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        pid = self.h._pid(km)
        try:
            # Both requests at once: the kernel answers its shell requests in order, so the
            # checkpoint does not wait a round trip for the kernel_info reply.
            info_id = client.kernel_info()
            msg_id = client.execute(CHECKPOINT_CODE, silent=True, store_history=False, allow_stdin=False)
            self.h.activity.internal(msg_id)  # the server's own request is not the user's activity
            info = await self.h._reply(client, info_id, 30, km, pid)
            reply = await self.h._reply(client, msg_id, self.h.checkpoint_timeout, km, pid)
        finally:
            client.stop_channels()
        content = reply["content"]
        if content.get("status") != "ok":
            raise LifecycleError(f"{content.get('ename', 'Error')}: {content.get('evalue', '')}".strip(), 500)
        count = content.get("execution_count")
        return dict(info["content"]), count if isinstance(count, int) and count > 0 else 0

    async def stop(self, kernel_id: str) -> None:
        """Stop the kernel gracefully (its atexit handlers flush the user's files), keeping
        its id, ports and connection file for the resume.

        The same steps as ``shutdown_kernel(restart=True)`` minus the interrupt (the kernel
        is idle) and with a 10 ms poll instead of 100 ms: a stop is on the hibernate path.
        """
        await self._end_process(kernel_id, graceful=True)

    async def kill(self, kernel_id: str) -> None:
        orphan = self.orphans.pop(kernel_id, None)
        if orphan is not None:
            _kill_pid(orphan)
        await self._end_process(kernel_id, graceful=False)

    async def _end_process(self, kernel_id: str, graceful: bool) -> None:
        """Stop the process (asking it, or killing it), keeping id, ports and connection file."""
        km = self._km(kernel_id)
        if km is None or not km.has_kernel:
            return
        km.shutting_down = True
        km.stop_restarter()
        if graceful:
            await km._async_request_shutdown(restart=True)
        else:
            await km._async_kill_kernel(restart=True)
        await km._async_finish_shutdown(pollinterval=0.01, restart=True)
        await km._async_cleanup_resources(restart=True)

    async def launch(self, kernel_id: str, restore: Committed | None, timeout: float) -> None:
        km = self._km(kernel_id)
        record = self.h.runtime.kernels.get(kernel_id)
        if km is None or record is None:
            raise LifecycleError(f"kernel {kernel_id} is gone", 404)
        deadline = time.monotonic() + timeout
        relaunches = 0
        while True:
            await self._start_process(km, record, restore, deadline)
            try:
                await self._wait_ready(
                    km, kernel_id if restore else None, max(1.0, deadline - time.monotonic())
                )
                break
            except HibernationError:
                # A resume launches on the ports the kernel had before it slept: another process
                # may have taken one since. Relaunched (the provisioner then picks new ports),
                # with the same restore request, a bounded number of times (issue 34).
                if relaunches >= BIND_RETRIES or BIND_ERROR not in stderr_tail(km):
                    raise
                relaunches += 1
                self.h.mkm.log.warning(
                    "Kernel %s could not bind its port at its resume (taken while it slept): relaunching "
                    "it with new ports (%d/%d)",
                    kernel_id,
                    relaunches,
                    BIND_RETRIES,
                )
                await self._end_process(kernel_id, graceful=False)
        if relaunches:  # the server's own IOPub watcher still points at the old ports
            mkm: Any = self.h.mkm
            mkm.stop_watching_activity(kernel_id)
            mkm._kernel_ports[kernel_id] = km.ports
            mkm.start_watching_activity(kernel_id)
        collect = getattr(km.provisioner, "collect_restore_report", None)
        if restore is not None and collect is not None:
            try:
                await collect()
            except Exception as exc:
                self.h.mkm.log.warning("kernel %s: restore report not collected: %s", kernel_id, exc)

    async def _start_process(
        self, km: Any, record: ManagedKernel, restore: Committed | None, deadline: float
    ) -> None:
        """Start the kernel's process, asking it to restore ``restore`` (every launch must ask:
        the provisioner reads the request at launch, and it is cleared after)."""
        record.restore_on_start = restore is not None
        # The only checkpoint the kernel may restore: the one the server verified.
        record.restore_checkpoint = restore.checkpoint_id if restore is not None else None
        launch_args = dict(getattr(km, "_launch_args", {}) or {})
        try:
            while True:
                try:
                    await km.start_kernel(**launch_args)
                    break
                except CapacityError:  # lost the slice to another start after the check
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            record.restore_on_start = False
            record.restore_checkpoint = None

    async def _wait_ready(self, km: Any, continue_count_of: str | None, timeout: float) -> None:
        client = km.client()
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        try:
            # One kernel_info round trip proves the kernel serves requests (the agent has
            # restored by then: it runs at extension load, before the first request).
            info = await self.h._reply(
                client, client.kernel_info(), timeout, km, self.h._pid(km), launching=True
            )
            refusal = check_agent(
                self.h.mkm.log, str(getattr(km, "kernel_id", "")), dict(info.get("content") or {})
            )
            if refusal:
                raise HibernationError(refusal, 500)
            record = self.h.records.get(continue_count_of) if continue_count_of else None
            if record is not None and record.execution_count > 0:
                # The notebook's cell numbers go on where they stopped (silently: no output).
                code = f"get_ipython().execution_count = {record.execution_count + 1}"
                msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False)
                self.h.activity.internal(msg_id)
                await self.h._reply(client, msg_id, timeout, km, self.h._pid(km))
                self.h.activity.get(record.kernel_id).execution_count = record.execution_count
        finally:
            client.stop_channels()

    def release_slice(self, kernel_id: str) -> None:
        released = self.h.runtime.allocator.release(kernel_id)
        if released is not None:
            self.released[kernel_id] = released

    async def discard_checkpoints(self, kernel_id: str) -> None:
        record = self.h.runtime.kernels.get(kernel_id)
        kept = self.h.records.get(kernel_id)
        owner = record.owner if record else kept.owner if kept else None
        if owner is not None:
            await asyncio.to_thread(self.h.runtime.checkpoints.remove, owner, kernel_id)

    def persist(self, kernel_id: str) -> None:
        self.h._remember(kernel_id)


def _kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


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
        self.registry_writer = WriteBehind(state_file, mkm.log)
        self.activity = activity or JupyterActivity()
        self.events = events or LifecycleEvents(None)
        self.released = ReleasedSliceSeconds()
        self.checkpoint_timeout = checkpoint_timeout
        self.start_timeout = start_timeout
        self._pruning: set[asyncio.Future[None]] = set()
        self.records: dict[str, KernelRecord] = {}
        self.platform = JupyterKernelPlatform(self)
        self.controller = LifecycleController(
            runtime.kernels, runtime.allocator, runtime.profile, self.platform, start_timeout=start_timeout
        )
        #: Kernels lost with their pod -> why and when (told to the notebook when they resume).
        self.lost_kernels: dict[str, LostKernel] = {}
        #: Kernels that ran in pods when the previous server stopped, until adoption decides.
        self.deferred: dict[str, KernelRecord] = {}
        #: Entered before a hibernated kernel takes a GPU slice again: (owner, GPU size, kernel
        #: id) -> a context manager that holds the kernel's place in its owner's quota until the
        #: resume has ended, or raises HibernationError (403) saying why not. Entered with no
        #: await before it, so resumes sent at once see each other (a shared gateway's quotas).
        self.admission: Callable[[str, str | None, str], contextlib.AbstractContextManager[Any]] | None = None
        #: Called with the kernel id when a resume has finished (once per resume): the
        #: websocket layer attaches the notebooks that were opened while it slept.
        self.on_resumed: list[Callable[[str], Any]] = []
        runtime.kernel_lost = self._kernel_lost
        runtime.kernel_stopping = self._kernel_stopping
        #: Kernels whose pod Kubernetes is stopping while they checkpoint themselves -> done when
        #: they were taken over (or ended): a resume waits for it, messages are held meanwhile.
        self.stopping: dict[str, asyncio.Future[None]] = {}

    # -- queries -------------------------------------------------------------------------

    def state_of(self, kernel_id: str) -> KernelState | None:
        return self.controller.state_of(kernel_id)

    def is_going_to_sleep(self, kernel_id: str) -> bool:
        """Hibernating now, or checkpointing itself while its pod is stopped: a message sent to the
        kernel must wait, or the stop would lose it."""
        return self.state_of(kernel_id) is KernelState.HIBERNATING or kernel_id in self.stopping

    def is_hibernated(self, kernel_id: str) -> bool:
        return self.state_of(kernel_id) in (KernelState.HIBERNATED, KernelState.RESUMING)

    def kernel_info(self, kernel_id: str) -> dict[str, Any]:
        record = self.records.get(kernel_id)
        return dict(record.kernel_info) if record else {}

    # -- hibernate -----------------------------------------------------------------------

    async def hibernate(self, kernel_id: str, reason: str = "api") -> None:
        """Checkpoint, stop, release; raises :class:`HibernationError` saying why not."""
        if kernel_id not in self.mkm:
            raise HibernationError(f"no kernel with id {kernel_id!r}", status=404)
        record = self.runtime.kernels.get(kernel_id)
        if record is None:
            spec = self.mkm.get_kernel(kernel_id).kernel_name
            raise HibernationError(
                f"kernel {kernel_id} (kernelspec {spec!r}) is not an elastic kernel; only kernels started "
                "from a GPU-size kernelspec (metadata.elastic.profile) can hibernate"
            )
        size = size_label(record.profile)
        started = time.time()
        try:
            committed = await self.controller.hibernate(kernel_id, reason)
        except HibernateFailed as exc:
            message = exc.message
            self.mkm.log.error("Hibernation of kernel %s failed; it keeps running: %s", kernel_id, message)
            metrics.HIBERNATION_FAILURES.labels(reason, size).inc()
            self.events.emit(
                "hibernate_failed", kernel_id, f"hibernation failed: {message}", reason=reason, size=size
            )
            status = 507 if _disk_full(message) else exc.status
            raise HibernationError(
                f"hibernation of kernel {kernel_id} failed, it keeps running: {message}", status
            ) from None
        if committed is None:
            return  # it was hibernated already
        km: Any = self.mkm.get_kernel(kernel_id)
        km.execution_state = "hibernated"
        self._prune_later(record.owner, kernel_id)
        self.runtime.checkpoints.forget_cached(record.owner, kernel_id)
        self._remember(
            kernel_id,
            pid=None,
            hibernated_at=time.time(),
            checkpoint_id=committed.checkpoint_id,
            kernel_info=self.platform.kernel_info.pop(kernel_id, {}),
            execution_count=self.platform.execution_counts.pop(kernel_id, 0)
            or self.activity.get(kernel_id).execution_count,
        )
        took = time.time() - started
        metrics.HIBERNATIONS.labels(reason, size).inc()
        metrics.HIBERNATE_SECONDS.labels(size).observe(took)
        metrics.CHECKPOINT_BYTES.labels(size).observe(committed.size)
        released = self.platform.released.pop(kernel_id, None)
        if released is not None:
            self.released.hibernated(kernel_id, size, sum(p.fraction for p in released.placements))
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

    async def _reply(
        self, client: Any, msg_id: str, timeout: float, km: Any, pid: int | None, launching: bool = False
    ) -> dict[str, Any]:
        """The shell reply to ``msg_id``; fails fast if the kernel process dies meanwhile.

        ``launching``: the kernel was just started, so its process ending (or hanging after a
        failed bind) is a failed start, told with its last stderr lines.
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HibernationError(f"the kernel did not answer within {timeout:g}s", 504)
            try:
                msg: dict[str, Any] = await client.get_shell_msg(timeout=min(1.0, remaining))
            except Exception:  # queue.Empty from jupyter_client: no message this second
                if launching:
                    tail = stderr_tail(km)
                    if BIND_ERROR in tail:  # ipykernel hangs after some failed binds: do not wait
                        raise HibernationError(f"the kernel could not bind its ports: {tail}", 503) from None
                    if not await ensure_async(km.is_alive()):
                        raise HibernationError(
                            f"the kernel exited before it answered; its last stderr lines: {tail or 'none'}",
                            500,
                        ) from None
                    continue
                if self._pid(km) != pid or not await ensure_async(km.is_alive()):
                    raise KernelDied(
                        "the kernel process died while writing its checkpoint; the previous checkpoint "
                        "(if any) is unchanged",
                        500,
                    ) from None
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg

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
        self.platform.kernel_info.pop(kernel_id, None)
        self.platform.execution_counts.pop(kernel_id, None)
        self.runtime.checkpoints.forget_cached(record.owner, kernel_id)
        self._prune_later(record.owner, kernel_id)
        self._remember(kernel_id, checkpoint_id=committed.checkpoint_id)
        metrics.BACKGROUND_CHECKPOINTS.labels(size_label(record.profile)).inc()
        self.mkm.log.info(
            "Kernel %s checkpointed in the background: %s, %d bytes",
            kernel_id,
            committed.checkpoint_id,
            committed.size,
        )
        return committed

    # -- lost ----------------------------------------------------------------------------

    def _kernel_stopping(self, kernel_id: str) -> None:
        """A provisioner saw Kubernetes begin stopping a running kernel's pod (see
        ``RuntimeConfig.kernel_stopping``); the kernel is checkpointing itself. Until it is taken
        over or gone, what a notebook sends is held, and a resume waits."""
        if kernel_id in self.stopping or self.state_of(kernel_id) is not KernelState.RUNNING:
            return
        self.stopping[kernel_id] = asyncio.get_running_loop().create_future()
        self.mkm.log.info(
            "Kernel %s: its pod is being stopped; holding its messages until it is back", kernel_id
        )

    def _stopped(self, kernel_id: str) -> None:
        """The stopping kernel was taken over, or ended otherwise: held messages may go on."""
        done = self.stopping.pop(kernel_id, None)
        if done is not None and not done.done():
            done.set_result(None)

    def _kernel_lost(self, kernel_id: str, why: str, stop_began: float | None = None) -> bool:
        """A provisioner saw a running kernel vanish: take it over if a checkpoint can bring it back.

        Without one (it never hibernated or checkpointed), ``False``: it ends as a crashed kernel
        does, and jupyter_server's restarter starts it again, empty.
        """
        record = self.runtime.kernels.get(kernel_id)
        if record is None or not self.runtime.checkpoints.has_checkpoint(record.owner, kernel_id):
            self._stopped(kernel_id)
            return False
        km: Any = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
        if km is not None:
            km.stop_restarter()  # now, before the restarter polls again: a restart would start it empty
        task = asyncio.ensure_future(self.lost(kernel_id, why, stop_began))
        task.add_done_callback(lambda _task: self._stopped(kernel_id))
        self._pruning.add(task)  # a strong reference until done (drained at exit like the prunes)
        task.add_done_callback(self._pruning.discard)
        return True

    async def lost(self, kernel_id: str, why: str, stop_began: float | None = None) -> None:
        """Hibernate a vanished kernel from its last checkpoint; the next cell resumes it, told so."""
        record = self.runtime.kernels.get(kernel_id)
        km: Any = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
        if record is None or km is None:
            return
        try:
            manifest = await asyncio.to_thread(self.runtime.checkpoints.latest, record.owner, kernel_id)
        except Exception as exc:
            manifest = None
            self.mkm.log.error("Kernel %s was lost and its checkpoint cannot be read: %s", kernel_id, exc)
        if manifest is None:
            self.platform.release_slice(kernel_id)
            if record.lifecycle.can(KernelState.DEAD):
                record.lifecycle.move(KernelState.DEAD, f"lost ({why}) with no readable checkpoint")
            km.execution_state = "dead"
            return
        committed = committed_of(manifest)
        try:
            if await self.controller.lost(kernel_id, why, committed) is None:
                return
        except LifecycleError as exc:
            self.mkm.log.error("Kernel %s was lost and could not be hibernated: %s", kernel_id, exc.message)
            return
        km.execution_state = "hibernated"
        self.lost_kernels[kernel_id] = LostKernel(why, committed, stop_began)
        self._remember(kernel_id, pid=None, hibernated_at=time.time(), checkpoint_id=committed.checkpoint_id)
        self.platform.released.pop(kernel_id, None)
        size = size_label(record.profile)
        metrics.KERNELS_LOST.labels(size).inc()
        if saved_at_stop(committed, stop_began):
            metrics.KERNELS_SAVED_AT_STOP.labels(size).inc()
        self.events.emit(
            "lost", kernel_id, f"kernel lost ({why}); hibernated from its last checkpoint", size=size
        )
        self.mkm.log.warning(
            "Kernel %s was lost (%s); hibernated from checkpoint %s", kernel_id, why, committed.checkpoint_id
        )

    async def newer_checkpoint(self, owner: str, kernel_id: str, known: Committed | None) -> Committed | None:
        """The kernel's committed checkpoint (verified) when it is newer than ``known``; else ``None``.

        Newer means another id and a later ``created``: an older checkpoint put back in place is
        never taken. A checkpoint that cannot be read or verified counts as none (logged).
        """
        try:
            manifest = await asyncio.to_thread(self.runtime.checkpoints.latest, owner, kernel_id)
        except Exception as exc:  # refused or unreadable: no better than none
            self.mkm.log.warning("Kernel %s: its newest checkpoint is not usable: %s", kernel_id, exc)
            return None
        if manifest is None:
            return None
        if known is not None and (
            manifest.checkpoint_id == known.checkpoint_id or manifest.created <= known.created
        ):
            return None
        return committed_of(manifest)

    async def _take_newer_checkpoint(self, kernel_id: str, record: Any, lost: LostKernel) -> None:
        """A lost kernel may have committed a checkpoint after the server read its newest one: a
        pod deleted with no grace period is gone from the API while its kernel still answers the
        SIGTERM. That newer checkpoint is what it resumes from."""
        committed = await self.newer_checkpoint(record.owner, kernel_id, lost.committed)
        if committed is None:
            return
        self.mkm.log.info(
            "Kernel %s committed checkpoint %s after it was lost; resuming from it",
            kernel_id,
            committed.checkpoint_id,
        )
        self.controller.committed[kernel_id] = committed
        lost.committed = committed
        self._remember(kernel_id, checkpoint_id=committed.checkpoint_id)

    # -- resume --------------------------------------------------------------------------

    async def resume(
        self, kernel_id: str, reason: str = "api", notify: Notify | None = None, restore: bool = True
    ) -> None:
        """Bring a hibernated kernel back; concurrent callers share one resume.

        ``restore=False`` starts it empty (a restart of a hibernated kernel) and drops the checkpoint.
        A kernel whose pod is being stopped is resumed once the server has taken it over.
        """
        stopping = self.stopping.get(kernel_id)
        if stopping is not None:
            try:
                await asyncio.wait_for(asyncio.shield(stopping), self.start_timeout)
            except TimeoutError:
                raise HibernationError(
                    f"kernel {kernel_id}: its pod is still stopping after {self.start_timeout:g}s", 504
                ) from None
        state = self.state_of(kernel_id)
        if state is KernelState.RUNNING and not self.controller.in_flight(kernel_id):
            return
        if state is None:
            if kernel_id not in self.mkm:
                raise HibernationError(f"no kernel with id {kernel_id!r}", status=404)
            raise HibernationError(f"kernel {kernel_id} is not elastic; nothing to resume")
        if state in (KernelState.STARTING, KernelState.DEAD):
            raise HibernationError(f"kernel {kernel_id} is {state.value}; nothing to resume")
        record = self.runtime.kernels.get(kernel_id)
        admitted = contextlib.ExitStack()
        if self.admission is not None and record is not None:  # hibernated, hibernating or resuming
            admitted.enter_context(self.admission(record.owner, record.profile, kernel_id))
        km: Any = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
        began = time.time()
        lost = self.lost_kernels.get(kernel_id)
        with admitted:  # the quota place is held until the resume has ended, either way
            if lost is not None and restore and record is not None:
                await self._take_newer_checkpoint(kernel_id, record, lost)
            try:
                await self.controller.resume(kernel_id, reason, notify, restore)
            except LifecycleError:
                if km is not None and self.is_hibernated(kernel_id):
                    km.execution_state = "hibernated"
                raise
        if record is None or km is None:
            return
        if km.execution_state == "hibernated":
            km.execution_state = "idle"
        if lost is not None and self.lost_kernels.pop(kernel_id, None) is not None and notify is not None:
            told = notify(lost_note(lost.why, lost.committed, lost.stop_began))
            if told is not None:
                await told
        if self.records.get(kernel_id) is not None and self.records[kernel_id].hibernated_at is None:
            return  # another caller's resume did the bookkeeping
        self._remember(kernel_id, pid=self._pid(km), hibernated_at=None)
        # Waking up is activity: the idle clock starts again from now.
        self.activity.restarted(kernel_id)
        self.activity.get(kernel_id).last_execution_end = time.time()
        size = size_label(record.profile)
        took = time.time() - began
        metrics.RESUMES.labels(reason, size).inc()
        metrics.RESUME_SECONDS.labels(size).observe(took)
        metrics.RESUME_PATH_SECONDS.labels(size, record.launch_path).observe(took)
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
        for hook in self.on_resumed:
            try:
                hook(kernel_id)
            except Exception:  # a hook must not turn a finished resume into a failed one
                self.mkm.log.exception("on_resumed hook failed for kernel %s", kernel_id)

    def cancel_resume(self, kernel_id: str) -> bool:
        """Stop waiting for a slice (the user interrupted). True if a wait was cancelled."""
        return self.controller.cancel_wait(kernel_id)

    async def cancel_operations(self, kernel_id: str) -> None:
        """Cancel a hibernation or resume in flight (the kernel is being deleted)."""
        await self.controller.cancel(kernel_id)

    # -- persistence ---------------------------------------------------------------------

    def track(self, kernel_id: str) -> None:
        """Persist a newly started elastic kernel (so a crashed server can find its checkpoint)."""
        km = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
        self._remember(kernel_id, pid=self._pid(km) if km is not None else None)

    def recover(self) -> list[str]:
        """Re-register the kernels a previous server run left hibernated (or hibernating).

        A kernel hibernated by the previous run is listed at once. One whose process is
        still alive (the previous server died while it ran: its watchdog checkpoints it once
        its running cell ends, however long that takes) is listed as ``hibernating`` and
        becomes ``hibernated`` when its process exits with a committed checkpoint; a resume
        waits for that. Nothing here blocks the server's start. Returns the ids re-registered.
        """
        try:
            previous = self.state_file.load()
        except ValueError as exc:
            self.mkm.log.error("%s", exc)
            return []
        adopted: list[str] = []
        in_pods = self.runtime.provisioner_name == KUBERNETES_PROVISIONER
        for kernel_id, record in previous.items():
            if in_pods and record.state != KernelState.HIBERNATED.value:
                # Its pod may still run: kernelmgr.server.adoption looks, then adopts it or recovers it.
                self.deferred[kernel_id] = record
                self.records[kernel_id] = record  # kept on disk until adoption decides
                continue
            if record.profile is not None and record.profile not in self.runtime.profiles:
                self.mkm.log.error(
                    "Kernel %s was hibernated with GPU size %r, which is no longer configured; "
                    "its checkpoint is kept on disk but the kernel is not listed",
                    kernel_id,
                    record.profile,
                )
                continue
            orphan = record.pid if record.state != KernelState.HIBERNATED.value else None
            if orphan is not None and _alive(orphan):
                record.state = KernelState.HIBERNATING.value
                self.mkm.adopt_hibernated(record, state=KernelState.HIBERNATING)
                self.records[kernel_id] = record
                self.platform.orphans[kernel_id] = orphan
                self._adopt_orphan_soon(kernel_id, record)
                adopted.append(kernel_id)
                continue
            manifest = self._latest(record)
            if manifest is None:
                self.mkm.log.warning(
                    "Kernel %s (%s) ended with the previous server before any checkpoint; it is gone",
                    kernel_id,
                    record.state,
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
            self.controller.committed[kernel_id] = Committed(
                record.checkpoint_id, manifest.created, int(manifest.summary().get("bytes") or 0)
            )
            adopted.append(kernel_id)
        self.state_file.save(self.records)
        if adopted:
            self.mkm.log.info("Recovered %d hibernated kernel(s): %s", len(adopted), ", ".join(adopted))
        return adopted

    def recover_lost(self, record: KernelRecord, why: str) -> bool:
        """A kernel that was running when the previous server stopped, and whose pod is gone:
        hibernated from its last checkpoint (the next cell is told what was lost), else forgotten."""
        kernel_id = record.kernel_id
        manifest = self._latest(record)
        if manifest is None:
            self.mkm.log.warning("Kernel %s %s before any checkpoint; it is gone", kernel_id, why)
            self.records.pop(kernel_id, None)
            self.registry_writer.save(self.records)
            return False
        record.checkpoint_id = manifest.checkpoint_id
        record.state = KernelState.HIBERNATED.value
        record.pid = None
        self.mkm.adopt_hibernated(record)
        self.records[kernel_id] = record
        committed = committed_of(manifest)
        self.controller.committed[kernel_id] = committed
        self.lost_kernels[kernel_id] = LostKernel(why, committed)
        self._remember(kernel_id, pid=None, hibernated_at=time.time())
        return True

    def _latest(self, record: KernelRecord) -> Any:
        try:
            return self.runtime.checkpoints.latest(record.owner, record.kernel_id)
        except Exception as exc:  # refused (integrity) or unreadable: kept aside by the store
            self.mkm.log.error("Kernel %s cannot be recovered: %s", record.kernel_id, exc)
            return None

    def _adopt_orphan_soon(self, kernel_id: str, record: KernelRecord) -> None:
        """Once the loop runs: wait (without blocking it) for the orphan to checkpoint and exit."""
        pid = self.platform.orphans[kernel_id]

        async def wait_for_exit() -> Committed | None:
            self.mkm.log.info(
                "Kernel %s (pid %d) outlived the previous server; waiting for it to checkpoint itself",
                kernel_id,
                pid,
            )
            while _alive(pid):
                await asyncio.sleep(0.2)
            self.platform.orphans.pop(kernel_id, None)
            manifest = await asyncio.to_thread(self._latest, record)
            if manifest is None:
                self.mkm.log.warning("Kernel %s ended before any checkpoint; it is gone", kernel_id)
                self.records.pop(kernel_id, None)
                if kernel_id in self.mkm:
                    self.mkm.remove_kernel(kernel_id)
                return None
            km: Any = self.mkm.get_kernel(kernel_id) if kernel_id in self.mkm else None
            if km is not None:
                km.execution_state = "hibernated"
            self._remember(kernel_id, pid=None, checkpoint_id=manifest.checkpoint_id)
            return committed_of(manifest)

        asyncio.get_event_loop().call_soon(self.controller.adopt_orphan, kernel_id, wait_for_exit)

    def _verified_checkpoint(self, kernel_id: str) -> str | None:
        """The checkpoint id verified when ``kernel_id`` hibernated (or was recovered)."""
        record = self.records.get(kernel_id)
        return record.checkpoint_id if record is not None else None

    @staticmethod
    def _pid(km: Any) -> int | None:
        process = getattr(getattr(km, "provisioner", None), "process", None)
        return getattr(process, "pid", None)

    def _remember(self, kernel_id: str, **changes: Any) -> None:
        """Update the on-disk record of ``kernel_id`` from the registry (plus ``changes``).

        Written behind, off the event loop; a failure (a full disk) is logged and retried,
        never raised into a lifecycle transition.
        """
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
        self.registry_writer.save(self.records)

    async def forget(self, kernel_id: str) -> None:
        """The kernel was shut down for good: drop its record, bookkeeping and checkpoints.

        The files go in a worker thread (a GiB takes a while), but before this returns: a
        delete that answered 204 has left nothing behind.
        """
        self.released.woke(kernel_id)
        self.activity.forget(kernel_id)
        self.controller.forget(kernel_id)
        self.platform.kernel_info.pop(kernel_id, None)
        self.platform.released.pop(kernel_id, None)
        self.lost_kernels.pop(kernel_id, None)
        self._stopped(kernel_id)
        orphan = self.platform.orphans.pop(kernel_id, None)
        if orphan is not None:
            _kill_pid(orphan)
        record = self.records.pop(kernel_id, None)
        managed = self.runtime.kernels.remove(kernel_id)
        owner = record.owner if record else managed.owner if managed else None
        self.registry_writer.save(self.records)
        if owner is not None:
            try:
                await asyncio.to_thread(self.runtime.checkpoints.remove, owner, kernel_id)
            except Exception:
                self.mkm.log.warning("could not remove the checkpoints of %s", kernel_id, exc_info=True)

    async def drain(self) -> None:
        """Wait for background removals and prunes, and write the registry (server exit)."""
        if self._pruning:
            await asyncio.wait(list(self._pruning), timeout=30)
        await asyncio.to_thread(self.registry_writer.flush)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (our own reaped-later children are zombies)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # not ours (pid reused by another user's process)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
