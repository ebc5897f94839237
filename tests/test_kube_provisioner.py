"""``elastic-kubernetes-provisioner`` against the real control plane: kernels as pods on the node runner.

Driven through a real ``jupyter_client.AsyncKernelManager`` whose kernelspec names the provisioner (as the
server's kernelspecs will), with the provisioner's configuration in the kernelspec metadata.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from kernelmgr.config import ElasticKernels, ElasticRuntime  # noqa: E402
from kernelmgr.kube.cluster import KubeCluster  # noqa: E402
from kernelmgr.kube.labels import (  # noqa: E402
    COMPONENT_LABEL,
    DEFAULT_INSTANCE,
    INSTANCE_LABEL,
    KERNEL_ID_LABEL,
    KERNEL_WATCH_SELECTOR,
    OWNER_LABEL,
    kernel_labels,
)
from kernelmgr.kube.manifests import SIZE_ANNOTATION  # noqa: E402
from tests.support.kernel_pods import INVENTORY, kernel_manager, make_runtime, pod_names, secret_names  # noqa: E402
from tests.support.node_runner import NodeRunner  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def informers() -> Iterator[KubeCluster]:
    """The cluster object the server would make: its pod watches are stopped after the test."""
    cluster = KubeCluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def runtime(tmp_path: Path, informers: KubeCluster) -> ElasticRuntime:
    return make_runtime(tmp_path / "ck", cluster=informers)


def test_kernel_pod_executes_interrupts_and_shuts_down(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    kube_runner: NodeRunner,
    runtime: ElasticRuntime,
    informers: KubeCluster,
) -> None:
    core = client.CoreV1Api(kube_api)
    km = kernel_manager(tmp_path, kube_plane, kube_namespace, runtime, "one")

    async def scenario() -> None:
        await km.start_kernel()
        kernel_id = km.kernel_id
        assert kernel_id is not None
        pod = core.read_namespaced_pod(f"kernel-{kernel_id}", kube_namespace)
        labels = pod.metadata.labels
        assert labels["app.kubernetes.io/name"] == "jupyter-elastic-kernels"
        assert labels[COMPONENT_LABEL] == "kernel" and labels[KERNEL_ID_LABEL] == kernel_id
        assert labels[INSTANCE_LABEL] == DEFAULT_INSTANCE and OWNER_LABEL in labels
        # Never Enterprise Gateway's bare labels (a NetworkPolicy selecting them selects EG's pods).
        assert "component" not in labels and "kernel_id" not in labels
        assert pod.metadata.annotations[SIZE_ANNOTATION] == "one"
        assert pod.spec.restart_policy == "Never"
        assert pod.spec.termination_grace_period_seconds == 60  # time to checkpoint at SIGTERM
        container = pod.spec.containers[0]
        env = {e.name: e.value for e in container.env}
        assert env["ELASTIC_CHECKPOINT_ON_SIGTERM"] == "1"
        # The GPU kernels' default cpu/memory (ElasticKubernetesProvisioner.resources) beside the slice.
        assert container.resources.limits == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}
        assert container.resources.requests == {"cpu": "1", "memory": "4Gi", "nvidia.com/gpu": "1"}
        assert container.security_context.allow_privilege_escalation is False
        assert container.security_context.capabilities.drop == ["ALL"]
        assert pod.spec.security_context.run_as_non_root is True
        secret = core.read_namespaced_secret(f"kernel-{kernel_id}", kube_namespace)
        assert secret.metadata.owner_references[0].uid == pod.metadata.uid
        assert km.get_connection_info()["ip"] == pod.status.pod_ip
        assert runtime.allocator.slice_of(kernel_id) is not None

        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=60)
            results: list[str] = []

            def collect(msg: dict[str, Any]) -> None:
                if msg["msg_type"] in ("execute_result", "stream"):
                    results.append(msg["content"].get("text") or msg["content"]["data"]["text/plain"])

            reply = await kc.execute_interactive(
                "import os; os.environ['POD_IP'], 6 * 7", timeout=30, output_hook=collect
            )
            assert reply["content"]["status"] == "ok"
            assert results == [repr((pod.status.pod_ip, 42))]

            msg_id = kc.execute("import time; print('in the cell', flush=True); time.sleep(60)")
            while True:  # the cell runs: an interrupt before it would find nothing to interrupt
                msg = await kc.get_iopub_msg(timeout=60)
                if msg["msg_type"] == "stream" and "in the cell" in msg["content"]["text"]:
                    break
            await km.interrupt_kernel()
            interrupted = await kc.get_shell_msg(timeout=15)
            assert interrupted["parent_header"]["msg_id"] == msg_id
            assert interrupted["content"]["ename"] == "KeyboardInterrupt"
        finally:
            kc.stop_channels()

        await km.shutdown_kernel()
        assert pod_names(core, kube_namespace) == []
        assert [s.metadata.name for s in core.list_namespaced_secret(kube_namespace).items] == []
        assert runtime.allocator.slice_of(kernel_id) is None
        assert runtime.kernels.get(kernel_id) is None

    asyncio.run(scenario())


def test_unschedulable_size_fails_with_the_scheduler_reason(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    kube_runner: NodeRunner,
    runtime: ElasticRuntime,
    informers: KubeCluster,
) -> None:
    core = client.CoreV1Api(kube_api)
    km = kernel_manager(tmp_path, kube_plane, kube_namespace, runtime, "two", launch_timeout=6.0)

    async def scenario() -> None:
        with pytest.raises(RuntimeError) as failed:
            await km.start_kernel()
        message = str(failed.value)
        assert "PodScheduled: Unschedulable: " in message, message
        assert "Insufficient nvidia.com/gpu" in message and "FailedScheduling" not in message, message
        assert runtime.allocator.slices() == []

    asyncio.run(scenario())
    assert pod_names(core, kube_namespace) == []
    assert [s.metadata.name for s in core.list_namespaced_secret(kube_namespace).items] == []


def test_unpullable_image_fails_with_the_kubelet_reason(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    kube_runner: NodeRunner,
    runtime: ElasticRuntime,
    informers: KubeCluster,
) -> None:
    core = client.CoreV1Api(kube_api)
    unpullable = "registry.invalid/missing:latest"
    km = kernel_manager(
        tmp_path, kube_plane, kube_namespace, runtime, "one", image=unpullable, launch_timeout=6
    )

    async def scenario() -> None:
        with pytest.raises(RuntimeError) as failed:
            await km.start_kernel()
        assert "ErrImagePull" in str(failed.value), str(failed.value)
        assert runtime.allocator.slices() == []

    asyncio.run(scenario())
    assert pod_names(core, kube_namespace) == []


IMPORT_ERROR = (
    "Traceback (most recent call last):\n"
    '  File "<frozen runpy>", line 189, in _run_module_as_main\n'
    "ModuleNotFoundError: No module named 'kernelmgr'\n"
)


def kubelet_reports_a_crash(core: Any, namespace: str, patched: dict[str, Any]) -> None:
    """Write the kernel pod's status as the kubelet of a node would when its container fails."""
    from tests.support.kube import wait_for

    pods = wait_for(lambda: core.list_namespaced_pod(namespace).items, 60, "the kernel pod")
    pod = pods[0]
    patched["policy"] = pod.spec.containers[0].termination_message_policy
    patched["name"] = pod.metadata.name
    terminated = {
        "exitCode": 1,
        "reason": "Error",
        "message": "".join(f"line {n}\n" for n in range(30)) + IMPORT_ERROR,
        "startedAt": "2026-01-01T00:00:00Z",
        "finishedAt": "2026-01-01T00:00:01Z",
    }
    status = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "kernel",
                "image": pod.spec.containers[0].image,
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": terminated},
            }
        ],
    }
    core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": status})


