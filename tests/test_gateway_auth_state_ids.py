"""Kernel pods as each Hub user's own uid and gid, read from their JupyterHub auth state.

A real JupyterHub (with configurable-http-proxy) whose authenticator stores LDAP-like attributes in
the auth state (``enable_auth_state`` with ``JUPYTERHUB_CRYPT_KEY``), the gateway as the Hub's
external service (its token granted ``admin:auth_state`` and ``read:users``), and the real API
server with the runner nodes: users log in through the Hub's form and start kernels with their own
Hub tokens, as a single-user server does.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from tests.support.hub import PASSWORD, Hub, require_proxy  # noqa: E402
from tests.support.node_runner import NodeRunner  # noqa: E402
from tests.support.pod_cluster import PodCluster, pod_cluster  # noqa: E402
from tests.support.server import RunningServer, free_port, isolated_env, launch  # noqa: E402

pytestmark = pytest.mark.timeout(900)

NAMESPACE = "elastic-hub-ids"
SIZE = "python3-gpu-whole"
GATEWAY = "elastic-gateway"
#: The directory's uidNumber/gidNumber per user; carol has no entry (no uid in her auth state).
IDS = {"alice": (5101, 5102), "bob": (5201, 5202), "ada": (5401, 5402)}
#: The admin's map wins over the auth state where it names the user.
ADMIN_MAP = {"ada": {"uid": 5501, "gid": 5502}}

HUB_CONFIG = """
import os
from jupyterhub.auth import DummyAuthenticator

import json

IDS_FILE = {ids_file!r}  # the directory: read at every login, so a test can change it


class DirectoryAuthenticator(DummyAuthenticator):
    \"\"\"Keeps what an LDAP authenticator keeps: the user's attributes, as one-value lists.\"\"\"

    async def authenticate(self, handler, data):
        name = await super().authenticate(handler, data)
        if not name:
            return None
        with open(IDS_FILE) as f:
            found = json.load(f).get(name)
        attributes = {{"cn": [name]}}
        if found:
            attributes.update(uidNumber=[str(found[0])], gidNumber=[str(found[1])])
        return {{"name": name, "auth_state": {{"user_attributes": attributes}}}}


c = get_config()
c.JupyterHub.bind_url = "http://127.0.0.1:{hub_port}"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{api_port}"
c.JupyterHub.db_url = "sqlite:///{state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{state}/cookie_secret"
c.ConfigurableHTTPProxy.pid_file = "{state}/proxy.pid"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.JupyterHub.authenticator_class = DirectoryAuthenticator
c.Authenticator.enable_auth_state = True
c.DummyAuthenticator.password = {password!r}
c.Authenticator.allowed_users = {{"alice", "bob", "carol", "ada"}}
c.JupyterHub.services = [{{"name": "{gateway}", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [
    {{"name": "user", "scopes": ["self", "access:services!service={gateway}"]}},
    {{"name": "gateway-reads-ids", "scopes": ["admin:auth_state", "read:users"], "services": ["{gateway}"]}},
]
"""


@pytest.fixture(scope="module")
def cluster(kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner) -> Iterator[PodCluster]:
    with pod_cluster(kube_plane, kube_api, kube_runner, NAMESPACE) as made:
        yield made


@contextmanager
def running_hub(tmp: Path) -> Iterator[tuple[Hub, str, str, Path]]:
    """The Hub and the gateway service's token (the Hub does not run the gateway here)."""
    proxy = require_proxy()
    tmp.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="ekt-hub-ids-"))
    token = secrets.token_hex(16)
    hub_port, api_port, proxy_api_port = free_port(), free_port(), free_port()
    ids_file = tmp / "directory.json"
    ids_file.write_text(json.dumps(IDS))
    config = tmp / "jupyterhub_config.py"
    config.write_text(
        HUB_CONFIG.format(
            ids_file=str(ids_file),
            hub_port=hub_port,
            api_port=api_port,
            proxy_api_port=proxy_api_port,
            state=state,
            proxy=proxy,
            password=PASSWORD,
            gateway=GATEWAY,
            token=token,
        )
    )
    env = isolated_env(tmp / "home")
    env["JUPYTERHUB_CRYPT_KEY"] = secrets.token_hex(32)
    log_path = tmp / "hub.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(config)],
            cwd=tmp,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    made = Hub(f"http://127.0.0.1:{hub_port}", PASSWORD, "", state, proc, log_path)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"JupyterHub exited:\n{made.log()[-4000:]}")
        try:
            return made.api("GET", "/hub/api/", token).status_code == 200
        except OSError:
            return False

    try:
        wait_for(up, 120, "JupyterHub to answer")
        yield made, f"http://127.0.0.1:{api_port}/hub/api", token, ids_file
    finally:
        stop_hub(made)


def stop_hub(hub: Hub) -> None:
    """SIGTERM the Hub (it stops its proxy), then kill what is left; a stopped one is left as is."""
    proc = hub.proc
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hub, str, str, Path]]:
    with running_hub(tmp_path_factory.mktemp("hub-ids")) as made:
        yield made


