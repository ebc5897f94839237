"""Hibernate and resume against their floors, side by side in one run.

For each state size (a NumPy array of that many bytes, plus a few small variables):

* hibernate: ``POST /api/elastic/kernels/{id}/hibernate`` (checkpoint + stop + release),
  beside its floor, a raw write of the same bytes with fsync to the same directory;
* resume: hibernated -> the first cell's reply through the kernel's websocket, beside its
  floor, a cold kernel start (start + first reply) plus a raw read of the same bytes, and
  beside what users do today: a fresh kernel plus re-running the cells that built the state
  (here: generating the array, which is far cheaper than the loading or training that builds
  real state, so this column flatters the re-run);
* peak extra memory of the kernel process while it checkpoints (VmHWM after the peak is
  reset through /proc/<pid>/clear_refs, minus the resident size before).

Run: ``python benchmarks/bench_hibernate.py [--sizes 0,100,1024] [--repeat 3]`` (sizes in
MiB). Prints a Markdown table of medians and ratios for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from tests.support.server import RunningServer, start_server

MIB = 1024 * 1024
PROFILES = {"small": {"gpu_fraction": 0.25, "memory_mib": 10240}}
INVENTORY = [{"uuid": "GPU-bench-0000", "name": "Declared benchmark GPU", "memory_mib": 40960}]


def build_cells(size_mib: int) -> str:
    count = size_mib * MIB // 8
    return (
        "import numpy as np\n"
        f"x = np.random.default_rng(0).random({count})\n"
        "meta = {'rows': len(x), 'note': 'benchmark'}\n"
        "labels = [str(i) for i in range(1000)]\n"
    )


def raw_write(directory: Path, nbytes: int) -> float:
    payload = os.urandom(min(nbytes, MIB)) if nbytes else b""
    path = directory / "raw-floor.bin"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        written = 0
        while written < nbytes:
            chunk = payload[: min(len(payload), nbytes - written)]
            handle.write(chunk)
            written += len(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    fd = os.open(directory, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - start


def raw_read(directory: Path, nbytes: int, fresh: bool) -> float:
    """Read the floor file into memory: ``fresh`` memory (a new anonymous mapping, faulted in
    by the read, as a resumed kernel's memory must be) or a buffer already touched."""
    path = directory / "raw-floor.bin"
    if not fresh:
        buffer: Any = bytearray(max(nbytes, 1))
    start = time.perf_counter()
    if fresh:
        buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with open(path, "rb", buffering=0) as handle:
        view = memoryview(buffer)
        done = 0
        while done < nbytes:
            got = handle.readinto(view[done : done + 64 * MIB])
            if not got:
                break
            done += got
        view.release()
    return time.perf_counter() - start


def rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def drop_caches() -> bool:
    """Evict the page cache (root only), so reads come from the disk as after a long idle."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3")
        return True
    except OSError:
        return False


class PeakWatcher(threading.Thread):
    """Polls a process's VmHWM until it exits; VmHWM only grows, so the last read is the peak."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_kib = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak_kib = max(self.peak_kib, rss_kib(self.pid, "VmHWM"))
            except OSError:
                return
            time.sleep(0.005)


def one_round(server: RunningServer, size_mib: int, scratch: Path, cold: bool) -> dict[str, float]:
    nbytes = size_mib * MIB
    kernel_id = server.start_kernel("python3-gpu-small")
    with server.channel(kernel_id, timeout=600) as chan:
        chan.execute(build_cells(size_mib), timeout=600)
        pid = int(chan.execute("import os; print(os.getpid())").stdout)
        before = rss_kib(pid, "VmRSS")
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM so it measures the checkpoint's own peak
        # The floor is written here, in the memory state the checkpoint meets: on a VM that
        # hands free memory back to its host (virtio-balloon free page reporting, as on the
        # machine of docs/benchmarks.md), new pages cost from 0.1 s per GiB (memory freed
        # milliseconds before) to over 1.5 s (memory idle for seconds). After the kernel's
        # shutdown, where it was measured before, it got the pages the shutdown had just freed.
        write_floor = raw_write(scratch, nbytes)
        watcher = PeakWatcher(pid)
        watcher.start()
        start = time.perf_counter()
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        hibernate = time.perf_counter() - start
        watcher.stop.set()
        watcher.join()
        assert reply.status == 200, reply
        checkpoint_seconds = float(reply.body["checkpoint"]["seconds"])  # the agent's own write time
        peak_extra = max(0, watcher.peak_kib - before)
        if cold:
            drop_caches()
        start = time.perf_counter()
        result = chan.execute("print(x.shape)", timeout=600)
        resume = time.perf_counter() - start
        assert not result.error, result.error
    server.shutdown_kernel(kernel_id)

    if cold:
        drop_caches()  # the floor's kernel start and read are as cold as the resume's
    start = time.perf_counter()
    floor_kernel = server.start_kernel("python3-gpu-small")
    server.execute(floor_kernel, "1")
    cold_start = time.perf_counter() - start
    read_fresh = raw_read(scratch, nbytes, fresh=True)
    if cold:
        drop_caches()  # the second read must not find the first one's pages cached
    read_touched = raw_read(scratch, nbytes, fresh=False)
    (scratch / "raw-floor.bin").unlink()
    server.shutdown_kernel(floor_kernel)

    start = time.perf_counter()
    fresh = server.start_kernel("python3-gpu-small")
    server.execute(fresh, build_cells(size_mib) + "print(x.shape)", timeout=600)
    rerun = time.perf_counter() - start
    server.shutdown_kernel(fresh)
    return {
        "hibernate": hibernate,
        "checkpoint": checkpoint_seconds,
        "write_floor": write_floor,
        "resume": resume,
        "resume_floor": cold_start + read_fresh,
        "resume_floor_touched": cold_start + read_touched,
        "rerun": rerun,
        "peak_extra_mib": peak_extra / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,100,1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--cold", action="store_true", help="drop the page cache before each resume and raw read (root only)"
    )
    args = parser.parse_args()
    if args.cold and not drop_caches():
        parser.error("--cold needs root (writes /proc/sys/vm/drop_caches)")
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        home = Path(tmp)
        checkpoints = home / "checkpoints"
        config = {
            "ElasticKernels": {
                "profiles": PROFILES,
                "gpu_inventory": INVENTORY,
                "checkpoint_root": str(checkpoints),
            }
        }
        server = start_server(home, config)
        try:
            scratch = checkpoints / "floor"
            scratch.mkdir(parents=True, exist_ok=True)
            rows = []
            for size in sizes:
                runs = [one_round(server, size, scratch, args.cold) for _ in range(args.repeat)]
                med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                rows.append((size, med))
                print(f"done {size} MiB: {med}", file=sys.stderr)
        finally:
            server.stop()
    cache = "page cache dropped before each resume and raw read" if args.cold else "warm page cache"
    print(f"Machine: {os.cpu_count()} cores; medians of {args.repeat} runs; {cache}; times in seconds.\n")
    headers = [
        "state",
        "hibernate",
        "of which the checkpoint",
        "raw write+fsync",
        "hibernate / raw",
        "checkpoint / raw",
        "resume (to first reply)",
        "cold start + raw read into new memory",
        "ratio",
        "cold start + raw read into touched memory",
        "ratio",
        "fresh kernel + re-run cells",
        "resume / re-run",
        "peak extra memory",
    ]
    print_header(headers)
    for size, m in rows:
        cells = [
            f"{size} MiB",
            f"{m['hibernate']:.3f}",
            f"{m['checkpoint']:.3f}",
            f"{m['write_floor']:.3f}",
            f"{m['hibernate'] / max(m['write_floor'], 1e-9):.2f}×",
            f"{m['checkpoint'] / max(m['write_floor'], 1e-9):.2f}×",
            f"{m['resume']:.3f}",
            f"{m['resume_floor']:.3f}",
            f"{m['resume'] / m['resume_floor']:.2f}×",
            f"{m['resume_floor_touched']:.3f}",
            f"{m['resume'] / m['resume_floor_touched']:.2f}×",
            f"{m['rerun']:.3f}",
            f"{m['resume'] / m['rerun']:.2f}×",
            f"{m['peak_extra_mib']:.0f} MiB",
        ]
        print_row(cells)


if __name__ == "__main__":
    main()
