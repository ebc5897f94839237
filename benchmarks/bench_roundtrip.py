"""Execute round trip through the kernel websocket against its floor, side by side in one run.

One round trip: send an ``execute_request`` and receive both its ``execute_reply`` and the
kernel's ``idle`` status for it (what a notebook waits for before it marks the cell done).
Arms, all on this machine and all alive for the whole run:

* direct ZMQ: jupyter_client's BlockingKernelClient on a KernelManager's kernel, no server
  (the floor: what the kernel itself costs);
* plain jupyter_server (the kernelmgr extension disabled), through its kernel websocket;
* jupyter_server with kernelmgr, through ``ElasticWebsocketConnection``: the CPU kernel
  ``python3`` and a GPU-size kernel ``python3-gpu-small`` (a declared fake GPU, so no GPU is needed).

The websocket arms share one client (websocket-client, the legacy JSON protocol, TCP_NODELAY
set on the client's socket so the client adds no delay of its own). After a warm-up, round
trips run in interleaved rounds (arm order rotating) so drifting machine noise hits all arms
alike. The table also reads TCP_NODELAY on both ends of each websocket: the server's end is
read from outside the server process (``pidfd_getfd``), which is the cause the timings show.

Run: ``python benchmarks/bench_roundtrip.py [--n 200] [--warmup 20] [--codes 1,pass]``.
Prints a Markdown table (median, p90, ratio of medians to direct ZMQ) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jupyter_server
import tornado
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from benchmarks.markdown import print_header, print_row
from tests.support.server import KernelChannel, RunningServer, start_server

PROFILES = {"small": {"gpu_fraction": 0.25, "memory_mib": 10240}}
INVENTORY = [{"uuid": "GPU-bench-0000", "name": "Declared benchmark GPU", "memory_mib": 40960}]
ELASTIC_CONFIG = {"ElasticKernels": {"profiles": PROFILES, "gpu_inventory": INVENTORY}}
PLAIN_CONFIG = {"ServerApp": {"jpserver_extensions": {"kernelmgr": False}}}
SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture


@dataclass
class Arm:
    """One way of reaching a kernel: a round-trip function and what it measured."""

    name: str
    round_trip: Callable[[str], None]
    client_nodelay: str = "n/a"
    server_nodelay: str = "n/a"
    samples: dict[str, list[float]] = field(default_factory=dict)

    def timed(self, code: str) -> None:
        start = time.perf_counter()
        self.round_trip(code)
        self.samples.setdefault(code, []).append(time.perf_counter() - start)


def zmq_round_trip(client: BlockingKernelClient) -> Callable[[str], None]:
    """Round trip on the kernel's own sockets: reply on shell, then idle on iopub."""

    def run(code: str) -> None:
        msg_id = client.execute(code)
        while True:
            reply = client.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                assert reply["content"]["status"] == "ok", reply["content"]
                break
        while True:
            msg = client.get_iopub_msg(timeout=60)
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                break

    return run


def ws_round_trip(chan: KernelChannel) -> Callable[[str], None]:
    def run(code: str) -> None:
        result = chan.execute(code)
        assert result.reply["content"]["status"] == "ok", result.reply

    return run


def server_side_nodelay(server: RunningServer, client_port: int) -> str:
    """TCP_NODELAY on the server's end of the websocket whose client end is ``client_port``.

    Read through a duplicate of the server's socket (``pidfd_getfd``, which shares the open
    file and so its options); "?" where this kernel or sandbox does not allow it.
    """
    pid, port = server.process.pid, int(server.url.rsplit(":", 1)[1])
    inode = None
    with open(f"/proc/{pid}/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and int(fields[2].split(":")[1], 16) == client_port:
                inode = fields[9]
    if inode is None or not hasattr(os, "pidfd_open"):
        return "?"
    fd_dir = f"/proc/{pid}/fd"
    fds = [int(fd) for fd in os.listdir(fd_dir) if os.readlink(f"{fd_dir}/{fd}") == f"socket:[{inode}]"]
    if not fds:
        return "?"
    target = fds[0]
    pidfd = os.pidfd_open(pid)
    try:
        dup = ctypes.CDLL(None, use_errno=True).syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
    finally:
        os.close(pidfd)
    if dup < 0:
        return "?"
    with socket.socket(fileno=dup) as theirs:
        return "on" if theirs.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) else "off"


