"""Users together cannot get the shared gateway killed for memory (issue 48).

A real JupyterHub with the gateway as its service; the gateway moved into a memory cgroup as a
pod's limit would hold it. Messages a notebook sends to a kernel that is hibernated wait in the
gateway's memory until the kernel is back; here no kernel can come back (every GPU is taken), so
they keep waiting. Four users send 128 MiB each to two hibernated kernels: the gateway, whose
caps default to a quarter of its memory limit (half of that per user), holds what fits, refuses
the rest with a reply that says which cap, is never OOM-killed and keeps answering.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket

from tests.support.cgroup import memory_cgroup, peak_rss
from tests.support.hub import Hub, gateway_pid, running_hub
from tests.support.server import KernelChannel, process_alive, wait_for

pytestmark = pytest.mark.timeout(900)

MiB = 2**20
#: The gateway's memory limit here: half the chart's pod limit, so the old 1 GiB cap was twice it.
LIMIT = 512 * MiB
MESSAGE = 4 * MiB
#: Per hibernated kernel: one connection's own cap (64 MiB), two kernels per user.
PER_KERNEL = 16
HOLDERS = ("hana", "hugo", "hiro", "hedy")
SCRAPE_TOKEN = "prometheus-scrape-token-for-the-memory-test"


def gateway(hub: Hub, method: str, path: str, token: str, **kwargs: Any) -> requests.Response:
    return hub.api(method, f"{hub.gateway_prefix}{path}", token, **kwargs)


def start(hub: Hub, token: str, size: str) -> str:
    specs = gateway(hub, "GET", "/api/kernelspecs", token).json()["kernelspecs"]
    name = next(
        n
        for n, s in specs.items()
        if (s["spec"].get("metadata") or {}).get("elastic", {}).get("profile") == size
    )
    started = gateway(hub, "POST", "/api/kernels", token, json={"name": name})
    assert started.status_code == 201, started.text
    return str(started.json()["id"])


def held_bytes(hub: Hub) -> float:
    """The gateway's own count of what it holds (``elastic_held_message_bytes``)."""
    scraped = requests.get(
        f"{hub.url}{hub.gateway_prefix}/metrics",
        headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"},
        timeout=60,
    )
    assert scraped.status_code == 200, scraped.text
    found = re.search(r"^elastic_held_message_bytes (\S+)$", scraped.text, re.M)
    assert found, scraped.text[:2000]
    return float(found.group(1))


def read_refusals(channel: KernelChannel, refused: dict[str, int]) -> None:
    """Count the refusals that arrived on ``channel`` by the cap they name (what is there now)."""
    while True:
        try:
            msg = channel.recv(deadline=time.monotonic() + 0.5)
        except (TimeoutError, websocket.WebSocketTimeoutException):
            return
        if msg["msg_type"] == "execute_reply" and msg["content"].get("ename") == "KernelQueueFull":
            cap = re.search(r"ElasticWebsocketConnection\.(\w+)", msg["content"]["evalue"])
            assert cap, msg["content"]
            refused[cap.group(1)] = refused.get(cap.group(1), 0) + 1


def test_users_holding_messages_for_sleeping_kernels_cannot_get_the_gateway_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_METRICS_TOKEN", SCRAPE_TOKEN)  # the example hands it to the gateway
    quota = {"filler": {"max_gpu": 2, "max_kernels": 2, "profiles": ["whole"]}}
    with running_hub(tmp_path, quota_users=json.dumps(quota), users=",".join([*HOLDERS, "filler"])) as hub:
        tokens = {user: hub.login_token(user) for user in [*HOLDERS, "filler"]}
        sleeping: dict[str, list[str]] = {}
        for user in HOLDERS:
            sleeping[user] = [start(hub, tokens[user], "small") for _ in range(2)]
            for kernel_id in sleeping[user]:
                done = gateway(hub, "POST", f"/api/elastic/kernels/{kernel_id}/hibernate", tokens[user])
                assert done.status_code == 200, done.text
        for _ in range(2):  # both GPUs whole: every resume waits for a slice
            start(hub, tokens["filler"], "whole")
        pid = gateway_pid(hub.gateway_port)
        assert pid is not None
        with memory_cgroup(LIMIT) as group:
            group.add(pid)  # before any kernel websocket: the caps are read from it at the first
            refused: dict[str, int] = {}
            sent = 0
            channels = []
            for user in HOLDERS:
                for kernel_id in sleeping[user]:
                    channel = KernelChannel(
                        f"{hub.url}{hub.gateway_prefix}", kernel_id, timeout=120, token=tokens[user]
                    )
                    channels.append(channel)
                    for i in range(PER_KERNEL):
                        code = f"# {user} {i}\n" + "#" * MESSAGE
                        channel.send("execute_request", {"code": code, "silent": False})
                        sent += 1

            # A refused cell is answered at once (an error reply naming the cap); a held one waits,
            # counted by the gateway: until every message sent is one or the other.
            def accounted() -> bool:
                for channel in channels:
                    read_refusals(channel, refused)
                return sum(refused.values()) + int(held_bytes(hub) // MESSAGE) >= sent

            wait_for(accounted, 300, what="every message held or refused")
            held = held_bytes(hub)
            assert process_alive(pid) and gateway_pid(hub.gateway_port) == pid
            assert group.oom_kills() == 0
            # Its whole size (what it held before the move is not charged to the group here).
            assert peak_rss(pid) < LIMIT, (peak_rss(pid), refused)
            # What fits a quarter of the limit is held; the rest was refused, naming the caps.
            assert 0 < held <= LIMIT // 4, (held, refused)
            assert sum(refused.values()) > 0 and set(refused) <= {
                "max_queued_bytes",  # one connection's (its 16th message, with its header)
                "max_queued_bytes_per_user",
                "max_queued_bytes_total",
            }, refused
            # And it answers everyone.
            for user in HOLDERS:
                assert gateway(hub, "GET", "/api/elastic/kernels", tokens[user]).status_code == 200
            print(
                f"peak RSS {peak_rss(pid) / MiB:.0f} MiB of {LIMIT / MiB:.0f}; "
                f"held {held / MiB:.0f} MiB; refused {refused}"
            )
            for channel in channels:
                channel.close()
