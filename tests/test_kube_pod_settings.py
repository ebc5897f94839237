"""Per-GPU-size pod settings and the pod patch, against the real API server, scheduler and kwok nodes.

A real jupyter_server subprocess with the Kubernetes provisioner, in a namespace that enforces Pod
Security "restricted" and holds a cpu/memory/ephemeral-storage ResourceQuota: two GPU sizes, each with
its own node selector, toleration, priority class, runtime class, image, /dev/shm and resources, land on
the kwok nodes their selectors name (kwok nodes run no kernel: the server does not wait for a reply).
A setting the API server refuses stops the server at start-up, one line naming the size and the field.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, create_fake_gpu_nodes, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from tests.support.server import START_SECONDS, RunningServer, launch, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)

TAINT = {"key": "elastic.test/pod-settings", "value": "true", "effect": "NoSchedule"}
TOLERATE = [{"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}]
GUARANTEED = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


@pytest.fixture(scope="module")
def setup(kube_plane: ControlPlane, kube_api: Any) -> Iterator[dict[str, Any]]:
    """Two tainted kwok GPU nodes (an "a100" one and an "l4" one), a PriorityClass, a RuntimeClass
    and a restricted namespace with a ResourceQuota on cpu, memory and ephemeral storage."""
    core = client.CoreV1Api(kube_api)
    suffix = uuid.uuid4().hex[:6]
    nodes = {model: f"kwok-{model}-{suffix}" for model in ("a100", "l4")}
    for model, name in nodes.items():
        create_fake_gpu_nodes(
            kube_api,
            [name],
            gpus=2,
            labels={"elastic.test/gpu-model": model},
            taints=[TAINT],
            extra={"ephemeral-storage": "500Gi"},
        )
    namespace = f"podset-{suffix}"
    core.create_namespace({"metadata": {"name": namespace, "labels": RESTRICTED}})
    core.create_namespaced_resource_quota(
        namespace,
        {
            "metadata": {"name": "kernels"},
            "spec": {
                "hard": {
                    "requests.cpu": "16",
                    "requests.memory": "64Gi",
                    "limits.cpu": "32",
                    "limits.memory": "128Gi",
                    "limits.ephemeral-storage": "200Gi",
                }
            },
        },
    )
    wait_for(lambda: core.read_namespaced_service_account("default", namespace), 60, "default ServiceAccount")
    priority = f"kernels-{suffix}"
    client.SchedulingV1Api(kube_api).create_priority_class({"metadata": {"name": priority}, "value": 1000})
    runtime = f"gpu-{suffix}"
    client.NodeV1Api(kube_api).create_runtime_class({"metadata": {"name": runtime}, "handler": "runc"})
    try:
        yield {"core": core, "nodes": nodes, "namespace": namespace, "priority": priority, "runtime": runtime}
    finally:
        core.delete_namespace(namespace)
        for name in nodes.values():
            core.delete_node(name)
        client.SchedulingV1Api(kube_api).delete_priority_class(priority)
        client.NodeV1Api(kube_api).delete_runtime_class(runtime)


def config(plane: ControlPlane, setup: dict[str, Any], tmp_path: Path, **provisioner: Any) -> dict[str, Any]:
    sizes = {
        "a100": {
            "image": "registry.example/torch:2",
            "resources": GUARANTEED,
            "nodeSelector": {"elastic.test/gpu-model": "a100"},
            "tolerations": TOLERATE,
            "priorityClassName": setup["priority"],
            "runtimeClassName": setup["runtime"],
            "imagePullSecrets": ["registry-pull"],
            "shmSize": "2Gi",
            "ephemeralStorage": "20Gi",
        },
        "l4": {"nodeSelector": {"elastic.test/gpu-model": "l4"}, "tolerations": TOLERATE},
    }
    return {
        "ElasticKernels": {
            "profiles": {"a100": {"gpu_fraction": 1}, "l4": {"gpu_fraction": 1}},
            "gpu_inventory": [
                {"uuid": f"GPU-{n}", "name": "Test GPU", "memory_mib": 40960} for n in range(4)
            ],
            "checkpoint_root": str(tmp_path / "checkpoints"),
            "kernel_provisioner": "elastic-kubernetes-provisioner",
        },
        "ElasticKubernetesProvisioner": {
            "namespace": setup["namespace"],
            "kubeconfig": str(plane.admin_kubeconfig),
            "image": "python:3.12",
            "launch_timeout": 120.0,
            # kwok nodes run no kernel: nothing would ever answer the first kernel_info.
            "wait_for_first_reply": False,
            "size_pod_settings": sizes,
            "pod_patch": {"metadata": {"labels": {"team": "ml"}}},
            "resources": {
                "requests": {"cpu": "1", "memory": "4Gi"},
                "limits": {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "10Gi"},
            },
            "cpu_kernel_resources": {
                "requests": {"cpu": "250m", "memory": "1Gi"},
                "limits": {"cpu": "1", "memory": "2Gi", "ephemeral-storage": "5Gi"},
            },
            **provisioner,
        },
    }


def test_two_sizes_land_on_their_nodes_within_a_quota_and_pod_security_restricted(
    kube_plane: ControlPlane, setup: dict[str, Any], tmp_path: Path
) -> None:
    server: RunningServer = start_server(tmp_path, config(kube_plane, setup, tmp_path))
    core, namespace = setup["core"], setup["namespace"]
    try:
        pods, kernels = {}, []
        for size in ("a100", "l4"):
            kernel_id = server.start_kernel(f"python3-gpu-{size}")
            kernels.append(kernel_id)

            def running(kernel_id: str = kernel_id) -> Any:
                pod = core.read_namespaced_pod(f"kernel-{kernel_id}", namespace)
                return pod if pod.status.phase == "Running" else None

            pods[size] = wait_for(running, 120, f"the {size} kernel's pod to run")
        a100, l4 = pods["a100"], pods["l4"]
        assert a100.spec.node_name == setup["nodes"]["a100"]
        assert l4.spec.node_name == setup["nodes"]["l4"]
        # The a100 size's own settings, and none of them on the l4 size's pod.
        (container,) = a100.spec.containers
        assert container.image == "registry.example/torch:2"
        assert a100.status.qos_class == "Guaranteed"
        assert container.resources.limits == {
            "cpu": "2",
            "memory": "8Gi",
            "ephemeral-storage": "20Gi",
            "nvidia.com/gpu": "1",
        }
        assert a100.spec.priority_class_name == setup["priority"] and a100.spec.priority == 1000
        assert a100.spec.runtime_class_name == setup["runtime"]
        assert [s.name for s in a100.spec.image_pull_secrets] == ["registry-pull"]
        shm = next(v for v in a100.spec.volumes if v.name == "dshm")
        assert shm.empty_dir.medium == "Memory" and shm.empty_dir.size_limit == "2Gi"
        assert any(m.mount_path == "/dev/shm" for m in container.volume_mounts)
        assert l4.spec.containers[0].image == "python:3.12" and l4.status.qos_class == "Burstable"
        assert l4.spec.priority_class_name is None and l4.spec.runtime_class_name is None
        (l4_shm,) = [v for v in l4.spec.volumes if v.name == "dshm"]  # the global shm_size
        assert l4_shm.empty_dir.size_limit == "1Gi"
        assert a100.metadata.labels["team"] == l4.metadata.labels["team"] == "ml"  # the pod patch
        quota = core.read_namespaced_resource_quota("kernels", namespace)
        assert quota.status.used["requests.memory"] == "12Gi", quota.status.used
        for kernel_id in kernels:
            server.shutdown_kernel(kernel_id)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"size_pod_settings": {"l4": {"priorityClassName": "no-such-priority"}}},
            ["size_pod_settings['l4']", "no-such-priority"],
        ),
        (
            {"size_pod_settings": {"l4": {"affinity": {"nodeAffinity": {"requiredDuringScheduling": {}}}}}},
            ["size_pod_settings['l4']", "spec.affinity.nodeAffinity.requiredDuringScheduling"],
        ),
        (
            {"pod_patch": {"spec": {"hostNetwork": True}}},
            ["pod_patch", "restricted", "hostNetwork"],
        ),
    ],
    ids=["missing-priority-class", "unknown-field", "pod-security"],
)
def test_a_setting_the_api_server_refuses_stops_the_server_naming_the_size(
    kube_plane: ControlPlane, setup: dict[str, Any], tmp_path: Path, change: dict[str, Any], named: list[str]
) -> None:
    base = config(kube_plane, setup, tmp_path)
    base["ElasticKubernetesProvisioner"].update(change)
    process, log_path, _url, _env = launch(tmp_path, base, None, None, "jupyter_server")
    try:
        assert process.wait(timeout=START_SECONDS) == 2, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    critical = [line for line in log_path.read_text().splitlines() if "invalid configuration" in line]
    assert len(critical) == 1, critical
    for part in named:
        assert part in critical[0], critical
    pods = setup["core"].list_namespaced_pod(setup["namespace"]).items
    assert not [p.metadata.name for p in pods if "dry-run" in p.metadata.name]  # a dry-run made nothing


def test_a_read_write_once_home_puts_kernels_on_the_node_of_the_owners_server(
    kube_plane: ControlPlane, setup: dict[str, Any], tmp_path: Path
) -> None:
    """home_access_mode ReadWriteOnce: a kernel pod joins its owner's single-user pod's node (there
    the home can be mounted); a size whose nodes are elsewhere fails with the scheduler's reason."""
    import getpass

    from kernelmgr.kube.namespaces import dns_label

    core, namespace = setup["core"], setup["namespace"]
    owner = dns_label(getpass.getuser())
    claim = f"claim-{owner}"
    core.create_persistent_volume(
        {
            "metadata": {"name": f"{namespace}-{claim}"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "hostPath": {"path": "/srv/home"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
    )
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": f"{namespace}-{claim}",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    # The owner's single-user server, as z2jh labels it, on the l4 node.
    restricted = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {
                "name": f"jupyter-{owner}",
                "labels": {"component": "singleuser-server", "hub.jupyter.org/username": owner},
            },
            "spec": {
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "nodeSelector": {"elastic.test/gpu-model": "l4"},
                "tolerations": TOLERATE,
                "containers": [
                    {
                        "name": "notebook",
                        "image": "quay.io/jupyter/base-notebook",
                        "securityContext": restricted,
                        "resources": {"limits": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}},
                    }
                ],
            },
        },
    )
    wait_for(
        lambda: core.read_namespaced_pod(f"jupyter-{owner}", namespace).status.phase == "Running",
        60,
        "the single-user pod to run",
    )
    base = config(kube_plane, setup, tmp_path)
    base["ElasticKernels"]["profiles"]["any"] = {"gpu_fraction": 1}
    provisioner = base["ElasticKubernetesProvisioner"]
    provisioner["size_pod_settings"]["any"] = {"tolerations": TOLERATE}
    provisioner.update(
        user_volumes=[{"name": "home", "claimName": "claim-{owner}", "mountPath": "/home/jovyan"}],
        home_volume="home",
        home_access_mode="ReadWriteOnce",
        # The refused size's start waits this long for a node before it answers with the reason.
        launch_timeout=30.0,
    )
    server = start_server(tmp_path, base)
    try:
        kernels = [server.start_kernel("python3-gpu-any") for _ in range(2)]
        for kernel_id in kernels:

            def running(kernel_id: str = kernel_id) -> Any:
                pod = core.read_namespaced_pod(f"kernel-{kernel_id}", namespace)
                return pod if pod.status.phase == "Running" else None

            assert wait_for(running, 120, "the kernel pod to run").spec.node_name == setup["nodes"]["l4"]
        refused = server.request("POST", "/api/kernels", {"name": "python3-gpu-a100"})
        # The answer says why, in the scheduler's words (it was jupyter_server's 500 "Unhandled error").
        assert refused.status == 503, refused.body
        assert "didn't match pod affinity rules" in refused.body["message"], refused.body
        assert "launch_timeout" in refused.body["message"], refused.body
        for kernel_id in kernels:
            server.shutdown_kernel(kernel_id)
    finally:
        server.stop()
        core.delete_namespaced_pod(f"jupyter-{owner}", namespace, grace_period_seconds=0)


