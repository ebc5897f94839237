"""The kernel's side of the object store: bytes through presigned URLs, in parallel, no credential.

A checkpoint's data goes up as the parts of a multipart upload (one presigned URL per part, sent
by several threads at once) and comes down as ranged GETs of one presigned URL, either into a
buffer the caller owns, each range read straight into its place (:func:`download`), or piece by
piece to a function of the caller's (:func:`download_pieces`: what a restore uses). Progress is
reported in bytes so the existing "restoring N of M MiB" figures keep working.
"""

from __future__ import annotations

import http.client
import mmap
import os
import threading
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

#: S3 refuses parts under 5 MiB (but the last); bigger parts mean fewer requests.
DEFAULT_PART_SIZE = 32 * 1024 * 1024
DEFAULT_WORKERS = 4
Progress = Callable[[int], None]
#: ``(offset, piece) -> bytes to send``: e.g. encryption at the piece's offset.
Transform = Callable[[int, memoryview], bytes | bytearray | memoryview]
#: ``(offset, piece) -> None``: each piece of a download as it is read (its buffer is reused).
Sink = Callable[[int, memoryview], None]
#: The pieces :func:`download_pieces` hands over: small enough to stay in a CPU cache.
PIECE_SIZE = 1 << 20


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
    first: int = 0,
) -> list[str]:
    """Send ``data`` as ``len(urls)`` parts of ``part_size`` (the last shorter), in parallel; their ETags.

    ``transform(offset, part)`` gives the bytes sent for a part (its offset in ``data``).
    ``first``: the parts before it went already (streamed while ``data`` was written); ``urls``
    are those of the parts from ``first`` on."""
    needed = part_count(len(data), part_size) - first
    if len(urls) != needed:
        raise ValueError(f"{len(data)} bytes in parts of {part_size} from part {first} need {needed} URLs")
    lock = threading.Lock()

    def send(i: int) -> str:
        n = first + i
        piece = data[n * part_size : (n + 1) * part_size]
        etag = put(urls[i], piece if transform is None else transform(n * part_size, piece))
        if on_progress is not None:
            with lock:
                on_progress(len(piece))
        return etag

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(urls)))) as pool:
        return list(pool.map(send, range(len(urls))))


