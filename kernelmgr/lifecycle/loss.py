"""A running kernel whose process or pod vanished without being asked: hibernated from its
last checkpoint, so the next cell resumes it and is told what (if anything) was lost.

Provisioners report the facts to :class:`KernelLoss`, their
:class:`~kernelmgr.core.controller.LossReports` (``stopping``: Kubernetes began stopping the pod
and the kernel checkpoints itself; ``vanished``: it is gone); the state moves through
:meth:`~kernelmgr.core.controller.LifecycleController.lost`. The same path serves a local
kernel that exited after checkpointing at SIGTERM and a pod deleted, evicted or lost with its
node.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kernelmgr.core.controller import LifecycleController, LifecycleError
from kernelmgr.core.kernels import Committed, Loss
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.lifecycle import metrics
from kernelmgr.lifecycle.checkpoints import committed_of, newer_checkpoint
from kernelmgr.lifecycle.events import LifecycleEvents
from kernelmgr.lifecycle.host import KernelHost
from kernelmgr.lifecycle.metrics import size_label
from kernelmgr.lifecycle.platform import JupyterKernelPlatform
from kernelmgr.lifecycle.records import KernelRecords

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime


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


def died_note(why: str, restored: bool, committed: Committed | None = None) -> str:
    """What the cell that was running when its kernel died is told: the cause, then what happens
    next (``restored``: the next cell brings it back from its last checkpoint, ``committed`` if
    known; else it starts again empty)."""
    if not restored:
        then = "It is started again, empty: its variables are lost. Run your cells again."
    else:
        when = "last checkpoint"
        if committed is not None:
            when = "checkpoint of " + time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(committed.created))
        then = (
            f"Your next cell brings it back with its variables from its {when}; what ran after "
            "that (this cell too) is not in it. Run this cell again."
        )
    return f"The kernel died while this cell ran: {why}. {then}"


class KernelLoss:
    """Takes over the kernels that vanished; one per server, beside the hibernator."""

    def __init__(
        self,
        host: KernelHost,
        runtime: ElasticRuntime,
        controller: LifecycleController,
        platform: JupyterKernelPlatform,
        records: KernelRecords,
        events: LifecycleEvents,
        tasks: set[asyncio.Future[Any]],
    ) -> None:
        self.host = host
        self.runtime = runtime
        self.controller = controller
        self.platform = platform
        self.records = records
        self.events = events
        #: The server's background tasks (drained at exit): each takeover runs as one.
        self.tasks = tasks
        #: Called with (kernel id, text) when a running kernel dies: the websocket layer answers
        #: the cells the kernel was running with the text (why, and what happens next).
        self.on_died: list[Callable[[str, str], Any]] = []

    def _tell_died(self, kernel_id: str, text: str) -> None:
        for hook in self.on_died:
            try:
                hook(kernel_id, text)
            except Exception:  # telling must not stop a takeover
                self.host.log.exception("on_died hook failed for kernel %s", kernel_id)

    def died(self, kernel_id: str, why: str) -> None:
        """A provisioner saw the kernel end on its own, not taken over: restarted empty."""
        self.host.log.warning("Kernel %s died: %s", kernel_id, why)
        self._tell_died(kernel_id, died_note(why, restored=False))

    def stopping(self, kernel_id: str) -> None:
        """A provisioner saw Kubernetes begin stopping a running kernel's pod (see
        :class:`~kernelmgr.core.controller.LossReports`); the kernel is checkpointing itself.
        Until it is taken over or gone, what a notebook sends is held, and a resume waits."""
        record = self.runtime.kernels.get(kernel_id)
        if record is None or record.stopping is not None or record.state is not KernelState.RUNNING:
            return
        record.stopping = asyncio.get_running_loop().create_future()
        self.host.log.info(
            "Kernel %s: its pod is being stopped; holding its messages until it is back", kernel_id
        )

    def stopped(self, kernel_id: str) -> None:
        """The stopping kernel was taken over, or ended otherwise: held messages may go on."""
        record = self.runtime.kernels.get(kernel_id)
        done = record.stopping if record is not None else None
        if record is not None:
            record.stopping = None
        if done is not None and not done.done():
            done.set_result(None)

    def vanished(self, kernel_id: str, why: str, stop_began: float | None = None) -> bool:
        """A provisioner saw a running kernel vanish: take it over if a checkpoint can bring it back;
        what notebooks send is held from now until the takeover has ended (``stopped``).

        Without one (it never hibernated or checkpointed), ``False``: it ends as a crashed kernel
        does, and jupyter_server's restarter starts it again, empty.
        """
        record = self.runtime.kernels.get(kernel_id)
        if record is None or not self.runtime.checkpoints.has_checkpoint(record.owner, kernel_id):
            self.stopped(kernel_id)
            return False
        km: Any = self.host.get_kernel(kernel_id) if kernel_id in self.host else None
        if km is not None:
            km.stop_restarter()  # now, before the restarter polls again: a restart would start it empty
        if record.stopping is None:
            # Held from the report on, as during a pod's stop: until the takeover below has made the
            # kernel hibernated, it still reads as running, and a message sent to the process that
            # is gone would never be answered. The resume the message starts waits for the takeover.
            record.stopping = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self.lost(kernel_id, why, stop_began))
        if stop_began is None:
            self._tell_died(kernel_id, died_note(why, True, record.committed))
        else:
            # Stopped with SIGTERM, the kernel answered its running cell before its checkpoint and
            # exit, and that reply may still be on its way when the end is seen (a loaded node):
            # the cells left unanswered are told once the takeover is over, not before the reply.
            task.add_done_callback(
                lambda _task: self._tell_died(kernel_id, died_note(why, True, record.committed))
            )
        task.add_done_callback(lambda _task: self.stopped(kernel_id))
        self.tasks.add(task)  # a strong reference until done (drained at exit like the prunes)
        task.add_done_callback(self.tasks.discard)
        return True

    async def lost(self, kernel_id: str, why: str, stop_began: float | None = None) -> None:
        """Hibernate a vanished kernel from its last checkpoint; the next cell resumes it, told so."""
        record = self.runtime.kernels.get(kernel_id)
        km: Any = self.host.get_kernel(kernel_id) if kernel_id in self.host else None
        if record is None or km is None:
            return
        try:
            manifest = await asyncio.to_thread(self.runtime.checkpoints.latest, record.owner, kernel_id)
        except Exception as exc:
            manifest = None
            self.host.log.error("Kernel %s was lost and its checkpoint cannot be read: %s", kernel_id, exc)
        if manifest is None:
            self.platform.release_slice(kernel_id)
            self.runtime.states.dead(record, f"lost ({why}) with no readable checkpoint")
            return
        committed = committed_of(manifest)
        try:
            if await self.controller.lost(kernel_id, why, committed) is None:
                return
        except LifecycleError as exc:
            self.host.log.error("Kernel %s was lost and could not be hibernated: %s", kernel_id, exc.message)
            return
        record.loss = Loss(why, committed, stop_began)
        self.records.remember(
            kernel_id, pid=None, hibernated_at=time.time(), checkpoint_id=committed.checkpoint_id
        )
        record.released = None
        size = size_label(record.profile)
        metrics.KERNELS_LOST.labels(size).inc()
        if saved_at_stop(committed, stop_began):
            metrics.KERNELS_SAVED_AT_STOP.labels(size).inc()
        self.events.emit(
            "lost", kernel_id, f"kernel lost ({why}); hibernated from its last checkpoint", size=size
        )
        self.host.log.warning(
            "Kernel %s was lost (%s); hibernated from checkpoint %s", kernel_id, why, committed.checkpoint_id
        )

    async def take_newer_checkpoint(self, kernel_id: str, record: Any, lost: Loss) -> None:
        """A lost kernel may have committed a checkpoint after the server read its newest one: a
        pod deleted with no grace period is gone from the API while its kernel still answers the
        SIGTERM. That newer checkpoint is what it resumes from."""
        committed = await newer_checkpoint(
            self.runtime.checkpoints, record.owner, kernel_id, lost.committed, self.host.log
        )
        if committed is None:
            return
        self.host.log.info(
            "Kernel %s committed checkpoint %s after it was lost; resuming from it",
            kernel_id,
            committed.checkpoint_id,
        )
        record.committed = committed
        lost.committed = committed
        self.records.remember(kernel_id, checkpoint_id=committed.checkpoint_id)
