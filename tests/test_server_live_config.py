"""The live configuration (``ElasticKernels.live_config_file``) on a real server with real kernels.

Culling switched on in the file while the server runs: the idle kernel is hibernated by the same
server, which started with culling off (the culler's ticks start with the new policy). GPU sizes
changed in the file: a new one is offered, a removed one is not (its hibernated kernel still
resumes), a changed one applies to the next start, an invalid change is one logged line. A bad file at
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
        ({"ServerApp": {"ip": "0.0.0.0"}}, "only CullPolicy, ElasticQuota, ElasticKernels may change"),
        ({"ElasticKernels": {"reap_interval": 2}}, "only ElasticKernels.profiles may change"),
        ({"ElasticKernels": {"profiles": {"half": {"gpu_fraction": 0.5}}}}, "memory_mib"),
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


def specs(server: Any) -> set[str]:
    return set(server.get("/api/kernelspecs")["kernelspecs"])


def size(server: Any, name: str) -> dict[str, Any]:
    return dict(next(p for p in server.get("/api/elastic/profiles")["profiles"] if p["name"] == name))


def test_gpu_sizes_change_in_the_live_file_without_a_restart(tmp_path: Path) -> None:
    small = {"gpu_fraction": 0.25, "memory_mib": 10240}
    whole = {"gpu_fraction": 1}
    live = tmp_path / "live_config.json"
    live.write_text(json.dumps({"ElasticKernels": {"profiles": {"small": small, "whole": whole}}}))
    server = start_server(tmp_path / "server", with_live(live))
    try:
        assert {"python3-gpu-small", "python3-gpu-whole"} <= specs(server)
        assert "python3-gpu-huge" not in specs(server)  # the live file's sizes replace the config's
        sleeper = server.start_kernel("python3-gpu-small")
        assert server.execute(sleeper, "x = 41; print(x)").strip() == "41"
        reply = server.request("POST", f"/api/elastic/kernels/{sleeper}/hibernate")
        assert reply.status == 200, reply

        # small removed, medium added, in one change.
        medium = {"gpu_fraction": 0.5, "memory_mib": 20480}
        live.write_text(json.dumps({"ElasticKernels": {"profiles": {"whole": whole, "medium": medium}}}))
        wait_for(lambda: "python3-gpu-medium" in specs(server), 120, what="the new size's kernelspec")
        assert "python3-gpu-small" not in specs(server)
        assert sorted(p["name"] for p in server.get("/api/elastic/profiles")["profiles"]) == [
            "medium",
            "whole",
        ]
        refused = server.request("POST", "/api/kernels", {"name": "python3-gpu-small"})
        assert refused.status == 404 and "no longer offered" in refused.body["message"], refused
        assert "python3-gpu-medium" in refused.body["message"]
        first = server.start_kernel("python3-gpu-medium")
        (device,) = server.get(f"/api/elastic/kernels/{first}")["slice"]["devices"]
        assert device["memory_mib"] == 20480
        # The removed size's hibernated kernel is still listed and resumes with its size.
        assert server.get(f"/api/elastic/kernels/{sleeper}")["profile"] == "small"
        assert server.execute(sleeper, "print(x + 1)", timeout=120).strip() == "42"
        assert server.get(f"/api/elastic/kernels/{sleeper}")["slice"]["profile"] == "small"

        # A changed size: the next start gets it, the running kernel keeps its slice.
        medium["memory_mib"] = 15360
        live.write_text(json.dumps({"ElasticKernels": {"profiles": {"whole": whole, "medium": medium}}}))
        wait_for(lambda: size(server, "medium")["memory_mib"] == 15360, 120, what="the changed size")
        second = server.start_kernel("python3-gpu-medium")
        (device,) = server.get(f"/api/elastic/kernels/{second}")["slice"]["devices"]
        assert device["memory_mib"] == 15360
        (device,) = server.get(f"/api/elastic/kernels/{first}")["slice"]["devices"]
        assert device["memory_mib"] == 20480

        # Invalid: refused with one line, the sizes stay; then a good change still applies.
        live.write_text(json.dumps({"ElasticKernels": {"profiles": {"half": {"gpu_fraction": 0.5}}}}))
        live_after = json.dumps(
            {"ElasticKernels": {"profiles": {"whole": whole}}, "CullPolicy": {"idle_timeout": 4321}}
        )
        wait_for(lambda: "Live configuration refused" in server.log(), 120, what="the refusal")
        refusals = [line for line in server.log().splitlines() if "Live configuration refused" in line]
        assert len(refusals) == 1 and "memory_mib" in refusals[0], refusals
        assert {"python3-gpu-medium", "python3-gpu-whole"} <= specs(server)
        # A rule naming a removed size refuses the change whole (sizes and policy together).
        live.write_text(
            json.dumps(
                {
                    "ElasticKernels": {"profiles": {"whole": whole}},
                    "CullPolicy": {"rules": [{"profiles": ["medium"], "idle_timeout": 60}]},
                }
            )
        )
        wait_for(
            lambda: server.log().count("Live configuration refused") == 2, 120, what="the second refusal"
        )
        assert "python3-gpu-medium" in specs(server)
        live.write_text(live_after)
        policy = "/api/elastic/policy"
        wait_for(lambda: server.get(policy)["idle_timeout"] == 4321, 120, what="the good change")
        assert "python3-gpu-medium" not in specs(server)
        # Kernels of the removed size run on.
        assert server.execute(first, "print('still')").strip() == "still"
        assert server.process.poll() is None
    finally:
        server.stop()


def test_a_size_removed_while_its_kernel_is_hibernated_survives_a_restart(tmp_path: Path) -> None:
    """The admin removes a size over the weekend and restarts the server: the user's hibernated
    kernel of that size is still listed and resumes with its variables and its size (kept from the
    kernel's record); the size is offered to no new kernel."""
    small = {"gpu_fraction": 0.25, "memory_mib": 10240}
    whole = {"gpu_fraction": 1}
    live = tmp_path / "live_config.json"
    live.write_text(json.dumps({"ElasticKernels": {"profiles": {"small": small, "whole": whole}}}))
    home = tmp_path / "server"
    server = start_server(home, with_live(live))
    try:
        kernel = server.start_kernel("python3-gpu-small")
        assert server.execute(kernel, "x = 41; print(x)").strip() == "41"
        reply = server.request("POST", f"/api/elastic/kernels/{kernel}/hibernate")
        assert reply.status == 200, reply
        live.write_text(json.dumps({"ElasticKernels": {"profiles": {"whole": whole}}}))
        wait_for(lambda: "python3-gpu-small" not in specs(server), 120, what="the size removed")
    finally:
        server.stop()

    server = start_server(home, with_live(live))
    try:
        listed = server.get(f"/api/elastic/kernels/{kernel}")
        assert (listed["state"], listed["profile"]) == ("hibernated", "small"), listed
        assert "python3-gpu-small" not in specs(server)
        refused = server.request("POST", "/api/kernels", {"name": "python3-gpu-small"})
        assert refused.status == 404 and "no longer offered" in refused.body["message"], refused
        assert server.execute(kernel, "print(x + 1)", timeout=120).strip() == "42"
        held = server.get(f"/api/elastic/kernels/{kernel}")["slice"]
        assert held["profile"] == "small" and held["devices"][0]["memory_mib"] == 10240, held
    finally:
        server.stop()
