"""The culler: applies the cull policy to every elastic kernel, on a timer.

Each tick gathers a :class:`~kernelmgr.core.policy.KernelSnapshot` per kernel (Jupyter
execution activity, the latest GPU sample, lifecycle state, warning and retry state), asks
:func:`~kernelmgr.core.policy.decide` what to do, and does it:

* **warn** — every connected notebook of the kernel gets a message saying what will
  happen, when, that its variables will be saved and that running a cell brings it back;
  once per idle period (activity in between cancels the warning);
* **hibernate** — through the same path as the REST API; a failure leaves the kernel
  running and is retried with exponential back-off, never in a tight loop;
* **remove** — a kernel hibernated for longer than ``hibernated_ttl`` is shut down and its
  checkpoint deleted; whoever asks for it later is told why it is gone.

The tick never waits for a hibernation or a removal. It *schedules* them on a
:class:`~kernelmgr.lifecycle.scheduler.BoundedScheduler` and goes on, so one slow checkpoint
(minutes, for a large state) holds up no other kernel's warning or hibernation: at most
``CullPolicy.max_concurrent_hibernations`` run at once, the rest wait their turn, and a kernel
already queued or hibernating is never scheduled twice. A queued hibernation asks the policy
again when its turn comes (the user may have run a cell meanwhile).

Nothing here grows with the kernels ever seen: what the culler knows of a kernel is on its
record (``ManagedKernel.cull`` and ``.gpu``) and goes with it, the GPU samplers keep only the
kernels of their last sample, finished jobs are forgotten as they finish, and the tombstones that explain
a removed kernel's 404 are kept for the newest :data:`MAX_TOMBSTONES` removals, at most
:data:`TOMBSTONE_TTL` seconds each.

GPU activity is sampled on its own timer: locally in a worker thread (NVML calls block), one NVML
call per device per sample whatever the number of kernels; in Kubernetes mode one HTTP request per
node agent per sample (:mod:`kernelmgr.server.cluster_activity`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

from tornado import ioloop

from kernelmgr.activity.gpu import GpuActivitySampler
from kernelmgr.core.controller import LifecycleError
from kernelmgr.core.kernels import ManagedKernel
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.policy import (
    Action,
    CullState,
    Decision,
    KernelSnapshot,
    Policy,
    decide,
    idle_seconds,
    review,
    under_pressure,
)
from kernelmgr.lifecycle import metrics
from kernelmgr.lifecycle.host import KernelHost
from kernelmgr.lifecycle.metrics import size_label
from kernelmgr.lifecycle.scheduler import BoundedScheduler
from kernelmgr.lifecycle.service import Hibernator
from kernelmgr.lifecycle.storage import CheckpointSpaceRefused
from kernelmgr.server.cluster_activity import ClusterGpuSampler

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime

MAX_BACKOFF = 3600.0
#: Removed kernels whose 404 still says why (the newest ones); older ones answer a plain 404.
MAX_TOMBSTONES = 1000
#: Seconds a removed kernel's tombstone is kept (a week: a user back from a long weekend is told why).
TOMBSTONE_TTL = 7 * 24 * 3600.0
#: Removals (shutdown of a hibernated kernel, deletion of its checkpoint) running at once.
MAX_CONCURRENT_REMOVALS = 4


class Broadcast(Protocol):
    """Shows a text in every open notebook of a kernel; returns how many were reached."""

    def __call__(self, kernel_id: str, text: str, *, idle_warning: bool = False) -> int: ...


class Tombstones(MutableMapping[str, str]):
    """Why each removed kernel is gone (kernel id → message), bounded in number and age.

    The kernel manager answers a request for a removed kernel with this message instead of a
    bare 404. Without a bound a server culling for months would keep one entry per kernel it
    ever removed; a tombstone only has to outlive the user's absence.
    """

    def __init__(
        self, limit: int = MAX_TOMBSTONES, ttl: float = TOMBSTONE_TTL, clock: Callable[[], float] = time.time
    ) -> None:
        self.limit = limit
        self.ttl = ttl
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def __getitem__(self, kernel_id: str) -> str:
        return self._entries[kernel_id][1]

    def __setitem__(self, kernel_id: str, message: str) -> None:
        self._entries.pop(kernel_id, None)
        self._entries[kernel_id] = (self.clock(), message)
        self.prune()

    def __delitem__(self, kernel_id: str) -> None:
        del self._entries[kernel_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def prune(self) -> None:
        """Drop tombstones older than ``ttl``, then the oldest beyond ``limit``."""
        oldest_kept = self.clock() - self.ttl
        while self._entries:
            _kernel_id, (written, _message) = next(iter(self._entries.items()))
            if written >= oldest_kept and len(self._entries) <= self.limit:
                break
            self._entries.popitem(last=False)


def _in(seconds: float) -> str:
    return f"{max(0, round(seconds))} s" if seconds < 120 else f"about {round(seconds / 60)} min"


def warning_text(deadline: float, now: float, idle: float, signals: str, pressure: bool = False) -> str:
    """What a notebook user reads before their kernel is hibernated."""
    when = time.strftime("%H:%M:%S", time.localtime(deadline))
    why = ", which another kernel is waiting for," if pressure else ""
    return (
        f"This kernel has been idle for {_in(idle)} ({signals}). To free its GPU{why} it will be hibernated "
        f"at {when} (in {_in(deadline - now)}): its variables are saved first, and running any cell "
        "brings it back with them. Run a cell now to keep it running."
    )


class Culler:
    """Runs the policy over the kernels of one elastic kernel manager."""

    def __init__(
        self,
        mkm: KernelHost,
        runtime: ElasticRuntime,
        hibernator: Hibernator,
        policy: Policy,
        sampler: GpuActivitySampler | ClusterGpuSampler | None,
        broadcast: Broadcast,
        sample_interval: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.mkm = mkm
        self.runtime = runtime
        self.hibernator = hibernator
        self.policy = policy
        self.sampler = sampler
        self.broadcast = broadcast
        self.sample_interval = sample_interval
        self.clock = clock
        self.tombstones = Tombstones(clock=clock)
        #: Policy hibernations queued or running, at most ``max_concurrent_hibernations`` at once.
        self.hibernations = BoundedScheduler(
            policy.max_concurrent_hibernations, mkm.log, "policy hibernation"
        )
        self.removals = BoundedScheduler(MAX_CONCURRENT_REMOVALS, mkm.log, "removal")
        self._callbacks: list[ioloop.PeriodicCallback] = []
        self._ticks: ioloop.PeriodicCallback | None = None
        self._started = False
        self._sampling = False

    # -- timers ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.sampler is not None:
            self._callbacks.append(ioloop.PeriodicCallback(self.sample, self.sample_interval * 1000))
        for callback in self._callbacks:
            callback.start()
        self._started = True
        self._start_ticks()

    def _start_ticks(self) -> None:
        if self.policy.enabled:
            self._ticks = ioloop.PeriodicCallback(self.tick, self.policy.interval * 1000)
            self._ticks.start()

    def stop(self) -> None:
        self._started = False
        for callback in self._callbacks:
            callback.stop()
        if self._ticks is not None:
            self._ticks.stop()
            self._ticks = None

    def set_policy(self, policy: Policy) -> None:
        """A new policy (the live configuration): the next tick decides by it, at its interval."""
        retime = (policy.enabled, policy.interval) != (self.policy.enabled, self.policy.interval)
        self.policy = policy
        if self.sampler is not None:
            self.sampler.busy_threshold = policy.defaults.gpu_idle_threshold
        if retime and self._started:  # the ticks follow the new interval
            if self._ticks is not None:
                self._ticks.stop()
                self._ticks = None
            self._start_ticks()

    async def close(self) -> None:
        """Server stop: no more ticks, queued jobs dropped, running ones allowed to finish.

        A hibernation is never cut off midway (its kernel would be left half-way between
        running and hibernated); the server's own hibernate-on-shutdown, which runs next,
        finds those kernels hibernated and the dropped ones still running.
        """
        self.stop()
        dropped = self.hibernations.cancel_waiting() + self.removals.cancel_waiting()
        if dropped:
            self.mkm.log.info("Server stopping: %d queued cull action(s) dropped", len(dropped))
        await self.hibernations.join()
        await self.removals.join()

    def prune(self) -> None:
        """Drop old tombstones. What the culler knows of a kernel is on its record
        (``ManagedKernel.cull``, ``.gpu``) and goes with it."""
        self.tombstones.prune()

    # -- GPU activity ----------------------------------------------------------------------

    def _kernel_processes(self) -> dict[str, tuple[int, list[str]]]:
        found: dict[str, tuple[int, list[str]]] = {}
        for granted in self.runtime.allocator.slices():
            if granted.kernel_id not in self.mkm:
                continue
            km = self.mkm.get_kernel(granted.kernel_id)
            pid = getattr(getattr(getattr(km, "provisioner", None), "process", None), "pid", None)
            if pid is not None:
                found[granted.kernel_id] = (pid, list(granted.device_uuids))
        return found

    def _kernel_slices(self) -> dict[str, list[str]]:
        return {
            granted.kernel_id: list(granted.device_uuids)
            for granted in self.runtime.allocator.slices()
            if granted.kernel_id in self.mkm
        }

    async def sample(self) -> None:
        """Sample GPU activity of every kernel holding a slice.

        Locally NVML in a worker thread; in Kubernetes mode the node agents, asked concurrently
        from the event loop (HTTP, no blocking call).
        """
        if self.sampler is None or self._sampling:
            return
        self._sampling = True
        try:
            if isinstance(self.sampler, ClusterGpuSampler):
                sampled = await self.sampler.sample(self._kernel_slices())
            else:
                sampled = await asyncio.to_thread(self.sampler.sample, self._kernel_processes())
            for record in self.runtime.kernels.all():
                record.gpu = sampled.get(record.kernel_id)
        except Exception:
            self.mkm.log.exception("GPU activity sampling failed; the policy falls back to Jupyter activity")
        finally:
            self._sampling = False

    # -- the policy ------------------------------------------------------------------------

    def snapshot(self, record: ManagedKernel, now: float) -> KernelSnapshot:
        state = record.cull
        activity = record.activity
        gpu = record.gpu
        km = self.mkm.get_kernel(record.kernel_id) if record.kernel_id in self.mkm else None
        hibernated = self.hibernator.records.get(record.kernel_id)
        return KernelSnapshot(
            kernel_id=record.kernel_id,
            profile=record.profile,
            state=record.state,
            execution_state=str(getattr(km, "execution_state", "unknown")),
            started=activity.started,
            last_execution=activity.last_execution,
            busy_since=activity.busy_since,
            gpu_available=bool(gpu and gpu.available),
            gpu_idle_seconds=gpu.idle_seconds if gpu and gpu.available else None,
            hibernated_at=hibernated.hibernated_at if hibernated else None,
            warned_at=state.warned_at,
            busy_warned=state.busy_warned,
            retry_at=state.retry_at,
        )

    async def tick(self) -> list[tuple[str, Decision]]:
        """One pass over every kernel; returns what was decided (for tests and benchmarks).

        Warnings go out here; hibernations and removals are only scheduled (see the module
        docstring), so a tick takes as long as its snapshots and decisions, whatever the
        checkpoints cost.
        """
        now = self.clock()
        decided: list[tuple[str, Decision]] = []
        records = self.runtime.kernels.all()
        self.prune()
        snapshots = {record.kernel_id: self.snapshot(record, now) for record in records}
        # Kernels waiting for a slice, less the hibernations already on their way to free one.
        waiting = len(self.runtime.slice_queue) - len(self.hibernations)
        pressured = set(under_pressure(self.policy, list(snapshots.values()), now, waiting))
        for record in records:
            if record.kernel_id in self.mkm.starting_kernels:
                # Still in its start (the POST /api/kernels waits for its first answer): counted
                # from its launch, a slow start on a loaded machine outlasted a short start_grace,
                # and the hibernation stopped the start midway (a 500 for the kernel's creator).
                continue
            snapshot = snapshots[record.kernel_id]
            state = record.cull
            pressure = record.kernel_id in pressured
            reviewed = review(self.policy, snapshot, now, pressure)
            if reviewed.warning_cancelled:
                state.warned_at, state.deadline, state.warning = None, None, ""
                state.pressure = False
            if snapshot.execution_state != "busy":
                state.busy_warned = False
            decision = reviewed.decision
            if decision.action is Action.NOTHING:
                continue
            decided.append((record.kernel_id, decision))
            if decision.action in (Action.WARN, Action.HIBERNATE):
                state.pressure = pressure
            try:
                self._act(record, state, decision, now)
            except Exception:
                self.mkm.log.exception(
                    "Cull policy action %s on kernel %s failed", decision.action, record.kernel_id
                )
        return decided

    def _act(self, record: ManagedKernel, state: CullState, decision: Decision, now: float) -> None:
        size = size_label(record.profile)
        kernel_id = record.kernel_id
        if decision.action is Action.WARN:
            state.warned_at = now
            state.deadline = decision.deadline
            idle, signals = idle_seconds(self.snapshot(record, now), now)
            state.warning = warning_text(decision.deadline or now, now, idle, signals, state.pressure)
            reached = self.broadcast(kernel_id, state.warning, idle_warning=True)
            metrics.WARNINGS.labels("idle", size).inc()
            self.hibernator.events.emit("warn", kernel_id, state.warning, reason="policy", size=size)
            self.mkm.log.info("Warned kernel %s (%d notebook(s)): %s", kernel_id, reached, decision.reason)
        elif decision.action is Action.WARN_BUSY:
            state.busy_warned = True
            text = (
                f"Note: {decision.reason}. If the cell is waiting on something that does not need the GPU, "
                "consider a smaller GPU size; this kernel is not hibernated while a cell runs."
            )
            self.broadcast(kernel_id, text)
            metrics.WARNINGS.labels("busy_gpu_idle", size).inc()
            self.hibernator.events.emit("warn_busy", kernel_id, text, reason="policy", size=size)
        elif decision.action is Action.HIBERNATE:
            if self.hibernations.schedule(kernel_id, lambda: self._hibernate(kernel_id)):
                waiting = len(self.hibernations) - len(self.hibernations.running)
                self.mkm.log.info(
                    "Policy hibernation of kernel %s scheduled (%d waiting, at most %d at once): %s",
                    kernel_id,
                    waiting,
                    self.hibernations.limit,
                    decision.reason,
                )
        elif decision.action is Action.REMOVE and kernel_id not in self.removals:
            ttl = self.policy.for_profile(record.profile).hibernated_ttl
            self.tombstones[kernel_id] = (
                f"kernel {kernel_id} was removed: it stayed hibernated for more than {ttl:g}s "
                "(CullPolicy.hibernated_ttl), so its saved variables were deleted. Start a new kernel."
            )
            metrics.REMOVALS.labels(size).inc()
            self.hibernator.events.emit(
                "remove", kernel_id, self.tombstones[kernel_id], reason="policy", size=size
            )
            self.removals.schedule(kernel_id, lambda: self._remove(kernel_id))

    async def _hibernate(self, kernel_id: str) -> None:
        """A scheduled policy hibernation, once its turn has come."""
        record = self.runtime.kernels.get(kernel_id)
        if record is None:
            return  # removed while it waited
        now = self.clock()
        pressure = record.cull.pressure and len(self.runtime.slice_queue) > 0
        decision = decide(self.policy, self.snapshot(record, now), now, pressure)
        if decision.action is not Action.HIBERNATE:
            # It waited for a slot, and meanwhile the user ran a cell (or the API hibernated it).
            self.mkm.log.info("Policy hibernation of kernel %s dropped: no longer due", kernel_id)
            return
        self.mkm.log.info(
            "Policy hibernation of kernel %s started (%d of at most %d running)",
            kernel_id,
            len(self.hibernations.running),
            self.hibernations.limit,
        )
        try:
            await self.hibernator.hibernate(kernel_id, "policy")
        except Exception as exc:
            message = exc.message if isinstance(exc, LifecycleError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, LifecycleError):
                self.mkm.log.exception("Policy hibernation of kernel %s raised", kernel_id)
            record = self.runtime.kernels.get(kernel_id)
            if record is None:
                return  # gone meanwhile: nothing to retry
            state = record.cull
            state.failures += 1
            if isinstance(exc, CheckpointSpaceRefused) and state.failures == 1:
                # Only its user can free the space: told once, not at every retry.
                self.broadcast(kernel_id, f"Not hibernated: {exc.detail}")
            delay = min(MAX_BACKOFF, self.policy.interval * 2**state.failures)
            state.retry_at = self.clock() + delay
            self.mkm.log.warning(
                "Policy hibernation of kernel %s failed (%d in a row), retrying in %.0fs: %s",
                kernel_id,
                state.failures,
                delay,
                message,
            )
            return
        finally:
            self.mkm.log.info("Policy hibernation of kernel %s finished", kernel_id)
        record = self.runtime.kernels.get(kernel_id)
        if record is not None:
            record.cull = CullState()

    async def _remove(self, kernel_id: str) -> None:
        """A scheduled TTL removal: shut the hibernated kernel down and delete its checkpoint."""
        if kernel_id in self.mkm:
            await self.mkm.shutdown_kernel(kernel_id)

    def cancel_warning(self, kernel_id: str) -> None:
        """The user asked to keep the kernel (an API call): drop its warning now, not at the next tick."""
        record = self.runtime.kernels.get(kernel_id)
        if record is not None:
            state = record.cull
            state.warned_at, state.deadline, state.warning = None, None, ""

    # -- what the API shows ----------------------------------------------------------------

    def activity_model(self, kernel_id: str) -> dict[str, Any]:
        now = self.clock()
        record = self.runtime.kernels.get(kernel_id)
        gpu = record.gpu if record is not None else None
        model: dict[str, Any] = {
            "gpu_utilization": None,
            "gpu_memory_mib": None,
            "gpu_idle_seconds": None,
            "gpu_activity_source": "not sampled yet" if self.sampler else "unavailable: no NVML",
        }
        if gpu is not None:
            model.update(gpu.to_dict())
        activity = self.hibernator.activity.get(kernel_id)
        model.update(activity.to_dict())
        if record is not None and record.state is KernelState.RUNNING:
            idle, signals = idle_seconds(self.snapshot(record, now), now)
            model["idle_seconds"] = round(idle, 1)
            model["idle_signals"] = signals
        state = record.cull if record is not None else None
        model["warning"] = (
            {"message": state.warning, "hibernate_at": state.deadline} if state and state.warning else None
        )
        return model
