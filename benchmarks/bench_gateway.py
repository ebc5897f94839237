"""The gateway's cost: execute round trips and kernel starts through it, beside their floors, in one run.

Round trip (as in ``bench_roundtrip.py``: an ``execute_request``, then its reply and the kernel's
``idle``), arms all alive for the whole run, interleaved in rounds with the order rotating:

* direct ZMQ: jupyter_client's BlockingKernelClient on a local kernel, no server (the floor);
* plain jupyter_server (no kernelmgr) through its own kernel websocket: what a notebook pays today;
* the gateway's websocket directly (``jupyter elastic-gateway``, standalone token mode);
* a stock single-user jupyter_server with ``GatewayClient.url`` at the gateway: the notebook's
  path in the JupyterHub deployment (user's server → gateway → kernel, two websocket hops);
* the same with ``gateway.singleuser.ElasticGatewayWebSocketConnection`` as its websocket relay.

Kernel start: ``POST /api/kernels`` on the plain server beside the same request on the user's
server, which starts the kernel at the gateway (each start is shut down before the next). Both
answer once the kernel's process is launched, before the kernel is ready.

Run: ``python benchmarks/bench_gateway.py [--n 200] [--warmup 20] [--starts 10]``.
Prints Markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jupyter_server

from benchmarks.bench_roundtrip import (
    ELASTIC_CONFIG,
    PLAIN_CONFIG,
    Arm,
    direct_kernel,
    other_benchmarks,
    percentile,
    ws_round_trip,
)
from benchmarks.markdown import print_header, print_row
from tests.support.server import TOKEN, KernelChannel, RunningServer, start_server

GPU_KERNEL = "python3-gpu-small"


@contextlib.contextmanager
def channel_arm(server: RunningServer, kernel_name: str, label: str) -> Iterator[Arm]:
    """An arm on a kernel started through ``server`` and reached over ``server``'s websocket."""
    kernel_id = server.start_kernel(kernel_name)
    chan = KernelChannel(server.url, kernel_id, 120)
    try:
        arm = Arm(label, ws_round_trip(chan))
        arm.round_trip("1")
        yield arm
    finally:
        chan.close()
        server.shutdown_kernel(kernel_id)


def time_starts(server: RunningServer, kernel_name: str, count: int) -> list[float]:
    """Seconds for each ``POST /api/kernels``: the server answers once the kernel process is
    launched (its model says ``starting``), so this is the API's cost, not the time to a ready kernel."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        kernel_id = server.start_kernel(kernel_name)
        samples.append(time.perf_counter() - start)
        server.shutdown_kernel(kernel_id)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="timed round trips per arm")
    parser.add_argument("--warmup", type=int, default=20, help="untimed round trips per arm first")
    parser.add_argument("--round", type=int, default=10, help="round trips per arm before the next arm")
    parser.add_argument("--starts", type=int, default=10, help="timed kernel starts per arm")
    args = parser.parse_args()
    code = "1"
    if busy := other_benchmarks():
        print(
            "warning: other benchmarks are running, timings will be noisy:",
            *busy,
            sep="\n  ",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory(prefix="elastic-gw-") as tmp, contextlib.ExitStack() as stack:
        home = Path(tmp)
        plain = start_server(home / "plain", PLAIN_CONFIG)
        stack.callback(plain.stop)
        assert plain.request("GET", "/api/elastic/profiles").status == 404, "kernelmgr is not disabled"
        gateway = start_server(
            home / "gateway", ELASTIC_CONFIG, ["--ElasticGateway.auth=token"], app_module="gateway.app"
        )
        stack.callback(gateway.stop)
        gateway_args = [f"--GatewayClient.url={gateway.url}", f"--GatewayClient.auth_token={TOKEN}"]
        user = start_server(home / "user", {}, gateway_args)
        stack.callback(user.stop)
        # The same, with the project's websocket relay (Nagle off on both hops).
        relay = "--ServerApp.kernel_websocket_connection_class="
        relay += "gateway.singleuser.ElasticGatewayWebSocketConnection"
        tuned = start_server(home / "tuned", {}, [*gateway_args, relay])
        stack.callback(tuned.stop)
        arms = [
            stack.enter_context(direct_kernel(home)),
            stack.enter_context(channel_arm(plain, "python3", "plain jupyter_server, python3")),
            stack.enter_context(channel_arm(gateway, GPU_KERNEL, f"gateway websocket, {GPU_KERNEL}")),
            stack.enter_context(channel_arm(user, GPU_KERNEL, f"user's server → gateway, {GPU_KERNEL}")),
            stack.enter_context(
                channel_arm(tuned, GPU_KERNEL, f"user's server → gateway, {GPU_KERNEL}, project's relay")
            ),
        ]
        # The user's kernel must really live at the gateway, not in the user's server.
        assert len(gateway.get("/api/kernels")) == 3, gateway.get("/api/kernels")
        for arm in arms:
            for _ in range(args.warmup):
                arm.round_trip(code)
        for index in range((args.n + args.round - 1) // args.round):
            for offset in range(len(arms)):
                arm = arms[(index + offset) % len(arms)]
                for _ in range(min(args.round, args.n - index * args.round)):
                    arm.timed(code)
        starts = {
            "plain jupyter_server, python3 (local)": time_starts(plain, "python3", args.starts),
            f"user's server → gateway, {GPU_KERNEL}": time_starts(user, GPU_KERNEL, args.starts),
        }

    print(
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, "
        f"Python {platform.python_version()}, jupyter_server {jupyter_server.__version__}; "
        f"{args.n} round trips per row after {args.warmup} warm-up, interleaved in rounds of "
        f"{args.round}; cell `{code}`; times in ms.\n"
    )
    print_header(["path", "median", "p90", "median / direct ZMQ"])
    floor = statistics.median(arms[0].samples[code])
    for arm in arms:
        samples = arm.samples[code]
        median = statistics.median(samples)
        print_row(
            [
                arm.name,
                f"{median * 1000:.2f}",
                f"{percentile(samples, 0.9) * 1000:.2f}",
                f"{median / floor:.2f}×",
            ]
        )
    print(f"\nKernel start (`POST /api/kernels`), {args.starts} each, ms:\n")
    print_header(["path", "median", "max", "median / local start"])
    local = statistics.median(next(iter(starts.values())))
    for name, samples in starts.items():
        median = statistics.median(samples)
        print_row([name, f"{median * 1000:.0f}", f"{max(samples) * 1000:.0f}", f"{median / local:.2f}×"])
    print(f"\nCommand: `{shlex.join(['python', *sys.argv])}`")


if __name__ == "__main__":
    main()
