"""The restore report as data: ``GET /api/elastic/kernels/{id}/report`` and ``jupyter elastic report``.

A real server, real ipykernel kernels: hibernate, resume (by executing), read the report, and
again after a second cycle and after a server restart (the report lives on disk, written by
the kernel's agent).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import elastic_config as config
from tests.support.server import RunningServer, start_server

CELLS = [
    "import threading\nnums = [1, 2, 3]",
    "gen = (n * n for n in nums)\nlock = threading.Lock()",
    "import random\ndraw = (v for v in [random.random()])",
]


def hibernate(server: RunningServer, kernel_id: str) -> None:
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply


def cli(server: RunningServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["jupyter", "elastic", *args], capture_output=True, text=True, timeout=60, env=server.env
    )


def test_the_report_outlives_the_notebook_and_the_server(tmp_path: Path) -> None:
    first = start_server(tmp_path, config(tmp_path / "checkpoints"))
    try:
        kernel_id = first.start_kernel("python3-gpu-small")
        assert first.get(f"/api/elastic/kernels/{kernel_id}/report") == {
            "id": kernel_id,
            "restore_report": None,
        }
        assert "has not been resumed" in cli(first, "report", kernel_id).stdout
        for cell in CELLS:
            first.execute(kernel_id, cell)
        for cycle in range(2):
            hibernate(first, kernel_id)
            assert first.execute(kernel_id, "print(sum(gen), lock.acquire(False))", timeout=120).strip() == (
                "14 True"
            )
            report = first.get(f"/api/elastic/kernels/{kernel_id}/report")["restore_report"]
            assert {item["name"] for item in report["recomputed"]} == {"gen", "lock"}, report
            assert "nums" in report["restored"]
            if cycle == 0:
                [lost] = report["not_restored"]
                assert lost["name"] == "draw" and lost["stage"] == "save"
                assert "without a seed" in lost["not_recomputed"]
            first.execute(kernel_id, "gen = (n * n for n in nums)")  # used up by the print above
        hibernate(first, kernel_id)
        first.execute(kernel_id, "print(1)", timeout=120)
    finally:
        first.stop()
    second = start_server(tmp_path, config(tmp_path / "checkpoints"))
    try:
        report = second.get(f"/api/elastic/kernels/{kernel_id}/report")["restore_report"]
        assert {item["name"] for item in report["recomputed"]} == {"gen", "lock"}
        shown = cli(second, "report", kernel_id)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0].startswith(f"kernel {kernel_id} resumed from ckpt-")
        assert any(line.startswith("recomputed: gen, lock (re-ran cells ") for line in lines), lines
        missing = cli(second, "report", "no-such-kernel")
        assert missing.returncode == 2
        assert missing.stderr.strip().splitlines() == [
            "jupyter elastic: no kernel is 'no-such-kernel': "
            "`jupyter elastic list` shows their ids and notebooks"
        ]
        bad = cli(second, "report", "../x")
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    finally:
        second.stop()
