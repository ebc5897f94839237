"""Bounded, non-blocking culling and what a held websocket does with what it cannot deliver.

Two kinds of tests:

* in-process, deterministic: the :class:`BoundedScheduler`, the culler's tick and the
  hibernate-on-shutdown helper with fake hibernations that finish only when the test says so
  (asyncio events), so "at most N at once" and "the tick does not wait" are checked by what
  has and has not started, never by timing;
* end to end, on a real server with real kernels and websockets: a checkpoint made slow by a
  *gate* — an object whose pickling waits until the test creates a file — so a hibernation
  stays in progress exactly as long as the test needs, and every assertion is about what
  happened while it was provably still in progress.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import websocket
from traitlets.config import Config

from kernelmgr.activity.nvml_double import NvmlDouble
from kernelmgr.config import CullPolicy, ElasticKernels, ElasticRuntime
from kernelmgr.core.controller import LifecycleError
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.policy import Action, build_policy
from kernelmgr.lifecycle.records import KernelStateFile
from kernelmgr.lifecycle.scheduler import BoundedScheduler, run_bounded
from kernelmgr.lifecycle.service import Hibernator
from kernelmgr.server.culler import Culler, Tombstones
from tests.conftest import INVENTORY, PROFILES
from tests.support.server import KernelChannel, Reply, RunningServer, start_server, wait_for

pytestmark = pytest.mark.pure

# -- in-process helpers ---------------------------------------------------------------------


async def settle(condition: Callable[[], bool] = lambda: False, turns: int = 50) -> None:
    """Let the event loop run ``turns`` rounds (or until ``condition``): ordering, not time."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)


class Gates:
    """Fake jobs that record when they start and finish only when released."""

    def __init__(self) -> None:
        self.events: dict[str, asyncio.Event] = {}
        self.started: list[str] = []
        self.finished: list[str] = []
        self.active = 0
        self.peak = 0

    def job(self, key: str) -> Callable[[], Awaitable[None]]:
        self.events[key] = asyncio.Event()

        async def run() -> None:
            self.started.append(key)
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                await self.events[key].wait()
            finally:
                self.active -= 1
                self.finished.append(key)

        return run

    async def release(self, key: str) -> None:
        self.events[key].set()
        await settle(lambda: key in self.finished)


# -- the scheduler --------------------------------------------------------------------------


def test_scheduler_runs_at_most_limit_jobs_in_order() -> None:
    async def scenario() -> None:
        scheduler = BoundedScheduler(2)
        gates = Gates()
        for key in "abcdef":
            assert scheduler.schedule(key, gates.job(key)) is True
        await settle()
        assert gates.started == ["a", "b"], "only `limit` jobs start; the rest wait their turn"
        assert scheduler.running == {"a", "b"} and scheduler.waiting == {"c", "d", "e", "f"}
        await gates.release("b")
        await settle(lambda: len(gates.started) == 3)
        await settle()
        assert gates.started == ["a", "b", "c"], "a finished job frees exactly one slot, first come first"
        for key in "acdef":
            await gates.release(key)
            await settle()
        await scheduler.join()
        assert gates.peak == 2 and scheduler.peak == 2
        assert gates.finished == list("bacdef")

    asyncio.run(scenario())


def test_scheduler_one_job_per_key_and_finished_jobs_forgotten() -> None:
    async def scenario() -> None:
        scheduler = BoundedScheduler(1)
        gates = Gates()
        assert scheduler.schedule("k", gates.job("k"))
        assert scheduler.schedule("k", gates.job("k-again")) is False, "in flight: not scheduled twice"
        assert "k" in scheduler and len(scheduler) == 1
        await settle()
        await gates.release("k")
        await scheduler.join()
        assert "k" not in scheduler and len(scheduler) == 0, "a finished job is dropped"
        assert gates.started == ["k"]
        assert scheduler.schedule("k", gates.job("k2")), "once finished, the key can be scheduled again"
        await settle()
        await gates.release("k2")
        await scheduler.join()

    asyncio.run(scenario())


