"""A real JupyterHub, the shared gateway as its service, two users, driven through the Hub's proxy.

JupyterHub (PyPI) with configurable-http-proxy (npm) runs the project's example configuration
as it is. alice starts her server, opens a notebook session on a GPU size and sets ``x = 41``;
her kernel is hibernated at the gateway; the Hub stops her server and starts it again; the same
notebook gets the same kernel id back and ``x + 1`` answers 42. bob cannot list, read,
hibernate, resume, interrupt, delete or connect to alice's kernel (404 on every path, through
his own server and at the gateway directly), and a start over his quota is refused with a
message that names the limit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import websocket

from tests.support.hub import Hub, running_hub
from tests.support.server import KernelChannel, wait_for

pytestmark = pytest.mark.timeout(600)

NOTEBOOK = "work/analysis.ipynb"


def sized_spec(hub: Hub, user: str, token: str, profile: str) -> str:
    specs = hub.api("GET", f"/user/{user}/api/kernelspecs", token).json()["kernelspecs"]
    for name, spec in specs.items():
        if ((spec["spec"].get("metadata") or {}).get("elastic") or {}).get("profile") == profile:
            return str(name)
    raise AssertionError(f"no {profile} kernelspec offered to {user}: {sorted(specs)}")


def offered_profiles(hub: Hub, user: str, token: str) -> set[str]:
    specs = hub.api("GET", f"/user/{user}/api/kernelspecs", token).json()["kernelspecs"]
    return {
        ((s["spec"].get("metadata") or {}).get("elastic") or {}).get("profile")
        for s in specs.values()
        if ((s["spec"].get("metadata") or {}).get("elastic") or {}).get("profile")
    }


def post_session(hub: Hub, user: str, token: str, path: str, kernel_name: str) -> Any:
    """``POST /api/sessions`` on the user's server, as a notebook opening does."""
    body = {"path": path, "type": "notebook", "name": path, "kernel": {"name": kernel_name}}
    return hub.api("POST", f"/user/{user}/api/sessions", token, json=body)


def open_session(hub: Hub, user: str, token: str, path: str, kernel_name: str) -> dict[str, Any]:
    made = post_session(hub, user, token, path, kernel_name)
    assert made.status_code == 201, made.text
    return dict(made.json())


def run(hub: Hub, user: str, token: str, kernel_id: str, code: str) -> str:
    with KernelChannel(f"{hub.url}/user/{user}", kernel_id, timeout=120, token=token) as channel:
        result = channel.execute(code, timeout=120)
    assert not result.error, result.error
    return result.displays[-1] if result.displays else result.stdout


def gateway(hub: Hub, method: str, path: str, token: str, **kwargs: Any) -> Any:
    return hub.api(method, f"{hub.gateway_prefix}{path}", token, **kwargs)


