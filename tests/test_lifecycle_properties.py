"""Random interleavings of everything users and admins do, against the lifecycle controller.

The controller (``kernelmgr/core/controller.py``) is the code that runs in the server; only
the platform under it is simulated here, faithfully to what the local platform does: a launch
takes the slice before the process exists, a stop or kill ends the process before the slice
is released, a checkpoint writes the namespace's current version and may fail (full disk) or
find the process dead, a launch may fail or hang past its timeout, a process may crash, and
every step yields to the event loop a random number of times so operations interleave.

Events: cells (which wake a hibernated kernel, as the websocket does), API/policy
hibernations, resumes, interrupts while waiting for a slice, deletes and TTL removals,
crashes, and losses: a process or pod that vanishes unasked (its node gone: no last
checkpoint; evicted: it checkpoints itself at SIGTERM first; deleted with no grace: its
checkpoint is committed only after the server read the newest one), at any moment, including
during a hibernation or a resume. A loss is seen by the provisioner's poll (``settle``) as the
provisioners do: a running kernel with a checkpoint is taken over (``KernelStates.taken_over``)
and hibernated from its newest checkpoint by ``LifecycleController.lost``; one without dies as
a crash does. The resume of a lost kernel first takes a checkpoint committed after the loss
was read, then tells the notebook what was lost (``lost_note``). Launches take the plan the
platform hands them (``LaunchPlan``), as the provisioners do.

Invariants, checked as the run goes and once everything has settled:

* a process always holds a slice; once settled, a slice is held only by a live process;
* no process belongs to a removed kernel, and a removed kernel has no checkpoint;
* a slice is released for a hibernation (asked or after a loss) only once a checkpoint is
  committed, and a process is stopped for hibernation only when the committed checkpoint
  holds its latest state; a resume restores a committed checkpoint holding the newest
  committed state, and a launch takes exactly the plan handed to it, once;
* a lost kernel's slice is freed exactly once, by its takeover;
* one state at a time: every move starts from the state the last one ended in, and a
  ``hibernated`` kernel has no process and no slice;
* a note that says a lost kernel saved everything at its stop is true: the restored state is
  the one it had when it vanished;
* once settled, no kernel is ``hibernating`` or ``resuming``, and the controller keeps no
  bookkeeping for removed kernels.

``ELASTIC_PROPERTY_EXAMPLES`` sets the number of random runs (default 300).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelmgr.core.allocator import SliceAllocator
from kernelmgr.core.controller import Committed, KernelStates, LifecycleController, LifecycleError
from kernelmgr.core.inventory import GpuInventory
from kernelmgr.core.kernels import KernelRegistry, LaunchPlan, Loss, ManagedKernel
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.profiles import parse_profiles
from kernelmgr.lifecycle.loss import saved_at_stop

pytestmark = pytest.mark.pure

S = KernelState
EXAMPLES = int(os.environ.get("ELASTIC_PROPERTY_EXAMPLES", "300"))
PROFILES = parse_profiles({"half": {"gpu_fraction": 0.5, "memory_mib": 1000}})
KERNELS = ["k0", "k1", "k2"]  # three kernels of half a GPU on one GPU: they compete for slices


class Violation(AssertionError):
    pass


@dataclass
class Vanished:
    """A process gone unasked, until the provisioner's poll reports it."""

    why: str
    version: int  # the state it had when it went
    stop_began: float | None  # when it was told to stop (None: its node vanished)
    late_commit: bool = False  # it commits its SIGTERM checkpoint after the server read the newest


@dataclass
class SimKernel:
    process: bool = False
    version: int = 0  # the namespace's state; a cell bumps it
    disk: list[tuple[str, int, float]] = field(default_factory=list)  # committed (id, version, created)
    removed: bool = False
    vanished: Vanished | None = None


class WatchedStates(KernelStates):
    """The real state writer, checking that each move starts where the last one ended."""

    def __init__(self, registry: KernelRegistry) -> None:
        super().__init__(registry)
        self.last: dict[str, KernelState] = {}

    def move(self, record: ManagedKernel, state: KernelState, reason: str) -> None:
        seen = self.last.get(record.kernel_id, record.state)
        if seen is not record.state:
            raise Violation(
                f"{record.kernel_id} moved from {record.state}, but the last move ended in {seen}"
            )
        super().move(record, state, reason)
        self.last[record.kernel_id] = state

    def ended(self, kernel_id: str, reason: str) -> None:
        super().ended(kernel_id, reason)
        record = self.registry.get(kernel_id)
        if record is not None:
            self.last[kernel_id] = record.state

    def dead(self, record: ManagedKernel, reason: str) -> None:
        super().dead(record, reason)
        self.last[record.kernel_id] = record.state