def test_scheduler_failure_frees_its_slot_and_cancel_spares_running_jobs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        scheduler = BoundedScheduler(1, logging.getLogger("test-scheduler"), "test job")

        async def boom() -> None:
            raise RuntimeError("disk on fire")

        gates = Gates()
        scheduler.schedule("bad", boom)
        scheduler.schedule("slow", gates.job("slow"))
        scheduler.schedule("queued", gates.job("queued"))
        await settle(lambda: gates.started == ["slow"])
        assert gates.started == ["slow"], "the failed job gave its slot to the next one"
        assert scheduler.cancel_waiting() == ["queued"]
        await settle()
        assert "slow" in scheduler.running, "a running job is never cut off"
        await gates.release("slow")
        await scheduler.join()
        assert gates.started == ["slow"] and len(scheduler) == 0

    with caplog.at_level(logging.ERROR, "test-scheduler"):
        asyncio.run(scenario())
    assert "test job of bad failed" in caplog.text and "disk on fire" in caplog.text


def test_run_bounded_waits_for_all() -> None:
    async def scenario() -> None:
        gates = Gates()
        runner = asyncio.ensure_future(run_bounded("xyz", lambda key: gates.job(key)(), 2))
        await settle(lambda: len(gates.started) == 2)
        await settle()
        assert gates.started == ["x", "y"] and not runner.done()
        for key in "xyz":
            await settle(lambda key=key: key in gates.started)  # type: ignore[misc]
            await gates.release(key)
        await runner
        assert gates.peak == 2 and gates.finished == ["x", "y", "z"]

    asyncio.run(scenario())


def test_max_concurrent_hibernations_is_validated() -> None:
    base: dict[str, Any] = {
        "idle_timeout": 10,
        "interval": 1,
        "gpu_idle_threshold": 5,
        "warn_before": 0,
        "hibernated_ttl": 0,
        "busy_gpu_idle_warning": 0,
        "rules": [],
    }
    assert build_policy(**base).max_concurrent_hibernations == 4
    assert build_policy(**base, max_concurrent_hibernations=1).to_dict()["max_concurrent_hibernations"] == 1
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"CullPolicy.max_concurrent_hibernations must be"):
            build_policy(**base, max_concurrent_hibernations=bad)
    config = Config({"CullPolicy": {"idle_timeout": 10, "warn_before": 0, "max_concurrent_hibernations": 7}})
    assert CullPolicy(config=config).build([]).max_concurrent_hibernations == 7


# -- the culler, in process -----------------------------------------------------------------


class KernelManagerStandIn:
    """Just enough of the elastic kernel manager for the culler (as in the culler benchmark)."""

    def __init__(self) -> None:
        self.kernels: dict[str, Any] = {}
        self.log = logging.getLogger("test-culler")
        self.hibernator: Any = None
        self.elastic_runtime: ElasticRuntime | None = None
        self.culler: Culler | None = None
        #: New kernels not up yet (none here): a server stop shuts them down instead of hibernating.
        self.starting_kernels: set[str] = set()

    def __contains__(self, kernel_id: object) -> bool:
        return kernel_id in self.kernels

    def get_kernel(self, kernel_id: str) -> Any:
        return self.kernels[kernel_id]

    async def shutdown_kernel(self, kernel_id: str) -> None:
        self.kernels.pop(kernel_id, None)
        assert self.elastic_runtime is not None
        self.elastic_runtime.kernels.remove(kernel_id)


class FakeHibernations:
    """Stands in for ``Hibernator.hibernate``: each call waits until the test releases it."""

    def __init__(self, runtime: ElasticRuntime) -> None:
        self.runtime = runtime
        self.gates = Gates()
        self.fail: set[str] = set()

    async def hibernate(self, kernel_id: str, reason: str = "api") -> None:
        record = self.runtime.kernels.get(kernel_id)
        assert record is not None
        record.lifecycle.move(KernelState.HIBERNATING, reason)
        try:
            await self.gates.job(kernel_id)()
        finally:
            failed = kernel_id in self.fail
            record.lifecycle.move(KernelState.RUNNING if failed else KernelState.HIBERNATED, reason)
        if failed:
            raise LifecycleError("no space left on device", 507)


