"""One user cannot stall or fill the server, or reach another owner's checkpoint through a link.

Real servers (tests/support/server.py), real kernels, real websocket clients:

* a link a kernel makes in its own checkpoint folder into another owner's: the server returns
  neither that owner's restore report nor checkpoint summary, and deleting the kernel removes the
  link only (the other owner's files compared byte for byte);
* a 2 MiB ``is_complete_request`` to a hibernated kernel is compiled off the event loop: another
  client's request on the same server is answered while it compiles (an ordering of events, not a
  time threshold), and code over the cap is answered ``unknown`` without compiling;
* held messages are bounded per user too, with a clear error; open kernel websockets per user;
* the gateway answers an unauthenticated 20 MiB body with 413 from its headers, unread.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websocket

from kernelmgr.checkpoint.keys import owner_key
from kernelmgr.checkpoint.writer import write_checkpoint
from tests.conftest import elastic_config
from tests.support.server import KernelChannel, Reply, RunningServer, start_server, wait_for
from tests.test_checkpoint_paths import snapshot
from tests.test_hibernation_culler_concurrency import gate_object, next_message, reply_to, state

pytestmark = pytest.mark.timeout(300)

SIZE = "python3-gpu-small"


def hibernate(server: RunningServer, kernel_id: str) -> None:
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("bounds")
    config = elastic_config(home / "checkpoints")
    config["ElasticWebsocketConnection"] = {
        "max_is_complete_bytes": 4 * 1024 * 1024,  # so that 2 MiB is compiled (and takes seconds)
        "max_queued_bytes_per_user": 100_000,
        "max_queued_bytes": 1_000_000,
        "max_connections_per_user": 3,
    }
    running = start_server(home, config)
    yield running
    running.stop()


@pytest.fixture
def kernel(server: RunningServer) -> Iterator[str]:
    kernel_id = server.start_kernel(SIZE)
    yield kernel_id
    server.shutdown_all_kernels()


def test_a_link_in_a_kernels_own_folder_reaches_no_other_owners_checkpoint(
    server: RunningServer, kernel: str
) -> None:
    root = server.home / "checkpoints"
    owner = server.get(f"/api/elastic/kernels/{kernel}")["owner"]
    victim = root / "bob" / "kb"
    made = write_checkpoint(victim, {"work": 1}, key=owner_key(b"v" * 32, "bob"), owner="bob", kernel_id="kb")
    (victim / "restore-report.json").write_text(json.dumps({"checkpoint": made.checkpoint_id, "bob": 1}))
    before = snapshot(victim)
    # The kernel's cell replaces its own checkpoint folder with a link into bob's.
    made_link = server.execute(
        kernel,
        "import os, pathlib, shutil\n"
        f"own = pathlib.Path({str(root)!r}) / {owner!r} / {kernel!r}\n"
        "own.parent.mkdir(parents=True, exist_ok=True)\n"
        "shutil.rmtree(own, ignore_errors=True)\n"
        "own.symlink_to('../bob/kb')\n"
        "print(own.resolve().parent.name)",
    )
    assert made_link.strip() == "bob"

    report = server.get(f"/api/elastic/kernels/{kernel}/report")["restore_report"]
    assert report is not None and "bob" not in report and "symlink" in report["error"], report
    model = server.get(f"/api/elastic/kernels/{kernel}")
    assert model["checkpoint"] is None, model["checkpoint"]
    assert all(k["checkpoint"] is None for k in server.get("/api/elastic/kernels"))
    server.shutdown_kernel(kernel)
    assert not (root / owner / kernel).exists() and not (root / owner / kernel).is_symlink()
    assert snapshot(victim) == before


def _pending_replies(chan: KernelChannel) -> list[dict[str, Any]]:
    """The messages already waiting on ``chan``'s socket (none waited for)."""
    found = []
    while select.select([chan.conn.sock], [], [], 0.05)[0]:
        found.append(chan.recv())
    return found


