"""The kernel's side of the object store: bytes through presigned URLs, in parallel, no credential.

A checkpoint's data goes up as the parts of a multipart upload (one presigned URL per part, sent
by several threads at once) and comes down as ranged GETs of one presigned URL into a buffer the
caller owns, each range read straight into its place (no second copy). Progress is reported in
bytes so the existing "restoring N of M MiB" figures keep working.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

#: S3 refuses parts under 5 MiB (but the last); bigger parts mean fewer requests.
DEFAULT_PART_SIZE = 32 * 1024 * 1024
DEFAULT_WORKERS = 4
Progress = Callable[[int], None]
#: ``(offset, piece) -> bytes to send``: e.g. encryption at the piece's offset.
Transform = Callable[[int, memoryview], bytes | bytearray | memoryview]
#: ``(offset, range) -> None``: run on each range once it has arrived (e.g. decryption in place).
Arrived = Callable[[int, memoryview], None]


class TransferError(Exception):
    """A presigned request failed: which, and the store's answer."""


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.netloc, timeout=timeout), parts.path + (f"?{parts.query}" if parts.query else "")


def put(url: str, data: bytes | bytearray | memoryview, timeout: float = 300.0) -> str:
    """PUT ``data`` to a presigned URL; the ETag the store gave it."""
    conn, target = _connection(url, timeout)
    try:
        conn.request("PUT", target, body=data, headers={"Content-Length": str(len(data))})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise TransferError(f"PUT {urllib.parse.urlsplit(url).path}: {resp.status} {body[:300]!r}")
    return (resp.getheader("ETag") or "").strip('"')


def get(url: str, timeout: float = 300.0) -> bytes | None:
    """The bytes behind a presigned GET URL; ``None`` when there is no such object."""
    conn, target = _connection(url, timeout)
    try:
        conn.request("GET", target)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status == 404:
        return None
    if resp.status != 200:
        raise TransferError(f"GET {urllib.parse.urlsplit(url).path}: {resp.status} {body[:300]!r}")
    return body


def part_count(size: int, part_size: int = DEFAULT_PART_SIZE) -> int:
    return max(1, -(-size // part_size))


def upload_parts(
    urls: list[str],
    data: memoryview,
    part_size: int = DEFAULT_PART_SIZE,
    workers: int = DEFAULT_WORKERS,
    on_progress: Progress | None = None,
    transform: Transform | None = None,
) -> list[str]:
    """Send ``data`` as ``len(urls)`` parts of ``part_size`` (the last shorter), in parallel; their ETags.

    ``transform(offset, part)`` gives the bytes sent for a part (its offset in ``data``)."""
    if len(urls) != part_count(len(data), part_size):
        raise ValueError(
            f"{len(data)} bytes in parts of {part_size} need {part_count(len(data), part_size)} URLs"
        )
    lock = threading.Lock()

    def send(n: int) -> str:
        piece = data[n * part_size : (n + 1) * part_size]
        etag = put(urls[n], piece if transform is None else transform(n * part_size, piece))
        if on_progress is not None:
            with lock:
                on_progress(len(piece))
        return etag

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(urls)))) as pool:
        return list(pool.map(send, range(len(urls))))


def download(
    url: str,
    into: memoryview,
    part_size: int = DEFAULT_PART_SIZE,
    workers: int = DEFAULT_WORKERS,
    on_progress: Progress | None = None,
    timeout: float = 300.0,
    arrived: Arrived | None = None,
) -> None:
    """Fill ``into`` (the object's size) from a presigned GET URL with parallel ranged reads;
    ``arrived(offset, range)`` runs on each range once it is whole."""
    size = len(into)
    lock = threading.Lock()

    def fetch(n: int) -> None:
        start, end = n * part_size, min(size, (n + 1) * part_size)
        conn, target = _connection(url, timeout)
        try:
            conn.request("GET", target, headers={"Range": f"bytes={start}-{end - 1}"})
            resp = conn.getresponse()
            if resp.status not in (200, 206):
                raise TransferError(f"GET range {start}-{end - 1}: {resp.status} {resp.read()[:300]!r}")
            view = into[start:end]
            got = 0
            while got < len(view):
                read = resp.readinto(view[got:])
                if not read:
                    raise TransferError(f"GET range {start}-{end - 1}: the store sent {got} bytes")
                got += read
                if on_progress is not None:
                    with lock:
                        on_progress(read)
            if arrived is not None:
                arrived(start, view)
        finally:
            conn.close()

    if size == 0:
        return
    count = part_count(size, part_size)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, count))) as pool:
        list(pool.map(fetch, range(count)))
