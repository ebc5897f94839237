"""Per-kernel GPU activity from NVML, through the NVML test double (no GPU needed)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kernelmgr.activity.gpu import GpuActivity, GpuActivitySampler
from kernelmgr.activity.nvml import NvmlUnavailable, PynvmlNvml
from kernelmgr.activity.nvml_double import ENV_FILE, FileNvmlDouble, NvmlDouble
from kernelmgr.activity.process_tree import children_map, descendants, parent_of
from kernelmgr.core.inventory import GpuDevice

pytestmark = pytest.mark.pure

GPU_A, GPU_B, MIG = "GPU-aaaa", "GPU-bbbb", "MIG-cccc"


class Clock:
    """A settable clock, so idle times are exact."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def double() -> NvmlDouble:
    devices = [
        GpuDevice(uuid=u, name="Test", memory_mib=40960, index=i) for i, u in enumerate([GPU_A, GPU_B, MIG])
    ]
    return NvmlDouble(devices, mig={MIG})


def fake_tree(children: dict[int, set[int]]) -> Callable[[int], set[int]]:
    """A process tree from a table, so attribution tests need no real processes."""
    return lambda pid: {pid} | children.get(pid, set())


def recording_tree(walked: list[int], child_offset: int = 0) -> Callable[[int], set[int]]:
    """A process tree that records which roots were walked (each has child pid + child_offset)."""

    def tree(pid: int) -> set[int]:
        walked.append(pid)
        return {pid, pid + child_offset} if child_offset else {pid}

    return tree


def test_utilisation_goes_to_the_right_kernel_including_a_child_process() -> None:
    nvml, clock = double(), Clock()
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({100: {101}, 200: set()}))
    kernels = {"k1": (100, [GPU_A]), "k2": (200, [GPU_A])}
    sampler.sample(kernels)
    nvml.set_memory(GPU_A, 101, 2048)  # a DataLoader worker of k1 does the GPU work
    nvml.add_sample(GPU_A, 101, 80)
    clock.now += 30
    got = sampler.sample(kernels)
    assert got["k1"].utilization == 80 and got["k1"].memory_mib == 2048 and got["k1"].idle_seconds == 0
    assert got["k1"].last_busy == clock.now and got["k1"].available
    assert got["k2"].utilization == 0 and got["k2"].memory_mib == 0 and got["k2"].idle_seconds == 30
    assert got["k1"].to_dict() == {
        "gpu_utilization": 80.0,
        "gpu_memory_mib": 2048,
        "gpu_idle_seconds": 0.0,
        "gpu_activity_source": "nvml",
    }


def test_no_new_samples_means_idle_and_each_sample_is_read_once() -> None:
    nvml, clock = double(), Clock()
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({}))
    kernels = {"k": (100, [GPU_A])}
    nvml.add_sample(GPU_A, 100, 90, timestamp_us=5_000)
    assert sampler.sample(kernels)["k"].utilization == 90
    clock.now += 10  # the driver's NotFound: nothing newer than timestamp 5000
    after = sampler.sample(kernels)["k"]
    assert after.utilization == 0 and after.idle_seconds == 10 and after.last_busy == 1000.0
    assert nvml.process_utilization(GPU_A, 5_000) == ({}, 5_000)


def test_memory_held_without_utilisation_is_still_idle() -> None:
    nvml, clock = double(), Clock()
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({}))
    nvml.set_memory(GPU_A, 100, 30_000)  # a framework keeps its cache allocated
    kernels = {"k": (100, [GPU_A])}
    idle = []
    for _ in range(3):
        activity = sampler.sample(kernels)["k"]
        assert activity.memory_mib == 30_000 and activity.utilization == 0
        idle.append(activity.idle_seconds)
        clock.now += 60
    assert idle == [0, 60, 120]


def test_busy_threshold() -> None:
    nvml, clock = double(), Clock()
    sampler = GpuActivitySampler(nvml, busy_threshold=10, clock=clock, tree=fake_tree({}))
    kernels = {"k": (100, [GPU_A])}
    sampler.sample(kernels)
    clock.now += 5
    nvml.add_sample(GPU_A, 100, 10)  # at the threshold: not above it, so not busy
    assert sampler.sample(kernels)["k"].idle_seconds == 5
    clock.now += 5
    nvml.add_sample(GPU_A, 100, 11)
    busy = sampler.sample(kernels)["k"]
    assert busy.idle_seconds == 0 and busy.last_busy == clock.now
    clock.now += 7
    assert sampler.sample(kernels)["k"].idle_seconds == 7


def test_max_over_processes_and_devices() -> None:
    nvml, clock = double(), Clock()
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({100: {101}}))
    nvml.add_sample(GPU_A, 100, 20)
    nvml.add_sample(GPU_A, 100, 35)
    nvml.add_sample(GPU_B, 101, 60)
    nvml.set_memory(GPU_A, 100, 1000)
    nvml.set_memory(GPU_B, 101, 500)
    got = sampler.sample({"k": (100, [GPU_A, GPU_B])})["k"]
    assert got.utilization == 60 and got.memory_mib == 1500


