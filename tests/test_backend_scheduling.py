"""Every slice backend scheduled for real: kernels of each size started through the provisioner, placed
(or refused) by the real kube-scheduler on kwok nodes that advertise the backend's resources.

Rendering tests (tests/test_backend_kubernetes.py) prove the pods are valid; these prove the requests
mean what the sizes say to a scheduler: a kernel that fits is bound to the node of its mechanism, and
one that does not stays Pending, so the provisioner's start fails with the scheduler's own
"Insufficient <resource>" and gives its slice back. kwok marks the bound pods Running, so the
provisioner's start completes as it would on a GPU node (no kernel process runs in them).

What only each mechanism's own scheduler can decide (which GPU on the node, for HAMi, Volcano,
gpushare's extender and gpu-admission; a node's total of a per-GPU resource is all the default
scheduler compares) is out of reach here: each backend is placed by the default scheduler on its
extended resources (Volcano with its option ``scheduler_name: default-scheduler``), and the README
says which parts are verified only as manifests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, create_fake_gpu_nodes, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from kernelmgr.config import ElasticKernels, ElasticRuntime  # noqa: E402
from kernelmgr.kube.cluster import KubeCluster  # noqa: E402
from kernelmgr.server.models import elastic_kernel_model, kernel_pod_annotations  # noqa: E402
from tests.support.kernel_pods import kernel_manager  # noqa: E402

pytestmark = [pytest.mark.pure, pytest.mark.timeout(240)]

#: Label of this module's nodes; its value (namespace-backend) is each kernelspec's node selector.
NODE_LABEL = "elastic.test/backend-node"

PROFILES: dict[str, dict[str, Any]] = {
    "whole-1": {"gpu_fraction": 1, "backend": "whole"},
    "whole-2": {"gpu_fraction": 2, "backend": "whole"},
    "mig-1g": {
        "gpu_fraction": 0.14,
        "memory_mib": 10240,
        "backend": "mig",
        "options": {"mig_profile": "1g.10gb"},
    },
    "mig-3g": {
        "gpu_fraction": 0.43,
        "memory_mib": 40960,
        "backend": "mig",
        "options": {"mig_profile": "3g.40gb"},
    },
    "shared-q": {"gpu_fraction": 0.25, "memory_mib": 10240, "backend": "shared"},
    "hami-half": {"gpu_fraction": 0.5, "memory_mib": 20480, "backend": "hami"},
    "hami-q": {"gpu_fraction": 0.25, "memory_mib": 10240, "backend": "hami"},
    "volcano-half": {
        "gpu_fraction": 0.5,
        "memory_mib": 20480,
        "backend": "volcano",
        "options": {"scheduler_name": "default-scheduler"},
    },
    "volcano-q": {
        "gpu_fraction": 0.25,
        "memory_mib": 10240,
        "backend": "volcano",
        "options": {"scheduler_name": "default-scheduler"},
    },
    "gpushare-8g": {"gpu_fraction": 0.5, "memory_mib": 8192, "backend": "gpushare"},
    "gpushare-4g": {"gpu_fraction": 0.25, "memory_mib": 4096, "backend": "gpushare"},
    "vcuda-half": {"gpu_fraction": 0.5, "memory_mib": 8000, "backend": "vcuda"},
    "vcuda-q": {"gpu_fraction": 0.25, "memory_mib": 4096, "backend": "vcuda"},
}
#: The allocator's own bookkeeping must admit every kernel here, so the scheduler is what decides.
INVENTORY = [{"uuid": f"GPU-sched-{i}", "name": "Test H100", "memory_mib": 81920} for i in range(8)]

#: backend -> (node resources, sizes that fit one after the other, the size that then does not, the
#: resource the scheduler names as insufficient)
SCENARIOS: dict[str, tuple[dict[str, str], list[str], str, str]] = {
    "whole": ({"nvidia.com/gpu": "2"}, ["whole-1"], "whole-2", "nvidia.com/gpu"),
    "mig": (
        {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-3g.40gb": "1"},
        ["mig-1g", "mig-3g"],
        "mig-1g",
        "nvidia.com/mig-1g.10gb",
    ),
    "shared": ({"nvidia.com/gpu.shared": "2"}, ["shared-q", "shared-q"], "shared-q", "nvidia.com/gpu.shared"),
    "hami": (
        {"nvidia.com/gpu": "10", "nvidia.com/gpumem": "40960", "nvidia.com/gpucores": "100"},
        ["hami-half", "hami-half"],
        "hami-q",
        "nvidia.com/gpucores",
    ),
    "volcano": (
        {"volcano.sh/vgpu-number": "10", "volcano.sh/vgpu-memory": "40960", "volcano.sh/vgpu-cores": "100"},
        ["volcano-half", "volcano-half"],
        "volcano-q",
        "volcano.sh/vgpu-cores",
    ),
    "gpushare": (
        {"aliyun.com/gpu-count": "1", "aliyun.com/gpu-mem": "16"},
        ["gpushare-8g", "gpushare-8g"],
        "gpushare-4g",
        "aliyun.com/gpu-mem",
    ),
    "vcuda": (
        {"tencent.com/vcuda-core": "100", "tencent.com/vcuda-memory": "64"},
        ["vcuda-half", "vcuda-half"],
        "vcuda-q",
        "tencent.com/vcuda-core",
    ),
}


@pytest.fixture
def runtime(tmp_path: Path) -> ElasticRuntime:
    elastic = ElasticKernels(
        profiles=PROFILES,
        gpu_inventory=INVENTORY,
        checkpoint_root=str(tmp_path / "ck"),
        kernel_provisioner="elastic-kubernetes-provisioner",
    )
    return elastic.build()


@pytest.fixture
def informers(runtime: ElasticRuntime) -> Iterator[KubeCluster]:
    """The cluster object the server would make (on the runtime): its watches stopped afterwards."""
    runtime.kube = KubeCluster()
    yield runtime.kube
    runtime.kube.stop()


@pytest.fixture
def nodes(kube_api: Any) -> Iterator[list[str]]:
    """Names of the nodes a test created; deleted afterwards, so other tests' inventories never see them."""
    created: list[str] = []
    yield created
    core = client.CoreV1Api(kube_api)
    for name in created:
        core.delete_node(name)


