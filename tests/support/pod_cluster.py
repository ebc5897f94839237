"""A namespace of the test control plane where kernel pods really run: two runner nodes, a claim.

Shared by the end-to-end Kubernetes server tests: the session's runner node ("runner-0") and a second
one made here ("runner-1", one GPU each, sharing volume folders), a static PersistentVolume and a
ReadWriteMany claim the controller manager binds to it (the runners map the claim to one folder, which
the server also uses as its ``checkpoint_root``, as a server pod mounting the same claim would).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from kernelmgr.kube.labels import DEFAULT_INSTANCE, KERNEL, PROJECT_SELECTOR, component_of, kernel_id_of
from tests.support.kube import ControlPlane, wait_for
from tests.support.node_runner import NodeRunner
from tests.support.ports import free_port_block

CLAIM = "checkpoints"
ON_RUNNER = {"elastic.test/node-runner": "true"}


@dataclass
class PodCluster:
    plane: ControlPlane
    core: Any
    runners: list[NodeRunner]
    checkpoints: Path
    namespace: str
    #: Pods get their own loopback IPs, but other test processes on this machine hand out the same
    #: ones: kernel ports of this cluster's own, below the ephemeral range (tests/support/ports.py).
    first_port: int = field(default_factory=lambda: free_port_block(10))

    def pods(self, component: str = "kernel") -> list[Any]:
        """The server's pods of ``component`` (either label generation, see kernelmgr/kube/labels.py)."""
        items = self.core.list_namespaced_pod(self.namespace, label_selector=PROJECT_SELECTOR).items
        return [p for p in items if component_of(p.metadata.labels, DEFAULT_INSTANCE) == component]

    def secrets(self) -> list[str]:
        items = self.core.list_namespaced_secret(self.namespace, label_selector=PROJECT_SELECTOR).items
        return [s.metadata.name for s in items if component_of(s.metadata.labels, DEFAULT_INSTANCE) == KERNEL]

    def pod_of(self, kernel_id: str) -> Any:
        pods = [p for p in self.pods() if kernel_id_of(p.metadata.labels, DEFAULT_INSTANCE) == kernel_id]
        return pods[0] if pods else None

    def running_pod(self, kernel_id: str) -> Any:
        def running() -> Any:
            pod = self.pod_of(kernel_id)
            return pod if pod is not None and pod.status.phase == "Running" else None

        return wait_for(running, 60, f"the pod of kernel {kernel_id} to run")

    def cordon(self, node: str, cordoned: bool = True) -> None:
        self.core.patch_node(node, {"spec": {"unschedulable": cordoned}})

    def config(self, **provisioner: Any) -> dict[str, Any]:
        return {
            "ElasticKernels": {
                "profiles": {"whole": {"gpu_fraction": 1}},
                "gpu_inventory": [
                    {"uuid": "GPU-pod-0000", "name": "Test A100", "memory_mib": 40960},
                    {"uuid": "GPU-pod-0001", "name": "Test A100", "memory_mib": 40960},
                ],
                "reap_interval": 1,
                "checkpoint_root": str(self.checkpoints),
                "kernel_provisioner": "elastic-kubernetes-provisioner",
                # Each test's stop leaves the namespace clean for the next test's server (which would
                # adopt running pods of the same owner). The pod-mode default, pods left running and
                # adopted, is test_kube_server's test_a_stopped_server_leaves_its_kernel_pods_running.
                "hibernate_on_shutdown": True,
            },
            "ElasticKubernetesProvisioner": {
                "namespace": self.namespace,
                "kubeconfig": str(self.plane.admin_kubeconfig),
                "image": "python:3.12",
                "node_selector": ON_RUNNER,
                "run_as_user": os.getuid() or 1000,
                "launch_timeout": 60.0,
                "checkpoint_claim": CLAIM,
                "first_port": self.first_port,
                **provisioner,
            },
        }


@contextmanager
def pod_cluster(
    kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner, namespace: str
) -> Iterator[PodCluster]:
    core = client.CoreV1Api(kube_api)
    core.create_namespace({"metadata": {"name": namespace}})
    wait_for(lambda: core.read_namespaced_service_account("default", namespace), 60, "default ServiceAccount")
    # A static PersistentVolume and a claim the controller manager binds to it (no provisioner needed).
    volume = {
        "metadata": {"name": f"{namespace}-{CLAIM}"},
        "spec": {
            "capacity": {"storage": "10Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "hostPath": {"path": "/srv/elastic-checkpoints"},
            "claimRef": {"namespace": namespace, "name": CLAIM},
        },
    }
    core.create_persistent_volume(volume)
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "metadata": {"name": CLAIM},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": volume["metadata"]["name"],
                "resources": {"requests": {"storage": "10Gi"}},
            },
        },
    )
    wait_for(
        lambda: core.read_namespaced_persistent_volume_claim(CLAIM, namespace).status.phase == "Bound",
        60,
        "the checkpoint claim to be bound",
    )
    # A second runner node sharing the first one's volume folders: the claim is one folder for both.
    second = NodeRunner(
        kube_plane.configuration(user="system:node:runner-1", groups=["system:nodes"]),
        "runner-1",
        kube_runner.volumes_root,
        capacity={"nvidia.com/gpu": "1"},
        heartbeat_interval=5,
        admin_configuration=kube_plane.configuration(),
    ).start()
    checkpoints = kube_runner.volumes_root / "pvc" / namespace / CLAIM
    checkpoints.mkdir(parents=True, exist_ok=True)
    try:
        yield PodCluster(kube_plane, core, [kube_runner, second], checkpoints, namespace)
    finally:
        second.stop()
        core.delete_namespace(namespace)
        core.delete_persistent_volume(volume["metadata"]["name"])
