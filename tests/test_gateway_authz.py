"""What acts on the whole gateway is the admins'; what a user sees of others is aggregates only.

A real JupyterHub (configurable-http-proxy, the project's example configuration) with the gateway
as its service; every request goes through the Hub's proxy with a user's own Hub token.

- bob (not an admin) cannot shut the gateway down, post a (forged) lifecycle event for alice's
  kernel, read the gateway-wide status or metrics, or open a session at the gateway (a kernel
  start outside the per-user path); each answers 403 with a JSON message, and the gateway keeps
  serving. An admin can post events and shut it down.
- bob's ``/api/elastic/gpus`` shows his kernel's slice and, of alice's, only the aggregate; his
  event subscription receives his own kernels' events and none of alice's.
- three resumes of one user's hibernated kernels sent at once are admitted one by one: with
  ``max_gpu`` 0.5 and three 0.5-GPU kernels, one resumes and two are refused (403, naming the
  limit), never all three.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

from tests.support.hub import Hub, running_hub
from tests.support.server import KernelChannel

pytestmark = pytest.mark.timeout(600)

LIFECYCLE = "https://events.jupyter.org/jupyter_elastic_kernels/kernel_lifecycle/v1"
SCRAPE_TOKEN = "prometheus-scrape-token-for-tests"


def gateway(hub: Hub, method: str, path: str, token: str, **kwargs: Any) -> requests.Response:
    return hub.api(method, f"{hub.gateway_prefix}{path}", token, **kwargs)


def spec_for(hub: Hub, token: str, profile: str) -> str:
    specs = gateway(hub, "GET", "/api/kernelspecs", token).json()["kernelspecs"]
    for name, spec in specs.items():
        if ((spec["spec"].get("metadata") or {}).get("elastic") or {}).get("profile") == profile:
            return str(name)
    raise AssertionError(f"no {profile} kernelspec offered: {sorted(specs)}")


def start_kernel(hub: Hub, token: str, profile: str) -> str:
    started = gateway(hub, "POST", "/api/kernels", token, json={"name": spec_for(hub, token, profile)})
    assert started.status_code == 201, started.text
    return str(started.json()["id"])


def hibernate(hub: Hub, token: str, kernel_id: str) -> None:
    done = gateway(hub, "POST", f"/api/elastic/kernels/{kernel_id}/hibernate", token)
    assert done.status_code == 200 and done.json()["state"] == "hibernated", done.text


def subscribe(hub: Hub, token: str) -> websocket.WebSocket:
    url = hub.url.replace("http://", "ws://") + f"{hub.gateway_prefix}/api/events/subscribe"
    return websocket.create_connection(url, header=[f"Authorization: token {token}"], timeout=120)


def events_until(conn: websocket.WebSocket, done: Any, timeout: float = 120) -> list[dict[str, Any]]:
    """Events received, in order, up to and including the first for which ``done`` is true."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = json.loads(conn.recv())
        seen.append(event)
        if done(event):
            return seen
    raise AssertionError(f"the awaited event never came; received: {seen}")


def refused(answer: requests.Response, fragment: str) -> None:
    where = f"{answer.request.method} {answer.url}"
    assert answer.status_code == 403, f"{where}: {answer.status_code} {answer.text}"
    assert fragment in answer.json()["message"], answer.text


