"""Per-kernel GPU activity, measured with NVML, for the idle policy.

Jupyter's own activity (execution requests, output) misses a kernel that is training in the
background, and memory is no activity signal at all: frameworks keep their allocations while
idle. So "busy" here means *SM utilisation above a threshold* in the kernel's processes (the
kernel process and its descendants, e.g. DataLoader workers), and idleness is the time since
that was last seen.

Cost is bounded: each :meth:`GpuActivitySampler.sample` makes at most one ``process_memory``
and one ``process_utilization`` call per device in use, however many kernels share it, and at
most one ``/proc`` scan (only when NVML lists a PID that is not itself a kernel process).

Limits, stated so the policy can fall back to Jupyter activity:

* NVML unavailable (no driver, device gone): ``available=False`` with the reason;
* MIG devices have no per-process utilisation: memory is measured, ``idle_seconds`` is None;
* NVML reports host PIDs, so the sampler must run in the kernels' PID namespace (local mode).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kernelmgr.activity.nvml import Nvml, NvmlUnavailable
from kernelmgr.activity.process_tree import children_map, descendants
from kernelmgr.core.activity import GpuActivity

KernelProcesses = Mapping[str, tuple[int, Sequence[str]]]
"""kernel_id -> (PID of the kernel process, UUIDs of the devices in its GPU slice)."""


@dataclass
class DeviceReading:
    """One device's NVML answers in one sample.

    ``memory`` is PID -> MiB; ``utilization`` is PID -> SM % over the samples since the previous
    reading (None on MIG devices: not measured); ``error`` is why NVML could not answer ("" if
    it did), in which case both maps are empty.
    """

    memory: dict[int, int]
    utilization: dict[int, int] | None
    error: str = ""

    def pids(self) -> set[int]:
        return set(self.memory) | set(self.utilization or {})


class DeviceReader:
    """Reads one device's per-process memory and utilisation, each driver sample exactly once.

    Shared by the local sampler below and the node agent (:mod:`kernelmgr.nodeagent.sampler`),
    so both follow the same NVML semantics: the newest utilisation timestamp is kept per device
    and passed back next time, a device's MIG-ness is asked once per UUID, and every failure
    becomes a reading with ``error`` set (never an exception), so one bad device does not hide
    the others.
    """

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self._since_us: dict[str, int] = {}
        self._mig: dict[str, bool] = {}
        #: What the last NVML query said: ``None`` before any, ``""`` when it answered, else why not.
        self.last_error: str | None = None

    def read(self, uuid: str) -> DeviceReading:
        """One reading of ``uuid``: at most one memory and one utilisation call."""
        try:
            mig = self._mig.get(uuid)
            if mig is None:  # a device's MIG-ness is fixed for its UUID: ask once
                mig = self._mig[uuid] = self._nvml.is_mig(uuid)
            memory = self._nvml.process_memory(uuid)
            if mig:
                self.last_error = ""
                return DeviceReading(memory, None)
            utilization, newest = self._nvml.process_utilization(uuid, self._since_us.get(uuid, 0))
        except NvmlUnavailable as exc:
            self.last_error = unavailable_reason(exc)
            return DeviceReading({}, {}, error=self.last_error)
        self.last_error = ""
        self._since_us[uuid] = max(newest, self._since_us.get(uuid, 0))
        return DeviceReading(memory, utilization)


@dataclass
class IdleTrack:
    """One kernel's idle bookkeeping between samples, shared by every GPU activity source.

    ``identity`` is what the kernel runs as (its process PID locally, its pod UID in a
    cluster): when it changes the kernel was hibernated and resumed, and a fresh track starts,
    so old activity neither keeps it alive nor makes it look idle for longer than it has been
    running. Time during which the kernel could not be measured is not counted as idle.
    """

    identity: object
    measured_since: float | None = None
    last_busy: float | None = None

    def unmeasured(self) -> None:
        """This sample could not measure the kernel: idleness restarts at the next measurement."""
        self.measured_since = None

    def measured(self, utilization: float | None, now: float, busy_threshold: float) -> float | None:
        """Record one measurement; the idle seconds (None when utilisation is not measurable)."""
        if self.measured_since is None:
            self.measured_since = now
        if utilization is not None and utilization > busy_threshold:
            self.last_busy = now
        if utilization is None:
            return None
        since = max(self.measured_since, self.last_busy or self.measured_since)
        return now - since


def track(tracks: dict[str, IdleTrack], kernel_id: str, identity: object) -> IdleTrack:
    """The kernel's track, started afresh when it is new or its identity changed."""
    current = tracks.get(kernel_id)
    if current is None or current.identity != identity:
        current = tracks[kernel_id] = IdleTrack(identity)
    return current


