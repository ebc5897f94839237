"""A gateway change on the real node: how long a notebook's cells go unanswered (issue 45).

The chart installed on the test cluster's real node (``tests/test_chart_on_real_node.py``), one
GPU kernel running. A notebook-like client runs a one-line cell on it through the gateway Service
again and again (a new websocket each time, as a notebook reconnects; 5 s per try), while
``helm upgrade`` changes the gateway's pod. Measured: the longest time between two answered cells
from the upgrade until the new gateway serves the kernel, and the time from the upgrade to the old
gateway pod's end. Side by side in one run, alternating: the chart's update strategy (a surge: the
new pod starts as a standby, the old leader then hands the Lease over) and ``Recreate`` (the old
pod stops first, as every upgrade did before the serving label).

Run as root where the real-node tests run, under the node's lock:
``flock /tmp/ek-real-node.lock python benchmarks/bench_gateway_change.py --repeat 2``.
Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from tests.support.kube import ControlPlane, free_port, wait_for
from tests.support.node import Node, require_node
from tests.test_chart_on_real_node import Chart, Gateway, gateway_pods, installed_chart
from tests.test_images import images_script

STRATEGIES = {"surge (chart default)": {}, "Recreate (before)": {"type": "Recreate"}}


def answered_cells(gateway: Gateway, kernel_id: str, stop: threading.Event, times: list[float]) -> None:
    """Run ``print(1)`` until ``stop``; append the monotonic time of each answered cell."""
    while not stop.is_set():
        try:
            if gateway.execute(kernel_id, "print(1)", timeout=5).strip() == "1":
                times.append(time.monotonic())
                continue
        except Exception:
            pass
        stop.wait(0.1)


def one_change(chart: Chart, kernel_id: str, strategy: dict[str, Any]) -> tuple[float, float]:
    """One upgrade that replaces the gateway pod: (longest unanswered gap, seconds to the old pod's end)."""
    chart.values["gateway"]["updateStrategy"] = strategy
    chart.upgrade()  # the strategy alone: the pod template is unchanged, nothing restarts
    gateway = chart.gateway()
    old = {p.metadata.uid for p in gateway_pods(chart)}
    times: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=answered_cells, args=(gateway, kernel_id, stop, times), daemon=True)
    poller.start()
    wait_for(lambda: len(times) >= 3, 120, "cells answered before the upgrade")
    chart.values["gateway"]["extraEnv"] = [{"name": "ELASTIC_BENCH_CHANGE", "value": uuid.uuid4().hex}]
    began = time.monotonic()
    chart.upgrade()
    wait_for(lambda: not old & {p.metadata.uid for p in gateway_pods(chart)}, 600, "the old pod to end")
    ended = time.monotonic() - began
    wait_for(lambda: times and times[-1] > began + ended, 600, "a cell answered by the new gateway")
    stop.set()
    poller.join()
    marks = [began, *[t for t in times if t > began]]
    return max(b - a for a, b in itertools.pairwise(marks)), ended


def measure(chart: Chart, repeat: int) -> None:
    gateway = chart.gateway()
    kernel_id = chart.start_kernel(gateway)
    assert gateway.execute(kernel_id, "print(1)").strip() == "1"
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in STRATEGIES}
    for _ in range(repeat):
        for name, strategy in STRATEGIES.items():
            gap, ended = one_change(chart, kernel_id, strategy)
            results[name][0].append(gap)
            results[name][1].append(ended)
    print_header(
        ["strategy", "longest unanswered cell gap (s)", "upgrade → old pod gone (s)", "gap / Recreate's"]
    )
    base = statistics.median(results["Recreate (before)"][0])
    for name, (gaps, ends) in results.items():
        gap = statistics.median(gaps)
        print_row(
            [
                name,
                f"{gap:.1f} [{min(gaps):.1f}–{max(gaps):.1f}]",
                f"{statistics.median(ends):.1f}",
                f"{gap / base:.2f}×",
            ]
        )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    paths = require_node()
    with (
        tempfile.TemporaryDirectory(prefix="elastic-gateway-change-") as tmp,
        ControlPlane(Path(tmp) / "plane") as plane,
    ):
        api = plane.api_client()
        registry_dir = Path(tmp) / "registry"
        registry_dir.mkdir()
        registry = images_script("registry-start", str(registry_dir), str(free_port())).strip()
        node_dir = Path(f"/tmp/ekg-{os.getpid()}")  # short: shim sockets and mount options are length-limited
        try:
            with Node(node_dir, plane.admin_kubeconfig, paths=paths, registry=registry) as node:
                kernel, gateway_image = images_script("push", registry).split()
                images = {"kernel": kernel, "gateway": gateway_image}
                with installed_chart(api, node, images, plane, Path(tmp)) as chart:
                    measure(chart, args.repeat)
        finally:
            images_script("registry-stop", str(registry_dir))
            shutil.rmtree(node_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
