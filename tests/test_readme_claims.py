"""README claims that had no test: each one here against a real server, kernels and websockets.

* elastic kernels ignore jupyter_server's own culler (``MappingKernelManager.cull_idle_timeout``),
  which still shuts down plain CPU kernels;
* without NVML: no driver and nothing declared means no GPUs and CPU kernels only (in the log and
  in ``/api/elastic/gpus``); with a declared inventory the policy runs on Jupyter activity alone
  and says so in ``activity.idle_signals``;
* several cells sent over the websocket while the kernel is hibernated run in order after the
  resume, each with its reply;
* ``CullPolicy.busy_gpu_idle_warning``: a cell running long with the GPU idle is warned about,
  and its kernel is never hibernated.

"NVML missing" is the NVML TEST DOUBLE (``FileNvmlDouble``) scripted to fail like a machine
without a driver, so these run the same on a machine that has one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websocket

from tests.conftest import INVENTORY, PROFILES
from tests.support.gate import Gate
from tests.support.server import KernelChannel, RunningServer, start_server, wait_for

NVML_DOUBLE = "kernelmgr.activity.nvml_double.FileNvmlDouble"
NO_DRIVER = "NVML unavailable: no NVIDIA driver (test double)"


def write_gpu_script(
    path: Path, processes: list[dict[str, Any]] | None = None, unavailable: str = ""
) -> None:
    """What the NVML double reports: the test GPUs, these processes, or a missing driver."""
    script = {
        "devices": [{"uuid": d["uuid"], "name": d["name"], "memory_mib": d["memory_mib"]} for d in INVENTORY],
        "processes": processes or [],
        "unavailable": unavailable,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(script))
    tmp.replace(path)


def serve(home: Path, config: dict[str, Any], gpu_script: Path | None = None) -> RunningServer:
    env = {"ELASTIC_NVML_DOUBLE_FILE": str(gpu_script)} if gpu_script else None
    return start_server(home, config, env_extra=env)


def model(server: RunningServer, kernel_id: str) -> dict[str, Any]:
    doc: dict[str, Any] = server.get(f"/api/elastic/kernels/{kernel_id}")
    return doc


def state(server: RunningServer, kernel_id: str) -> str:
    return str(model(server, kernel_id)["state"])


def stream_text(iopub: list[dict[str, Any]]) -> str:
    return "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")


# -- jupyter_server's culler -----------------------------------------------------------------


@pytest.fixture
def culling_server(tmp_path: Path) -> Iterator[RunningServer]:
    """jupyter_server's culler on a short fuse; the elastic CullPolicy off."""
    config = {
        "ElasticKernels": {"profiles": PROFILES, "gpu_inventory": INVENTORY},
        "MappingKernelManager": {"cull_idle_timeout": 2, "cull_interval": 1},
    }
    running = serve(tmp_path, config)
    yield running
    running.stop()


def test_jupyter_server_culler_leaves_elastic_kernels_alone(culling_server: RunningServer) -> None:
    """The CPU kernel is the witness: once jupyter_server culled it, it had every chance to cull
    the elastic kernel too (whose last cell ran before the CPU kernel's)."""
    server = culling_server
    elastic = server.start_kernel("python3-gpu-small")
    server.execute(elastic, "kept = 'state'")
    cpu = server.start_kernel("python3")
    server.execute(cpu, "x = 1")
    wait_for(
        lambda: server.request("GET", f"/api/kernels/{cpu}").status == 404,
        timeout=60,
        what="jupyter_server's culler to shut down the CPU kernel",
    )
    assert server.get(f"/api/kernels/{elastic}")["id"] == elastic
    assert state(server, elastic) == "running", "not culled, and not hibernated (CullPolicy is off)"
    assert server.execute(elastic, "print(kept)").strip() == "state"
    culling = server.get("/api/elastic/policy")["jupyter_server_culling"]
    assert culling["cull_idle_timeout"] == 2 and "non-elastic kernels only" in culling["applies_to"]


# -- NVML missing ------------------------------------------------------------------------------


def test_no_driver_and_nothing_declared_means_cpu_kernels_only(tmp_path: Path) -> None:
    script = tmp_path / "gpu.json"
    write_gpu_script(script, unavailable=NO_DRIVER)
    running = serve(tmp_path, {"ElasticKernels": {"profiles": PROFILES, "nvml_class": NVML_DOUBLE}}, script)
    try:
        gpus = running.get("/api/elastic/gpus")
        assert gpus["source"] == "none" and gpus["devices"] == []
        assert gpus["message"].startswith(f"No GPUs: {NO_DRIVER}")
        assert "only CPU kernels are offered" in gpus["message"]
        specs = running.get("/api/kernelspecs")["kernelspecs"]
        assert "python3" in specs and not [name for name in specs if "-gpu-" in name]
        log = running.log()
        assert "no GPUs" in log and NO_DRIVER in log and "only CPU kernels are offered" in log
        cpu = running.start_kernel("python3")
        assert running.execute(cpu, "print(6 * 7)").strip() == "42"
    finally:
        running.stop()


