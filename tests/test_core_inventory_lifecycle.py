"""Declared inventory validation, NVML discovery (through the NVML double) and the lifecycle."""

from __future__ import annotations

import pytest

from kernelmgr.activity.nvml import PynvmlNvml, discover_inventory
from kernelmgr.activity.nvml_double import NvmlDouble
from kernelmgr.core.errors import ConfigError, InvalidTransitionError
from kernelmgr.core.inventory import GpuDevice, GpuInventory
from kernelmgr.core.lifecycle import KernelState, Lifecycle

pytestmark = pytest.mark.pure


def test_declared_inventory() -> None:
    inv = GpuInventory.declared([{"uuid": "GPU-a", "name": "A100", "memory_mib": 40960}])
    assert inv.source == "declared"
    assert inv.devices[0] == GpuDevice(uuid="GPU-a", name="A100", memory_mib=40960, index=0)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ([{"name": "A100", "memory_mib": 1}], "gpu_inventory[0].uuid: required"),
        ([{"uuid": "GPU-a", "name": "A100"}], "gpu_inventory[0].memory_mib: required"),
        (
            [{"uuid": "GPU-a", "name": "A100", "memory_mib": "40G"}],
            "memory_mib: required, a positive integer",
        ),
        (
            [{"uuid": "GPU-a", "name": "A", "memory_mib": 1, "vendor": "x"}],
            "gpu_inventory[0].vendor: unknown key",
        ),
        (
            [
                {"uuid": "GPU-a", "name": "A", "memory_mib": 1},
                {"uuid": "GPU-a", "name": "B", "memory_mib": 1},
            ],
            "'GPU-a' appears twice",
        ),
        ("GPU-a", "must be a list of devices"),
        (["GPU-a"], "gpu_inventory[0] must be an object"),
    ],
)
def test_bad_inventory(raw: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        GpuInventory.declared(raw)  # type: ignore[arg-type]
    assert fragment in str(caught.value)


def test_discovery_through_the_nvml_double() -> None:
    devices = [GpuDevice(uuid="GPU-x", name="H100", memory_mib=81559, index=0)]
    inv = discover_inventory(NvmlDouble(devices))
    assert inv.source == "nvml" and inv.devices == tuple(devices)
    assert "1 GPU(s) discovered with NVML" in inv.note


def test_discovery_without_a_driver_offers_cpu_only() -> None:
    inv = discover_inventory(NvmlDouble(unavailable_reason="NVML unavailable: Driver Not Loaded"))
    assert inv.source == "none" and len(inv) == 0
    assert "Driver Not Loaded" in inv.note and "only CPU kernels" in inv.note


def test_discovery_with_no_devices() -> None:
    inv = discover_inventory(NvmlDouble([]))
    assert inv.source == "none" and "NVML found no GPUs" in inv.note


def test_real_pynvml_reports_unavailable_cleanly_without_a_gpu() -> None:
    nvml = PynvmlNvml()
    try:
        devices = nvml.devices()
    except Exception as exc:  # what a GPU-less machine must give: our one error type
        from kernelmgr.activity.nvml import NvmlUnavailable

        assert isinstance(exc, NvmlUnavailable)
        assert discover_inventory(nvml).source == "none"
    else:  # pragma: no cover - only on machines with a GPU driver
        assert all(d.uuid.startswith(("GPU-", "MIG-")) for d in devices)


def test_lifecycle_happy_path() -> None:
    ticks = iter(range(100))
    life = Lifecycle(clock=lambda: float(next(ticks)))
    for target in ["running", "hibernating", "hibernated", "resuming", "running"]:
        life.move(KernelState(target), reason=f"to {target}")
    assert life.state is KernelState.RUNNING and life.reason == "to running"


def test_failed_hibernation_returns_to_running_and_failed_resume_to_hibernated() -> None:
    life = Lifecycle(state=KernelState.HIBERNATING)
    life.move(KernelState.RUNNING, "checkpoint failed")
    life = Lifecycle(state=KernelState.RESUMING)
    life.move(KernelState.HIBERNATED, "no slice free")
    assert life.state is KernelState.HIBERNATED


@pytest.mark.parametrize(
    ("start", "target"),
    [("starting", "hibernating"), ("running", "resuming"), ("hibernated", "running"), ("dead", "running")],
)
def test_impossible_moves_are_refused(start: str, target: str) -> None:
    life = Lifecycle(state=KernelState(start))
    with pytest.raises(InvalidTransitionError, match=f"kernel is {start} and cannot become {target}"):
        life.move(KernelState(target))
    assert life.state is KernelState(start)


def test_every_state_can_die() -> None:
    for state in KernelState:
        if state is not KernelState.DEAD:
            assert Lifecycle(state=state).can(KernelState.DEAD)
