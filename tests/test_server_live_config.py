"""The live configuration (``ElasticKernels.live_config_file``) on a real server with real kernels.

Culling switched on in the file while the server runs: the idle kernel is hibernated by the same
server, which started with culling off (the culler's ticks start with the new policy). A bad file at
start stops the server with one line and exit code 2, as any configuration error does. The quota
side, through a real JupyterHub and the gateway, is tests/test_gateway_jupyterhub.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CONFIG
from tests.support.server import launch, start_server, wait_for

SIZE = "python3-gpu-small"


def with_live(path: Path) -> dict[str, Any]:
    return {
        "ElasticKernels": {
            **CONFIG["ElasticKernels"],
            "live_config_file": str(path),
            "live_config_interval": 0.5,
        }
    }


def test_culling_switched_on_in_the_live_file_hibernates_an_idle_kernel_without_a_restart(
    tmp_path: Path,
) -> None:
    live = tmp_path / "live_config.json"
    live.write_text(json.dumps({"CullPolicy": {"idle_timeout": 0}}))
    server = start_server(tmp_path / "server", with_live(live))
    try:
        assert server.get("/api/elastic/policy")["enabled"] is False
        kernel_id = server.start_kernel(SIZE)
        assert server.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        live.write_text(json.dumps({"CullPolicy": {"idle_timeout": 1, "interval": 1, "warn_before": 0}}))
        wait_for(
            lambda: server.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "hibernated",
            120,
            what="the idle kernel to be hibernated by the new policy",
        )
        assert server.process.poll() is None and "Live configuration reloaded" in server.log()
        assert server.execute(kernel_id, "print(x + 1)").strip() == "42"
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ({"CullPolicy": {"idle_timeout": -5}}, "idle_timeout"),
        ({"ElasticKernels": {"profiles": {}}}, "only CullPolicy, ElasticQuota may change"),
        ("not json", "not JSON"),
    ],
)
def test_a_bad_live_file_at_start_is_one_line_and_exit_code_2(
    content: Any, named: str, tmp_path: Path
) -> None:
    live = tmp_path / "live_config.json"
    live.write_text(content if isinstance(content, str) else json.dumps(content))
    process, log_path, _url, _env = launch(tmp_path / "server", with_live(live))
    try:
        assert process.wait(timeout=120) == 2
    finally:
        if process.poll() is None:
            process.kill()
    critical = [line for line in log_path.read_text().splitlines() if "invalid configuration" in line]
    assert len(critical) == 1 and named in critical[0], log_path.read_text()[-2000:]