def test_gateway_wide_operations_are_for_admins_and_users_see_only_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_METRICS_TOKEN", SCRAPE_TOKEN)  # the example hands it to the gateway
    with running_hub(tmp_path, admins="ada") as hub:
        alice = hub.login_token("alice")
        bob = hub.login_token("bob")
        ada = hub.login_token("ada")
        stream = subscribe(hub, bob)
        try:
            alice_id = start_kernel(hub, alice, "small")
            bob_id = start_kernel(hub, bob, "small")
            with KernelChannel(f"{hub.url}{hub.gateway_prefix}", bob_id, timeout=120, token=bob) as channel:
                cell = channel.execute("import os; 'ELASTIC_METRICS_TOKEN' in os.environ", timeout=120)
            assert not cell.error and cell.displays == ["False"], cell  # no kernel holds the scrape token

            # Operations on every user's kernels: 403 for bob, with a message; the gateway keeps going.
            refused(gateway(hub, "POST", "/api/shutdown", bob), "shutting the gateway down is for")
            forged = {
                "schema_id": LIFECYCLE,
                "version": 1,
                "data": {"action": "lost", "kernel_id": alice_id, "msg": "forged by bob"},
            }
            refused(gateway(hub, "POST", "/api/events", bob, json=forged), "posting events is for")
            refused(gateway(hub, "GET", "/api/status", bob), "the gateway's status")
            refused(gateway(hub, "GET", "/metrics", bob), "/metrics is for the gateway's admins")
            session = {"path": "x.ipynb", "type": "notebook", "name": "x", "kernel": {"name": "python3"}}
            refused(gateway(hub, "POST", "/api/sessions", bob, json=session), "keeps no notebook sessions")
            assert [k["id"] for k in gateway(hub, "GET", "/api/kernels", bob).json()] == [bob_id]
            # Asking what one may do answers, without a 403 (jupyter_server's /api/me).
            asked = json.dumps({"server": ["write"], "events": ["write", "execute"], "kernels": ["read"]})
            for who, expected in (
                (bob, {"server": [], "events": ["execute"], "kernels": ["read"]}),
                (ada, {"server": ["write"], "events": ["write", "execute"], "kernels": ["read"]}),
            ):
                me = gateway(hub, "GET", "/api/me", who, params={"permissions": asked})
                granted = {k: v for k, v in me.json()["permissions"].items() if k in expected}
                assert me.status_code == 200 and granted == expected, me.text
            assert gateway(hub, "GET", f"/api/elastic/kernels/{alice_id}", alice).json()["state"] == "running"

            # The GPUs: bob's own slice in full, alice's only as an aggregate.
            gpus = gateway(hub, "GET", "/api/elastic/gpus", bob)
            assert gpus.status_code == 200, gpus.text
            assert alice_id not in gpus.text and "alice" not in gpus.text, gpus.text
            slices = [s for d in gpus.json()["devices"] for s in d["slices"]]
            assert [s["kernel_id"] for s in slices] == [bob_id], slices
            others = [d["other_users"] for d in gpus.json()["devices"]]
            assert sum(o["slices"] for o in others) == 1 and sum(o["fraction"] for o in others) == 0.25
            everything = gateway(hub, "GET", "/api/elastic/gpus", ada).json()
            assert {s["kernel_id"] for d in everything["devices"] for s in d["slices"]} == {alice_id, bob_id}

            # Events: alice's hibernation first, then bob's; bob's stream has his own only.
            hibernate(hub, alice, alice_id)
            hibernate(hub, bob, bob_id)
            received = events_until(
                stream, lambda e: e.get("kernel_id") == bob_id and e.get("action") == "hibernate"
            )
        finally:
            stream.close()
        assert all(e.get("kernel_id") == bob_id for e in received), received

        # An admin may post events, read the status and the metrics, and shut the gateway down.
        assert gateway(hub, "POST", "/api/events", ada, json=forged).status_code == 204
        assert gateway(hub, "GET", "/api/status", ada).json()["kernels"] == 2
        assert "elastic_kernels" in gateway(hub, "GET", "/metrics", ada).text
        # Prometheus: the scrape token, and nothing else without a Hub login.
        scrape_url = f"{hub.url}{hub.gateway_prefix}/metrics"
        scraped = requests.get(scrape_url, headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"}, timeout=60)
        assert scraped.status_code == 200 and "elastic_kernels" in scraped.text, scraped.text
        wrong = requests.get(scrape_url, headers={"Authorization": "Bearer not-the-token"}, timeout=60)
        assert wrong.status_code == 403, wrong.text
        assert gateway(hub, "POST", "/api/shutdown", ada).status_code == 200


def test_resumes_sent_at_once_are_held_to_the_quota(tmp_path: Path) -> None:
    with running_hub(tmp_path, quota_users=json.dumps({"carol": {"max_gpu": 0.5, "max_kernels": 4}})) as hub:
        carol = hub.login_token("carol")
        kernels = []
        for _ in range(3):  # 0.5 GPU each: one at a time fits the quota
            kernel_id = start_kernel(hub, carol, "medium")
            hibernate(hub, carol, kernel_id)
            kernels.append(kernel_id)

        barrier = threading.Barrier(len(kernels))
        answers: dict[str, requests.Response] = {}

        def resume(kernel_id: str) -> None:
            barrier.wait()
            answers[kernel_id] = gateway(hub, "POST", f"/api/elastic/kernels/{kernel_id}/resume", carol)

        threads = [threading.Thread(target=resume, args=(k,)) for k in kernels]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        statuses = sorted(answer.status_code for answer in answers.values())
        assert statuses == [200, 403, 403], {k: (a.status_code, a.text) for k, a in answers.items()}
        for answer in answers.values():
            if answer.status_code == 403:
                assert "GPU quota reached" in answer.json()["message"], answer.text
                assert "of 0.5 GPU" in answer.json()["message"], answer.text
        states = {k["id"]: k["state"] for k in gateway(hub, "GET", "/api/elastic/kernels", carol).json()}
        assert sorted(states.values()) == ["hibernated", "hibernated", "running"], states

        # Starts sent at once are held the same way: with the medium kernel running, no start fits.
        small = spec_for(hub, carol, "small")
        running = next(k for k, state in states.items() if state == "running")
        hibernate(hub, carol, running)
        barrier = threading.Barrier(3)
        started: list[requests.Response] = []

        def start() -> None:
            barrier.wait()
            started.append(gateway(hub, "POST", "/api/kernels", carol, json={"name": small}))

        threads = [threading.Thread(target=start) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # max_kernels 4 with three hibernated: one start; the others name the kernel limit.
        assert sorted(a.status_code for a in started) == [201, 403, 403], [a.text for a in started]
        assert all("kernel quota reached" in a.json()["message"] for a in started if a.status_code == 403)


def test_a_size_change_over_the_quota_is_refused_before_the_kernel_stops(tmp_path: Path) -> None:
    """``POST .../resize`` at the gateway: the user's sizes and GPU quota are checked first (403
    naming the limit) and the kernel keeps running at its size; a change within them goes through."""
    with running_hub(tmp_path, quota_users=json.dumps({"carol": {"max_gpu": 0.5, "max_kernels": 3}})) as hub:
        carol = hub.login_token("carol")
        kernel_id = start_kernel(hub, carol, "small")
        other = start_kernel(hub, carol, "small")  # 0.25 + 0.25 of carol's 0.5
        path = f"/api/elastic/kernels/{kernel_id}/resize"
        not_offered = gateway(hub, "POST", path, carol, json={"size": "whole"})
        assert not_offered.status_code == 403 and "not offered to you" in not_offered.json()["message"]
        over = gateway(hub, "POST", path, carol, json={"size": "medium"})  # 0.25 + 0.5 > 0.5
        assert over.status_code == 403 and "GPU quota reached" in over.json()["message"], over.text
        model = gateway(hub, "GET", f"/api/elastic/kernels/{kernel_id}", carol).json()
        assert (model["state"], model["profile"]) == ("running", "small")
        assert gateway(hub, "DELETE", f"/api/kernels/{other}", carol).status_code == 204
        within = gateway(hub, "POST", path, carol, json={"size": "medium"})
        assert within.status_code == 200, within.text
        assert (within.json()["state"], within.json()["profile"]) == ("running", "medium")


def test_the_charts_service_monitor_scrapes_the_gateway_served_as_a_hub_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prometheus as the chart's ServiceMonitor (rendered by the real helm) has it scrape in Hub mode:
    the Service's port, ``/metrics`` under the Hub service's base URL, the token of the rendered
    Secret, which the chart gives the gateway as ELASTIC_METRICS_TOKEN and so does the example."""
    import base64

    from prometheus_client.parser import text_string_to_metric_families

    from gateway.config import METRICS_TOKEN_VARIABLE
    from tests.test_helm_chart import only, render

    docs = render({"metrics": {"serviceMonitor": {"enabled": True}}}, tmp_path)  # auth: jupyterhub
    monitor = only(docs, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    ref = endpoint["bearerTokenSecret"]
    token = base64.b64decode(only(docs, "Secret", ref["name"])["data"][ref["key"]]).decode()
    (container,) = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == METRICS_TOKEN_VARIABLE]
    assert env["valueFrom"]["secretKeyRef"] == ref  # the gateway reads the token Prometheus sends
    # The target: the Service's port the monitor names, forwarding to the gateway container's port.
    service = only(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}

    # The example's Hub passes the gateway ELASTIC_METRICS_TOKEN (as the chart does from the Secret).
    monkeypatch.setenv(METRICS_TOKEN_VARIABLE, token)
    with running_hub(tmp_path, users="alice", admins="") as hub:
        path = endpoint["path"]
        assert path == f"{hub.gateway_prefix}/metrics", (path, hub.gateway_prefix)
        # The Service's target is the gateway itself (its port); through the Hub's proxy the same path.
        for url in (f"http://127.0.0.1:{hub.gateway_port}{path}", f"{hub.url}{path}"):
            scraped = requests.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
            assert scraped.status_code == 200, (url, scraped.status_code, scraped.text[:500])
            assert scraped.headers["Content-Type"].startswith("text/plain;"), scraped.headers
            families = {f.name for f in text_string_to_metric_families(scraped.text)}
            assert {"elastic_kernels", "elastic_resume_failures", "elastic_capacity_refusals"} <= families, (
                sorted(families)
            )
            for headers in ({}, {"Authorization": "Bearer not-the-token"}):
                refused = requests.get(url, headers=headers, timeout=60)
                assert refused.status_code in (401, 403), (url, headers, refused.status_code)
                assert "metrics_token" in refused.json()["message"], refused.text