class PartStreamer:
    """The parts of an upload sent while the file they come from is still being written.

    The writer calls :meth:`settled` as the file becomes final up to an offset; each part that is
    whole by then is queued for one of ``workers`` threads, which maps its range of the file
    (the page cache: no copy), applies ``transform`` (encryption, into one buffer per thread)
    and sends it. The writer never waits: parts queue as offsets, not bytes, so the memory an
    upload holds is at most ``workers`` parts in flight (:attr:`peak_in_flight` counts them)
    whatever the file's size. Parts past the last URL are left for :func:`upload_parts`
    (``first=``) once the size is known. A failed part stops the queueing; :meth:`finish`
    raises its error.
    """

    def __init__(
        self,
        urls: list[str],
        part_size: int = DEFAULT_PART_SIZE,
        workers: int = DEFAULT_WORKERS,
        transform: Transform | None = None,
        on_progress: Progress | None = None,
    ) -> None:
        self.urls = urls
        self.part_size = part_size
        self.transform = transform
        self.on_progress = on_progress
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckpt-upload")
        self._futures: list[Future[str]] = []
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._failed: BaseException | None = None
        self.in_flight = 0
        self.peak_in_flight = 0
        #: Parts queued before the file was whole (sent while it was still being written).
        self.streamed_early = 0

    def settled(self, fd: int, offset: int) -> None:
        """``fd``'s file is final before ``offset``: queue the parts that are whole."""
        if self._fd is None:
            self._fd = os.dup(fd)  # the writer closes its own before the last parts have gone
        while (
            self._failed is None
            and len(self._futures) < len(self.urls)
            and (len(self._futures) + 1) * self.part_size <= offset
        ):
            self._queue(self.part_size)
            self.streamed_early += 1

    def _queue(self, length: int) -> None:
        future = self._pool.submit(self._send, len(self._futures), length)
        future.add_done_callback(self._done)
        self._futures.append(future)

    def _done(self, future: Future[str]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None and self._failed is None:
            self._failed = error

    def _send(self, n: int, length: int) -> str:
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            offset = n * self.part_size
            if length == 0:
                return put(self.urls[n], b"")
            assert self._fd is not None
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            size = offset - start + length
            with mmap.mmap(self._fd, size, access=mmap.ACCESS_READ, offset=start) as region:
                view = memoryview(region)[offset - start :]
                try:
                    etag = put(self.urls[n], view if self.transform is None else self.transform(offset, view))
                finally:
                    view.release()
            if self.on_progress is not None:
                with self._lock:
                    self.on_progress(length)
            return etag
        finally:
            with self._lock:
                self.in_flight -= 1

    def finish(self, size: int, fd: int | None = None) -> list[str]:
        """The file is whole at ``size`` bytes: send the rest the URLs cover; the ETags of every
        part sent (fewer than the file's parts when it outgrew the URLs)."""
        try:
            if self._fd is None and fd is not None:
                self._fd = os.dup(fd)
            total = part_count(size, self.part_size)
            while self._failed is None and len(self._futures) < min(total, len(self.urls)):
                n = len(self._futures)
                self._queue(min(self.part_size, size - n * self.part_size))
            etags = [future.result() for future in self._futures]
            if self._failed is not None:
                raise self._failed
            return etags
        finally:
            self.close()

    def close(self) -> None:
        """Stop: parts not started are dropped, those in flight are waited for."""
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def download(
    url: str,
    into: memoryview,
    part_size: int = DEFAULT_PART_SIZE,
    workers: int = DEFAULT_WORKERS,
    on_progress: Progress | None = None,
    timeout: float = 300.0,
) -> None:
    """Fill ``into`` (the object's size) from a presigned GET URL with parallel ranged reads,
    each read straight into its place."""

    def read(resp: http.client.HTTPResponse, start: int, end: int, counted: Progress) -> None:
        _read_fully(resp, into[start:end], start, counted)

    _ranges(url, len(into), read, part_size, workers, on_progress, timeout)


def download_pieces(
    url: str,
    size: int,
    sink: Sink,
    part_size: int = DEFAULT_PART_SIZE,
    workers: int = DEFAULT_WORKERS,
    on_progress: Progress | None = None,
    timeout: float = 300.0,
    piece_size: int = PIECE_SIZE,
) -> None:
    """Read the object (``size`` bytes) behind a presigned GET URL with parallel ranged reads,
    handing it to ``sink(offset, piece)`` piece by piece: ``piece_size`` bytes from each range's
    start (the last shorter), in order within a range, each on its range's thread, in a buffer
    reused for the next piece.

    Why pieces and not :func:`download`'s reads into place: the sink decrypts, digests and writes
    each piece while it is still in the CPU's cache, and writing a piece into a file (a memory
    file included) allocates its pages in one call where a read into a mapping takes a page
    fault per 4 KiB. Measured on the 2-core VM of docs/benchmarks.md, 1 GiB into a memory file:
    0.61 s by pieces written with ``pwrite``, 0.69 s read into its mapping.
    """

    def read(resp: http.client.HTTPResponse, start: int, end: int, counted: Progress) -> None:
        buffer = memoryview(bytearray(min(piece_size, end - start)))
        for offset in range(start, end, piece_size):
            piece = buffer[: min(piece_size, end - offset)]
            _read_fully(resp, piece, offset, counted)
            sink(offset, piece)

    _ranges(url, size, read, part_size, workers, on_progress, timeout)


def _read_fully(resp: http.client.HTTPResponse, view: memoryview, offset: int, counted: Progress) -> None:
    got = 0
    while got < len(view):
        read = resp.readinto(view[got:])
        if not read:
            raise TransferError(f"GET range from {offset}: the store sent {got} of {len(view)} bytes")
        got += read
        counted(read)


def _ranges(
    url: str,
    size: int,
    read: Callable[[http.client.HTTPResponse, int, int, Progress], None],
    part_size: int,
    workers: int,
    on_progress: Progress | None,
    timeout: float,
) -> None:
    """``read(response, start, end, counted)`` for each range of ``part_size`` bytes, on
    ``workers`` threads, each range its own ranged GET; ``counted(bytes)`` reports progress."""
    lock = threading.Lock()

    def counted(count: int) -> None:
        if on_progress is not None:
            with lock:
                on_progress(count)

    def fetch(n: int) -> None:
        start, end = n * part_size, min(size, (n + 1) * part_size)
        conn, target = _connection(url, timeout)
        try:
            conn.request("GET", target, headers={"Range": f"bytes={start}-{end - 1}"})
            resp = conn.getresponse()
            if resp.status not in (200, 206):
                raise TransferError(f"GET range {start}-{end - 1}: {resp.status} {resp.read()[:300]!r}")
            read(resp, start, end, counted)
        finally:
            conn.close()

    if size == 0:
        return
    count = part_count(size, part_size)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, count))) as pool:
        list(pool.map(fetch, range(count)))