def test_mig_device_measures_memory_only() -> None:
    nvml, clock = double(), Clock()
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({}))
    nvml.set_memory(MIG, 100, 4096)
    nvml.add_sample(MIG, 100, 99)  # never reported: the driver has no per-process util on MIG
    got = sampler.sample({"k": (100, [MIG])})["k"]
    assert got.available and got.memory_mib == 4096
    assert got.utilization is None and got.idle_seconds is None
    assert "MIG" in got.reason and "memory only" in got.reason
    assert got.to_dict()["gpu_activity_source"].startswith("nvml: MIG device(s) MIG-cccc")
    assert nvml.calls["process_utilization"] == 0


def test_nvml_unavailable_gives_the_reason_and_no_numbers() -> None:
    nvml, clock = double(), Clock()
    nvml.unavailable_reason = "Driver Not Loaded"
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({}))
    got = sampler.sample({"k": (100, [GPU_A]), "j": (200, [GPU_B])})
    for activity in got.values():
        assert not activity.available
        assert activity.reason == "NVML unavailable: Driver Not Loaded"
        assert activity.utilization is None and activity.idle_seconds is None
        assert activity.to_dict()["gpu_activity_source"] == "unavailable: NVML unavailable: Driver Not Loaded"


def test_time_without_measurements_is_not_counted_as_idle() -> None:
    nvml, clock = double(), Clock()
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({}))
    kernels = {"k": (100, [GPU_A])}
    sampler.sample(kernels)
    nvml.unavailable_reason = "GPU is lost"
    clock.now += 600
    assert not sampler.sample(kernels)["k"].available
    nvml.unavailable_reason = ""
    clock.now += 5
    assert sampler.sample(kernels)["k"].idle_seconds == 0


def test_unknown_device_and_cpu_kernel_are_unavailable() -> None:
    sampler = GpuActivitySampler(double(), clock=Clock(), tree=fake_tree({}))
    got = sampler.sample({"gone": (100, ["GPU-gone"]), "cpu": (200, [])})
    assert not got["gone"].available and "GPU-gone" in got["gone"].reason
    assert got["gone"].reason.startswith("NVML unavailable")
    assert not got["cpu"].available and got["cpu"].reason == "the kernel has no GPU slice"


def test_real_pynvml_without_a_gpu_makes_kernels_unavailable() -> None:
    got = GpuActivitySampler(PynvmlNvml()).sample({"k": (os.getpid(), ["GPU-nonexistent"])})["k"]
    assert not got.available and got.reason.startswith("NVML unavailable")
    with pytest.raises(NvmlUnavailable):
        PynvmlNvml().process_memory("GPU-nonexistent")


def test_a_fresh_kernel_is_idle_from_its_first_sighting_and_a_new_pid_starts_afresh() -> None:
    nvml, clock = double(), Clock()
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({}))
    sampler.sample({"k": (100, [GPU_A])})
    nvml.add_sample(GPU_A, 100, 50)
    clock.now += 10
    assert sampler.sample({"k": (100, [GPU_A])})["k"].last_busy == 1010
    clock.now += 100  # hibernated and resumed: a new kernel process
    resumed = sampler.sample({"k": (300, [GPU_A])})["k"]
    assert resumed.idle_seconds == 0 and resumed.last_busy is None
    clock.now += 3
    assert sampler.sample({"k": (300, [GPU_A])})["k"].idle_seconds == 3
    sampler.forget("k")
    clock.now += 50
    assert sampler.sample({"k": (300, [GPU_A])})["k"].idle_seconds == 0


def test_one_nvml_call_per_device_per_sample_with_100_kernels() -> None:
    nvml, clock = double(), Clock()
    trees: list[int] = []
    sampler = GpuActivitySampler(nvml, clock=clock, tree=recording_tree(trees, child_offset=10_000))
    kernels = {f"k{i}": (1000 + i, [GPU_A] if i % 2 else [GPU_B]) for i in range(100)}
    for i in range(100):
        nvml.add_sample(GPU_A if i % 2 else GPU_B, 11_000 + i, 40)  # work in each kernel's child
    for rounds in range(1, 4):
        got = sampler.sample(kernels)
        assert nvml.calls["process_memory"] == 2 * rounds
        assert nvml.calls["process_utilization"] == 2 * rounds
        assert nvml.calls["is_mig"] == 2  # asked once per device, ever
    assert len(got) == 100 and all(a.available for a in got.values())
    assert len(trees) == 100  # only the first round saw child PIDs; no samples since, so no tree walks


