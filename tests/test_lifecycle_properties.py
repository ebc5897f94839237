"""Random interleavings of everything users and admins do, against the lifecycle controller.

The controller (``kernelmgr/core/controller.py``) is the code that runs in the server; only
the platform under it is simulated here, faithfully to what the local platform does: a launch
takes the slice before the process exists, a stop or kill ends the process before the slice
is released, a checkpoint writes the namespace's current version and may fail (full disk) or
find the process dead, a launch may fail or hang past its timeout, a process may crash, and
every step yields to the event loop a random number of times so operations interleave.

Events: cells (which wake a hibernated kernel, as the websocket does), API/policy
hibernations, resumes, interrupts while waiting for a slice, deletes and TTL removals,
crashes. Invariants, checked as the run goes and once everything has settled:

* a process always holds a slice; once settled, a slice is held only by a live process;
* no process belongs to a removed kernel, and a removed kernel has no checkpoint;
* a process is stopped for hibernation only when the committed checkpoint holds its latest
  state, and a resume restores exactly the newest committed checkpoint (nothing lost);
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
from kernelmgr.core.controller import Committed, LifecycleController, LifecycleError
from kernelmgr.core.inventory import GpuInventory
from kernelmgr.core.kernels import KernelRegistry
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.profiles import parse_profiles

pytestmark = pytest.mark.pure

S = KernelState
EXAMPLES = int(os.environ.get("ELASTIC_PROPERTY_EXAMPLES", "300"))
PROFILES = parse_profiles({"half": {"gpu_fraction": 0.5, "memory_mib": 1000}})
KERNELS = ["k0", "k1", "k2"]  # three kernels of half a GPU on one GPU: they compete for slices


class Violation(AssertionError):
    pass


@dataclass
class SimKernel:
    process: bool = False
    version: int = 0  # the namespace's state; a cell bumps it
    disk: list[tuple[str, int]] = field(default_factory=list)  # committed checkpoints (id, version)
    removed: bool = False


class SimPlatform:
    """The local platform's behaviour, with random delays and faults."""

    def __init__(self, rng: random.Random, allocator: SliceAllocator) -> None:
        self.rng = rng
        self.allocator = allocator
        self.kernels = {kid: SimKernel(process=True) for kid in KERNELS}
        self.commits = 0
        self.clock = 1000.0

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
        self.commits += 1
        self.clock += 1
        checkpoint_id = f"ckpt-{self.commits}"
        sim.disk.append((checkpoint_id, version))
        return Committed(checkpoint_id, self.clock, 10)

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
        self.allocator.allocate(kernel_id, PROFILES["half"])  # pre_launch takes the slice first
        await self.pause()
        if self.rng.random() < 0.1:
            raise LifecycleError("kernel process failed to launch", 500)
        sim.process = True
        if restore is not None:
            if not sim.disk or sim.disk[-1][0] != restore.checkpoint_id:
                raise Violation(f"{kernel_id} restored {restore.checkpoint_id}, not the newest commit")
            sim.version = sim.disk[-1][1]
        else:
            sim.version = 0
        await self.pause()
        if self.rng.random() < 0.1:
            raise LifecycleError(f"the kernel did not answer within {timeout:g}s", 504)

    def release_slice(self, kernel_id: str) -> None:
        self.allocator.release(kernel_id)

    async def discard_checkpoints(self, kernel_id: str) -> None:
        await self.pause()
        self.kernels[kernel_id].disk.clear()

    def persist(self, kernel_id: str) -> None:
        self.check()


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["cell", "hibernate", "resume", "interrupt", "delete", "crash", "settle"]),
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
    platform = SimPlatform(rng, allocator)
    controller = LifecycleController(
        registry, allocator, PROFILES.__getitem__, platform, start_timeout=1.0, busy_retry=0.001
    )
    for kid in KERNELS[:2]:  # two start running; the third starts hibernated with a checkpoint
        registry.register(kid, "python3-gpu-half", "half", "alice", state=S.RUNNING)
        allocator.allocate(kid, PROFILES["half"])
    third = KERNELS[2]
    registry.register(third, "python3-gpu-half", "half", "alice", state=S.HIBERNATED)
    platform.kernels[third] = SimKernel(process=False, version=7, disk=[("ckpt-0", 7)])
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

    def reap() -> None:
        """The reaper's poll: a running kernel whose process is gone is dead (as the provisioner does)."""
        for kid, sim in platform.kernels.items():
            record = registry.get(kid)
            if record is not None and record.state is S.RUNNING and not sim.process:
                allocator.release(kid)
                record.lifecycle.move(S.DEAD, "crashed")

    for event, kid in events:
        sim = platform.kernels[kid]
        record = registry.get(kid)
        if event == "cell" and record is not None:
            if record.state is S.RUNNING and sim.process and not controller.in_flight(kid):
                sim.version += 1
            elif record.state in (S.HIBERNATED, S.RESUMING):
                background(controller.resume(kid, "execute"))
        elif event == "hibernate":
            background(controller.hibernate(kid, rng.choice(["api", "policy", "server shutdown"])))
        elif event == "resume":
            background(controller.resume(kid, "api"))
        elif event == "interrupt":
            controller.cancel_wait(kid)
        elif event == "delete" and not sim.removed:
            background(delete(kid))
        elif event == "settle":
            reap()
        elif event == "crash" and sim.process:
            sim.process = False  # what the provisioner's poll sees: the slice goes with the process
            allocator.release(kid)
            if record is not None and record.state is S.RUNNING:
                record.lifecycle.move(S.DEAD, "crashed")
        await platform.pause()
        platform.check()

    # A resume waiting for a slice waits until one frees up or the user interrupts: at the
    # end of the run every user gives up waiting, so that everything settles.
    while not all(task.done() for task in tasks):
        for kid in KERNELS:
            controller.cancel_wait(kid)
        await asyncio.sleep(0.001)
    await asyncio.gather(*tasks)
    reap()
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
            assert (
                sim.disk
                and record.committed is not None
                and record.committed.checkpoint_id == sim.disk[-1][0]
            )
        if record.state is S.RUNNING:
            assert sim.process
    assert not controller.busy_kernels()
    assert controller.slot_count() <= sum(1 for sim in platform.kernels.values() if not sim.removed)


@settings(max_examples=EXAMPLES, deadline=None)
@given(events=EVENTS, seed=st.integers(0, 2**32 - 1))
def test_random_interleavings_keep_the_invariants(events: list[tuple[str, str]], seed: int) -> None:
    asyncio.run(scenario(events, seed))
