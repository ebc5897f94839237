"""The JupyterHub images of the test cluster (issue 46), built here and run in real containers.

``scripts/images.sh export-hub`` builds the hub (JupyterHub, KubeSpawner, this package), proxy
(configurable-http-proxy on Debian's Node.js) and single-user (jupyterhub-singleuser, JupyterLab with
this package's extension and gateway-aware managers) images and writes them as OCI archives; they are
imported into a private containerd (:mod:`tests.support.containerd`) and run with ``ctr``: each
image's tools answer as its own user, and the Hub, started by its image's own command with a mounted
``jupyterhub_config.py`` as z2jh mounts one, registers itself with the proxy container and answers
through it.

Needs root and buildah, mmdebstrap, npm, containerd, runc, ctr: skipped without them, failed instead
with ``ELASTIC_REQUIRE_NODE=1`` (CI).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernelmgr import __version__
from tests.support.containerd import Containerd, require_node_tools
from tests.support.kube import free_port
from tests.test_images import HOW, IMAGES_SCRIPT, TOOLS, check_project_labels, images_script

# A cold build makes a second Debian base (with nodejs) and installs JupyterLab: well over the kernel
# image's budget on the 2-core CI machine, with the real-node tests beside it.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

HUB_TOOLS = (*TOOLS, "npm")
WHICH = ("hub", "proxy", "singleuser")
_run_ids = itertools.count()


def pinned(name: str) -> str:
    """A version the script pins (``NAME="x.y.z"`` in scripts/images.sh)."""
    found = re.search(rf'^{name}="([^"]+)"$', IMAGES_SCRIPT.read_text(), re.MULTILINE)
    assert found, f"scripts/images.sh pins no {name}"
    return found.group(1)


@pytest.fixture(scope="module")
def archives() -> dict[str, Path]:
    """The three images as OCI archives (built here, or the cached ones if nothing changed)."""
    require_node_tools(HUB_TOOLS, what="the JupyterHub image tests", how=HOW)
    paths = [Path(path) for path in images_script("export-hub").split()]
    assert len(paths) == 3, paths
    return dict(zip(WHICH, paths, strict=True))


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    require_node_tools(HUB_TOOLS, what="the JupyterHub image tests", how=HOW)
    # A short path: containerd's shim sockets and overlay mount options are length-limited.
    directory = Path(f"/tmp/ekh-{os.getpid()}")
    try:
        with Containerd(directory) as running:
            yield running
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def images(archives: dict[str, Path], containerd: Containerd) -> dict[str, str]:
    names = {which: containerd.import_image(archive) for which, archive in archives.items()}
    assert all(names.values()), f"an archive brought no image name: {names}"
    return {which: found[0] for which, found in names.items()}


def run(containerd: Containerd, image: str, argv: list[str], tmp_path: Path, timeout: float = 300) -> str:
    """Run ARGV in IMAGE (its own user and working directory) to its end; what it printed."""
    container_id = f"hubimg-{os.getpid()}-{next(_run_ids)}"
    log = tmp_path / f"{container_id}.log"
    proc = containerd.run_detached(image, container_id, argv, log=log)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        containerd.kill(container_id)
        proc.wait(timeout=60)
        raise AssertionError(f"{argv} in {image} did not end in {timeout} s: {log.read_text()}") from None
    out = log.read_text()
    assert code == 0, f"{argv} in {image} exited {code}: {out}"
    return out


def plain(text: str) -> str:
    """TEXT without its terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def get_json(url: str, token: str | None = None) -> tuple[int, object]:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, None
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        return status, None