def test_kernels_outlive_the_users_server_and_stay_private(tmp_path: Path) -> None:
    with running_hub(tmp_path, quota_users=json.dumps({"bob": {"max_kernels": 1}})) as hub:
        assert hub.api("GET", f"{hub.gateway_prefix}/api/kernels", "not-a-hub-token").status_code == 403
        alice = hub.login_token("alice")
        bob = hub.login_token("bob")
        hub.start_server("alice", alice)

        # Sizes offered follow the quota: the default offers small and medium, not whole.
        assert offered_profiles(hub, "alice", alice) == {"small", "medium"}
        session = open_session(hub, "alice", alice, NOTEBOOK, sized_spec(hub, "alice", alice, "small"))
        kernel_id = session["kernel"]["id"]
        assert run(hub, "alice", alice, kernel_id, "x = 41; x") == "41"
        # Neither the gateway's Hub token nor alice's server token reaches her kernel.
        seen = run(hub, "alice", alice, kernel_id, "import os; sorted(k for k in os.environ if 'TOKEN' in k)")
        assert seen == "[]", seen

        model = gateway(hub, "GET", f"/api/elastic/kernels/{kernel_id}", alice).json()
        assert model["owner"] == "alice" and model["profile"] == "small"
        # Her own server relays /api/elastic to the gateway as her (what JupyterLab's extension asks).
        via_server = hub.api("GET", "/user/alice/api/elastic/kernels", alice).json()
        assert [(k["id"], k["owner"]) for k in via_server] == [(kernel_id, "alice")]
        me = hub.api("GET", "/user/alice/api/elastic/me", alice).json()
        assert me["user"] == "alice" and me["admin"] is False, me
        hibernated = gateway(hub, "POST", f"/api/elastic/kernels/{kernel_id}/hibernate", alice)
        assert hibernated.status_code == 200, hibernated.text
        assert hibernated.json()["state"] == "hibernated"

        # The Hub stops alice's server: her kernel stays at the gateway, hibernated.
        hub.stop_server("alice", alice)
        still = gateway(hub, "GET", f"/api/elastic/kernels/{kernel_id}", alice)
        assert still.status_code == 200 and still.json()["state"] == "hibernated", still.text

        # bob: a server of his own, and alice's kernel is nowhere to be seen.
        hub.start_server("bob", bob)
        assert [k["id"] for k in hub.api("GET", "/user/bob/api/kernels", bob).json()] == []
        assert gateway(hub, "GET", "/api/kernels", bob).json() == []
        assert gateway(hub, "GET", "/api/elastic/kernels", bob).json() == []
        for method, path in (
            ("GET", f"/api/kernels/{kernel_id}"),
            ("DELETE", f"/api/kernels/{kernel_id}"),
            ("POST", f"/api/kernels/{kernel_id}/interrupt"),
            ("POST", f"/api/kernels/{kernel_id}/restart"),
            ("GET", f"/api/elastic/kernels/{kernel_id}"),
            ("POST", f"/api/elastic/kernels/{kernel_id}/hibernate"),
            ("POST", f"/api/elastic/kernels/{kernel_id}/resume"),
            ("POST", f"/api/elastic/kernels/{kernel_id}/activity"),
        ):
            answer = gateway(hub, method, path, bob)
            assert answer.status_code == 404, f"{method} {path} as bob: {answer.status_code} {answer.text}"
            assert "message" in answer.json()
        assert hub.api("GET", f"/user/bob/api/kernels/{kernel_id}", bob).status_code == 404
        assert hub.api("GET", "/user/bob/api/elastic/kernels", bob).json() == []
        for method in ("GET", "POST"):
            path = f"/user/bob/api/elastic/kernels/{kernel_id}" + ("/resume" if method == "POST" else "")
            relayed = hub.api(method, path, bob)
            assert relayed.status_code == 404 and "message" in relayed.json(), (path, relayed.text)
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            KernelChannel(f"{hub.url}{hub.gateway_prefix}", kernel_id, timeout=30, token=bob)
        assert refused.value.status_code == 404
        with pytest.raises(websocket.WebSocketBadStatusException) as refused_via_server:
            KernelChannel(f"{hub.url}/user/bob", kernel_id, timeout=30, token=bob)
        assert refused_via_server.value.status_code == 404
        # ... and alice's kernel is untouched by all of that.
        assert gateway(hub, "GET", f"/api/elastic/kernels/{kernel_id}", alice).json()["state"] == "hibernated"

        # bob's quota: one kernel; a second start is refused with the limit and what he holds.
        bob_spec = sized_spec(hub, "bob", bob, "small")
        open_session(hub, "bob", bob, "first.ipynb", bob_spec)
        over = post_session(hub, "bob", bob, "second.ipynb", bob_spec)
        assert over.status_code == 403, over.text
        assert "kernel quota reached: you have 1 of 1 kernels" in over.json()["message"]
        # Every way his server starts a kernel at the gateway says the gateway's own words, not
        # jupyter_server's "Error from Gateway: [%s] %s. Ensure gateway url is valid...".
        direct = hub.api("POST", "/user/bob/api/kernels", bob, json={"name": bob_spec})
        assert direct.status_code == 403, direct.text
        assert direct.json()["message"].startswith("kernel quota reached: you have 1 of 1 kernels"), (
            direct.text
        )
        assert "%s" not in direct.text and "Ensure gateway url" not in direct.text
        first = next(
            s for s in hub.api("GET", "/user/bob/api/sessions", bob).json() if s["path"] == "first.ipynb"
        )
        changed = hub.api(
            "PATCH", f"/user/bob/api/sessions/{first['id']}", bob, json={"kernel": {"name": bob_spec}}
        )
        assert "kernel quota reached: you have 1 of 1 kernels" in changed.json()["message"], changed.text
        assert "Ensure gateway url" not in changed.text
        whole = gateway(hub, "POST", "/api/kernels", bob, json={"name": bob_spec.replace("small", "whole")})
        assert whole.status_code in (403, 404), whole.text

        # alice comes back: the same notebook gets the same kernel, which resumes with x.
        hub.start_server("alice", alice)
        sessions = hub.api("GET", "/user/alice/api/sessions", alice).json()
        assert [(s["path"], s["kernel"]["id"]) for s in sessions] == [(NOTEBOOK, kernel_id)]
        again = open_session(hub, "alice", alice, NOTEBOOK, sized_spec(hub, "alice", alice, "small"))
        assert again["kernel"]["id"] == kernel_id
        assert run(hub, "alice", alice, kernel_id, "x + 1") == "42"
        assert gateway(hub, "GET", f"/api/elastic/kernels/{kernel_id}", alice).json()["state"] == "running"