def build_culler(
    tmp_path: Path, policy: dict[str, Any], idle: dict[str, float]
) -> tuple[Culler, FakeHibernations, list[tuple[str, str]]]:
    """A culler over kernels idle for the given seconds, with fake hibernations."""
    config = Config(
        {
            "ElasticKernels": {
                "gpu_inventory": INVENTORY,
                "profiles": PROFILES,
                "checkpoint_root": str(tmp_path / "checkpoints"),
            },
            "CullPolicy": policy,
        }
    )
    runtime = ElasticKernels(config=config).build(nvml_factory=NvmlDouble)
    built = CullPolicy(config=config).build(list(runtime.profiles))
    mkm = KernelManagerStandIn()
    mkm.elastic_runtime = runtime
    hibernator = Hibernator(mkm, runtime, KernelStateFile(tmp_path / "kernels.json"))  # type: ignore[arg-type]
    fake = FakeHibernations(runtime)
    hibernator.hibernate = fake.hibernate  # type: ignore[method-assign]
    mkm.hibernator = hibernator
    now = time.time()
    for kernel_id, seconds in idle.items():
        profile = "whole" if kernel_id.startswith("whole") else "small"
        runtime.kernels.register(kernel_id, f"python3-gpu-{profile}", profile, "tester", KernelState.RUNNING)
        mkm.kernels[kernel_id] = SimpleNamespace(execution_state="idle", provisioner=None)
        hibernator.activity.get(kernel_id).last_execution_end = now - seconds
    broadcasts: list[tuple[str, str]] = []

    def broadcast(kernel_id: str, text: str, *, idle_warning: bool = False) -> int:
        broadcasts.append((kernel_id, text))
        return 1

    culler = Culler(mkm, runtime, hibernator, built, None, broadcast=broadcast)  # type: ignore[arg-type]
    mkm.culler = culler
    return culler, fake, broadcasts


POLICY = {
    "idle_timeout": 100,
    "warn_before": 0,
    "interval": 10,
    "max_concurrent_hibernations": 2,
    "rules": [{"profiles": ["whole"], "idle_timeout": 100, "warn_before": 50}],
}


def test_tick_schedules_hibernations_and_warns_without_waiting(tmp_path: Path) -> None:
    culler, fake, broadcasts = build_culler(
        tmp_path, POLICY, {"k1": 500, "k2": 400, "k3": 300, "whole-w": 60, "busy-free": 1}
    )

    async def scenario() -> None:
        decided = await asyncio.wait_for(culler.tick(), timeout=30)  # returns with hibernations pending
        actions = dict(decided)
        assert {k for k, d in actions.items() if d.action is Action.HIBERNATE} == {"k1", "k2", "k3"}
        assert actions["whole-w"].action is Action.WARN
        assert [kernel for kernel, _text in broadcasts] == ["whole-w"], "the warning went out on this tick"
        await settle(lambda: len(fake.gates.started) == 2)
        await settle()
        assert fake.gates.started == ["k1", "k2"], "at most max_concurrent_hibernations at once"
        assert set(culler.hibernations.waiting) == {"k3"}

        # The next tick neither waits nor schedules anything twice.
        await asyncio.wait_for(culler.tick(), timeout=30)
        await settle()
        assert fake.gates.started == ["k1", "k2"] and len(culler.hibernations) == 3

        await fake.gates.release("k2")
        await settle(lambda: "k3" in fake.gates.started)
        assert fake.gates.started == ["k1", "k2", "k3"], "k3 starts once a slot is free"
        assert culler.runtime.kernels.get("k2").state is KernelState.HIBERNATED  # type: ignore[union-attr]
        for key in ("k1", "k3"):
            await fake.gates.release(key)
        await culler.hibernations.join()
        assert fake.gates.peak == 2 and len(culler.hibernations) == 0

    asyncio.run(scenario())


