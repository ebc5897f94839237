"""The agent's version handshake, and the image check an admin runs in an image (issue 27).

A kernel image carries its own copy of the checkpoint agent. The agent reports its version and
checkpoint format in ``kernel_info``; the server refuses a kernel whose checkpoints it cannot read
(at its start and at a resume, naming both versions) and warns on any other difference. The
kernels here are real ipykernels behind a real server; "another image" is a kernelspec whose kernel
advertises another version (``exec_lines`` after the agent loaded), as an older image's agent would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

from kernelmgr import __version__
from kernelmgr.checkpoint.version import KERNEL_INFO_KEY, agent_info, compare
from kernelmgr.core.manifest import FORMAT
from kernelmgr.image_check import check_server, run_checks
from tests.conftest import elastic_config
from tests.support.server import RunningServer, start_server

pytestmark = pytest.mark.pure

#: Run in a kernel after the agent loaded: advertise what the file named by argv says (an image of
#: another version), read at every launch so a test can change the image between start and resume.
ADVERTISE_FROM_FILE = (
    "import json, os; from kernelmgr.checkpoint.version import advertise; "
    "advertise(get_ipython().kernel, json.load(open(os.environ['ELASTIC_TEST_ADVERTISE'])))"
)


def test_compare_refuses_another_checkpoint_format_naming_both_versions() -> None:
    reply = {KERNEL_INFO_KEY: {"version": "0.0.7", "checkpoint_format": "elastic-checkpoint/0"}}
    check = compare(reply, version="0.1.0", fmt="elastic-checkpoint/1")
    assert check.refusal is not None
    assert "jupyter-elastic-kernels 0.0.7 (checkpoint format elastic-checkpoint/0)" in check.refusal
    assert "jupyter-elastic-kernels 0.1.0 (checkpoint format elastic-checkpoint/1)" in check.refusal


def test_compare_warns_on_another_version_with_the_same_format() -> None:
    reply = {KERNEL_INFO_KEY: {"version": "0.0.7", "checkpoint_format": FORMAT}}
    check = compare(reply, version="0.1.0")
    assert check.refusal is None
    assert len(check.warnings) == 1 and "0.0.7" in check.warnings[0] and "0.1.0" in check.warnings[0]
    assert compare({KERNEL_INFO_KEY: agent_info()}) == compare(
        {KERNEL_INFO_KEY: agent_info()}, version=__version__
    )
    assert compare({KERNEL_INFO_KEY: agent_info()}).warnings == ()


def test_compare_warns_when_the_kernel_reports_no_agent() -> None:
    check = compare({"implementation": "ipython"})
    assert check.refusal is None and "no checkpoint agent version" in check.warnings[0]


def test_a_real_kernel_with_the_agent_reports_its_version_in_kernel_info() -> None:
    km, kc = start_new_kernel(
        kernel_name="python3", extra_arguments=["--IPKernelApp.extra_extensions=kernelmgr.checkpoint.agent"]
    )
    try:
        kc.kernel_info()
        reply = kc.get_shell_msg(timeout=60)
        assert reply["msg_type"] == "kernel_info_reply"
        assert reply["content"][KERNEL_INFO_KEY] == {"version": __version__, "checkpoint_format": FORMAT}
        assert reply["content"]["status"] == "ok" and reply["content"]["implementation"] == "ipython"
        # The control channel answers kernel_info too (jupyter_server's websocket asks there).
        msg_id = kc.control_channel.send(kc.session.msg("kernel_info_request"))
        del msg_id
        control = kc.get_control_msg(timeout=60)
        assert control["content"][KERNEL_INFO_KEY]["checkpoint_format"] == FORMAT
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# ---- the server side, through a real server


def _kernelspec(home: Path, name: str, argv: list[str], env: dict[str, str]) -> None:
    spec = home / "data" / "kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": argv,
                "display_name": name,
                "language": "python",
                "env": env,
                "metadata": {
                    "elastic": {"profile": "small"},
                    "kernel_provisioner": {"provisioner_name": "elastic-local-provisioner"},
                },
            }
        )
    )


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files saying what each test kernel's "image" advertises."""
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("server")
    argv = [
        sys.executable,
        "-m",
        "ipykernel_launcher",
        "-f",
        "{connection_file}",
        "--IPKernelApp.extra_extensions=kernelmgr.checkpoint.agent",
        f"--IPKernelApp.exec_lines={ADVERTISE_FROM_FILE}",
    ]
    for name in ("old-format", "old-version", "changes-at-resume"):
        _kernelspec(home, name, argv, {"ELASTIC_TEST_ADVERTISE": str(images / f"{name}.json")})
    (images / "old-format.json").write_text(
        json.dumps({"version": "0.0.7", "checkpoint_format": "elastic-checkpoint/0"})
    )
    (images / "old-version.json").write_text(json.dumps({"version": "0.0.7", "checkpoint_format": FORMAT}))
    (images / "changes-at-resume.json").write_text(json.dumps(agent_info()))
    running = start_server(home, elastic_config(home / "checkpoints", start_timeout=60))
    yield running
    running.stop()


