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

GPU activity is sampled on its own timer in a worker thread (NVML calls block), one NVML
call per device per sample whatever the number of kernels.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tornado import ioloop

from kernelmgr.activity.gpu import GpuActivity, GpuActivitySampler
from kernelmgr.core.kernels import ManagedKernel
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.policy import (
    Action,
    Decision,
    KernelSnapshot,
    Policy,
    activity_resets_warning,
    decide,
    idle_seconds,
)
from kernelmgr.server import metrics
from kernelmgr.server.hibernation import HibernationError, Hibernator
from kernelmgr.server.metrics import size_label

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime
    from kernelmgr.server.kernelmanager import ElasticMappingKernelManager

MAX_BACKOFF = 3600.0


@dataclass
class CullState:
    """What the culler remembers about one kernel between ticks."""

    warned_at: float | None = None
    deadline: float | None = None
    warning: str = ""
    busy_warned: bool = False
    failures: int = 0
    retry_at: float | None = None


Broadcast = Callable[[str, str], int]


def _in(seconds: float) -> str:
    return f"{max(0, round(seconds))} s" if seconds < 120 else f"about {round(seconds / 60)} min"


def warning_text(deadline: float, now: float, idle: float, signals: str) -> str:
    """What a notebook user reads before their kernel is hibernated."""
    when = time.strftime("%H:%M:%S", time.localtime(deadline))
    return (
        f"This kernel has been idle for {_in(idle)} ({signals}). To free its GPU it will be hibernated "
        f"at {when} (in {_in(deadline - now)}): its variables are saved first, and running any cell "
        "brings it back with them. Run a cell now to keep it running."
    )


class Culler:
    """Runs the policy over the kernels of one elastic kernel manager."""

    def __init__(
        self,
        mkm: ElasticMappingKernelManager,
        runtime: ElasticRuntime,
        hibernator: Hibernator,
        policy: Policy,
        sampler: GpuActivitySampler | None,
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
        self.states: dict[str, CullState] = {}
        self.gpu: dict[str, GpuActivity] = {}
        self.tombstones: dict[str, str] = {}
        self._callbacks: list[ioloop.PeriodicCallback] = []
        self._sampling = False

    # -- timers ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.sampler is not None:
            self._callbacks.append(ioloop.PeriodicCallback(self.sample, self.sample_interval * 1000))
        if self.policy.enabled:
            self._callbacks.append(ioloop.PeriodicCallback(self.tick, self.policy.interval * 1000))
        for callback in self._callbacks:
            callback.start()

    def stop(self) -> None:
        for callback in self._callbacks:
            callback.stop()

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

    async def sample(self) -> None:
        """Sample GPU activity of every kernel holding a slice (in a worker thread)."""
        if self.sampler is None or self._sampling:
            return
        self._sampling = True
        try:
            kernels = self._kernel_processes()
            sampler = self.sampler
            self.gpu = await asyncio.to_thread(sampler.sample, kernels)
            for gone in set(self.states) - {r.kernel_id for r in self.runtime.kernels.all()}:
                self.states.pop(gone, None)
                sampler.forget(gone)
        except Exception:
            self.mkm.log.exception("GPU activity sampling failed; the policy falls back to Jupyter activity")
        finally:
            self._sampling = False

    # -- the policy ------------------------------------------------------------------------

    def snapshot(self, record: ManagedKernel, now: float) -> KernelSnapshot:
        state = self.states.get(record.kernel_id, CullState())
        activity = self.hibernator.activity.get(record.kernel_id)
        gpu = self.gpu.get(record.kernel_id)
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
        """One pass over every kernel; returns what was decided (for tests and benchmarks)."""
        now = self.clock()
        decided: list[tuple[str, Decision]] = []
        for record in self.runtime.kernels.all():
            snapshot = self.snapshot(record, now)
            state = self.states.setdefault(record.kernel_id, CullState())
            if activity_resets_warning(snapshot, self.policy, now):
                state.warned_at, state.deadline, state.warning = None, None, ""
                snapshot = self.snapshot(record, now)
            if snapshot.execution_state != "busy":
                state.busy_warned = False
            decision = decide(self.policy, snapshot, now)
            if decision.action is Action.NOTHING:
                continue
            decided.append((record.kernel_id, decision))
            try:
                await self._act(record, state, decision, now)
            except Exception:
                self.mkm.log.exception(
                    "Cull policy action %s on kernel %s failed", decision.action, record.kernel_id
                )
        return decided

    async def _act(self, record: ManagedKernel, state: CullState, decision: Decision, now: float) -> None:
        size = size_label(record.profile)
        kernel_id = record.kernel_id
        if decision.action is Action.WARN:
            state.warned_at = now
            state.deadline = decision.deadline
            idle, signals = idle_seconds(self.snapshot(record, now), now)
            state.warning = warning_text(decision.deadline or now, now, idle, signals)
            reached = self.broadcast(kernel_id, state.warning)
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
            try:
                await self.hibernator.hibernate(kernel_id, "policy")
            except HibernationError as exc:
                state.failures += 1
                delay = min(MAX_BACKOFF, self.policy.interval * 2**state.failures)
                state.retry_at = now + delay
                self.mkm.log.warning(
                    "Policy hibernation of kernel %s failed (%d in a row), retrying in %.0fs: %s",
                    kernel_id,
                    state.failures,
                    delay,
                    exc.message,
                )
                return
            self.states[kernel_id] = CullState()
        elif decision.action is Action.REMOVE:
            ttl = self.policy.for_profile(record.profile).hibernated_ttl
            self.tombstones[kernel_id] = (
                f"kernel {kernel_id} was removed: it stayed hibernated for more than {ttl:g}s "
                "(CullPolicy.hibernated_ttl), so its saved variables were deleted. Start a new kernel."
            )
            metrics.REMOVALS.labels(size).inc()
            self.hibernator.events.emit(
                "remove", kernel_id, self.tombstones[kernel_id], reason="policy", size=size
            )
            await self.mkm.shutdown_kernel(kernel_id)
            self.states.pop(kernel_id, None)

    # -- what the API shows ----------------------------------------------------------------

    def activity_model(self, kernel_id: str) -> dict[str, Any]:
        now = self.clock()
        record = self.runtime.kernels.get(kernel_id)
        gpu = self.gpu.get(kernel_id)
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
        state = self.states.get(kernel_id)
        model["warning"] = (
            {"message": state.warning, "hibernate_at": state.deadline} if state and state.warning else None
        )
        return model
