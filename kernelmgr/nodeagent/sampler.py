"""One pass over a node's GPUs: per-process NVML numbers, attributed to pods by cgroup.

The local sampler (:mod:`kernelmgr.activity.gpu`) knows its kernels' PIDs and asks "what are
these processes doing". A node agent knows no kernels and has no API rights, so it goes the
other way: every process NVML lists on every device -> its cgroup -> the pod UID (and the
kernel id its environment carries, when readable). Both read NVML through the same
:class:`~kernelmgr.activity.gpu.DeviceReader`, so each driver utilisation sample is read once
and MIG devices report memory only.

Processes that are not in any pod (host daemons, a user's process outside Kubernetes) or no
longer in ``/proc`` are not dropped silently: they are summed under ``unattributed`` so that
GPU use the culler cannot see is at least visible. Processes NVML lists that ``/proc`` does not
show are counted separately (``missing_pids``): many of them usually mean the agent runs
without ``hostPID`` and sees only its own PID namespace.

Per pod, ``gpu_utilization`` is the highest SM % of its processes over the driver samples since
the previous pass (0 when nothing ran; None when all its devices are MIG, where NVML has no
per-process utilisation), ``gpu_memory_mib`` the sum of its processes' memory. Nothing about
PIDs is cached between passes: PIDs are reused.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernelmgr.activity.gpu import DeviceReader, DeviceReading, unavailable_reason
from kernelmgr.activity.nvml import Nvml, NvmlUnavailable
from kernelmgr.nodeagent.cgroups import PROC, read_pod_uid
from kernelmgr.nodeagent.environ import read_kernel_id


@dataclass
class PodActivity:
    """GPU use of one pod's processes in one pass."""

    pod_uid: str
    kernel_id: str | None = None
    #: Distinct kernel ids seen in the pod's processes' environments, when they disagree.
    kernel_id_conflict: list[str] = field(default_factory=list)
    gpu_utilization: float | None = None
    gpu_memory_mib: int = 0
    devices: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "pod_uid": self.pod_uid,
            "kernel_id": self.kernel_id,
            "gpu_utilization": self.gpu_utilization,
            "gpu_memory_mib": self.gpu_memory_mib,
            "devices": self.devices,
            "pids": self.pids,
        }
        if self.kernel_id_conflict:
            doc["kernel_id_conflict"] = self.kernel_id_conflict
        return doc


@dataclass
class Unattributed:
    """GPU processes that belong to no pod (or that ``/proc`` no longer shows)."""

    pids: list[int] = field(default_factory=list)
    missing_pids: list[int] = field(default_factory=list)
    gpu_memory_mib: int = 0
    gpu_utilization: float | None = None
    devices: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pids": self.pids,
            "missing_pids": self.missing_pids,
            "gpu_memory_mib": self.gpu_memory_mib,
            "gpu_utilization": self.gpu_utilization,
            "devices": self.devices,
        }


@dataclass
class NodeSample:
    """Everything one pass saw; ``error`` is set when NVML could not list the devices at all."""

    node: str
    sampled_at: float
    duration_seconds: float = 0.0
    error: str = ""
    devices: list[dict[str, Any]] = field(default_factory=list)
    pods: dict[str, PodActivity] = field(default_factory=dict)
    unattributed: Unattributed = field(default_factory=Unattributed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "sampled_at": self.sampled_at,
            "duration_seconds": round(self.duration_seconds, 6),
            "nvml": "ok" if not self.error else self.error,
            "devices": self.devices,
            "pods": {uid: pod.to_dict() for uid, pod in sorted(self.pods.items())},
            "unattributed": self.unattributed.to_dict(),
        }


def default_node_name() -> str:
    """``$NODE_NAME`` (set from the downward API in the DaemonSet), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


class _Accumulator:
    """Running totals for one pod (or for the unattributed processes) within a pass."""

    def __init__(self) -> None:
        self.memory = 0
        self.utilization: float | None = None
        self.devices: dict[str, None] = {}
        self.pids: set[int] = set()

    def add(self, uuid: str, pid: int, reading: DeviceReading) -> None:
        self.memory += reading.memory.get(pid, 0)
        self.devices[uuid] = None
        self.pids.add(pid)
        if reading.utilization is not None:
            value = float(reading.utilization.get(pid, 0))
            self.utilization = value if self.utilization is None else max(self.utilization, value)


class NodeSampler:
    """Call :meth:`sample` periodically (from one thread: NVML and ``/proc`` reads block).

    State kept between passes: only the per-device utilisation timestamps inside the
    :class:`DeviceReader`, so each driver sample counts in exactly one pass.
    """

    def __init__(
        self,
        nvml: Nvml,
        proc_root: str = PROC,
        node: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._nvml = nvml
        self._reader = DeviceReader(nvml)
        self.proc_root = proc_root
        self.node = node or default_node_name()
        self._clock = clock

    def sample(self) -> NodeSample:
        """One pass over every device NVML lists."""
        began = time.monotonic()
        result = NodeSample(node=self.node, sampled_at=self._clock())
        try:
            devices = self._nvml.devices()
        except NvmlUnavailable as exc:
            result.error = unavailable_reason(exc)
            result.duration_seconds = time.monotonic() - began
            return result
        pods: dict[str, _Accumulator] = {}
        kernel_ids: dict[str, dict[str, None]] = {}
        outside = _Accumulator()
        missing: set[int] = set()
        uid_of: dict[int, str | None] = {}  # this pass only: PIDs are reused
        for device in devices:
            reading = self._reader.read(device.uuid)
            result.devices.append(
                {
                    "uuid": device.uuid,
                    "name": device.name,
                    "mig": reading.utilization is None and not reading.error,
                    "error": reading.error or None,
                }
            )
            for pid in sorted(reading.pids()):
                if pid not in uid_of:
                    uid_of[pid] = read_pod_uid(pid, self.proc_root)
                    if uid_of[pid] is not None:
                        kernel_id = read_kernel_id(pid, self.proc_root)
                        if kernel_id is not None:
                            kernel_ids.setdefault(str(uid_of[pid]), {})[kernel_id] = None
                    elif not os.path.exists(f"{self.proc_root}/{pid}"):
                        missing.add(pid)
                uid = uid_of[pid]
                if uid is None:
                    outside.add(device.uuid, pid, reading)
                else:
                    pods.setdefault(uid, _Accumulator()).add(device.uuid, pid, reading)
        for uid, acc in pods.items():
            seen = list(kernel_ids.get(uid, {}))
            result.pods[uid] = PodActivity(
                pod_uid=uid,
                kernel_id=seen[0] if len(seen) == 1 else None,
                kernel_id_conflict=sorted(seen) if len(seen) > 1 else [],
                gpu_utilization=acc.utilization,
                gpu_memory_mib=acc.memory,
                devices=list(acc.devices),
                pids=sorted(acc.pids),
            )
        result.unattributed = Unattributed(
            pids=sorted(outside.pids - missing),
            missing_pids=sorted(missing),
            gpu_memory_mib=outside.memory,
            gpu_utilization=outside.utilization,
            devices=list(outside.devices),
        )
        result.duration_seconds = time.monotonic() - began
        return result
