"""What runs in a Kubernetes warm pod: import the frameworks, hold the slice, wait to become a kernel.

A warm pod (:mod:`kernelmgr.kube.warm_pods`) is created before its user is known, so it has none of
what a kernel pod is given at creation: no connection file, no owner's key, no checkpoint volume (a
pod's volumes are fixed at creation, and mounting every owner's checkpoints is what we refuse). It
has its GPU slice (the pod's resources), a token in its own Secret, and an ``emptyDir`` for the one
kernel it will serve. The server hands it the rest over HTTP on ``$POD_IP:--port``, every request
carrying the token (``Authorization: Bearer``):

``GET /status``                     ``{"state": "preloading" | "ready" | "failed" | "kernel", ...}``
``PUT /checkpoint/<kernel>/<path>`` before the hand-off: the checkpoint to restore, file by file
                                    (``<checkpoint id>/<file>``, then ``current``), into the emptyDir
``POST /handoff``                   ``{"kernel_id", "connection", "key", "env", "args"}``: the process
                                    becomes that kernel (once; a second hand-off is refused)
``GET /list/<kernel>/<checkpoint>`` after it: the files of one checkpoint the agent committed
``GET /checkpoint/<kernel>/<path>`` after it: one file (``current``, a checkpoint's files, the
                                    restore report), streamed, for the server to commit in its store

Becoming the kernel is what a cold kernel pod's entry point does (:mod:`kernelmgr.kube.pod_kernel`),
done in this process: the connection file with the pod's IP written privately, the owner's key in a
0600 file the agent removes once read, the agent's variables set, the ``ELASTIC_WARM_*`` ones
removed, and ipykernel run as ``__main__`` (:func:`kernelmgr.warm.worker.become_kernel`), so the
user namespace, history and cell numbers are a fresh kernel's. The HTTP thread stays up so the
server can collect the checkpoints the kernel writes; it serves this pod's own kernel only, and a
cell that reads the token gains nothing it could not do itself.

The GPU is not checked after the preload (as a local warm process is): the pod's slice is fixed at
scheduling, so a framework that initialises CUDA at import initialises it on the right GPU.

Usage: ``python -m kernelmgr.kube.warm_pod --port PORT [MODULE ...]`` with ``ELASTIC_WARM_TOKEN_FILE``
and ``ELASTIC_WARM_CHECKPOINTS`` (the emptyDir) in the environment.
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ENV_TOKEN_FILE = "ELASTIC_WARM_TOKEN_FILE"
ENV_CHECKPOINTS = "ELASTIC_WARM_CHECKPOINTS"
#: Every variable of the warm pod's own that the kernel must not inherit starts with this.
WARM_ENV_PREFIX = "ELASTIC_WARM_"
#: Variables a hand-off may set: the checkpoint agent's. Anything else would make a warm kernel's
#: environment differ from a cold one's (the pod spec already holds the rest).
HANDOFF_ENV_PREFIX = "ELASTIC_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 8 * 2**20


def safe_relative(path: str, depth: int = 2) -> list[str] | None:
    """``path`` split into at most ``depth`` plain names (no ``..``, no hidden names), else ``None``."""
    parts = path.split("/")
    if not 1 <= len(parts) <= depth or not all(_NAME.match(part) for part in parts):
        return None
    return parts


class WarmState:
    """What the pod is doing, shared by the HTTP thread and the main thread."""

    def __init__(self, checkpoints: Path) -> None:
        self.checkpoints = checkpoints
        self.state = "preloading"
        self.detail: dict[str, Any] = {}
        self.kernel_id: str | None = None
        self.pushed_for: str | None = None
        self.handoffs: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=1)
        self.lock = threading.Lock()

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {"state": self.state, "pid": os.getpid(), **self.detail}


def _handler(state: WarmState, token: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return  # the kernel's stderr is the user's; the server logs what matters

        def _reply(self, code: int, body: dict[str, Any] | list[Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._drain()
            self._reply(401, {"message": "this warm pod answers its server only (bad or missing token)"})
            return False

        def _drain(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            while length > 0:
                length -= len(self.rfile.read(min(length, _CHUNK)))

        def _kernel_path(self, rest: str, *, handed_off: bool) -> Path | None:
            kernel, _, relative = rest.partition("/")
            parts = safe_relative(relative)
            with state.lock:
                expected = state.kernel_id if handed_off else (state.pushed_for or kernel)
                ready = (state.state == "kernel") if handed_off else (state.state == "ready")
            if not _NAME.match(kernel) or parts is None:
                self._drain()
                self._reply(400, {"message": f"not a kernel file path: {rest!r}"})
                return None
            if not ready or kernel != expected:
                self._drain()
                self._reply(409, {"message": f"this pod is {state.status()['state']}, not serving {kernel}"})
                return None
            return state.checkpoints.joinpath(kernel, *parts)

        def do_GET(self) -> None:
            if not self._authorised():
                return
            if self.path == "/status":
                self._reply(200, state.status())
            elif self.path.startswith("/list/"):
                directory = self._kernel_path(self.path[len("/list/") :], handed_off=True)
                if directory is None:
                    return
                if not directory.is_dir():
                    self._reply(404, {"message": f"no checkpoint {directory.name}"})
                    return
                files = sorted((p.name, p.stat().st_size) for p in directory.iterdir() if p.is_file())
                self._reply(200, [{"name": name, "size": size} for name, size in files])
            elif self.path.startswith("/checkpoint/"):
                path = self._kernel_path(self.path[len("/checkpoint/") :], handed_off=True)
                if path is not None:
                    self._send_file(path)
            else:
                self._reply(404, {"message": f"no {self.path}"})

        def _send_file(self, path: Path) -> None:
            try:
                handle = open(path, "rb")  # noqa: SIM115 (closed below, after streaming)
            except FileNotFoundError:
                self._reply(404, {"message": f"no {path.name}"})
                return
            with handle:
                size = os.fstat(handle.fileno()).st_size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                self.connection.sendfile(handle)  # zero-copy where the OS has sendfile(2)

        def do_PUT(self) -> None:
            if not self._authorised():
                return
            if not self.path.startswith("/checkpoint/"):
                self._drain()
                self._reply(404, {"message": f"no {self.path}"})
                return
            path = self._kernel_path(self.path[len("/checkpoint/") :], handed_off=False)
            if path is None:
                return
            with state.lock:
                state.pushed_for = path.relative_to(state.checkpoints).parts[0]
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            length = int(self.headers.get("Content-Length") or 0)
            with open(tmp, "wb") as target:
                while length > 0:
                    chunk = self.rfile.read(min(length, _CHUNK))
                    if not chunk:
                        break
                    target.write(chunk)
                    length -= len(chunk)
            if length:
                tmp.unlink()
                self._reply(400, {"message": "the body ended early"})
                return
            os.replace(tmp, path)
            self._reply(200, {"stored": path.name})

        def do_POST(self) -> None:
            if not self._authorised():
                return
            if self.path != "/handoff":
                self._drain()
                self._reply(404, {"message": f"no {self.path}"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                handoff = json.loads(self.rfile.read(length))
                refusal = check_handoff(handoff)
            except ValueError as exc:
                refusal = f"not a hand-off: {exc}"
            with state.lock:
                if refusal is None and state.state != "ready":
                    refusal = f"this pod is {state.state}"
                if refusal is None and state.pushed_for not in (None, handoff["kernel_id"]):
                    refusal = f"the checkpoint pushed here is kernel {state.pushed_for}'s"
                if refusal is None:
                    state.state = "kernel"
                    state.kernel_id = handoff["kernel_id"]
            if refusal is not None:
                self._reply(409, {"message": refusal})
                return
            state.handoffs.put(handoff)
            self._reply(200, {"pid": os.getpid()})

    return Handler


def check_handoff(handoff: Any) -> str | None:
    """Why ``handoff`` cannot be taken, or ``None``."""
    if not isinstance(handoff, dict):
        return "a hand-off is a JSON object"
    missing = [k for k in ("kernel_id", "connection", "key", "env", "args") if k not in handoff]
    if missing:
        return f"the hand-off lacks {', '.join(missing)}"
    if not isinstance(handoff["kernel_id"], str) or not _NAME.match(handoff["kernel_id"]):
        return "kernel_id is not a kernel id"
    env = handoff["env"]
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and k.startswith(HANDOFF_ENV_PREFIX) and not k.startswith(WARM_ENV_PREFIX)
        for k in env
    ):
        return f"a hand-off sets only {HANDOFF_ENV_PREFIX}* variables (the checkpoint agent's)"
    args = handoff["args"]
    if not isinstance(args, list) or not all(isinstance(a, str) and a.startswith("--") for a in args):
        return "args are ipykernel options (--name=value)"
    return None


def kernel_launch(handoff: dict[str, Any], environ: dict[str, str], checkpoints: Path) -> dict[str, Any]:
    """What :func:`kernelmgr.warm.worker.become_kernel` needs to make this process the kernel a cold
    pod would have run: its command, environment and working directory."""
    from kernelmgr.checkpoint.keys import ENV_KEY_FILE, write_key_file
    from kernelmgr.kube.pod_kernel import write_pod_connection_file

    kernel_id = handoff["kernel_id"]
    kernel_dir = checkpoints / kernel_id
    kernel_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {k: v for k, v in environ.items() if not k.startswith(WARM_ENV_PREFIX)}
    env.update({str(k): str(v) for k, v in handoff["env"].items()})
    env["ELASTIC_CHECKPOINT_DIR"] = str(kernel_dir)
    tmp = Path(environ.get("TMPDIR") or "/tmp")
    data_key = bytes.fromhex(handoff.get("data_key") or "") or None
    env[ENV_KEY_FILE] = str(
        write_key_file(tmp / "elastic-checkpoint.key", bytes.fromhex(handoff["key"]), data_key=data_key)
    )
    connection = write_pod_connection_file(dict(handoff["connection"]), environ)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", connection, *handoff["args"]]
    return {"argv": argv, "env": env, "cwd": os.getcwd()}


def serve(state: WarmState, token: str, address: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((address, port), _handler(state, token))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="warm-pod-http", daemon=True).start()
    return server


def main(args: list[str]) -> int:
    from kernelmgr.warm.worker import KERNEL_MODULES, become_kernel, preload

    if len(args) < 2 or args[0] != "--port" or not args[1].isdigit():
        print("usage: python -m kernelmgr.kube.warm_pod --port PORT [MODULE ...]", file=sys.stderr)
        return 2
    port, modules = int(args[1]), args[2:]
    token = Path(os.environ[ENV_TOKEN_FILE]).read_text(encoding="utf-8").strip()
    state = WarmState(Path(os.environ[ENV_CHECKPOINTS]))
    serve(state, token, os.environ.get("POD_IP") or "0.0.0.0", port)
    started = time.perf_counter()
    failure = preload([*modules, *KERNEL_MODULES])
    with state.lock:
        if failure is None:
            state.state = "ready"
            state.detail = {"seconds": round(time.perf_counter() - started, 3), "preload": modules}
        else:
            state.state = "failed"
            state.detail = {"reason": failure}
    if failure is not None:
        print(f"warm pod: {failure}", file=sys.stderr, flush=True)
        threading.Event().wait()  # keep answering /status until the server deletes the pod
    handoff = state.handoffs.get()
    become_kernel(kernel_launch(handoff, dict(os.environ), state.checkpoints))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
