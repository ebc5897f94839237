"""Faults found by running the server, each reproduced end to end: a full disk, a delete
during a resume, a resume that times out, a server killed while a cell runs.

What every test checks in the end is the same: nothing stuck (no ``hibernating`` or
``resuming`` once nothing is in flight), nothing leaked (no process of the kernel, no slice,
no files of a deleted kernel) and nothing lost (the newest committed state comes back).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import elastic_config as config
from tests.support.disk import small_disk
from tests.support.gate import Gate, slow_to_load_cell
from tests.support.server import Reply, RunningServer, start_server, wait_for

pytest.importorskip("numpy")


def kernel_processes(kernel_id: str) -> list[int]:
    """Every live process started for ``kernel_id`` (found by the agent's environment)."""
    marker = f"ELASTIC_KERNEL_ID={kernel_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if marker not in environ.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def slices(server: RunningServer) -> list[Any]:
    return [s for d in server.get("/api/elastic/gpus")["devices"] for s in d["slices"]]


def state(server: RunningServer, kernel_id: str) -> str:
    return str(server.get(f"/api/elastic/kernels/{kernel_id}")["state"])


def hibernate(server: RunningServer, kernel_id: str) -> Reply:
    return server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")


#: A variable whose *restore* takes ``n`` seconds: unpickling calls ``time.sleep(n)``.
def test_disk_full_answers_507_keeps_running_and_hibernates_once_space_is_freed(tmp_path: Path) -> None:
    with small_disk(tmp_path, "8m") as disk:
        running = start_server(tmp_path, config(disk))
        try:
            kernel_id = running.start_kernel("python3-gpu-small")
            running.execute(kernel_id, "import numpy as np; kept = 41; big = np.ones(3_000_000)")
            # Fill what is left, so that not even the small registry file fits.
            filler = disk / "filler"
            # Unbuffered: a buffered file would fail again at close, flushing a part-written block.
            with open(filler, "wb", buffering=0) as handle, contextlib.suppress(OSError):
                while True:
                    handle.write(b"\0" * 65536)
            for _attempt in range(2):  # and again: never stuck "hibernating" (it used to answer 409)
                reply = hibernate(running, kernel_id)
                assert reply.status == 507, reply
                # Refused from its estimate, before anything was written (lifecycle/storage.py).
                assert "B free and this checkpoint needs about 22.9 MiB" in reply.body["message"], reply
                assert state(running, kernel_id) == "running"
                assert len(slices(running)) == 1
            assert running.execute(kernel_id, "print(kept + 1)").strip() == "42"

            filler.unlink()
            running.execute(kernel_id, "del big")
            assert hibernate(running, kernel_id).status == 200
            assert slices(running) == []
            assert running.execute(kernel_id, "print(kept + 1)", timeout=120).strip() == "42"
        finally:
            running.stop()


def test_delete_while_resuming_stops_the_process_frees_the_slice_and_leaves_no_files(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    running = start_server(tmp_path, config(checkpoints))
    try:
        kernel_id = running.start_kernel("python3-gpu-small")
        running.execute(kernel_id, slow_to_load_cell(6) + "x = 1")
        assert hibernate(running, kernel_id).status == 200
        kernel_dir = next(checkpoints.glob(f"*/{kernel_id}"))

        replies: list[Reply] = []
        resumer = threading.Thread(
            target=lambda: replies.append(running.request("POST", f"/api/elastic/kernels/{kernel_id}/resume"))
        )
        resumer.start()
        wait_for(lambda: kernel_processes(kernel_id), what="the resume to launch the kernel process")
        assert state(running, kernel_id) == "resuming"

        assert running.request("DELETE", f"/api/kernels/{kernel_id}").status == 204
        resumer.join(60)
        assert replies and replies[0].status == 404, replies
        assert "deleted" in replies[0].body["message"]
        assert kernel_processes(kernel_id) == []
        assert slices(running) == []
        assert not kernel_dir.exists()
        assert running.request("GET", f"/api/kernels/{kernel_id}").status == 404
    finally:
        running.stop()
    # Not even the server's exit brings back a process that writes into the removed directory.
    assert not kernel_dir.exists()


def test_resume_that_times_out_stops_its_process_and_stays_hibernated(tmp_path: Path) -> None:
    running = start_server(tmp_path, config(tmp_path / "checkpoints", resume_timeout=2))
    try:
        kernel_id = running.start_kernel("python3-gpu-small")
        running.execute(kernel_id, slow_to_load_cell(30))
        assert hibernate(running, kernel_id).status == 200

        reply = running.request("POST", f"/api/elastic/kernels/{kernel_id}/resume")
        assert reply.status == 504, reply
        assert "did not answer within" in reply.body["message"]
        model = running.get(f"/api/elastic/kernels/{kernel_id}")
        assert model["state"] == "hibernated" and model["slice"] is None
        assert "resume failed" in model["state_reason"]
        # What the chart's ElasticResumesFailing alert watches.
        assert 'elastic_resume_failures_total{size="small"} 1.0' in running.text("/metrics")
        wait_for(lambda: kernel_processes(kernel_id) == [], what="the timed-out process to be stopped")
        assert slices(running) == []
        assert running.request("DELETE", f"/api/kernels/{kernel_id}").status == 204
    finally:
        running.stop()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_server_gone_during_a_long_cell_keeps_the_cells_result(tmp_path: Path, how: str) -> None:
    """The server goes while a cell runs, killed (SIGKILL) or stopped gracefully (SIGTERM, where
    the kernel cannot hibernate now and shutting it down would lose its variables and checkpoints).

    The kernel is left to itself: it finishes its cell, checkpoints (with what the cell made) and
    exits; the next server starts at once, lists it as hibernating meanwhile, then hibernated, and
    the resume brings back the cell's result. (recover() used to block the start, then give up
    after 60 s; a graceful stop used to shut the kernel down.)
    """
    checkpoints = tmp_path / "checkpoints"
    first = start_server(tmp_path, config(checkpoints))
    kernel_id = first.start_kernel("python3-gpu-small")
    gate = Gate(tmp_path / "gate")  # the cell runs until the second server has seen it running
    with first.channel(kernel_id) as chan:
        chan.execute("before = 1")
        chan.send(
            "execute_request", {"code": gate.cell(limit=600) + "made_by_long_cell = 42", "silent": False}
        )
        wait_for(gate.is_reached, what="the long cell to be running")
    if how == "killed":
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait()
    else:
        first.stop()
        assert first.process.returncode == 0
        assert f"Kernel {kernel_id} could not hibernate at shutdown: left running" in first.log()
    second = start_server(tmp_path, config(checkpoints))
    try:
        if how == "killed":
            assert state(second, kernel_id) == "hibernating"  # the cell is still running
        gate.open()
        wait_for(
            lambda: state(second, kernel_id) == "hibernated", timeout=60, what="the kernel's own checkpoint"
        )
        assert second.execute(kernel_id, "print(before + made_by_long_cell)", timeout=120).strip() == "43"
    finally:
        second.stop()
