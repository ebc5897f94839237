"""A real JupyterHub (with configurable-http-proxy) running the project's local example.

Started as a subprocess with ``examples/jupyterhub/local/jupyterhub_config.py`` exactly as the
example's README runs it, on free ports, with its state in a temporary folder. Users log in
through the Hub's login form (the test authenticator) and get API tokens from the Hub's REST
API, as a person with a browser would.

The gateway runs each user's kernels as that user's OS account (the example's default), so the
tests run as root (as CI does) and create the accounts they need: Hub user ``alice`` runs as
``ekt-alice`` (:func:`ensure_accounts`, idempotent). Those accounts must be able to run this
interpreter and read the Hub's state folder: :func:`make_enterable` adds ``o+x`` (enter, not
list) to the folders above them that lack it (``/root`` where the interpreter lives under it).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.server import free_port, isolated_env

REPO = Path(__file__).resolve().parents[2]
HUB_CONFIG = REPO / "examples" / "jupyterhub" / "local" / "jupyterhub_config.py"
PASSWORD = "elastic-test-password"
CHP_CACHE = Path.home() / ".cache" / "jupyter-elastic-kernels" / "chp" / "node_modules" / ".bin"
#: The OS account each Hub user's kernels run as (``ElasticGateway.kernel_account``).
ACCOUNT_TEMPLATE = "ekt-{username}"


def account_of(user: str) -> str:
    return ACCOUNT_TEMPLATE.format(username=user)


def require_root() -> None:
    """Per-user kernels need a root gateway (setuid) and accounts made with useradd."""
    if os.geteuid() == 0 and shutil.which("useradd"):
        return
    message = "the gateway's per-user kernels need root and useradd (run the tests as root, as CI does)"
    if os.environ.get("ELASTIC_REQUIRE_JUPYTERHUB"):
        pytest.fail(message)
    pytest.skip(message)


def ensure_accounts(users: list[str]) -> dict[str, pwd.struct_passwd]:
    """The test accounts of ``users`` (``ekt-<user>``), created when missing: no home, no login."""
    require_root()
    found = {}
    for user in users:
        name = account_of(user)
        try:
            found[user] = pwd.getpwnam(name)
            continue
        except KeyError:
            pass
        made = subprocess.run(
            ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
        )
        if made.returncode not in (0, 9):  # 9: made meanwhile (another test run)
            raise AssertionError(f"useradd {name} failed: {made.stderr}")
        found[user] = pwd.getpwnam(name)
    for tool in (Path(sys.executable).parent, Path(sys.executable).resolve().parent, REPO):
        make_enterable(tool)  # the accounts run this interpreter and import this checkout
    return found


def make_enterable(path: Path) -> None:
    """Add ``o+x`` to every folder from ``/`` to ``path`` that lacks it (enter, not list)."""
    for folder in (*reversed(path.parents), path):
        mode = os.stat(folder).st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)


def proxy_command() -> str | None:
    """configurable-http-proxy: ELASTIC_HUB_PROXY, the project's cache (.ci/run), or PATH."""
    for candidate in (os.environ.get("ELASTIC_HUB_PROXY"), str(CHP_CACHE / "configurable-http-proxy")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("configurable-http-proxy")


def require_proxy() -> str:
    found = proxy_command()
    if found is None:
        message = (
            "configurable-http-proxy is not installed (npm install configurable-http-proxy; .ci/run does)"
        )
        if os.environ.get("ELASTIC_REQUIRE_JUPYTERHUB"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class HubClient:
    """What a person (or a script) does with a Hub at ``url``: log in, get a token, start a server."""

    url: str
    password: str = PASSWORD

    def log(self) -> str:
        """What the Hub wrote, for failure messages."""
        return ""

    def api(
        self, method: str, path: str, token: str, timeout: float = 60, **kwargs: Any
    ) -> requests.Response:
        return requests.request(
            method,
            f"{self.url}{path}",
            headers={"Authorization": f"token {token}"},
            timeout=timeout,
            **kwargs,
        )

    def login_token(self, user: str) -> str:
        """Log in through the Hub's form, then ask the Hub for an API token for this user."""
        session = requests.Session()
        page = session.get(f"{self.url}/hub/login", timeout=30)
        xsrf = session.cookies.get("_xsrf") or re.search(r'name="_xsrf" value="([^"]+)"', page.text).group(1)
        done = session.post(
            f"{self.url}/hub/login?next=",
            data={"username": user, "password": self.password, "_xsrf": xsrf},
            timeout=30,
            allow_redirects=False,
        )
        assert done.status_code in (302, 303), f"login of {user} failed: {done.status_code} {done.text[:300]}"
        # A browser goes on to a page, which hands it the XSRF cookie of its logged-in session:
        # JupyterHub 5.0 and 5.1 set the login response's cookie for the session before its
        # session cookie existed, so that one fails every later POST ("XSRF cookie does not match").
        home = session.get(f"{self.url}/hub/home", timeout=30)
        assert home.status_code == 200, f"{user}'s Hub home page: {home.status_code} {home.text[:300]}"
        made = session.post(
            f"{self.url}/hub/api/users/{user}/tokens",
            json={"note": "elastic test"},
            headers={"X-XSRFToken": session.cookies.get("_xsrf") or xsrf},
            timeout=30,
        )
        assert made.status_code == 201, made.text
        return str(made.json()["token"])

    def start_server(
        self, user: str, token: str, timeout: float = 90, options: dict[str, Any] | None = None
    ) -> None:
        started = self.api("POST", f"/hub/api/users/{user}/server", token, json=options)
        assert started.status_code in (201, 202, 400), started.text  # 400: already running
        self._wait_server(user, token, ready=True, timeout=timeout)

    def stop_server(self, user: str, token: str, timeout: float = 90) -> None:
        stopped = self.api("DELETE", f"/hub/api/users/{user}/server", token)
        assert stopped.status_code in (202, 204), stopped.text
        self._wait_server(user, token, ready=False, timeout=timeout)

    def _wait_server(self, user: str, token: str, ready: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.api("GET", f"/hub/api/users/{user}", token).json()
            server = (model.get("servers") or {}).get("")
            if ready and server and server.get("ready"):
                return
            if not ready and not server:
                return
            time.sleep(0.5)
        raise AssertionError(
            f"{user}'s server did not become {'ready' if ready else 'stopped'}:\n{self.log()[-4000:]}"
        )


@dataclass
class Hub(HubClient):
    """A Hub started here as a process (:func:`running_hub`)."""

    gateway_prefix: str = ""
    state: Path = Path()
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = Path()
    gateway_port: int = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


#: JupyterHub 5 gives a managed service a fixed ~10 s to answer, then exits ("Cannot connect to
#: managed service"); JupyterHub 6 waits ``timeout`` (30 s). On a loaded machine the gateway's start
#: can take longer than 10 s: the Hub is then started again, at most this many times in all.
HUB_STARTS = 4
#: How each version says it (JupyterHub 6 swaps the service's name and kind in the line).
MANAGED_SERVICE_TIMED_OUT = re.compile(r"Cannot connect to (managed service|\S+ service managed)")


@contextmanager
def running_hub(
    tmp: Path,
    quota_users: str = "",
    users: str = "alice,bob,carol,ada",
    admins: str = "",
    live_config: Path | None = None,
    checkpoint_volume: str = "",
) -> Iterator[Hub]:
    """The example's Hub and gateway; each user's kernels run as ``ekt-<user>``. With
    ``checkpoint_volume`` (a size, "64m"), the checkpoints go to a tmpfs of that size (root only)."""
    proxy = require_proxy()
    ensure_accounts(users.split(","))
    tmp.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, HUB_STARTS + 1):
        # Outside pytest's own folders (0700): kernels reach their checkpoints and runtime files here.
        state = Path(tempfile.mkdtemp(prefix="ekt-hub-"))
        state.chmod(0o711)
        make_enterable(state)
        if checkpoint_volume:
            mount_volume(state / "checkpoints", checkpoint_volume)
        log_path = tmp / ("hub.log" if attempt == 1 else f"hub-{attempt}.log")
        hub = _launch(tmp, state, log_path, proxy, quota_users, users, admins, live_config)
        try:
            up = _wait_up(hub)
        except BaseException:
            _stop(hub)
            _remove(state)
            raise
        if up:
            break
        _stop(hub)
        _remove(state)
    else:
        raise AssertionError(f"JupyterHub exited {HUB_STARTS} times:\n{hub.log()[-4000:]}")
    try:
        yield hub
    finally:
        _stop(hub)
        _remove(state)


def mount_volume(path: Path, size: str) -> None:
    """A tmpfs of ``size`` at ``path``, which everyone may pass through (kernels run as users)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0711", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")


def _remove(state: Path) -> None:
    """The Hub's state folder, and the volume mounted in it if there is one."""
    if (state / "checkpoints").is_mount():
        subprocess.run(["umount", "-l", str(state / "checkpoints")], capture_output=True)
    shutil.rmtree(state, ignore_errors=True)


def _launch(
    tmp: Path,
    state: Path,
    log_path: Path,
    proxy: str,
    quota_users: str,
    users: str,
    admins: str,
    live_config: Path | None = None,
) -> Hub:
    env = isolated_env(tmp / "jupyter-home")
    hub_port, api_port, proxy_api_port, gateway_port = (free_port() for _ in range(4))
    env.update(
        ELASTIC_HUB_STATE=str(state),
        ELASTIC_HUB_PORT=str(hub_port),
        ELASTIC_HUB_API_PORT=str(api_port),
        ELASTIC_HUB_PROXY_API_PORT=str(proxy_api_port),
        ELASTIC_GATEWAY_PORT=str(gateway_port),
        ELASTIC_HUB_PROXY=proxy,
        ELASTIC_HUB_PASSWORD=PASSWORD,
        ELASTIC_HUB_USERS=users,
        ELASTIC_HUB_ADMINS=admins,
        ELASTIC_HUB_ALLOW_ROOT="1" if os.geteuid() == 0 else "",
        ELASTIC_QUOTA_USERS=quota_users,
        # The gateway's live file (quotas, cull policy), re-read twice a second here.
        ELASTIC_LIVE_CONFIG=str(live_config or ""),
        ELASTIC_LIVE_CONFIG_INTERVAL="0.5",
        ELASTIC_KERNEL_ACCOUNT=ACCOUNT_TEMPLATE,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    env.pop("JUPYTERHUB_API_TOKEN", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(HUB_CONFIG)],
            cwd=tmp,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{hub_port}"
    return Hub(url, PASSWORD, "/services/elastic-gateway", state, proc, log_path, gateway_port)


def _wait_up(hub: Hub) -> bool:
    """True once the Hub routes to its gateway; False when JupyterHub 5 gave up on the gateway's
    start (to be started again); raises for anything else. The bound is generous: on a loaded
    2-core machine (the real node's tests beside it) the gateway's start took over 90 s."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if hub.proc.poll() is not None:
            if MANAGED_SERVICE_TIMED_OUT.search(hub.log()):
                return False
            raise AssertionError(f"JupyterHub exited:\n{hub.log()[-4000:]}")
        try:
            status = requests.get(f"{hub.url}/services/elastic-gateway/api/status", timeout=5).status_code
            if status in (200, 403):
                return True
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the Hub or its gateway did not come up:\n{hub.log()[-4000:]}")


def _stop(hub: Hub) -> None:
    """SIGTERM the Hub (it stops its servers, service and proxy), then kill what is left."""
    proc = hub.proc
    if proc.poll() is None:
        proc.terminate()
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    _kill_gateway(hub.gateway_port)


def _kill_gateway(port: int) -> None:
    """Kill the Hub's gateway on ``port`` if it outlived the Hub: a Hub that gives up on its managed
    service exits without stopping it, and the service runs in a session of its own."""
    pid = gateway_pid(port)
    if pid is not None:
        with suppress(ProcessLookupError):
            os.kill(pid, 9)


def gateway_pid(port: int) -> int | None:
    """The process id of the Hub's gateway service listening on ``port``, or None."""
    wanted = f"--ServerApp.port={port}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gateway.app" in argv and wanted in argv:
            return int(entry.name)
    return None
