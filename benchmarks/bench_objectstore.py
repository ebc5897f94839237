"""Hibernate and resume through an S3-compatible object store, beside a raw upload and download of
the same bytes with the same client, side by side in one run.

For each state size (a NumPy array of that many MiB, plus a few small variables), through the real
path (a jupyter_server with the extension and ``ElasticKernels.checkpoint_store = "s3"``, a real
ipykernel kernel, a real S3 server from ``tests/support/s3.py``):

* hibernate: ``POST /api/elastic/kernels/{id}/hibernate`` (the kernel's size estimate, the
  upload started, the checkpoint written to the local scratch folder while each part of
  ``data.bin`` goes to the store as soon as it is written, the upload completed, the manifest
  committed, the kernel stopped), beside its floor: the same number of bytes sent with the same
  client (``kernelmgr.objectstore.transfer.upload_parts``: same part size, same threads) to the
  same server, through presigned part URLs of a multipart upload, completed;
* resume: hibernated -> the first cell's reply (the kernel started, ``data.bin`` read back by
  parallel ranged GETs, each range digested as it arrives, verified, unpickled), once the local
  copy is pruned (so it is read from the bucket), beside its floor: the same bytes read with
  the same client (``transfer.download``, with the GIL switch interval the kernel's download
  sets) into fresh memory;
* with ``--warm-pool``, the same resume on a second server whose resumes take a warm process
  (``ElasticKernels.warm_pool``, preloading numpy), where the download starts as the warm process
  becomes the kernel, before ipykernel runs (``kernelmgr.checkpoint.prefetch``; a cold resume
  starts it too, through ``kernelmgr.checkpoint.launch``, before ipykernel's imports); with
  ``--no-prefetch-too``, also on servers with ``ELASTIC_RESTORE_PREFETCH=0`` (``cold-nopf``, and
  ``warm-nopf`` with ``--warm-pool``: the agent downloads once it has loaded, as before); with
  ``--thread-too``, also on servers with ``ELASTIC_RESTORE_PREFETCH=thread`` (``cold-thread``,
  ``warm-thread``: the prefetch on a thread of the kernel process, sharing its GIL, as before it
  ran in a child process of its own). Each
  resume's restore report (how long before the agent the download began, its own time, what the
  restore still waited) goes to stderr.

The table also gives the CPU seconds the whole machine spent on each resume and on the raw
download (``/proc/stat``: store, server, kernel and download together): on a machine whose cores
the raw download already keeps busy, a resume's time follows its CPU.

Each timed step starts after an ``os.sync()``: the store writes to this machine's disk too, and a
step would otherwise pay for the writeback of the gigabyte the step before it wrote. The load
average is printed before and after (the machine is shared).

Run: ``python benchmarks/bench_objectstore.py [--sizes 1024] [--repeat 3] [--encrypt] [--warm-pool
[--no-prefetch-too] [--thread-too]]`` (sizes in MiB; ``--encrypt``: encryption at rest on, the raw floor stays
plaintext; needs ``scripts/s3.sh build``). Prints a Markdown table of medians and ratios for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from kernelmgr.checkpoint.prefetch import SWITCH_INTERVAL
from kernelmgr.objectstore import transfer
from kernelmgr.objectstore.client import Bucket
from tests.support.s3 import S3Server, running_s3
from tests.support.server import RunningServer, start_server, wait_for

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
PROFILES = {"small": {"gpu_fraction": 0.25, "memory_mib": 10240}}
INVENTORY = [{"uuid": "GPU-bench-0000", "name": "Declared benchmark GPU", "memory_mib": 40960}]
ID_ENV, KEY_ENV = "ELASTIC_BENCH_S3_ACCESS_KEY", "ELASTIC_BENCH_S3_SECRET_KEY"
BUCKET = "bench-checkpoints"


def build_cells(size_mib: int) -> str:
    count = size_mib * MIB // 8
    return (
        "import numpy as np\n"
        f"x = np.random.default_rng(0).random({count})\n"
        "meta = {'rows': len(x), 'note': 'benchmark'}\n"
    )


def start(
    home: Path, s3: S3Server, encrypt: bool = False, warm: bool = False, prefetch: str = ""
) -> RunningServer:
    """``prefetch``: ``ELASTIC_RESTORE_PREFETCH`` (empty: the default, a child process)."""
    key_files = []
    if encrypt:  # encryption at rest: a master key file, as the Helm chart mounts one
        home.mkdir(parents=True, exist_ok=True)
        master = home / "master-key"
        master.write_text(os.urandom(32).hex())
        master.chmod(0o600)
        key_files.append(str(master))
    config: dict[str, Any] = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "checkpoint_root": str(home / "scratch"),
            "checkpoint_store": "s3",
            "checkpoint_timeout": 1800,
            "resume_timeout": 1800,
            # Resumes take a warm process: a user's frameworks imported ahead, as a lab would.
            **(
                {
                    "warm_pool": {
                        "python3": {"size": 1, "preload": ["numpy"], "memory_mib": 4096, "starts": False}
                    }
                }
                if warm
                else {}
            ),
        },
        "S3Checkpoints": {
            "endpoint": s3.endpoint,
            "bucket": BUCKET,
            "create_bucket": True,
            "access_key_id_env": ID_ENV,
            "secret_access_key_env": KEY_ENV,
            "encryption_key_files": key_files,
        },
    }
    # The server and its kernels run this tree's code, not whatever copy is installed.
    env = {ID_ENV: s3.admin.access_key, KEY_ENV: s3.admin.secret_key, "PYTHONPATH": str(ROOT)}
    if prefetch:
        env["ELASTIC_RESTORE_PREFETCH"] = prefetch
    server = start_server(home, config, env_extra=env)
    if warm:
        wait_for(lambda: warm_ready(server), timeout=600, what="the warm pool to fill")
    return server


def warm_ready(server: RunningServer) -> bool:
    """The pool holds a ready process (``elastic_warm_pool_processes{state="ready"}``)."""
    for line in server.text("/metrics").splitlines():
        match = re.match(r"^elastic_warm_pool_processes\{(.*)\} (\S+)$", line)
        if match and 'state="ready"' in match.group(1) and float(match.group(2)) >= 1:
            return True
    return False


def busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy since boot (``/proc/stat``): what a
    step costs the whole machine, store and kernel included, where its time on 2 cores is bound
    by the CPU rather than by the network."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def raw_upload(bucket: Bucket, nbytes: int) -> float:
    """The same bytes through the same client: a multipart upload by presigned part URLs, completed."""
    data = memoryview(os.urandom(nbytes))
    key = "raw/floor.bin"
    os.sync()
    start_t = time.perf_counter()
    upload_id = bucket.start_upload(key)
    count = transfer.part_count(nbytes)
    urls = bucket.part_urls(key, upload_id, count, 900)
    etags = transfer.upload_parts(urls, data)
    bucket.complete_upload(key, upload_id, etags)
    return time.perf_counter() - start_t


def raw_download(bucket: Bucket, nbytes: int) -> tuple[float, float]:
    """Seconds, and the machine's CPU seconds (:func:`busy_seconds`)."""
    url = bucket.presign("GET", "raw/floor.bin", 900)
    os.sync()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)  # as the kernel's download sets it (prefetch.download)
    busy, start_t = busy_seconds(), time.perf_counter()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(buffer)[:nbytes]
    transfer.download(url, view)
    elapsed = time.perf_counter() - start_t
    busy = busy_seconds() - busy
    sys.setswitchinterval(interval)
    view.release()
    buffer.close()
    return elapsed, busy