def test_queued_hibernation_asks_the_policy_again(tmp_path: Path) -> None:
    culler, fake, _ = build_culler(
        tmp_path, {**POLICY, "max_concurrent_hibernations": 1}, {"a": 500, "b": 500}
    )

    async def scenario() -> None:
        await culler.tick()
        await settle(lambda: fake.gates.started == ["a"])
        # The user comes back to "b" while it waits for a slot.
        culler.hibernator.activity.get("b").last_execution_end = time.time()
        await fake.gates.release("a")
        await settle(lambda: "b" not in culler.hibernations or "b" in fake.gates.started)
        assert fake.gates.started == ["a"], "b was active again when its turn came: not hibernated"
        await culler.hibernations.join()
        assert culler.runtime.kernels.get("b").state is KernelState.RUNNING  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_failed_scheduled_hibernation_backs_off(tmp_path: Path) -> None:
    culler, fake, _ = build_culler(tmp_path, POLICY, {"k": 500})
    fake.fail.add("k")

    async def scenario() -> None:
        await culler.tick()
        await settle(lambda: fake.gates.started == ["k"])
        await fake.gates.release("k")
        await culler.hibernations.join()
        state = culler.runtime.kernels.get("k").cull  # type: ignore[union-attr]
        assert state.failures == 1 and state.retry_at is not None and state.retry_at > time.time()
        assert await culler.tick() == [], "no retry before the back-off ends"

    asyncio.run(scenario())


def test_a_kernel_still_starting_is_left_to_its_start(tmp_path: Path) -> None:
    """While the server waits for a new kernel's first answer, the policy neither warns nor
    hibernates it, however long it has been since its launch: a hibernation then stopped the start
    midway, and its creator got a 500 (seen at the lowest pins on a loaded machine). Once up, it is
    counted as any other kernel; a hibernation asked by the API meanwhile is refused with a 409."""
    culler, fake, broadcasts = build_culler(tmp_path, POLICY, {"slow": 500, "whole-slow": 60})
    culler.mkm.starting_kernels.update({"slow", "whole-slow"})  # type: ignore[attr-defined]

    async def scenario() -> None:
        assert await culler.tick() == []
        assert broadcasts == [] and len(culler.hibernations) == 0
        with pytest.raises(LifecycleError) as refused:
            await Hibernator.hibernate(culler.hibernator, "slow")  # the real one, not the stand-in's
        assert refused.value.status == 409 and "still starting" in refused.value.message
        culler.mkm.starting_kernels.clear()  # type: ignore[attr-defined]
        decided = dict(await culler.tick())
        assert decided["slow"].action is Action.HIBERNATE and decided["whole-slow"].action is Action.WARN
        await settle(lambda: fake.gates.started == ["slow"])
        await fake.gates.release("slow")
        await culler.hibernations.join()

    asyncio.run(scenario())


def test_tombstones_are_bounded_in_number_and_age() -> None:
    now = [1000.0]
    tombs = Tombstones(limit=3, ttl=100, clock=lambda: now[0])
    for n in range(5):
        tombs[f"k{n}"] = f"k{n} was removed"
        now[0] += 1
    assert list(tombs) == ["k2", "k3", "k4"], "only the newest `limit` are kept"
    assert tombs["k4"] == "k4 was removed" and "k0" not in tombs
    now[0] += 98  # k2 was written 101 s ago, k3 100 s, k4 99 s; the TTL is 100 s
    tombs.prune()
    assert list(tombs) == ["k3", "k4"]


def test_ttl_removal_is_scheduled_and_leaves_a_tombstone(tmp_path: Path) -> None:
    policy = {"idle_timeout": 100, "warn_before": 0, "interval": 10, "hibernated_ttl": 50}
    culler, _fake, _ = build_culler(tmp_path, policy, {"old": 1})
    record = culler.runtime.kernels.get("old")
    assert record is not None
    record.lifecycle.move(KernelState.HIBERNATING, "test")
    record.lifecycle.move(KernelState.HIBERNATED, "test")
    culler.hibernator.records["old"] = SimpleNamespace(hibernated_at=time.time() - 60)  # type: ignore[assignment]

    async def scenario() -> None:
        decided = await culler.tick()
        assert [d.action for _k, d in decided] == [Action.REMOVE]
        assert "old" in culler.removals, "the removal runs after the tick, not inside it"
        await culler.removals.join()
        assert "old" not in culler.runtime.kernels
        assert "hibernated_ttl" in culler.tombstones["old"]

    asyncio.run(scenario())


