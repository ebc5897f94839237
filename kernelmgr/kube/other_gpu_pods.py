"""GPU pods that are not kernels: their GPUs are booked, so no kernel is promised one of them.

A node's allocatable GPUs do not go down as pods use them, so a training job or another notebook
platform on the same nodes was invisible: the allocator counted its GPUs free and answered
"fits" for a kernel pod kube-scheduler then left Pending. One cluster-wide pod watch (running
and pending pods bound to a node) books, for each such pod, what it requests (in its containers'
requests or limits, init containers counted as the scheduler counts them) on its node: GPUs
(``nvidia.com/gpu``) under the holder ``pod:<namespace>/<name>``, time-slicing/MPS replicas
(``nvidia.com/gpu.shared``) and MIG instances of the mixed strategy (``nvidia.com/mig-<profile>``,
each an exclusive device of that resource) under ``pod:<namespace>/<name>#<resource>``; a pod
that ends or is deleted gives them back. On a node whose GPUs are shared (GFD's
``nvidia.com/gpu.replicas: R``), K replicas (of ``nvidia.com/gpu`` or ``.shared``) are K/R of a
GPU (whole GPUs past one). Bookings that do not fit this view yet (the node's devices not listed,
or kernels booked there first) are kept and tried again at every change, node changes included
(:meth:`OtherGpuPods.retry`).

Not counted yet: HAMi and other vendors' resources. Pods of this
project (``app.kubernetes.io/name: jupyter-elastic-kernels``) are kernels or warm pods, booked
by their own code. Needs ``list`` and ``watch`` on ``pods`` cluster-wide.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client

from kernelmgr.core.allocator import OTHER_POD_PREFIX, SliceAllocator
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.kube.access import ExplainedCoreV1Api
from kernelmgr.kube.fields import field_of as _field
from kernelmgr.kube.informer import Informer
from kernelmgr.kube.labels import NAME, NAME_LABEL
from kernelmgr.kube.nodes import GPU, GPU_SHARED, MIG_RESOURCE_RE
from kernelmgr.kube.shapes import GPU_POD

log = logging.getLogger(__name__)

_APP_KEY, _APP_VALUE = NAME_LABEL, NAME
#: Pods that may hold GPUs: running, or pending on a node (the scheduler bound them already).
FIELD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"


def counted(resource: str) -> bool:
    """The GPU resources booked for other pods: GPUs, their replicas, and mixed-strategy MIG instances."""
    return resource in (GPU, GPU_SHARED) or MIG_RESOURCE_RE.match(resource) is not None


def _gpus(resources: Any) -> dict[str, int]:
    """What one container asks for of each counted resource (requests, else limits: extended
    resources need both equal)."""
    found: dict[str, int] = {}
    for part in ("limits", "requests"):  # requests win where both name a resource
        for resource, amount in (_field(resources, part) or {}).items():
            if counted(resource):
                try:
                    found[resource] = max(0, int(str(amount)))
                except ValueError:
                    found[resource] = 0
    return found


def requests_of(pod: Any) -> dict[str, int]:
    """What kube-scheduler counts for ``pod``, per resource: the sum over its containers, or its
    largest init container if that is more (init containers run one at a time, before the others)."""
    spec = _field(pod, "spec")
    total: dict[str, int] = {}
    for container in _field(spec, "containers") or ():
        for resource, count in _gpus(_field(container, "resources")).items():
            total[resource] = total.get(resource, 0) + count
    for container in _field(spec, "init_containers") or ():
        for resource, count in _gpus(_field(container, "resources")).items():
            total[resource] = max(total.get(resource, 0), count)
    return {resource: count for resource, count in total.items() if count > 0}


def gpus_of(pod: Any) -> int:
    """The whole GPUs (``nvidia.com/gpu``) ``pod`` takes."""
    return requests_of(pod).get(GPU, 0)


def holder_of(pod: Any, resource: str = GPU) -> str:
    metadata = _field(pod, "metadata")
    holder = f"{OTHER_POD_PREFIX}{_field(metadata, 'namespace')}/{_field(metadata, 'name')}"
    return holder if resource == GPU else f"{holder}#{resource}"


def booked_size(count: int, resource: str, replicas: int) -> GpuProfile:
    """What ``count`` of ``resource`` amount to on a node whose GPUs are ``replicas`` replicas each:
    a share of one GPU, or whole GPUs (MIG instances: whole devices)."""
    if resource in (GPU, GPU_SHARED) and replicas > 1:
        if count < replicas:
            fraction = count / replicas
            return GpuProfile(
                f"other-pod-{resource}-{count}-of-{replicas}",
                f"{count} of {replicas} replicas of {resource} of another pod",
                fraction,
                None,
                max(1, round(100 * fraction)),
                "shared",
                {"resource_name": resource},
            )
        count = -(-count // replicas)
    return whole_gpus(count, resource)


def whole_gpus(count: int, resource: str = GPU) -> GpuProfile:
    """The size another pod's request amounts to: ``count`` whole devices of ``resource`` (GPUs,
    or MIG instances) on one node."""
    if resource == GPU:
        return GpuProfile(
            f"other-pod-{count}", f"{count} GPU(s) of another pod", float(count), None, 100, "whole"
        )
    return GpuProfile(
        f"other-pod-{resource}-{count}",
        f"{count} {resource} of another pod",
        float(count),
        None,
        100,
        "whole",
        {"resource_name": resource},
    )


class OtherGpuPods:
    """Keeps ``allocator``'s bookings equal to the whole GPUs of the GPU pods that are not kernels."""

    def __init__(
        self,
        api: client.ApiClient,
        allocator: SliceAllocator,
        watch_timeout: int = 300,
        replicas: Callable[[str], int] | None = None,
    ) -> None:
        self.allocator = allocator
        #: A node's GPU replica count (GFD's label; 1 when unknown or not shared).
        self.replicas = replicas or (lambda node: 1)
        self.informer = Informer(
            ExplainedCoreV1Api(api).list_pod_for_all_namespaces,
            key=self._key,
            shape=GPU_POD,
            name="GPU pod",
            list_kwargs={"field_selector": FIELD_SELECTOR},
            watch_timeout=watch_timeout,
        )
        self.informer.add_listener(self._apply)
        self._lock = threading.Lock()
        #: holder -> (resource, count, node), one per pod and resource; booked or waiting for room.
        self._wanted: dict[str, tuple[str, int, str]] = {}
        self._unbooked: set[str] = set()
        #: pod (its cache key) -> its holders.
        self._holders: dict[str, set[str]] = {}

    @staticmethod
    def _key(pod: Any) -> str | None:
        """Only bound GPU pods that are not this project's are cached (the rest: ``None``)."""
        labels = _field(_field(pod, "metadata"), "labels") or {}
        if labels.get(_APP_KEY) == _APP_VALUE or not _field(_field(pod, "spec"), "node_name"):
            return None
        return holder_of(pod) if requests_of(pod) else None

    def start(self) -> OtherGpuPods:
        self.informer.start()
        return self

    def stop(self) -> None:
        self.informer.stop()

    @property
    def synced(self) -> bool:
        return self.informer.synced

    def unbooked(self) -> set[str]:
        """Pods whose GPUs found no room in this view yet (the node unknown, or full of kernels)."""
        with self._lock:
            return set(self._unbooked)

    def _apply(self, changes: Mapping[str, Any | None]) -> None:
        """On the informer's thread: book new pods, release ended ones."""
        with self._lock:
            for key, pod in changes.items():
                node = str(_field(_field(pod, "spec"), "node_name")) if pod is not None else ""
                wanted = {
                    holder_of(pod, resource): (resource, count, node)
                    for resource, count in (requests_of(pod) if pod is not None else {}).items()
                }
                for holder in self._holders.pop(key, set()) - set(wanted):
                    self._wanted.pop(holder, None)
                    self._unbooked.discard(holder)
                    self.allocator.release(holder)
                if wanted:
                    self._holders[key] = set(wanted)
                    self._wanted.update(wanted)
                    self._unbooked.update(wanted)
            self._book_locked()

    def retry(self) -> None:
        """Book what had no room before, and again what a node change took away (call it when
        the inventory changed)."""
        with self._lock:
            self._unbooked |= {h for h in self._wanted if self.allocator.slice_of(h) is None}
            self._book_locked()

    def _book_locked(self) -> None:
        for holder in sorted(self._unbooked):
            resource, count, node = self._wanted[holder]
            profile = booked_size(count, resource, self.replicas(node))
            if self.allocator.occupy(holder, profile, node) is not None:
                self._unbooked.discard(holder)
            else:
                log.info(
                    "GPU pod %s (%s on %s): no room in the inventory yet",
                    holder[4:],
                    profile.display_name,
                    node,
                )
