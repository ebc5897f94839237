"""Where a CUDA resume's time goes: the restore report's timings beside simple floors, one run.

Companion of ``bench_gpu_resume.py`` (whose floors are tighter: use it for the ratios of
issue #10). This one prints, per size, the restore report's ``timings`` (read + digest, wait for
the prewarmed torch import, unpickle with the device copy) next to the parts of deliberately
simple floors (``x.cpu()`` into fresh pageable memory; a plain read into fresh memory), to
compare two versions of the code in one device call.

For each size, in one run on the GPU machine:

* a real kernel (jupyter_server + kernelmgr + ipykernel with the in-kernel agent) builds a
  CUDA tensor of that many bytes (or, for ``cpu:`` sizes, a NumPy array);
* hibernate: ``POST /api/elastic/kernels/{id}/hibernate``, beside its floor measured in a
  separate process on the same bytes: device-to-host copy + write + fsync (file and directory);
* resume: the next cell's reply after hibernation, beside its floor: a fresh process that
  imports torch, creates the CUDA context, reads the same bytes and copies them to the GPU
  (for CPU arrays: a cold kernel start plus a raw read into new memory, as bench_hibernate.py);
  a cold kernel start (start + first reply) is shown too, since a resume pays one.

Run (GPU machine): ``python benchmarks/bench_gpu_restore_timings.py --sizes 1,4,16,cpu:1``
(sizes in GiB). Page cache warm (the checkpoint was just written). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_hibernate import raw_read, raw_write
from benchmarks.markdown import print_header, print_row
from tests.support.server import RunningServer, start_server

GIB = 1024**3

HIBERNATE_FLOOR = """
import os, sys, time, torch
n, path = int(sys.argv[1]), sys.argv[2]
x = torch.empty(n, dtype=torch.uint8, device="cuda").random_(); torch.cuda.synchronize()
t0 = time.perf_counter()
host = x.cpu()
t1 = time.perf_counter()
with open(path, "wb", buffering=0) as f:
    view = memoryview(host.numpy())
    done = 0
    while done < n:
        done += f.write(view[done : done + (256 << 20)])
    os.fsync(f.fileno())
fd = os.open(os.path.dirname(path), os.O_RDONLY); os.fsync(fd); os.close(fd)
t2 = time.perf_counter()
print({"d2h": t1 - t0, "write_fsync": t2 - t1})
"""

RESUME_FLOOR = """
import sys, time
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
n, path = int(sys.argv[1]), sys.argv[2]
host = torch.empty(n, dtype=torch.uint8)
with open(path, "rb", buffering=0) as f:
    view = memoryview(host.numpy()); done = 0
    while done < n:
        done += f.readinto(view[done : done + (256 << 20)])
t2 = time.perf_counter()
x = host.cuda(); torch.cuda.synchronize()
t3 = time.perf_counter()
print({"import_ctx": t1 - t0, "read": t2 - t1, "h2d": t3 - t2})
"""


def floor_process(code: str, nbytes: int, path: Path) -> tuple[float, dict[str, float]]:
    """Run a floor script in a fresh process; wall time from spawn to exit, and its parts."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, str(nbytes), str(path)], check=True, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    parts: dict[str, float] = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return wall, parts


def build_cell(nbytes: int, cuda: bool) -> str:
    if cuda:
        return (
            "import torch\n"
            f"x = torch.empty({nbytes}, dtype=torch.uint8, device='cuda').random_()\n"
            "check = int(x[:: 1 << 20].sum()); torch.cuda.synchronize()\n"
        )
    return (
        "import numpy as np\n"
        f"x = np.random.default_rng(0).integers(0, 255, {nbytes}, dtype=np.uint8)\n"
        "check = int(x[:: 1 << 20].sum())\n"
    )


