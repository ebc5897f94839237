"""What one GPU-activity sample costs, per kernel, on the NVML double and on a real GPU.

:class:`kernelmgr.activity.gpu.GpuActivitySampler` runs on the server's activity timer, so its
cost must stay small and grow no worse than linearly with the number of kernels. Cases:

* the NVML test double with 1, 10, 100 and 1000 kernels spread over up to 8 devices, every
  kernel's GPU work in a child process (so attribution needs the kernel's process tree) and a
  fresh utilisation sample per kernel each round; the tree is a table lookup, so this times the
  sampler itself (including the count of NVML calls per sample, which must equal 2 per device);
* 100 kernels whose PID is this process, with the real ``/proc`` tree: once with the default
  (one ``/proc`` scan shared by all kernels) and once with a scan per kernel;
* the real driver through ``PynvmlNvml`` when a GPU is present ("no GPU here" otherwise).

Run: ``python benchmarks/bench_nvml_sampling.py [--rounds 50]``. Prints Markdown tables of the
median over rounds.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernelmgr.activity.gpu import GpuActivitySampler
from kernelmgr.activity.nvml import NvmlUnavailable, PynvmlNvml
from kernelmgr.activity.nvml_double import NvmlDouble
from kernelmgr.activity.process_tree import descendants
from kernelmgr.core.inventory import GpuDevice

CHILD = 1_000_000  # a kernel's worker PID is its own PID + CHILD in the double cases
STRANGER = 4_000_000  # a PID on every device that belongs to no kernel: forces tree walks


def median_ms(run: Callable[[], object], before: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def double_case(count: int, rounds: int) -> tuple[float, float]:
    devices = [GpuDevice(uuid=f"GPU-bench-{d}", name="Double", memory_mib=81920, index=d) for d in range(8)]
    nvml = NvmlDouble(devices)
    kernels = {f"k{i}": (10_000 + i, [devices[i % len(devices)].uuid]) for i in range(count)}
    for pid, (device,) in kernels.values():
        nvml.set_memory(device, pid + CHILD, 1024)

    def fresh_samples() -> None:
        nvml.clear_samples()
        for pid, (device,) in kernels.values():
            nvml.add_sample(device, pid + CHILD, 50)

    sampler = GpuActivitySampler(nvml, tree=lambda pid: {pid, pid + CHILD})
    sampler.sample(kernels)  # the first sample also asks each device whether it is MIG
    before = sum(nvml.calls.values())
    ms = median_ms(lambda: sampler.sample(kernels), fresh_samples, rounds)
    used = len({d for _, (d,) in kernels.values()})
    calls = (sum(nvml.calls.values()) - before) / rounds / used
    return ms, calls


def real_tree_case(count: int, rounds: int, shared_scan: bool) -> float:
    devices = [GpuDevice(uuid=f"GPU-bench-{d}", name="Double", memory_mib=81920, index=d) for d in range(8)]
    nvml = NvmlDouble(devices)
    for device in devices:
        nvml.set_memory(device.uuid, STRANGER, 1)
    kernels = {f"k{i}": (os.getpid(), [devices[i % len(devices)].uuid]) for i in range(count)}
    tree = descendants if shared_scan else (lambda pid: descendants(pid))
    sampler = GpuActivitySampler(nvml, tree=tree)
    sampler.sample(kernels)
    return median_ms(lambda: sampler.sample(kernels), lambda: None, rounds)


def real_gpu(rounds: int) -> None:
    nvml = PynvmlNvml()
    try:
        devices = nvml.devices()
    except NvmlUnavailable as exc:
        print(f"no GPU here ({exc})")
        return
    if not devices:
        print("no GPU here (NVML lists no devices)")
        return
    print(f"Real GPU ({len(devices)} x {devices[0].name}), PynvmlNvml, median of {rounds}:\n")
    print("| kernels | ms per sample | µs per kernel |")
    print("|---:|---:|---:|")
    for count in (1, 10, 100):
        kernels = {f"k{i}": (os.getpid(), [devices[i % len(devices)].uuid]) for i in range(count)}
        sampler = GpuActivitySampler(nvml)
        first = sampler.sample(kernels)["k0"]
        if not first.available:
            print(f"| {count} | unavailable: {first.reason} | |")
            continue
        ms = median_ms(functools.partial(sampler.sample, kernels), lambda: None, rounds)
        print(f"| {count} | {ms:.3f} | {ms * 1000 / count:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    print(f"NVML double, process tree from a table, median of {args.rounds} samples:\n")
    print("| kernels | tree | ms per sample | µs per kernel | NVML calls per device per sample |")
    print("|---:|---|---:|---:|---:|")
    for count in (1, 10, 100, 1000):
        ms, calls = double_case(count, args.rounds)
        print(f"| {count} | table | {ms:.3f} | {ms * 1000 / count:.1f} | {calls:.0f} |")
    for shared in (True, False):
        ms = real_tree_case(100, args.rounds, shared)
        label = "real /proc, one scan per sample" if shared else "real /proc, one scan per kernel"
        print(f"| 100 | {label} | {ms:.3f} | {ms * 1000 / 100:.1f} | 2 |")
    print(f"\n(/proc holds {sum(1 for e in os.listdir('/proc') if e.isdigit())} processes here)\n")
    real_gpu(args.rounds)


if __name__ == "__main__":
    main()
