"""The extras: local mode without the Kubernetes client (``[kubernetes]``) loads and serves; Kubernetes
mode, or the gateway without JupyterHub (``[gateway]``), says in one line which extra to install. A
package is hidden from the process by a ``sitecustomize`` that refuses to import it, as if it were not
installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIG
from tests.support.server import START_SECONDS, launch, start_server

HIDE = """
import importlib.abc, sys

class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {package!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Hidden())
"""


def without(package: str, tmp_path: Path) -> dict[str, str]:
    """Environment variables for a process in which ``package`` cannot be imported."""
    hider = tmp_path / f"hide-{package}"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(HIDE.format(package=package))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hider), os.environ.get("PYTHONPATH")]))}


def without_kubernetes(tmp_path: Path) -> dict[str, str]:
    return without("kubernetes", tmp_path)


def test_local_mode_serves_without_the_kubernetes_client(tmp_path: Path) -> None:
    server = start_server(tmp_path / "home", CONFIG, env_extra=without_kubernetes(tmp_path))
    try:
        reply = server.request("GET", "/api/elastic/profiles")
        assert reply.status == 200, server.log()
        assert [profile["name"] for profile in reply.body["profiles"]] == ["small", "whole", "huge"]
        missing = server.request("GET", "/api/elastic/kernels/nope")
        assert missing.status == 404 and "no kernel with id" in missing.body["message"]
        assert "No module named 'kubernetes'" not in server.log()
    finally:
        server.stop()


def test_kubernetes_mode_without_the_client_names_the_extra(tmp_path: Path) -> None:
    in_pods = {"kernel_provisioner": "elastic-kubernetes-provisioner"}
    config = {"ElasticKernels": {**CONFIG["ElasticKernels"], **in_pods}}
    proc, log_path, _url, _env = launch(tmp_path / "home", config, env_extra=without_kubernetes(tmp_path))
    try:
        proc.wait(timeout=START_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log = log_path.read_text()
    assert proc.returncode == 2, log
    assert "pip install 'jupyter-elastic-kernels[kubernetes]'" in log
    assert "Traceback" not in log


def test_the_gateway_without_jupyterhub_names_the_extra(tmp_path: Path) -> None:
    env = {**os.environ, **without("jupyterhub", tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", "from gateway.launch import main; main()", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "jupyter-elastic-gateway: jupyter elastic-gateway needs JupyterHub's client, which is not "
        "installed: pip install 'jupyter-elastic-kernels[gateway]'"
    ]


pytestmark = pytest.mark.server
