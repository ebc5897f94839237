"""What a stranger gets from ``pip install``: the sdist and the wheel built with ``python -m build``
(the wheel from the sdist), their files and metadata (``twine check``), and the wheel installed in a
fresh virtual environment (not editable, without extras) serving the README's run command.

Needs the package index (or pip's ``PIP_FIND_LINKS``/``PIP_NO_INDEX`` pointing at a wheelhouse) for
the build backend and the dependencies; a few minutes, most of it pip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import START_SECONDS, TOKEN, free_port, isolated_env, wait_for

# Building, then pip installing ~80 distributions into a fresh venv: minutes on a loaded machine.
pytestmark = [pytest.mark.server, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parent.parent
LABEXTENSION = "share/jupyter/labextensions/jupyter-elastic-kernels"
#: What ``pip install jupyter-elastic-kernels`` may pull (issue 32: jupyter_server + ipykernel alone are 78).
MAX_DISTRIBUTIONS = 85


def run(*cmd: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(part) for part in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, ROOT)
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel alone installed; its ``bin`` folder."""
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", venv)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run(venv / "bin" / "pip", "install", "--disable-pip-version-check", *dist.glob("*.whl"), env=env)
    yield venv / "bin"


def wheel_of(dist: Path) -> Path:
    (wheel,) = dist.glob("*.whl")
    return wheel


def test_the_wheel_carries_the_license_the_labextension_and_the_server_config(dist: Path) -> None:
    names = zipfile.ZipFile(wheel_of(dist)).namelist()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
    data = [name.split(".data/data/", 1)[1] for name in names if ".data/data/" in name]
    assert f"{LABEXTENSION}/install.json" in data
    assert f"{LABEXTENSION}/package.json" in data
    assert "etc/jupyter/jupyter_server_config.d/kernelmgr.json" in data
    # named by Kubernetes-mode RBAC errors (kernelmgr/kube/access.py)
    assert "share/jupyter-elastic-kernels/kubernetes/rbac.yaml" in data
    # the tour's configuration, for `jupyter elastic demo-config`
    assert "kernelmgr/demo/jupyter_server_config.py" in names
    install = json.loads(
        zipfile.ZipFile(wheel_of(dist)).read(next(n for n in names if n.endswith("install.json")))
    )
    assert install["packageName"] == "jupyter-elastic-kernels" and install["packageManager"] == "python"


def test_the_metadata_is_what_pypi_and_the_extension_manager_read(dist: Path) -> None:
    zipped = zipfile.ZipFile(wheel_of(dist))
    metadata = zipped.read(next(n for n in zipped.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Classifier: Framework :: Jupyter :: JupyterLab :: Extensions :: Prebuilt" in metadata
    assert "License-Expression: BSD-3-Clause" in metadata
    assert "Project-URL: Source, https://" in metadata
    assert "Provides-Extra: kubernetes" in metadata and "Provides-Extra: gateway" in metadata
    description = metadata.split("\n\n", 1)[1]
    assert len(description) < 4000 and "](docs/" not in description  # short, absolute links only
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "labextension/install.json", "docs/pypi.md", "pyproject.toml"} <= names
    if shutil.which("twine") or _has_module("twine"):
        run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_pip_install_pulls_few_distributions(installed: Path) -> None:
    listed = json.loads(run(installed / "pip", "list", "--format=json", "--disable-pip-version-check"))
    names = {entry["name"].lower() for entry in listed} - {"pip", "setuptools"}
    print(f"pip install <wheel>: {len(names)} distributions")
    assert "jupyter-elastic-kernels" in names
    assert not names & {"jupyterhub", "kubernetes"}, "extras leaked into the default install"
    assert len(names) < MAX_DISTRIBUTIONS, sorted(names)


def test_the_installed_wheel_serves_the_readme_run_command(installed: Path, tmp_path: Path) -> None:
    """``jupyter elastic demo-config config.py`` then ``jupyter server --config=config.py`` (the tour's
    commands for a wheel user, without JupyterLab, which is an extra), from outside the checkout: the
    wheel carries the example configuration, its own server config enables the extension, and it
    answers ``/api/elastic/profiles``."""
    env = isolated_env(tmp_path)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{installed}{os.pathsep}{env['PATH']}"
    run(installed / "jupyter", "elastic", "demo-config", "config.py", cwd=tmp_path, env=env)
    example = ROOT / "examples" / "local" / "jupyter_server_config.py"
    assert (tmp_path / "config.py").read_text() == example.read_text()
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen(
        [
            installed / "jupyter", "server", "--config=config.py", f"--port={port}", "--no-browser",
            "--allow-root", f"--IdentityProvider.token={TOKEN}", "--ServerApp.port_retries=0",
        ],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:

        def profiles() -> dict | None:
            if server.poll() is not None:
                raise AssertionError((tmp_path / "server.log").read_text())
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/api/elastic/profiles", headers={"Authorization": f"token {TOKEN}"}
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    body: dict = json.load(reply)
                    return body
            except OSError:
                return None

        body = wait_for(profiles, timeout=START_SECONDS, what="/api/elastic/profiles from the wheel")
        assert [p["name"] for p in body["profiles"]] == ["small", "medium", "whole"]
        located = run(
            installed / "python", "-c", "import kernelmgr; print(kernelmgr.__file__)", cwd=tmp_path, env=env
        )
        assert str(installed.parent) in located and str(ROOT) not in located
    finally:
        server.terminate()
        server.wait(timeout=60)