def test_failed_kernel_container_start_error_quotes_its_last_output(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    runtime: ElasticRuntime,
    informers: KubeCluster,
) -> None:
    """Its exit code and last log lines (the termination message a kubelet writes with
    FallbackToLogsOnError) reach the start error; with ``failed_pod_retention = 0`` the pod is
    deleted at once."""
    import threading

    core = client.CoreV1Api(kube_api)
    # No node takes the pod: this test writes its status as the kubelet of a node would.
    km = kernel_manager(
        tmp_path,
        kube_plane,
        kube_namespace,
        runtime,
        "one",
        node_selector={"elastic.test/no-such-node": "true"},
        launch_timeout=120.0,
        failed_pod_retention=0,
    )
    patched: dict[str, Any] = {}
    reporter = threading.Thread(target=kubelet_reports_a_crash, args=(core, kube_namespace, patched))

    async def scenario() -> None:
        reporter.start()
        with pytest.raises(RuntimeError) as failed:
            await km.start_kernel()
        message = str(failed.value)
        assert "container kernel exited with code 1; its last output:" in message, message
        assert "ModuleNotFoundError: No module named 'kernelmgr'" in message, message
        assert "line 13\n" in message and "line 12\n" not in message, message  # the last 20 lines
        assert runtime.allocator.slices() == []

    asyncio.run(scenario())
    reporter.join(60)
    assert patched["policy"] == "FallbackToLogsOnError"
    assert pod_names(core, kube_namespace) == []


