"""Failover between two gateways sharing a Lease (issue 30): how long the notebooks wait.

The tests' real control plane and node runners (kernel pods as local processes), two gateway
processes (jupyter_server with the extension, ``ElasticLeaderElection.enabled``) sharing one
checkpoint folder and one Lease, ``--kernels`` running kernels (one or two: the two runner nodes
have one GPU each), each holding a variable. Each round the active gateway is stopped, alternately:

* **SIGKILL** (OOM kill, node loss): the standby takes over once it has seen the Lease unrenewed
  for ``lease_duration``;
* **SIGTERM** (rolling update, drain): the leader releases the Lease on its way out; the standby
  takes it at its next try.

Measured from the signal: until the standby's readiness answers 200 (the Service would route to
it), and until the first kernel answers a cell through it (same process, variable intact). The
stopped gateway is started again as the new standby for the next round.

``python benchmarks/bench_failover.py --kernels 2 --rounds 4 --lease 15,10,2`` (the chart's
timings; ``--lease 6,4,1`` for short ones). Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from tests.support.kube import ControlPlane, wait_for
from tests.support.node_runner import NodeRunner
from tests.support.pod_cluster import PodCluster, pod_cluster
from tests.support.server import RunningServer, start_server

SIZE = "python3-gpu-whole"


def ready(server: RunningServer) -> bool:
    try:
        return bool(server.request("GET", "/api/elastic/leader", token=None, timeout=5).status == 200)
    except OSError:
        return False


def config(cluster: PodCluster, lease: tuple[float, float, float], kernels: int) -> dict[str, Any]:
    made = cluster.config()
    duration, deadline, retry = lease
    made["ElasticLeaderElection"] = {
        "enabled": True,
        "lease_name": "bench-gateway",
        "lease_duration": duration,
        "renew_deadline": deadline,
        "retry_period": retry,
    }
    return made


def run(
    home: Path, kernels: int, rounds: int, lease: tuple[float, float, float]
) -> list[tuple[str, float, float]]:
    results: list[tuple[str, float, float]] = []
    with (
        ControlPlane(home / "plane") as plane,
        plane.api_client() as api,
        NodeRunner(
            plane.configuration(user="system:node:runner-0", groups=["system:nodes"]),
            "runner-0",
            home / "runner",
            capacity={"nvidia.com/gpu": "1"},
            heartbeat_interval=5,
            admin_configuration=plane.configuration(),
        ) as runner,
        pod_cluster(plane, api, runner, "elastic-bench") as cluster,
    ):
        settings = config(cluster, lease, kernels)
        gateways_home = home / "gateways"
        active = start_server(gateways_home, settings)
        wait_for(lambda: ready(active), 120, "the first gateway to lead")
        standby = start_server(gateways_home, settings)
        ids = [active.start_kernel(SIZE) for _ in range(kernels)]
        for n, kernel_id in enumerate(ids):
            assert active.execute(kernel_id, f"x = {n}; print(x)").strip() == str(n)
        try:
            for r in range(rounds):
                how = signal.SIGKILL if r % 2 == 0 else signal.SIGTERM
                start = time.perf_counter()
                active.process.send_signal(how)
                wait_for(partial(ready, standby), 600, "the standby to take over", interval=0.05)
                took_over = time.perf_counter() - start
                assert standby.execute(ids[0], "print(x)").strip() == "0"
                answered = time.perf_counter() - start
                results.append((how.name, took_over, answered))
                active.process.wait()
                active, standby = standby, start_server(gateways_home, settings)
            for kernel_id in ids:
                active.shutdown_kernel(kernel_id)
        finally:
            active.stop()
            standby.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=2, choices=(1, 2), help="one per runner node (two)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--lease", default="15,10,2", help="lease_duration,renew_deadline,retry_period (s)")
    args = parser.parse_args()
    duration, deadline, retry = (float(v) for v in args.lease.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        results = run(Path(tmp), args.kernels, args.rounds, (duration, deadline, retry))
    print(
        f"\nLease {duration:g} s, renew deadline {deadline:g} s, retry {retry:g} s; {args.kernels} kernels\n"
    )
    print_header(["stop", "rounds", "standby ready (s), median [min–max]", "first cell answered (s), median"])
    for how in ("SIGKILL", "SIGTERM"):
        rows = [r for r in results if r[0] == how]
        if not rows:
            continue
        ready_s = [r[1] for r in rows]
        answered = [r[2] for r in rows]
        print_row(
            [
                how,
                str(len(rows)),
                f"{statistics.median(ready_s):.1f} [{min(ready_s):.1f}–{max(ready_s):.1f}]",
                f"{statistics.median(answered):.1f}",
            ]
        )


if __name__ == "__main__":
    main()
