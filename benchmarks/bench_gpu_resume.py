"""CUDA state through hibernate and resume on a real GPU, beside the hardware's floors, in one run.

For each size (one CUDA float32 tensor of that many GiB, plus a few small variables), through
the project's real path (a jupyter_server with the extension, a real ipykernel kernel holding the
tensor on the GPU):

* hibernate: ``POST /api/elastic/kernels/{id}/hibernate``, beside its floor measured in a
  separate process holding the same tensor: device-to-host copy + write + fsync of the bytes
  to the same checkpoint directory;
* resume: hibernated -> the first cell's reply (the cell touches the tensor on the GPU), beside
  its floor: a fresh Python process that imports torch, creates its CUDA context, reads the
  same bytes from the same directory and copies them to the GPU (timed from the process's
  spawn to the copy done).

Needs a CUDA GPU (run on the GPU machine). Run: ``python benchmarks/bench_gpu_resume.py
[--sizes 1,4,16] [--repeat 2]`` (sizes in GiB); prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from tests.support.server import RunningServer, start_server

GIB = 1024**3
PROFILES = {"whole": {"gpu_fraction": 1, "display_name": "GPU whole"}}

HIBERNATE_FLOOR = """
import os, sys, time, torch
n, path = int(sys.argv[1]), sys.argv[2]
t = torch.randn(n // 4, device="cuda"); torch.cuda.synchronize()
start = time.perf_counter()
host = t.cpu()                          # device-to-host, as a checkpoint must
with open(path, "wb", buffering=0) as f:
    f.write(memoryview(host.numpy()).cast("B"))
    os.fsync(f.fileno())
print(time.perf_counter() - start)
"""

RESUME_FLOOR = """
import sys, time
spawned = float(sys.argv[3])
import numpy, torch
torch.empty(1, device="cuda"); torch.cuda.synchronize()   # the CUDA context
n, path = int(sys.argv[1]), sys.argv[2]
host = numpy.empty(n // 4, dtype=numpy.float32)
with open(path, "rb", buffering=0) as f:
    f.readinto(memoryview(host).cast("B"))
t = torch.from_numpy(host).to("cuda"); torch.cuda.synchronize()
print(time.time() - spawned)
"""

CHECK_CELL = "print(t.device, abs(float(t[:1000].double().sum()) - checksum) < 1e-9)"


def setup_cells(size_gib: float) -> str:
    count = int(size_gib * GIB) // 4
    return (
        "import torch\n"
        f"t = torch.randn({count}, device='cuda')\n"
        "checksum = float(t[:1000].double().sum())\n"
        "meta = {'note': 'benchmark', 'n': t.numel()}\n"
        "torch.cuda.synchronize()\n"
    )


def floor(script: str, *args: str) -> float:
    out = subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def one_round(server: RunningServer, size_gib: float, scratch: Path) -> dict[str, float]:
    kernel_id = server.start_kernel("python3-gpu-whole")
    with server.channel(kernel_id, timeout=900) as chan:
        chan.execute(setup_cells(size_gib), timeout=900)
        start = time.perf_counter()
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        hibernate = time.perf_counter() - start
        assert reply.status == 200, reply
        checkpoint = float(reply.body["checkpoint"]["seconds"])
        start = time.perf_counter()
        result = chan.execute(CHECK_CELL, timeout=900)
        resume = time.perf_counter() - start
        assert not result.error and result.stdout.strip() == "cuda:0 True", result
    server.shutdown_kernel(kernel_id)
    nbytes = int(size_gib * GIB)
    path = scratch / "floor.bin"
    hibernate_floor = floor(HIBERNATE_FLOOR, str(nbytes), str(path))
    resume_floor = floor(RESUME_FLOOR, str(nbytes), str(path), repr(time.time()))
    path.unlink()
    return {
        "hibernate": hibernate,
        "checkpoint": checkpoint,
        "hibernate_floor": hibernate_floor,
        "resume": resume,
        "resume_floor": resume_floor,
    }


def device_name() -> str:
    probe = "import torch; print(torch.cuda.get_device_name(0), torch.__version__)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.stdout.strip() or "no CUDA device"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16", help="CUDA state sizes in GiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="elastic-gpu-bench-", dir=os.environ.get("BENCH_DIR")) as tmp:
        home = Path(tmp)
        checkpoints = home / "checkpoints"
        config = {"ElasticKernels": {"profiles": PROFILES, "checkpoint_root": str(checkpoints)}}
        server = start_server(home, config)
        try:
            scratch = checkpoints / "floor"
            scratch.mkdir(parents=True, exist_ok=True)
            for size in sizes:
                runs = [one_round(server, size, scratch) for _ in range(args.repeat)]
                med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                rows.append((size, med))
                print(f"done {size} GiB: {runs}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps([{"gib": s, **m} for s, m in rows], indent=1))
    machine = f"Device: {device_name()}; {os.cpu_count()} cores"
    print(f"{machine}; medians of {args.repeat} runs; warm page cache.\n")
    print_header(
        [
            "CUDA state",
            "hibernate",
            "of which the checkpoint",
            "floor: D2H + write + fsync",
            "hibernate / floor",
            "resume (to first reply)",
            "floor: new process, import torch, CUDA context, read, H2D",
            "resume / floor",
        ]
    )
    for size, m in rows:
        print_row(
            [
                f"{size:g} GiB",
                f"{m['hibernate']:.2f}",
                f"{m['checkpoint']:.2f}",
                f"{m['hibernate_floor']:.2f}",
                f"{m['hibernate'] / m['hibernate_floor']:.2f}×",
                f"{m['resume']:.2f}",
                f"{m['resume_floor']:.2f}",
                f"{m['resume'] / m['resume_floor']:.2f}×",
            ]
        )


if __name__ == "__main__":
    main()