def test_a_large_is_complete_compiles_off_the_event_loop(server: RunningServer, kernel: str) -> None:
    hibernate(server, kernel)
    with server.channel(kernel) as compiling, server.channel(kernel) as other:
        code = "x = 1 + 2 * (3 - 4)\n" * (2 * 1024 * 1024 // 20)
        asked = compiling.send("is_complete_request", {"code": code})
        # Sent after the 2 MiB request reached the server: with a compile on the event loop, this
        # reply could only come after that one was written.
        info = other.request("kernel_info_request", {})
        assert info["content"]["status"] == "ok"
        early = [m for m in _pending_replies(compiling) if m["msg_type"] == "is_complete_reply"]
        assert early == [], "the 2 MiB compile held the event loop: it was answered first"
        reply, _iopub = compiling.collect(asked, timeout=120)
        assert reply["content"] == {"status": "complete"}

        too_large = compiling.request("is_complete_request", {"code": code * 3})  # 6 MiB > the 4 MiB cap
        assert too_large["content"] == {"status": "unknown"}
    assert state(server, kernel) == "hibernated", "answered without waking the kernel"


def test_held_messages_are_bounded_per_user_with_a_clear_error(
    server: RunningServer, kernel: str, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    first = server.channel(kernel, timeout=120)
    second = server.channel(kernel, timeout=120)
    replies: list[Reply] = []
    hibernating = threading.Thread(
        target=lambda: replies.append(server.request("POST", f"/api/elastic/kernels/{kernel}/hibernate"))
    )
    try:
        assert first.execute(gate_object(gate) + "n = 0").error == ""
        hibernating.start()
        wait_for(lambda: state(server, kernel) == "hibernating", what="hibernating")
        cell = "s = '" + "y" * 60_000 + "'; print(len(s))"
        held = first.send("execute_request", {"code": cell, "silent": False, "store_history": True})
        # Held: the server says the cell is busy (it waits for the kernel); only then the second.
        next_message(first, lambda m: m["msg_type"] == "status" and m["parent_header"].get("msg_id") == held)
        refused = second.send("execute_request", {"code": cell, "silent": False, "store_history": True})
        reply, iopub = reply_to(second, refused)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KernelQueueFull"
        evalue = reply["content"]["evalue"]
        assert "your connections would hold" in evalue and "max_queued_bytes_per_user is 100000" in evalue
        assert any(m["msg_type"] == "error" for m in iopub)
        gate.touch()
        reply, _iopub = reply_to(first, held, timeout=120)
        assert reply["content"]["status"] == "ok", "the message that fitted was held and ran"
        assert replies[0].status == 200 if replies else True
    finally:
        gate.touch()
        hibernating.join(60)
        first.close()
        second.close()


def test_open_kernel_websockets_are_bounded_per_user(server: RunningServer, kernel: str) -> None:
    opened = [server.channel(kernel) for _ in range(3)]
    try:
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            server.channel(kernel)
        assert refused.value.status_code == 429
        opened.pop().close()
        opened.append(wait_for(lambda: _try_channel(server, kernel), what="a connection after one closed"))
    finally:
        for chan in opened:
            chan.close()


def _try_channel(server: RunningServer, kernel: str) -> KernelChannel | None:
    try:
        return server.channel(kernel)
    except websocket.WebSocketBadStatusException:
        return None


def test_the_gateway_refuses_an_unauthenticated_large_body_before_reading_it(tmp_path: Path) -> None:
    gateway = start_server(
        tmp_path / "gateway",
        elastic_config(tmp_path / "checkpoints"),
        extra_args=["--ElasticGateway.auth=token"],
        app_module="gateway.app",
    )
    try:
        host, port = gateway.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(
                b"POST /api/kernels HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {20 * 1024 * 1024}\r\n\r\n".encode()
                + b"{" * 65536  # the rest never comes: today's server waits for it, buffering
            )
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), answer[:200]
        assert "ServerApp.max_body_size" in json.loads(body)["message"]
        assert gateway.request("GET", "/api/status").status == 200
    finally:
        gateway.stop()
