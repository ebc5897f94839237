"""Jupyter execution activity is kept on each kernel's record, and its idle clock starts when
the kernel's process is up."""

from __future__ import annotations

import pytest

from kernelmgr.activity.jupyter import JupyterActivity
from kernelmgr.core.kernels import KernelRegistry

pytestmark = pytest.mark.pure

CELL = {"msg_type": "execute_request", "msg_id": "cell-1"}


def test_activity_is_on_the_record_and_not_kept_for_a_kernel_without_one() -> None:
    now = [100.0]
    registry = KernelRegistry()
    record = registry.register("k", "python3-gpu-small", "small", "tester")
    activity = JupyterActivity(registry, clock=lambda: now[0])
    activity.observe("k", "execute_input", CELL, {"execution_count": 7})
    assert record.activity.last_execution_start == 100.0 and record.activity.execution_count == 7
    activity.observe("cpu-kernel", "execute_input", CELL, {"execution_count": 1})
    assert activity.get("cpu-kernel").execution_count == 0, "no record: nothing is kept"


def test_the_idle_clock_starts_when_the_process_is_up_not_at_registration() -> None:
    """A slow launch (seconds on a loaded machine) must not count as idle time: a kernel could be
    hibernated before its first cell arrives."""
    now = [100.0]
    registry = KernelRegistry()
    record = registry.register("k", "python3-gpu-small", "small", "tester")
    activity = JupyterActivity(registry, clock=lambda: now[0])
    now[0] = 130.0  # the launch took 30 s
    activity.restarted("k")  # the server starts watching the new process
    assert record.activity.started == 130.0 and record.activity.busy_since is None
