"""The kernel websocket's fast path: Nagle's algorithm is off on the server's socket.

A cell's reply reaches the browser as several small websocket frames (busy, reply, idle); with
Nagle on, every frame after the first waits for the client's delayed ACK, which costs ~40 ms
per cell on Linux. Speed is benchmarked (benchmarks/bench_roundtrip.py), not asserted: these
tests check the cause instead, the TCP_NODELAY option itself, both on a unit (``_no_delay`` on a
real TCP socket) and on the socket of a real server's websocket, read from outside the server
process with ``pidfd_getfd`` so no debug surface is needed in the server.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from jupyter_server.services.kernels.websocket import KernelWebsocketHandler

from kernelmgr.server.websocket import ElasticWebsocketConnection
from tests.support.server import RunningServer

pytestmark = pytest.mark.pure

SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (unified syscall table)


@contextmanager
def connected_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A real connected TCP pair on loopback (socket.socketpair would be AF_UNIX: no TCP options)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        server, _addr = listener.accept()
        with client, server:
            yield server, client


def handler_around(sock: socket.socket) -> KernelWebsocketHandler:
    """jupyter_server's kernel websocket handler, its stream being ``sock`` as after the handshake.

    Built without ``__init__`` (no application or request needed): the connection only reads
    ``ws_connection.stream.socket``, and its trait wants a real KernelWebsocketHandler instance.
    """
    handler = KernelWebsocketHandler.__new__(KernelWebsocketHandler)
    handler.ws_connection = SimpleNamespace(stream=SimpleNamespace(socket=sock))  # type: ignore[assignment]
    return handler


def nodelay(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_no_delay_turns_nagle_off_on_the_websocket_socket() -> None:
    with connected_pair() as (server_side, _client_side):
        conn = ElasticWebsocketConnection(websocket_handler=handler_around(server_side))
        assert nodelay(server_side) == 0, "Nagle is on by default, else the check below proves nothing"
        conn._no_delay()
        assert nodelay(server_side) != 0


def test_no_delay_before_the_handshake_is_harmless() -> None:
    """Before the handshake there is no websocket stream: nothing to set, and nothing raises."""
    handler = KernelWebsocketHandler.__new__(KernelWebsocketHandler)
    handler.ws_connection = None
    ElasticWebsocketConnection(websocket_handler=handler)._no_delay()


# -- the real server -----------------------------------------------------------------------------


def socket_inode(pid: int, local_port: int, peer_port: int) -> int | None:
    """Inode of ``pid``'s IPv4 TCP socket from ``local_port`` to ``peer_port`` (from /proc/net/tcp)."""
    with open(f"/proc/{pid}/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, peer, inode = fields[1], fields[2], int(fields[9])
            if int(local.split(":")[1], 16) == local_port and int(peer.split(":")[1], 16) == peer_port:
                return inode
    return None


def borrow_socket(pid: int, local_port: int, peer_port: int) -> socket.socket:
    """A duplicate of another process's TCP socket (same open file: its options are shared).

    Skips the test where the kernel or sandbox refuses ``pidfd_getfd`` (Linux < 5.6, seccomp,
    ptrace restrictions): the unit test above still covers ``_no_delay`` itself.
    """
    inode = socket_inode(pid, local_port, peer_port)
    assert inode, f"no socket {local_port}->{peer_port} in process {pid}"
    fd_dir = f"/proc/{pid}/fd"
    target = next(
        (int(fd) for fd in os.listdir(fd_dir) if os.readlink(f"{fd_dir}/{fd}") == f"socket:[{inode}]"), None
    )
    assert target is not None, f"socket inode {inode} is not open in process {pid}"
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        dup = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if dup < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                pytest.skip(f"pidfd_getfd unavailable here: {os.strerror(err)}")
            raise OSError(err, os.strerror(err))
    finally:
        os.close(pidfd)
    return socket.socket(fileno=dup)


def server_port(server: RunningServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def test_gpu_kernel_round_trip_through_the_elastic_websocket(plain_server: RunningServer) -> None:
    """An execute round trip to a GPU-size kernel, through the extension's connection class."""
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        with plain_server.channel(kernel_id) as chan:
            result = chan.execute("print(6 * 7)")
            assert result.reply["content"]["status"] == "ok", result.reply
            assert result.stdout == "42\n"
            assert result.statuses[-1] == "idle"
    finally:
        plain_server.shutdown_kernel(kernel_id)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds")
def test_real_server_websocket_has_nagle_off(plain_server: RunningServer) -> None:
    """The server's end of a live kernel websocket has TCP_NODELAY set.

    This checks the ordering too: tornado's HTTP layer turns Nagle back on when it finishes
    the handshake, so an option set before it (in ``prepare()``) would read 0 here. Plain
    jupyter_server leaves it 0 (see the benchmark's table), so 1 also shows that the server
    runs our connection class.
    """
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        with plain_server.channel(kernel_id) as chan:
            assert not chan.execute("1").error  # the websocket is open and attached to the kernel
            client_port = chan.conn.sock.getsockname()[1]
            with borrow_socket(plain_server.process.pid, server_port(plain_server), client_port) as theirs:
                assert nodelay(theirs) != 0
    finally:
        plain_server.shutdown_kernel(kernel_id)