def test_a_failed_kernel_pod_is_kept_for_kubectl_logs_then_deleted(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    runtime: ElasticRuntime,
    informers: KubeCluster,
) -> None:
    """By default a pod that failed on its own stays ``failed_pod_retention`` seconds for ``kubectl
    logs`` and ``describe``: out of the kernels (another label), its slice released at once, never
    adopted; then the server deletes it."""
    import threading

    from kernelmgr.kube.failed_pods import DELETE_AFTER, FAILED_COMPONENT
    from kernelmgr.kube.settings import KubeSettings
    from tests.support.kube import wait_for

    core = client.CoreV1Api(kube_api)
    km = kernel_manager(
        tmp_path,
        kube_plane,
        kube_namespace,
        runtime,
        "one",
        node_selector={"elastic.test/no-such-node": "true"},
        launch_timeout=120.0,
        failed_pod_retention=4.0,
    )
    patched: dict[str, Any] = {}
    reporter = threading.Thread(target=kubelet_reports_a_crash, args=(core, kube_namespace, patched))

    async def scenario() -> None:
        reporter.start()
        with pytest.raises(RuntimeError, match="exited with code 1"):
            await km.start_kernel()
        assert runtime.allocator.slices() == []  # released at once, the pod kept or not
        (kept,) = core.list_namespaced_pod(kube_namespace).items
        assert kept.metadata.name == patched["name"]
        assert kept.metadata.labels[COMPONENT_LABEL] == FAILED_COMPONENT
        assert DELETE_AFTER in kept.metadata.annotations
        assert "No module named 'kernelmgr'" in kept.status.container_statuses[0].state.terminated.message
        # No kernel: not in the kernels' watch, not found by a restarted server.
        informer = informers.pod_informer(kube_namespace, str(kube_plane.admin_kubeconfig))
        assert informer.get(kept.metadata.labels[KERNEL_ID_LABEL]) is None
        restarted = KubeCluster(KubeSettings(kubeconfig=str(kube_plane.admin_kubeconfig)))
        try:
            assert await restarted.find_kernel_pods(kube_namespace) == []
        finally:
            await asyncio.to_thread(restarted.stop)
        await asyncio.to_thread(
            wait_for, lambda: not core.list_namespaced_pod(kube_namespace).items, 60, "the kept pod to go"
        )

    asyncio.run(scenario())
    reporter.join(60)
    assert secret_names(core, kube_namespace) == []  # the connection key did not stay with it


def test_informer_sees_pods_and_lists_again_after_410_gone(
    kube_plane: ControlPlane, kube_api: Any, kube_namespace: str
) -> None:
    """One watch: pods appear in the cache, and after etcd compaction (410 Gone) it lists again."""
    from kernelmgr.kube.informer import PodInformer

    core = client.CoreV1Api(kube_api)

    def pending_pod(kernel_id: str) -> dict[str, Any]:
        return {
            "metadata": {
                "name": f"p-{kernel_id}",
                "labels": kernel_labels(DEFAULT_INSTANCE, kernel_id, "alice"),
            },
            "spec": {
                "nodeSelector": {"elastic.test/nowhere": "true"},
                "containers": [{"name": "k", "image": "python:3.12", "command": ["true"]}],
            },
        }

    informer = PodInformer(
        client.ApiClient(kube_plane.configuration()), kube_namespace, KERNEL_WATCH_SELECTOR
    )
    informer.start()
    try:
        core.create_namespaced_pod(kube_namespace, pending_pod("a"))
        asyncio.run(informer.wait_for("a", lambda pod: pod is not None, 30))
        assert informer.lists == 1
        kube_plane.expire_resource_versions()
        core.create_namespaced_pod(kube_namespace, pending_pod("b"))
        asyncio.run(informer.wait_for("b", lambda pod: pod is not None, 60))
        core.delete_namespaced_pod("p-a", kube_namespace, grace_period_seconds=0)
        asyncio.run(informer.wait_for("a", lambda pod: pod is None, 30))
        assert informer.lists >= 2
    finally:
        informer.stop()


def test_dra_size_creates_its_claim_template_and_explains_an_unschedulable_claim(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    kube_runner: NodeRunner,
    informers: KubeCluster,
) -> None:
    """A DRA size: the ResourceClaimTemplate its pod names is created (accepted by the real API
    server, once), the pod refers to it; with no DRA driver publishing devices, the start fails
    with the scheduler's reason and leaves no pod, no Secret, no slice."""
    from kubernetes import client as k8s

    profiles = {
        "dra-half": {
            "gpu_fraction": 0.5,
            "memory_mib": 20480,
            "backend": "dra",
            "options": {"sharing": "consumable"},
        }
    }
    elastic = ElasticKernels(profiles=profiles, gpu_inventory=INVENTORY, checkpoint_root=str(tmp_path / "ck"))
    runtime = elastic.build()
    runtime.kube = informers
    # Long enough for the controller manager to make the pod's claim from the template under load:
    # its informer may not have seen the template created a moment before the pod, and then it
    # retries with back-off (a CI run saw "template not found" still at 6 s).
    km = kernel_manager(tmp_path, kube_plane, kube_namespace, runtime, "dra-half", launch_timeout=20.0)

    async def scenario() -> None:
        with pytest.raises(RuntimeError) as failed:
            await km.start_kernel()
        assert "PodScheduled: Unschedulable" in str(failed.value), str(failed.value)

    asyncio.run(scenario())
    templates = k8s.ResourceV1Api(kube_api).list_namespaced_resource_claim_template(kube_namespace).items
    assert [t.metadata.name.startswith("elastic-gpu-dra-half-") for t in templates] == [True]
    core = client.CoreV1Api(kube_api)
    assert pod_names(core, kube_namespace) == []
    assert runtime.allocator.slices() == []
