"""The server's side of a warm pod's HTTP protocol (:mod:`kernelmgr.kube.warm_pod`).

Blocking calls (``http.client``), run in worker threads by their callers, each with a deadline and
a size cap on what it reads. Checkpoints move file by file, streamed in 8 MiB pieces; one is verified
again with its owner's key right before it is pushed; what the server takes from a pod is committed
in its store, through descriptors that follow no link, with the same rules the agent follows
(:mod:`kernelmgr.checkpoint.layout`): written under ``.partial-<id>``, fsynced, renamed, and only
then named by ``current``. A pod that dies half-way leaves a ``.partial`` folder (cleaned up by the
next prune) and the previous commit, never a torn checkpoint.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.layout import (
    CURRENT,
    CURRENT_CAP,
    PARTIAL_PREFIX,
    RESTORE_REPORT,
    is_checkpoint_id,
    publish_current,
    read_current,
)
from kernelmgr.checkpoint.safedir import SafeDir, UnsafePath
from kernelmgr.checkpoint_store import RESTORE_REPORT_CAP

if TYPE_CHECKING:
    from kernelmgr.checkpoint_store import CheckpointStore

_CHUNK = 8 * 2**20
#: What the server reads of a pod's JSON answers (status, listings, replies): they are small.
JSON_CAP = 1024 * 1024
#: A checkpoint is a few files (manifest, data, notes): more in a listing is refused.
MAX_FILES = 64
#: Seconds a request waits to connect, and (small answers) for the whole answer.
CONNECT_TIMEOUT = 10.0
#: A file moves at least this fast, or its transfer fails (on top of ``timeout``), so a pod that
#: trickles cannot hold a worker thread for ever.
MIN_RATE = 1024 * 1024


class WarmPodError(RuntimeError):
    """A warm pod refused or failed a request; the message says which and why."""


class WarmPodClient:
    """One warm pod, at ``address:port``, answering those who hold ``token``.

    Every request has a deadline: ``timeout`` seconds for a small answer (the socket's own
    timeout bounds each wait, and the whole answer must come before the deadline), plus
    ``size / MIN_RATE`` for a file. Every answer has a size cap. A pod is a user's kernel once
    it took the hand-off: nothing it sends can hold the server's threads or memory unbounded.
    """

    def __init__(self, address: str, port: int, token: str, timeout: float = 30.0) -> None:
        self.address = address
        self.port = port
        self.token = token
        self.timeout = timeout

    def _connection(self) -> http.client.HTTPConnection:
        # 8 MiB blocks for a file body (http.client sends 8 KiB at a time by default).
        return http.client.HTTPConnection(
            self.address, self.port, timeout=min(self.timeout, CONNECT_TIMEOUT), blocksize=_CHUNK
        )

    def _request(
        self, method: str, path: str, body: Any = None, length: int | None = None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connection()
        headers = {"Authorization": f"Bearer {self.token}"}
        if length is not None:
            headers["Content-Length"] = str(length)
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self.timeout)
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise WarmPodError(
                f"warm pod {self.address}:{self.port} did not answer {method} {path}: {exc}"
            ) from None
        return conn, response

    def _read(
        self,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        what: str,
        cap: int,
        seconds: float,
    ) -> bytes:
        """The body of ``response``, at most ``cap`` bytes, within ``seconds``; else :class:`WarmPodError`."""
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise WarmPodError(f"warm pod {self.address}: {what}: {declared} bytes, more than the {cap} read")
        return b"".join(self._chunks(conn, response, what, cap, seconds))

    def _chunks(
        self,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        what: str,
        cap: int,
        seconds: float,
    ) -> Iterator[bytes]:
        deadline = time.monotonic() + seconds
        got = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WarmPodError(f"warm pod {self.address}: {what}: no whole answer within {seconds:.0f} s")
            if conn.sock is not None:
                conn.sock.settimeout(min(left, self.timeout))
            try:
                chunk = response.read1(min(_CHUNK, cap + 1 - got))
            except (OSError, http.client.HTTPException) as exc:
                raise WarmPodError(f"warm pod {self.address}: {what}: {exc}") from None
            if not chunk:
                return
            got += len(chunk)
            if got > cap:
                raise WarmPodError(f"warm pod {self.address}: {what}: more than the {cap} bytes read")
            yield chunk

    def _json(self, method: str, path: str, payload: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        conn, response = self._request(method, path, data, len(data) if data is not None else None)
        try:
            body = self._read(conn, response, f"{method} {path}", JSON_CAP, self.timeout)
        finally:
            conn.close()
        if response.status not in ok:
            message = _message(body)
            raise WarmPodError(f"warm pod {self.address}: {method} {path}: {response.status} {message}")
        try:
            return json.loads(body) if body else None
        except ValueError:
            raise WarmPodError(f"warm pod {self.address}: {method} {path}: not JSON") from None

    def status(self) -> dict[str, Any]:
        answer = self._json("GET", "/status")
        if not isinstance(answer, dict):
            raise WarmPodError(f"warm pod {self.address}: GET /status: not a status")
        return answer

    def handoff(self, handoff: dict[str, Any]) -> None:
        self._json("POST", "/handoff", handoff)

    # -- checkpoints in ---------------------------------------------------------------------

    def push_checkpoint(self, kernel_id: str, store: CheckpointStore, owner: str, checkpoint_id: str) -> int:
        """Send ``owner``'s committed checkpoint ``checkpoint_id`` of ``kernel_id``, ``current`` last;
        bytes sent.

        Verified again with the owner's key right before it is sent, from the descriptors it is
        sent from (:meth:`CheckpointStore.verified_files`): a checkpoint changed since the kernel
        hibernated, or reached through a link, is refused (``CheckpointRefused``), never sent.
        """
        sent = 0
        try:
            with store.verified_files(owner, kernel_id, checkpoint_id) as files:
                for name, handle, size in files:
                    self._put(f"/checkpoint/{kernel_id}/{checkpoint_id}/{name}", handle, size)
                    sent += size
        except CheckpointRefused as exc:
            raise WarmPodError(f"not sent to warm pod {self.address}: {exc}") from None
        self._put(f"/checkpoint/{kernel_id}/{CURRENT}", checkpoint_id.encode(), len(checkpoint_id))
        return sent

    def _put(self, path: str, body: Any, size: int) -> None:
        if hasattr(body, "read"):  # a file: it must move at MIN_RATE at least
            body = _Paced(body, time.monotonic() + self.timeout + size / MIN_RATE)
        conn, response = self._request("PUT", path, body, size)
        try:
            answer = self._read(conn, response, f"PUT {path}", JSON_CAP, self.timeout)
        finally:
            conn.close()
        if response.status != 200:
            raise WarmPodError(f"warm pod {self.address}: PUT {path}: {response.status} {_message(answer)}")

    # -- checkpoints out --------------------------------------------------------------------

    def _get_to(self, path: str, target: SafeDir, name: str, size: int) -> bool:
        """Stream ``path`` (``size`` bytes, as listed) into ``target/name`` (fsynced); ``False`` when
        the pod has no such file."""
        conn, response = self._request("GET", path)
        try:
            if response.status == 404:
                return False
            if response.status != 200:
                body = self._read(conn, response, f"GET {path}", JSON_CAP, self.timeout)
                raise WarmPodError(f"warm pod {self.address}: GET {path}: {response.status} {_message(body)}")
            if response.getheader("Content-Length") != str(size):
                raise WarmPodError(
                    f"warm pod {self.address}: {path} is {response.getheader('Content-Length')} bytes, "
                    f"listed as {size}"
                )
            written = 0
            with os.fdopen(target.create_file(name), "wb") as handle:
                for chunk in self._chunks(
                    conn, response, f"GET {path}", size, self.timeout + size / MIN_RATE
                ):
                    handle.write(chunk)
                    written += len(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            if written != size:
                raise WarmPodError(f"warm pod {self.address}: {path} ended after {written} bytes")
            return True
        finally:
            conn.close()

    def _get_bytes(self, path: str, cap: int) -> bytes | None:
        conn, response = self._request("GET", path)
        try:
            body = self._read(conn, response, f"GET {path}", max(cap, JSON_CAP), self.timeout)
        finally:
            conn.close()
        if response.status == 404:
            return None
        if response.status != 200:
            raise WarmPodError(f"warm pod {self.address}: GET {path}: {response.status} {_message(body)}")
        if len(body) > cap:
            raise WarmPodError(f"warm pod {self.address}: GET {path}: more than the {cap} bytes read")
        return body

    def pull_checkpoint(self, kernel_id: str, store: CheckpointStore, owner: str) -> str | None:
        """Commit the pod's current checkpoint of ``kernel_id`` in ``owner``'s folder of ``store``; its id.

        ``None`` when the pod has committed none. Already here (an earlier pull): nothing moves.
        Written through descriptors, following no link (:meth:`CheckpointStore.open_kernel_dir`).
        """
        raw = self._get_bytes(f"/checkpoint/{kernel_id}/{CURRENT}", CURRENT_CAP)
        if raw is None:
            return None
        checkpoint_id = raw.decode("ascii", "replace").strip()
        if not is_checkpoint_id(checkpoint_id):
            raise WarmPodError(
                f"warm pod {self.address}: 'current' names {checkpoint_id!r}, not a checkpoint"
            )
        try:
            kernel_dir = store.open_kernel_dir(owner, kernel_id, create=True)
        except UnsafePath as exc:
            raise WarmPodError(f"the checkpoint from warm pod {self.address} was not stored: {exc}") from None
        with kernel_dir:
            with contextlib.suppress(ValueError):
                if read_current(kernel_dir) == checkpoint_id:
                    return checkpoint_id
            listing = self._json("GET", f"/list/{kernel_id}/{checkpoint_id}")
            files = _checked_listing(listing, self.address)
            partial = f"{PARTIAL_PREFIX}{checkpoint_id}"
            with contextlib.suppress(FileNotFoundError):
                kernel_dir.remove(partial)
            with kernel_dir.subdir(partial, create=True) as folder:
                for name, size in files:
                    if not self._get_to(
                        f"/checkpoint/{kernel_id}/{checkpoint_id}/{name}", folder, name, size
                    ):
                        raise WarmPodError(
                            f"warm pod {self.address}: {checkpoint_id}/{name} vanished while read"
                        )
                folder.fsync()
            with contextlib.suppress(FileNotFoundError):
                kernel_dir.remove(checkpoint_id)
            os.replace(partial, checkpoint_id, src_dir_fd=kernel_dir.fd, dst_dir_fd=kernel_dir.fd)
            kernel_dir.fsync()
            publish_current(kernel_dir, checkpoint_id)
        return checkpoint_id

    def pull_restore_report(self, kernel_id: str, store: CheckpointStore, owner: str) -> bool:
        """Copy the agent's last restore report into the store; whether there was one."""
        body = self._get_bytes(f"/checkpoint/{kernel_id}/{RESTORE_REPORT}", RESTORE_REPORT_CAP)
        if body is None:
            return False
        try:
            kernel_dir = store.open_kernel_dir(owner, kernel_id, create=True)
        except UnsafePath as exc:
            raise WarmPodError(
                f"the restore report from warm pod {self.address} was not stored: {exc}"
            ) from None
        with kernel_dir:
            kernel_dir.write_atomic(RESTORE_REPORT, body)
        return True


class _Paced:
    """A file sent as a request body that fails the upload once its deadline has passed (a pod
    reading a checkpoint slower than :data:`MIN_RATE` would hold a worker thread for ever)."""

    def __init__(self, handle: Any, deadline: float) -> None:
        self.handle = handle
        self.deadline = deadline

    def read(self, size: int = -1) -> bytes:
        if time.monotonic() > self.deadline:
            raise TimeoutError("the pod took the checkpoint too slowly")
        return bytes(self.handle.read(size))


def _checked_listing(listing: Any, address: str) -> list[tuple[str, int]]:
    """``[(name, size)]`` of a pod's listing of one checkpoint, or :class:`WarmPodError` saying why not."""
    if not isinstance(listing, list) or len(listing) > MAX_FILES:
        raise WarmPodError(f"warm pod {address}: a checkpoint listing is a list of at most {MAX_FILES} files")
    files = []
    for entry in listing:
        name = entry.get("name") if isinstance(entry, dict) else None
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not name or "\0" in name:
            raise WarmPodError(f"warm pod {address}: refusing a checkpoint file named {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise WarmPodError(f"warm pod {address}: {name} has no size in the listing")
        files.append((name, size))
    return files


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")
