"""The one interface through which the project talks to NVML.

Everything that needs the GPU driver (device discovery now, per-process activity later)
goes through :class:`Nvml`, so that machines without a GPU can run the whole product with
a declared inventory, and tests can swap in :class:`kernelmgr.activity.nvml_double.NvmlDouble`
without patching ``pynvml``. :class:`PynvmlNvml` is the real implementation; it is the only
module that imports ``pynvml``.
"""

from __future__ import annotations

from typing import Protocol

from kernelmgr.core.inventory import GpuDevice, GpuInventory


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no driver, no library, no permission)."""


class Nvml(Protocol):
    """What the project needs from NVML."""

    def devices(self) -> list[GpuDevice]:
        """Every visible GPU, in NVML index order. Raises :class:`NvmlUnavailable`."""
        ...


class PynvmlNvml:
    """NVML through ``pynvml`` (the ``nvidia-ml-py`` distribution).

    Needs a GPU driver; on a machine without one, :meth:`devices` raises
    :class:`NvmlUnavailable` with the driver's own reason.
    """

    def __init__(self) -> None:
        self._initialised = False

    def _init(self) -> None:
        if self._initialised:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # pynvml raises NVMLError subclasses, or OSError/ImportError
            raise NvmlUnavailable(f"NVML unavailable: {exc}") from exc
        self._initialised = True

    def devices(self) -> list[GpuDevice]:  # pragma: no cover - needs a GPU driver
        self._init()
        import pynvml

        found: list[GpuDevice] = []
        try:
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                name = pynvml.nvmlDeviceGetName(handle)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                found.append(
                    GpuDevice(
                        uuid=uuid if isinstance(uuid, str) else uuid.decode(),
                        name=name if isinstance(name, str) else name.decode(),
                        memory_mib=int(memory.total) // (1024 * 1024),
                        index=index,
                    )
                )
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML device query failed: {exc}") from exc
        return found


def discover_inventory(nvml: Nvml) -> GpuInventory:
    """Build the inventory from NVML, or an empty one that says why there are no GPUs."""
    try:
        devices = nvml.devices()
    except NvmlUnavailable as exc:
        return GpuInventory(
            [],
            source="none",
            note=f"{exc}; ElasticKernels.gpu_inventory is empty, so only CPU kernels are offered",
        )
    if not devices:
        return GpuInventory([], source="none", note="NVML found no GPUs, so only CPU kernels are offered")
    return GpuInventory(devices, source="nvml", note=f"{len(devices)} GPU(s) discovered with NVML")
