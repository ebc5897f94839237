"""The server's side of a warm pod's HTTP protocol (:mod:`kernelmgr.kube.warm_pod`).

Blocking calls (``http.client``), run in worker threads by their callers. Checkpoints move file by
file, streamed in 8 MiB pieces; what the server takes from a pod is committed in its store with the
same rules the agent follows (:mod:`kernelmgr.checkpoint.layout`): written under ``.partial-<id>``,
fsynced, renamed, and only then named by ``current``. A pod that dies half-way leaves a ``.partial``
folder (cleaned up by the next prune) and the previous commit, never a torn checkpoint.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
from pathlib import Path
from typing import Any

from kernelmgr.checkpoint.integrity import fsync_dir
from kernelmgr.checkpoint.layout import (
    CURRENT,
    PARTIAL_PREFIX,
    RESTORE_REPORT,
    is_checkpoint_id,
    publish_current,
    read_current,
    write_file_atomic,
)

_CHUNK = 8 * 2**20


class WarmPodError(RuntimeError):
    """A warm pod refused or failed a request; the message says which and why."""


class WarmPodClient:
    """One warm pod, at ``address:port``, answering those who hold ``token``."""

    def __init__(self, address: str, port: int, token: str, timeout: float = 30.0) -> None:
        self.address = address
        self.port = port
        self.token = token
        self.timeout = timeout

    def _connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        # 8 MiB blocks for a file body (http.client sends 8 KiB at a time by default).
        return http.client.HTTPConnection(
            self.address, self.port, timeout=timeout or self.timeout, blocksize=_CHUNK
        )

    def _request(
        self, method: str, path: str, body: Any = None, length: int | None = None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connection()
        headers = {"Authorization": f"Bearer {self.token}"}
        if length is not None:
            headers["Content-Length"] = str(length)
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise WarmPodError(
                f"warm pod {self.address}:{self.port} did not answer {method} {path}: {exc}"
            ) from None
        return conn, response

    def _json(self, method: str, path: str, payload: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        conn, response = self._request(method, path, data, len(data) if data is not None else None)
        try:
            body = response.read()
        finally:
            conn.close()
        if response.status not in ok:
            message = _message(body)
            raise WarmPodError(f"warm pod {self.address}: {method} {path}: {response.status} {message}")
        return json.loads(body) if body else None

    def status(self) -> dict[str, Any]:
        return dict(self._json("GET", "/status"))

    def handoff(self, handoff: dict[str, Any]) -> None:
        self._json("POST", "/handoff", handoff)

    # -- checkpoints in ---------------------------------------------------------------------

    def push_checkpoint(self, kernel_id: str, kernel_dir: Path, checkpoint_id: str) -> int:
        """Send the committed checkpoint ``checkpoint_id`` of ``kernel_dir``, ``current`` last; bytes sent."""
        source = kernel_dir / checkpoint_id
        sent = 0
        for path in sorted(p for p in source.iterdir() if p.is_file()):
            size = path.stat().st_size
            with open(path, "rb") as handle:
                self._put(f"/checkpoint/{kernel_id}/{checkpoint_id}/{path.name}", handle, size)
            sent += size
        self._put(f"/checkpoint/{kernel_id}/{CURRENT}", checkpoint_id.encode(), len(checkpoint_id))
        return sent

    def _put(self, path: str, body: Any, size: int) -> None:
        conn, response = self._request("PUT", path, body, size)
        try:
            answer = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise WarmPodError(f"warm pod {self.address}: PUT {path}: {response.status} {_message(answer)}")

    # -- checkpoints out --------------------------------------------------------------------

    def _get_to(self, path: str, target: Path) -> bool:
        """Stream ``path`` into ``target`` (fsynced); ``False`` when the pod has no such file."""
        conn, response = self._request("GET", path)
        try:
            if response.status == 404:
                response.read()
                return False
            if response.status != 200:
                raise WarmPodError(
                    f"warm pod {self.address}: GET {path}: {response.status} {_message(response.read())}"
                )
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                shutil.copyfileobj(response, handle, _CHUNK)
                handle.flush()
                os.fsync(handle.fileno())
            expected = response.getheader("Content-Length")
            if expected is not None and target.stat().st_size != int(expected):
                raise WarmPodError(
                    f"warm pod {self.address}: {path} ended after {target.stat().st_size} bytes"
                )
            return True
        finally:
            conn.close()

    def _get_bytes(self, path: str) -> bytes | None:
        conn, response = self._request("GET", path)
        try:
            body = response.read()
        finally:
            conn.close()
        if response.status == 404:
            return None
        if response.status != 200:
            raise WarmPodError(f"warm pod {self.address}: GET {path}: {response.status} {_message(body)}")
        return body

    def pull_checkpoint(self, kernel_id: str, kernel_dir: Path) -> str | None:
        """Commit the pod's current checkpoint of ``kernel_id`` in ``kernel_dir``; its id.

        ``None`` when the pod has committed none. Already here (an earlier pull): nothing moves.
        """
        raw = self._get_bytes(f"/checkpoint/{kernel_id}/{CURRENT}")
        if raw is None:
            return None
        checkpoint_id = raw.decode("ascii", "replace").strip()
        if not is_checkpoint_id(checkpoint_id):
            raise WarmPodError(
                f"warm pod {self.address}: 'current' names {checkpoint_id!r}, not a checkpoint"
            )
        kernel_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(ValueError):
            if read_current(kernel_dir) == checkpoint_id:
                return checkpoint_id
        listing = self._json("GET", f"/list/{kernel_id}/{checkpoint_id}")
        partial = kernel_dir / f"{PARTIAL_PREFIX}{checkpoint_id}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(mode=0o700)
        for entry in listing:
            name = str(entry["name"])
            if "/" in name or name.startswith("."):
                raise WarmPodError(f"warm pod {self.address}: refusing a checkpoint file named {name!r}")
            if not self._get_to(f"/checkpoint/{kernel_id}/{checkpoint_id}/{name}", partial / name):
                raise WarmPodError(f"warm pod {self.address}: {checkpoint_id}/{name} vanished while read")
        fsync_dir(partial)
        final = kernel_dir / checkpoint_id
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        fsync_dir(kernel_dir)
        publish_current(kernel_dir, checkpoint_id)
        return checkpoint_id

    def pull_restore_report(self, kernel_id: str, kernel_dir: Path) -> bool:
        """Copy the agent's last restore report into ``kernel_dir``; whether there was one."""
        body = self._get_bytes(f"/checkpoint/{kernel_id}/{RESTORE_REPORT}")
        if body is None:
            return False
        kernel_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_file_atomic(kernel_dir / RESTORE_REPORT, body)
        return True


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")
