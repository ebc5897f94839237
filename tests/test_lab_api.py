"""What the JupyterLab extension asks the server, against a real server and real kernels.

"Keep running" (``POST /api/elastic/kernels/{id}/activity``), who is asking
(``GET /api/elastic/me``), and the resume's phase in the kernel model (``resume``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from kernelmgr.checkpoint.progress import ProgressFile, read_progress
from tests.conftest import elastic_config
from tests.support.server import RunningServer, start_server, wait_for

POLICY = {"idle_timeout": 6, "warn_before": 4, "interval": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("lab-api")
    config = elastic_config(home / "checkpoints")
    config["CullPolicy"] = POLICY
    running = start_server(home, config)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def no_kernels_left(server: RunningServer) -> Iterator[None]:
    yield
    server.shutdown_all_kernels()


def model(server: RunningServer, kernel_id: str) -> dict:
    return server.get(f"/api/elastic/kernels/{kernel_id}")  # type: ignore[no-any-return]


def test_keep_running_cancels_the_warning_and_the_hibernation(server: RunningServer) -> None:
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, "x = 1")
    warning = wait_for(
        lambda: model(server, kernel_id)["activity"]["warning"], timeout=20, what="the idle warning"
    )
    kept_at = time.time()
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/activity")
    assert reply.status == 200, reply.body
    assert reply.body["activity"]["warning"] is None  # gone at once, not at the next policy check
    assert reply.body["activity"]["idle_seconds"] < 1.0  # counts as activity: the idle clock restarted
    # The hibernation that comes is the next idle period's: a whole idle_timeout after "keep running",
    # not at the deadline the warning announced. (Its checkpoint's time says when it happened, so
    # the test reads no clock against a loaded machine's timing: load only makes it later.)
    wait_for(
        lambda: model(server, kernel_id)["state"] == "hibernated", timeout=60, what="the next idle period"
    )
    checkpoint = model(server, kernel_id)["checkpoint"]
    hibernated = datetime.fromisoformat(checkpoint["created"].replace("Z", "+00:00")).timestamp()
    assert hibernated >= kept_at + POLICY["idle_timeout"] > warning["hibernate_at"], (checkpoint, warning)


def test_keep_running_refuses_what_it_cannot_keep(server: RunningServer) -> None:
    missing = server.request("POST", "/api/elastic/kernels/no-such-kernel/activity")
    assert missing.status == 404 and "no-such-kernel" in missing.body["message"]
    cpu = server.start_kernel("python3")
    refused = server.request("POST", f"/api/elastic/kernels/{cpu}/activity")
    assert refused.status == 409 and "not an elastic kernel" in refused.body["message"]
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, "y = 2")
    assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
    asleep = server.request("POST", f"/api/elastic/kernels/{kernel_id}/activity")
    assert asleep.status == 409 and "hibernated" in asleep.body["message"]
    anonymous = server.request("POST", f"/api/elastic/kernels/{kernel_id}/activity", token=None)
    assert anonymous.status == 403


def test_me_says_admin_and_gpu_hours_released(server: RunningServer) -> None:
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, "z = 3")
    assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
    time.sleep(1.0)
    me = server.get("/api/elastic/me")
    assert me["admin"] is True  # one user's server: its user is the admin
    # small = 1/4 GPU, hibernated for at least a second.
    assert me["gpu_hours_released"]["small"] >= 0.25 * 1.0 / 3600
    assert server.request("GET", "/api/elastic/me", token=None).status == 403


def test_resume_shows_its_phases(server: RunningServer) -> None:
    # Both GPUs taken by whole-GPU kernels: the resume has to wait for a slice.
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, "import numpy as np; big = np.ones(300 * 2**20 // 8)")
    assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
    assert model(server, kernel_id)["resume"] is None  # only while resuming
    holders = [server.start_kernel("python3-gpu-whole") for _ in range(2)]
    outcome: list[int] = []
    resumer = threading.Thread(
        target=lambda: outcome.append(
            server.request("POST", f"/api/elastic/kernels/{kernel_id}/resume").status
        )
    )
    resumer.start()
    waiting = {"phase": "waiting_for_slice", "position": 1, "waiting": 1, "estimate_s": None}
    wait_for(lambda: model(server, kernel_id)["resume"] == waiting, timeout=30, what="the resume to wait")
    server.shutdown_kernel(holders[0])
    phases: list[dict] = []
    while resumer.is_alive():
        current = model(server, kernel_id)["resume"]
        if current is not None and (not phases or phases[-1] != current):
            phases.append(current)
        time.sleep(0.01)
    resumer.join()
    assert outcome == [200]
    restoring = [p for p in phases if p["phase"] == "restoring"]
    assert restoring, phases
    assert all(abs(p["total_mib"] - 300) < 1 for p in restoring)
    assert all(0 <= p["restored_mib"] <= p["total_mib"] for p in restoring)
    assert model(server, kernel_id)["resume"] is None
    assert server.execute(kernel_id, "print(big.sum() == big.size)").strip() == "True"


def test_progress_file_is_throttled_and_dated(tmp_path: Path) -> None:
    now = [1000.0]
    progress = ProgressFile(tmp_path, clock=lambda: now[0])
    progress("ckpt-a", 0, 100)
    progress("ckpt-a", 10, 100)  # within the interval: not written
    assert read_progress(tmp_path, since=0)["read_bytes"] == 0
    now[0] += 1
    progress("ckpt-a", 50, 100)
    assert read_progress(tmp_path, since=0)["read_bytes"] == 50
    progress("ckpt-a", 100, 100)  # the last one always
    assert read_progress(tmp_path, since=0)["read_bytes"] == 100
    assert read_progress(tmp_path, since=now[0] + 1) is None  # an earlier resume's
