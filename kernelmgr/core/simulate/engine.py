"""The event loop: a trace replayed on a simulated clock under three policies.

Each session is a cursor over its own events (kernel start, each cell's start and end, kernel
shutdown); only its next event is on the heap. When a user has to wait (for a slice, or for a
resume) the cursor stalls, and once the kernel is ready the rest of the session moves later by
that wait: the user sat in front of the notebook, so everything they did after happens later.

The policies differ only in what the culler tick does with an idle kernel:

* ``static`` — no culler: each session holds its GPU size from start to end;
* ``cull_shutdown`` — jupyter_server-style culling: the same ``idle_timeout`` (per size),
  Jupyter activity only (no GPU signal), no warning, and a culled kernel is shut down, its
  variables lost; the next cell starts a fresh kernel ("restart with state lost");
* ``policy`` — this project: :func:`~kernelmgr.core.policy.decide` on the same snapshot the
  server's culler builds (last execution, GPU idle seconds, busy state, warning state); a
  hibernation holds the slice while the checkpoint is written, the next cell resumes it;
* ``pressure`` — the same, plus culling under pressure: while kernels wait for a slice,
  :func:`~kernelmgr.core.policy.under_pressure` picks the longest-idle kernels idle past
  ``CullPolicy.pressure_idle_minimum`` (run only when that is set).

Waiting kernels are served by the server's own :class:`~kernelmgr.core.queue.SliceQueue` (priority
per size, each user's first before anyone's second, arrival). On Kubernetes a pod has to be
scheduled and started, and a node's first kernel pulls the image: :class:`DelayModel`'s ``pod_s``
and ``pull_s`` (a simulated GPU stands for a node).

Slices come from the real :class:`~kernelmgr.core.allocator.SliceAllocator`, so binpacking,
memory limits and whole-GPU sizes behave as in the server. Hibernations run at most
``CullPolicy.max_concurrent_hibernations`` at once, as the server's culler runs them: the others
wait their turn with the kernel still running (holding its slice, its cells running as usual),
and ask the policy again when it comes (a cell run meanwhile drops them). What is not modelled:
failed hibernations, GPU sampling delay (GPU activity is known exactly), and users who give up
while waiting.

Long because the policies run on one event loop and one simulated clock: a policy is a
branch of the culler tick, not a module of its own.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kernelmgr.core.allocator import MILLI, SliceAllocator
from kernelmgr.core.inventory import GpuDevice, GpuInventory
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.policy import (
    Action,
    KernelSnapshot,
    Policy,
    PolicyRule,
    decide,
    review,
    under_pressure,
)
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.core.queue import SliceQueue
from kernelmgr.core.simulate.trace import Session, TraceError

MODES = ("static", "cull_shutdown", "policy", "pressure")
#: The default simulated GPU when the configuration declares none: an 80 GiB device.
DEFAULT_GPU_MODEL = "Simulated GPU"
DEFAULT_GPU_MIB = 80 * 1024

# Heap priorities at one instant: a kernel becoming ready first, then the users' own events,
# then the culler (a cell that starts at a tick's instant is seen by that tick).
_READY, _SESSION, _TICK = 0, 1, 2
#: Event kind (not a priority) of a finished checkpoint; it sorts with ``_READY``.
_HIBERNATED = 3


@dataclass(frozen=True)
class DelayModel:
    """How long users wait for a resume, and how long a hibernation holds the slice.

    Defaults come from docs/benchmarks.md, "Hibernate and resume against their floors", the
    page-cache-dropped table (the usual case after hours idle): resume to first reply of a
    0 MiB kernel 0.986 s (``start_s``); 1024 MiB 1.606 s, so the extra 1024 MiB read at about
    1024 / 0.620 = 1650 MiB/s (``read_mib_s``). Hibernation: a fixed 0.27 s (0 MiB row) plus the
    checkpoint, 1.06 s per 1024 MiB, about 965 MiB/s (``write_mib_s``, warm table). That run
    has since been superseded there (later runs: ~0.08 s fixed, 0.5-0.6 s per GiB written, resume
    0.5-0.7 s at 0 MiB), so these defaults overstate the delays somewhat; they are kept so that
    simulations, and the tables in docs/benchmarks.md made with them, stay comparable.
    """

    start_s: float = 0.99
    read_mib_s: float = 1650.0
    hibernate_fixed_s: float = 0.27
    write_mib_s: float = 965.0
    #: Kubernetes: a kernel pod's scheduling and container start, before the kernel starts.
    pod_s: float = 0.0
    #: Kubernetes: the image pull on a node's first kernel pod (each simulated GPU is a node).
    pull_s: float = 0.0

    def resume(self, state_mib: float) -> float:
        return self.start_s + state_mib / self.read_mib_s

    def checkpoint(self, state_mib: float) -> float:
        return self.hibernate_fixed_s + state_mib / self.write_mib_s


@dataclass
class Result:
    """What one policy did to the trace. ``timeline``: (time, GPUs held) after each change."""

    gpu_hours: float = 0.0
    ratio_to_static: float = 1.0
    peak_gpus: int = 0
    peak_gpus_held: float = 0.0
    hibernations: int = 0
    #: Policy hibernations that waited for a free slot (``max_concurrent_hibernations``), and
    #: those of them dropped when their turn came (the user had run a cell meanwhile).
    hibernations_queued: int = 0
    hibernations_dropped: int = 0
    resumes: int = 0
    resumes_per_session_day: float = 0.0
    resume_wait_p50_s: float | None = None
    resume_wait_p95_s: float | None = None
    slice_waits: int = 0
    slice_wait_total_s: float = 0.0
    slice_wait_max_s: float = 0.0
    restarts_state_lost: int = 0
    warnings: int = 0
    busy_warnings: int = 0
    removals: int = 0
    events: int = 0
    timeline: list[tuple[float, float]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_hours": round(self.gpu_hours, 6),
            "ratio_to_static": round(self.ratio_to_static, 6),
            "peak_gpus": self.peak_gpus,
            "peak_gpus_held": round(self.peak_gpus_held, 6),
            "hibernations": self.hibernations,
            "hibernations_queued": self.hibernations_queued,
            "hibernations_dropped": self.hibernations_dropped,
            "resumes": self.resumes,
            "resumes_per_session_day": round(self.resumes_per_session_day, 6),
            "resume_wait_p50_s": _round(self.resume_wait_p50_s),
            "resume_wait_p95_s": _round(self.resume_wait_p95_s),
            "slice_waits": self.slice_waits,
            "slice_wait_total_s": round(self.slice_wait_total_s, 6),
            "slice_wait_max_s": round(self.slice_wait_max_s, 6),
            "restarts_state_lost": self.restarts_state_lost,
            "warnings": self.warnings,
            "busy_warnings": self.busy_warnings,
            "removals": self.removals,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (``p`` in 0..100) of ``values``; ``None`` if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def simulated_inventory(
    count: int, memory_mib: int = DEFAULT_GPU_MIB, name: str = DEFAULT_GPU_MODEL
) -> GpuInventory:
    """``count`` identical declared devices."""
    devices = [
        GpuDevice(uuid=f"sim-gpu-{i}", name=name, memory_mib=memory_mib, index=i) for i in range(count)
    ]
    return GpuInventory(devices, source="declared", note=f"{count} simulated GPU(s)")


def without_warnings(policy: Policy) -> Policy:
    """The policy as jupyter_server's culler applies it: same timeouts, no warning, no busy note."""
    quiet = {"warn_before": 0.0, "busy_gpu_idle_warning": 0.0}
    rules = tuple(PolicyRule(r.profiles, {**dict(r.overrides), **quiet}) for r in policy.rules)
    return replace(policy, defaults=replace(policy.defaults, **quiet), rules=rules)