def start_gateway(
    home: Path, cluster: PodCluster, api_url: str, service_token: str, **sections: dict[str, Any]
) -> RunningServer:
    config = cluster.config(user_ids=ADMIN_MAP)
    config.update(sections)
    config["ElasticGateway"] = {
        "auth": "jupyterhub",
        "user_ids_from_auth_state": {"uid": "user_attributes.uidNumber", "gid": "user_attributes.gidNumber"},
        "user_ids_refresh_seconds": 0,  # asked again at every start: a changed uid is followed at once
    }
    env = {
        "JUPYTERHUB_API_TOKEN": service_token,
        "JUPYTERHUB_API_URL": api_url,
        "JUPYTERHUB_SERVICE_NAME": GATEWAY,
    }
    proc, log_path, url, env = launch(home, config, env_extra=env, app_module="gateway.app")
    server = RunningServer(url=url, process=proc, home=home, log_path=log_path, env=env)

    def answering() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited:\n{server.log()[-4000:]}")
        try:
            return server.request("GET", "/api/status", token=None).status in (200, 403)
        except OSError:
            return False

    wait_for(answering, 180, "the gateway to answer")
    return server


def test_kernel_pods_run_as_the_uid_in_the_users_auth_state_and_a_user_without_one_is_refused(
    cluster: PodCluster, hub: tuple[Hub, str, str, Path], tmp_path: Path
) -> None:
    the_hub, api_url, service_token, ids_file = hub
    tokens = {user: the_hub.login_token(user) for user in ("alice", "bob", "carol", "ada")}
    server = start_gateway(tmp_path, cluster, api_url, service_token)
    started: list[str] = []
    try:
        # carol's auth state has no uidNumber: refused, saying what the admin must fix.
        refused = server.request("POST", "/api/kernels", {"name": SIZE}, token=tokens["carol"])
        assert refused.status == 403, refused
        message = refused.body["message"]
        assert "user_attributes.uidNumber" in message and "carol" in message, message
        assert not [
            p for p in cluster.pods() if p.metadata.annotations.get("elastic.jupyter.org/owner") == "carol"
        ]

        # alice runs as her own uid and gid; her checkpoint folder is hers.
        reply = server.request("POST", "/api/kernels", {"name": SIZE}, token=tokens["alice"])
        assert reply.status == 201, (reply, server.log()[-3000:])
        started.append(reply.body["id"])
        context = cluster.running_pod(reply.body["id"]).spec.security_context
        assert (context.run_as_user, context.run_as_group, context.fs_group) == (5101, 5102, 5102)
        found = (cluster.checkpoints / "alice").stat()
        assert (found.st_uid, found.st_gid) == (5101, 5102)
        # A resume (no request to take the user from) makes her new pod as her uid again.
        kernel = reply.body["id"]
        for action in ("hibernate", "resume"):
            done = server.request("POST", f"/api/elastic/kernels/{kernel}/{action}", token=tokens["alice"])
            assert done.status == 200, (action, done, server.log()[-3000:])
        context = cluster.running_pod(kernel).spec.security_context
        assert (context.run_as_user, context.run_as_group, context.fs_group) == (5101, 5102, 5102)

        # bob, asking for alice's uid the way Enterprise Gateway clients do, still runs as his own.
        body = {"name": SIZE, "env": {"KERNEL_UID": "5101", "KERNEL_GID": "5102"}}
        reply = server.request("POST", "/api/kernels", body, token=tokens["bob"])
        assert reply.status == 201, (reply, server.log()[-3000:])
        started.append(reply.body["id"])
        context = cluster.running_pod(reply.body["id"]).spec.security_context
        assert (context.run_as_user, context.run_as_group, context.fs_group) == (5201, 5202, 5202)

        # ada is in the admin's user_ids: that wins over her auth state (a CPU kernel: both GPUs are taken).
        reply = server.request("POST", "/api/kernels", {"name": "python3-cpu"}, token=tokens["ada"])
        assert reply.status == 201, (reply, server.log()[-3000:])
        started.append(reply.body["id"])
        context = cluster.running_pod(reply.body["id"]).spec.security_context
        assert (context.run_as_user, context.run_as_group) == (5501, 5502)

        # The directory gives bob another uid; at his next login and start his new pod follows it.
        ids_file.write_text(json.dumps({**IDS, "bob": (5301, 5302)}))
        tokens["bob"] = the_hub.login_token("bob")
        reply = server.request("POST", "/api/kernels", {"name": "python3-cpu"}, token=tokens["bob"])
        assert reply.status == 201, (reply, server.log()[-3000:])
        started.append(reply.body["id"])
        context = cluster.running_pod(reply.body["id"]).spec.security_context
        assert (context.run_as_user, context.run_as_group) == (5301, 5302)
    finally:
        for kernel_id, owner in zip(started, ("alice", "bob", "ada", "bob"), strict=False):
            server.request("DELETE", f"/api/kernels/{kernel_id}", token=tokens[owner])
        for kernel_id in started:
            wait_for(lambda k=kernel_id: cluster.pod_of(k) is None, 120, "the kernel pod to be deleted")
        server.stop()
        for owner in ("alice", "bob", "ada"):
            folder = cluster.checkpoints / owner
            if folder.exists():
                os.chown(folder, os.getuid(), os.getgid())  # as the other tests expect it


