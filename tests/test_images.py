"""The kernel image, built here (scripts/images.sh) and run in a real container (issue 27).

The image is built with buildah from a Debian base (or taken from the script's cache), exported as
an OCI archive, imported into a private containerd (:mod:`tests.support.containerd`) and run with
``ctr``: the kernel pod's own entry point (``python -m kernelmgr.kube.pod_kernel``) starts a real
ipykernel inside the container, on the host network with the ports of a connection file the test
wrote; the test connects from outside, runs a cell and reads the agent's version in kernel_info.

Needs root and buildah, mmdebstrap, containerd, runc, ctr: skipped without them, failed instead
with ``ELASTIC_REQUIRE_NODE=1`` (CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import write_connection_file

from kernelmgr import __version__
from kernelmgr.checkpoint.version import KERNEL_INFO_KEY
from kernelmgr.core.manifest import FORMAT
from tests.support.containerd import Containerd, require_node_tools
from tests.test_project_urls import CANONICAL

# The image builds and a cell in the container take minutes under a loaded full suite (the cell once
# took over 120 s there): the same budget as the real-node tests.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
IMAGES_SCRIPT = REPO / "scripts" / "images.sh"
TOOLS = ("buildah", "mmdebstrap", "skopeo", "containerd", "containerd-shim-runc-v2", "runc", "ctr")
HOW = (
    "apt-get install -y buildah mmdebstrap skopeo containerd runc, as root; "
    "the images build with scripts/images.sh build"
)


def images_script(*args: str, timeout: float = 1800) -> str:
    done = subprocess.run(
        ["bash", str(IMAGES_SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"scripts/images.sh {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return done.stdout


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two images as OCI archives (built here, or the cached ones if nothing changed)."""
    require_node_tools(TOOLS, what="the image tests", how=HOW)
    paths = [Path(line) for line in images_script("export").split()]
    return {"kernel": paths[0], "gateway": paths[1]}


@pytest.fixture(scope="module")
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    require_node_tools(TOOLS, what="the image tests", how=HOW)
    # A short path: containerd's shim sockets and overlay mount options are length-limited.
    directory = Path(f"/tmp/ekc-{os.getpid()}")
    try:
        with Containerd(directory) as running:
            yield running
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel_image(archives: dict[str, Path], containerd: Containerd) -> str:
    names = containerd.import_image(archives["kernel"])
    assert names, "the archive brought no image name"
    return names[0]


def test_image_names_follow_the_package_version() -> None:
    names = images_script("names").split()
    assert names == [
        f"localhost/jupyter-elastic-kernels-kernel:{__version__}",
        f"localhost/jupyter-elastic-kernels:{__version__}",
    ]


def test_the_kernel_image_checks_itself(containerd: Containerd, kernel_image: str, tmp_path: Path) -> None:
    """Run alone, the image's command is the image check: everything a kernel pod needs is there."""
    log = tmp_path / "check.log"
    proc = containerd.run_detached(kernel_image, f"check-{os.getpid()}", [], log=log)
    assert proc.wait(timeout=300) == 0, log.read_text()
    out = log.read_text()
    assert "this image can run elastic kernels" in out, out
    assert f"checkpoint agent: jupyter-elastic-kernels {__version__}, format {FORMAT}" in out
    assert "python on PATH: /opt/elastic/bin/python" in out


def test_a_cell_runs_in_a_real_ipykernel_in_the_kernel_container(
    containerd: Containerd, kernel_image: str, tmp_path: Path
) -> None:
    connection_dir = tmp_path / "connection"
    connection_dir.mkdir()
    connection_dir.chmod(0o755)
    connection_file, _info = write_connection_file(
        str(connection_dir / "kernel.json"), ip="127.0.0.1", key=os.urandom(16).hex().encode()
    )
    Path(connection_file).chmod(0o644)  # the container's user (uid 1000) reads it; a Secret volume would
    container_id = f"kernel-{os.getpid()}"
    log = tmp_path / "kernel.log"
    # The chart's pod command: the pod entry module writes the connection file with $POD_IP and execs
    # ipykernel with the checkpoint agent.
    argv = [
        "python",
        "-m",
        "kernelmgr.kube.pod_kernel",
        "-f",
        "/etc/elastic/kernel.json",
        "--IPKernelApp.extra_extensions=kernelmgr.checkpoint.agent",
    ]
    options = [
        "--net-host",
        "--env",
        "POD_IP=127.0.0.1",
        "--mount",
        f"type=bind,src={connection_dir},dst=/etc/elastic,options=rbind:ro",
    ]
    proc = containerd.run_detached(kernel_image, container_id, argv, options=options, log=log)
    client = BlockingKernelClient(connection_file=connection_file)
    client.load_connection_file()
    client.start_channels()
    try:
        # Up means a kernel_info reply on shell AND its status on IOPub: a SUB socket subscribes some
        # time after it connects, and what the kernel publishes before that is lost, so a cell run on
        # a reply alone can wait for ever for outputs that were sent (jupyter_client's own
        # wait_for_ready does the same).
        reply = None
        heard_iopub = False
        deadline = time.monotonic() + 240
        while reply is None or not heard_iopub:
            assert proc.poll() is None, f"the container exited ({proc.returncode}): {log.read_text()}"
            assert time.monotonic() < deadline, f"no kernel_info reply and status: {log.read_text()}"
            msg_id = client.kernel_info()
            try:
                msg = client.get_shell_msg(timeout=5)
            except Exception:  # queue.Empty: not up yet
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                reply = msg["content"]
            while client.iopub_channel.msg_ready():
                heard_iopub |= client.get_iopub_msg(timeout=1)["parent_header"].get("msg_id") == msg_id
            if not heard_iopub:
                with contextlib.suppress(Exception):
                    heard_iopub = client.get_iopub_msg(timeout=2)["parent_header"].get("msg_id") == msg_id
        assert reply[KERNEL_INFO_KEY] == {"version": __version__, "checkpoint_format": FORMAT}
        outputs: list[str] = []

        def collect(msg: dict[str, object]) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream" and isinstance(content, dict):
                outputs.append(str(content["text"]))

        result = client.execute_interactive(
            "import sys, os, kernelmgr; print(sys.executable, os.getuid(), kernelmgr.__version__, 6 * 7)",
            timeout=300,  # a budget for a stuck kernel: the full suite's load once took it past 120 s
            output_hook=collect,
        )
        assert result["content"]["status"] == "ok", result
        # Inside the image: its own interpreter and user, not this test's.
        assert "".join(outputs).split() == ["/opt/elastic/bin/python", "1000", __version__, "42"]
    finally:
        client.stop_channels()
        containerd.kill(container_id)
        proc.wait(timeout=60)


def check_project_labels(archives: dict[str, Path]) -> None:
    """Each OCI archive says the package version, the project's URL and licence (also for the Hub's)."""
    for which, archive in archives.items():
        done = subprocess.run(
            ["skopeo", "inspect", "--config", f"oci-archive:{archive}"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        labels = json.loads(done.stdout)["config"]["Labels"]
        assert labels["org.opencontainers.image.version"] == __version__, which
        # Where a registry's page (and `skopeo inspect`) sends someone who found the image.
        assert labels["org.opencontainers.image.source"] == CANONICAL, which
        assert labels["org.opencontainers.image.licenses"] == "BSD-3-Clause", which


def test_the_archives_carry_the_version_and_project_labels(archives: dict[str, Path], tmp_path: Path) -> None:
    check_project_labels(archives)
