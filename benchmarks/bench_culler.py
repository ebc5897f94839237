"""Culler tick cost and memory with many kernel records.

One tick of :class:`kernelmgr.server.culler.Culler` (snapshot + policy decision for every
kernel) over N managed kernels, plus the GPU sampler over the same kernels on the NVML test
double (two devices), in-process: the server's kernel manager is replaced by a minimal
stand-in that answers "which kernels exist and are they idle" — the part of the tick that
touches jupyter_server is a dict lookup. Half the kernels are recently active (nothing to
do), half idle past the warning point (a warning each, on the first tick only). Local mode
makes no Kubernetes API calls per tick (0 by construction; the pod provisioner will use one
shared watch).

Run: ``python benchmarks/bench_culler.py [--kernels 10,100,1000] [--ticks 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from traitlets.config import Config

from benchmarks.markdown import print_header, print_row
from kernelmgr.activity.gpu import GpuActivitySampler
from kernelmgr.activity.nvml_double import NvmlDouble
from kernelmgr.config import CullPolicy, ElasticKernels
from kernelmgr.core.inventory import GpuDevice
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.lifecycle.records import KernelStateFile
from kernelmgr.lifecycle.service import Hibernator
from kernelmgr.server.culler import Culler


class KernelManagerStandIn:
    """Just enough of the elastic kernel manager for the culler's tick."""

    def __init__(self) -> None:
        self.kernels: dict[str, Any] = {}
        self.log = logging.getLogger("bench")
        self.starting_kernels: set[str] = set()

    def __contains__(self, kernel_id: object) -> bool:
        return kernel_id in self.kernels

    def get_kernel(self, kernel_id: str) -> Any:
        return self.kernels[kernel_id]


def build(count: int, root: Path) -> tuple[Culler, Any]:
    devices = [{"uuid": f"GPU-{i}", "name": "bench", "memory_mib": 81920} for i in range(2)]
    config = Config(
        {
            "ElasticKernels": {
                "gpu_inventory": devices,
                "profiles": {"tiny": {"gpu_fraction": 0.001, "memory_mib": 1}},
                "checkpoint_root": str(root),
            },
            "CullPolicy": {"idle_timeout": 600, "warn_before": 60, "interval": 30},
        }
    )
    runtime = ElasticKernels(config=config).build(nvml_factory=NvmlDouble)
    policy = CullPolicy(config=config).build(list(runtime.profiles))
    mkm = KernelManagerStandIn()
    hibernator = Hibernator(mkm, runtime, KernelStateFile(root / "kernels.json"))  # type: ignore[arg-type]
    now = time.time()
    for n in range(count):
        kernel_id = f"kernel-{n:05d}"
        record = runtime.kernels.register(kernel_id, "python3-gpu-tiny", "tiny", "bench", KernelState.RUNNING)
        runtime.allocator.allocate(kernel_id, runtime.profile("tiny"))
        mkm.kernels[kernel_id] = SimpleNamespace(execution_state="idle", provisioner=None)
        activity = hibernator.activity.get(kernel_id)
        activity.last_execution_end = now - (30 if n % 2 else 580)
        assert record.state is KernelState.RUNNING
    gpu = [GpuDevice(uuid=d["uuid"], name="bench", memory_mib=81920, index=i) for i, d in enumerate(devices)]
    sampler = GpuActivitySampler(NvmlDouble(gpu))
    culler = Culler(mkm, runtime, hibernator, policy, sampler, broadcast=lambda _kid, _text: 0)  # type: ignore[arg-type]
    processes = {f"kernel-{n:05d}": (100_000 + n, [f"GPU-{n % 2}"]) for n in range(count)}
    return culler, processes


def measure(count: int, ticks: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        tracemalloc.start()
        culler, processes = build(count, Path(tmp))
        base_current, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loop = asyncio.new_event_loop()
        culler.gpu = culler.sampler.sample(processes)  # type: ignore[union-attr]
        loop.run_until_complete(culler.tick())  # one traced pass: memory, not time
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()  # tracing slows Python severalfold: time the ticks without it
        tick_times = []
        sample_times = []
        for _ in range(ticks):
            start = time.perf_counter()
            culler.gpu = culler.sampler.sample(processes)  # type: ignore[union-attr]
            sample_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            loop.run_until_complete(culler.tick())
            tick_times.append(time.perf_counter() - start)
        loop.close()
    return {
        "tick_ms": statistics.median(tick_times) * 1000,
        "sample_ms": statistics.median(sample_times) * 1000,
        "peak_extra_kib": (peak - base_current) / 1024,
        "state_kib": base_current / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="10,100,1000")
    parser.add_argument("--ticks", type=int, default=20)
    args = parser.parse_args()
    logging.getLogger("bench").setLevel(logging.ERROR)
    print(f"median of {args.ticks} ticks; policy interval 30 s; 2 devices on the NVML test double\n")
    print_header(
        [
            "kernels",
            "culler tick",
            "per kernel",
            "GPU sample",
            "peak extra memory per tick",
            "records in memory",
        ]
    )
    for count in (int(c) for c in args.kernels.split(",")):
        m = measure(count, args.ticks)
        per_kernel_us = m["tick_ms"] * 1000 / count
        cells = [
            str(count),
            f"{m['tick_ms']:.2f} ms",
            f"{per_kernel_us:.1f} µs",
            f"{m['sample_ms']:.2f} ms",
            f"{m['peak_extra_kib']:.0f} KiB",
            f"{m['state_kib']:.0f} KiB",
        ]
        print_row(cells)


if __name__ == "__main__":
    main()
