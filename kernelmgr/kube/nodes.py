"""The GPU inventory of a Kubernetes cluster, read from its Node objects and kept current by a watch.

In Kubernetes mode the devices slices are placed on are the cluster's, not the server's machine's:
``/api/elastic/gpus`` and ``fits_now`` must say what the cluster has. Each node's *allocatable*
resources (what the device plugins advertise; it does not go down as pods use it) are turned into
:class:`~kernelmgr.core.inventory.GpuDevice` records by :func:`node_devices`, and
:class:`NodeInventorySync` keeps the allocator's inventory equal to the union of those records.

What a node contributes (its devices are ``closed`` while it is cordoned, ``spec.unschedulable``, or
its ``Ready`` condition is not ``True``, or kernel pods cannot land there (:mod:`.placement`), so
"fits" never counts a GPU kube-scheduler would not give a kernel. No new slice goes to a closed
device, and the kernels already there keep theirs, since cordoning stops new pods, not running
ones, and a node that misses heartbeats for a moment usually comes back with its pods still
running; dropping their slices would count those GPUs free when it does. A kernel whose pod is
evicted or lost ends, and gives its slice back, the way any ended kernel does. Only a deleted
node, or one advertising fewer GPUs, takes slices away):

* **Whole GPUs / time-slicing / MPS** (NVIDIA device plugin): ``nvidia.com/gpu: N`` gives
  ``N / replicas`` devices ``<node>/gpu-<i>`` (``nvidia.com/gpu.replicas`` is the time-slicing
  or MPS replica count GPU feature discovery (GFD) labels the node with; 1 without sharing), each
  with the memory of GFD's ``nvidia.com/gpu.memory`` label (MiB) and named after
  ``nvidia.com/gpu.product``. Replicas renamed to ``nvidia.com/gpu.shared`` give devices
  ``<node>/gpu-shared-<i>`` of that resource. Under the device plugin's single MIG strategy
  (GFD label ``nvidia.com/mig.strategy=single``) every ``nvidia.com/gpu`` is one MIG instance,
  so each device is *exclusive* (one kernel, whatever its size). Without the memory label a
  device has 0 MiB: whole-GPU sizes fit on it, sizes with a memory cap do not.
* **MIG, mixed strategy**: every ``nvidia.com/mig-<g>g.<mem>gb[.<attr>]: K`` gives K exclusive
  devices ``<node>/mig-<g>g.<mem>gb-<i>`` of ``<mem> * 1024`` MiB and that resource.
* **HAMi**: its device plugin registers the node's GPUs in the annotation
  ``hami.io/node-nvidia-register`` (``uuid,count,devmem,devcore,type,numa,health[,index,mode]``
  per device, ``:``-separated, or a JSON list in newer releases); each healthy GPU is one
  device ``<node>/<uuid>`` with its ``devmem`` MiB. A node that instead advertises HAMi's
  ``nvidia.com/gpumem`` (MiB, all GPUs together) and ``nvidia.com/gpucores`` (100 per GPU) as
  extended resources (as the test cluster's simulated nodes do) gives ``gpucores / 100`` devices
  ``<node>/gpu-<i>`` sharing ``gpumem`` equally. On a HAMi node ``nvidia.com/gpu`` counts vGPU
  shares (GPUs x split count), not GPUs, so it adds nothing more. HAMi devices are of resource
  ``nvidia.com/gpu``: a whole size there gets a whole card.
* **Aliyun gpushare**: ``aliyun.com/gpu-count: N`` with ``aliyun.com/gpu-mem: M`` (the memory of all
  N GPUs, in GiB, or in MiB where the device plugin runs with ``--memory-unit=MiB``) gives N devices
  ``<node>/gpushare-<i>`` of resource ``aliyun.com/gpu-mem`` with ``M / N`` each. The node does not
  say which unit it counts in; since no GPU has 1024 GiB, a per-GPU figure of 1024 or more is read
  as MiB, a smaller one as GiB.
* **Tencent gpu-manager**: ``tencent.com/vcuda-core: 100 * N`` with ``tencent.com/vcuda-memory: U``
  (256 MiB units, all GPUs together) gives N devices ``<node>/vcuda-<i>`` of resource
  ``tencent.com/vcuda-core`` with ``U * 256 / N`` MiB each.

A GPU size with placement settings of its own (``size_pod_settings``: node selector, tolerations,
required node affinity) fits only on the nodes its pods may land on: the other nodes' devices name
it in ``refused_sizes``.

Long because it reads every mechanism's node format (whole, time-slicing, MIG, HAMi, gpushare,
vCUDA) into one device model and keeps that view current with one watch.

Kernel pods consume node resources that the allocator already tracks by kernel id, so nothing
here subtracts pod requests: the allocator's slices *are* the usage. The whole GPUs of pods that
are not kernels are booked by :mod:`kernelmgr.kube.other_gpu_pods`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes import client

from kernelmgr.core.allocator import InventoryChange, Slice, SliceAllocator
from kernelmgr.core.inventory import GpuDevice, GpuInventory
from kernelmgr.kube.access import ExplainedCoreV1Api
from kernelmgr.kube.fields import field_of as _field
from kernelmgr.kube.informer import Informer
from kernelmgr.kube.placement import Placement
from kernelmgr.kube.shapes import NODE

log = logging.getLogger(__name__)

GPU = "nvidia.com/gpu"
GPU_SHARED = "nvidia.com/gpu.shared"
HAMI_GPUMEM = "nvidia.com/gpumem"
HAMI_GPUCORES = "nvidia.com/gpucores"
HAMI_REGISTER_ANNOTATION = "hami.io/node-nvidia-register"
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
GPUSHARE_MEM = "aliyun.com/gpu-mem"
GPUSHARE_COUNT = "aliyun.com/gpu-count"
VCUDA_CORE = "tencent.com/vcuda-core"
VCUDA_MEMORY = "tencent.com/vcuda-memory"
#: MiB per ``tencent.com/vcuda-memory`` unit.
VCUDA_MEMORY_UNIT_MIB = 256
#: ``nvidia.com/mig-1g.10gb``, ``nvidia.com/mig-1g.10gb.me`` (the device plugin writes ``+me`` as ``.me``).
MIG_RESOURCE_RE = re.compile(r"^nvidia\.com/mig-(?P<profile>[1-7]g\.(?P<gb>[0-9]+)gb(\.[a-z.]+)?)$")


# ---- reading a Node (a kubernetes client model, or the same as a plain dict)


def node_name(node: Any) -> str:
    return str(_field(_field(node, "metadata"), "name") or "")


def node_schedulable(node: Any) -> bool:
    """Not cordoned, and its ``Ready`` condition is ``True``."""
    return not _field(_field(node, "spec"), "unschedulable") and node_ready(node)


def _count(value: Any) -> int:
    """An extended resource quantity (always an integer) as an int; 0 if absent or not one."""
    try:
        return max(0, int(str(value)))
    except (TypeError, ValueError):
        return 0


def node_ready(node: Any) -> bool:
    """Its ``Ready`` condition is ``True`` (cordoned or not)."""
    for condition in _field(_field(node, "status"), "conditions") or ():
        if _field(condition, "type") == "Ready":
            return _field(condition, "status") == "True"
    return False


def node_devices(
    node: Any, placement: Placement | None = None, sizes: Mapping[str, Placement] | None = None
) -> tuple[GpuDevice, ...]:
    """The GPU devices ``node`` contributes (see the module docstring): ``closed`` ones (no new
    slices, the old ones kept) while it is cordoned or not Ready, or where ``placement`` says
    kernel pods cannot land; with ``sizes`` (each GPU size's own placement), the sizes whose pods
    cannot land here are the devices' ``refused_sizes`` (closed when every size is)."""
    name = node_name(node)
    if not name:
        return ()
    devices = _advertised_devices(node, name)
    if sizes:
        refused = frozenset(size for size, admitted in sizes.items() if not admitted.admits(node))
        if node_schedulable(node) and len(refused) < len(sizes):
            return tuple(dataclasses.replace(d, refused_sizes=refused) for d in devices)
        return tuple(dataclasses.replace(d, closed=True) for d in devices)
    if not node_schedulable(node) or (placement is not None and not placement.admits(node)):
        return tuple(dataclasses.replace(d, closed=True) for d in devices)
    return devices


def _advertised_devices(node: Any, name: str) -> tuple[GpuDevice, ...]:
    metadata = _field(node, "metadata")
    labels: Mapping[str, str] = _field(metadata, "labels") or {}
    annotations: Mapping[str, str] = _field(metadata, "annotations") or {}
    allocatable: Mapping[str, Any] = _field(_field(node, "status"), "allocatable") or {}
    product = labels.get(PRODUCT_LABEL, "")
    memory = _count(labels.get(MEMORY_LABEL))
    replicas = _count(labels.get(REPLICAS_LABEL)) or 1
    devices: list[GpuDevice] = []

    hami = _hami_devices(name, annotations.get(HAMI_REGISTER_ANNOTATION), product)
    if hami is None and (HAMI_GPUMEM in allocatable or HAMI_GPUCORES in allocatable):
        hami = _hami_resource_devices(name, allocatable, product, memory)
    if hami is not None:
        devices.extend(hami)
    else:
        exclusive = labels.get(MIG_STRATEGY_LABEL) == "single"
        for resource, suffix in ((GPU, "gpu"), (GPU_SHARED, "gpu-shared")):
            physical = _count(allocatable.get(resource)) // replicas
            devices.extend(
                GpuDevice(
                    uuid=f"{name}/{suffix}-{i}",
                    name=product or resource,
                    memory_mib=memory,
                    index=i,
                    node=name,
                    resource=resource,
                    exclusive=exclusive,
                )
                for i in range(physical)
            )
    devices.extend(_gpushare_devices(name, allocatable, product))
    devices.extend(_vcuda_devices(name, allocatable, product))
    for resource in sorted(allocatable):
        match = MIG_RESOURCE_RE.match(resource)
        if not match:
            continue
        profile = match.group("profile")
        devices.extend(
            GpuDevice(
                uuid=f"{name}/mig-{profile}-{i}",
                name=f"{product} MIG {profile}".strip(),
                memory_mib=int(match.group("gb")) * 1024,
                index=i,
                node=name,
                resource=resource,
                exclusive=True,
            )
            for i in range(_count(allocatable[resource]))
        )
    return tuple(devices)


def _hami_devices(node: str, register: str | None, product: str) -> list[GpuDevice] | None:
    """Devices from HAMi's ``hami.io/node-nvidia-register`` annotation; ``None`` if absent or unreadable."""
    if not register or not register.strip():
        return None
    entries: list[tuple[str, int, str, bool]] = []  # uuid, devmem MiB, type, healthy
    text = register.strip()
    try:
        if text.startswith("["):
            for raw in json.loads(text):
                entries.append(
                    (
                        str(raw["id"]),
                        _count(raw.get("devmem")),
                        str(raw.get("type") or ""),
                        raw.get("health", True),
                    )
                )
        else:
            for part in text.split(":"):
                fields = part.split(",")
                if len(fields) < 7:
                    continue
                entries.append((fields[0], _count(fields[2]), fields[4], fields[6].strip().lower() == "true"))
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning(
            "node %s: cannot read %s=%r; using its resources instead", node, HAMI_REGISTER_ANNOTATION, text
        )
        return None
    return [
        GpuDevice(
            uuid=f"{node}/{uuid}",
            name=kind or product or "HAMi GPU",
            memory_mib=devmem,
            index=i,
            node=node,
            resource=GPU,
        )
        for i, (uuid, devmem, kind, healthy) in enumerate(e for e in entries if e[3] is True)
    ]


def _hami_resource_devices(
    node: str, allocatable: Mapping[str, Any], product: str, label_memory: int
) -> list[GpuDevice]:
    cores = _count(allocatable.get(HAMI_GPUCORES))
    count = cores // 100 if cores else _count(allocatable.get(GPU))
    if count <= 0:
        return []
    total = _count(allocatable.get(HAMI_GPUMEM))
    memory = total // count if total else label_memory
    return _identical_devices(node, count, memory, "gpu", product or "HAMi GPU", GPU)


def _gpushare_devices(node: str, allocatable: Mapping[str, Any], product: str) -> list[GpuDevice]:
    """Devices of a node running Aliyun's gpushare device plugin (see the module docstring)."""
    count = _count(allocatable.get(GPUSHARE_COUNT))
    total = _count(allocatable.get(GPUSHARE_MEM))
    if count <= 0 or total <= 0:
        return []
    per_gpu = total // count
    memory = per_gpu if per_gpu >= 1024 else per_gpu * 1024
    return _identical_devices(node, count, memory, "gpushare", product or "gpushare GPU", GPUSHARE_MEM)


def _vcuda_devices(node: str, allocatable: Mapping[str, Any], product: str) -> list[GpuDevice]:
    """Devices of a node running Tencent's gpu-manager (see the module docstring)."""
    count = _count(allocatable.get(VCUDA_CORE)) // 100
    if count <= 0:
        return []
    memory = _count(allocatable.get(VCUDA_MEMORY)) * VCUDA_MEMORY_UNIT_MIB // count
    return _identical_devices(node, count, memory, "vcuda", product or "vCUDA GPU", VCUDA_CORE)


def _identical_devices(
    node: str, count: int, memory_mib: int, prefix: str, name: str, resource: str
) -> list[GpuDevice]:
    """``count`` devices of one node that only the node's totals describe (per-resource backends
    advertise a sum, not one entry per GPU): equal shares of memory, ids ``<node>/<prefix>-<i>``."""
    return [
        GpuDevice(
            uuid=f"{node}/{prefix}-{i}",
            name=name,
            memory_mib=memory_mib,
            index=i,
            node=node,
            resource=resource,
        )
        for i in range(count)
    ]


def cluster_inventory(
    nodes_devices: Mapping[str, Sequence[GpuDevice]], schedulable_nodes: int
) -> GpuInventory:
    """One snapshot of the devices of all nodes, ordered by node name then device.

    Its note counts open and closed devices apart: a cordoned or NotReady node's GPUs are in the
    inventory (its kernels keep their slices) but take no new kernel.
    """
    devices = [d for node in sorted(nodes_devices) for d in nodes_devices[node]]
    open_devices = [d for d in devices if not d.closed]
    closed = len(devices) - len(open_devices)
    open_nodes = len({d.node for d in open_devices})
    note = (
        f"{len(open_devices)} GPU device(s) on {open_nodes} of the cluster's "
        f"{schedulable_nodes} schedulable node(s)"
        if open_devices
        else f"no schedulable node of the cluster ({schedulable_nodes} schedulable) advertises GPUs"
    )
    if closed:
        closed_nodes = len({d.node for d in devices if d.closed})
        note += (
            f"; {closed} more on {closed_nodes} node(s) cordoned, NotReady or out of the kernels' "
            "node selector and tolerations, closed to new kernels"
        )
    return GpuInventory(devices, source="kubernetes", note=note)


# ---- keeping the allocator in sync with the nodes

LostCallback = Callable[[tuple[Slice, ...]], None]


class NodeInventorySync:
    """Keeps ``allocator``'s inventory equal to the GPUs of the cluster's nodes (closed on the
    cordoned and NotReady ones).

    One shared node watch (:class:`~kernelmgr.kube.informer.Informer` over ``list_node``, with
    ``label_selector`` if given, e.g. ``nvidia.com/gpu.present=true``). After the first list and
    after each node event that changes what a node contributes, the devices of all nodes become
    one new :class:`GpuInventory`, swapped into the allocator with
    :meth:`SliceAllocator.replace_inventory` on the watch thread (the allocator's lock makes
    that safe against allocations on the event loop). Slices that were on devices now gone
    (node deleted, or advertising fewer GPUs) are no longer held; they are
    handed to ``on_lost`` -- on ``loop`` with ``call_soon_threadsafe`` when a loop is given (the
    server's: then the callback may touch kernel managers), else on the watch thread -- so the
    caller can mark or stop those kernels. A node event that changes nothing GPU-related (status
    heartbeats) costs one comparison of that node's devices.

    Needs ``list`` and ``watch`` on ``nodes`` (cluster scope: a ClusterRole).
    """

    def __init__(
        self,
        api: client.ApiClient,
        allocator: SliceAllocator,
        *,
        label_selector: str = "",
        on_lost: LostCallback | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        watch_timeout: int = 300,
        retry_delay: float = 1.0,
        placement: Placement | None = None,
        sizes: Mapping[str, Placement] | None = None,
    ) -> None:
        self.allocator = allocator
        self.placement = placement
        self.sizes = sizes
        self.on_lost = on_lost
        self.loop = loop
        kwargs = {"label_selector": label_selector} if label_selector else {}
        self.informer = Informer(
            ExplainedCoreV1Api(api).list_node,
            key=node_name,
            name="node",
            list_kwargs=kwargs,
            watch_timeout=watch_timeout,
            retry_delay=retry_delay,
            shape=NODE,
        )
        self.informer.add_listener(self._apply)
        #: How many times a new inventory was swapped in (tests and metrics read it).
        self.updates = 0
        #: Called on the watch thread after each new inventory (e.g. to book other GPU pods again).
        self.after_change: list[Callable[[], None]] = []
        #: Watches that live and stop with this one (:class:`~kernelmgr.kube.other_gpu_pods.OtherGpuPods`).
        self.companions: list[Any] = []
        self._by_node: dict[str, tuple[GpuDevice, ...]] = {}
        self._schedulable: set[str] = set()
        self._cond = threading.Condition()

    def start(self) -> NodeInventorySync:
        self.informer.start()
        return self

    def replicas(self, node: str) -> int:
        """How many replicas each GPU of ``node`` is shared as (GFD's label; 1 if unknown)."""
        labels = _field(_field(self.informer.get(node), "metadata"), "labels") or {}
        return _count(labels.get(REPLICAS_LABEL)) or 1

    def stop(self) -> None:
        self.informer.stop()
        for companion in self.companions:
            companion.stop()

    @property
    def synced(self) -> bool:
        """Whether the nodes were listed at least once (before that the inventory is empty)."""
        return self.informer.synced

    def _apply(self, changes: Mapping[str, Any | None]) -> None:
        """Runs on the informer's thread with the nodes that changed (``None``: deleted)."""
        with self._cond:
            dirty = self.updates == 0  # the first list always yields a snapshot, even an empty one
            for name, node in changes.items():
                devices = node_devices(node, self.placement, self.sizes) if node is not None else ()
                if node is not None and node_schedulable(node):
                    self._schedulable.add(name)
                else:
                    self._schedulable.discard(name)
                if self._by_node.get(name, ()) != devices:
                    dirty = True
                    if devices:
                        self._by_node[name] = devices
                    else:
                        self._by_node.pop(name, None)
            if not dirty:
                return
            change = self.allocator.replace_inventory(
                cluster_inventory(self._by_node, len(self._schedulable))
            )
            self.updates += 1
            self._cond.notify_all()
        self._report(change)
        for hook in self.after_change:
            try:
                hook()
            except Exception:  # one bad hook must not stop the node watch
                log.exception("after-change hook of the node inventory failed")

    def _report(self, change: InventoryChange) -> None:
        if change.added or change.removed:
            log.info(
                "cluster GPUs: %d added, %d removed, %d slice(s) lost",
                len(change.added),
                len(change.removed),
                len(change.lost),
            )
        if not change.lost:
            return
        for granted in change.lost:
            log.warning(
                "kernel %s lost its GPU slice (%s): device(s) %s left the cluster's inventory",
                granted.kernel_id,
                granted.profile,
                ", ".join(granted.device_uuids),
            )
        if self.on_lost is None:
            return
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
                self.loop.call_soon_threadsafe(self._call_on_lost, change.lost)
        else:
            self._call_on_lost(change.lost)

    def _call_on_lost(self, lost: tuple[Slice, ...]) -> None:
        assert self.on_lost is not None
        try:
            self.on_lost(lost)
        except Exception:
            log.exception("on_lost callback failed for %s", [s.kernel_id for s in lost])

    def wait_until(self, predicate: Callable[[GpuInventory], bool], timeout: float) -> bool:
        """Block until ``predicate(current inventory)`` holds after a sync; ``False`` after ``timeout``.

        For threads and tests (from asyncio: ``await asyncio.to_thread(sync.wait_until, ...)``).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self.updates and predicate(self.allocator.inventory)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True


def follow_pod_node(runtime: Any, holder: str, granted: Any, pod: Any, log: Any) -> Any:
    """Book ``holder``'s slice on the node kube-scheduler bound ``pod`` to; the slice now held.

    The allocator chose devices before the pod existed; the scheduler decides where it runs (a
    kernel's pod, or a warm pod). A declared inventory has no nodes to follow.
    """
    node = getattr(getattr(pod, "spec", None), "node_name", None)
    if granted is None or not node or runtime.allocator.inventory.source != "kubernetes":
        return granted
    moved = runtime.allocator.move_to_node(holder, runtime.profile(granted.profile), node)
    if moved is None:
        log.warning(
            "%s: its pod runs on node %s, where this server counts no room for size %s; "
            "its slice stays booked on %s",
            holder,
            node,
            granted.profile,
            ", ".join(granted.device_uuids),
        )
        return granted
    if moved != granted:
        log.info(
            "%s: slice booked on %s, where its pod runs (was %s)",
            holder,
            ", ".join(moved.device_uuids),
            ", ".join(granted.device_uuids),
        )
    return moved
