"""The server's view of a shared file system lags (NFS attribute caching), and a resume still
restores the newest checkpoint: the server records the checkpoint the kernel reports, and the
resume reads it by that id, never through the ``current`` the server saw.

The lag is :class:`tests.support.lagging_store.LaggingViewStore`: once the server has read a
kernel's ``current``, it keeps seeing that, while the kernel's side of the folder moves on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernelmgr.checkpoint.layout import read_current
from tests.conftest import INVENTORY, PROFILES
from tests.support.server import start_server


def config(checkpoints: Path) -> dict[str, Any]:
    return {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "checkpoint_root": str(checkpoints),
            "checkpoint_store_class": "tests.support.lagging_store.LaggingViewStore",
        }
    }


def test_a_stale_view_of_current_still_resumes_the_newest_checkpoint(tmp_path: Path) -> None:
    server = start_server(tmp_path, config(tmp_path / "checkpoints"))
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        server.execute(kernel_id, "balance = 100")
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        kernel_dir = tmp_path / "checkpoints" / reply.body["owner"] / kernel_id
        first = read_current(kernel_dir)

        assert server.execute(kernel_id, "balance = 0; print(balance)", timeout=120).strip() == "0"
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        newest = read_current(kernel_dir)  # the kernel's side of the folder
        assert newest is not None and newest != first

        assert server.execute(kernel_id, "print(balance)", timeout=120).strip() == "0"
        report = json.loads((kernel_dir / "restore-report.json").read_text())
        assert report["refused"] is None and report["checkpoint"] == newest
    finally:
        server.stop()
