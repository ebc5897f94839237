"""Liveness and readiness of the server, for Kubernetes' probes (no token: they reveal nothing).

- ``GET /api/elastic/healthz``: the event loop turns. A timer on the loop beats every second; the
  answer is 503 when the last beat is older than ``max_lag`` seconds (the loop was blocked that
  long), and no answer at all while it is blocked, which the probe's timeout counts as a failure.
  A gateway whose loop is stuck serves no notebook: the kubelet restarts it, and its kernel pods,
  left running, are adopted by the next one. How late each beat came is the histogram
  ``elastic_event_loop_lag_seconds`` (a stall anywhere delays every notebook's messages).
- ``GET /api/elastic/readyz``: the server knows its kernels. In Kubernetes mode that is once the
  kernel pods and the nodes were listed (the watches' first lists) and the running pods adopted;
  before it a request would see no kernels. Later watch failures do not make it unready: the
  kernels it serves keep working, and taking the only gateway out of its Service would cut them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jupyter_server.auth.decorator import allow_unauthenticated
from jupyter_server.base.handlers import APIHandler
from tornado import ioloop

from kernelmgr.lifecycle.metrics import LOOP_LAG_SECONDS

#: Seconds between beats of the loop's timer.
BEAT_INTERVAL = 1.0
#: Seconds without a beat after which the loop counts as stuck.
MAX_LAG = 30.0


class Health:
    """The loop's heartbeat and the conditions of readiness (each says why it is not met yet)."""

    def __init__(self, log: logging.Logger, max_lag: float = MAX_LAG) -> None:
        self.log = log
        self.max_lag = max_lag
        self.last_beat = time.monotonic()
        #: Each returns why the server is not ready yet, or ``None``.
        self.readiness: list[Callable[[], str | None]] = []
        self._timer: ioloop.PeriodicCallback | None = None
        self._said: str | None = None

    def start(self) -> Health:
        self._timer = ioloop.PeriodicCallback(self._beat, BEAT_INTERVAL * 1000)
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.stop()

    def _beat(self) -> None:
        now = time.monotonic()
        LOOP_LAG_SECONDS.observe(max(0.0, now - self.last_beat - BEAT_INTERVAL))
        self.last_beat = now

    def lag(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self.last_beat

    def not_ready(self) -> str | None:
        """Why the server is not ready (logged once per reason, never sent), or ``None``."""
        for check in self.readiness:
            why = check()
            if why is not None:
                if why != self._said:
                    self.log.info("jupyter-elastic-kernels: not ready yet: %s", why)
                    self._said = why
                return why
        return None


def health_of(handler: APIHandler) -> Health | None:
    health = handler.settings.get("elastic_health")
    return health if isinstance(health, Health) else None


class LivenessHandler(APIHandler):
    """``GET /api/elastic/healthz``: 200 while the event loop turns, 503 once it lagged ``max_lag``."""

    @allow_unauthenticated
    async def get(self) -> None:
        health = health_of(self)
        if health is not None and health.lag() > health.max_lag:
            self.set_status(503)
            self.finish({"message": "the event loop is stuck"})
            return
        self.finish({"alive": True})


class ReadinessHandler(APIHandler):
    """``GET /api/elastic/readyz``: 200 once the server knows its kernels, 503 before."""

    @allow_unauthenticated
    async def get(self) -> None:
        health = health_of(self)
        if health is None or health.not_ready() is not None:
            self.set_status(503)
            self.finish({"message": "not ready yet"})
            return
        self.finish({"ready": True})


def health_handlers() -> list[tuple[str, type[APIHandler]]]:
    return [(r"/api/elastic/healthz", LivenessHandler), (r"/api/elastic/readyz", ReadinessHandler)]