def test_hibernate_on_shutdown_is_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    culler, fake, _ = build_culler(tmp_path, POLICY, {f"k{n}": 1 for n in range(5)})
    fake.fail.add("k4")
    mkm = culler.mkm

    async def scenario() -> list[str]:
        running = sorted(r.kernel_id for r in mkm.elastic_runtime.kernels.all())
        stopping = asyncio.ensure_future(
            culler.hibernator.hibernate_all(running, POLICY["max_concurrent_hibernations"])
        )
        await settle(lambda: len(fake.gates.started) == 2)
        await settle()
        assert fake.gates.started == ["k0", "k1"], "at most the limit at once"
        for n in range(5):
            await settle(lambda n=n: f"k{n}" in fake.gates.started)  # type: ignore[misc]
            await fake.gates.release(f"k{n}")
        return await stopping

    with caplog.at_level(logging.WARNING, "test-culler"):
        done = asyncio.run(scenario())
    assert fake.gates.peak == 2
    assert done == ["k0", "k1", "k2", "k3"]
    assert "Not hibernated at shutdown: no space left on device" in caplog.text


# -- end to end: helpers ---------------------------------------------------------------------


def gate_object(gate: Path) -> str:
    """Source of an object whose pickling waits for ``gate`` to exist: a checkpoint held open.

    On entering, the pickling creates ``<gate>.entered``: the test can see the checkpoint began.
    """
    return (
        "import os, time\n"
        "class Gate:\n"
        "    def __reduce__(self):\n"
        f"        open({str(gate) + '.entered'!r}, 'w').close()\n"
        f"        while not os.path.exists({str(gate)!r}):\n"
        "            time.sleep(0.05)\n"
        "        return (Gate, ())\n"
        "gate = Gate()\n"
    )


def state(server: RunningServer, kernel_id: str) -> str:
    return str(server.get(f"/api/elastic/kernels/{kernel_id}")["state"])


def hibernate(server: RunningServer, kernel_id: str) -> Reply:
    return server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")


def receive(chan: KernelChannel, deadline: float) -> dict[str, Any] | None:
    """The next message, or None if none came within a second.

    Short socket timeouts, because the server's websocket pings keep a long ``recv`` from
    ever timing out: a test waiting for a message that never comes must fail, not hang.
    """
    if time.monotonic() > deadline:
        raise AssertionError("the expected message did not arrive")
    chan.conn.settimeout(1.0)
    try:
        return chan.recv()
    except websocket.WebSocketTimeoutException:
        return None


def next_message(chan: KernelChannel, match: Callable[[dict[str, Any]], bool], timeout: float = 30) -> dict:
    """The next message ``match`` accepts (others are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = receive(chan, deadline)
        if msg is not None and match(msg):
            return msg


def collect_all(chan: KernelChannel, msg_ids: list[str], timeout: float = 120) -> dict[str, dict[str, Any]]:
    """Replies, iopub messages, stdout and idle of several requests whose messages interleave."""
    got: dict[str, dict[str, Any]] = {
        m: {"reply": None, "iopub": [], "stdout": "", "idle": False} for m in msg_ids
    }
    deadline = time.monotonic() + timeout
    while not all(g["reply"] and g["idle"] for g in got.values()):
        msg = receive(chan, deadline)
        entry = got.get(msg.get("parent_header", {}).get("msg_id")) if msg is not None else None
        if msg is None or entry is None:
            continue
        if msg["msg_type"].endswith("_reply"):
            entry["reply"] = msg
            continue
        entry["iopub"].append(msg)
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            entry["stdout"] += msg["content"]["text"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            entry["idle"] = True
    return got


def reply_to(chan: KernelChannel, msg_id: str, timeout: float = 30) -> tuple[dict[str, Any], list[dict]]:
    """(reply, iopub messages) of one request."""
    got = collect_all(chan, [msg_id], timeout)[msg_id]
    return got["reply"], got["iopub"]


def policy_log(server: RunningServer) -> list[tuple[str, str]]:
    """(event, kernel id) of the culler's hibernation log lines, in order."""
    pattern = re.compile(r"Policy hibernation of kernel (\S+) (scheduled|started|finished)")
    return [(m.group(2), m.group(1)) for m in pattern.finditer(server.log())]


