"""CurveZMQ between the server and its local kernels (issue 46: not only the network policy).

A kernel's IOPub socket publishes to whoever subscribes: the HMAC key keeps forged messages out of
a kernel, but any process that can reach its port reads every output (on a multi-user gateway's
host, another user's process). jupyter_client 8.9+ and ipykernel 7.4+ encrypt the kernel's
sockets when ``KernelManager.transport_encryption`` asks for it (the keys in the connection file,
which only the kernel's account can read). With the project's provisioner, its GPU-size
kernelspecs (which keep ipykernel's ``supported_encryption``) and hibernation, a spy on the
IOPub port reads the outputs without it and nothing with it, and the kernel hibernates and
resumes with its variables. The local JupyterHub example turns it on: from another user's notebook
cell, a socket to a kernel's IOPub port is refused at its handshake. Not yet the project's default,
nor for kernel pods (docs/security.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zmq

from tests.support.server import RunningServer, start_server

pytestmark = pytest.mark.timeout(300)

GPUS = {"ElasticKernels": {"gpu_inventory": [{"uuid": "GPU-test-0000", "name": "test", "memory_mib": 40960}]}}


def _supported() -> bool:
    from jupyter_client.manager import KernelManager

    return "transport_encryption" in KernelManager.class_trait_names() and bool(zmq.has("curve"))


HANDSHAKE_FAILED = (
    "EVENT_HANDSHAKE_FAILED_NO_DETAIL",
    "EVENT_HANDSHAKE_FAILED_PROTOCOL",
    "EVENT_HANDSHAKE_FAILED_AUTH",
)


def _handshake(monitor: zmq.Socket[bytes]) -> bool:
    """Wait for the spy's first handshake with the kernel: True when it succeeded, False when the
    kernel refused it (a client without the kernel's keys)."""
    from zmq.utils.monitor import recv_monitor_message

    failed = {getattr(zmq, name) for name in HANDSHAKE_FAILED}
    while monitor.poll(60_000):
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return True
        if event in failed:
            return False
    raise AssertionError("no handshake with the kernel's IOPub port within 60 s")


def _spy_reads(server: RunningServer, home: Path, kernel_id: str) -> bool:
    """Whether a process with no key, subscribed to the kernel's IOPub port, reads a cell's output."""
    info = json.loads(next(home.rglob(f"kernel-{kernel_id}.json")).read_text())
    context = zmq.Context()
    spy = context.socket(zmq.SUB)
    spy.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = spy.get_monitor_socket()
    spy.connect(f"tcp://{info['ip']}:{info['iopub_port']}")
    try:
        if _handshake(monitor):
            # Connected: until its subscription has reached the kernel, outputs go past it.
            for _ in range(60):
                server.execute(kernel_id, "print('warming up')")
                if spy.poll(500):
                    break
        server.execute(kernel_id, "print('the secret output')")
        seen = []
        while spy.poll(2000):
            seen.append(b"".join(spy.recv_multipart()))
        return any(b"the secret output" in frame for frame in seen)
    finally:
        spy.disable_monitor()
        monitor.close(0)
        spy.close(0)
        context.term()


@pytest.mark.parametrize("encryption", ["disabled", "auto"])
def test_a_process_without_the_key_reads_no_kernel_output_with_transport_encryption(
    tmp_path: Path, encryption: str
) -> None:
    if not _supported():
        pytest.skip("jupyter_client < 8.9 (no transport_encryption) or pyzmq without CurveZMQ")
    config = {**GPUS, "KernelManager": {"transport_encryption": encryption}}
    server = start_server(tmp_path, config)
    try:
        name = next(n for n in server.get("/api/kernelspecs")["kernelspecs"] if "gpu" in n)
        kernel_id = server.start_kernel(name)
        assert server.execute(kernel_id, "x = 41; print(x + 1)").strip() == "42"
        info = json.loads(next(tmp_path.rglob(f"kernel-{kernel_id}.json")).read_text())
        assert ("curve_secretkey" in info) is (encryption == "auto")
        read = _spy_reads(server, tmp_path, kernel_id)
        assert read is (encryption == "disabled"), "the spy read the output" if read else "no output"
        # Hibernation and resume go through the same encrypted channels.
        assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
        assert server.execute(kernel_id, "print(x)", timeout=120).strip() == "41"
        server.shutdown_kernel(kernel_id)
    finally:
        server.stop()


SPY_CELL = """
import zmq
from zmq.utils.monitor import recv_monitor_message
spy = zmq.Context().socket(zmq.SUB)
spy.setsockopt(zmq.SUBSCRIBE, b"")
monitor = spy.get_monitor_socket()
spy.connect("tcp://127.0.0.1:{port}")
names = {{getattr(zmq, n): n for n in dir(zmq) if n.startswith("EVENT_HANDSHAKE")}}
while monitor.poll(60_000):
    event = recv_monitor_message(monitor)["event"]
    if event in names:
        print(names[event])
        break
"""


def test_another_users_notebook_cannot_read_a_kernels_output_at_the_shared_gateway(tmp_path: Path) -> None:
    """The local JupyterHub example (per-user accounts) turns CurveZMQ on: from bob's notebook, a
    socket to alice's kernel's IOPub port is refused at its handshake (before this, it connected
    and read every output she printed)."""
    if not _supported():
        pytest.skip("jupyter_client < 8.9 (no transport_encryption) or pyzmq without CurveZMQ")
    from tests.support.hub import running_hub
    from tests.test_gateway_authz import start_kernel

    with running_hub(tmp_path) as hub:
        alice, bob = hub.login_token("alice"), hub.login_token("bob")
        hers = start_kernel(hub, alice, "small")
        (connection,) = hub.state.rglob(f"kernel-{hers}.json")  # root reads it; bob's account cannot
        info = json.loads(connection.read_text())
        assert "curve_secretkey" in info, sorted(info)
        his = start_kernel(hub, bob, "small")
        from tests.support.server import KernelChannel

        with KernelChannel(f"{hub.url}{hub.gateway_prefix}", his, timeout=120, token=bob) as channel:
            said = channel.execute(SPY_CELL.format(port=info["iopub_port"]), timeout=120)
        assert said.stdout.strip().startswith("EVENT_HANDSHAKE_FAILED"), (said.stdout, said.error)