def test_process_trees_are_walked_only_for_unknown_pids() -> None:
    nvml = double()
    walked: list[int] = []
    sampler = GpuActivitySampler(nvml, clock=Clock(), tree=recording_tree(walked))
    nvml.set_memory(GPU_A, 100, 10)  # the kernel process itself: no walk needed
    sampler.sample({"k": (100, [GPU_A]), "j": (200, [GPU_B])})
    assert walked == []
    nvml.set_memory(GPU_B, 201, 10)
    sampler.sample({"k": (100, [GPU_A]), "j": (200, [GPU_B])})
    assert walked == [200]


SPAWNER = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_process_tree_finds_a_child_and_a_grandchild() -> None:
    child = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        found = descendants(os.getpid())
        assert {os.getpid(), child.pid, grandchild} <= found
        assert descendants(child.pid) == {child.pid, grandchild}
        assert descendants(child.pid, children_map()) == {child.pid, grandchild}
        assert parent_of(grandchild) == child.pid
    finally:
        child.kill()
        child.wait()
    with contextlib.suppress(ProcessLookupError):
        os.kill(grandchild, signal.SIGKILL)
    assert parent_of(2**22 + 12345) is None  # beyond pid_max: a process that is gone
    assert descendants(2**22 + 12345) == {2**22 + 12345}


def test_process_tree_survives_processes_vanishing_and_odd_names(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, stat in {
        1: "1 (init) S 0 1",
        10: "10 (we ird) name)) R 1 10",  # comm with spaces and parentheses
        11: "11 (x) S 10 11",
        12: "12 (garbled",  # truncated read
    }.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(stat)
    (proc / "13").mkdir()  # listed, then gone before its stat was read
    (proc / "self").mkdir()
    table = children_map(str(proc))
    assert table == {0: [1], 1: [10], 10: [11]}
    assert descendants(1, table) == {1, 10, 11}
    assert children_map(str(tmp_path / "missing")) == {}


def test_the_default_tree_resolves_real_children_with_one_scan() -> None:
    nvml = double()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        nvml.add_sample(GPU_A, child.pid, 70)
        got = GpuActivitySampler(nvml, clock=Clock()).sample({"me": (os.getpid(), [GPU_A])})
        assert got["me"].utilization == 70
    finally:
        child.kill()
        child.wait()


def test_file_double_follows_a_changing_json_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "nvml.json"
    nvml = FileNvmlDouble()
    clock = Clock()
    sampler = GpuActivitySampler(nvml, clock=clock, tree=fake_tree({}))
    kernels = {"k": (4242, [GPU_A])}
    assert "is not set" in sampler.sample(kernels)["k"].reason
    monkeypatch.setenv(ENV_FILE, str(path))
    assert "cannot use" in sampler.sample(kernels)["k"].reason  # no file yet

    def write(processes: list[dict[str, object]], **extra: object) -> None:
        devices = [{"uuid": GPU_A, "name": "Test A100", "memory_mib": 40960}]
        path.write_text(json.dumps({"devices": devices, "processes": processes, **extra}))

    write([{"pid": 4242, "device": GPU_A, "memory_mib": 1024, "sm_percent": 55}])
    assert nvml.devices() == [GpuDevice(uuid=GPU_A, name="Test A100", memory_mib=40960, index=0)]
    for _ in range(2):  # busy for as long as the file says so: a fresh sample every call
        clock.now += 10
        busy = sampler.sample(kernels)["k"]
        assert busy.utilization == 55 and busy.memory_mib == 1024 and busy.idle_seconds == 0
    write([{"pid": 4242, "device": GPU_A, "memory_mib": 1024, "sm_percent": 0}])
    clock.now += 10
    idle = sampler.sample(kernels)["k"]
    assert idle.utilization == 0 and idle.memory_mib == 1024 and idle.idle_seconds == 10
    write([], unavailable="Driver Not Loaded")
    assert sampler.sample(kernels)["k"].reason == "NVML unavailable: Driver Not Loaded"
    path.write_text("{not json")
    with pytest.raises(NvmlUnavailable, match="cannot use"):
        nvml.devices()


def test_activity_defaults_are_unmeasured() -> None:
    assert GpuActivity(False, "x").to_dict() == {
        "gpu_utilization": None,
        "gpu_memory_mib": None,
        "gpu_idle_seconds": None,
        "gpu_activity_source": "unavailable: x",
    }


def test_double_scripting_helpers() -> None:
    nvml = double()
    nvml.set_memory(GPU_A, 1, None)
    assert nvml.process_memory(GPU_A) == {1: 0}
    nvml.remove_process(GPU_A, 1)
    assert nvml.process_memory(GPU_A) == {}
    nvml.set_mig(GPU_A)
    assert nvml.is_mig(GPU_A)
    nvml.set_mig(GPU_A, False)
    assert not nvml.is_mig(GPU_A)
    assert nvml.add_sample(GPU_B, 1, 5, timestamp_us=100) == 100 and nvml.add_sample(GPU_B, 1, 5) == 101
    assert nvml.process_utilization(GPU_B, 0) == ({1: 5}, 101)
