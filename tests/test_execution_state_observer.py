"""jupyter_server's execution_state follows the lifecycle: the observer of ``KernelStates``'
transitions sets it, whichever path moved the kernel (hibernation, resume, loss, recovery)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kernelmgr.core.controller import KernelStates
from kernelmgr.core.kernels import KernelRegistry
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.server.execution_state import ExecutionStates

pytestmark = pytest.mark.pure

S = KernelState


class Host:
    """The kernels jupyter_server lists: kernel id -> its KernelManager's attributes."""

    def __init__(self) -> None:
        self.kernels: dict[str, Any] = {}
        self.log = logging.getLogger("test-execution-state")

    def __contains__(self, kernel_id: object) -> bool:
        return kernel_id in self.kernels

    def get_kernel(self, kernel_id: str) -> Any:
        return self.kernels[kernel_id]


def setup() -> tuple[KernelStates, Host]:
    states = KernelStates(KernelRegistry())
    host = Host()
    states.observers.append(ExecutionStates(host))  # type: ignore[arg-type]
    return states, host


def running(states: KernelStates, host: Host, kernel_id: str = "k") -> Any:
    record = states.starting(kernel_id, "python3-gpu-small", "small", "tester")
    host.kernels[kernel_id] = SimpleNamespace(execution_state="starting")
    states.launched(kernel_id, "cold")
    host.kernels[kernel_id].execution_state = "idle"  # jupyter_server's IOPub watcher
    return record


def test_hibernation_resume_and_a_failed_resume() -> None:
    states, host = setup()
    record = running(states, host)
    km = host.kernels["k"]
    states.move(record, S.HIBERNATING, "api")
    assert km.execution_state == "idle"  # still running while it checkpoints
    states.move(record, S.HIBERNATED, "api")
    assert km.execution_state == "hibernated"
    states.move(record, S.RESUMING, "cell")
    km.execution_state = "busy"  # the new process's status, seen during the resume
    states.move(record, S.HIBERNATED, "resume failed")
    assert km.execution_state == "hibernated"
    states.move(record, S.RESUMING, "cell")
    states.move(record, S.RUNNING, "resumed")
    assert km.execution_state == "idle"


def test_a_resume_keeps_what_jupyter_already_saw() -> None:
    states, host = setup()
    record = running(states, host)
    for state in (S.HIBERNATING, S.HIBERNATED, S.RESUMING):
        states.move(record, state, "api")
    host.kernels["k"].execution_state = "busy"  # the first cell already runs
    states.move(record, S.RUNNING, "resumed")
    assert host.kernels["k"].execution_state == "busy"


def test_dead_for_good_but_not_a_crash_the_restarter_starts_again() -> None:
    states, host = setup()
    running(states, host, "crashed")
    states.ended("crashed", "exit status 1")
    assert host.kernels["crashed"].execution_state == "idle"  # jupyter_server's restart follows
    lost = running(states, host, "lost")
    states.dead(lost, "lost (pod deleted) with no readable checkpoint")
    assert host.kernels["lost"].execution_state == "dead"


def test_a_kernel_listed_again_after_a_server_restart() -> None:
    states, host = setup()
    for kernel_id, state in (("slept", S.HIBERNATED), ("orphan", S.HIBERNATING)):
        host.kernels[kernel_id] = SimpleNamespace()
        states.adopted(kernel_id, "python3-gpu-small", "small", "tester", state)
        assert host.kernels[kernel_id].execution_state == "hibernated"
    orphan = states.registry.get("orphan")
    assert orphan is not None
    states.move(orphan, S.HIBERNATED, "recovered")
    assert host.kernels["orphan"].execution_state == "hibernated"


def test_a_kernel_jupyter_does_not_list_is_left_alone() -> None:
    states, _host = setup()
    record = states.starting("unlisted", "python3-gpu-small", "small", "tester")
    states.launched("unlisted", "cold")
    states.move(record, S.HIBERNATING, "api")
    states.move(record, S.HIBERNATED, "api")  # no KernelManager: nothing to set, nothing raised
    assert record.state is S.HIBERNATED