class SimPlatform:
    """The local platform's behaviour, with random delays and faults."""

    def __init__(
        self, rng: random.Random, allocator: SliceAllocator, registry: KernelRegistry, states: KernelStates
    ) -> None:
        self.rng = rng
        self.allocator = allocator
        self.registry = registry
        self.states = states
        self.kernels = {kid: SimKernel(process=True) for kid in KERNELS}
        self.commits = 0
        self.clock = 1000.0
        self.controller: LifecycleController | None = None  # set by the scenario
        self.lost_frees: dict[str, int] = {}  # slices freed while a loss is taken over

    def operation(self, kernel_id: str) -> str:
        return self.controller.in_flight(kernel_id) if self.controller is not None else ""

    def commit(self, kernel_id: str, version: int) -> Committed:
        self.commits += 1
        self.clock += 1
        checkpoint_id = f"ckpt-{self.commits}"
        self.kernels[kernel_id].disk.append((checkpoint_id, version, self.clock))
        return Committed(checkpoint_id, self.clock, 10)

    def newest(self, kernel_id: str) -> Committed | None:
        disk = self.kernels[kernel_id].disk
        return Committed(disk[-1][0], disk[-1][2], 10) if disk else None

    async def pause(self) -> None:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)

    def check(self) -> None:
        """The invariants that hold at every moment."""
        for kid, sim in self.kernels.items():
            if sim.process and self.allocator.slice_of(kid) is None:
                raise Violation(f"{kid} has a process but no slice")
            if sim.removed and (sim.process or sim.disk):
                raise Violation(f"removed {kid} left a process or a checkpoint")
            record = self.registry.get(kid)
            hibernated = record is not None and record.state is S.HIBERNATED
            if hibernated and (sim.process or self.allocator.slice_of(kid) is not None):
                raise Violation(f"hibernated {kid} still has a process or a slice")

    async def ensure_idle(self, kernel_id: str) -> None:
        await self.pause()

    async def checkpoint(self, kernel_id: str) -> Committed:
        sim = self.kernels[kernel_id]
        await self.pause()
        if not sim.process:
            raise LifecycleError("the kernel process died while writing its checkpoint", 500)
        if self.rng.random() < 0.15:
            raise LifecycleError("OSError: [Errno 28] No space left on device", 507)
        version = sim.version
        await self.pause()
        if not sim.process:
            raise LifecycleError("the kernel process died while writing its checkpoint", 500)
        return self.commit(kernel_id, version)

    async def stop(self, kernel_id: str) -> None:
        sim = self.kernels[kernel_id]
        if sim.process and (not sim.disk or sim.disk[-1][1] != sim.version):
            raise Violation(f"{kernel_id} stopped for hibernation with state not committed")
        await self.pause()
        sim.process = False

    async def kill(self, kernel_id: str) -> None:
        await self.pause()
        self.kernels[kernel_id].process = False

    async def launch(self, kernel_id: str, restore: Committed | None, timeout: float) -> None:
        sim = self.kernels[kernel_id]
        if sim.removed:
            raise Violation(f"launching removed kernel {kernel_id}")
        record = self.registry.get(kernel_id)
        assert record is not None
        # As JupyterKernelPlatform and the provisioners: the platform hands the plan, the
        # launch's claim_slice registers the start and takes the plan, then the slice.
        record.hand_launch_plan(LaunchPlan.restoring(restore))
        await self.pause()
        self.states.starting(kernel_id, record.kernelspec, record.profile, record.owner)
        plan = record.take_launch_plan()
        if plan != LaunchPlan.restoring(restore) or record.take_launch_plan() != LaunchPlan():
            raise Violation(f"{kernel_id}'s launch took {plan}, not once the plan it was handed")
        self.allocator.allocate(kernel_id, PROFILES["half"])
        await self.pause()
        if self.rng.random() < 0.1:
            raise LifecycleError("kernel process failed to launch", 500)
        sim.process = True
        sim.vanished = None
        if restore is not None:
            kept = {checkpoint_id: version for checkpoint_id, version, _ in sim.disk}
            if restore.checkpoint_id not in kept or kept[restore.checkpoint_id] != sim.disk[-1][1]:
                raise Violation(
                    f"{kernel_id} restored {restore.checkpoint_id}, not the newest committed state"
                )
            sim.version = kept[restore.checkpoint_id]
        else:
            sim.version = 0
        self.states.launched(kernel_id, "process launched")
        await self.pause()
        if self.rng.random() < 0.1:
            raise LifecycleError(f"the kernel did not answer within {timeout:g}s", 504)

    def release_slice(self, kernel_id: str) -> None:
        record = self.registry.get(kernel_id)
        if record is not None and record.state is S.HIBERNATING and not self.kernels[kernel_id].disk:
            raise Violation(f"{kernel_id}'s slice released for a hibernation with no committed checkpoint")
        if self.allocator.release(kernel_id) is not None and self.operation(kernel_id) == "lost":
            self.lost_frees[kernel_id] = self.lost_frees.get(kernel_id, 0) + 1

    async def discard_checkpoints(self, kernel_id: str) -> None:
        await self.pause()
        self.kernels[kernel_id].disk.clear()

    def persist(self, kernel_id: str) -> None:
        self.check()


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "cell",
                "hibernate",
                "resume",
                "interrupt",
                "delete",
                "crash",
                "settle",
                "vanish",
                "evict",
                "drop",
            ]
        ),
        st.sampled_from(KERNELS),
    ),
    min_size=1,
    max_size=25,
)


