"""TEST DOUBLES for NVML, for machines without a GPU.

:class:`NvmlDouble` implements :class:`kernelmgr.activity.nvml.Nvml` from devices and
per-process numbers that a test scripts into it, so tests (and demos) can exercise NVML
discovery and per-kernel GPU activity without a driver. It also counts its calls, so tests can
check that sampling cost stays bounded. :class:`FileNvmlDouble` is the same double fed from a
JSON file on every call, so an end-to-end test can run a real server subprocess against it and
change "GPU activity" while the server runs.

Neither is ever picked by the server on its own; tests (or a test configuration) hand them to
the code under test explicitly. The real implementation is
:class:`~kernelmgr.activity.nvml.PynvmlNvml`.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kernelmgr.activity.nvml import NvmlUnavailable
from kernelmgr.core.inventory import GpuDevice

ENV_FILE = "ELASTIC_NVML_DOUBLE_FILE"


@dataclass(frozen=True)
class UtilizationSample:
    """One scripted driver sample: ``pid`` used ``sm_percent`` of the SMs at ``timestamp_us``."""

    pid: int
    sm_percent: int
    timestamp_us: int


class NvmlDouble:
    """TEST DOUBLE: reports the devices and process numbers it was given, like the driver would.

    * :meth:`set_memory` scripts what ``nvmlDeviceGetComputeRunningProcesses`` would list;
    * :meth:`add_sample` scripts what ``nvmlDeviceGetProcessUtilization`` keeps in its buffer:
      :meth:`process_utilization` returns only samples newer than ``since_us``, and nothing
      (``({}, since_us)``, the driver's NotFound) when there are none, exactly the "idle" case;
    * devices named in ``mig`` behave like MIG instances: memory only, never utilisation;
    * a non-empty ``unavailable_reason`` (settable at any time) makes every call fail like a
      missing driver; so does asking about a device the double does not know.

    ``calls`` counts calls per method name ("devices", "process_memory", ...).
    """

    def __init__(
        self,
        devices: list[GpuDevice] | None = None,
        unavailable_reason: str = "",
        mig: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self._devices = list(devices or [])
        self.unavailable_reason = unavailable_reason
        self._mig = set(mig)
        self._memory: dict[str, dict[int, int]] = {}
        self._samples: dict[str, list[UtilizationSample]] = {}
        self._last_timestamp_us = 0
        self.calls: Counter[str] = Counter()

    # -- scripting -------------------------------------------------------------------------

    def set_memory(self, device_uuid: str, pid: int, mib: int | None) -> None:
        """Script that ``pid`` holds ``mib`` MiB on the device (None: the driver cannot say, reads 0)."""
        self._memory.setdefault(device_uuid, {})[pid] = mib or 0

    def remove_process(self, device_uuid: str, pid: int) -> None:
        """Script that ``pid`` left the device (its memory is freed)."""
        self._memory.get(device_uuid, {}).pop(pid, None)

    def add_sample(self, device_uuid: str, pid: int, sm_percent: int, timestamp_us: int | None = None) -> int:
        """Script one utilisation sample; without a timestamp, one newer than any so far. Returns it."""
        if timestamp_us is None:
            timestamp_us = self._last_timestamp_us + 1
        self._last_timestamp_us = max(self._last_timestamp_us, timestamp_us)
        self._samples.setdefault(device_uuid, []).append(UtilizationSample(pid, sm_percent, timestamp_us))
        return timestamp_us

    def clear_samples(self, device_uuid: str | None = None) -> None:
        """Script the driver's sample buffer rolling over (for one device, or all)."""
        if device_uuid is None:
            self._samples.clear()
        else:
            self._samples.pop(device_uuid, None)

    def set_mig(self, device_uuid: str, mig: bool = True) -> None:
        """Script whether the device is a MIG instance."""
        if mig:
            self._mig.add(device_uuid)
        else:
            self._mig.discard(device_uuid)

    # -- the Nvml protocol -----------------------------------------------------------------

    def _refresh(self) -> None:
        """Hook for subclasses that load their script from elsewhere before every call."""

    def _check(self, device_uuid: str | None = None) -> None:
        self._refresh()
        if self.unavailable_reason:
            raise NvmlUnavailable(self.unavailable_reason)
        if device_uuid is not None and all(d.uuid != device_uuid for d in self._devices):
            raise NvmlUnavailable(f"NVML cannot find device {device_uuid}: Not Found")

    def devices(self) -> list[GpuDevice]:
        self.calls["devices"] += 1
        self._check()
        return list(self._devices)

    def process_memory(self, device_uuid: str) -> dict[int, int]:
        self.calls["process_memory"] += 1
        self._check(device_uuid)
        return dict(self._memory.get(device_uuid, {}))

    def process_utilization(self, device_uuid: str, since_us: int) -> tuple[dict[int, int], int]:
        self.calls["process_utilization"] += 1
        self._check(device_uuid)
        if device_uuid in self._mig:
            return {}, since_us
        utilisation: dict[int, int] = {}
        newest = since_us
        for sample in self._samples.get(device_uuid, []):
            if sample.timestamp_us > since_us:
                utilisation[sample.pid] = max(utilisation.get(sample.pid, 0), sample.sm_percent)
                newest = max(newest, sample.timestamp_us)
        return utilisation, newest

    def is_mig(self, device_uuid: str) -> bool:
        self.calls["is_mig"] += 1
        self._check(device_uuid)
        return device_uuid in self._mig


class FileNvmlDouble(NvmlDouble):
    """TEST DOUBLE: :class:`NvmlDouble` whose script is re-read from a JSON file on every call.

    The file is named by the environment variable ``ELASTIC_NVML_DOUBLE_FILE`` (read on every
    call too), so a test can start a real server subprocess configured to use this double and
    rewrite the file to change what "the GPU" shows while the server runs. Shape::

        {
          "devices": [{"uuid": "GPU-a", "name": "Test A100", "memory_mib": 40960, "mig": false}],
          "processes": [{"pid": 1234, "device": "GPU-a", "memory_mib": 512, "sm_percent": 40}],
          "unavailable": ""
        }

    ``mig`` and ``unavailable`` are optional. Every listed process holds its ``memory_mib``; one
    with ``sm_percent`` > 0 yields a fresh utilisation sample (a timestamp newer than any before)
    on each call, so "busy" lasts exactly as long as the file says so. A missing variable, an
    unreadable file or bad JSON fail like a missing driver (:class:`NvmlUnavailable`).
    """

    def _refresh(self) -> None:
        path = os.environ.get(ENV_FILE, "")
        if not path:
            raise NvmlUnavailable(f"NVML unavailable: {ENV_FILE} is not set (FileNvmlDouble)")
        try:
            with open(path, encoding="utf-8") as handle:
                script = json.load(handle)
            self._load(script)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise NvmlUnavailable(f"NVML unavailable: cannot use {ENV_FILE}={path}: {exc!r}") from exc

    def _load(self, script: dict[str, Any]) -> None:
        devices = script.get("devices", [])
        self._devices = [
            GpuDevice(
                uuid=d["uuid"], name=d.get("name", "GPU double"), memory_mib=int(d["memory_mib"]), index=n
            )
            for n, d in enumerate(devices)
        ]
        self._mig = {d["uuid"] for d in devices if d.get("mig")}
        self.unavailable_reason = str(script.get("unavailable", "") or "")
        self._memory = {}
        self._samples = {}
        fresh = max(time.time_ns() // 1000, self._last_timestamp_us + 1)
        for process in script.get("processes", []):
            device, pid = str(process["device"]), int(process["pid"])
            self.set_memory(device, pid, int(process.get("memory_mib", 0)))
            if int(process.get("sm_percent", 0)) > 0:
                self.add_sample(device, pid, int(process["sm_percent"]), fresh)