def test_the_server_refuses_a_kernel_whose_checkpoint_format_it_cannot_read(server: RunningServer) -> None:
    reply = server.request("POST", "/api/kernels", {"name": "old-format"})
    assert reply.status == 500, reply
    message = reply.body["message"]
    assert "jupyter-elastic-kernels 0.0.7 (checkpoint format elastic-checkpoint/0)" in message
    assert f"jupyter-elastic-kernels {__version__} (checkpoint format {FORMAT})" in message
    assert server.get("/api/kernels") == []
    slices = [s for d in server.get("/api/elastic/gpus")["devices"] for s in d["slices"]]
    assert slices == []


def test_the_server_warns_about_another_agent_version_and_starts_the_kernel(server: RunningServer) -> None:
    kernel_id = server.start_kernel("old-version")
    try:
        assert server.execute(kernel_id, "print(6 * 7)").strip() == "42"
        assert (
            f"kernel {kernel_id}: the kernel image's checkpoint agent is jupyter-elastic-kernels 0.0.7"
            in (server.log())
        )
    finally:
        server.shutdown_kernel(kernel_id)


def test_a_resume_into_an_image_whose_format_the_server_cannot_read_is_refused(
    server: RunningServer, images: Path
) -> None:
    kernel_id = server.start_kernel("changes-at-resume")
    try:
        server.execute(kernel_id, "kept = 41")
        assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
        # The kernel image is replaced by an older one while the kernel sleeps.
        (images / "changes-at-resume.json").write_text(
            json.dumps({"version": "0.0.7", "checkpoint_format": "elastic-checkpoint/0"})
        )
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/resume")
        assert reply.status >= 500, reply
        assert "checkpoint format elastic-checkpoint/0" in reply.body["message"], reply
        assert f"jupyter-elastic-kernels {__version__}" in reply.body["message"], reply
        assert server.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "hibernated"
        # The right image back: the kernel resumes with its variables.
        (images / "changes-at-resume.json").write_text(json.dumps(agent_info()))
        assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/resume").status == 200
        assert server.execute(kernel_id, "print(kept + 1)").strip() == "42"
    finally:
        server.shutdown_kernel(kernel_id)


# ---- python -m kernelmgr.image_check


def test_the_image_check_passes_in_this_environment() -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "kernelmgr.image_check", "check", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["ok"] is True
    assert {c["name"] for c in result["checks"]} >= {
        "ipykernel",
        "kernelmgr.checkpoint.agent",
        "python on PATH",
    }


def test_the_image_check_says_what_is_missing(tmp_path: Path) -> None:
    # A PATH whose `python` is another environment (the pod would run it, without kernelmgr).
    other = tmp_path / "bin"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho /somewhere/else\n")
    (other / "python").chmod(0o755)
    checks = {c.name: c for c in run_checks(environ={"PATH": str(other)})}
    assert not checks["python on PATH"].ok
    assert "/somewhere/else" in checks["python on PATH"].detail
    # A module that is not installed: named with the pip line that adds it.
    from kernelmgr.image_check import check_module

    missing = check_module("kernelmgr_no_such_module", None, "jupyter-elastic-kernels")
    assert not missing.ok and "pip install 'jupyter-elastic-kernels'" in missing.detail
    old = check_module("os", (99, 0), "os")
    assert old.ok  # os has no __version__: importable is enough
    too_old = check_module("ipykernel", (99, 0), "ipykernel")
    assert not too_old.ok and "pip install 'ipykernel>=99.0'" in too_old.detail
    # And the command exits 1 with the MISSING line.
    done = subprocess.run(
        [sys.executable, "-m", "kernelmgr.image_check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": str(other)},
        timeout=120,
    )
    assert done.returncode == 1 and "MISSING python on PATH" in done.stdout, done.stdout


def test_the_image_check_tells_whether_a_gateway_accepts_this_agent() -> None:
    checks = {c.name: c for c in run_checks(server_version="0.0.7")}
    assert checks["gateway handshake"].ok and "0.0.7" in checks["gateway handshake"].detail


def test_the_image_check_asks_a_running_server_its_version(server: RunningServer) -> None:
    """``--gateway URL``: the version and checkpoint format come from the server itself (``GET
    /api/elastic/version``, open without a token like ``/api``), as the chart's ``helm test`` asks."""
    reply = server.request("GET", "/api/elastic/version", token=None)
    assert reply.status == 200 and reply.body == agent_info(), reply
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "kernelmgr.image_check", "check", "--gateway", server.url, "--same-version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gateway handshake: gateway {__version__} accepts this agent" in done.stdout, done.stdout
    # Nothing answers there: the check fails, naming the URL.
    checks = {c.name: c for c in run_checks(gateway=f"{server.url}/nothing-here")}
    assert not checks["gateway handshake"].ok
    assert f"{server.url}/nothing-here/api/elastic/version" in checks["gateway handshake"].detail


def test_the_image_check_with_same_version_fails_on_another_version() -> None:
    """Accepted by the gateway with a warning, but ``helm test`` must name a stale image."""
    check = check_server("0.0.7", FORMAT, same_version=True)
    assert not check.ok and "0.0.7" in check.detail and __version__ in check.detail, check
    refused = check_server(__version__, "elastic-checkpoint/0", same_version=True)
    assert not refused.ok and "cannot read" in refused.detail, refused
    assert check_server(__version__, FORMAT, same_version=True).ok
