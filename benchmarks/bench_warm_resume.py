"""Resume through a warm pool against a cold resume, beside the floor, in one run (issue 13).

Two servers side by side, identical but for ``ElasticKernels.warm_pool`` (``{"python3": {"size":
1, "preload": ["torch"]}}`` on one, none on the other). For each state size, rounds alternate
between them: a kernel imports torch and makes one float32 tensor of that size (on the GPU when
there is one, else on the CPU), is hibernated, and the resume is timed from the first cell sent to
its reply (the cell touches the tensor; with size 0 it makes a one-element tensor on the device).

Floors, each in a fresh process:

* warm floor: what a resume must still do once torch is imported: create the CUDA context (GPU
  only), read the bytes from the checkpoint disk, and copy them to the device;
* cold floor: the same from the process's spawn, with ``import torch``.

Run here (CPU): ``python benchmarks/bench_warm_resume.py``; on the GPU machine:
``python benchmarks/bench_warm_resume.py --sizes 0,0.0625,1,4`` (sizes in GiB; the device is
found by itself). Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from tests.support.server import RunningServer, start_server, wait_for

GIB = 1024**3
PROFILES = {"whole": {"gpu_fraction": 1, "display_name": "GPU whole"}}
#: Without a GPU: one declared device, so that the per-size kernelspec exists (nothing uses it).
CPU_INVENTORY = [{"uuid": "GPU-bench-0000", "name": "declared, not used", "memory_mib": 81920}]

FLOOR = """
import sys, time
spawned = float(sys.argv[4])
import numpy, torch
after_import = time.time()
dev = sys.argv[3]
if dev == "cuda":
    torch.empty(1, device="cuda"); torch.cuda.synchronize()   # the CUDA context
n, path = int(sys.argv[1]), sys.argv[2]
host = numpy.empty(n // 4, dtype=numpy.float32)
if n:
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(host).cast("B"))
t = torch.from_numpy(host).to(dev)
if dev == "cuda":
    torch.cuda.synchronize()
done = time.time()
print(done - after_import, done - spawned)
"""


def device() -> str:
    probe = "import torch; print('cuda' if torch.cuda.is_available() else 'cpu', torch.__version__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def setup_cell(nbytes: int, dev: str) -> str:
    if nbytes == 0:
        return "import torch\nmeta = {'note': 'benchmark'}\n"
    return (
        "import torch\n"
        f"t = torch.randn({nbytes // 4}, device={dev!r})\n"
        "checksum = float(t[:1000].double().sum())\n"
        "meta = {'note': 'benchmark', 'n': t.numel()}\n"
    )


def check_cell(nbytes: int, dev: str) -> tuple[str, str]:
    if nbytes == 0:
        return f"print(torch.ones(1, device={dev!r}).device.type, meta['note'])", f"{dev} benchmark"
    return "print(t.device.type, abs(float(t[:1000].double().sum()) - checksum) < 1e-9)", f"{dev} True"


def pool_ready(server: RunningServer) -> bool:
    wanted = 'elastic_warm_pool_processes{kernel="python3",state="ready"} 1.0'
    return wanted in server.text("/metrics")


def resume_once(server: RunningServer, nbytes: int, dev: str, warm: bool) -> float:
    kernel_id = server.start_kernel("python3-gpu-whole")
    with server.channel(kernel_id, timeout=900) as chan:
        result = chan.execute(setup_cell(nbytes, dev), timeout=900)
        assert not result.error, result.error
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        if warm:
            wait_for(lambda: pool_ready(server), timeout=300, what="a ready warm process")
        code, expected = check_cell(nbytes, dev)
        start = time.perf_counter()
        result = chan.execute(code, timeout=900)
        took = time.perf_counter() - start
        assert not result.error and result.stdout.strip() == expected, result
    server.shutdown_kernel(kernel_id)
    return took


def floors(nbytes: int, dev: str, scratch: Path) -> tuple[float, float]:
    path = scratch / "floor.bin"
    with open(path, "wb") as handle:
        handle.write(os.urandom(min(nbytes, 1 << 20)) * (nbytes // (1 << 20) or 1) if nbytes else b"")
    args = [str(nbytes), str(path), dev, repr(time.time())]
    out = subprocess.run([sys.executable, "-c", FLOOR, *args], check=True, capture_output=True, text=True)
    path.unlink()
    warm, cold = (float(x) for x in out.stdout.split())
    return warm, cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,0.0625,1", help="state sizes in GiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    dev, torch_version = device().split()
    sizes = [float(s) for s in args.sizes.split(",")]
    rows: list[tuple[float, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="elastic-warm-bench-", dir=os.environ.get("BENCH_DIR")) as tmp:
        servers: dict[str, RunningServer] = {}
        try:
            for path in ("cold", "warm"):
                home = Path(tmp) / path
                home.mkdir()
                elastic: dict[str, Any] = {"profiles": PROFILES, "checkpoint_root": str(home / "checkpoints")}
                if dev == "cpu":
                    elastic["gpu_inventory"] = CPU_INVENTORY
                if path == "warm":
                    elastic["warm_pool"] = {"python3": {"size": 1, "preload": ["torch"], "memory_mib": 4096}}
                servers[path] = start_server(home, {"ElasticKernels": elastic})
            wait_for(lambda: pool_ready(servers["warm"]), timeout=300, what="the warm pool to fill")
            for size in sizes:
                nbytes = int(size * GIB)
                runs: dict[str, list[float]] = {"cold": [], "warm": [], "warm_floor": [], "cold_floor": []}
                for _ in range(args.repeat):
                    for path in ("cold", "warm"):
                        runs[path].append(resume_once(servers[path], nbytes, dev, warm=path == "warm"))
                    warm_floor, cold_floor = floors(nbytes, dev, Path(tmp))
                    runs["warm_floor"].append(warm_floor)
                    runs["cold_floor"].append(cold_floor)
                rows.append((size, {key: statistics.median(values) for key, values in runs.items()}))
                print(f"done {size} GiB: {runs}", file=sys.stderr, flush=True)
            hits = servers["warm"].text("/metrics")
            assert 'elastic_warm_pool_hits_total{kernel="python3",use="resume"}' in hits, "no warm resume"
        finally:
            for server in servers.values():
                server.stop()
    print(f"Device: {dev}; torch {torch_version}; {os.cpu_count()} cores; medians of {args.repeat} runs.\n")
    print_header(
        [
            "state",
            "cold resume",
            "warm resume",
            "cold / warm",
            "floor (import torch + context + read + copy)",
            "floor without import",
            "warm / floor without import",
        ]
    )
    for size, m in rows:
        label = "0" if size == 0 else (f"{size * 1024:g} MiB" if size < 1 else f"{size:g} GiB")
        print_row(
            [
                label,
                f"{m['cold']:.2f} s",
                f"{m['warm']:.2f} s",
                f"{m['cold'] / m['warm']:.1f}×",
                f"{m['cold_floor']:.2f} s",
                f"{m['warm_floor']:.2f} s",
                f"{m['warm'] / max(m['warm_floor'], 1e-3):.1f}×",
            ]
        )


if __name__ == "__main__":
    main()
