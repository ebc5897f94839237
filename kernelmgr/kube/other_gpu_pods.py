"""GPU pods that are not kernels: their GPUs are booked, so no kernel is promised one of them.

A node's allocatable GPUs do not go down as pods use them, so a training job or another notebook
platform on the same nodes was invisible: the allocator counted its GPUs free and answered
"fits" for a kernel pod kube-scheduler then left Pending. One cluster-wide pod watch (running
and pending pods bound to a node) books, for each such pod, the whole GPUs it requests
(``nvidia.com/gpu`` in its containers' requests or limits, init containers counted as the
scheduler counts them) on its node, under the holder ``pod:<namespace>/<name>``; a pod that ends
or is deleted gives them back. Bookings that do not fit this view yet (the node's devices not
listed, or kernels booked there first) are kept and tried again at every change, node changes
included (:meth:`OtherGpuPods.retry`).

Only whole-GPU requests are counted: shared, MIG and vendor resources of other pods are not
seen. Pods of this project (``app.kubernetes.io/name: jupyter-elastic-kernels``) are kernels
or warm pods, booked by their own code. Needs ``list`` and ``watch`` on ``pods`` cluster-wide.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import client

from kernelmgr.core.allocator import OTHER_POD_PREFIX, SliceAllocator
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.kube.access import ExplainedCoreV1Api
from kernelmgr.kube.fields import field_of as _field
from kernelmgr.kube.informer import Informer
from kernelmgr.kube.labels import NAME, NAME_LABEL
from kernelmgr.kube.nodes import GPU

log = logging.getLogger(__name__)

_APP_KEY, _APP_VALUE = NAME_LABEL, NAME
#: Pods that may hold GPUs: running, or pending on a node (the scheduler bound them already).
FIELD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"


def _gpus(resources: Any) -> int:
    """Whole GPUs one container asks for (requests, else limits: extended resources need both equal)."""
    for part in ("requests", "limits"):
        amount = (_field(resources, part) or {}).get(GPU)
        if amount is not None:
            try:
                return max(0, int(str(amount)))
            except ValueError:
                return 0
    return 0


def gpus_of(pod: Any) -> int:
    """What kube-scheduler counts for ``pod``: the sum over its containers, or its largest init
    container if that is more (init containers run one at a time, before the others)."""
    spec = _field(pod, "spec")
    running = sum(_gpus(_field(c, "resources")) for c in _field(spec, "containers") or ())
    first = max((_gpus(_field(c, "resources")) for c in _field(spec, "init_containers") or ()), default=0)
    return max(running, first)


def holder_of(pod: Any) -> str:
    metadata = _field(pod, "metadata")
    return f"{OTHER_POD_PREFIX}{_field(metadata, 'namespace')}/{_field(metadata, 'name')}"


def whole_gpus(count: int) -> GpuProfile:
    """The size another pod's request amounts to: ``count`` whole GPUs on one node."""
    return GpuProfile(
        f"other-pod-{count}", f"{count} GPU(s) of another pod", float(count), None, 100, "whole"
    )


class OtherGpuPods:
    """Keeps ``allocator``'s bookings equal to the whole GPUs of the GPU pods that are not kernels."""

    def __init__(self, api: client.ApiClient, allocator: SliceAllocator, watch_timeout: int = 300) -> None:
        self.allocator = allocator
        self.informer = Informer(
            ExplainedCoreV1Api(api).list_pod_for_all_namespaces,
            key=self._key,
            name="GPU pod",
            list_kwargs={"field_selector": FIELD_SELECTOR},
            watch_timeout=watch_timeout,
        )
        self.informer.add_listener(self._apply)
        self._lock = threading.Lock()
        #: holder -> (GPUs, node) of every other pod using GPUs; booked or waiting for room.
        self._wanted: dict[str, tuple[int, str]] = {}
        self._unbooked: set[str] = set()

    @staticmethod
    def _key(pod: Any) -> str | None:
        """Only bound GPU pods that are not this project's are cached (the rest: ``None``)."""
        labels = _field(_field(pod, "metadata"), "labels") or {}
        if labels.get(_APP_KEY) == _APP_VALUE or not _field(_field(pod, "spec"), "node_name"):
            return None
        return holder_of(pod) if gpus_of(pod) else None

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
            for holder, pod in changes.items():
                if pod is None:
                    self._wanted.pop(holder, None)
                    self._unbooked.discard(holder)
                    self.allocator.release(holder)
                else:
                    self._wanted[holder] = (gpus_of(pod), str(_field(_field(pod, "spec"), "node_name")))
                    self._unbooked.add(holder)
            self._book_locked()

    def retry(self) -> None:
        """Book what had no room before, and again what a node change took away (call it when
        the inventory changed)."""
        with self._lock:
            self._unbooked |= {h for h in self._wanted if self.allocator.slice_of(h) is None}
            self._book_locked()

    def _book_locked(self) -> None:
        for holder in sorted(self._unbooked):
            count, node = self._wanted[holder]
            if self.allocator.occupy(holder, whole_gpus(count), node) is not None:
                self._unbooked.discard(holder)
            else:
                log.info(
                    "GPU pod %s (%d GPU(s) on %s): no room in the inventory yet", holder[4:], count, node
                )