def one_size(server: RunningServer, label: str, scratch: Path) -> dict[str, float | str]:
    cuda = not label.startswith("cpu:")
    nbytes = int(float(label.removeprefix("cpu:")) * GIB)
    kernel_id = server.start_kernel("python3-gpu-whole")
    with server.channel(kernel_id, timeout=900) as chan:
        result = chan.execute(build_cell(nbytes, cuda), timeout=900)
        assert not result.error, result.error
        start = time.perf_counter()
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        hibernate = time.perf_counter() - start
        assert reply.status == 200, reply
        checkpoint_seconds = float(reply.body["checkpoint"]["seconds"])
        start = time.perf_counter()
        result = chan.execute("print(int(x[:: 1 << 20].sum()) == check, getattr(x, 'device', 'cpu'))", 900)
        resume = time.perf_counter() - start
        assert not result.error, result.error
        assert result.stdout.split()[0] == "True", result.stdout
        report = server.execute(
            kernel_id,
            "import json, kernelmgr.checkpoint.agent as a; print(json.dumps(a.last_restore_report()))",
        )
    server.shutdown_kernel(kernel_id)
    restore_report = json.loads(report.strip().splitlines()[-1]) or {}

    start = time.perf_counter()
    floor_kernel = server.start_kernel("python3-gpu-whole")
    server.execute(floor_kernel, "1")
    cold_start = time.perf_counter() - start
    server.shutdown_kernel(floor_kernel)

    path = scratch / "floor.bin"
    if cuda:
        hib_floor, hib_parts = floor_process(HIBERNATE_FLOOR, nbytes, path)
        res_floor, res_parts = floor_process(RESUME_FLOOR, nbytes, path)
        parts = {f"hib_{k}": v for k, v in hib_parts.items()}
        parts.update({f"res_{k}": v for k, v in res_parts.items()})
    else:
        hib_floor = raw_write(scratch, nbytes)
        res_floor = cold_start + raw_read(scratch, nbytes, fresh=True)
        parts = {}
        path = scratch / "raw-floor.bin"
    path.unlink()
    timings = restore_report.get("timings") or {}
    return {
        "label": f"{label.removeprefix('cpu:')} GiB {'CUDA tensor' if cuda else 'NumPy array (CPU)'}",
        "hibernate": hibernate,
        "checkpoint": checkpoint_seconds,
        "hib_floor": hib_floor,
        "resume": resume,
        "res_floor": res_floor,
        "cold_start": cold_start,
        "parts": json.dumps({k: round(v, 3) for k, v in {**parts, **timings}.items()}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,cpu:1", help="GiB, comma-separated; cpu:N for NumPy")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="elastic-gpubench-") as tmp:
        home = Path(tmp)
        checkpoints = home / "checkpoints"
        profiles = {"whole": {"gpu_fraction": 1}}
        config = {"ElasticKernels": {"profiles": profiles, "checkpoint_root": str(checkpoints)}}
        server = start_server(home, config)
        try:
            scratch = checkpoints / "floor"
            scratch.mkdir(parents=True, exist_ok=True)
            for label in args.sizes.split(","):
                row = one_size(server, label, scratch)
                print(f"done {label}: {row}", file=sys.stderr, flush=True)
                rows.append(row)
        finally:
            server.stop()
    print(f"Machine: {os.cpu_count()} cores; one run per size; warm page cache; times in seconds.\n")
    print_header(
        [
            "state",
            "hibernate",
            "of which checkpoint",
            "floor: D2H+write+fsync",
            "hibernate / floor",
            "resume (to first reply)",
            "floor: import torch+ctx+read+H2D",
            "resume / floor",
            "cold kernel start",
            "floor parts and restore timings",
        ]
    )
    for r in rows:
        assert isinstance(r["hibernate"], float) and isinstance(r["resume"], float)
        hf, rf = float(r["hib_floor"]), float(r["res_floor"])
        print_row(
            [
                str(r["label"]),
                f"{r['hibernate']:.2f}",
                f"{float(r['checkpoint']):.2f}",
                f"{hf:.2f}",
                f"{r['hibernate'] / hf:.2f}×",
                f"{r['resume']:.2f}",
                f"{rf:.2f}",
                f"{r['resume'] / rf:.2f}×",
                f"{float(r['cold_start']):.2f}",
                f"`{r['parts']}`",
            ]
        )


if __name__ == "__main__":
    main()
