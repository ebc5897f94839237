"""The cluster's GPU inventory from its nodes, against the real control plane with kwok GPU nodes.

Each test labels its own kwok nodes and watches only those (``label_selector``), so the session's
other nodes (the node runner, other tests' nodes) never show up here. The runtime comes from
``ElasticKernels(gpu_inventory_source="kubernetes")``, as the server builds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, create_fake_gpu_nodes, fake_gpu_node, require_envtest

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from kernelmgr.config import ElasticKernels, ElasticRuntime  # noqa: E402
from kernelmgr.core.allocator import Slice  # noqa: E402
from kernelmgr.core.inventory import GpuInventory  # noqa: E402
from kernelmgr.kube.nodes import NodeInventorySync  # noqa: E402
from kernelmgr.kube.other_gpu_pods import OtherGpuPods  # noqa: E402
from kernelmgr.kube.placement import Placement  # noqa: E402

pytestmark = pytest.mark.timeout(180)
WAIT = 60.0
GFD = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/gpu.memory": "40960"}
PROFILES = {
    "small": {"gpu_fraction": 0.25, "memory_mib": 10240, "backend": "hami"},
    "one": {"gpu_fraction": 1},
    "two": {"gpu_fraction": 2},
    "mig": {
        "gpu_fraction": 0.14,
        "memory_mib": 9000,
        "backend": "mig",
        "options": {"mig_profile": "1g.10gb"},
    },
}


class Cluster:
    """This test's own kwok GPU nodes (deleted afterwards) and a node sync that watches only them."""

    def __init__(
        self,
        api: Any,
        plane: ControlPlane,
        runtime: ElasticRuntime,
        placement: Placement | None = None,
        sizes: dict[str, Placement] | None = None,
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.tag = uuid.uuid4().hex[:8]
        self.selector = f"elastic.test/inventory={self.tag}"
        self.runtime = runtime
        self.lost: list[Slice] = []
        self.lost_seen = threading.Condition()
        self.created: list[str] = []
        self.sync = NodeInventorySync(
            client.ApiClient(plane.configuration()),
            runtime.allocator,
            label_selector=self.selector,
            on_lost=self._on_lost,
            placement=placement,
            sizes=sizes,
        )

    def _on_lost(self, lost: tuple[Slice, ...]) -> None:
        with self.lost_seen:
            self.lost.extend(lost)
            self.lost_seen.notify_all()

    def name(self, short: str) -> str:
        return f"inv-{self.tag}-{short}"

    def add(self, short: str, **kwargs: Any) -> str:
        name = self.name(short)
        labels = {"elastic.test/inventory": self.tag, **kwargs.pop("labels", {})}
        create_fake_gpu_nodes(self.api, [name], labels=labels, **kwargs)
        self.created.append(name)
        return name

    def uuids(self) -> list[str]:
        return [d.uuid for d in self.runtime.inventory]

    def wait(self, predicate: Callable[[GpuInventory], bool], what: str) -> None:
        assert self.sync.wait_until(predicate, WAIT), f"{what}; inventory now: {self.uuids()}"

    def wait_lost(self, kernel_id: str) -> None:
        with self.lost_seen:
            found = self.lost_seen.wait_for(lambda: kernel_id in {s.kernel_id for s in self.lost}, WAIT)
        assert found, f"kernel {kernel_id} was not reported lost (lost: {self.lost})"

    def close(self) -> None:
        self.sync.stop()
        for name in self.created:
            try:
                self.core.delete_node(name)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise


@pytest.fixture
def runtime(tmp_path: Path) -> ElasticRuntime:
    elastic = ElasticKernels(
        profiles=PROFILES, gpu_inventory_source="kubernetes", checkpoint_root=str(tmp_path / "ck")
    )
    return elastic.build()


@pytest.fixture
def cluster(kube_plane: ControlPlane, kube_api: Any, runtime: ElasticRuntime) -> Iterator[Cluster]:
    made = Cluster(kube_api, kube_plane, runtime)
    yield made
    made.close()


def has(*uuids: str) -> Callable[[GpuInventory], bool]:
    return lambda inventory: {d.uuid for d in inventory} == set(uuids)


def all_placed_but_one_refused(cluster: Cluster, names: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """Where kube-scheduler put each pod, once all but one are placed and that one is refused
    (``PodScheduled=False``); the last look if that never happens within :data:`WAIT`."""

    def refused(name: str) -> bool:
        conditions = cluster.core.read_namespaced_pod(name, "default").status.conditions or []
        return any(c.type == "PodScheduled" and c.status == "False" for c in conditions)

    deadline = time.monotonic() + WAIT
    while True:
        nodes = {n: cluster.core.read_namespaced_pod(n, "default").spec.node_name for n in names}
        waiting = [n for n, v in nodes.items() if not v]
        if len(waiting) == 1 and refused(waiting[0]):
            return nodes, waiting
        if time.monotonic() > deadline:
            return nodes, []
        time.sleep(0.2)


def test_inventory_reflects_whole_hami_and_mig_nodes(cluster: Cluster) -> None:
    runtime = cluster.runtime
    assert runtime.inventory.source == "kubernetes" and not runtime.gpus_available  # nothing listed yet
    whole = cluster.add("whole", gpus=2, labels=GFD)
    hami = cluster.add("hami", gpus=20, gpumem_mib=2 * 24576, gpucores=200)
    mig = cluster.add("mig", gpus=0, mig={"1g.10gb": 2, "3g.40gb": 1})
    cluster.sync.start()
    expected = [
        f"{hami}/gpu-0",
        f"{hami}/gpu-1",
        f"{mig}/mig-1g.10gb-0",
        f"{mig}/mig-1g.10gb-1",
        f"{mig}/mig-3g.40gb-0",
        f"{whole}/gpu-0",
        f"{whole}/gpu-1",
    ]
    cluster.wait(has(*expected), "every node's GPUs")
    assert cluster.uuids() == expected  # ordered by node, then device
    by_uuid = {d.uuid: d for d in runtime.inventory}
    assert by_uuid[f"{whole}/gpu-0"].memory_mib == 40960
    assert by_uuid[f"{whole}/gpu-0"].name == "NVIDIA-A100-SXM4-40GB"
    assert by_uuid[f"{hami}/gpu-1"].memory_mib == 24576
    assert by_uuid[f"{mig}/mig-3g.40gb-0"].memory_mib == 40960 and by_uuid[f"{mig}/mig-3g.40gb-0"].exclusive
    assert all(d.node in (whole, hami, mig) for d in runtime.inventory)
    assert runtime.inventory.note == "7 GPU device(s) on 3 of the cluster's 3 schedulable node(s)"

    alloc = runtime.allocator
    assert alloc.allocate("m1", runtime.profile("mig")).device_uuids[0].startswith(f"{mig}/mig-1g.10gb-")
    assert alloc.allocate("m2", runtime.profile("mig")).device_uuids[0].startswith(f"{mig}/mig-1g.10gb-")
    assert not alloc.fits(runtime.profile("mig"))  # both 1g.10gb instances are taken; 3g.40gb is another size
    assert alloc.fits(runtime.profile("two"))
    assert alloc.allocate("s", runtime.profile("small")).device_uuids[0].startswith(f"{hami}/")


def test_cordoned_nodes_close_their_gpus_and_deleted_ones_take_their_slices_away(cluster: Cluster) -> None:
    alloc = cluster.runtime.allocator
    a = cluster.add("a", gpus=1, labels=GFD)
    b = cluster.add("b", gpus=1, labels=GFD)
    cluster.sync.start()
    cluster.wait(has(f"{a}/gpu-0", f"{b}/gpu-0"), "both nodes")
    on_a = alloc.allocate("k-a", cluster.runtime.profile("one"))
    assert on_a.device_uuids == (f"{a}/gpu-0",)

    def closed(uuid: str) -> Callable[[GpuInventory], bool]:
        return lambda inventory: any(d.uuid == uuid and d.closed for d in inventory)

    cluster.core.patch_node(a, {"spec": {"unschedulable": True}})  # kubectl cordon
    cluster.wait(closed(f"{a}/gpu-0"), "the cordoned node's GPU to close")
    assert alloc.slice_of("k-a") is not None  # its kernel runs on: cordoning stops new pods only
    on_b = alloc.allocate("k-b", cluster.runtime.profile("one"))
    assert on_b.device_uuids == (f"{b}/gpu-0",)
    assert not alloc.fits(cluster.runtime.profile("one"))  # a is closed, b is full

    cluster.core.delete_node(b)
    cluster.wait(has(f"{a}/gpu-0"), "the deleted node's GPU to leave")
    cluster.wait_lost("k-b")
    assert [s.kernel_id for s in alloc.slices()] == ["k-a"]
    alloc.release("k-a")  # its kernel ended: a is empty now, and still closed
    assert not alloc.fits(cluster.runtime.profile("one"))

    cluster.core.patch_node(a, {"spec": {"unschedulable": False}})  # uncordon: open again
    cluster.wait(lambda inventory: not closed(f"{a}/gpu-0")(inventory), "the uncordoned node's GPU to open")
    assert alloc.allocate("k-a2", cluster.runtime.profile("one")).device_uuids == (f"{a}/gpu-0",)
    assert [s.kernel_id for s in cluster.lost] == ["k-b"]


def test_a_node_that_misses_heartbeats_keeps_its_kernels_slices(cluster: Cluster) -> None:
    """NotReady for a moment, then back: its kernel's slice stays booked all along, so the GPU
    is never offered twice. (The node is not kwok's: this test writes its Ready condition.)"""
    alloc, one = cluster.runtime.allocator, cluster.runtime.profile("one")
    name = cluster.name("flaky")
    manifest = fake_gpu_node(name, gpus=1, labels={"elastic.test/inventory": cluster.tag, **GFD})
    manifest["metadata"]["annotations"] = {}  # kwok manages only annotated nodes
    cluster.core.create_node(manifest)
    cluster.created.append(name)

    def set_ready(status: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        condition = {
            "type": "Ready",
            "status": status,
            "reason": "Test",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        cluster.core.patch_node_status(name, {"status": {"conditions": [condition]}})

    def open_gpu(is_open: bool) -> Callable[[GpuInventory], bool]:
        return lambda inventory: any(d.uuid == f"{name}/gpu-0" and d.closed != is_open for d in inventory)

    set_ready("True")
    cluster.sync.start()
    cluster.wait(open_gpu(True), "the node's GPU")
    granted = alloc.allocate("k", one)
    assert granted.device_uuids == (f"{name}/gpu-0",)

    set_ready("False")
    cluster.wait(open_gpu(False), "the NotReady node's GPU to close")
    assert alloc.slice_of("k") == granted and not alloc.fits(one)
    assert alloc.inventory.note.endswith(
        "; 1 more on 1 node(s) cordoned, NotReady or out of the kernels' node selector and tolerations, "
        "closed to new kernels"
    )

    set_ready("True")
    cluster.wait(open_gpu(True), "the node's GPU to open again")
    assert alloc.slice_of("k") == granted
    assert not alloc.fits(one)  # still the kernel's: nobody else gets that GPU
    assert cluster.lost == []


def test_a_node_joining_makes_a_bigger_size_fit(cluster: Cluster) -> None:
    runtime = cluster.runtime
    alloc = runtime.allocator
    small_node = cluster.add("one", gpus=1, labels=GFD)
    cluster.sync.start()
    cluster.wait(has(f"{small_node}/gpu-0"), "the first node")
    alloc.allocate("k", runtime.profile("one"))
    assert not alloc.fits(runtime.profile("one")) and not alloc.ever_fits(runtime.profile("two"))

    big = cluster.add("two", gpus=2, labels=GFD)
    cluster.wait(lambda inv: len(inv) == 3, "the new node's GPUs")
    assert alloc.fits(runtime.profile("two"))
    assert alloc.allocate("t", runtime.profile("two")).device_uuids == (f"{big}/gpu-0", f"{big}/gpu-1")
    assert alloc.slice_of("k") is not None and cluster.lost == []


def test_lost_slices_are_delivered_on_the_event_loop(
    kube_plane: ControlPlane, kube_api: Any, runtime: ElasticRuntime, cluster: Cluster
) -> None:
    node = cluster.add("loop", gpus=1, labels=GFD)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        delivered: asyncio.Future[tuple[str, tuple[Slice, ...]]] = loop.create_future()

        def on_lost(lost: tuple[Slice, ...]) -> None:
            # runs on the loop's thread: safe to touch asyncio objects and kernel managers here
            delivered.set_result((threading.current_thread().name, lost))

        sync = NodeInventorySync(
            client.ApiClient(kube_plane.configuration()),
            runtime.allocator,
            label_selector=cluster.selector,
            on_lost=on_lost,
            loop=loop,
        ).start()
        try:
            assert await asyncio.to_thread(sync.wait_until, has(f"{node}/gpu-0"), WAIT)
            granted = runtime.allocator.allocate("k", runtime.profile("one"))
            await asyncio.to_thread(cluster.core.delete_node, node)
            thread, lost = await asyncio.wait_for(delivered, WAIT)
            assert lost == (granted,) and thread == threading.current_thread().name
        finally:
            await asyncio.to_thread(sync.stop)

    asyncio.run(scenario())


def test_node_watch_lists_again_after_410_gone(kube_plane: ControlPlane, cluster: Cluster) -> None:
    """After etcd compaction (410 Gone) the node watch lists again, and the inventory is still right."""
    alloc = cluster.runtime.allocator
    # Reconnecting only every 3 s makes it likely that the changes below happen while the watch is
    # down, so that only the re-list can tell that node a is gone (the outcome must be right anyway).
    cluster.sync = NodeInventorySync(
        client.ApiClient(kube_plane.configuration()),
        alloc,
        label_selector=cluster.selector,
        on_lost=cluster._on_lost,
        retry_delay=3.0,
    )
    a = cluster.add("a", gpus=1, labels=GFD)
    cluster.sync.start()
    cluster.wait(has(f"{a}/gpu-0"), "the first node")
    alloc.allocate("k-a", cluster.runtime.profile("one"))
    assert cluster.sync.informer.lists == 1

    kube_plane.expire_resource_versions()
    cluster.core.delete_node(a)
    b = cluster.add("b", gpus=2, labels=GFD)
    cluster.wait(has(f"{b}/gpu-0", f"{b}/gpu-1"), "the inventory after the re-list")
    cluster.wait_lost("k-a")
    assert cluster.sync.informer.lists >= 2
    assert alloc.fits(cluster.runtime.profile("two"))


def test_only_nodes_the_scheduler_would_use_for_a_kernel_pod_take_new_kernels(
    kube_plane: ControlPlane, kube_api: Any, runtime: ElasticRuntime
) -> None:
    """Kernel pods select ``zone=a`` and tolerate ``gpu=shared``: a node in zone b, or with a taint
    they do not tolerate, is closed; the real kube-scheduler agrees, placing a pod with the same
    selector and tolerations on the open node only, and leaving the next one Pending."""
    toleration = {"key": "gpu", "operator": "Equal", "value": "shared", "effect": "NoSchedule"}
    placement = Placement({"zone": "a"}, (toleration,))
    cluster = Cluster(kube_api, kube_plane, runtime, placement)
    try:
        good = cluster.add("good", gpus=1, labels={**GFD, "zone": "a"})
        shared = {"key": "gpu", "value": "shared", "effect": "NoSchedule"}
        tolerated = cluster.add("tolerated", gpus=1, labels={**GFD, "zone": "a"}, taints=[shared])
        dedicated = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
        tainted = cluster.add("tainted", gpus=1, labels={**GFD, "zone": "a"}, taints=[dedicated])
        elsewhere = cluster.add("elsewhere", gpus=1, labels={**GFD, "zone": "b"})
        cluster.sync.start()
        cluster.wait(
            lambda inventory: (
                {d.uuid: d.closed for d in inventory}
                == {
                    f"{good}/gpu-0": False,
                    f"{tolerated}/gpu-0": False,
                    f"{tainted}/gpu-0": True,
                    f"{elsewhere}/gpu-0": True,
                }
            ),
            "the intolerable and the unselected nodes' GPUs closed",
        )
        one = runtime.profile("one")
        assert runtime.allocator.fits(one)
        runtime.allocator.allocate("k1", one)
        runtime.allocator.allocate("k2", one)
        assert not runtime.allocator.fits(one)  # 4 GPUs in the cluster, 2 a kernel pod can use

        # The scheduler's own answer for pods like the kernels' (one GPU each, among these nodes).
        names = [f"sched-{cluster.tag}-{n}" for n in range(3)]
        for name in names:
            cluster.core.create_namespaced_pod(
                "default",
                {
                    "metadata": {"name": name},
                    "spec": {
                        "nodeSelector": {"zone": "a", "elastic.test/inventory": cluster.tag},
                        "tolerations": [toleration],
                        "containers": [
                            {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                        ],
                    },
                },
            )
        try:
            nodes, waiting = all_placed_but_one_refused(cluster, names)
            # Two pods on the two open nodes; no third GPU a kernel pod can use: Pending, as "fits" said.
            assert sorted(v for v in nodes.values() if v) == sorted([good, tolerated]), nodes
            assert len(waiting) == 1, nodes
        finally:
            for name in names:
                cluster.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    finally:
        cluster.close()


def test_gpus_of_pods_that_are_not_kernels_are_not_offered_to_kernels(cluster: Cluster) -> None:
    """A training job takes one of a node's two GPUs: one kernel fits, not two; when the job ends
    its GPU is offered again. A pod labelled as this project's (a kernel's) is not counted twice."""
    runtime, alloc = cluster.runtime, cluster.runtime.allocator
    node = cluster.add("shared", gpus=2, labels=GFD)
    others = OtherGpuPods(cluster.api, alloc)
    cluster.sync.after_change.append(others.retry)
    cluster.sync.companions.append(others)
    cluster.sync.start()
    others.start()
    cluster.wait(has(f"{node}/gpu-0", f"{node}/gpu-1"), "the node's GPUs")
    one = runtime.profile("one")

    def pod(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            },
        }

    job, kernel_like = f"job-{cluster.tag}", f"kern-{cluster.tag}"
    cluster.core.create_namespaced_pod("default", pod(job))
    cluster.core.create_namespaced_pod(
        "default", pod(kernel_like, {"app.kubernetes.io/name": "jupyter-elastic-kernels"})
    )
    try:
        holder = f"pod:default/{job}"
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and alloc.slice_of(holder) is None:
            time.sleep(0.1)
        assert alloc.slice_of(holder) is not None, "the job's GPU was not booked"
        assert alloc.slice_of(f"pod:default/{kernel_like}") is None  # a kernel's pod: booked by its kernel
        alloc.allocate("k1", one)
        assert not alloc.fits(one)  # two GPUs: the job's and k1's
        cluster.core.delete_namespaced_pod(job, "default", grace_period_seconds=0)
        while time.monotonic() < deadline and alloc.slice_of(holder) is not None:
            time.sleep(0.1)
        assert alloc.fits(one), "the job ended but its GPU is still booked"
    finally:
        for name in (job, kernel_like):
            with contextlib.suppress(client.ApiException):
                cluster.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_mig_instances_of_pods_that_are_not_kernels_are_not_offered_to_kernels(cluster: Cluster) -> None:
    """A job holding one of a node's two MIG 1g.10gb instances (mixed strategy): one kernel of the
    MIG size fits, not two; the job's end gives its instance back."""
    runtime, alloc = cluster.runtime, cluster.runtime.allocator
    node = cluster.add("mig-shared", gpus=0, mig={"1g.10gb": 2})
    others = OtherGpuPods(cluster.api, alloc)
    cluster.sync.after_change.append(others.retry)
    cluster.sync.companions.append(others)
    cluster.sync.start()
    others.start()
    cluster.wait(has(f"{node}/mig-1g.10gb-0", f"{node}/mig-1g.10gb-1"), "the node's MIG instances")
    mig = runtime.profile("mig")
    job = f"mig-job-{cluster.tag}"
    resources = {"limits": {"nvidia.com/mig-1g.10gb": "1"}}
    cluster.core.create_namespaced_pod(
        "default",
        {
            "metadata": {"name": job},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [{"name": "c", "image": "x", "resources": resources}],
            },
        },
    )
    try:
        holder = f"pod:default/{job}#nvidia.com/mig-1g.10gb"
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and alloc.slice_of(holder) is None:
            time.sleep(0.1)
        booked = alloc.slice_of(holder)
        assert booked is not None, "the job's MIG instance was not booked"
        assert booked.device_uuids[0].startswith(f"{node}/mig-1g.10gb-")
        alloc.allocate("m1", mig)
        assert not alloc.fits(mig)  # two instances: the job's and m1's
        cluster.core.delete_namespaced_pod(job, "default", grace_period_seconds=0)
        while time.monotonic() < deadline and alloc.slice_of(holder) is not None:
            time.sleep(0.1)
        assert alloc.fits(mig), "the job ended but its MIG instance is still booked"
    finally:
        with contextlib.suppress(client.ApiException):
            cluster.core.delete_namespaced_pod(job, "default", grace_period_seconds=0)


def test_a_size_pinned_to_some_nodes_fits_only_on_their_gpus(
    kube_plane: ControlPlane, kube_api: Any, runtime: ElasticRuntime
) -> None:
    """Size "one" has pod settings of its own (a node selector, a toleration, a required node
    affinity): it fits only on the nodes those admit, while the other sizes keep the rest; the
    real kube-scheduler places pods with "one"'s settings on the same nodes and no others."""
    from kernelmgr.kube.placement import size_placements
    from kernelmgr.kube.settings import KubeSettings

    toleration = {"key": "gpu", "operator": "Equal", "value": "big", "effect": "NoSchedule"}
    not_z9 = {"key": "zone", "operator": "NotIn", "values": ["z9"]}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [not_z9]}]
            }
        }
    }
    own = {"nodeSelector": {"pool": "big"}, "tolerations": [toleration], "affinity": affinity}
    template = KubeSettings(size_pod_settings={"one": own}).pod_template()
    sizes = size_placements(template, runtime.profiles)
    assert sizes is not None
    cluster = Cluster(kube_api, kube_plane, runtime, sizes=sizes)
    try:
        big = cluster.add("big", gpus=1, labels={**GFD, "pool": "big"})
        taint = {"key": "gpu", "value": "big", "effect": "NoSchedule"}
        tainted = cluster.add("bigtainted", gpus=1, labels={**GFD, "pool": "big"}, taints=[taint])
        z9 = cluster.add("bigz9", gpus=1, labels={**GFD, "pool": "big", "zone": "z9"})
        plain = cluster.add("plain", gpus=1, labels=GFD)
        cluster.sync.start()
        others = {"small", "two", "mig"}
        cluster.wait(
            lambda inventory: (
                {d.uuid: d.refused_sizes for d in inventory}
                == {
                    f"{big}/gpu-0": frozenset(),
                    f"{tainted}/gpu-0": frozenset(others),
                    f"{z9}/gpu-0": frozenset({"one"}),
                    f"{plain}/gpu-0": frozenset({"one"}),
                }
            ),
            "each node's GPU refusing the sizes whose pods cannot land there",
        )
        alloc, one, small = runtime.allocator, runtime.profile("one"), runtime.profile("small")
        placed = {alloc.allocate(k, one).device_uuids[0].split("/")[0] for k in ("k1", "k2")}
        assert placed == {big, tainted}
        assert not alloc.fits(one)  # two GPUs are free, but not where "one"'s pods may go
        assert alloc.allocate("s1", small).device_uuids[0].split("/")[0] in {z9, plain}

        # The scheduler's own answer for pods with "one"'s settings (one GPU each, among these nodes).
        names = [f"size-{cluster.tag}-{n}" for n in range(3)]
        for name in names:
            cluster.core.create_namespaced_pod(
                "default",
                {
                    "metadata": {"name": name},
                    "spec": {
                        "nodeSelector": {"pool": "big", "elastic.test/inventory": cluster.tag},
                        "tolerations": [toleration],
                        "affinity": affinity,
                        "containers": [
                            {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                        ],
                    },
                },
            )
        try:
            nodes, waiting = all_placed_but_one_refused(cluster, names)
            assert sorted(v for v in nodes.values() if v) == sorted([big, tainted]), nodes
            assert len(waiting) == 1, nodes
        finally:
            for name in names:
                cluster.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    finally:
        cluster.close()


def test_replicas_of_a_time_sliced_gpu_that_other_pods_hold_are_booked_as_their_share(
    kube_plane: ControlPlane, kube_api: Any, tmp_path: Path
) -> None:
    """A node's one GPU is shared as 4 replicas (GFD's nvidia.com/gpu.replicas, renamed to
    nvidia.com/gpu.shared); a job holding 2 of them leaves room for two quarter-GPU kernels, not
    four; its end gives its half back."""
    sizes = {**PROFILES, "quarter": {"gpu_fraction": 0.25, "memory_mib": 10000, "backend": "shared"}}
    runtime = ElasticKernels(
        profiles=sizes, gpu_inventory_source="kubernetes", checkpoint_root=str(tmp_path / "ck")
    ).build()
    cluster = Cluster(kube_api, kube_plane, runtime)
    job = f"ts-job-{cluster.tag}"
    try:
        labels = {**GFD, "nvidia.com/gpu.replicas": "4"}
        node = cluster.add("ts", gpus=0, extra={"nvidia.com/gpu.shared": "4"}, labels=labels)
        others = OtherGpuPods(cluster.api, runtime.allocator, replicas=cluster.sync.replicas)
        cluster.sync.after_change.append(others.retry)
        cluster.sync.companions.append(others)
        cluster.sync.start()
        others.start()
        cluster.wait(has(f"{node}/gpu-shared-0"), "the node's shared GPU")
        alloc, quarter = runtime.allocator, runtime.profile("quarter")
        resources = {"limits": {"nvidia.com/gpu.shared": "2"}}
        cluster.core.create_namespaced_pod(
            "default",
            {
                "metadata": {"name": job},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [{"name": "c", "image": "x", "resources": resources}],
                },
            },
        )
        holder = f"pod:default/{job}#nvidia.com/gpu.shared"
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and alloc.slice_of(holder) is None:
            time.sleep(0.1)
        booked = alloc.slice_of(holder)
        assert booked is not None, "the job's replicas were not booked"
        assert booked.placements[0].milli == 500  # 2 of 4 replicas: half the GPU
        alloc.allocate("q1", quarter)
        alloc.allocate("q2", quarter)
        assert not alloc.fits(quarter)  # the job's half and two quarters
        cluster.core.delete_namespaced_pod(job, "default", grace_period_seconds=0)
        while time.monotonic() < deadline and alloc.slice_of(holder) is not None:
            time.sleep(0.1)
        assert alloc.fits(quarter), "the job ended but its replicas are still booked"
    finally:
        with contextlib.suppress(client.ApiException):
            cluster.core.delete_namespaced_pod(job, "default", grace_period_seconds=0)
        cluster.close()