def unavailable_reason(exc: NvmlUnavailable) -> str:
    """The error as one line that always starts with "NVML unavailable"."""
    text = str(exc)
    return text if text.startswith("NVML unavailable") else f"NVML unavailable: {text}"


class GpuActivitySampler:
    """Samples NVML and attributes GPU use to kernels; call :meth:`sample` periodically.

    State kept between samples: each device's newest utilisation timestamp (so every driver
    sample is read once) and each kernel's last busy time. A kernel whose process PID changes
    (it was hibernated and resumed) starts afresh, so old activity neither keeps it alive nor
    makes it look idle for longer than it has been running. Time during which a kernel could
    not be measured is not counted as idle either.
    """

    def __init__(
        self,
        nvml: Nvml,
        busy_threshold: float = 5.0,
        clock: Callable[[], float] = time.time,
        tree: Callable[[int], set[int]] = descendants,
    ) -> None:
        self._reader = DeviceReader(nvml)
        self.busy_threshold = busy_threshold
        self._clock = clock
        self._tree = tree
        self._kernels: dict[str, IdleTrack] = {}

    @property
    def last_error(self) -> str | None:
        """What the last NVML query said: ``None`` before any, ``""`` when it answered, else why not."""
        return self._reader.last_error

    def source(self) -> str:
        """Where GPU activity comes from, as the policy endpoint shows it."""
        if self.last_error is None:
            return "nvml (not sampled yet)"
        return f"unavailable: {self.last_error}" if self.last_error else "nvml"

    def forget(self, kernel_id: str) -> None:
        """Drop what is remembered about a kernel (it stopped or was hibernated)."""
        self._kernels.pop(kernel_id, None)

    def sample(self, kernels: KernelProcesses) -> dict[str, GpuActivity]:
        """One NVML pass over every device in use; the activity of each kernel given."""
        now = self._clock()
        for gone in (
            self._kernels.keys() - kernels.keys()
        ):  # hibernated or removed: a new process starts afresh
            del self._kernels[gone]
        for kernel_id, (pid, _) in kernels.items():
            track(self._kernels, kernel_id, pid)
        in_use = list(dict.fromkeys(uuid for _, devices in kernels.values() for uuid in devices))
        readings = {uuid: self._reader.read(uuid) for uuid in in_use}
        owned = self._attribute(kernels, readings)
        return {
            kernel_id: self._activity(self._kernels[kernel_id], devices, readings, owned[kernel_id], now)
            for kernel_id, (_, devices) in kernels.items()
        }

    def _attribute(
        self, kernels: KernelProcesses, readings: Mapping[str, DeviceReading]
    ) -> dict[str, set[int]]:
        """kernel_id -> its PIDs; process trees are resolved only where NVML lists unknown PIDs."""
        roots = {pid for pid, _ in kernels.values()}
        strangers = {uuid: reading.pids() - roots for uuid, reading in readings.items()}
        table: dict[int, list[int]] | None = None
        owned: dict[str, set[int]] = {}
        for kernel_id, (pid, devices) in kernels.items():
            if not any(strangers[uuid] for uuid in devices):
                owned[kernel_id] = {pid}
            elif self._tree is descendants:  # the default: one /proc scan shared by all kernels
                table = children_map() if table is None else table
                owned[kernel_id] = descendants(pid, table)
            else:
                owned[kernel_id] = self._tree(pid) | {pid}
        return owned

    def _activity(
        self,
        track: IdleTrack,
        devices: Sequence[str],
        readings: Mapping[str, DeviceReading],
        pids: set[int],
        now: float,
    ) -> GpuActivity:
        if not devices:
            track.unmeasured()
            reason = "the kernel has no GPU slice"
            return GpuActivity(False, reason, last_busy=track.last_busy, sampled_at=now)
        errors = [readings[uuid].error for uuid in devices if readings[uuid].error]
        if errors:
            track.unmeasured()
            return GpuActivity(False, errors[0], last_busy=track.last_busy, sampled_at=now)
        memory = sum(readings[uuid].memory.get(pid, 0) for uuid in devices for pid in pids)
        measured = [u for u in (readings[uuid].utilization for uuid in devices) if u is not None]
        utilization = (
            float(max((u.get(pid, 0) for u in measured for pid in pids), default=0)) if measured else None
        )
        mig = [uuid for uuid in devices if readings[uuid].utilization is None]
        idle = track.measured(utilization, now, self.busy_threshold)
        if mig:
            reason = f"MIG device(s) {', '.join(mig)}: NVML has no per-process utilisation there, memory only"
            return GpuActivity(True, reason, utilization, memory, None, track.last_busy, now)
        return GpuActivity(True, "", utilization, memory, idle, track.last_busy, now)
