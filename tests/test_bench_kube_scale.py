"""The Kubernetes scale benchmark still runs: ``benchmarks/bench_kube_scale.py --quick`` (5 kernels, 2 nodes).

It starts its own control plane (with an audit log, which the session's cluster lacks), so it runs
as a subprocess; no time is asserted, only the counts the benchmark exists to show.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kube import REPO_ROOT, require_envtest

require_envtest(module_level=True)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_quick_run_counts_api_requests(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "bench_kube_scale.py"),
            "--quick",
            "--json",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| per kernel start | 4.00 | 4.00 | ≤ 3 + 1 Event |" in done.stdout
    results = json.loads(out.read_text())
    assert results["start"]["client_calls"] == results["start"]["server_calls"] == 4
    assert results["start"]["server_breakdown"] == {
        "create secrets": 1.0,
        "create pods": 1.0,
        "patch secrets": 1.0,
        "create events": 1.0,  # KernelStarted, in the background
    }
    assert results["shutdown"]["server_calls"] == results["shutdown"]["client_calls"] > 0
    assert results["tick"]["ours"]["server_calls"] == results["tick"]["ours"]["client_calls"] == 0
    assert results["tick"]["baseline_list"]["server_calls"] == 5
    assert results["tick"]["baseline_get"]["server_calls"] == 5
    assert results["latency"]["sequential"]["n"] == 5 and results["latency"]["burst"]["n"] == 5
    assert results["left"] == {"pods": 0, "secrets": 0, "slices": 0}
    assert "informer" not in done.stderr  # the pod watch never disconnected
