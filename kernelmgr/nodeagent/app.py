"""``jupyter elastic node-agent``: the per-node GPU activity agent's HTTP service.

Runs on every GPU node as a DaemonSet with ``hostPID: true`` (NVML reports host PIDs, and
``/proc/<pid>/cgroup`` must be read in the same PID namespace), the NVIDIA driver libraries,
no GPU request and no Kubernetes API rights: it only reads NVML and ``/proc``. Optional
``CAP_SYS_PTRACE`` lets it read kernel pods' environments and report their kernel ids.

Endpoints (read-only). ``/activity`` and ``/metrics`` list PIDs and pods: they answer only a request
bearing the token of ``--token-file`` (a Secret shared with the server), 401 without one and 403
with another; the chart's NetworkPolicy admits only the server too. ``/healthz`` (the kubelet's
probe, which carries no token) says only whether sampling runs.

* ``GET /activity``: JSON, the latest sample (:meth:`NodeSample.to_dict`): per pod UID the
  kernel id when known, GPU utilisation %, memory MiB, device UUIDs, PIDs; the unattributed
  processes; the devices; ``sampled_at``.
* ``GET /metrics``: the same as Prometheus gauges (:mod:`kernelmgr.nodeagent.metrics`).
* ``GET /healthz``: 200 while samples keep coming, 503 when the sampling thread is stuck
  (none finished within three intervals) — NVML being unavailable is *not* unhealthy: a
  restart would not bring a driver, and ``/activity`` says why.

Sampling runs on a timer in one worker thread (NVML and ``/proc`` reads block), never per
request, so scrapes cost nothing however many clients read; every response is the latest
sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tornado import httpserver, netutil, web

from kernelmgr.activity.nvml import Nvml
from kernelmgr.nodeagent import DEFAULT_INTERVAL, DEFAULT_PORT, metrics
from kernelmgr.nodeagent.cgroups import PROC
from kernelmgr.nodeagent.sampler import NodeSample, NodeSampler

log = logging.getLogger("kernelmgr.nodeagent")

#: /healthz turns 503 when no sample finished for this many intervals.
STALE_INTERVALS = 3


@dataclass(frozen=True)
class AgentOptions:
    """What ``jupyter elastic node-agent`` was asked for (validated by the CLI)."""

    ip: str = ""
    port: int = DEFAULT_PORT
    proc_root: str = PROC
    interval: float = DEFAULT_INTERVAL
    node: str | None = None
    #: The bearer token ``/activity`` and ``/metrics`` require; ``""`` only with ``--no-token``.
    token: str = ""


class NodeAgent:
    """Holds the sampler and its latest sample; :meth:`serve` runs the HTTP server and the timer."""

    def __init__(self, nvml: Nvml, options: AgentOptions) -> None:
        self.options = options
        self.sampler = NodeSampler(nvml, proc_root=options.proc_root, node=options.node)
        self.latest: NodeSample | None = None
        self.last_finished = 0.0  # monotonic time of the last finished sample
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="node-agent-sampler")

    def sample_once(self) -> NodeSample:
        """One pass (blocking); keeps its result as the latest."""
        try:
            sample = self.sampler.sample()
        except Exception:  # a bug must not stop the timer: log it, keep serving the last sample
            log.exception("node agent: sampling failed")
            raise
        self.latest = sample
        self.last_finished = time.monotonic()
        return sample

    def healthy(self) -> bool:
        return time.monotonic() - self.last_finished < STALE_INTERVALS * self.options.interval

    def application(self) -> web.Application:
        return web.Application(
            [
                (r"/activity", ActivityHandler, {"agent": self}),
                (r"/metrics", MetricsHandler, {"agent": self}),
                (r"/healthz", HealthHandler, {"agent": self}),
            ]
        )

    async def _sample_forever(self, stop: asyncio.Event) -> None:
        """Every interval after the first (already taken) sample, until ``stop``."""
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        while True:
            delay = max(0.0, self.options.interval - (time.monotonic() - began))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
            if stop.is_set():
                return
            began = time.monotonic()
            with contextlib.suppress(Exception):  # logged in sample_once; keep the timer going
                await loop.run_in_executor(self._executor, self.sample_once)

    def bind(self) -> list[socket.socket]:
        """Bind the port first, so a port in use fails at once (raises OSError)."""
        return netutil.bind_sockets(self.options.port, address=self.options.ip or None)

    async def serve(self, sockets: list[socket.socket]) -> None:
        """Sample once, start serving on ``sockets``, then sample every interval until SIGTERM/SIGINT."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.sample_once)
        server = httpserver.HTTPServer(self.application())
        server.add_sockets(sockets)
        port = int(sockets[0].getsockname()[1])
        host = self.options.ip or "0.0.0.0"
        # One line, on stdout: tests (and people) read the port from it when --port is 0.
        print(f"jupyter elastic node-agent listening on http://{host}:{port}", flush=True)
        if self.latest is not None and self.latest.error:
            log.warning("node agent: %s", self.latest.error)
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            await self._sample_forever(stop)
        finally:
            server.stop()
            self._executor.shutdown(wait=False)


class _AgentHandler(web.RequestHandler):
    def initialize(self, agent: NodeAgent) -> None:
        self.agent = agent

    def write_json(self, doc: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(doc))


class _ProtectedHandler(_AgentHandler):
    """Answers only a request bearing the agent's token (when it has one)."""

    def prepare(self) -> None:
        token = self.agent.options.token
        if not token:
            return
        given = self.request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not value:
            self.set_header("WWW-Authenticate", 'Bearer realm="node-agent"')
            self.write_json({"message": "this agent answers only the server: send its token as Bearer"}, 401)
        elif not hmac.compare_digest(value.strip().encode(), token.encode()):
            self.write_json({"message": "wrong token: this agent answers only the server"}, 403)


class ActivityHandler(_ProtectedHandler):
    def get(self) -> None:
        sample = self.agent.latest
        if sample is None:  # pragma: no cover - the agent samples once before it listens
            self.write_json({"message": "no sample yet"}, 503)
            return
        self.write_json(sample.to_dict())


class MetricsHandler(_ProtectedHandler):
    def get(self) -> None:
        self.set_header("Content-Type", metrics.CONTENT_TYPE)
        self.finish(metrics.render(lambda: self.agent.latest))


class HealthHandler(_AgentHandler):
    def get(self) -> None:
        sample = self.agent.latest
        doc = {
            "status": "ok" if self.agent.healthy() else "stale",
            "sampled_at": sample.sampled_at if sample else None,
            "nvml": (sample.error or "ok") if sample else None,
        }
        self.write_json(doc, 200 if self.agent.healthy() else 503)


def run(nvml: Nvml, options: AgentOptions) -> None:
    """Run the agent until SIGTERM/SIGINT; raises OSError when the port cannot be bound."""
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s %(asctime)s %(name)s] %(message)s")
    logging.getLogger("tornado.access").setLevel(logging.WARNING)  # a line per scrape is noise
    agent = NodeAgent(nvml, options)
    sockets = agent.bind()
    asyncio.run(agent.serve(sockets))
