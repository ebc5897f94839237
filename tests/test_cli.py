"""``jupyter elastic`` against a real server: tables, JSON, discovery and one-line errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.server import TOKEN, RunningServer


def cli(
    server: RunningServer | None, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["jupyter", "elastic", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env if env is not None else (server.env if server else None),
    )


def test_profiles_table_from_the_runtime_file(plain_server: RunningServer) -> None:
    result = cli(plain_server, "profiles")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["SIZE", "DISPLAY", "NAME"]
    small = next(line for line in lines if line.startswith("small "))
    assert "GPU small (10 GiB)" in small and "25%" in small and "python3-gpu-small" in small


def test_gpus_json(plain_server: RunningServer) -> None:
    result = cli(plain_server, "--json", "gpus")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [d["uuid"] for d in doc["devices"]] == ["GPU-test-0000", "GPU-test-0001"]


def test_list_shows_a_running_kernel(plain_server: RunningServer) -> None:
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        result = cli(plain_server, "--url", plain_server.url, "--token", TOKEN, "list")
        assert result.returncode == 0, result.stderr
        row = next(line for line in result.stdout.splitlines() if line.startswith(kernel_id))
        assert row.split()[1:3] == ["small", "running"]
        assert "GPU-test-0000" in row
    finally:
        plain_server.shutdown_kernel(kernel_id)
    assert cli(plain_server, "list").stdout.strip() == "no kernels"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "a command is required"),
        (["--url", "not-a-url", "gpus"], "--url must look like http://host:port/base/"),
    ],
)
def test_bad_usage_is_exit_2_and_one_line(
    plain_server: RunningServer, args: list[str], fragment: str
) -> None:
    result = cli(plain_server, *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert fragment in result.stderr


def test_wrong_token_is_one_line(plain_server: RunningServer) -> None:
    result = cli(plain_server, "--url", plain_server.url, "--token", "wrong", "gpus")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"jupyter elastic: {plain_server.url} refused the request (HTTP 403): check --token"
    ]


def test_no_server_is_one_line(tmp_path: Path, plain_server: RunningServer) -> None:
    env = dict(plain_server.env, JUPYTER_RUNTIME_DIR=str(tmp_path))
    result = cli(None, "gpus", env=env)
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"jupyter elastic: no running Jupyter server found in {tmp_path}; pass --url and --token"
    )


def test_unreachable_server_is_one_line(plain_server: RunningServer) -> None:
    result = cli(plain_server, "--url", "http://127.0.0.1:9", "gpus")
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "cannot reach http://127.0.0.1:9" in result.stderr
