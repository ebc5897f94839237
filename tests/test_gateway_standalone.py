"""An unmodified jupyter_server runs its notebooks' kernels at the gateway (standalone mode).

The gateway here is single-tenant (one static token, no JupyterHub); the user's server is stock
jupyter_server with only ``GatewayClient.url`` and ``GatewayClient.auth_token`` set. Its
notebook's kernel starts at the gateway on a GPU size, keeps its websocket open while the
gateway hibernates it, and the next cell on that same connection resumes it with its variables.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.bench_roundtrip import server_side_nodelay
from tests.conftest import elastic_config
from tests.support.server import START_SECONDS, TOKEN, RunningServer, launch, start_server

pytestmark = pytest.mark.pure


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path / "gateway",
        elastic_config(tmp_path / "checkpoints"),
        extra_args=["--ElasticGateway.auth=token"],
        app_module="gateway.app",
    )
    yield running
    running.stop()


def test_stock_server_runs_its_kernels_at_the_gateway(tmp_path: Path, gateway: RunningServer) -> None:
    user = start_server(
        tmp_path / "user",
        {},
        extra_args=[f"--GatewayClient.url={gateway.url}", f"--GatewayClient.auth_token={TOKEN}"],
    )
    try:
        specs = user.get("/api/kernelspecs")["kernelspecs"]
        small = next(
            n for n, s in specs.items() if s["spec"]["metadata"].get("elastic", {}).get("profile") == "small"
        )
        made = user.request(
            "POST", "/api/sessions", {"path": "a.ipynb", "type": "notebook", "kernel": {"name": small}}
        )
        assert made.status == 201, made
        kernel_id = made.body["kernel"]["id"]
        assert [k["id"] for k in gateway.get("/api/kernels")] == [kernel_id]

        with user.channel(kernel_id, timeout=120) as channel:
            assert channel.execute("x = 41; print(x)").stdout == "41\n"
            hibernated = gateway.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
            assert hibernated.status == 200 and hibernated.body["state"] == "hibernated", hibernated
            again = channel.execute("print(x + 1)", timeout=120)  # the same open connection
        assert again.stdout == "42\n", again
        assert gateway.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "running"

        # The gateway's own API: bad input answers 4xx with a message, never a 500.
        for body in ([1, 2], {"name": 7}, {"name": "small", "kernel_id": "x"}):
            bad = gateway.request("POST", "/api/kernels", body)
            assert bad.status == 400 and bad.body["message"], (body, bad)
        unknown = gateway.request("POST", "/api/kernels", {"name": "no-such-kernel"})
        assert unknown.status == 404 and "no kernelspec named" in unknown.body["message"], unknown
        # No contents or UI at the gateway: kernels only.
        assert gateway.request("GET", "/api/contents").status == 404
    finally:
        user.stop()


def test_the_users_server_relays_the_elastic_api_to_the_gateway(
    tmp_path: Path, gateway: RunningServer
) -> None:
    """JupyterLab asks its own server for ``/api/elastic/*``; with kernels at a gateway, the
    server relays to it (``kernelmgr.server.gateway_relay``), so the extension sees the kernels."""
    user = start_server(
        tmp_path / "user",
        {},
        extra_args=[f"--GatewayClient.url={gateway.url}", f"--GatewayClient.auth_token={TOKEN}"],
    )
    try:
        kernel_id = user.start_kernel("python3-gpu-small")
        with user.channel(kernel_id, timeout=120) as channel:
            assert channel.execute("x = 41; print(x)").stdout == "41\n"
            listed = user.get("/api/elastic/kernels")
            assert [(k["id"], k["profile"], k["state"]) for k in listed] == [(kernel_id, "small", "running")]
            assert user.get("/api/elastic/profiles") == gateway.get("/api/elastic/profiles")
            # A POST through the relay acts at the gateway; the answer is the gateway's model.
            hibernated = user.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
            assert hibernated.status == 200 and hibernated.body["state"] == "hibernated", hibernated
            assert gateway.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "hibernated"
            assert channel.execute("print(x + 1)", timeout=120).stdout == "42\n"
        assert user.get(f"/api/elastic/kernels/{kernel_id}/report")["restore_report"] is not None
        # The gateway's 4xx and its message come back as they are, not as a 500.
        unknown = user.request("POST", "/api/elastic/kernels/no-such-kernel/hibernate")
        assert unknown.status == 404 and "no-such-kernel" in unknown.body["message"], unknown
        assert user.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
        refused = user.request("POST", f"/api/elastic/kernels/{kernel_id}/activity")
        assert refused.status == 409 and "run a cell to resume it" in refused.body["message"], refused
        # The user's server still asks for its own token first.
        assert user.request("GET", "/api/elastic/kernels", token="wrong").status == 403
        user.shutdown_kernel(kernel_id)
        # A gateway that is gone: 503 with a message naming it, never a traceback.
        gateway.stop()
        gone = user.request("GET", "/api/elastic/kernels")
        assert gone.status == 503 and "cannot be reached" in gone.body["message"], gone
    finally:
        user.stop()


def test_a_bad_quota_stops_the_gateway_with_one_clear_line(tmp_path: Path) -> None:
    config = elastic_config(tmp_path / "checkpoints")
    config["ElasticQuota"] = {"users": {"ann": {"profiles": ["enormous"]}}}
    proc, log_path, _url, _env = launch(tmp_path / "gateway", config, app_module="gateway.app")
    try:
        assert proc.wait(timeout=START_SECONDS) == 2  # a whole start, then the refusal
    finally:  # a gateway that failed to stop must not outlive the test
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert (
        "invalid configuration: ElasticQuota.users['ann'].profiles names unknown GPU sizes ['enormous']"
        in log
    )
    assert "Traceback" not in log


def test_the_projects_relay_runs_cells_with_nagle_off(tmp_path: Path, gateway: RunningServer) -> None:
    """``ElasticGatewayWebSocketConnection`` relays cells (hibernation included) with Nagle off.

    Nagle on the notebook's websocket is what makes the stock relay cost a delayed ACK per cell
    (``benchmarks/bench_gateway.py``); whether it is off is read from outside the server process.
    """
    relay = (
        "--ServerApp.kernel_websocket_connection_class=gateway.singleuser.ElasticGatewayWebSocketConnection"
    )
    user = start_server(
        tmp_path / "user",
        {},
        extra_args=[f"--GatewayClient.url={gateway.url}", f"--GatewayClient.auth_token={TOKEN}", relay],
    )
    try:
        kernel_id = user.start_kernel("python3-gpu-small")
        with user.channel(kernel_id, timeout=120) as channel:
            for cycle in range(3):
                assert channel.execute(f"x = {cycle}; print(x)").stdout == f"{cycle}\n"
                hibernated = gateway.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
                assert hibernated.status == 200, hibernated
                assert channel.execute("print(x * 10)", timeout=120).stdout == f"{cycle * 10}\n"
            port = channel.conn.sock.getsockname()[1]
            assert server_side_nodelay(user, port) == "on"
        user.shutdown_kernel(kernel_id)
        assert gateway.get("/api/kernels") == []
    finally:
        user.stop()


def test_help_lists_the_gateways_own_settings() -> None:
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "gateway.app", "--help-all"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    for name in ("--ElasticQuota.default", "--ElasticGateway.auth", "--ElasticKernels.profiles"):
        assert name in shown.stdout, name


def test_help_shows_the_gateways_own_settings() -> None:
    """``--help`` (not only ``--help-all``) documents the gateway, not jupyter server's flags."""
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "gateway.app", "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    for name in ("--ElasticGateway.auth", "--ElasticGateway.admin_users", "--ElasticQuota.default"):
        assert name in shown.stdout, name
    assert "--pylab" not in shown.stdout and "--help-all" in shown.stdout


def test_hub_mode_without_a_hub_token_refuses_to_start_in_one_line(tmp_path: Path) -> None:
    """Outside a Hub, a gateway in Hub mode used to start and answer every request with 500."""
    proc, log_path, _url, _env = launch(
        tmp_path / "gateway", elastic_config(tmp_path / "checkpoints"), app_module="gateway.app"
    )
    try:
        assert proc.wait(timeout=START_SECONDS) == 2, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    refusals = [line for line in log.splitlines() if "elastic-gateway:" in line]
    assert (
        len(refusals) == 1
        and "ElasticGateway.auth is 'jupyterhub' but there is no Hub API token" in refusals[0]
    )
    assert "ElasticGateway.auth = 'token'" in refusals[0] and "Traceback" not in log


def test_a_gateway_kernel_starts_in_the_notebooks_folder(tmp_path: Path, gateway: RunningServer) -> None:
    """GatewayClient sends the notebook's folder as KERNEL_WORKING_DIR: a local kernel at the gateway
    starts there (a pod kernel: in the same folder on the user's volume, tests/test_kube_user_files.py)."""
    user = start_server(
        tmp_path / "user",
        {},
        extra_args=[f"--GatewayClient.url={gateway.url}", f"--GatewayClient.auth_token={TOKEN}"],
    )
    try:
        folder = tmp_path / "user" / "root" / "proj"
        folder.mkdir(parents=True)
        (folder / "data.csv").write_text("a,b\n1,2\n")
        specs = user.get("/api/kernelspecs")["kernelspecs"]
        small = next(
            n for n, s in specs.items() if s["spec"]["metadata"].get("elastic", {}).get("profile") == "small"
        )
        made = user.request(
            "POST", "/api/sessions", {"path": "proj/nb.ipynb", "type": "notebook", "kernel": {"name": small}}
        )
        assert made.status == 201, made
        kernel_id = made.body["kernel"]["id"]
        with user.channel(kernel_id, timeout=120) as channel:
            result = channel.execute("import os; print(os.getcwd(), open('data.csv').read().split()[1])")
        assert result.stdout.split() == [str(folder), "1,2"], result
        bad = gateway.request("POST", "/api/kernels", {"name": small, "env": ["KERNEL_WORKING_DIR"]})
        assert bad.status == 400 and "env must be an object" in bad.body["message"], bad
    finally:
        user.stop()


def test_a_gateway_whose_extension_fails_stops_in_one_line(tmp_path: Path) -> None:
    """jupyter_server only warns when an extension fails to load and serves on: the chart's gateway pod
    was Running and Ready with no elastic kernels (found following docs/deploy-kubernetes.md on the
    real node: a checkpoint claim its user could not write, PermissionError in the kernel registry's
    first save). Root writes anywhere, so here the extension fails on a registry record it cannot
    build (a field missing), which nothing in the extension catches either."""
    import json

    from kernelmgr.server.sessions import server_identity
    from tests.support.kube import wait_for

    claim = tmp_path / "checkpoints"
    home = tmp_path / "gateway"
    claim.mkdir()
    registry = claim / f"kernels-{server_identity(str(home / 'root'))}.json"
    registry.write_text(json.dumps({"format": 1, "kernels": {"k1": {"kernel_id": "k1"}}}))
    proc, log_path, _url, _env = launch(
        home, elastic_config(claim), extra_args=["--ElasticGateway.auth=token"], app_module="gateway.app"
    )
    try:
        # Either it stops, or it serves (the bug): wait for the one or the other, not a time.
        wait_for(
            lambda: proc.poll() is not None or "is running at" in log_path.read_text(),
            120,
            "the gateway to stop or serve",
        )
        assert proc.poll() == 2, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    refusals = [line for line in log.splitlines() if "elastic-gateway:" in line]
    assert len(refusals) == 1, log
    assert "the kernelmgr extension failed to start" in refusals[0], refusals
    assert "TypeError" in refusals[0] and "owner" in refusals[0], refusals
    assert "Traceback" not in log
