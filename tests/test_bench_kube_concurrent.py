"""Forty kernel pods started at once, through the server and through the gateway (issue 34).

``benchmarks/bench_kube_concurrent.py``: its own control plane with kwok GPU nodes and a real
server (or gateway, token mode) with the Kubernetes provisioner, so it runs as a subprocess. 40
starts at once for 32 quarter-GPU slices, twice on the same server: 32 answered 201 with a
running kernel and a Running pod, 8 refused with a 4xx JSON reason, the allocator's slices
exactly the running kernels', every delete 204, and nothing left afterwards (kernels, slices,
pods, Secrets). No time is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kube import REPO_ROOT, require_envtest

require_envtest(module_level=True)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

SLICES = 32
OVER = 8


@pytest.mark.parametrize("front", ["server", "gateway"])
def test_forty_concurrent_pod_starts_leave_nothing_stuck_or_held(tmp_path: Path, front: str) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "bench_kube_concurrent.py"),
            f"--kernels={SLICES}",
            f"--over={OVER}",
            "--repeat=2",
            "--settle=120",
            *(["--gateway"] if front == "gateway" else []),
            "--json",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results["rounds"]) == 2
    for round_ in results["rounds"]:
        assert round_["start_status"].get("201") == SLICES, round_["start_errors"]
        assert sum(round_["start_status"].values()) == SLICES + OVER
        assert round_["refused_cleanly"], round_["start_errors"]  # 4xx with a message, never 5xx
        assert round_["stuck"] == 0 and round_["states"] == {"running": SLICES}
        assert round_["slices"] == SLICES and round_["slices_match"]
        assert round_["pods_running"] == SLICES
        assert round_["delete_status"] == {"204": SLICES}
        assert round_["left"] == {"pods": 0, "secrets": 0, "slices": 0, "kernels": 0}
    assert results["server_errors"] == 0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
