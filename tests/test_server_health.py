"""The probes the chart gives the gateway: liveness on the event loop's heartbeat, readiness.

Both answer without a token (the kubelet has none) and say nothing but that. A server whose loop is
stopped (SIGSTOP: as a loop blocked by a call that never returns) answers no probe, which the kubelet
counts as a failure after the probe's timeout; once it turns again the probe passes. Readiness in
Kubernetes mode (not before the kernel pods are adopted) is tested in tests/test_kube_server.py.
"""

from __future__ import annotations

import json
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CONFIG
from tests.support.server import RunningServer, start_server, wait_for


def probe(server: RunningServer, name: str, timeout: float = 60) -> tuple[int, Any]:
    """GET as the kubelet does: no token."""
    try:
        with urllib.request.urlopen(f"{server.url}/api/elastic/{name}", timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_probes_answer_without_a_token_and_liveness_fails_while_the_loop_is_stopped(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path, CONFIG)
    try:
        assert probe(server, "healthz") == (200, {"alive": True})
        assert probe(server, "readyz") == (200, {"ready": True})
        server.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(OSError):  # no answer: the kubelet's timeoutSeconds runs out
                probe(server, "healthz", timeout=3)
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert probe(server, "healthz") == (200, {"alive": True})

        def late_beats() -> float:
            """Beats that came more than a second late (the stop lasted at least 3 s)."""
            found = dict(
                re.findall(
                    r'^elastic_event_loop_lag_seconds_(count|bucket\{le="1.0"\}) (\S+)$',
                    server.text("/metrics"),
                    re.M,
                )
            )
            return float(found.get("count", 0)) - float(found.get('bucket{le="1.0"}', 0))

        assert wait_for(late_beats, 30, what="the late beat in elastic_event_loop_lag_seconds") >= 1
    finally:
        server.stop()
