"""The kernel pod watch's memory at 1,000, 5,000 and 10,000 kernel pods, steady and through a re-list.

A real control plane with kwok (fake nodes; kwok marks each pod Running with an IP and
conditions, as a kubelet would report it). The pods are the project's own kernel pod manifests
(:func:`kernelmgr.kube.manifests.make_kernel_pod` with the default settings, a whole-GPU size and
a checkpoint claim), bound straight to the fake nodes.

Side by side in one run, for the same pods:

* **before**: the watch as it was until this change, labeled so and implemented here: one
  unpaginated list, every pod kept whole (managed fields dropped), and a re-list that builds the
  new cache beside the old one before swapping;
* **now**: :class:`kernelmgr.kube.informer.PodInformer` as shipped: pages of
  ``PAGE_SIZE`` pods, read as JSON and cut to what is read (:mod:`kernelmgr.kube.shapes`: of a
  pod's spec only its node) before a model is built, and a re-list that keeps the cached copy of
  every unchanged pod (building nothing for it).

Measured with ``tracemalloc`` (Python allocations, which is what grows with pods): the cache
after the first list (steady), and the peak above that during a re-list (what a 410 Gone or a
restart costs), and each one's duration. Run: ``python benchmarks/bench_informer_memory.py``
(``--counts 200,400`` for a quick look). Needs ``bash scripts/envtest.sh build``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubernetes import client

from benchmarks.markdown import print_header, print_row
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.kube.informer import PodInformer, without_managed_fields
from kernelmgr.kube.labels import KERNEL_WATCH_SELECTOR
from kernelmgr.kube.manifests import make_kernel_pod
from kernelmgr.kube.settings import KubeSettings
from tests.support.kube import ControlPlane, fake_gpu_node, node_schedulable, wait_for

NAMESPACE = "bench-memory"
NODES = 20
WHOLE = GpuProfile("whole", "1 GPU", 1.0, None, 100, "whole")
#: What the checkpoint agent's environment holds in a real pod (names, and values of their length).
AGENT_ENV = {
    "ELASTIC_CHECKPOINT_KEY_FILE": "/var/run/elastic/key",
    "ELASTIC_CHECKPOINT_TIMEOUT": "120",
    "ELASTIC_AGENT_VERSION": "0.1.0",
    "ELASTIC_OWNER": "someone@example.org",
    "ELASTIC_MAX_CHECKPOINT_BYTES": "17179869184",
}


class BeforeInformer(PodInformer):
    """The baseline, labeled so: the watch before pages and slim pods (one list, whole pods)."""

    def __init__(self, api: client.ApiClient, namespace: str, selector: str) -> None:
        super().__init__(api, namespace, selector)
        self.page_size = None
        self.shape = None
        self.transform = without_managed_fields

    def relist(self) -> str:
        listed = self.list_func(*self.list_args, **self.list_kwargs)
        items = [without_managed_fields(i) for i in listed.items]
        fresh = {k: item for item in items if (k := self.key(item))}
        with self._lock:
            self._items = fresh
        self.lists += 1
        return str(listed.metadata.resource_version or "")


def kernel_pod(n: int) -> dict[str, Any]:
    kernel_id = str(uuid.uuid4())
    template = KubeSettings(checkpoint_claim="checkpoints").pod_template()
    pod = make_kernel_pod(
        template,
        name=f"kernel-{kernel_id}",
        kernel_id=kernel_id,
        cmd=["python", "-m", "ipykernel_launcher", "-f", "/var/run/elastic/connection.json"],
        agent_env=AGENT_ENV,
        owner=f"user-{n % 300}",
        kernelspec="python3-gpu-whole",
        profile=WHOLE,
        checkpoint_sub_path=f"user-{n % 300}",
    )
    pod["spec"]["nodeName"] = f"mem-{n % NODES:02d}"
    return pod


def grow_to(core: Any, have: int, want: int) -> None:
    """Create kernel pods ``have .. want-1`` (8 at a time) and wait until kwok runs them all."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: core.create_namespaced_pod(NAMESPACE, kernel_pod(n)), range(have, want)))

    def all_running() -> bool:
        running = 0
        token = None
        while True:
            page = core.list_namespaced_pod(NAMESPACE, limit=2000, _continue=token)
            running += sum(1 for p in page.items if p.status.phase == "Running" and p.status.pod_ip)
            token = page.metadata._continue
            if not token:
                return running == want

    wait_for(all_running, 120 + want // 10, f"{want} kernel pods to run", interval=2.0)


def measure(informer: PodInformer) -> dict[str, float]:
    """Steady cache and re-list peak of ``informer`` (not started: it lists when told)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    informer.relist()
    gc.collect()
    steady = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.reset_peak()
    held = tracemalloc.get_traced_memory()[0]
    began = time.perf_counter()
    informer.relist()
    seconds = time.perf_counter() - began
    peak = tracemalloc.get_traced_memory()[1] - held
    tracemalloc.stop()
    assert len(informer.items()) > 0
    return {"steady": steady, "peak": peak, "seconds": seconds, "pods": len(informer.items())}


def mib(value: float) -> str:
    return f"{value / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,5000,10000", help="kernel pod counts, ascending")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        plane = ControlPlane(Path(tmp) / "plane")
        plane.start()
        try:
            api = client.ApiClient(plane.configuration())
            core: Any = client.CoreV1Api(api)
            core.create_namespace({"metadata": {"name": NAMESPACE}})
            for i in range(NODES):
                core.create_node(fake_gpu_node(f"mem-{i:02d}", gpus=8, pods=max(counts)))
            wait_for(
                lambda: sum(node_schedulable(n) for n in core.list_node().items) >= NODES, 120, "the nodes"
            )
            have = 0
            for count in counts:
                grow_to(core, have, count)
                have = count
                before = measure(BeforeInformer(api, NAMESPACE, KERNEL_WATCH_SELECTOR))
                now = measure(PodInformer(api, NAMESPACE, KERNEL_WATCH_SELECTOR))
                rows.append({"pods": count, "before": before, "now": now})
                print(f"measured {count} pods: {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            plane.stop()
    print(f"Kernel pod watch memory (tracemalloc), {NODES} kwok nodes; before = one list, whole pods")
    print()
    print_header(
        [
            "Kernel pods",
            "Cache before",
            "Cache now",
            "Now / before",
            "Re-list peak before",
            "Re-list peak now",
            "Now / before",
            "Re-list s before",
            "Re-list s now",
        ]
    )
    for row in rows:
        b, n = row["before"], row["now"]
        print_row(
            [
                f"{row['pods']:,}",
                mib(b["steady"]),
                mib(n["steady"]),
                f"{n['steady'] / b['steady']:.2f}x",
                mib(b["peak"]),
                mib(n["peak"]),
                f"{n['peak'] / b['peak']:.2f}x",
                f"{b['seconds']:.1f}",
                f"{n['seconds']:.1f}",
            ]
        )
    print()
    per_pod = rows[-1]["now"]["steady"] / rows[-1]["pods"]
    print(f"Now: {per_pod / 1024:.1f} KiB per cached kernel pod.")
    return rows


if __name__ == "__main__":
    main()