class _Run:
    """One session's kernel during the replay."""

    __slots__ = (
        "busy",
        "busy_warned",
        "cursor",
        "gpu_busy",
        "gpu_idle_since",
        "held_milli",
        "held_since",
        "hibernated_at",
        "last_execution",
        "offset",
        "pending",
        "pressure",
        "profile",
        "requested_at",
        "session",
        "started",
        "state",
        "wait_kind",
        "warned_at",
    )

    def __init__(self, session: Session, profile: GpuProfile) -> None:
        self.session = session
        self.profile = profile
        self.cursor = 0
        self.offset = 0.0
        self.state = "new"
        self.busy = False
        self.gpu_busy = False
        self.gpu_idle_since = 0.0
        self.started = 0.0
        self.last_execution: float | None = None
        self.warned_at: float | None = None
        self.busy_warned = False
        self.hibernated_at: float | None = None
        self.pending = False
        self.pressure = False
        self.requested_at = 0.0
        self.wait_kind = ""
        self.held_milli = 0
        self.held_since = 0.0

    def event_time(self) -> float:
        """When the cursor's event happens, with the waits so far added."""
        s, c = self.session, self.cursor
        if c == 0:
            base = s.start
        elif c <= 2 * len(s.cells):
            cell = s.cells[(c - 1) // 2]
            base = cell.start if c % 2 else cell.end
        else:
            base = s.end
        return base + self.offset


class _Replay:
    """One replay of a trace under one mode."""

    def __init__(
        self,
        mode: str,
        sessions: list[Session],
        profiles: Mapping[str, GpuProfile],
        policy: Policy,
        inventory: GpuInventory,
        delays: DelayModel,
        strategy: str,
        grow: bool,
    ) -> None:
        self.mode = mode
        if mode != "pressure":
            policy = replace(policy, pressure_idle_minimum=0.0)
        self.policy = without_warnings(policy) if mode == "cull_shutdown" else policy
        self.gpu_signal = mode in ("policy", "pressure")
        self.threshold = policy.defaults.gpu_idle_threshold
        self.delays = delays
        self.allocator = SliceAllocator(inventory, strategy=strategy)
        #: "As many GPUs as needed": add a device of the same model whenever a size does not fit,
        #: so the device count ends at the peak that the allocator's placement needs (cheaper than
        #: starting with one device per session: placement scans every device).
        self.grow = grow
        self.runs = [_Run(s, profiles[s.size]) for s in sessions]
        self.sizes = dict(profiles)
        self.heap: list[tuple[float, int, int, int, _Run | None]] = []
        self.seq = 0
        self.queue = SliceQueue()
        self.waiting: dict[str, _Run] = {}
        #: Simulated GPUs (nodes) that have pulled the kernel image already.
        self.pulled: set[str] = set()
        #: User -> slices their kernels hold.
        self.holding: dict[str, int] = {}
        self.running: dict[int, _Run] = {}
        self.hibernated: dict[int, _Run] = {}
        #: Checkpoints being written, and the policy hibernations waiting for one to finish.
        self.checkpointing = 0
        self.hibernation_queue: deque[_Run] = deque()
        self.queued_for_hibernation: set[int] = set()
        self.device_holders: dict[str, int] = {}
        self.held_milli = 0
        self.gpu_milli_seconds = 0.0
        self.resume_waits: list[float] = []
        self.result = Result()
        self.active = len(self.runs)

    # -- the heap --------------------------------------------------------------------------

    def push(self, when: float, priority: int, kind: int, run: _Run | None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, priority, self.seq, kind, run))

    def run(self) -> Result:
        for each in self.runs:
            self.push(each.event_time(), _SESSION, _SESSION, each)
        ticks = self.mode != "static" and self.policy.enabled
        if ticks and self.runs:
            self.push(self.policy.interval, _TICK, _TICK, None)
        events = 0
        while self.heap:
            now, _priority, _seq, kind, run = heapq.heappop(self.heap)
            events += 1
            if kind == _TICK:
                if self.active:
                    self.tick(now)
                    self.push(now + self.policy.interval, _TICK, _TICK, None)
            elif kind == _SESSION:
                assert run is not None
                self.session_event(run, now)
            elif kind == _HIBERNATED:
                assert run is not None
                self.hibernation_done(run, now)
            else:
                assert run is not None
                self.ready(run, now)
        self.result.events = events
        self.result.gpu_hours = self.gpu_milli_seconds / MILLI / 3600
        self.result.resume_wait_p50_s = percentile(self.resume_waits, 50)
        self.result.resume_wait_p95_s = percentile(self.resume_waits, 95)
        return self.result

    # -- slices ----------------------------------------------------------------------------

    def take(self, run: _Run, now: float) -> float:
        """Allocate ``run``'s slice; the pod's delay before its kernel starts (Kubernetes)."""
        granted = self.allocator.allocate(run.session.id, run.profile)
        run.held_milli = sum(p.milli for p in granted.placements)
        run.held_since = now
        for p in granted.placements:
            self.device_holders[p.device_uuid] = self.device_holders.get(p.device_uuid, 0) + 1
        self.held_milli += run.held_milli
        self.result.peak_gpus = max(self.result.peak_gpus, len(self.device_holders))
        self.result.peak_gpus_held = max(self.result.peak_gpus_held, self.held_milli / MILLI)
        self.result.timeline.append((now, self.held_milli / MILLI))
        user = run.session.user or run.session.id
        self.holding[user] = self.holding.get(user, 0) + 1
        fresh = {p.device_uuid for p in granted.placements} - self.pulled
        self.pulled |= fresh
        return self.delays.pod_s + (self.delays.pull_s if fresh else 0.0)

    def give_back(self, run: _Run, now: float) -> None:
        granted = self.allocator.release(run.session.id)
        if granted is None:
            return
        user = run.session.user or run.session.id
        self.holding[user] -= 1
        if not self.holding[user]:
            del self.holding[user]
        self.gpu_milli_seconds += run.held_milli * (now - run.held_since)
        for p in granted.placements:
            left = self.device_holders[p.device_uuid] - 1
            if left:
                self.device_holders[p.device_uuid] = left
            else:
                del self.device_holders[p.device_uuid]
        self.held_milli -= run.held_milli
        run.held_milli = 0
        self.result.timeline.append((now, self.held_milli / MILLI))
        self.serve(now)

    def ask(self, run: _Run, kind: str, requested_at: float, now: float) -> None:
        """A start, resume or restart asks for a slice; it waits in line if none fits."""
        run.wait_kind, run.requested_at = kind, requested_at
        if self.grow:
            self.make_room(run.profile)
        if not len(self.queue) and self.allocator.fits(run.profile):
            self.grant(run, now)
        else:
            run.state = "waiting"
            key = run.session.id
            self.queue.join(key, run.session.user or key, run.profile.name, now, run.profile.queue_priority)
            self.waiting[key] = run

    def make_room(self, profile: GpuProfile) -> None:
        """Add empty devices, like the last one, until ``profile`` fits."""
        while not self.allocator.fits(profile):
            current = self.allocator.inventory
            model = current.devices[-1]
            count = len(current) + max(1, profile.whole_gpus)
            grown = simulated_inventory(count, model.memory_mib, model.name)
            self.allocator.replace_inventory(grown)

    def serve(self, now: float) -> None:
        """Hand freed capacity to waiting kernels in the queue's order (a smaller size may go
        before a bigger one that does not fit, a bounded number of times)."""
        fits = self.fits_size
        granted = True
        while granted and len(self.queue):
            granted = False
            for waiter in self.queue.order(self.held_by):
                if self.queue.may_take(waiter.key, fits, held=self.held_by):
                    self.queue.granted(waiter.key, now, self.held_by)
                    self.grant(self.waiting.pop(waiter.key), now)
                    granted = True
                    break

    def held_by(self) -> dict[str, int]:
        """Slices each user's kernels hold now (the queue's fair share counts them)."""
        return self.holding

    def fits_size(self, size: str) -> bool:
        return self.allocator.fits(self.sizes[size])

    def grant(self, run: _Run, now: float) -> None:
        pod = self.take(run, now)
        waited = now - run.requested_at
        if waited > 0:
            self.result.slice_waits += 1
            self.result.slice_wait_total_s += waited
            self.result.slice_wait_max_s = max(self.result.slice_wait_max_s, waited)
        if run.wait_kind == "start":
            run.cursor += 1
            if pod:  # the notebook waits for its pod; ready() moves the session on by the whole wait
                run.state = "starting"
                self.push(now + pod, _READY, _READY, run)
                return
            run.offset += waited
            self.become_running(run, now)
            self.push(run.event_time(), _SESSION, _SESSION, run)
            return
        if run.wait_kind == "resume":
            delay = pod + self.delays.resume(run.session.state_mib)
            self.result.resumes += 1
        else:
            delay = pod + self.delays.start_s
            self.result.restarts_state_lost += 1
        self.resume_waits.append(waited + delay)
        run.state = "resuming"
        self.push(now + delay, _READY, _READY, run)

    # -- events ----------------------------------------------------------------------------

    def become_running(self, run: _Run, now: float) -> None:
        run.state = "running"
        run.started = now
        run.gpu_idle_since = now
        run.warned_at, run.busy_warned = None, False
        self.running[id(run)] = run

    def ready(self, run: _Run, now: float) -> None:
        """A resume or restart finished: the waiting cell runs now, the session later by the wait."""
        run.offset += now - run.requested_at
        self.become_running(run, now)
        self.push(run.event_time(), _SESSION, _SESSION, run)

    def session_event(self, run: _Run, now: float) -> None:
        cells = run.session.cells
        c = run.cursor
        if c == 0:
            self.ask(run, "start", now, now)
            return
        if c > 2 * len(cells):
            self.finish(run, now)
            return
        cell = cells[(c - 1) // 2]
        if c % 2:  # a cell starts
            if run.state == "hibernating":
                run.pending, run.requested_at = True, now
                return
            if run.state == "hibernated":
                self.hibernated.pop(id(run), None)
                self.ask(run, "resume", now, now)
                return
            if run.state == "gone":
                self.ask(run, "restart", now, now)
                return
            run.busy = True
            run.last_execution = now
            run.gpu_busy = cell.gpu_util > self.threshold
        else:  # a cell ends
            run.busy = False
            run.last_execution = now
            if run.gpu_busy:
                run.gpu_busy = False
                run.gpu_idle_since = now
        run.cursor += 1
        self.push(run.event_time(), _SESSION, _SESSION, run)

    def finish(self, run: _Run, now: float) -> None:
        self.running.pop(id(run), None)
        self.queued_for_hibernation.discard(id(run))  # its queue entry is skipped: state "done"
        self.hibernated.pop(id(run), None)
        self.give_back(run, now)
        run.state = "done"
        self.active -= 1

    def hibernation_done(self, run: _Run, now: float) -> None:
        self.give_back(run, now)
        self.checkpointing -= 1
        self.next_hibernation(now)
        if run.state != "hibernating":
            return  # the session ended while the checkpoint was written
        run.state = "hibernated"
        run.hibernated_at = now
        self.hibernated[id(run)] = run
        if run.pending:
            run.pending = False
            self.hibernated.pop(id(run), None)
            self.ask(run, "resume", run.requested_at, now)

    # -- the culler ------------------------------------------------------------------------

    def snapshot(self, run: _Run, now: float, state: KernelState) -> KernelSnapshot:
        """What :meth:`kernelmgr.server.culler.Culler.snapshot` would see for this kernel."""
        return KernelSnapshot(
            kernel_id=run.session.id,
            profile=run.profile.name,
            state=state,
            execution_state="busy" if run.busy else "idle",
            started=run.started,
            last_execution=run.last_execution,
            gpu_available=self.gpu_signal,
            gpu_idle_seconds=(0.0 if run.gpu_busy else now - run.gpu_idle_since) if self.gpu_signal else None,
            hibernated_at=run.hibernated_at,
            warned_at=run.warned_at,
            busy_warned=run.busy_warned,
        )

    def start_hibernation(self, run: _Run, now: float) -> None:
        """The checkpoint starts: the slice is held until it is written."""
        del self.running[id(run)]
        run.state = "hibernating"
        self.result.hibernations += 1
        self.checkpointing += 1
        self.push(now + self.delays.checkpoint(run.session.state_mib), _READY, _HIBERNATED, run)

    def next_hibernation(self, now: float) -> None:
        """A slot is free: the queued hibernations whose turn it is ask the policy again."""
        while self.hibernation_queue and self.checkpointing < self.policy.max_concurrent_hibernations:
            run = self.hibernation_queue.popleft()
            if id(run) not in self.queued_for_hibernation:
                continue  # its session ended while it waited
            self.queued_for_hibernation.discard(id(run))
            pressure = run.pressure and len(self.queue) > 0
            decision = decide(self.policy, self.snapshot(run, now, KernelState.RUNNING), now, pressure)
            if decision.action is Action.HIBERNATE:
                self.start_hibernation(run, now)
            else:
                self.result.hibernations_dropped += 1

    def tick(self, now: float) -> None:
        """One culler pass, in the order :meth:`kernelmgr.server.culler.Culler.tick` takes."""
        policy = self.policy
        snapshots = {id(run): self.snapshot(run, now, KernelState.RUNNING) for run in self.running.values()}
        # As the server's culler: the waiting kernels, less the hibernations that will free a slice.
        waiting = len(self.queue) - self.checkpointing - len(self.queued_for_hibernation)
        pressured = set(under_pressure(policy, list(snapshots.values()), now, waiting))
        for run in list(self.running.values()):
            pressure = run.session.id in pressured
            reviewed = review(policy, snapshots[id(run)], now, pressure)
            if reviewed.warning_cancelled:
                run.warned_at = None
                run.pressure = False
            if not run.busy:
                run.busy_warned = False
            action = reviewed.decision.action
            if action is Action.NOTHING:
                continue
            if action in (Action.WARN, Action.HIBERNATE):
                run.pressure = pressure
            if action is Action.WARN:
                run.warned_at = now
                self.result.warnings += 1
            elif action is Action.WARN_BUSY:
                run.busy_warned = True
                self.result.busy_warnings += 1
            elif action is Action.HIBERNATE:
                if self.mode == "cull_shutdown":
                    del self.running[id(run)]
                    run.state = "gone"
                    self.give_back(run, now)
                elif id(run) in self.queued_for_hibernation:
                    continue  # waiting its turn already (the server never schedules one twice)
                elif self.checkpointing < policy.max_concurrent_hibernations:
                    self.start_hibernation(run, now)
                else:
                    self.queued_for_hibernation.add(id(run))
                    self.hibernation_queue.append(run)
                    self.result.hibernations_queued += 1
        for run in list(self.hibernated.values()):
            decision = decide(policy, self.snapshot(run, now, KernelState.HIBERNATED), now)
            if decision.action is Action.REMOVE:
                del self.hibernated[id(run)]
                run.state = "gone"
                self.result.removals += 1


def simulate(
    sessions: list[Session],
    profiles: Mapping[str, GpuProfile],
    policy: Policy,
    inventory: GpuInventory | None = None,
    delays: DelayModel | None = None,
    strategy: str = "binpack",
    modes: Iterable[str] = MODES,
) -> dict[str, Result]:
    """Replay ``sessions`` under each mode; ``inventory`` ``None`` means as many GPUs as needed."""
    grow = inventory is None
    if inventory is None:
        inventory = simulated_inventory(1)
    widest = max((profiles[s.size].whole_gpus for s in sessions), default=1)
    probe = SliceAllocator(simulated_inventory(max(1, widest)) if grow else inventory, strategy=strategy)
    for session in sessions:
        if not probe.ever_fits(profiles[session.size]):
            raise TraceError(
                f"session {session.id!r}.size: GPU size {session.size!r} can never fit on the simulated GPUs "
                f"({len(inventory)} x {next(iter(inventory)).memory_mib if len(inventory) else 0} MiB)"
            )
    days = sum(s.duration for s in sessions) / 86400
    results: dict[str, Result] = {}
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; modes are {', '.join(MODES)}")
        if mode == "pressure" and policy.pressure_idle_minimum <= 0:
            continue  # nothing to compare: CullPolicy.pressure_idle_minimum is not set
        replay = _Replay(mode, sessions, profiles, policy, inventory, delays or DelayModel(), strategy, grow)
        result = replay.run()
        result.resumes_per_session_day = result.resumes / days if days else 0.0
        results[mode] = result
    static = results.get("static")
    if static is not None:
        for result in results.values():
            result.ratio_to_static = result.gpu_hours / static.gpu_hours if static.gpu_hours else 1.0
    return results
