"""Jupyter execution activity is kept on each kernel's record, and its idle clock starts when
the kernel's process is up."""

from __future__ import annotations

import asyncio
import time

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


class _Log:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, message: str, *args: object) -> None:
        self.warnings.append(message % args)


class _Host:
    def __init__(self) -> None:
        self.log = _Log()


class _Client:
    def kernel_info(self) -> str:
        return "kernel-info"


def _platform(heard_on_ask: int | None) -> tuple[object, list[int], _Host, KernelRegistry]:
    """A platform whose kernel's busy/idle reaches the server's IOPub watcher from the
    ``heard_on_ask``-th kernel_info on (``None``: never), as when it joins late."""
    from kernelmgr.lifecycle.platform import JupyterKernelPlatform

    registry = KernelRegistry()
    registry.register("k", "python3-gpu-small", "small", "tester")
    activity = JupyterActivity(registry)
    host = _Host()
    platform = JupyterKernelPlatform(host, None, None, activity, 10.0)  # type: ignore[arg-type]
    asks: list[int] = []

    async def reply(client: object, request: object, timeout: float, km: object, pid: object) -> dict:
        asks.append(len(asks) + 1)
        if heard_on_ask is not None and len(asks) >= heard_on_ask:
            activity.observe("k", "status", {"msg_type": "kernel_info_request"}, {"execution_state": "idle"})
        return {}

    platform.reply = reply  # type: ignore[method-assign]
    platform.pid_of = lambda km: None  # type: ignore[method-assign]
    return platform, asks, host, registry


def test_a_resume_asks_the_kernel_until_the_servers_watcher_hears_it() -> None:
    """The watcher reconnects to a new process by itself, after it binds; what the kernel
    published before is lost to it. The resume asks kernel_info again until it hears one."""
    platform, asks, host, _registry = _platform(heard_on_ask=3)
    since = time.time()
    asyncio.run(platform._until_watched(_Client(), None, "k", since))  # type: ignore[attr-defined]
    assert asks == [1, 2, 3] and not host.log.warnings


def test_a_watcher_that_already_heard_the_new_process_costs_no_request() -> None:
    platform, asks, host, registry = _platform(heard_on_ask=None)
    since = time.time()
    JupyterActivity(registry).observe("k", "status", {"msg_type": "kernel_info_request"}, {})
    asyncio.run(platform._until_watched(_Client(), None, "k", since))  # type: ignore[attr-defined]
    assert asks == [] and not host.log.warnings


def test_a_watcher_that_never_hears_lets_the_resume_go_on_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kernelmgr.lifecycle import platform as module

    monkeypatch.setattr(module, "WATCH_PROBE_SECONDS", 0.6)
    monkeypatch.setattr(module, "WATCH_HEARD_SECONDS", 0.1)
    platform, asks, host, _registry = _platform(heard_on_ask=None)
    asyncio.run(platform._until_watched(_Client(), None, "k", time.time()))  # type: ignore[attr-defined]
    assert asks  # asked (as often as the time allowed), then gave up
    assert host.log.warnings and "has not heard it" in host.log.warnings[0]
