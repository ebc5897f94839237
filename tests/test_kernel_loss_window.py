"""A cell sent between a kernel's loss being reported and the server taking it over.

The loss is real: a local kernel sent SIGTERM checkpoints itself and exits, and its provisioner
reports it (``KernelLoss.vanished``). The takeover reads the kernel's newest checkpoint in a
thread before it hibernates the kernel; :class:`tests.support.held_store.HeldLatestStore` holds
that read, so the test can send its cell exactly then. The cell must wait for the takeover and run
in the resumed kernel, not go to the process that is gone (where nothing would ever answer it).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import websocket

from tests.conftest import elastic_config
from tests.support.held_store import latest_hold
from tests.support.server import KernelChannel, start_server, wait_for


def wait_for_message(chan: KernelChannel, msg_id: str, kind: str, timeout: float) -> list[dict[str, Any]]:
    """Messages for ``msg_id`` up to its first ``kind`` status; AssertionError if none came."""
    deadline = time.monotonic() + timeout
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            msg = chan.recv(deadline)
        except (TimeoutError, OSError, websocket.WebSocketTimeoutException):
            break
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        seen.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == kind:
            return seen
    raise AssertionError(f"no {kind!r} status for the cell within {timeout:g}s; got {seen}")


def test_a_cell_sent_before_the_takeover_of_a_lost_kernel_waits_for_it_and_runs(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    hold = latest_hold(checkpoints)
    hold.mkdir(parents=True)
    config = elastic_config(checkpoints, checkpoint_store_class="tests.support.held_store.HeldLatestStore")
    running = start_server(tmp_path, config)
    try:
        kernel_id = running.start_kernel("python3-gpu-small")
        with running.channel(kernel_id, timeout=120) as tab:
            pid = int(tab.execute("import os; x = 41; print(os.getpid())").stdout.strip())
            (hold / "armed").touch()
            os.kill(pid, signal.SIGTERM)
            wait_for(
                lambda: (hold / "entered").exists(),
                timeout=120,
                what="the server to begin taking the lost kernel over (its checkpoint read is held)",
            )
            log = running.log()
            assert f"Kernel {kernel_id}: its process was sent SIGTERM" in log, log[-3000:]
            assert f"Kernel {kernel_id} was lost" not in log, "the takeover must not have happened yet"

            cell = tab.send(
                "execute_request", {"code": "print(x + 1)", "silent": False, "store_history": True}
            )
            # The server holds the cell (and says the kernel is busy with it); the dead process
            # could not answer, so without the hold nothing would come.
            held = wait_for_message(tab, cell, "busy", timeout=60)
            (hold / "armed").unlink()
            (hold / "release").touch()

            reply, iopub = tab.collect(cell, timeout=180)
        iopub = held + iopub
        assert reply["content"]["status"] == "ok", reply
        stdout = "".join(
            m["content"]["text"]
            for m in iopub
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        )
        stderr = "".join(
            m["content"]["text"]
            for m in iopub
            if m["msg_type"] == "stream" and m["content"]["name"] == "stderr"
        )
        assert stdout.strip() == "42", iopub
        assert "stopped (its process was sent SIGTERM). The kernel checkpointed itself first" in stderr, iopub
        assert running.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "running"
    finally:
        (hold / "release").touch()
        running.stop()
