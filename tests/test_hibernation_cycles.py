"""Repeated hibernation: the namespace after any number of cycles, by every trigger, equals
what it would be without hibernation.

An oracle, not a list of expectations: the same cells run in a reference kernel that is
never hibernated (a plain ipykernel started by jupyter_client in the test process), and
after every resume the elastic kernel's namespace digest must equal the reference's. The
digest covers every user variable (values, types, functions called, classes, instances),
shared references, deleted names, and what ``%who`` lists.

The triggers, one per cycle: the REST API, server shutdown (``hibernate_on_shutdown``),
the cull policy, a server killed with SIGKILL (the kernel's watchdog checkpoints it), and
the API again on the restarted server.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import INVENTORY, PROFILES
from tests.support.oracle import SETUP, Reference, check_same, cycle_cell, run_both
from tests.support.server import RunningServer, process_alive, start_server, wait_for

pytest.importorskip("numpy")


def config(checkpoints: Path, policy: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "reap_interval": 1,
            "checkpoint_root": str(checkpoints),
        }
    }
    if policy:
        cfg["CullPolicy"] = {"idle_timeout": 2, "warn_before": 0, "interval": 1}
    return cfg


def model(server: RunningServer, kernel_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/elastic/kernels/{kernel_id}"))


def user_names(digest: dict[str, Any]) -> set[str]:
    return {name for name in digest if not name.startswith("#")}


def test_five_cycles_by_every_trigger_keep_the_namespace(tmp_path: Path, reference: Reference) -> None:
    checkpoints = tmp_path / "checkpoints"
    server = start_server(tmp_path, config(checkpoints))
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        run_both(server, kernel_id, reference, SETUP)
        digest = check_same(server, kernel_id, reference)

        def hibernated_with_everything(srv: RunningServer) -> None:
            current = model(srv, kernel_id)
            assert current["state"] == "hibernated", current
            assert set(current["checkpoint"]["saved"]) == user_names(digest), current["checkpoint"]

        for n, trigger in enumerate(["api", "shutdown", "policy", "crash", "api"], start=1):
            if trigger == "api":
                reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
                assert reply.status == 200, reply
                hibernated_with_everything(server)
            elif trigger == "shutdown":
                server.stop()  # SIGTERM: hibernate_on_shutdown
                server = start_server(tmp_path, config(checkpoints, policy=True))
                hibernated_with_everything(server)
            elif trigger == "policy":
                wait_for(
                    lambda srv=server: model(srv, kernel_id)["state"] == "hibernated",
                    timeout=60,
                    what="the cull policy to hibernate the idle kernel",
                )
                hibernated_with_everything(server)
                assert "policy" in model(server, kernel_id)["state_reason"]
            elif trigger == "crash":
                pid = int(server.execute(kernel_id, "import os; print(os.getpid())").strip())
                reference.run("import os")
                digest = check_same(server, kernel_id, reference)
                os.kill(server.process.pid, signal.SIGKILL)
                server.process.wait()
                wait_for(
                    lambda pid=pid: not process_alive(pid),
                    timeout=60,
                    what="the orphan to checkpoint",
                )
                server = start_server(tmp_path, config(checkpoints))
                hibernated_with_everything(server)

            # The next cell resumes it; the report counts every variable.
            report, _ = run_both(server, kernel_id, reference, cycle_cell(n))
            count = len(user_names(digest))
            assert f"restored {count} variables" in report, report
            digest = check_same(server, kernel_id, reference)
            assert digest["#shared"] is True
            assert f"t{n}" in digest and (n < 3 or f"t{n - 2}" not in digest)
    finally:
        server.stop()
