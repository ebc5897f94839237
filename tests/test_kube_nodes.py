"""Node object -> GPU devices, per backend (pure: plain dicts shaped like the API's Nodes, no cluster)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.backends.kubernetes import profile_resource
from kernelmgr.core.allocator import SliceAllocator
from kernelmgr.core.inventory import GpuInventory
from kernelmgr.core.profiles import parse_profile
from kernelmgr.kube.nodes import node_devices
from kernelmgr.kube.placement import Placement

pytestmark = pytest.mark.pure

GFD = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/gpu.memory": "40960"}


def node(
    name: str,
    allocatable: dict[str, str],
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ready: str = "True",
    unschedulable: bool = False,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "spec": {"unschedulable": unschedulable},
        "status": {
            "allocatable": {"cpu": "32", "pods": "110", **allocatable},
            "conditions": [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready", "status": ready}],
        },
    }


def test_whole_gpus_with_feature_discovery_labels() -> None:
    devices = node_devices(node("n1", {"nvidia.com/gpu": "2"}, labels=GFD))
    assert [(d.uuid, d.name, d.memory_mib, d.index, d.node, d.resource, d.exclusive) for d in devices] == [
        ("n1/gpu-0", "NVIDIA-A100-SXM4-40GB", 40960, 0, "n1", "nvidia.com/gpu", False),
        ("n1/gpu-1", "NVIDIA-A100-SXM4-40GB", 40960, 1, "n1", "nvidia.com/gpu", False),
    ]


def test_without_the_memory_label_a_gpu_has_unknown_memory() -> None:
    (device,) = node_devices(node("n1", {"nvidia.com/gpu": "1"}))
    assert device.memory_mib == 0 and device.name == "nvidia.com/gpu"


@pytest.mark.parametrize(
    ("change", "why"), [({"ready": "False"}, "NotReady"), ({"ready": "Unknown"}, "lost")]
)
def test_nodes_that_are_not_ready_keep_their_devices_closed(change: dict[str, Any], why: str) -> None:
    devices = node_devices(node("n1", {"nvidia.com/gpu": "2"}, labels=GFD, **change))
    assert [(d.uuid, d.closed) for d in devices] == [("n1/gpu-0", True), ("n1/gpu-1", True)], why


def test_a_cordoned_node_keeps_its_devices_closed() -> None:
    devices = node_devices(node("n1", {"nvidia.com/gpu": "2"}, labels=GFD, unschedulable=True))
    assert [(d.uuid, d.closed) for d in devices] == [("n1/gpu-0", True), ("n1/gpu-1", True)]


def test_time_slicing_replicas_count_physical_gpus() -> None:
    labels = {**GFD, "nvidia.com/gpu.replicas": "4"}
    assert [d.uuid for d in node_devices(node("n", {"nvidia.com/gpu": "8"}, labels=labels))] == [
        "n/gpu-0",
        "n/gpu-1",
    ]
    renamed = node_devices(node("n", {"nvidia.com/gpu.shared": "8"}, labels=labels))
    assert [(d.uuid, d.resource) for d in renamed] == [
        ("n/gpu-shared-0", "nvidia.com/gpu.shared"),
        ("n/gpu-shared-1", "nvidia.com/gpu.shared"),
    ]


def test_mig_mixed_resources_are_exclusive_devices() -> None:
    devices = node_devices(
        node(
            "m",
            {"nvidia.com/mig-1g.10gb": "3", "nvidia.com/mig-3g.40gb": "1"},
            labels={"nvidia.com/gpu.product": "A100"},
        )
    )
    assert [(d.uuid, d.memory_mib, d.resource, d.exclusive) for d in devices] == [
        ("m/mig-1g.10gb-0", 10240, "nvidia.com/mig-1g.10gb", True),
        ("m/mig-1g.10gb-1", 10240, "nvidia.com/mig-1g.10gb", True),
        ("m/mig-1g.10gb-2", 10240, "nvidia.com/mig-1g.10gb", True),
        ("m/mig-3g.40gb-0", 40960, "nvidia.com/mig-3g.40gb", True),
    ]
    assert devices[0].name == "A100 MIG 1g.10gb"


def test_mig_single_strategy_gpus_are_exclusive() -> None:
    labels = {"nvidia.com/mig.strategy": "single", "nvidia.com/gpu.memory": "4864"}
    devices = node_devices(node("s", {"nvidia.com/gpu": "7"}, labels=labels))
    assert len(devices) == 7 and all(d.exclusive and d.memory_mib == 4864 for d in devices)


def test_hami_resources_split_memory_per_gpu() -> None:
    allocatable = {"nvidia.com/gpu": "40", "nvidia.com/gpumem": str(4 * 40960), "nvidia.com/gpucores": "400"}
    devices = node_devices(node("h", allocatable))
    assert [(d.uuid, d.memory_mib, d.resource, d.exclusive) for d in devices] == [
        (f"h/gpu-{i}", 40960, "nvidia.com/gpu", False) for i in range(4)
    ]


def test_hami_register_annotation_in_both_formats() -> None:
    legacy = (
        "GPU-aaa,10,32768,100,NVIDIA-Tesla V100-PCIE-32GB,0,true,0,hami-core:"
        "GPU-bbb,10,32768,100,NVIDIA-Tesla V100-PCIE-32GB,0,false,1,hami-core:"
    )
    modern = json.dumps(
        [
            {
                "id": "GPU-ccc",
                "count": 10,
                "devmem": 81920,
                "devcore": 100,
                "type": "NVIDIA-H100",
                "health": True,
            },
            {
                "id": "GPU-ddd",
                "count": 10,
                "devmem": 81920,
                "devcore": 100,
                "type": "NVIDIA-H100",
                "health": True,
            },
        ]
    )
    annotation = "hami.io/node-nvidia-register"
    # the register wins over the vGPU share count in nvidia.com/gpu; unhealthy GPUs are left out
    old = node_devices(node("h", {"nvidia.com/gpu": "20"}, annotations={annotation: legacy}))
    assert [(d.uuid, d.memory_mib, d.name) for d in old] == [
        ("h/GPU-aaa", 32768, "NVIDIA-Tesla V100-PCIE-32GB")
    ]
    new = node_devices(node("h", {"nvidia.com/gpu": "20"}, annotations={annotation: modern}))
    assert [(d.uuid, d.index, d.memory_mib) for d in new] == [
        ("h/GPU-ccc", 0, 81920),
        ("h/GPU-ddd", 1, 81920),
    ]


@pytest.mark.parametrize(
    ("gpu_mem", "per_gpu_mib"),
    [("30", 15 * 1024), (str(2 * 16384), 16384)],
    ids=["GiB-unit", "MiB-unit"],
)
def test_gpushare_count_and_memory_in_either_unit(gpu_mem: str, per_gpu_mib: int) -> None:
    devices = node_devices(node("g", {"aliyun.com/gpu-count": "2", "aliyun.com/gpu-mem": gpu_mem}))
    assert [(d.uuid, d.memory_mib, d.resource, d.exclusive) for d in devices] == [
        (f"g/gpushare-{i}", per_gpu_mib, "aliyun.com/gpu-mem", False) for i in range(2)
    ]


def test_vcuda_cores_count_gpus_and_memory_is_in_256_mib_units() -> None:
    allocatable = {"tencent.com/vcuda-core": "300", "tencent.com/vcuda-memory": str(3 * 64)}
    devices = node_devices(node("t", allocatable, labels={"nvidia.com/gpu.product": "Tesla-T4"}))
    assert [(d.uuid, d.name, d.memory_mib, d.resource) for d in devices] == [
        (f"t/vcuda-{i}", "Tesla-T4", 16384, "tencent.com/vcuda-core") for i in range(3)
    ]


def test_gpushare_and_vcuda_sizes_land_on_their_own_nodes() -> None:
    """With ``gpu_inventory_source: kubernetes`` each size is placed only on nodes of its mechanism."""
    devices = (
        *node_devices(node("g", {"aliyun.com/gpu-count": "1", "aliyun.com/gpu-mem": "16"})),
        *node_devices(node("t", {"tencent.com/vcuda-core": "100", "tencent.com/vcuda-memory": "64"})),
        *node_devices(node("n", {"nvidia.com/gpu": "1"}, labels=GFD)),
    )
    alloc = SliceAllocator(GpuInventory(devices, source="kubernetes"), profile_resource=profile_resource)
    share = parse_profile("share", {"gpu_fraction": 0.5, "memory_mib": 8192, "backend": "gpushare"})
    vcuda = parse_profile("vc", {"gpu_fraction": 0.5, "memory_mib": 8192, "backend": "vcuda"})
    assert alloc.allocate("a", share).device_uuids == ("g/gpushare-0",)
    assert alloc.allocate("b", vcuda).device_uuids == ("t/vcuda-0",)
    assert alloc.allocate("c", share).device_uuids == ("g/gpushare-0",)
    assert not alloc.fits(share)  # 16 GiB taken; the NVIDIA node's GPU is not gpushare's


def test_sizes_land_on_the_devices_of_their_resource() -> None:
    """The allocator with the Kubernetes resource matcher: a MIG size never lands on a whole GPU."""
    devices = node_devices(node("a", {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"}, labels=GFD))
    alloc = SliceAllocator(GpuInventory(devices, source="kubernetes"), profile_resource=profile_resource)
    mig = parse_profile(
        "mig",
        {"gpu_fraction": 0.14, "memory_mib": 9000, "backend": "mig", "options": {"mig_profile": "1g.10gb"}},
    )
    small = parse_profile("small", {"gpu_fraction": 0.25, "memory_mib": 10240, "backend": "hami"})
    whole = parse_profile("whole", {"gpu_fraction": 1})
    assert alloc.allocate("m", mig).device_uuids == ("a/mig-1g.10gb-0",)
    assert not alloc.fits(mig)
    assert alloc.allocate("s", small).device_uuids == ("a/gpu-0",)
    assert not alloc.fits(whole)


def test_inventory_source_setting(tmp_path: Path) -> None:
    from kernelmgr.config import ElasticKernels
    from kernelmgr.core.errors import ConfigError

    declared = [{"uuid": "GPU-0", "name": "Test", "memory_mib": 40960}]
    root = str(tmp_path / "ck")
    auto = ElasticKernels(gpu_inventory=declared, checkpoint_root=root).build()
    assert auto.inventory_source == "declared" and [d.uuid for d in auto.inventory] == ["GPU-0"]

    kube = ElasticKernels(gpu_inventory_source="kubernetes", checkpoint_root=root).build()
    assert kube.inventory_source == "kubernetes" and kube.inventory.source == "kubernetes"
    assert not kube.gpus_available and "not been listed" in kube.inventory.note
    change = kube.replace_inventory(
        GpuInventory(node_devices(node("n", {"nvidia.com/gpu": "1"}, labels=GFD)), "kubernetes")
    )
    assert [d.uuid for d in change.added] == ["n/gpu-0"]
    assert kube.gpus_available and kube.inventory is kube.allocator.inventory
    assert kube.allocator.profile_resource is profile_resource

    with pytest.raises(ConfigError, match="gpu_inventory is empty"):
        ElasticKernels(gpu_inventory_source="declared", checkpoint_root=root).build()
    with pytest.raises(ConfigError, match="remove one of the two"):
        ElasticKernels(
            gpu_inventory_source="kubernetes", gpu_inventory=declared, checkpoint_root=root
        ).build()


def test_client_model_nodes_read_the_same_and_are_slimmed_for_the_cache() -> None:
    from kubernetes import client

    from kernelmgr.kube.shapes import NODE

    raw = {
        "metadata": {"name": "n1", "labels": GFD, "managedFields": [{"manager": "kubelet"}]},
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": "2", "nvidia.com/mig-1g.10gb": "1"},
            "conditions": [{"type": "Ready", "status": "True"}],
            "images": [{"names": ["registry.example/big:1"], "sizeBytes": 1 << 30}],
        },
    }
    model = client.V1Node.from_dict(raw)
    assert [d.uuid for d in node_devices(model)] == ["n1/gpu-0", "n1/gpu-1", "n1/mig-1g.10gb-0"]
    slim = NODE.build(raw)
    assert slim.status.images is None and slim.metadata.managed_fields is None
    assert node_devices(slim) == node_devices(model)


def tainted(*taints: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    made = node("n1", {"nvidia.com/gpu": "1"}, labels={**GFD, **(labels or {})})
    made["spec"]["taints"] = list(taints)
    return made


@pytest.mark.parametrize(
    ("toleration", "admitted"),
    [
        ({"key": "gpu", "operator": "Equal", "value": "shared", "effect": "NoSchedule"}, True),
        ({"key": "gpu", "value": "shared"}, True),  # Equal is the default; no effect named: all effects
        ({"key": "gpu", "operator": "Exists"}, True),
        ({"operator": "Exists"}, True),  # tolerates every taint
        ({"key": "gpu", "value": "other"}, False),
        ({"key": "gpu", "value": "shared", "effect": "NoExecute"}, False),
        ({"key": "other", "operator": "Exists"}, False),
    ],
)
def test_a_taint_closes_the_node_unless_the_kernels_tolerate_it(
    toleration: dict[str, str], admitted: bool
) -> None:
    placement = Placement(tolerations=(toleration,))
    (device,) = node_devices(tainted({"key": "gpu", "value": "shared", "effect": "NoSchedule"}), placement)
    assert device.closed is not admitted


def test_prefer_no_schedule_does_not_close_and_the_node_selector_does() -> None:
    soft = tainted({"key": "gpu", "value": "x", "effect": "PreferNoSchedule"}, labels={"zone": "a"})
    assert not node_devices(soft, Placement())[0].closed
    assert not node_devices(soft, Placement({"zone": "a"}))[0].closed
    assert node_devices(soft, Placement({"zone": "b"}))[0].closed
    assert node_devices(soft, Placement({"pool": "gpu"}))[0].closed


def test_required_node_affinity_decides_as_the_scheduler_does() -> None:
    """Terms are ORed, a term's expressions and fields ANDed; an empty term matches nothing."""

    node = {"metadata": {"name": "n1", "labels": {"zone": "a", "gpus": "8"}}, "spec": {}}

    def admits(*terms: dict[str, Any]) -> bool:
        return Placement(node_terms=terms).admits(node)

    def term(key: str, operator: str, *values: str) -> dict[str, Any]:
        return {"matchExpressions": [{"key": key, "operator": operator, "values": list(values)}]}

    assert admits(term("zone", "In", "a", "b")) and not admits(term("zone", "In", "b"))
    assert admits(term("zone", "NotIn", "b")) and admits(term("rack", "NotIn", "r1"))
    assert admits(term("zone", "Exists")) and not admits(term("rack", "Exists"))
    assert admits(term("rack", "DoesNotExist")) and not admits(term("zone", "DoesNotExist"))
    assert admits(term("gpus", "Gt", "4")) and not admits(term("gpus", "Lt", "4"))
    assert admits(term("zone", "In", "b"), term("zone", "In", "a"))  # ORed
    assert not admits(
        {
            "matchExpressions": [
                *term("zone", "In", "a")["matchExpressions"],
                {"key": "rack", "operator": "Exists"},
            ]
        }
    )
    fields = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
    assert admits(fields) and not admits({}) and admits()


def test_other_pods_replicas_are_booked_as_their_share_of_a_gpu() -> None:
    """K of a GPU's R time-slicing replicas are K/R of it (``nvidia.com/gpu`` or ``.shared``),
    whole GPUs from R on; without sharing, and for MIG instances, whole devices."""
    from kernelmgr.kube.other_gpu_pods import booked_size

    assert booked_size(1, "nvidia.com/gpu", 4).gpu_fraction == 0.25
    assert booked_size(3, "nvidia.com/gpu.shared", 4).gpu_fraction == 0.75
    assert booked_size(5, "nvidia.com/gpu.shared", 4).whole_gpus == 2
    assert booked_size(2, "nvidia.com/gpu", 1).whole_gpus == 2
    assert booked_size(1, "nvidia.com/mig-1g.10gb", 4).whole_gpus == 1