def test_gpu_quota_counts_running_kernels_only_and_guards_resumes(tmp_path: Path) -> None:
    """Hibernated kernels hold no GPU; resuming one takes GPU again, so it must fit the quota."""
    with running_hub(tmp_path, quota_users=json.dumps({"carol": {"max_gpu": 0.5}}), admins="ada") as hub:
        carol = hub.login_token("carol")
        ada = hub.login_token("ada")
        hub.start_server("carol", carol)
        small = open_session(hub, "carol", carol, "small.ipynb", sized_spec(hub, "carol", carol, "small"))
        small_id = small["kernel"]["id"]
        assert run(hub, "carol", carol, small_id, "y = 7; y") == "7"
        medium_spec = sized_spec(hub, "carol", carol, "medium")
        over = post_session(hub, "carol", carol, "medium.ipynb", medium_spec)
        assert over.status_code == 403, over.text
        assert "GPU quota reached: your running kernels hold 0.25 of 0.5 GPU" in over.json()["message"]

        assert gateway(hub, "POST", f"/api/elastic/kernels/{small_id}/hibernate", carol).status_code == 200
        medium = open_session(hub, "carol", carol, "medium.ipynb", medium_spec)  # fits now
        medium_id = medium["kernel"]["id"]
        assert run(hub, "carol", carol, medium_id, "z = 1; z") == "1"

        refused = gateway(hub, "POST", f"/api/elastic/kernels/{small_id}/resume", carol)
        assert refused.status_code == 403, refused.text
        assert "GPU quota reached" in refused.json()["message"]
        with KernelChannel(f"{hub.url}/user/carol", small_id, timeout=120, token=carol) as channel:
            cell = channel.execute("y", timeout=120)  # the next cell's resume is refused the same way
        assert "GPU quota reached" in cell.error, cell
        assert gateway(hub, "GET", f"/api/elastic/kernels/{small_id}", carol).json()["state"] == "hibernated"

        # An admin sees every user's kernels; carol frees GPU and her notebook comes back.
        seen = {k["id"]: k["owner"] for k in gateway(hub, "GET", "/api/elastic/kernels", ada).json()}
        assert seen == {small_id: "carol", medium_id: "carol"}
        by_admin = gateway(hub, "POST", f"/api/elastic/kernels/{medium_id}/hibernate", ada)
        assert by_admin.status_code == 200, by_admin.text
        # JupyterLab's GPUs panel: the all-GPUs view and the GPU-hours released are for admins only.
        assert gateway(hub, "GET", "/api/elastic/me", ada).json()["admin"] is True
        assert gateway(hub, "GET", "/api/elastic/me", ada).json()["gpu_hours_released"]["small"] > 0
        assert gateway(hub, "GET", "/api/elastic/me", carol).json() == {
            "user": "carol",
            "admin": False,
            "gpu_hours_released": None,
            "gpus_released_now": None,
        }
        assert run(hub, "carol", carol, small_id, "y + 1") == "8"


def test_a_quota_change_takes_effect_without_restarting_the_gateway(tmp_path: Path) -> None:
    """The gateway re-reads its live file (ElasticKernels.live_config_file, the chart's live
    ConfigMap): a higher quota admits the next start, a new idle timeout is the policy, in the same
    gateway process; an invalid change is refused and the previous quota stays."""
    live = tmp_path / "live_config.json"
    live.write_text(json.dumps({"ElasticQuota": {"users": {"bob": {"max_kernels": 1}}}}))
    with running_hub(tmp_path / "hub", live_config=live) as hub:
        bob = hub.login_token("bob")
        hub.start_server("bob", bob)
        spec = sized_spec(hub, "bob", bob, "small")
        first = gateway(hub, "POST", "/api/kernels", bob, json={"name": spec})
        assert first.status_code == 201, first.text
        over = gateway(hub, "POST", "/api/kernels", bob, json={"name": spec})
        assert over.status_code == 403 and "you have 1 of 1 kernels" in over.json()["message"], over.text

        live.write_text(
            json.dumps(
                {"ElasticQuota": {"users": {"bob": {"max_kernels": 2}}}, "CullPolicy": {"idle_timeout": 1234}}
            )
        )
        wait_for(
            lambda: gateway(hub, "GET", "/api/elastic/policy", bob).json()["idle_timeout"] == 1234,
            60,
            what="the live change to be applied",
        )
        assert gateway(hub, "POST", "/api/kernels", bob, json={"name": spec}).status_code == 201
        over = gateway(hub, "POST", "/api/kernels", bob, json={"name": spec})
        assert over.status_code == 403 and "you have 2 of 2 kernels" in over.json()["message"], over.text

        live.write_text(json.dumps({"ElasticQuota": {"users": {"bob": {"max_kernels": -1}}}}))
        wait_for(lambda: "Live configuration refused" in hub.log(), 60, what="the bad change to be refused")
        assert "max_kernels must be a whole number" in hub.log()
        over = gateway(hub, "POST", "/api/kernels", bob, json={"name": spec})
        assert over.status_code == 403 and "you have 2 of 2 kernels" in over.json()["message"], over.text
        # The same gateway throughout: a restart would have hibernated the first kernel.
        model = gateway(hub, "GET", f"/api/elastic/kernels/{first.json()['id']}", bob).json()
        assert model["state"] == "running", model
        assert hub.log().count("Live configuration reloaded") == 1


