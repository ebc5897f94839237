"""The one interface through which the project talks to NVML.

Everything that needs the GPU driver (device discovery, per-process activity) goes through
:class:`Nvml`, so that machines without a GPU can run the whole product with a declared
inventory, and tests can swap in :class:`kernelmgr.activity.nvml_double.NvmlDouble` without
patching ``pynvml``. :class:`PynvmlNvml` is the real implementation; it is the only module that
imports ``pynvml``.

Process ids: NVML reports *host* PIDs (newer drivers translate the process lists, but not the
utilisation samples, into the caller's PID namespace), so whoever matches them against
``/proc`` must run in the same PID namespace as the kernels. Local mode does.
"""

from __future__ import annotations

from typing import Any, Protocol

from kernelmgr.core.inventory import GpuDevice, GpuInventory

_MIB = 1024 * 1024


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no driver, no library, no permission, device gone)."""


class Nvml(Protocol):
    """What the project needs from NVML.

    Every method raises :class:`NvmlUnavailable` (never a raw ``pynvml`` error) when NVML or the
    device cannot be queried, so callers handle exactly one error type.
    """

    def devices(self) -> list[GpuDevice]:
        """Every visible GPU, in NVML index order."""
        ...

    def process_memory(self, device_uuid: str) -> dict[int, int]:
        """PID -> GPU memory in MiB used on the device (compute and MPS client processes).

        A process whose usage NVML cannot report (``usedGpuMemory`` is None) maps to 0: it is
        still *on* the device, which matters for attribution.
        """
        ...

    def process_utilization(self, device_uuid: str, since_us: int) -> tuple[dict[int, int], int]:
        """PID -> SM utilisation % over the samples newer than ``since_us``, and the newest timestamp.

        The driver keeps a short ring buffer of samples and only lists processes that had
        non-zero utilisation, so "no samples" (``({}, since_us)``) means "nothing ran": idle, not
        an error. Pass the returned timestamp back next time so every sample is read once.
        MIG devices have no per-process utilisation: they always give ``({}, since_us)``; check
        :meth:`is_mig` to tell "idle" from "not measured" (only memory is measured there).
        """
        ...

    def is_mig(self, device_uuid: str) -> bool:
        """Whether the device is a MIG instance (or a MIG-enabled GPU): memory only, no utilisation."""
        ...


class PynvmlNvml:
    """NVML through ``pynvml`` (the ``nvidia-ml-py`` distribution).

    Needs a GPU driver; on a machine without one every method raises :class:`NvmlUnavailable`
    with the driver's own reason. Device handles are cached by UUID (looking one up costs a
    driver call) and dropped when a call on them fails, so a reset GPU is looked up afresh.
    """

    def __init__(self) -> None:
        self._initialised = False
        self._handles: dict[str, Any] = {}
        self._mig: dict[str, bool] = {}

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
                        memory_mib=int(memory.total) // _MIB,
                        index=index,
                    )
                )
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML device query failed: {exc}") from exc
        return found

    def _handle(self, device_uuid: str) -> Any:
        self._init()
        handle = self._handles.get(device_uuid)
        if handle is None:  # pragma: no cover - needs a GPU driver
            import pynvml

            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(device_uuid)
            except pynvml.NVMLError as exc:
                raise NvmlUnavailable(f"NVML cannot find device {device_uuid}: {exc}") from exc
            self._handles[device_uuid] = handle
        return handle

    def _failed(self, device_uuid: str, what: str, exc: BaseException) -> NvmlUnavailable:
        """Forget the device's cached handle and describe the failure in our own error type."""
        self._handles.pop(device_uuid, None)
        self._mig.pop(device_uuid, None)
        return NvmlUnavailable(f"NVML {what} failed on {device_uuid}: {exc}")

    def process_memory(self, device_uuid: str) -> dict[int, int]:  # pragma: no cover - needs a GPU driver
        handle = self._handle(device_uuid)
        import pynvml

        used: dict[int, int] = {}
        for versions in (
            (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetComputeRunningProcesses_v2),
            (
                pynvml.nvmlDeviceGetMPSComputeRunningProcesses,
                pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v2,
            ),
        ):
            try:
                processes = _first_supported(versions, handle)
            except pynvml.NVMLError_NotSupported:
                continue  # e.g. the MPS list on drivers/devices without MPS support
            except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
                raise self._failed(device_uuid, "process list", exc) from exc
            for process in processes:
                mib = int(process.usedGpuMemory or 0) // _MIB
                # A process can be in both lists; it is one allocation, not two.
                used[int(process.pid)] = max(used.get(int(process.pid), 0), mib)
        return used

    def process_utilization(  # pragma: no cover - needs a GPU driver
        self, device_uuid: str, since_us: int
    ) -> tuple[dict[int, int], int]:
        if self.is_mig(device_uuid):
            return {}, since_us
        handle = self._handle(device_uuid)
        import pynvml

        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)
        except pynvml.NVMLError_NotFound:
            return {}, since_us  # no samples newer than since_us: nothing ran
        except pynvml.NVMLError as exc:
            if getattr(exc, "value", None) == pynvml.NVML_SUCCESS:
                return {}, since_us  # pynvml raises "error 0" when the driver has zero samples
            raise self._failed(device_uuid, "process utilisation", exc) from exc
        utilisation: dict[int, int] = {}
        newest = since_us
        for sample in samples:
            pid = int(sample.pid)
            utilisation[pid] = max(utilisation.get(pid, 0), int(sample.smUtil))
            newest = max(newest, int(sample.timeStamp))
        return utilisation, newest

    def is_mig(self, device_uuid: str) -> bool:  # pragma: no cover - needs a GPU driver
        cached = self._mig.get(device_uuid)
        if cached is not None:
            return cached
        handle = self._handle(device_uuid)
        import pynvml

        try:
            mig = bool(pynvml.nvmlDeviceIsMigDeviceHandle(handle))
        except pynvml.NVMLError:  # old drivers / GPUs without MIG
            mig = False
        if not mig:
            try:  # a MIG-enabled parent GPU has no per-process utilisation either
                mig = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:
                mig = False
        self._mig[device_uuid] = mig
        return mig


def _first_supported(versions: tuple[Any, ...], handle: Any) -> list[Any]:  # pragma: no cover - needs a GPU
    """Call the newest process-list function the driver has (``_v3`` is missing before driver 510)."""
    import pynvml

    newest, fallback = versions
    try:
        return list(newest(handle))
    except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLLibraryMismatchError):
        return list(fallback(handle))


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
