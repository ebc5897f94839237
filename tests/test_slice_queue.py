"""Resumes that do not fit wait in one queue and are served in order, each told its place (issue 29).

Real server, real kernels: two whole GPUs held by two kernels, three hibernated kernels asking to
resume one after the other, the last of a size with a higher ``queue_priority``; each freed GPU goes
to the first in line (the urgent one, then by arrival), never to whoever looks first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PROFILES
from tests.conftest import elastic_config as config
from tests.support.server import RunningServer, start_server, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("queue")
    sizes = {**PROFILES, "urgent": {"gpu_fraction": 1, "queue_priority": 5}}
    running = start_server(home, config(home / "checkpoints", profiles=sizes))
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def no_kernels_left(server: RunningServer) -> Iterator[None]:
    yield
    server.shutdown_all_kernels()


def model(server: RunningServer, kernel_id: str) -> dict[str, Any]:
    return server.get(f"/api/elastic/kernels/{kernel_id}")


def place(server: RunningServer, kernel_id: str) -> Any:
    resume = model(server, kernel_id)["resume"]
    return resume.get("position") if resume else None


class InBackground(threading.Thread):
    """A request in the background: a resume or a queued start answers once the kernel has its slice."""

    def __init__(self, server: RunningServer, method: str, path: str, body: Any = None) -> None:
        super().__init__(daemon=True)
        self.server, self.method, self.path, self.body = server, method, path, body
        self.reply: Any = None
        self.start()

    def run(self) -> None:
        self.reply = self.server.request(self.method, self.path, self.body, timeout=900)


def resuming(server: RunningServer, kernel_id: str) -> InBackground:
    return InBackground(server, "POST", f"/api/elastic/kernels/{kernel_id}/resume")


def hibernated_with(server: RunningServer, value: int, size: str = "whole") -> str:
    kernel_id = server.start_kernel(f"python3-gpu-{size}")
    server.execute(kernel_id, f"x = {value}")
    assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
    return kernel_id


def test_waiting_resumes_are_served_in_order_and_told_their_place(server: RunningServer) -> None:
    first, second = hibernated_with(server, 0), hibernated_with(server, 1)
    urgent = hibernated_with(server, 2, size="urgent")
    hogs = [server.start_kernel("python3-gpu-whole") for _ in range(2)]  # both GPUs taken
    resumes = {}
    for kernel_id, places in ((first, [first]), (second, [first, second]), (urgent, [urgent, first, second])):
        resumes[kernel_id] = resuming(server, kernel_id)
        for n, waiting in enumerate(places, start=1):
            wait_for(lambda k=waiting, n=n: place(server, k) == n, timeout=60, what=f"{waiting} at place {n}")
    assert model(server, second)["resume"]["waiting"] == 3

    server.shutdown_kernel(hogs[0])  # the urgent size goes first although it came last
    resumes[urgent].join(timeout=180)
    assert resumes[urgent].reply is not None and resumes[urgent].reply.status == 200, resumes[urgent].reply
    wait_for(lambda: place(server, first) == 1, timeout=30, what="the first moving up")
    assert place(server, second) == 2

    server.shutdown_kernel(hogs[1])
    resumes[first].join(timeout=180)
    assert resumes[first].reply.status == 200, resumes[first].reply
    assert model(server, second)["state"] == "resuming"

    server.shutdown_kernel(urgent)
    resumes[second].join(timeout=180)
    assert resumes[second].reply.status == 200, resumes[second].reply
    assert server.execute(first, "print(x)").strip() == "0"
    assert server.execute(second, "print(x)").strip() == "1"


def test_a_wait_past_max_slice_wait_fails_saying_why(tmp_path: Path) -> None:
    running = start_server(tmp_path, config(tmp_path / "checkpoints", max_slice_wait=2))
    try:
        sleeper = hibernated_with(running, 7)
        hogs = [running.start_kernel("python3-gpu-whole") for _ in range(2)]
        reply = running.request("POST", f"/api/elastic/kernels/{sleeper}/resume")
        assert reply.status == 409, reply
        message = reply.body["message"]
        assert "ElasticKernels.max_slice_wait" in message and "number 1 in the queue" in message, message
        assert model(running, sleeper)["state"] == "hibernated"
        running.shutdown_kernel(hogs[0])
        assert running.execute(sleeper, "print(x)", timeout=120).strip() == "7"
    finally:
        running.stop()


def test_a_waiting_kernel_gets_the_gpu_of_the_longest_idle_one_under_pressure(tmp_path: Path) -> None:
    """No idle timeout at all, only ``pressure_idle_minimum``: nothing is culled until someone waits,
    then the longest-idle kernel is warned and hibernated, and only that one."""
    settings = config(tmp_path / "checkpoints")
    settings["CullPolicy"] = {"interval": 1, "idle_timeout": 0, "warn_before": 1, "pressure_idle_minimum": 2}
    running = start_server(tmp_path, settings)
    try:
        sleeper = hibernated_with(running, 9)
        hogs = [running.start_kernel("python3-gpu-whole") for _ in range(2)]
        for hog in hogs:  # idle from here on (a cell ran, so they are "idle", not "starting")
            running.execute(hog, "pass")
        for hog in hogs:  # a few ticks with nobody waiting: nothing is culled
            wait_for(
                lambda hog=hog: model(running, hog)["activity"]["idle_seconds"] >= 4,
                timeout=60,
                what="the kernels idle past the pressure minimum",
            )
        assert [model(running, hog)["state"] for hog in hogs] == ["running", "running"]
        reply = running.request("POST", f"/api/elastic/kernels/{sleeper}/resume", timeout=900)
        assert reply.status == 200, reply
        assert [model(running, hog)["state"] for hog in hogs] == ["hibernated", "running"]
        assert running.execute(sleeper, "print(x)").strip() == "9"
        assert running.execute(hogs[0], "print('back')").strip() == "back"  # waits for a slice again
    finally:
        running.stop()


def starting(server: RunningServer, kernelspec: str) -> InBackground:
    return InBackground(server, "POST", "/api/kernels", {"name": kernelspec})


def test_starts_wait_in_the_queue_behind_a_waiting_resume(tmp_path: Path) -> None:
    """With ``start_queue_wait`` a start that does not fit waits (listed in /api/elastic/queue)
    instead of a 409, behind the resume that came first; past the limit it fails saying so."""
    running = start_server(tmp_path, config(tmp_path / "checkpoints", start_queue_wait=120))
    try:
        sleeper = hibernated_with(running, 3)
        hogs = [running.start_kernel("python3-gpu-whole") for _ in range(2)]
        resume = resuming(running, sleeper)
        wait_for(lambda: place(running, sleeper) == 1, timeout=60, what="the resume in the queue")
        start = starting(running, "python3-gpu-whole")
        queued = lambda: running.get("/api/elastic/queue")["waiting"] == 2  # noqa: E731
        wait_for(queued, timeout=60, what="the start in the queue")
        entries = running.get("/api/elastic/queue")["entries"]
        assert [(e["position"], e["kind"], e["size"]) for e in entries] == [
            (1, "resume", "whole"),
            (2, "start", "whole"),
        ], entries
        running.shutdown_kernel(hogs[0])
        resume.join(timeout=180)
        assert resume.reply.status == 200, resume.reply
        assert start.is_alive() and running.get("/api/elastic/queue")["entries"][0]["kind"] == "start"
        running.shutdown_kernel(hogs[1])
        start.join(timeout=180)
        assert start.reply.status == 201, start.reply
        started = start.reply.body["id"]
        assert running.execute(started, "print(40 + 2)").strip() == "42"
        assert running.get("/api/elastic/queue") == {"waiting": 0, "entries": []}
    finally:
        running.stop()


def test_a_queued_start_past_its_limit_fails_saying_why(tmp_path: Path) -> None:
    running = start_server(tmp_path, config(tmp_path / "checkpoints", start_queue_wait=2))
    try:
        for _ in range(2):
            running.start_kernel("python3-gpu-whole")
        reply = running.request("POST", "/api/kernels", {"name": "python3-gpu-whole"})
        assert reply.status == 409, reply
        assert "ElasticKernels.start_queue_wait" in reply.body["message"], reply.body
        assert running.get("/api/elastic/queue")["waiting"] == 0
        too_big = running.request("POST", "/api/kernels", {"name": "python3-gpu-huge"})
        assert too_big.status == 409 and "start_queue_wait" not in too_big.body["message"], too_big
    finally:
        running.stop()