def test_every_backend_has_a_scenario() -> None:
    from kernelmgr.backends.kubernetes import REGISTRY

    assert set(REGISTRY) - set(SCENARIOS) == {"dra"}  # DRA: test_dra_whole_gpu_claim_is_allocated_...


@pytest.mark.parametrize("backend", sorted(SCENARIOS))
def test_sizes_that_fit_are_bound_and_the_next_is_refused_with_the_scheduler_reason(
    backend: str,
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    runtime: ElasticRuntime,
    informers: KubeCluster,
    nodes: list[str],
) -> None:
    resources, fitting, refused, insufficient = SCENARIOS[backend]
    core = client.CoreV1Api(kube_api)
    node = f"{kube_namespace}-{backend}"
    selector = {NODE_LABEL: node}
    create_fake_gpu_nodes(kube_api, [node], gpus=0, extra=resources, labels=selector)
    nodes.append(node)

    def manager(size: str, index: int, **config: Any) -> Any:
        return kernel_manager(
            tmp_path,
            kube_plane,
            kube_namespace,
            runtime,
            size,
            name=f"k-{size}-{index}",
            node_selector=selector,
            **config,
        )

    async def scenario() -> None:
        started = []
        try:
            for index, size in enumerate(fitting):
                km = manager(size, index)
                await km.start_kernel()
                started.append(km)
                pod = core.read_namespaced_pod(f"kernel-{km.kernel_id}", kube_namespace)
                assert pod.spec.node_name == node, (size, pod.spec.node_name)
            late = manager(refused, len(fitting), launch_timeout=6.0)
            with pytest.raises(RuntimeError) as failed:
                await late.start_kernel()
            message = str(failed.value)
            assert "PodScheduled: Unschedulable: " in message, message
            assert f"Insufficient {insufficient}" in message, message
            assert runtime.allocator.slice_of(late.kernel_id) is None  # the refused kernel's slice came back
            assert {s.kernel_id for s in runtime.allocator.slices()} == {km.kernel_id for km in started}
        finally:
            for km in started:
                await km.shutdown_kernel(now=True)

    asyncio.run(scenario())
    assert runtime.allocator.slices() == []


