"""The server's private probes of a kernel never block its event loop (issue 34).

Found in the load benchmark: a kernel lost its shell port to another kernel's IOPub pipe (a
ZeroMQ PULL socket bound to a random port); the server's probe connected there, ZeroMQ dropped
the connection at the refused handshake, and the probe's next send waited for a peer forever,
stalling every request of the server. Here a real ZeroMQ handshake is refused deterministically:
the peer announces itself as a PULL socket at once, so the client's side is the one that refuses
(and, by ZeroMQ's rule for a protocol error, does not reconnect).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from jupyter_client.manager import KernelManager

from kernelmgr.lifecycle.platform import shell_client, try_send

pytestmark = pytest.mark.pure


def zmtp_greeting_and_ready(socket_type: bytes) -> bytes:
    """A ZMTP 3.0 greeting (NULL mechanism) and READY command announcing ``socket_type``."""
    greeting = (
        b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    )
    name = b"Socket-Type"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type
    return greeting + b"\x04" + bytes([len(body)]) + body


@pytest.fixture
def pull_impostor() -> Iterator[int]:
    """A port whose holder speaks ZeroMQ as a PULL socket and keeps every connection open."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            conn.sendall(zmtp_greeting_and_ready(b"PULL"))

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()
    for conn in held:
        conn.close()


def test_a_probe_of_a_port_held_by_another_zeromq_socket_never_blocks(pull_impostor: int) -> None:
    km = KernelManager()
    km.load_connection_info({"ip": "127.0.0.1", "transport": "tcp", "key": b"k", "shell_port": pull_impostor})
    client = shell_client(km)
    try:
        refused = False
        for _ in range(100):  # until the refused handshake has left the socket without a peer
            started = time.monotonic()
            if try_send(client.kernel_info) is None:
                refused = True
                break
            assert time.monotonic() - started < 30, "a send blocked"
            time.sleep(0.05)
        assert refused, "the handshake was never refused: this test proves nothing"
        # Every later send is refused too, promptly, instead of waiting for a peer forever.
        assert try_send(client.kernel_info) is None
    finally:
        client.stop_channels()
