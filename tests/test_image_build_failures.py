"""``scripts/images.sh`` when a step fails: it stops there, says why, and leaves no cached artifact
that a later run would trust (issue 43: a base made as a directory, imported empty, tagged, and
found by every later run, each failing with a message that named none of the causes).

Real buildah, each test with its own image storage (``ELASTIC_IMAGES_CACHE`` in a temporary
folder). Only mmdebstrap is a stand-in: a script on ``PATH`` that fails the way the real one did
(a directory where a tarball was wanted), or makes a tarball in seconds instead of minutes.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.support.containerd import require_node_tools

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
HOW = "apt-get install -y buildah, as root"

#: What the stand-in mmdebstrap does with its target (its last argument), chosen by the test.
STAND_IN = """#!/bin/sh
for target; do :; done
echo "$target" >> "$(dirname "$0")/calls"
case "$STAND_IN_MODE" in
  directory) mkdir -p "$target/proc" ;;
  tarball) cp "$STAND_IN_TARBALL" "$target" ;;
  fail) echo "stand-in mmdebstrap: no network" >&2; exit 3 ;;
esac
"""


def images(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    stand_in = tools / "mmdebstrap"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    environ = {
        **os.environ,
        "PATH": f"{tools}:{os.environ['PATH']}",
        "ELASTIC_IMAGES_CACHE": str(tmp_path / "cache"),
        **env,
    }
    command = ["bash", str(REPO / "scripts" / "images.sh"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=environ)


def storage(tmp_path: Path, *args: str) -> str:
    cache = tmp_path / "cache"
    root = ["--root", str(cache / "storage"), "--runroot", str(cache / "run"), "--storage-driver", "overlay"]
    done = subprocess.run(["buildah", *root, *args], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip()


def image_names(tmp_path: Path) -> list[str]:
    return storage(tmp_path, "images", "--format", "{{.Name}}:{{.Tag}}").split()


def empty_image(tmp_path: Path, name: str) -> None:
    """An image with no files at all: no shell, no python3."""
    container = storage(tmp_path, "from", "--quiet", "scratch")
    storage(tmp_path, "commit", "--quiet", "--rm", container, name)


@pytest.fixture(autouse=True)
def _buildah() -> None:
    require_node_tools(("buildah",), what="the image build failure tests", how=HOW)


def test_a_base_made_as_a_directory_stops_the_build_and_leaves_nothing(tmp_path: Path) -> None:
    failed = images(tmp_path, "build", STAND_IN_MODE="directory")
    assert failed.returncode != 0, failed.stderr
    assert "is not a tarball holding ./usr/bin/python3 (removed)" in failed.stderr, failed.stderr
    assert "pip" not in failed.stderr  # it stopped at the base: no wheels asked for a Python ""
    assert not [n for n in image_names(tmp_path) if "jupyter-elastic-kernels" in n]
    assert not list((tmp_path / "cache").glob("*base-*"))  # neither the tarball nor the directory


def test_a_base_without_a_working_python_is_never_tagged(tmp_path: Path) -> None:
    """mmdebstrap succeeded, but what it made does not run python3 (here: an empty file by that name)."""
    root = tmp_path / "rootfs"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "python3").write_bytes(b"")
    tarball = tmp_path / "rootfs.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(root, arcname=".")
    failed = images(tmp_path, "build", STAND_IN_MODE="tarball", STAND_IN_TARBALL=str(tarball))
    assert failed.returncode != 0
    assert "does not run python3 (tarball removed; run again to remake it)" in failed.stderr, failed.stderr
    assert not [n for n in image_names(tmp_path) if "jupyter-elastic-kernels" in n]
    assert not list((tmp_path / "cache").glob("base-*.tar"))


def test_a_cached_base_without_python_is_made_again(tmp_path: Path) -> None:
    """What the broken runs left behind (a base tag on an empty image) is found, removed and made
    again, saying so, instead of being trusted by every later run."""
    first = images(tmp_path, "build", STAND_IN_MODE="fail")
    assert first.returncode != 0 and "stand-in mmdebstrap: no network" in first.stderr
    key = Path((tmp_path / "tools" / "calls").read_text().split()[0]).name.removeprefix("partial-base-")
    broken = f"localhost/jupyter-elastic-kernels-base:{key.removesuffix('.tar')}"
    empty_image(tmp_path, broken)
    again = images(tmp_path, "build", STAND_IN_MODE="fail")
    assert f"the cached base {broken} has no working python3: removing it and making it again" in again.stderr
    assert again.returncode != 0 and "stand-in mmdebstrap: no network" in again.stderr  # it tried
    assert broken not in image_names(tmp_path)


def test_an_image_without_python_is_an_error_naming_it(tmp_path: Path) -> None:
    empty_image(tmp_path, "localhost/no-python:1")
    failed = images(tmp_path, "build", ELASTIC_IMAGES_BASE="localhost/no-python:1")
    assert failed.returncode != 0
    lines = [line for line in failed.stderr.splitlines() if line.startswith("images: ")]
    assert lines[-1].startswith("images: python3 does not run in localhost/no-python:1"), failed.stderr
    assert "No matching distribution" not in failed.stderr
