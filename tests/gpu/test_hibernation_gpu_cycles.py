"""On a real GPU: CUDA state through repeated hibernation, and the GPU's memory really freed.

Skipped where there is no CUDA device (CI has none); run on the GPU machine with
``python -m pytest tests/gpu``. What it checks, cycle after cycle (API hibernations, then a
cell that resumes the kernel): CUDA tensors come back on the GPU with their values, a
``torch.nn.Module`` and its optimizer (with its per-parameter state) keep training where
they stopped, a module imported by the notebook is still there, and while the kernel is
hibernated the GPU holds none of its memory (NVML per-process), while running it does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pynvml = pytest.importorskip("pynvml")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)

from tests.support.server import RunningServer, start_server, wait_for  # noqa: E402

pytestmark = pytest.mark.gpu

CYCLES = 5

SETUP = """
import math, torch
torch.manual_seed(0)
big = torch.randn(256, 1024, 1024, device="cuda")          # 1 GiB on the GPU
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(512, 64, device="cuda"); y = x.sum(1, keepdim=True)
def train(steps):
    for _ in range(steps):
        opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); opt.step()
    return float(loss)
losses = [train(20)]
checksum = float(big.double().sum())
def opt_devices():  # Adam keeps exp_avg/exp_avg_sq with the parameter and its step count on the CPU
    found = {(k, str(t.device)) for s in opt.state.values() for k, t in s.items() if torch.is_tensor(t)}
    return sorted(found)
opt_devices_before = opt_devices()
print("ready")
"""

CHECK = """
import json as _json
print(_json.dumps({
    "big_device": str(big.device), "big_ok": abs(float(big.double().sum()) - checksum) < 1e-6,
    "params_on_cuda": all(p.is_cuda for p in model.parameters()),
    "opt_state_devices_kept": opt_devices() == opt_devices_before,
    "moments_on_cuda": all(s["exp_avg"].is_cuda and s["exp_avg_sq"].is_cuda for s in opt.state.values()),
    "grads_on_cuda": all(p.grad is not None and p.grad.is_cuda for p in model.parameters()),
    "opt_steps": int(next(iter(opt.state.values()))["step"]),
    "math": math.sqrt(16),
    "loss_falls": (losses.append(train(20)) or losses[-1] <= losses[0]),
    "n_losses": len(losses),
}))
"""


def kernel_gpu_mib(pid_filter: set[int] | None = None) -> int:
    """GPU memory (MiB) used by compute processes, per NVML."""
    pynvml.nvmlInit()
    try:
        used = 0
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if pid_filter is None or proc.pid in pid_filter:
                    used += (proc.usedGpuMemory or 0) >> 20
        return used
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RunningServer]:
    profiles = {"whole": {"gpu_fraction": 1}}
    running = start_server(
        tmp_path,
        {
            "ElasticKernels": {
                "profiles": profiles,
                "checkpoint_root": str(tmp_path / "ck"),
                "gpu_sample_interval": 1,
            }
        },
    )
    yield running
    running.stop()


def test_cuda_state_survives_five_cycles_and_the_gpu_is_freed(server: RunningServer) -> None:
    gpus = server.get("/api/elastic/gpus")
    assert gpus["source"] == "nvml", gpus
    kernel_id = server.start_kernel("python3-gpu-whole")
    assert server.execute(kernel_id, SETUP, timeout=300).strip() == "ready"
    pid = int(server.execute(kernel_id, "import os; print(os.getpid())").strip())
    assert kernel_gpu_mib({pid}) >= 1024
    # Per-kernel activity from real NVML, attributed through the process tree.
    model = wait_for(
        lambda: (m := server.get(f"/api/elastic/kernels/{kernel_id}"))["activity"]["gpu_memory_mib"] and m,
        timeout=30,
        what="NVML per-kernel memory",
    )
    print("activity while running:", json.dumps(model["activity"]))
    for cycle in range(1, CYCLES + 1):
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        print(f"cycle {cycle}: checkpoint {reply.body['checkpoint']['bytes'] >> 20} MiB")
        assert kernel_gpu_mib() == 0, "the GPU still holds memory of the hibernated kernel"
        with server.channel(kernel_id, timeout=300) as chan:
            result = chan.execute(CHECK, timeout=300)
        assert result.error == "", result.error
        print(f"cycle {cycle}: report {result.displays}")
        state = json.loads(result.stdout)
        assert state["big_device"].startswith("cuda") and state["big_ok"]
        assert state["params_on_cuda"] and state["moments_on_cuda"] and state["math"] == 4.0, state
        assert state["opt_state_devices_kept"] and state["grads_on_cuda"], state
        assert state["opt_steps"] == 20 * cycle, state  # the optimizer's state came back each time
        assert state["loss_falls"] and state["n_losses"] == cycle + 1
        assert "restored" in " ".join(result.displays)
