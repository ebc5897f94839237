"""What the JupyterLab extension asks the server, against a real server and real kernels.

"Keep running" (``POST /api/elastic/kernels/{id}/activity``), who is asking
(``GET /api/elastic/me``), and the resume's phase in the kernel model (``resume``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from kernelmgr.checkpoint.progress import ProgressFile, read_progress
from tests.conftest import INVENTORY, elastic_config
from tests.support.server import RunningServer, start_server, wait_for

POLICY = {"idle_timeout": 6, "warn_before": 4, "interval": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("lab-api")
    # The NVML TEST DOUBLE, scripted by gpu_script(): no process uses a GPU until a test says so.
    gpu_file = home / "gpu.json"
    gpu_file.write_text(json.dumps({"devices": INVENTORY, "processes": []}))
    config = elastic_config(
        home / "checkpoints",
        nvml_class="kernelmgr.activity.nvml_double.FileNvmlDouble",
        gpu_sample_interval=0.5,
    )
    config["CullPolicy"] = POLICY
    running = start_server(home, config, env_extra={"ELASTIC_NVML_DOUBLE_FILE": str(gpu_file)})
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
    assert me["gpus_released_now"] == 0.25  # the trend: a quarter GPU released at this moment
    assert server.request("GET", "/api/elastic/me", token=None).status == 403


def gpu_script(server: RunningServer, processes: list[dict]) -> None:
    """What the NVML double shows: each process's memory and SM % on a test GPU."""
    path = server.home / "gpu.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"devices": INVENTORY, "processes": processes}))
    tmp.replace(path)


def test_gpus_carry_each_devices_live_use_from_its_kernels(server: RunningServer) -> None:
    """``GET /api/elastic/gpus``: per device, the sum of its kernels' sampled use (the panel's meters)."""
    idle = server.get("/api/elastic/gpus")["devices"]
    assert [d["activity"] for d in idle] == [{"gpu_utilization": None, "memory_used_mib": None}] * 2
    first = server.start_kernel("python3-gpu-small")
    second = server.start_kernel("python3-gpu-small")
    pids = [int(server.execute(k, "import os; print(os.getpid())").strip()) for k in (first, second)]
    slices = {
        s["kernel_id"]: d["uuid"] for d in server.get("/api/elastic/gpus")["devices"] for s in d["slices"]
    }
    assert slices[first] == slices[second]  # packed on one GPU
    device = slices[first]
    gpu_script(
        server,
        [
            {"pid": pids[0], "device": device, "memory_mib": 3072, "sm_percent": 40},
            {"pid": pids[1], "device": device, "memory_mib": 1024, "sm_percent": 15},
        ],
    )

    def device_use() -> dict | None:
        for entry in server.get("/api/elastic/gpus")["devices"]:
            if entry["uuid"] == device and entry["activity"]["gpu_utilization"] == 55:
                return entry["activity"]  # type: ignore[no-any-return]
        return None

    use = wait_for(device_use, timeout=20, what="the GPU's use from its two kernels")
    assert use == {"gpu_utilization": 55.0, "memory_used_mib": 4096.0}
    other = [d for d in server.get("/api/elastic/gpus")["devices"] if d["uuid"] != device]
    assert other[0]["activity"] == {"gpu_utilization": None, "memory_used_mib": None}  # no kernel there
    gpu_script(server, [])


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


def test_resize_hibernates_and_resumes_at_the_other_size_with_the_variables(server: RunningServer) -> None:
    """``POST /api/elastic/kernels/{id}/resize``: same kernel id, the new size's slice, variables back."""
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, "kept = 41")
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/resize", {"size": "whole"})
    assert reply.status == 200, reply.body
    assert (reply.body["profile"], reply.body["state"], reply.body["name"]) == (
        "whole",
        "running",
        "python3-gpu-whole",
    )
    assert [d["fraction"] for d in reply.body["slice"]["devices"]] == [1.0]
    assert server.execute(kernel_id, "print(kept + 1)").strip() == "42"
    assert server.get(f"/api/kernels/{kernel_id}")["name"] == "python3-gpu-whole"
    # A hibernated kernel changes size too (and comes back running).
    assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
    back = server.request("POST", f"/api/elastic/kernels/{kernel_id}/resize", {"size": "small"})
    assert back.status == 200, back.body
    assert (back.body["profile"], back.body["state"]) == ("small", "running")
    assert server.execute(kernel_id, "print(kept)").strip() == "41"


def test_resize_refuses_with_what_to_fix(server: RunningServer) -> None:
    kernel_id = server.start_kernel("python3-gpu-small")
    path = f"/api/elastic/kernels/{kernel_id}/resize"
    no_body = server.request("POST", path, {})
    assert (
        no_body.status == 400
        and '{"size": "<GPU size>"}, one of: huge, small, whole' in no_body.body["message"]
    )
    unknown = server.request("POST", path, {"size": "tiny"})
    assert unknown.status == 400 and "unknown GPU size 'tiny'" in unknown.body["message"]
    same = server.request("POST", path, {"size": "small"})
    assert same.status == 400 and "already of GPU size 'small'" in same.body["message"]
    never = server.request("POST", path, {"size": "huge"})
    assert never.status == 409 and "never fits" in never.body["message"]
    missing = server.request("POST", "/api/elastic/kernels/no-such-kernel/resize", {"size": "whole"})
    assert missing.status == 404
    cpu = server.start_kernel("python3")
    sizeless = server.request("POST", f"/api/elastic/kernels/{cpu}/resize", {"size": "whole"})
    assert sizeless.status == 409 and "has no GPU size" in sizeless.body["message"]
    assert model(server, kernel_id)["state"] == "running"  # nothing was done to it


def test_hibernation_shows_the_bytes_written(server: RunningServer) -> None:
    """While hibernating, the kernel model's ``hibernate`` says how much of the checkpoint is written
    (the agent's progress file) and the writer's estimate of the whole."""
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(
        kernel_id,
        "big = bytearray(300 * 2**20)\n"
        "class SlowToSave:  # pickled after big: 3 s during which big's bytes are on disk\n"
        "    def __reduce__(self):\n"
        "        import time\n"
        "        time.sleep(3)\n"
        "        return (int, (1,))\n"
        "slow = SlowToSave()",
    )
    assert model(server, kernel_id)["hibernate"] is None  # only while hibernating
    outcome: list[int] = []
    sender = threading.Thread(
        target=lambda: outcome.append(
            server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status
        )
    )
    sender.start()
    seen: list[dict] = []
    while sender.is_alive():
        current = model(server, kernel_id)
        if current["state"] == "hibernating" and current["hibernate"]:
            seen.append(current["hibernate"])
        time.sleep(0.05)
    sender.join()
    assert outcome == [200]
    assert seen, "no bytes written were shown while hibernating"
    written = [s["written_mib"] for s in seen]
    assert written == sorted(written) and written[-1] > 0, seen  # grows while the file is written
    assert all(s["expected_mib"] >= 300 for s in seen), seen
    assert model(server, kernel_id)["hibernate"] is None