def local_checkpoints(home: Path) -> list[Path]:
    return [p for p in (home / "scratch").glob("*/*/ckpt-*")]


def one_run(
    server: RunningServer, home: Path, size_mib: int, warm: bool = False
) -> tuple[float, float, float]:
    """The hibernation's and the resume's seconds, and the resume's CPU seconds (the machine's)."""
    kernel_id = server.start_kernel("python3-gpu-small")
    try:
        server.execute(kernel_id, build_cells(size_mib), timeout=1800)
        if warm:  # the resume must find a ready process (the previous run's was used)
            wait_for(lambda: warm_ready(server), timeout=600, what="the warm pool to refill")
        os.sync()
        start_t = time.perf_counter()
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        hibernate = time.perf_counter() - start_t
        assert reply.status == 200, reply
        wait_for(lambda: not local_checkpoints(home), timeout=600, what="the local copy to be pruned")
        os.sync()
        busy, start_t = busy_seconds(), time.perf_counter()
        out = server.execute(kernel_id, "print(len(x))", timeout=1800)
        resume = time.perf_counter() - start_t
        busy = busy_seconds() - busy
        assert out.strip() == str(size_mib * MIB // 8), out
        report = json.loads(
            (home / "scratch" / reply.body["owner"] / kernel_id / "restore-report.json").read_text()
        )
        print(
            f"{home.name}: resume {resume:.2f} s ({busy:.2f} CPU s), restore {report['seconds']} s, "
            f"timings {report.get('timings')}, prefetch {report.get('prefetch')}",
            file=sys.stderr,
        )
        return hibernate, resume, busy
    finally:
        server.request("DELETE", f"/api/kernels/{kernel_id}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--encrypt", action="store_true", help="with S3Checkpoints.encryption_key_files")
    parser.add_argument("--warm-pool", action="store_true", help="also resume through a warm pool")
    parser.add_argument(
        "--no-prefetch-too",
        action="store_true",
        help="also resume without the prefetch (cold, and warm with --warm-pool)",
    )
    parser.add_argument(
        "--thread-too",
        action="store_true",
        help="also resume with the prefetch on a thread of the kernel (cold, and warm with --warm-pool)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-objectstore-") as tmp:
        home = Path(tmp)
        with running_s3(home / "s3") as s3:
            servers = {"cold": start(home / "cold", s3, args.encrypt)}
            variants = {
                "nopf": "0" if args.no_prefetch_too else "",
                "thread": "thread" if args.thread_too else "",
            }
            for name, value in variants.items():
                if value:
                    servers[f"cold-{name}"] = start(home / f"cold-{name}", s3, args.encrypt, prefetch=value)
            if args.warm_pool:
                servers["warm"] = start(home / "warm", s3, args.encrypt, warm=True)
                for name, value in variants.items():
                    if value:
                        servers[f"warm-{name}"] = start(
                            home / f"warm-{name}", s3, args.encrypt, warm=True, prefetch=value
                        )
            bucket = s3.bucket(BUCKET)
            paths = list(servers)
            try:
                print_header(
                    ["state (MiB)", "hibernate (s)", "raw upload (s)", "ratio"]
                    + [f"resume, {path} (s)" for path in paths]
                    + ["raw download (s)"]
                    + [f"ratio, {path}" for path in paths]
                    + [f"CPU, {path} (s)" for path in paths]
                    + ["CPU, raw download (s)"]
                )
                for size in sizes:
                    hib: list[float] = []
                    res: dict[str, list[float]] = {path: [] for path in paths}
                    cpu: dict[str, list[float]] = {path: [] for path in paths}
                    up, down, down_cpu = [], [], []
                    for _ in range(args.repeat):
                        for path, server in servers.items():  # alternated, run after run
                            h, r, c = one_run(server, home / path, size, warm=path.startswith("warm"))
                            if path == "cold":
                                hib.append(h)
                            res[path].append(r)
                            cpu[path].append(c)
                        up.append(raw_upload(bucket, size * MIB))
                        seconds, busy = raw_download(bucket, size * MIB)
                        down.append(seconds)
                        down_cpu.append(busy)
                    mh = statistics.median(hib)
                    mu, md = statistics.median(up), statistics.median(down)
                    mr = {path: statistics.median(times) for path, times in res.items()}
                    print_row(
                        [str(size), f"{mh:.2f}", f"{mu:.2f}", f"{mh / mu:.2f}x"]
                        + [f"{mr[path]:.2f}" for path in paths]
                        + [f"{md:.2f}"]
                        + [f"{mr[path] / md:.2f}x" for path in paths]
                        + [f"{statistics.median(cpu[path]):.2f}" for path in paths]
                        + [f"{statistics.median(down_cpu):.2f}"]
                    )
            finally:
                for server in servers.values():
                    server.stop()
    print("load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), file=sys.stderr)


if __name__ == "__main__":
    main()
