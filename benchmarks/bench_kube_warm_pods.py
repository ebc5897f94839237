"""Kubernetes warm pods against cold pods: resume and hibernate, side by side in one run (issue 13).

One server on the test control plane (etcd, kube-apiserver, scheduler, controller manager built
from the Kubernetes modules) with two runner nodes that run pods as local processes
(``tests/support/node_runner.py``; 3 GPUs between them). Two GPU sizes identical but for their
name: ``warm`` has ``ElasticKubernetesProvisioner.warm_pods = {"warm": {"count": 1, "preload":
PRELOAD}}``, ``cold`` has none. For each state size, rounds alternate between the sizes: a kernel
imports the preload modules and makes one float32 numpy array of that size, is hibernated (timed:
a warm-origin kernel's checkpoint is copied out of its pod through the server), then resumed,
timed from the first cell sent to its reply (the cell touches the array).

What a cold pod pays here: the API calls, scheduling, the runner starting the process, Python,
ipykernel and the preload imports (``--preload``, default ``numpy,pandas,matplotlib.pyplot``; the
frameworks GPU notebooks import, torch above all, take seconds, so they only widen the gap). A
real cluster adds the container start (image present) to the cold path only; this benchmark does
not have it.

Run: ``python benchmarks/bench_kube_warm_pods.py`` (needs ``scripts/envtest.sh build``). Prints a
Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from tests.support.kube import ControlPlane, wait_for
from tests.support.node_runner import NodeRunner
from tests.support.pod_cluster import PodCluster, pod_cluster
from tests.support.server import RunningServer, start_server

MIB = 2**20


def setup_cell(nbytes: int, preload: list[str]) -> str:
    imports = "".join(f"import {module}\n" for module in preload)
    return (
        f"{imports}import numpy\n"
        f"t = numpy.random.default_rng(1).random({max(nbytes // 4, 1)}, dtype=numpy.float32)\n"
        "checksum = float(t[:1000].astype('float64').sum())\n"
    )


CHECK_CELL = "print(abs(float(t[:1000].astype('float64').sum()) - checksum) < 1e-9)"


def warm_ready(server: RunningServer) -> bool:
    return bool(server.get("/api/elastic/gpus")["warm_pods"].get("warm", {}).get("ready"))


def cycle(
    server: RunningServer, cluster: PodCluster, size: str, nbytes: int, preload: list[str]
) -> tuple[float, float]:
    """(hibernate seconds, resume seconds) of one kernel of ``size``."""
    kernel_id = server.start_kernel(f"python3-gpu-{size}")
    with server.channel(kernel_id, timeout=600) as chan:
        result = chan.execute(setup_cell(nbytes, preload), timeout=600)
        assert not result.error, result.error
        start = time.perf_counter()
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        hibernate = time.perf_counter() - start
        assert reply.status == 200, reply
        if size == "warm":
            wait_for(lambda: warm_ready(server), 300, "a ready warm pod")
        start = time.perf_counter()
        result = chan.execute(CHECK_CELL, timeout=600)
        resume = time.perf_counter() - start
        assert not result.error and result.stdout.strip() == "True", result
        name = cluster.running_pod(kernel_id).metadata.name
        assert name.startswith("warm-") == (size == "warm"), name
    server.shutdown_kernel(kernel_id)
    wait_for(lambda: cluster.pod_of(kernel_id) is None, 120, "the kernel pod to go")
    return hibernate, resume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,64", help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--preload", default="numpy,pandas,matplotlib.pyplot", help="modules, comma-sep.")
    args = parser.parse_args()
    preload = args.preload.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    with (
        tempfile.TemporaryDirectory(prefix="elastic-warm-pods-bench-") as tmp,
        ControlPlane(Path(tmp) / "plane") as plane,
    ):
        api = plane.api_client()
        with (
            NodeRunner(
                plane.configuration(user="system:node:runner-0", groups=["system:nodes"]),
                "runner-0",
                Path(tmp) / "runner",
                capacity={"nvidia.com/gpu": "2"},
                heartbeat_interval=5,
                admin_configuration=plane.configuration(),
            ) as runner,
            pod_cluster(plane, api, runner, "bench-warm") as cluster,
        ):
            config: dict[str, Any] = cluster.config(
                warm_pods={"warm": {"count": 1, "preload": preload}}, launch_timeout=300.0
            )
            config["ElasticKernels"]["profiles"] = {"warm": {"gpu_fraction": 1}, "cold": {"gpu_fraction": 1}}
            config["ElasticKernels"]["gpu_inventory"] = [
                {"uuid": f"GPU-bench-{i}", "name": "Test A100", "memory_mib": 40960} for i in range(3)
            ]
            server = start_server(Path(tmp) / "server", config)
            try:
                wait_for(lambda: warm_ready(server), 300, "the warm pod")
                print_header(
                    [
                        "state",
                        "cold pod: resume",
                        "warm pod: resume",
                        "cold / warm",
                        "cold pod: hibernate",
                        "warm pod: hibernate",
                        "warm / cold",
                    ]
                )
                for mib in sizes:
                    times: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
                    for _ in range(args.repeat):
                        for size in ("cold", "warm"):
                            times[size].append(cycle(server, cluster, size, mib * MIB, preload))
                    hib = {k: statistics.median(h for h, _ in v) for k, v in times.items()}
                    res = {k: statistics.median(r for _, r in v) for k, v in times.items()}
                    print_row(
                        [
                            f"{mib} MiB" if mib else "0",
                            f"{res['cold']:.2f} s",
                            f"{res['warm']:.2f} s",
                            f"{res['cold'] / res['warm']:.1f}×",
                            f"{hib['cold']:.2f} s",
                            f"{hib['warm']:.2f} s",
                            f"{hib['warm'] / hib['cold']:.2f}×",
                        ]
                    )
                    sys.stdout.flush()
            finally:
                server.stop()


if __name__ == "__main__":
    main()
