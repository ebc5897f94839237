"""A gateway change on the real node: how long a notebook's cells go unanswered (issue 45).

The chart installed on the test cluster's real node (``tests/test_chart_on_real_node.py``), one
GPU kernel running. A notebook-like client runs a one-line cell on it through the gateway Service
again and again (a new websocket each time, as a notebook reconnects; 5 s per try), while
``helm upgrade`` changes the gateway's pod. Measured: the longest time between two answered cells
from the change until the new gateway serves the kernel, and the time from the change to the old
gateway pod's end. Side by side in one run, alternating: an upgrade with the chart's update
strategy (a surge: the new pod starts as a standby, the old leader then hands the Lease over) and
with ``Recreate`` (the old pod stops first, as every upgrade did before the serving label); the
serving gateway pod deleted with a standby beside it and without.

Run as root where the real-node tests run, under the node's lock:
``flock /tmp/ek-real-node.lock python benchmarks/bench_gateway_change.py --repeat 2`` (``--load 2``:
with two busy processes beside it).
Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_real_node import chart_on_the_real_node
from benchmarks.markdown import print_header, print_row
from tests.support.kube import wait_for
from tests.test_chart_on_real_node import Chart, Gateway, gateway_pods

#: (name, gateway values, the change): an upgrade that replaces the gateway pod, or its deletion.
SCENARIOS: list[tuple[str, dict[str, Any], str]] = [
    ("helm upgrade, surge (chart default)", {"replicas": 1, "updateStrategy": {}}, "upgrade"),
    ("helm upgrade, Recreate (before)", {"replicas": 1, "updateStrategy": {"type": "Recreate"}}, "upgrade"),
    ("gateway pod deleted, 2 replicas", {"replicas": 2, "updateStrategy": {}}, "delete"),
    ("gateway pod deleted, 1 replica", {"replicas": 1, "updateStrategy": {}}, "delete"),
]


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


def pod_uids(chart: Chart) -> set[str]:
    """Every gateway pod's uid, terminating ones too."""
    pods = chart.core.list_namespaced_pod(
        chart.namespace, label_selector="app.kubernetes.io/component=gateway"
    )
    return {p.metadata.uid for p in pods.items}


def one_change(chart: Chart, kernel_id: str, values: dict[str, Any], change: str) -> tuple[float, float]:
    """One gateway change: (longest gap between answered cells, seconds to the old pod's end)."""
    if any(chart.values["gateway"].get(k) != v for k, v in values.items()):
        chart.values["gateway"].update(values)
        chart.upgrade()  # the replicas and strategy alone: nothing restarts
    wait_for(lambda: len(gateway_pods(chart)) == values["replicas"], 600, "the gateway pods")
    gateway = chart.gateway()
    leader = chart.pod
    old = {p.metadata.uid for p in gateway_pods(chart)} if change == "upgrade" else {leader.metadata.uid}
    times: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=answered_cells, args=(gateway, kernel_id, stop, times), daemon=True)
    poller.start()
    wait_for(lambda: len(times) >= 3, 120, "cells answered before the change")
    began = time.monotonic()
    if change == "upgrade":
        chart.values["gateway"]["extraEnv"] = [{"name": "ELASTIC_BENCH_CHANGE", "value": uuid.uuid4().hex}]
        chart.upgrade()
    else:
        chart.core.delete_namespaced_pod(leader.metadata.name, chart.namespace)
    # Gone from the API, not just terminating (a terminating gateway may still answer what it has).
    wait_for(lambda: not old & pod_uids(chart), 600, "the old pod to be gone")
    ended = time.monotonic() - began
    wait_for(lambda: times and times[-1] > began + ended, 600, "a cell answered by the new gateway")
    print(f"{values} {change}: old pod gone after {ended:.1f} s", file=sys.stderr, flush=True)
    stop.set()
    poller.join()
    marks = [began, *[t for t in times if t > began]]
    return max(b - a for a, b in itertools.pairwise(marks)), ended


def measure(chart: Chart, repeat: int) -> None:
    gateway = chart.gateway()
    kernel_id = chart.start_kernel(gateway)
    assert gateway.execute(kernel_id, "print(1)").strip() == "1"
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, _ in SCENARIOS}
    for _ in range(repeat):
        for name, values, change in SCENARIOS:
            gap, ended = one_change(chart, kernel_id, values, change)
            results[name][0].append(gap)
            results[name][1].append(ended)
    columns = ["change", "longest gap between answered cells (s)", "change → old pod gone (s)"]
    print_header(columns)
    for name, (gaps, ends) in results.items():
        gap = statistics.median(gaps)
        print_row([name, f"{gap:.1f} [{min(gaps):.1f}–{max(gaps):.1f}]", f"{statistics.median(ends):.1f}"])
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside it (a loaded machine)")
    args = parser.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        run(args.repeat)
    finally:
        for burner in burners:
            burner.kill()


def run(repeat: int) -> None:
    with chart_on_the_real_node("elastic-gateway-change-") as chart:
        measure(chart, repeat)


if __name__ == "__main__":
    main()