def test_gpushare_device_assigned_by_the_extender_is_shown_in_the_kernel_model(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    runtime: ElasticRuntime,
    informers: KubeCluster,
    nodes: list[str],
) -> None:
    """gpushare's extender writes the GPU it picked on the pod; the kernel model reads it from the pod watch.

    No extender runs here, so the test writes its annotations as the extender does when it binds
    (``ALIYUN_COM_GPU_MEM_*``); what is tested is the read-back through the provisioner's pod watch.
    """
    core = client.CoreV1Api(kube_api)
    node = f"{kube_namespace}-gpushare-readback"
    selector = {NODE_LABEL: node}
    create_fake_gpu_nodes(
        kube_api,
        [node],
        gpus=0,
        extra={"aliyun.com/gpu-count": "2", "aliyun.com/gpu-mem": "32"},
        labels=selector,
    )
    nodes.append(node)
    km = kernel_manager(tmp_path, kube_plane, kube_namespace, runtime, "gpushare-8g", node_selector=selector)

    async def scenario() -> None:
        await km.start_kernel()
        kernel_id = km.kernel_id
        try:
            extender = {
                "ALIYUN_COM_GPU_MEM_IDX": "1",
                "ALIYUN_COM_GPU_MEM_DEV": "16",
                "ALIYUN_COM_GPU_MEM_POD": "8",
                "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1732406400000000000",
                "ALIYUN_COM_GPU_MEM_ASSIGNED": "true",
            }
            core.patch_namespaced_pod(
                f"kernel-{kernel_id}", kube_namespace, {"metadata": {"annotations": extender}}
            )

            def model() -> dict[str, Any] | None:
                annotations = kernel_pod_annotations(runtime, kernel_id, runtime.kube.kernel_pods())
                found = elastic_kernel_model(runtime, {"id": kernel_id}, None, annotations)
                return found if "assigned" in (found["slice"] or {}) else None

            found = await asyncio.to_thread(
                wait_for, model, 30, "the extender's annotations in the pod watch"
            )
            assert found["slice"]["assigned"] == {
                "mechanism": "gpushare",
                "index": 1,
                "device_memory": 16,
                "pod_memory": 8,
                "assume_time": 1732406400000000000,
                "assigned": True,
            }
            assert found["slice"]["profile"] == "gpushare-8g"
        finally:
            await km.shutdown_kernel(now=True)

    asyncio.run(scenario())


#: A made-up DRA driver and device class, so nothing here meets another test's DRA objects.
DRA_DRIVER = "gpu.elastic-test.example"


def test_dra_whole_gpu_claim_is_allocated_and_the_next_refused(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    informers: KubeCluster,
    nodes: list[str],
) -> None:
    """DRA with the default scheduler: a kwok node with one GPU published in a ResourceSlice (as a DRA
    driver's kubelet plugin would), a DeviceClass selecting the driver; a whole-GPU size's claim is
    allocated that device and its pod bound there, and a second kernel waits with the scheduler's reason.

    No driver prepares the device on the node (kwok runs the pod without it): what a driver does at
    run time (MPS sharing, MIG devices, consumable capacity) is verified only as manifests.
    """
    resource = client.ResourceV1Api(kube_api)
    core = client.CoreV1Api(kube_api)
    node = f"{kube_namespace}-dra"
    selector = {NODE_LABEL: node}
    create_fake_gpu_nodes(kube_api, [node], gpus=0, labels=selector)
    nodes.append(node)
    device_class = f"{kube_namespace}.{DRA_DRIVER}"
    resource.create_device_class(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": device_class},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRA_DRIVER}"'}}]},
        }
    )
    resource.create_resource_slice(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-gpus"},
            "spec": {
                "driver": DRA_DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {
                        "name": "gpu-0",
                        "attributes": {"productName": {"string": "Test H100"}},
                        "capacity": {"memory": {"value": "80Gi"}},
                    }
                ],
            },
        }
    )
    profiles = {"dra-1": {"gpu_fraction": 1, "backend": "dra", "options": {"device_class": device_class}}}
    elastic = ElasticKernels(profiles=profiles, gpu_inventory=INVENTORY, checkpoint_root=str(tmp_path / "ck"))
    runtime = elastic.build()
    runtime.kube = informers

    async def scenario() -> None:
        first = kernel_manager(
            tmp_path, kube_plane, kube_namespace, runtime, "dra-1", name="dra-a", node_selector=selector
        )
        await first.start_kernel()
        try:
            pod = core.read_namespaced_pod(f"kernel-{first.kernel_id}", kube_namespace)
            assert pod.spec.node_name == node
            claims = resource.list_namespaced_resource_claim(kube_namespace).items
            allocated = [c for c in claims if c.status and c.status.allocation]
            assert len(allocated) == 1, [c.metadata.name for c in claims]
            (result,) = allocated[0].status.allocation.devices.results
            assert (result.driver, result.pool, result.device) == (DRA_DRIVER, node, "gpu-0")
            second = kernel_manager(
                tmp_path,
                kube_plane,
                kube_namespace,
                runtime,
                "dra-1",
                name="dra-b",
                node_selector=selector,
                launch_timeout=6.0,
            )
            with pytest.raises(RuntimeError) as failed:
                await second.start_kernel()
            message = str(failed.value)
            assert "PodScheduled: Unschedulable: " in message, message
            assert "cannot allocate all claims" in message, message
        finally:
            await first.shutdown_kernel(now=True)

    try:
        asyncio.run(scenario())
    finally:
        resource.delete_resource_slice(f"{node}-gpus")
        resource.delete_device_class(device_class)
    assert runtime.allocator.slices() == []