def most_at_once(events: list[tuple[str, str]]) -> int:
    running: set[str] = set()
    peak = 0
    for event, kernel_id in events:
        if event == "started":
            running.add(kernel_id)
            peak = max(peak, len(running))
        elif event == "finished":
            running.discard(kernel_id)
    return peak


# -- end to end: the culler -------------------------------------------------------------------


@pytest.fixture(scope="module")
def culling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("culling-concurrency")
    config = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "checkpoint_root": str(home / "checkpoints"),
        },
        "CullPolicy": {
            "idle_timeout": 2,
            "warn_before": 0,
            "interval": 1,
            "max_concurrent_hibernations": 2,
            # "whole" kernels are warned 2 s into idleness and hibernated only after 60 s.
            "rules": [{"profiles": ["whole"], "idle_timeout": 60, "warn_before": 58}],
        },
    }
    running = start_server(home, config)
    yield running
    (home / "gates").mkdir(exist_ok=True)
    for gate in ("s", "a", "b", "c"):
        (home / "gates" / gate).touch()  # nothing stays blocked in a checkpoint
    running.stop()


def test_a_slow_checkpoint_holds_up_no_other_hibernation_or_warning(culling: RunningServer) -> None:
    gates = culling.home / "gates"
    gates.mkdir(exist_ok=True)
    slow = culling.start_kernel("python3-gpu-small")
    try:
        culling.execute(slow, gate_object(gates / "s") + "kept = 'slow'")
        wait_for(lambda: state(culling, slow) == "hibernating", what="the slow kernel's policy hibernation")

        # While that checkpoint cannot finish (its gate is closed), others come due.
        fast = culling.start_kernel("python3-gpu-small")
        warned = culling.start_kernel("python3-gpu-whole")
        with culling.channel(warned) as chan:
            culling.execute(fast, "kept = 'fast'")
            assert chan.execute("w = 1").error == ""
            wait_for(lambda: state(culling, fast) == "hibernated", what="the fast kernel's hibernation")
            warning = next_message(
                chan, lambda m: m["msg_type"] == "stream" and "will be hibernated" in m["content"]["text"]
            )
            assert "Run a cell now to keep it running" in warning["content"]["text"]
            assert state(culling, slow) == "hibernating", "all of that happened during the slow checkpoint"

        (gates / "s").touch()
        wait_for(lambda: state(culling, slow) == "hibernated", what="the slow hibernation to finish")
        log = culling.log()
        assert log.index(f"Kernel {fast} hibernated") < log.index(f"Kernel {slow} hibernated")
        assert culling.execute(fast, "print(kept)", timeout=120).strip() == "fast"
        assert culling.execute(slow, "print(kept)", timeout=120).strip() == "slow"
    finally:
        (gates / "s").touch()
        culling.shutdown_all_kernels()


