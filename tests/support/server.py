"""Start a real jupyter_server (with the kernelmgr extension) as a subprocess.

A subprocess keeps the server's event loop, kernels and config fully real and separate from
pytest's process, and lets tests kill it, read its log and restart it like an operator would.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websocket
from jupyter_server.services.kernels.connection.base import deserialize_msg_from_ws_v1, serialize_msg_to_ws_v1

TOKEN = "elastic-test-token"


def free_port() -> int:
    """A port free a moment ago. Something else may bind it before the caller does (CI once met a
    kernel's ZMQ socket on a gateway's port): callers launch again on a new one when theirs was
    taken (:func:`start_server`, the chart tests' gateway)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def isolated_env(home: Path) -> dict[str, str]:
    """Environment with Jupyter's config, data and runtime dirs inside ``home``."""
    env = dict(os.environ)
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        env.pop(var, None)
    env["JUPYTER_CONFIG_DIR"] = str(home / "config")
    env["JUPYTER_DATA_DIR"] = str(home / "data")
    env["JUPYTER_RUNTIME_DIR"] = str(home / "runtime")
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@dataclass
class ExecResult:
    stdout: str = ""
    stderr: str = ""
    displays: list[str] = field(default_factory=list)
    error: str = ""
    reply: dict[str, Any] = field(default_factory=dict)
    statuses: list[str] = field(default_factory=list)


V1_PROTOCOL = "v1.kernel.websocket.jupyter.org"


class KernelChannel:
    """A real websocket client for one kernel.

    Speaks the legacy JSON protocol by default, or with ``v1=True`` the binary
    ``v1.kernel.websocket.jupyter.org`` subprotocol that JupyterLab uses.
    """

    def __init__(
        self,
        url: str,
        kernel_id: str,
        timeout: float = 60,
        v1: bool = False,
        token: str = TOKEN,
        session: str | None = None,
    ) -> None:
        ws_url = url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels"
        # A notebook reconnecting (a reload keeps no session; a dropped websocket does) passes its own.
        self.session = session or uuid.uuid4().hex
        self.timeout = timeout
        self.v1 = v1
        self.conn = websocket.create_connection(
            f"{ws_url}?session_id={self.session}",
            header=[f"Authorization: token {token}"],
            timeout=timeout,
            subprotocols=[V1_PROTOCOL] if v1 else None,
            # websocket-client's default too, asked for explicitly: the client must never be the
            # side that holds small frames back (the round-trip benchmark relies on it).
            sockopt=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
        )
        if v1:
            assert self.conn.getsubprotocol() == V1_PROTOCOL, "the server did not accept the v1 protocol"

    def recv(self, deadline: float | None = None) -> dict[str, Any]:
        """The next message as a dict: channel, msg_type, header, parent_header, content.

        Control frames come back to this loop (``control_frame=True``), so the server's pings
        every 30 s cannot keep one receive waiting past ``deadline`` (``time.monotonic()``).
        """
        while True:
            if deadline is not None:
                self.conn.settimeout(max(0.1, deadline - time.monotonic()))
            opcode, raw = self.conn.recv_data(control_frame=True)
            if opcode in (websocket.ABNF.OPCODE_TEXT, websocket.ABNF.OPCODE_BINARY):
                break
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                raise ConnectionError("the server closed the kernel websocket")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no message before the deadline (only pings)")
        if opcode == websocket.ABNF.OPCODE_TEXT and isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        if not self.v1:
            msg: dict[str, Any] = json.loads(raw)
            return msg
        channel, parts = deserialize_msg_from_ws_v1(raw)
        header, parent, metadata, content = (json.loads(p) for p in parts[:4])
        return {
            "channel": channel,
            "header": header,
            "msg_type": header["msg_type"],
            "parent_header": parent,
            "metadata": metadata,
            "content": content,
        }

    def __enter__(self) -> KernelChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.conn.close()

    def send(self, msg_type: str, content: dict[str, Any], channel: str = "shell") -> str:
        msg_id = uuid.uuid4().hex
        msg = {
            "header": {
                "msg_id": msg_id,
                "msg_type": msg_type,
                "username": "test",
                "session": self.session,
                "version": "5.3",
                "date": "",
            },
            "parent_header": {},
            "metadata": {},
            "content": content,
        }
        if self.v1:
            pack = lambda obj: json.dumps(obj).encode()  # noqa: E731
            self.conn.send_binary(serialize_msg_to_ws_v1(msg, channel, pack))
        else:
            self.conn.send(json.dumps({**msg, "channel": channel, "buffers": []}))
        return msg_id

    def collect(
        self, msg_id: str, timeout: float | None = None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Messages for ``msg_id`` until its reply and its idle status: (reply, iopub messages)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        reply: dict[str, Any] = {}
        iopub: list[dict[str, Any]] = []
        idle = False
        while time.monotonic() < deadline and not (reply and idle):
            msg = self.recv(deadline)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["channel"] == "iopub":
                iopub.append(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
            elif msg["msg_type"].endswith("_reply"):
                reply = msg
        if not (reply and idle):
            raise TimeoutError(f"no complete reply to {msg_id} within the timeout")
        return reply, iopub

    def request(self, msg_type: str, content: dict[str, Any], channel: str = "shell") -> dict[str, Any]:
        reply, _iopub = self.collect(self.send(msg_type, content, channel))
        return reply

    def execute(self, code: str, timeout: float | None = None) -> ExecResult:
        msg_id = self.send("execute_request", {"code": code, "silent": False, "store_history": True})
        reply, iopub = self.collect(msg_id, timeout)
        result = ExecResult(reply=reply)
        for msg in iopub:
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    result.stdout += content["text"]
                else:
                    result.stderr += content["text"]
            elif kind in ("display_data", "execute_result"):
                result.displays.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                result.error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status":
                result.statuses.append(content["execution_state"])
        return result


@dataclass
class Reply:
    status: int
    body: Any


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen[bytes]
    home: Path
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    def request(
        self, method: str, path: str, body: Any = None, token: str | None = TOKEN, timeout: float = 60
    ) -> Reply:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"token {token}")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                return Reply(resp.status, json.loads(raw) if raw else None)
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                payload = json.loads(raw) if raw else None
            except json.JSONDecodeError:
                payload = raw.decode(errors="replace")
            return Reply(err.code, payload)

    def text(self, path: str) -> str:
        """GET a non-JSON document (``/metrics``)."""
        req = urllib.request.Request(self.url + path)
        req.add_header("Authorization", f"token {TOKEN}")
        with urllib.request.urlopen(req, timeout=60) as resp:
            return str(resp.read().decode())

    def get(self, path: str) -> Any:
        reply = self.request("GET", path)
        assert reply.status == 200, (path, reply)
        return reply.body

    def start_kernel(self, name: str, timeout: float = 60) -> str:
        reply = self.request("POST", "/api/kernels", {"name": name}, timeout=timeout)
        assert reply.status == 201, reply
        return str(reply.body["id"])

    def shutdown_kernel(self, kernel_id: str) -> None:
        reply = self.request("DELETE", f"/api/kernels/{kernel_id}")
        assert reply.status == 204, reply

    def execute(self, kernel_id: str, code: str, timeout: float = 60) -> str:
        """Run ``code`` through the kernel's websocket; return its stdout (raises on error)."""
        with self.channel(kernel_id, timeout=timeout) as chan:
            result = chan.execute(code, timeout=timeout)
        if result.error:
            raise AssertionError(f"kernel error: {result.error}")
        return result.stdout

    def wake_to_a_refused_restore(self, kernel_id: str, timeout: float = 120) -> None:
        """Run a cell on a hibernated kernel whose checkpoint its restore will refuse: the cell wakes
        the kernel and is not run itself (``kernelmgr/checkpoint/first_cell.py``)."""
        with self.channel(kernel_id, timeout=timeout) as chan:
            result = chan.execute("pass", timeout=timeout)
        assert result.error.startswith("RestoreIncomplete: Your variables could not be restored"), result

    def channel(self, kernel_id: str, timeout: float = 60, v1: bool = False) -> KernelChannel:
        """An open websocket to the kernel, as a notebook holds one."""
        return KernelChannel(self.url, kernel_id, timeout, v1=v1)

    def shutdown_all_kernels(self) -> None:
        """Shut down every kernel (test clean-up between tests sharing one server)."""
        if self.process.poll() is not None:
            return
        for kernel in self.get("/api/kernels"):
            self.request("DELETE", f"/api/kernels/{kernel['id']}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


#: Launches on new ports after the chosen port was taken before the server bound it.
PORT_ATTEMPTS = 5
#: How long a server may take to answer: a start takes seconds, but minutes on two cores
#: shared with a hundred kernels (a budget for a stuck start, not a timing claim).
START_SECONDS = 180


def launch(
    home: Path,
    config: dict[str, Any],
    extra_args: list[str] | None = None,
    env_extra: dict[str, str] | None = None,
    app_module: str = "jupyter_server",
) -> tuple[subprocess.Popen[bytes], Path, str, dict[str, str]]:
    """Start the server process (or ``app_module``'s, e.g. the gateway); don't wait for it."""
    (home / "config").mkdir(parents=True, exist_ok=True)
    full = {"ServerApp": {"jpserver_extensions": {"kernelmgr": True}}}
    for section, values in config.items():
        full.setdefault(section, {}).update(values)
    (home / "config" / "jupyter_server_config.json").write_text(json.dumps(full))
    (home / "root").mkdir(exist_ok=True)
    port = free_port()
    log_path = home / f"server-{port}.log"
    env = isolated_env(home)
    env.update(env_extra or {})
    config_arg = (
        []
        if app_module == "jupyter_server"
        else [f"--config={home / 'config' / 'jupyter_server_config.json'}"]
    )
    cmd = [
        sys.executable,
        "-m",
        app_module,
        *config_arg,
        "--allow-root",
        "--no-browser",
        f"--port={port}",
        # Never another port: the caller talks to this one (under load a kernel may take it first;
        # start_server then launches again on a new one).
        "--ServerApp.port_retries=0",
        "--ip=127.0.0.1",
        f"--IdentityProvider.token={TOKEN}",
        f"--ServerApp.root_dir={home / 'root'}",
        *(extra_args or []),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=home)
    return proc, log_path, f"http://127.0.0.1:{port}", env


def start_server(
    home: Path,
    config: dict[str, Any],
    extra_args: list[str] | None = None,
    env_extra: dict[str, str] | None = None,
    app_module: str = "jupyter_server",
) -> RunningServer:
    """Start the server and wait until ``/api/status`` answers (on a new port if its port was taken)."""
    for attempt in range(PORT_ATTEMPTS):
        proc, log_path, url, env = launch(home, config, extra_args, env_extra, app_module)
        server = RunningServer(url=url, process=proc, home=home, log_path=log_path, env=env)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                if "is not available" in server.log() and attempt + 1 < PORT_ATTEMPTS:
                    break  # another process bound the port first: try a new one
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                if server.request("GET", "/api/status").status == 200:
                    return server
            except (OSError, http.client.HTTPException):
                pass  # not listening yet, or the port's other owner answering until our server exits
            time.sleep(0.2)
        else:
            server.stop()
            raise RuntimeError(f"server did not start within {START_SECONDS}s:\n{server.log()}")
    raise AssertionError("unreachable")


def wait_for(predicate: Any, timeout: float = 30, interval: float = 0.2, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has exited; only its parent's wait is due)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
