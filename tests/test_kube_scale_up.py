"""Room for the cluster autoscaler (issue 29): a kernel whose GPU size fits on no node now gets its
pod anyway, left Pending, so an autoscaler sees the demand and adds a node; the start or resume
waits for it within ``ElasticKernels.scale_up_wait`` and books the GPU where the scheduler put it.

Real control plane and node runners: the kernels may only land on nodes labelled as the
autoscaled pool, and there are none until the test starts one (the autoscaler's new node) while
the pod is Pending.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from tests.support.node_runner import NodeRunner  # noqa: E402
from tests.support.pod_cluster import ON_RUNNER, PodCluster, pod_cluster  # noqa: E402
from tests.support.server import RunningServer, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)

NAMESPACE = "elastic-scale-up"
SIZE = "python3-gpu-whole"
#: Only the autoscaler's nodes carry it; the kernels' node selector asks for it.
POOL = {"elastic.test/pool": "autoscaled"}
RESUME_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def cluster(kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner) -> Iterator[PodCluster]:
    with pod_cluster(kube_plane, kube_api, kube_runner, NAMESPACE) as made:
        yield made


def scale_up_config(cluster: PodCluster, wait: float) -> dict[str, Any]:
    config = cluster.config(node_selector={**ON_RUNNER, **POOL})
    elastic = config["ElasticKernels"]
    del elastic["gpu_inventory"]
    elastic.update(gpu_inventory_source="kubernetes", scale_up_wait=wait, resume_timeout=RESUME_TIMEOUT)
    return config


def added_node(cluster: PodCluster, name: str) -> NodeRunner:
    """What a cluster autoscaler does: a node of the pool registers, with one GPU."""
    return NodeRunner(
        cluster.plane.configuration(user=f"system:node:{name}", groups=["system:nodes"]),
        name,
        cluster.runners[0].volumes_root,
        capacity={"nvidia.com/gpu": "1"},
        labels=POOL,
        heartbeat_interval=5,
        admin_configuration=cluster.plane.configuration(),
    ).start()


class InBackground(threading.Thread):
    def __init__(self, server: RunningServer, method: str, path: str, body: Any = None) -> None:
        super().__init__(daemon=True)
        self.server, self.method, self.path, self.body = server, method, path, body
        self.reply: Any = None
        self.start()

    def run(self) -> None:
        self.reply = self.server.request(self.method, self.path, self.body, timeout=600)


def unschedulable_pod(cluster: PodCluster) -> Any:
    """The kernel pod the scheduler has tried and found no node for: what an autoscaler acts on."""

    def seen() -> Any:
        for pod in cluster.pods():
            for condition in pod.status.conditions or ():
                if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                    return pod
        return None

    return wait_for(seen, 120, "a Pending kernel pod the scheduler found no node for")


def started(server: RunningServer, cluster: PodCluster) -> None:
    """The server knows the cluster's nodes (none of them the pool's)."""
    wait_for(lambda: server.get("/api/elastic/gpus")["devices"], 60, "the nodes' GPUs")


def test_a_kernel_that_fits_nowhere_waits_pending_for_a_node_the_autoscaler_adds(
    cluster: PodCluster, tmp_path: Path
) -> None:
    server = start_server(tmp_path, scale_up_config(cluster, 300))
    nodes: list[NodeRunner] = []
    try:
        started(server, cluster)
        start = InBackground(server, "POST", "/api/kernels", {"name": SIZE})
        pending = unschedulable_pod(cluster)
        assert pending.spec.node_name is None and start.reply is None
        assert server.get("/api/elastic/gpus")["devices"] and all(
            not d["slices"] for d in server.get("/api/elastic/gpus")["devices"]
        )
        nodes.append(added_node(cluster, "scale-0"))
        start.join(300)
        assert start.reply is not None and start.reply.status == 201, start.reply
        kernel_id = start.reply.body["id"]
        assert server.execute(kernel_id, "x = 41; print(6 * 7)").strip() == "42"
        assert cluster.running_pod(kernel_id).spec.node_name == "scale-0"
        booked = [
            (d["node"], s["kernel_id"])
            for d in server.get("/api/elastic/gpus")["devices"]
            for s in d["slices"]
        ]
        assert booked == [("scale-0", kernel_id)], booked

        # The node goes (scaled down while the kernel slept); the resume's pod waits for the next.
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply.body
        nodes.pop().stop()
        wait_for(
            lambda: all(d["node"] != "scale-0" for d in server.get("/api/elastic/gpus")["devices"]),
            60,
            "the removed node's GPU to leave the view",
        )
        resume = InBackground(server, "POST", f"/api/elastic/kernels/{kernel_id}/resume")
        unschedulable_pod(cluster)
        wait_for(
            lambda: (
                (server.get(f"/api/elastic/kernels/{kernel_id}")["resume"] or {}).get("phase")
                == "waiting_for_node"
            ),
            60,
            "the resume to show it waits for a node",
        )
        # The node comes after the resume's restore budget (resume_timeout) would have run out:
        # the pod's wait is its own budget, and the restore's counts from when the pod runs.
        time.sleep(RESUME_TIMEOUT + 2)
        nodes.append(added_node(cluster, "scale-1"))
        resume.join(300)
        assert resume.reply is not None and resume.reply.status == 200, resume.reply
        assert server.execute(kernel_id, "print(x + 1)").strip() == "42"
        assert cluster.running_pod(kernel_id).spec.node_name == "scale-1"
        server.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
    finally:
        server.stop()
        for node in nodes:
            node.stop()


def test_a_pod_no_node_comes_for_fails_past_scale_up_wait_saying_so(
    cluster: PodCluster, tmp_path: Path
) -> None:
    server = start_server(tmp_path, scale_up_config(cluster, 3))
    try:
        started(server, cluster)
        reply = server.request("POST", "/api/kernels", {"name": SIZE})
        assert reply.status == 503, reply
        message = reply.body["message"]
        assert "ElasticKernels.scale_up_wait" in message and "Unschedulable" in message, message
        assert server.get("/api/kernels") == []
        wait_for(lambda: not cluster.pods(), 60, "the Pending pod to be deleted")
    finally:
        server.stop()