def test_policy_hibernations_never_exceed_the_bound(culling: RunningServer) -> None:
    gates = culling.home / "gates"
    gates.mkdir(exist_ok=True)
    kernels: dict[str, str] = {}
    try:
        for gate in "abc":
            kernels[gate] = culling.start_kernel("python3-gpu-small")
        for gate, kernel_id in kernels.items():
            culling.execute(kernel_id, gate_object(gates / gate))

        def scheduled_all() -> bool:
            scheduled = {k for event, k in policy_log(culling) if event == "scheduled"}
            return set(kernels.values()) <= scheduled

        wait_for(scheduled_all, what="all three hibernations to be scheduled")
        states = {gate: state(culling, kernel_id) for gate, kernel_id in kernels.items()}
        hibernating = [gate for gate, s in states.items() if s == "hibernating"]
        assert len(hibernating) <= 2, f"at most 2 checkpoints at once (max_concurrent_hibernations): {states}"
        wait_for(
            lambda: sum(state(culling, k) == "hibernating" for k in kernels.values()) == 2,
            what="two hibernations in progress",
        )
        waiting = next(g for g, k in kernels.items() if state(culling, k) == "running")
        first = next(g for g, k in kernels.items() if g != waiting and state(culling, k) == "hibernating")
        (gates / first).touch()
        wait_for(lambda: state(culling, kernels[waiting]) == "hibernating", what="the third to get its turn")
        for gate in "abc":
            (gates / gate).touch()
        for kernel_id in kernels.values():
            wait_for(lambda k=kernel_id: state(culling, k) == "hibernated", what="every hibernation")
        events = [(e, k) for e, k in policy_log(culling) if k in kernels.values()]
        assert most_at_once(events) == 2, events
        assert events.index(("started", kernels[waiting])) > events.index(("finished", kernels[first]))
    finally:
        for gate in "abc":
            (gates / gate).touch()
        culling.shutdown_all_kernels()


# -- end to end: the websocket while a kernel is held ----------------------------------------

#: A kernel id, its open websocket, the gate holding its checkpoint, the hibernate request's reply.
Held = tuple[str, KernelChannel, Path, list[Reply]]


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("held-websocket")
    config = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "checkpoint_root": str(home / "checkpoints"),
        },
        "ElasticWebsocketConnection": {"max_queued_messages": 3, "max_queued_bytes": 100_000},
    }
    running = start_server(home, config)
    yield running
    running.stop()


@pytest.fixture()
def hibernating(
    held: RunningServer, tmp_path: Path
) -> Iterator[tuple[str, KernelChannel, Path, list[Reply]]]:
    """A kernel whose hibernation is in progress and held there until the test opens the gate."""
    gate = tmp_path / "gate"
    kernel_id = held.start_kernel("python3-gpu-small")
    chan = held.channel(kernel_id, timeout=120)
    replies: list[Reply] = []
    thread = threading.Thread(target=lambda: replies.append(hibernate(held, kernel_id)))
    try:
        assert chan.execute(gate_object(gate) + "n = 0").error == ""
        thread.start()
        wait_for(lambda: state(held, kernel_id) == "hibernating", what="hibernating")
        yield kernel_id, chan, gate, replies
    finally:
        gate.touch()
        thread.join(60)
        chan.close()
        held.shutdown_all_kernels()


def execute(chan: KernelChannel, code: str) -> str:
    return chan.send("execute_request", {"code": code, "silent": False, "store_history": True})


def test_full_queue_refuses_with_a_clear_error(held: RunningServer, hibernating: Held) -> None:
    kernel_id, chan, gate, replies = hibernating
    big = execute(chan, "x = '" + "y" * 150_000 + "'")
    reply, iopub = reply_to(chan, big)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KernelQueueFull"
    assert "max_queued_bytes is 100000" in reply["content"]["evalue"]
    assert any(m["msg_type"] == "error" and "still being hibernated" in m["content"]["evalue"] for m in iopub)

    queued = [execute(chan, "n += 1; print(n)") for _ in range(3)]
    refused = execute(chan, "print('one too many')")
    reply, _iopub = reply_to(chan, refused)
    assert reply["content"]["status"] == "error"
    assert "3 messages already wait for it" in reply["content"]["evalue"]
    assert "max_queued_messages is 3" in reply["content"]["evalue"]
    info = chan.send("kernel_info_request", {})
    reply, _iopub = reply_to(chan, info)
    assert reply["msg_type"] == "kernel_info_reply" and reply["content"]["status"] == "error"
    assert state(held, kernel_id) == "hibernating", "refused at once, while the checkpoint is still held"

    gate.touch()
    done = collect_all(chan, queued)
    assert [done[m]["stdout"].strip() for m in queued] == ["1", "2", "3"], "the queued cells ran, in order"
    assert replies and replies[0].status == 200
    assert f"Kernel {kernel_id}: execute_request refused" in held.log()


