"""A TEST DOUBLE for NVML, for machines without a GPU.

:class:`NvmlDouble` implements :class:`kernelmgr.activity.nvml.Nvml` from a list of devices
given to it, so tests (and demos) can exercise NVML discovery without a driver. It is never
picked by the server, which always uses :class:`~kernelmgr.activity.nvml.PynvmlNvml`; tests hand
it to the code under test explicitly.
"""

from __future__ import annotations

from kernelmgr.activity.nvml import NvmlUnavailable
from kernelmgr.core.inventory import GpuDevice


class NvmlDouble:
    """Test double: reports the devices it was given, or fails like a missing driver."""

    def __init__(self, devices: list[GpuDevice] | None = None, unavailable_reason: str = "") -> None:
        self._devices = list(devices or [])
        self._unavailable_reason = unavailable_reason

    def devices(self) -> list[GpuDevice]:
        if self._unavailable_reason:
            raise NvmlUnavailable(self._unavailable_reason)
        return list(self._devices)
