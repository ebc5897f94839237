"""On a real GPU: the NVML paths the cull policy and the node agent read, against a real process.

Skipped where there is no CUDA device (CI has none); run on the GPU machine with
``python -m pytest tests/gpu``. A child process holds 1 GiB of CUDA memory and runs matrix
products, then stops computing but keeps its memory (a notebook between cells). Checked:
NVML lists the device; per-process memory names the child; per-process utilisation sees it
busy, then idle; the local activity sampler turns that into busy -> idle for a "kernel" with
that PID; the node agent's sampler accounts the child as a GPU process that belongs to no pod.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pynvml")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)

from kernelmgr.activity.gpu import GpuActivitySampler  # noqa: E402
from kernelmgr.activity.nvml import PynvmlNvml  # noqa: E402
from kernelmgr.nodeagent.sampler import NodeSampler  # noqa: E402
from tests.support.server import wait_for  # noqa: E402

pytestmark = pytest.mark.gpu

WORKER = """
import sys, time, pathlib, torch
stop = pathlib.Path(sys.argv[1])
held = torch.empty(256 * 1024 * 1024, dtype=torch.float32, device="cuda")  # 1 GiB
a = torch.randn(4096, 4096, device="cuda")
print("ready", flush=True)
while not stop.exists():
    for _ in range(50):
        a = a @ a
        a = a / a.norm()
    torch.cuda.synchronize()
print("idle", flush=True)
while True:
    time.sleep(1)  # memory held, nothing computed: a notebook between cells
"""


@pytest.fixture
def busy_child(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    stop = tmp_path / "stop"
    child = subprocess.Popen([sys.executable, "-c", WORKER, str(stop)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    yield child, stop
    child.kill()
    child.wait()


def test_nvml_sees_a_real_process_busy_then_idle(busy_child: tuple[subprocess.Popen[str], Path]) -> None:
    child, stop = busy_child
    nvml = PynvmlNvml()
    devices = nvml.devices()
    assert devices and devices[0].memory_mib > 10_000, devices
    uuid = devices[0].uuid
    print("device:", devices[0])

    memory = nvml.process_memory(uuid)
    print("process memory (MiB):", memory)
    assert memory.get(child.pid, 0) >= 1024, memory

    sampler = GpuActivitySampler(nvml, busy_threshold=5.0)
    kernels = {"k1": (child.pid, [uuid])}

    def busy_now() -> Any:
        activity = sampler.sample(kernels)["k1"]
        return activity if activity.utilization and activity.utilization > 5 else None

    busy = wait_for(busy_now, 30, 0.5, what="NVML to see the process busy")
    print("busy sample:", busy)
    assert busy and busy.available and busy.memory_mib >= 1024
    assert busy.idle_seconds is not None and busy.idle_seconds < 5

    stop.touch()
    assert child.stdout is not None and child.stdout.readline().strip() == "idle"

    def idle_now() -> Any:
        activity = sampler.sample(kernels)["k1"]
        return activity if activity.idle_seconds and activity.idle_seconds > 5 else None

    idle = wait_for(idle_now, 40, 0.5, what="NVML to see the process idle")
    print("idle sample:", idle)
    assert idle and idle.utilization is not None and idle.utilization <= 5
    assert idle.memory_mib >= 1024  # memory held is no activity signal

    node = NodeSampler(nvml, node="gpu-test").sample()
    print("node agent sample:", node.to_dict())
    assert node.error == ""
    assert child.pid in node.unattributed.pids  # a GPU process of no pod: accounted, not lost
    assert node.unattributed.gpu_memory_mib >= 1024