async def scenario(events: list[tuple[str, str]], seed: int) -> None:
    rng = random.Random(seed)
    inventory = GpuInventory.declared([{"uuid": "GPU-0", "name": "Sim", "memory_mib": 4000}])
    allocator = SliceAllocator(inventory)
    registry = KernelRegistry()
    states = WatchedStates(registry)
    platform = SimPlatform(rng, allocator, registry, states)
    controller = LifecycleController(
        registry,
        allocator,
        PROFILES.__getitem__,
        platform,
        start_timeout=1.0,
        busy_retry=0.001,
        states=states,
    )
    platform.controller = controller
    for kid in KERNELS[:2]:  # two start running; the third starts hibernated with a checkpoint
        registry.register(kid, "python3-gpu-half", "half", "alice", state=S.RUNNING)
        allocator.allocate(kid, PROFILES["half"])
    third = KERNELS[2]
    registry.register(third, "python3-gpu-half", "half", "alice", state=S.HIBERNATED)
    platform.kernels[third] = SimKernel(process=False, version=7, disk=[("ckpt-0", 7, 999.0)])
    third_record = registry.get(third)
    assert third_record is not None
    third_record.committed = Committed("ckpt-0", 999.0, 10)

    tasks: list[asyncio.Task[object]] = []

    async def quietly(operation: object) -> None:
        # Refused or failed with a message is allowed; the invariants say what must hold.
        with contextlib.suppress(LifecycleError):
            await operation  # type: ignore[misc]

    def background(operation: object) -> None:
        tasks.append(asyncio.ensure_future(quietly(operation)))

    async def delete(kid: str) -> None:
        await controller.remove(kid)
        platform.kernels[kid].removed = True
        platform.check()

    async def take_over(kid: str, gone: Vanished) -> None:
        """``KernelLoss.lost``: hibernate from the newest checkpoint, then the loss on the record."""
        committed = platform.newest(kid)
        record = registry.get(kid)
        if committed is None:  # its checkpoints went meanwhile (a delete): it dies
            platform.release_slice(kid)
            if record is not None:
                states.dead(record, f"lost ({gone.why}) with no readable checkpoint")
            return
        if gone.late_commit and not platform.kernels[kid].removed:
            platform.commit(kid, gone.version)  # committed after the server read the newest
        freed = platform.lost_frees.get(kid, 0)
        if await controller.lost(kid, gone.why, committed) is None or record is None:
            return
        if platform.lost_frees.get(kid, 0) - freed != 1:
            raise Violation(f"lost {kid}'s slice freed {platform.lost_frees.get(kid, 0) - freed} times")
        record.loss = Loss(gone.why, committed, gone.stop_began)

    async def resume(kid: str, reason: str) -> None:
        """``Hibernator.resume``: a lost kernel takes a newer checkpoint first, and is told after."""
        record = registry.get(kid)
        lost = record.loss if record is not None else None
        if record is not None and lost is not None:  # KernelLoss.take_newer_checkpoint
            newest = platform.newest(kid)
            if newest is not None and newest.created > lost.committed.created:
                record.committed = lost.committed = newest
        await controller.resume(kid, reason)
        if record is None or lost is None or record.loss is not lost:
            return
        record.loss = None
        gone_at = platform.kernels[kid].disk
        restored = next(version for cid, version, _ in gone_at if cid == lost.committed.checkpoint_id)
        if saved_at_stop(lost.committed, lost.stop_began) and restored != vanished_at[kid]:
            raise Violation(f"{kid} was told nothing was lost, but restored state {restored}")

    vanished_at: dict[str, int] = {}

    def vanish(kid: str, how: str) -> None:
        """Its process or pod goes unasked; an evicted kernel checkpoints itself first."""
        sim = platform.kernels[kid]
        if not sim.process:
            return
        platform.clock += 1
        stop_began = platform.clock if how != "vanish" else None
        gone = Vanished(how, sim.version, stop_began, late_commit=how == "drop")
        if how == "evict":
            platform.commit(kid, sim.version)  # the SIGTERM checkpoint, within the grace period
        sim.process = False
        sim.vanished = gone

    def reap() -> None:
        """The provisioner's poll: a running kernel whose process is gone is taken over if it has
        a checkpoint (a loss), else it is dead; a taken-over kernel reports no exit."""
        for kid, sim in platform.kernels.items():
            record = registry.get(kid)
            if record is None or record.state is not S.RUNNING or sim.process or record.taken_over:
                if record is not None and record.state is S.HIBERNATED:
                    sim.vanished = None  # no process to report on; the next launch starts anew
                continue
            gone, sim.vanished = sim.vanished, None
            if gone is not None and sim.disk:
                states.taken_over(record, gone.why)
                vanished_at[kid] = gone.version
                background(take_over(kid, gone))
                continue
            allocator.release(kid)
            states.ended(kid, "crashed")

    for event, kid in events:
        sim = platform.kernels[kid]
        record = registry.get(kid)
        if event == "cell" and record is not None:
            if record.state is S.RUNNING and sim.process and not controller.in_flight(kid):
                sim.version += 1
            elif record.state in (S.HIBERNATED, S.RESUMING):
                background(resume(kid, "execute"))
        elif event == "hibernate":
            background(controller.hibernate(kid, rng.choice(["api", "policy", "server shutdown"])))
        elif event == "resume":
            background(resume(kid, "api"))
        elif event in ("vanish", "evict", "drop"):
            vanish(kid, event)
        elif event == "interrupt":
            controller.cancel_wait(kid)
        elif event == "delete" and not sim.removed:
            background(delete(kid))
        elif event == "settle":
            reap()
        elif event == "crash" and sim.process:
            sim.process = False  # what the provisioner's poll sees: the slice goes with the process
            allocator.release(kid)
            states.ended(kid, "crashed")
        await platform.pause()
        platform.check()

    # A resume waiting for a slice waits until one frees up or the user interrupts: at the
    # end of the run every user gives up waiting, so that everything settles (a last poll may
    # take a lost kernel over: that settles too).
    while True:
        while not all(task.done() for task in tasks):
            for kid in KERNELS:
                controller.cancel_wait(kid)
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        started = len(tasks)
        reap()
        if len(tasks) == started:
            break
    platform.check()
    for kid, sim in platform.kernels.items():
        record = registry.get(kid)
        if sim.removed:
            assert record is None and not sim.process and not sim.disk
            continue
        assert record is not None
        assert record.state not in (S.HIBERNATING, S.RESUMING), (kid, record.state, record.lifecycle.reason)
        holds = allocator.slice_of(kid) is not None
        assert holds == sim.process, (kid, record.state, "slice held" if holds else "no slice")
        if record.state is S.HIBERNATED:
            assert sim.disk and record.committed is not None
            kept = {checkpoint_id: version for checkpoint_id, version, _ in sim.disk}
            assert record.committed.checkpoint_id in kept
            if record.loss is None:  # a lost kernel may have committed later: its resume takes it
                assert kept[record.committed.checkpoint_id] == sim.disk[-1][1]
        if record.state is S.RUNNING:
            assert sim.process
    assert not controller.busy_kernels()
    assert controller.slot_count() <= sum(1 for sim in platform.kernels.values() if not sim.removed)


@settings(max_examples=EXAMPLES, deadline=None)
@given(events=EVENTS, seed=st.integers(0, 2**32 - 1))
def test_random_interleavings_keep_the_invariants(events: list[tuple[str, str]], seed: int) -> None:
    asyncio.run(scenario(events, seed))
