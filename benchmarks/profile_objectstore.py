"""Where a hibernation and a resume through an object store spend their time, step by step.

``bench_objectstore.py`` times the whole path through a server; this times each step the agent
takes, in isolation and on the same bytes, against the same real S3 server
(``tests/support/s3.py``), so the gap to a raw transfer can be attributed:

* hibernate: the checkpoint written to the local scratch folder (serialize, write, digest,
  fsync: ``writer.write_checkpoint``), then ``data.bin`` sent from its mapping
  (``transfer.upload_parts``, the path before the parts were streamed); the checkpoint written
  with its parts streamed as they are written (``transfer.PartStreamer``, no fsync: the agent's
  path now) up to the completed upload; beside the same bytes sent from memory;
* resume: ``data.bin`` read by ranged GETs into a scratch file, each piece digested and written as
  it arrives (``prefetch.receive``, the agent's path, here into a file rather than its memory
  file, so the restore below can read it by name), beside the same bytes
  read into anonymous memory; then ``reader.restore_checkpoint`` from the downloaded folder
  (manifest, the digest compared, the array mapped from the copy, as the agent does);
* encryption at rest: AES-256-CTR over the bytes part by part (``cipher.crypt_into``, what the
  kernel's upload costs with ``S3Checkpoints.encryption_key_files``).

Run: ``python benchmarks/profile_objectstore.py [--size 1024] [--repeat 3]`` (MiB; needs
``scripts/s3.sh build``). Prints a Markdown table of medians (seconds).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from kernelmgr.checkpoint import cipher
from kernelmgr.checkpoint.integrity import ChunkDigests
from kernelmgr.checkpoint.layout import DATA_FILE, MANIFEST_FILE, new_checkpoint_id
from kernelmgr.checkpoint.prefetch import receive
from kernelmgr.checkpoint.reader import restore_checkpoint
from kernelmgr.checkpoint.writer import write_checkpoint
from kernelmgr.objectstore import transfer
from kernelmgr.objectstore.client import Bucket
from tests.support.s3 import running_s3

MIB = 1024 * 1024
KEY = b"k" * 32
OWNER, KERNEL = "bench", "k-profile"


def timed(call: Callable[[], Any]) -> float:
    # Each step starts with no dirty pages left by the one before (the store writes to this disk
    # too): otherwise a step pays for the writeback of the previous step's gigabyte.
    os.sync()
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def upload(bucket: Bucket, key: str, view: memoryview) -> None:
    upload_id = bucket.start_upload(key)
    urls = bucket.part_urls(key, upload_id, transfer.part_count(len(view)), 900)
    bucket.complete_upload(key, upload_id, transfer.upload_parts(urls, view))


def upload_file(bucket: Bucket, key: str, path: Path) -> None:
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as region:
        view = memoryview(region)
        try:
            upload(bucket, key, view)
        finally:
            view.release()


def download_anonymous(url: str, size: int) -> None:
    with mmap.mmap(-1, size) as region:
        view = memoryview(region)
        try:
            transfer.download(url, view)
        finally:
            view.release()


def download_file(url: str, path: Path, size: int, algorithm: str) -> str:
    """As the agent downloads (``prefetch.receive``): pieces digested and written into a file."""
    digests = ChunkDigests(algorithm, size)
    with open(path, "w+b") as handle:
        receive(url, size, handle.fileno(), digests)
    return digests.hexdigest()


def stream(bucket: Bucket, folder: Path, array: Any, size: int) -> None:
    """As the agent checkpoints to an object store: parts sent while the checkpoint is written."""
    checkpoint_id = new_checkpoint_id()
    key = f"ck/{checkpoint_id}/data.bin"
    upload_id = bucket.start_upload(key)
    urls = bucket.part_urls(key, upload_id, transfer.part_count(size + size // 8), 900)
    streamer = transfer.PartStreamer(urls, transfer.DEFAULT_PART_SIZE)
    manifest = write_checkpoint(
        folder,
        {"x": array},
        key=KEY,
        owner=OWNER,
        kernel_id=KERNEL,
        checkpoint_id=checkpoint_id,
        on_settled=streamer.settled,
        durable=False,
    )
    fd = os.open(folder / checkpoint_id / DATA_FILE, os.O_RDONLY)
    try:
        etags = streamer.finish(manifest.data_bytes, fd)
    finally:
        os.close(fd)
    bucket.complete_upload(key, upload_id, etags)


def one_round(bucket: Bucket, work: Path, size_mib: int) -> dict[str, float]:
    import numpy as np

    array = np.random.default_rng(0).random(size_mib * MIB // 8)
    raw = memoryview(array).cast("B")
    folder = work / "kernel"
    row: dict[str, float] = {}
    manifest: Any = None

    def write() -> None:
        nonlocal manifest
        manifest = write_checkpoint(folder, {"x": array}, key=KEY, owner=OWNER, kernel_id=KERNEL)

    row["write locally"] = timed(write)
    data = folder / manifest.checkpoint_id / DATA_FILE
    row["upload from the file"] = timed(lambda: upload_file(bucket, "ck/data.bin", data))
    row["write, streaming the parts"] = timed(lambda: stream(bucket, work / "streamed", array, raw.nbytes))
    row["raw upload"] = timed(lambda: upload(bucket, "raw/data.bin", raw))
    size = data.stat().st_size
    url = bucket.presign("GET", "ck/data.bin", 900)
    row["raw download"] = timed(lambda: download_anonymous(url, size))
    restored = work / "download" / manifest.checkpoint_id
    restored.mkdir(parents=True)
    shutil.copy(folder / manifest.checkpoint_id / MANIFEST_FILE, restored / MANIFEST_FILE)
    digest = ""

    def download() -> None:
        nonlocal digest
        digest = download_file(url, restored / DATA_FILE, size, manifest.digest_algorithm)

    row["download to a file, digested"] = timed(download)
    namespace: dict[str, Any] = {}
    row["restore from it"] = timed(
        lambda: restore_checkpoint(
            work / "download",
            namespace,
            key=KEY,
            owner=OWNER,
            kernel_id=KERNEL,
            expected_checkpoint=manifest.checkpoint_id,
            map_buffers=True,  # as the agent restores a downloaded copy
            data_digest=digest,
        )
    )
    assert namespace["x"].nbytes == array.nbytes
    data_key = cipher.data_key(b"c" * 32)
    part = transfer.DEFAULT_PART_SIZE
    buffer = memoryview(bytearray(part))

    def encrypt() -> None:  # as the agent encrypts an upload's parts, one reused buffer
        for offset in range(0, len(raw), part):
            piece = raw[offset : offset + part]
            cipher.crypt_into(data_key, offset, piece, buffer[: len(piece)])

    row["encrypt (AES-CTR)"] = timed(encrypt)
    shutil.rmtree(folder)
    shutil.rmtree(work / "streamed")
    shutil.rmtree(work / "download")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="state size in MiB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="profile-objectstore-") as tmp:
        work = Path(tmp)
        with running_s3(work / "s3") as s3:
            bucket = s3.bucket("profile")
            bucket.create()
            rows = [one_round(bucket, work, args.size) for _ in range(args.repeat)]
    steps = list(rows[0])
    print_header(["state (MiB)", *steps])
    print_row([str(args.size), *(f"{statistics.median(r[s] for r in rows):.2f}" for s in steps)])


if __name__ == "__main__":
    main()