def test_one_users_checkpoints_cannot_fill_the_volume_for_another(tmp_path: Path) -> None:
    """Issue 48: alice's checkpoint quota on a shared 64 MiB volume. Her second hibernation is
    refused before it writes (naming the checkpoint that holds her space) and her kernel keeps
    running; bob, beside her, still hibernates; each sees only their own checkpoints, an admin
    every user's and the volume's free space."""
    quotas = json.dumps({"alice": {"max_checkpoint_bytes": "16Mi"}})
    with running_hub(tmp_path, quota_users=quotas, admins="ada", checkpoint_volume="64m") as hub:
        alice, bob, ada = (hub.login_token(user) for user in ("alice", "bob", "ada"))
        held: dict[str, list[str]] = {}
        for user, token in (("alice", alice), ("bob", bob)):
            hub.start_server(user, token)
            spec = sized_spec(hub, user, token, "small")
            for notebook in ("one.ipynb", "two.ipynb"):
                kernel_id = open_session(hub, user, token, notebook, spec)["kernel"]["id"]
                assert run(hub, user, token, kernel_id, "blob = bytearray(10 * 2**20); len(blob)") == str(
                    10 * 2**20
                )
                held.setdefault(user, []).append(kernel_id)
        first, second = held["alice"]
        assert gateway(hub, "POST", f"/api/elastic/kernels/{first}/hibernate", alice).status_code == 200
        refused = gateway(hub, "POST", f"/api/elastic/kernels/{second}/hibernate", alice)
        assert refused.status_code == 403, refused.text
        message = refused.json()["message"]
        assert "checkpoint quota reached" in message and "over your quota of 16 MiB" in message
        assert first[:8] in message, message
        assert gateway(hub, "GET", f"/api/elastic/kernels/{second}", alice).json()["state"] == "running"
        assert run(hub, "alice", alice, second, "len(blob)") == str(10 * 2**20)
        # bob's hibernations are his own business: both go through.
        for kernel_id in held["bob"]:
            assert gateway(hub, "POST", f"/api/elastic/kernels/{kernel_id}/hibernate", bob).status_code == 200

        mine = gateway(hub, "GET", "/api/elastic/storage", alice).json()
        assert mine["volume"] is None, "the volume's free space is for admins"
        assert [(o["owner"], o["quota_bytes"]) for o in mine["owners"]] == [("alice", 16 * 2**20)]
        assert [c["kernel_id"] for c in mine["owners"][0]["checkpoints"]] == [first]
        his = gateway(hub, "GET", "/api/elastic/storage", bob).json()
        assert [o["owner"] for o in his["owners"]] == ["bob"]
        assert {c["kernel_id"] for c in his["owners"][0]["checkpoints"]} == set(held["bob"])
        everyone = gateway(hub, "GET", "/api/elastic/storage", ada).json()
        assert {"alice", "bob"} <= {o["owner"] for o in everyone["owners"]}
        assert everyone["volume"]["total_bytes"] == 64 * 2**20
        # bob cannot free alice's space for her, nor read which kernels hold it.
        assert gateway(hub, "DELETE", f"/api/kernels/{first}", bob).status_code == 404
        # alice discards her hibernated kernel: her running one hibernates now.
        assert gateway(hub, "DELETE", f"/api/kernels/{first}", alice).status_code == 204
        assert gateway(hub, "POST", f"/api/elastic/kernels/{second}/hibernate", alice).status_code == 200
        assert run(hub, "alice", alice, second, "len(blob)") == str(10 * 2**20)