def test_declared_gpus_without_nvml_cull_on_jupyter_activity_alone(tmp_path: Path) -> None:
    script = tmp_path / "gpu.json"
    write_gpu_script(script, unavailable=NO_DRIVER)
    config = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "nvml_class": NVML_DOUBLE,
            "gpu_sample_interval": 0.5,
            "checkpoint_root": str(tmp_path / "checkpoints"),
        },
        "CullPolicy": {"idle_timeout": 4, "warn_before": 0, "interval": 1},
    }
    running = serve(tmp_path, config, script)
    try:
        kernel_id = running.start_kernel("python3-gpu-small")
        running.execute(kernel_id, "kept = 41")
        activity = wait_for(
            lambda: (
                (a := model(running, kernel_id)["activity"])["gpu_activity_source"].startswith("unavailable")
                and a
            ),
            what="a GPU sample that found no NVML",
        )
        assert NO_DRIVER in activity["gpu_activity_source"]
        assert NO_DRIVER in running.get("/api/elastic/policy")["gpu_activity"]  # not "nvml"
        assert activity["idle_signals"] == "no cell run; GPU activity not measurable here"
        wait_for(lambda: state(running, kernel_id) == "hibernated", timeout=60, what="hibernation")
        assert running.execute(kernel_id, "print(kept + 1)", timeout=120).strip() == "42"
    finally:
        running.stop()


# -- cells queued while hibernated ---------------------------------------------------------------


def test_cells_sent_while_hibernated_run_in_order_with_their_replies(plain_server: RunningServer) -> None:
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        plain_server.execute(kernel_id, "seq = []")
        assert plain_server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
        cells = [f"seq.append({n}); print(len(seq))" for n in range(1, 5)] + ["print(seq)"]
        with plain_server.channel(kernel_id) as chan:
            sent = [
                chan.send("execute_request", {"code": code, "silent": False, "store_history": True})
                for code in cells
            ]
            replies, outputs = collect_all(chan, sent)
        assert [r["parent_header"]["msg_id"] for r in replies] == sent, "replies come in the order sent"
        assert [r["content"]["status"] for r in replies] == ["ok"] * len(cells)
        counts = [r["content"]["execution_count"] for r in replies]
        assert counts == list(range(counts[0], counts[0] + len(cells))), "each cell ran once, in order"
        assert [outputs[m].strip() for m in sent] == ["1", "2", "3", "4", "[1, 2, 3, 4]"]
    finally:
        plain_server.shutdown_kernel(kernel_id)


def collect_all(
    chan: KernelChannel, msg_ids: list[str], timeout: float = 120
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every reply (in arrival order) and each request's stdout, once all are idle."""
    replies: list[dict[str, Any]] = []
    outputs = {msg_id: "" for msg_id in msg_ids}
    idle: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(replies) < len(msg_ids) or len(idle) < len(msg_ids):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{len(replies)} replies, {len(idle)} idle of {len(msg_ids)} in {timeout}s")
        chan.conn.settimeout(max(0.1, deadline - time.monotonic()))
        msg = chan.recv()
        parent = msg.get("parent_header", {}).get("msg_id")
        if parent not in outputs:
            continue
        if msg["channel"] == "shell" and msg["msg_type"] == "execute_reply":
            replies.append(msg)
        elif msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            outputs[parent] += msg["content"]["text"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle.add(parent)
    return replies, outputs


# -- the busy-GPU warning --------------------------------------------------------------------------


def test_long_cell_with_idle_gpu_is_warned_and_never_hibernated(tmp_path: Path) -> None:
    """The idle witness kernel, started after the long cell, is hibernated by the same policy."""
    script = tmp_path / "gpu.json"
    write_gpu_script(script)
    config = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "nvml_class": NVML_DOUBLE,
            "gpu_sample_interval": 0.5,
            "checkpoint_root": str(tmp_path / "checkpoints"),
        },
        "CullPolicy": {"idle_timeout": 4, "warn_before": 0, "interval": 1, "busy_gpu_idle_warning": 2},
    }
    running = serve(tmp_path, config, script)
    gate = Gate(tmp_path / "gate")
    try:
        busy = running.start_kernel("python3-gpu-small")
        pid = int(running.execute(busy, "import os; print(os.getpid())").strip())
        device = model(running, busy)["slice"]["devices"][0]["uuid"]
        # The kernel holds GPU memory but runs nothing on the GPU (e.g. waiting on I/O).
        write_gpu_script(script, [{"pid": pid, "device": device, "memory_mib": 4096, "sm_percent": 0}])
        with running.channel(busy) as chan:
            msg_id = chan.send("execute_request", {"code": gate.cell() + "print('done')", "silent": False})
            wait_for(gate.is_reached, what="the long cell to be running")
            warning = next_stream_containing(chan, "the GPU has been idle")
            assert "not hibernated while a cell runs" in warning and "smaller GPU size" in warning
            witness = running.start_kernel("python3-gpu-small")
            running.execute(witness, "w = 1")
            wait_for(
                lambda: state(running, witness) == "hibernated", timeout=60, what="the idle witness to go"
            )
            assert state(running, busy) == "running"
            gate.open()
            reply, iopub = chan.collect(msg_id, timeout=60)
        assert reply["content"]["status"] == "ok" and "done" in stream_text(iopub)
        assert stream_text(iopub).count("the GPU has been idle") == 0, "warned once per cell"
        metrics = running.text("/metrics")
        assert 'elastic_hibernation_warnings_total{kind="busy_gpu_idle",size="small"} 1.0' in metrics
    finally:
        gate.open()
        running.stop()


def next_stream_containing(chan: KernelChannel, fragment: str, timeout: float = 30) -> str:
    """The text of the next stream message containing ``fragment`` (other messages skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # A deadline per call, not one socket timeout: the server's websocket pings would
        # restart that timeout and the wait would never end.
        chan.conn.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            msg = chan.recv()
        except websocket.WebSocketTimeoutException:
            break
        if msg["msg_type"] == "stream" and fragment in msg["content"]["text"]:
            return str(msg["content"]["text"])
    raise AssertionError(f"no message containing {fragment!r} within {timeout}s")