@contextlib.contextmanager
def direct_kernel(home: Path) -> Iterator[Arm]:
    manager = KernelManager(kernel_name="python3", connection_file=str(home / "kernel-direct.json"))
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        yield Arm("direct ZMQ (jupyter_client)", zmq_round_trip(client))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@contextlib.contextmanager
def websocket_kernel(server: RunningServer, kernel_name: str, label: str, v1: bool = False) -> Iterator[Arm]:
    kernel_id = server.start_kernel(kernel_name)
    chan = KernelChannel(server.url, kernel_id, v1=v1)
    try:
        arm = Arm(label, ws_round_trip(chan))
        arm.round_trip("1")  # the websocket is attached before its sockets are inspected
        sock = chan.conn.sock
        arm.client_nodelay = "on" if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) else "off"
        arm.server_nodelay = server_side_nodelay(server, sock.getsockname()[1])
        yield arm
    finally:
        chan.close()
        server.shutdown_kernel(kernel_id)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def other_benchmarks() -> list[str]:
    """Other running benchmarks, whose load would pollute these timings."""
    found = subprocess.run(["pgrep", "-af", "benchmarks/bench_"], capture_output=True, text=True).stdout
    mine = {str(os.getpid()), str(os.getppid())}
    return [
        line for line in found.splitlines() if line.split()[0] not in mine and "bench_roundtrip" not in line
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="timed round trips per arm and code")
    parser.add_argument("--warmup", type=int, default=20, help="untimed round trips per arm and code first")
    parser.add_argument("--round", type=int, default=10, help="round trips per arm before the next arm")
    parser.add_argument("--codes", default="1,pass", help="cell sources to execute, comma-separated")
    args = parser.parse_args()
    codes = args.codes.split(",")
    if busy := other_benchmarks():
        print(
            "warning: other benchmarks are running, timings will be noisy:",
            *busy,
            sep="\n  ",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory(prefix="elastic-rt-") as tmp, contextlib.ExitStack() as stack:
        home = Path(tmp)
        plain = start_server(home / "plain", PLAIN_CONFIG)
        stack.callback(plain.stop)
        # start_server always enables kernelmgr first; make sure the plain arm really is plain.
        assert plain.request("GET", "/api/elastic/profiles").status == 404, "kernelmgr is not disabled"
        elastic = start_server(home / "elastic", ELASTIC_CONFIG)
        stack.callback(elastic.stop)
        assert elastic.request("GET", "/api/elastic/profiles").status == 200, "kernelmgr is not enabled"
        arms = [
            stack.enter_context(direct_kernel(home)),
            stack.enter_context(websocket_kernel(plain, "python3", "plain jupyter_server, python3")),
            stack.enter_context(websocket_kernel(elastic, "python3", "kernelmgr, python3")),
            stack.enter_context(
                websocket_kernel(elastic, "python3-gpu-small", "kernelmgr, python3-gpu-small")
            ),
            # The binary subprotocol JupyterLab uses: the server relays frames without decoding them.
            stack.enter_context(
                websocket_kernel(plain, "python3", "plain jupyter_server, python3, v1 protocol", v1=True)
            ),
            stack.enter_context(
                websocket_kernel(
                    elastic, "python3-gpu-small", "kernelmgr, python3-gpu-small, v1 protocol", v1=True
                )
            ),
        ]
        for arm in arms:
            for code in codes:
                for _ in range(args.warmup):
                    arm.round_trip(code)
        for index in range((args.n + args.round - 1) // args.round):
            for offset in range(len(arms)):
                arm = arms[(index + offset) % len(arms)]  # rotate who goes first
                for code in codes:
                    for _ in range(min(args.round, args.n - index * args.round)):
                        arm.timed(code)
            print(f"round {index + 1} done", file=sys.stderr)

    command = shlex.join(["python", *sys.argv])
    print(
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, "
        f"Python {platform.python_version()}, jupyter_server {jupyter_server.__version__}, "
        f"tornado {tornado.version}; {args.n} round trips per row after {args.warmup} warm-up, "
        f"interleaved in rounds of {args.round}; times in ms.\n"
    )
    headers = [
        "path",
        "cell",
        "median",
        "p90",
        "median / direct ZMQ",
        "client TCP_NODELAY",
        "server TCP_NODELAY",
    ]
    print_header(headers)
    for code in codes:
        floor = statistics.median(arms[0].samples[code])
        for arm in arms:
            samples = arm.samples[code]
            median = statistics.median(samples)
            cells = [
                arm.name,
                f"`{code}`",
                f"{median * 1000:.2f}",
                f"{percentile(samples, 0.9) * 1000:.2f}",
                f"{median / floor:.2f}×",
                arm.client_nodelay,
                arm.server_nodelay,
            ]
            print_row(cells)
    print(f"\nCommand: `{command}`")


if __name__ == "__main__":
    main()