def wait_until(what: str, check: Callable[[], object], timeout: float, logs: list[Path]) -> object:
    """Poll CHECK until it returns something true; its value."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except (OSError, ValueError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs if log.exists())
            raise AssertionError(f"no {what} in {timeout} s\n{tails}")
        time.sleep(0.5)


def test_image_names_follow_the_package_version() -> None:
    assert images_script("names-hub").split() == [
        f"localhost/jupyter-elastic-kernels-hub:{__version__}",
        f"localhost/jupyter-elastic-kernels-proxy:{__version__}",
        f"localhost/jupyter-elastic-kernels-singleuser:{__version__}",
    ]


def test_the_hub_image_has_jupyterhub_kubespawner_and_this_package(
    containerd: Containerd, images: dict[str, str], tmp_path: Path
) -> None:
    assert run(containerd, images["hub"], ["jupyterhub", "--version"], tmp_path).strip() == pinned(
        "JUPYTERHUB_VERSION"
    )
    code = (
        # (yaml: z2jh's hub configuration reads its values.yaml with it)
        "import os, kubespawner, jupyterhub_idle_culler, pycurl, yaml, kernelmgr, gateway;"
        "print(os.getuid(), os.getgid(), os.getcwd(), os.access('.', os.W_OK), kernelmgr.__version__)"
    )
    out = run(containerd, images["hub"], ["python", "-c", code], tmp_path)
    # uid 1000, in the folder that holds the sqlite database and the cookie secret, which it may write.
    assert out.split() == ["1000", "100", "/srv/jupyterhub", "True", __version__], out


def test_the_proxy_image_runs_configurable_http_proxy_as_nobody(
    containerd: Containerd, images: dict[str, str], tmp_path: Path
) -> None:
    out = run(containerd, images["proxy"], ["configurable-http-proxy", "--version"], tmp_path)
    assert out.strip() == pinned("CHP_VERSION")
    assert run(containerd, images["proxy"], ["id", "-u"], tmp_path).strip() == "65534"


def test_the_hub_registers_with_the_proxy_and_answers_through_it(
    containerd: Containerd, images: dict[str, str], tmp_path: Path
) -> None:
    """The z2jh layout on the host network: the proxy container with its API, the Hub container from
    its image's own command with a mounted config that does not start a proxy but uses that one."""
    token = os.urandom(16).hex()
    public, api, hub = free_port(), free_port(), free_port()
    config_dir = tmp_path / "hub-config"
    config_dir.mkdir()
    config_dir.chmod(0o755)
    config = config_dir / "jupyterhub_config.py"
    config.write_text(
        "c = get_config()  # noqa\n"
        f'c.JupyterHub.bind_url = "http://127.0.0.1:{public}"\n'
        f'c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub}"\n'
        "c.ConfigurableHTTPProxy.should_start = False\n"
        f'c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api}"\n'
        'c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"\n'
        'c.JupyterHub.authenticator_class = "dummy"\n'
    )
    config.chmod(0o644)
    proxy_id, hub_id = f"proxy-{os.getpid()}", f"hub-{os.getpid()}"
    proxy_log, hub_log = tmp_path / "proxy.log", tmp_path / "hub.log"
    logs = [proxy_log, hub_log]
    env = ["--env", f"CONFIGPROXY_AUTH_TOKEN={token}"]
    proxy = containerd.run_detached(
        images["proxy"],
        proxy_id,
        [
            "configurable-http-proxy",
            "--ip=127.0.0.1",
            f"--port={public}",
            "--api-ip=127.0.0.1",
            f"--api-port={api}",
        ],
        options=["--net-host", *env],
        log=proxy_log,
    )
    hub_proc = None
    try:
        routes_url = f"http://127.0.0.1:{api}/api/routes"
        wait_until("answer on the proxy's API", lambda: get_json(routes_url, token)[0] == 200, 120, logs)
        assert get_json(routes_url)[0] == 403  # the API wants the token
        # No argv: the image's command, jupyterhub --config /usr/local/etc/jupyterhub/jupyterhub_config.py.
        hub_proc = containerd.run_detached(
            images["hub"],
            hub_id,
            [],
            options=[
                "--net-host",
                *env,
                "--mount",
                f"type=bind,src={config_dir},dst=/usr/local/etc/jupyterhub,options=rbind:ro",
            ],
            log=hub_log,
        )

        def hub_route() -> object:
            assert proxy.poll() is None, f"the proxy exited: {proxy_log.read_text()}"
            assert hub_proc.poll() is None, f"the Hub exited: {hub_log.read_text()}"
            status, routes = get_json(routes_url, token)
            if status != 200 or not isinstance(routes, dict):
                return False
            return f"http://127.0.0.1:{hub}" in [route.get("target") for route in routes.values()]

        wait_until("route to the Hub in the proxy", hub_route, 240, logs)

        def hub_api() -> object:
            status, info = get_json(f"http://127.0.0.1:{public}/hub/api")
            return info if status == 200 else None

        info = wait_until("answer from the Hub through the proxy", hub_api, 120, logs)
        assert info == {"version": pinned("JUPYTERHUB_VERSION")}, info
        # What a readiness probe asks the Hub's own port.
        assert get_json(f"http://127.0.0.1:{hub}/hub/health")[0] == 200
    finally:
        containerd.kill(hub_id)
        containerd.kill(proxy_id)
        for proc in (hub_proc, proxy):
            if proc is not None:
                proc.wait(timeout=60)


def test_the_singleuser_image_has_the_server_lab_and_the_gateway_managers(
    containerd: Containerd, images: dict[str, str], tmp_path: Path
) -> None:
    image = images["singleuser"]
    out = run(containerd, image, ["jupyterhub-singleuser", "--version"], tmp_path)
    assert out.strip().splitlines()[-1] == pinned("JUPYTERHUB_VERSION"), out
    code = (
        "import os, gateway.singleuser, kernelmgr, jupyterlab;"
        "print(os.getuid(), os.getgid(), os.environ['HOME'], os.getcwd(), kernelmgr.__version__)"
    )
    out = run(containerd, image, ["python", "-c", code], tmp_path)
    assert out.split() == ["1000", "100", "/home/jovyan", "/home/jovyan", __version__], out
    # The wheel's prebuilt extension, found in the image's environment (and not only the source's).
    # (jupyter colours "enabled" and "OK" even when not on a terminal)
    out = plain(run(containerd, image, ["jupyter", "labextension", "list"], tmp_path))
    assert re.search(rf"jupyter-elastic-kernels v{re.escape(__version__)} enabled\s+OK", out), out
    out = plain(run(containerd, image, ["jupyter", "server", "extension", "list"], tmp_path))
    assert re.search(r"kernelmgr\s+enabled", out), out


def test_the_archives_carry_the_version_and_project_labels(archives: dict[str, Path]) -> None:
    check_project_labels(archives)