def test_while_the_hub_is_unreachable_a_known_user_keeps_their_uid_and_an_unknown_one_is_told_why(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """The Hub's answer is kept past user_ids_refresh_seconds while the Hub cannot be asked: a
    kernel never starts as another uid (run_as_user), and a user whose uid was never read is told
    the Hub is unreachable rather than refused for good."""
    with running_hub(tmp_path / "hub") as (the_hub, api_url, service_token, _):
        tokens = {user: the_hub.login_token(user) for user in ("alice", "bob", "carol")}
        # The gateway's token checks stay cached while the Hub is away (they are HubAuth's, not ours).
        home = tmp_path / "gateway"
        server = start_gateway(home, cluster, api_url, service_token, HubAuth={"cache_max_age": 3600})
        started: list[str] = []
        try:
            reply = server.request("POST", "/api/kernels", {"name": "python3-cpu"}, token=tokens["alice"])
            assert reply.status == 201, (reply, server.log()[-3000:])
            started.append(reply.body["id"])
            context = cluster.running_pod(reply.body["id"]).spec.security_context
            assert (context.run_as_user, context.run_as_group) == (5101, 5102)
            # bob's token is known to the gateway, his uid is not (he has started nothing yet).
            listed = server.request("GET", "/api/kernels", token=tokens["bob"])
            assert listed.status == 200 and listed.body == [], listed

            stop_hub(the_hub)  # the refresh interval (0) has passed: every start asks the Hub again
            with pytest.raises(OSError):
                the_hub.api("GET", "/hub/api/", service_token)

            reply = server.request("POST", "/api/kernels", {"name": "python3-cpu"}, token=tokens["alice"])
            assert reply.status == 201, (reply, server.log()[-3000:])
            started.append(reply.body["id"])
            context = cluster.running_pod(reply.body["id"]).spec.security_context
            assert (context.run_as_user, context.run_as_group) == (5101, 5102)
            assert "alice's uid from the cache: Hub unreachable" in server.log()

            refused = server.request("POST", "/api/kernels", {"name": "python3-cpu"}, token=tokens["bob"])
            assert refused.status == 503, (refused, server.log()[-3000:])
            assert "bob" in refused.body["message"] and "Hub" in refused.body["message"], refused
            assert "could not be asked" in refused.body["message"], refused
            # carol's token was never checked: the Hub's client library says it cannot reach the Hub.
            refused = server.request("POST", "/api/kernels", {"name": "python3-cpu"}, token=tokens["carol"])
            assert 500 <= refused.status < 600, (refused, server.log()[-3000:])
            assert "Failed to connect to Hub API" in refused.body["message"], refused
            owners = {p.metadata.annotations.get("elastic.jupyter.org/owner") for p in cluster.pods()}
            assert not owners & {"bob", "carol"}, owners
        finally:
            for kernel_id in started:
                server.request("DELETE", f"/api/kernels/{kernel_id}", token=tokens["alice"])
            for kernel_id in started:
                wait_for(lambda k=kernel_id: cluster.pod_of(k) is None, 120, "the kernel pod to be deleted")
            server.stop()
            folder = cluster.checkpoints / "alice"
            if folder.exists():
                os.chown(folder, os.getuid(), os.getgid())  # as the other tests expect it


@pytest.mark.parametrize(
    ("keys", "provisioner", "said"),
    [
        ({"gid": "gidNumber"}, {}, "user_ids_from_auth_state must be"),
        ({"uid": "uidNumber"}, {"warm_pods": {"whole": {"count": 1}}}, "warm_pods cannot be used with"),
    ],
)
def test_a_bad_user_ids_from_auth_state_stops_the_gateway_in_one_line(
    cluster: PodCluster,
    hub: tuple[Hub, str, str, Path],
    tmp_path: Path,
    keys: dict[str, str],
    provisioner: dict[str, Any],
    said: str,
) -> None:
    _, api_url, _, _ = hub
    config = cluster.config(**provisioner)
    config["ElasticGateway"] = {"auth": "jupyterhub", "user_ids_from_auth_state": keys}
    env = {
        "JUPYTERHUB_API_TOKEN": "x" * 32,
        "JUPYTERHUB_API_URL": api_url,
        "JUPYTERHUB_SERVICE_NAME": GATEWAY,
    }
    proc, log_path, _, _ = launch(tmp_path, config, env_extra=env, app_module="gateway.app")
    try:
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:  # a gateway that started instead: leave nothing behind
            proc.kill()
            proc.wait()
    assert code == 2
    lines = [line for line in log_path.read_text().splitlines() if said in line]
    assert len(lines) == 1, log_path.read_text()[-3000:]
