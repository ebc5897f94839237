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
  the same client (``transfer.download``) into fresh memory.

Each timed step starts after an ``os.sync()``: the store writes to this machine's disk too, and a
step would otherwise pay for the writeback of the gigabyte the step before it wrote. The load
average is printed before and after (the machine is shared).

Run: ``python benchmarks/bench_objectstore.py [--sizes 1024] [--repeat 3] [--encrypt]`` (sizes in
MiB; ``--encrypt``: encryption at rest on, the raw floor stays plaintext; needs
``scripts/s3.sh build``). Prints a Markdown table of medians and ratios for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from kernelmgr.objectstore import transfer
from kernelmgr.objectstore.client import Bucket
from tests.support.s3 import S3Server, running_s3
from tests.support.server import RunningServer, start_server, wait_for

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


def start(home: Path, s3: S3Server, encrypt: bool = False) -> RunningServer:
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
    return start_server(home, config, env_extra={ID_ENV: s3.admin.access_key, KEY_ENV: s3.admin.secret_key})


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


def raw_download(bucket: Bucket, nbytes: int) -> float:
    url = bucket.presign("GET", "raw/floor.bin", 900)
    os.sync()
    start_t = time.perf_counter()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(buffer)[:nbytes]
    transfer.download(url, view)
    elapsed = time.perf_counter() - start_t
    view.release()
    buffer.close()
    return elapsed


def local_checkpoints(home: Path) -> list[Path]:
    return [p for p in (home / "scratch").glob("*/*/ckpt-*")]


def one_run(server: RunningServer, home: Path, size_mib: int) -> tuple[float, float]:
    kernel_id = server.start_kernel("python3-gpu-small")
    try:
        server.execute(kernel_id, build_cells(size_mib), timeout=1800)
        os.sync()
        start_t = time.perf_counter()
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        hibernate = time.perf_counter() - start_t
        assert reply.status == 200, reply
        wait_for(lambda: not local_checkpoints(home), timeout=600, what="the local copy to be pruned")
        os.sync()
        start_t = time.perf_counter()
        out = server.execute(kernel_id, "print(len(x))", timeout=1800)
        resume = time.perf_counter() - start_t
        assert out.strip() == str(size_mib * MIB // 8), out
        return hibernate, resume
    finally:
        server.request("DELETE", f"/api/kernels/{kernel_id}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--encrypt", action="store_true", help="with S3Checkpoints.encryption_key_files")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-objectstore-") as tmp:
        home = Path(tmp)
        with running_s3(home / "s3") as s3:
            server = start(home / "server", s3, args.encrypt)
            bucket = s3.bucket(BUCKET)
            try:
                print_header(
                    [
                        "state (MiB)",
                        "hibernate (s)",
                        "raw upload (s)",
                        "ratio",
                        "resume (s)",
                        "raw download (s)",
                        "ratio",
                    ]
                )
                for size in sizes:
                    hib, res, up, down = [], [], [], []
                    for _ in range(args.repeat):
                        h, r = one_run(server, home / "server", size)
                        hib.append(h)
                        res.append(r)
                        up.append(raw_upload(bucket, size * MIB))
                        down.append(raw_download(bucket, size * MIB))
                    mh, mr = statistics.median(hib), statistics.median(res)
                    mu, md = statistics.median(up), statistics.median(down)
                    print_row(
                        [
                            str(size),
                            f"{mh:.2f}",
                            f"{mu:.2f}",
                            f"{mh / mu:.2f}x",
                            f"{mr:.2f}",
                            f"{md:.2f}",
                            f"{mr / md:.2f}x",
                        ]
                    )
            finally:
                server.stop()
    print("load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), file=sys.stderr)


if __name__ == "__main__":
    main()