def test_interrupt_while_hibernating_cancels_the_waiting_cell(held: RunningServer, hibernating: Held) -> None:
    kernel_id, chan, gate, replies = hibernating
    waiting = execute(chan, "n = 'this must not run'")
    interrupt = chan.send("interrupt_request", {}, channel="control")
    cell_reply: dict[str, Any] = {}
    interrupt_reply: dict[str, Any] = {}
    while not (cell_reply and interrupt_reply):
        msg = next_message(chan, lambda m: m["msg_type"] in ("execute_reply", "interrupt_reply"))
        if msg["parent_header"].get("msg_id") == waiting:
            cell_reply = msg
        elif msg["parent_header"].get("msg_id") == interrupt:
            interrupt_reply = msg
    assert interrupt_reply["content"]["status"] == "ok" and interrupt_reply["content"]["cells_cancelled"] == 1
    assert (
        cell_reply["content"]["status"] == "error" and cell_reply["content"]["ename"] == "KeyboardInterrupt"
    )
    assert "cancelled by an interrupt before it ran" in cell_reply["content"]["evalue"]
    assert state(held, kernel_id) == "hibernating"

    gate.touch()
    wait_for(lambda: bool(replies), timeout=60, what="the hibernation to finish")
    assert replies[0].status == 200
    model = held.get(f"/api/elastic/kernels/{kernel_id}")
    assert model["state"] == "hibernated" and model["slice"] is None, "nothing needed the kernel: not resumed"
    # The same connection still works: the next cell resumes the kernel as usual.
    result = chan.execute("print(n)", timeout=120)
    assert result.error == "" and result.stdout.strip() == "0"


def test_input_reply_while_hibernated_is_explained(held: RunningServer) -> None:
    kernel_id = held.start_kernel("python3-gpu-small")
    try:
        with held.channel(kernel_id) as chan:
            ran = execute(chan, "v = 1")
            reply_to(chan, ran)
            assert hibernate(held, kernel_id).status == 200
            chan.send("input_reply", {"value": "my answer"}, channel="stdin")
            notice = next_message(chan, lambda m: m["msg_type"] == "stream")
            text = notice["content"]["text"]
            assert notice["content"]["name"] == "stderr" and notice["parent_header"]["msg_id"] == ran
            assert "was not delivered" in text and "hibernated" in text and "Run the cell again" in text
            assert state(held, kernel_id) == "hibernated", "a stale input does not wake the kernel"
        assert "input_reply) was not delivered" in held.log()
    finally:
        held.shutdown_all_kernels()


def test_policy_endpoint_shows_the_bound(held: RunningServer) -> None:
    assert held.get("/api/elastic/policy")["max_concurrent_hibernations"] == 4


def test_server_stop_hibernates_under_the_bound(tmp_path: Path) -> None:
    """Hibernate-on-shutdown with max_concurrent_hibernations = 1: one checkpoint at a time."""
    config = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "checkpoint_root": str(tmp_path / "checkpoints"),
        },
        "CullPolicy": {"max_concurrent_hibernations": 1},
    }
    running = start_server(tmp_path, config)
    gates = {name: tmp_path / f"gate-{name}" for name in "ab"}
    try:
        kernels = {name: running.start_kernel("python3-gpu-small") for name in gates}
        for name, kernel_id in kernels.items():
            running.execute(kernel_id, gate_object(gates[name]))
        running.process.terminate()  # a normal server stop: hibernate-on-shutdown
        entered = {name: Path(str(gate) + ".entered") for name, gate in gates.items()}
        first = wait_for(
            lambda: next((n for n, p in entered.items() if p.exists()), None), what="a checkpoint to begin"
        )
        second = next(n for n in gates if n != first)
        gates[first].touch()
        wait_for(entered[second].exists, what="the second checkpoint to begin")
        # It began only after the first hibernation had finished, not beside it.
        assert f"Kernel {kernels[first]} hibernated (server shutdown)" in running.log()
        gates[second].touch()
        assert running.process.wait(timeout=120) == 0
        assert f"Kernel {kernels[second]} hibernated (server shutdown)" in running.log()
    finally:
        for gate in gates.values():
            gate.touch()
        running.stop()