def test_a_gpu_size_added_in_the_live_file_starts_pods_without_a_restart(
    kube_plane: ControlPlane, setup: dict[str, Any], tmp_path: Path
) -> None:
    """ElasticKernels.profiles in the live file (the chart's live ConfigMap): a new size is checked as
    at start (its pod dry-run by the API server) and offered at once; removing a size that
    size_pod_settings names is refused with one line, the sizes stay."""
    import json

    # The new size has no size_pod_settings (restart-only): every pod tolerates the nodes' taint.
    base = config(kube_plane, setup, tmp_path, tolerations=TOLERATE)
    sizes = base["ElasticKernels"].pop("profiles")
    live = tmp_path / "live_config.json"
    live.write_text(json.dumps({"ElasticKernels": {"profiles": sizes}}))
    base["ElasticKernels"].update({"live_config_file": str(live), "live_config_interval": 0.5})
    server: RunningServer = start_server(tmp_path, base)
    core, namespace = setup["core"], setup["namespace"]

    def offered() -> set[str]:
        return set(server.get("/api/kernelspecs")["kernelspecs"])

    try:
        assert "python3-gpu-pair" not in offered()
        live.write_text(json.dumps({"ElasticKernels": {"profiles": {**sizes, "pair": {"gpu_fraction": 2}}}}))
        wait_for(lambda: "python3-gpu-pair" in offered(), 120, "the new size's kernelspec")
        kernel_id = server.start_kernel("python3-gpu-pair")
        pod = wait_for(lambda: core.read_namespaced_pod(f"kernel-{kernel_id}", namespace), 120, "its pod")
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"
        assert pod.metadata.annotations["elastic.jupyter.org/size"] == "pair"
        # l4 is named by size_pod_settings (a restart-only setting): it cannot go live.
        live.write_text(json.dumps({"ElasticKernels": {"profiles": {"a100": sizes["a100"]}}}))
        wait_for(lambda: "Live configuration refused" in server.log(), 120, "the refusal")
        refusals = [line for line in server.log().splitlines() if "Live configuration refused" in line]
        assert len(refusals) == 1 and "size_pod_settings" in refusals[0], refusals
        assert {"python3-gpu-l4", "python3-gpu-pair"} <= offered()
        server.shutdown_kernel(kernel_id)
    finally:
        server.stop()
