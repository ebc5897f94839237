"""Checkpoint storage shared fairly (issue 48): a per-user quota and a reserve of the volume.

The rules on their own, then a real server on a small tmpfs: a hibernation over the owner's
``max_checkpoint_bytes`` is refused before anything is written (403, naming what holds the
space), the kernel keeps running and hibernates once space is freed; a kernel new to a nearly
full volume may not take the last bytes (507), a kernel whose checkpoint the volume already
holds may; a policy hibernation refused for space tells the notebook once, not at every retry.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import websocket

from gateway.quota import Limits, parse_limits
from kernelmgr.checkpoint.safedir import SafeDir
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.storage import StorageRules, storage_refusal
from kernelmgr.core.units import parse_bytes
from tests.conftest import elastic_config as config
from tests.support.disk import small_disk
from tests.support.server import RunningServer, start_server, wait_for
from tests.test_cli import cli

MIB = 1 << 20
GIB = 1 << 30


# -- the rules -------------------------------------------------------------------------------


@pytest.mark.pure
def test_the_quota_counts_the_owners_other_checkpoints_and_names_the_largest() -> None:
    rules = StorageRules(max_bytes=10 * GIB)
    held = {"aaaaaaaa-1": 6 * GIB, "bbbbbbbb-2": 3 * GIB, "me": 4 * GIB}
    names = {"aaaaaaaa-1": "train.ipynb"}
    # Its own stored checkpoint is replaced by the new one: not counted.
    assert storage_refusal(rules, "me", 1 * GIB, held, None, names) is None
    refusal = storage_refusal(rules, "me", 2 * GIB, held, None, names)
    assert refusal is not None and (refusal.limit, refusal.status) == ("quota", 403)
    assert "needs about 2 GiB and your other checkpoints hold 9 GiB" in refusal.message
    assert "(train.ipynb 6 GiB, bbbbbbbb 3 GiB), over your quota of 10 GiB" in refusal.message
    assert "`jupyter elastic list`" in refusal.message and "keeps running" in refusal.message
    assert storage_refusal(StorageRules(), "me", 100 * GIB, held, None) is None  # no quota


@pytest.mark.pure
def test_the_reserve_is_for_kernels_the_volume_already_holds() -> None:
    rules = StorageRules(reserve_bytes=4 * GIB)
    # 5 GiB free: a first checkpoint of 2 GiB would leave 3, inside the reserve.
    refusal = storage_refusal(rules, "new", 2 * GIB, {}, 5 * GIB)
    assert refusal is not None and (refusal.limit, refusal.status) == ("reserve", 507)
    assert "last 4 GiB are kept for the kernels already hibernated there" in refusal.message
    # A kernel with a stored checkpoint may use it (its old checkpoint's bytes come back).
    assert storage_refusal(rules, "old", 2 * GIB, {"old": 2 * GIB}, 5 * GIB) is None
    assert storage_refusal(rules, "new", 1 * GIB, {}, 5 * GIB) is None
    full = storage_refusal(rules, "old", 6 * GIB, {"old": 2 * GIB}, 5 * GIB)
    assert full is not None and full.limit == "full" and "has 5 GiB free" in full.message


@pytest.mark.pure
def test_sizes_in_configuration() -> None:
    assert parse_bytes("x", "20Gi") == 20 * GIB
    assert parse_bytes("x", "500M") == 500_000_000
    assert parse_bytes("x", 1234) == 1234 and parse_bytes("x", None) is None
    for bad in ("lots", "-1Gi", "10 parsecs", True, -5, 1.5):
        with pytest.raises(ConfigError, match=r"x must be a number of bytes or a size such as"):
            parse_bytes("x", bad)
    parsed = parse_limits("ElasticQuota.users['ann']", {"max_checkpoint_bytes": "1Gi"}, [])
    assert Limits(**parsed).max_checkpoint_bytes == GIB
    with pytest.raises(ConfigError, match=r"ElasticQuota.users\['ann'\].max_checkpoint_bytes"):
        parse_limits("ElasticQuota.users['ann']", {"max_checkpoint_bytes": "a lot"}, [])


@pytest.mark.pure
def test_usage_counts_files_below_and_follows_no_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(os.urandom(3 * MIB))
    folder = tmp_path / "kernel"
    (folder / "ckpt").mkdir(parents=True)
    (folder / "ckpt" / "data.bin").write_bytes(os.urandom(MIB))
    (folder / "link").symlink_to(outside)
    (folder / "dirlink").symlink_to(tmp_path)
    with SafeDir.open(tmp_path) as root:
        counted = root.disk_bytes("kernel")
    assert MIB <= counted < 2 * MIB, counted


# -- a real server on a small volume -----------------------------------------------------------


def hibernate(server: RunningServer, kernel_id: str) -> tuple[int, str]:
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate", timeout=120)
    return reply.status, (reply.body or {}).get("message", "") if isinstance(reply.body, dict) else ""


def hold(server: RunningServer, mib: int) -> str:
    """A new kernel holding about ``mib`` MiB of variables."""
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, f"blob = bytearray({mib} * 2**20); print(len(blob))")
    return kernel_id


def state(server: RunningServer, kernel_id: str) -> str:
    return str(server.get(f"/api/elastic/kernels/{kernel_id}")["state"])


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path, "64m") as disk:
        yield disk


def test_quota_and_reserve_on_a_small_volume(tmp_path: Path, volume: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    settings = config(volume / "checkpoints", max_checkpoint_bytes="30Mi", checkpoint_reserve=0.25)
    server = start_server(home, settings)
    try:
        first = hold(server, 12)
        assert hibernate(server, first)[0] == 200
        # Over the quota: 12 MiB held + 20 MiB > 30 MiB. Refused before a byte is written.
        second = hold(server, 20)
        status, message = hibernate(server, second)
        assert status == 403, message
        assert f"kernel {second} was not hibernated, it keeps running: checkpoint quota reached" in message
        assert "your other checkpoints hold 12" in message and first[:8] in message
        assert "over your quota of 30 MiB" in message
        assert not list((volume / "checkpoints").glob(f"*/{second}/*/data.bin"))
        assert state(server, second) == "running"
        assert server.execute(second, "print(len(blob))").strip() == str(20 * MIB)
        storage = server.get("/api/elastic/storage")
        [mine] = storage["owners"]
        assert mine["quota_bytes"] == 30 * MIB and mine["used_bytes"] >= 12 * MIB
        assert [row["kernel_id"] for row in mine["checkpoints"]] == [first]
        assert mine["checkpoints"][0]["state"] == "hibernated"
        assert storage["volume"]["total_bytes"] == 64 * MIB
        assert storage["volume"]["reserve_bytes"] == 16 * MIB
        metrics = server.text("/metrics")
        assert 'elastic_checkpoint_space_refusals_total{limit="quota"} 1.0' in metrics
        # The same through the CLI: the refusal's own words, exit 1; storage lists what holds it.
        refused = cli(server, "hibernate", second[:8])
        assert refused.returncode == 1 and "checkpoint quota reached" in refused.stderr, refused
        listed = cli(server, "storage")
        assert listed.returncode == 0, listed.stderr
        assert "of 30 MiB quota" in listed.stdout and first[:8] in listed.stdout, listed.stdout
        assert "16 MiB kept for kernels it holds" in listed.stdout
        running = cli(server, "discard", second[:8], "--yes")
        assert running.returncode == 2 and "is running, not hibernated" in running.stderr, running
        unconfirmed = cli(server, "discard", first[:8])  # no terminal, no --yes: refused
        assert unconfirmed.returncode == 2 and "add --yes" in unconfirmed.stderr, unconfirmed
        assert state(server, first) == "hibernated"

        # The first kernel resumes (its checkpoint stays on the volume until it hibernates again)
        # and someone else's data fills the volume: 64 - 12 - 34 = 18 MiB free.
        assert server.execute(first, "print(len(blob))").strip() == str(12 * MIB)
        (volume / "filler").write_bytes(b"\0" * (34 * MIB))
        # A kernel new to the volume may not take the reserve's 16 MiB: 18 - 4 < 16.
        third = hold(server, 4)
        status, message = hibernate(server, third)
        assert status == 507, message
        assert "its last 16 MiB are kept for the kernels already hibernated there" in message
        assert state(server, third) == "running"
        # The first one, whose checkpoint the volume holds, may: its old one goes once it commits.
        assert hibernate(server, first)[0] == 200
        # Space freed (the hibernated kernel discarded): the refused kernel hibernates.
        (volume / "filler").unlink()
        discarded = cli(server, "discard", first[:8], "--yes")
        assert discarded.returncode == 0 and "discarded" in discarded.stdout, discarded
        assert not list((volume / "checkpoints").glob(f"*/{first}"))
        assert hibernate(server, second)[0] == 200
        assert server.execute(second, "print(len(blob))").strip() == str(20 * MIB)
    finally:
        server.stop()


POLICY = {"idle_timeout": 3, "warn_before": 0, "interval": 1}


def test_a_policy_hibernation_refused_for_space_tells_the_notebook_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    settings = config(tmp_path / "checkpoints", max_checkpoint_bytes="8Mi")
    settings["CullPolicy"] = POLICY
    server = start_server(home, settings)
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        notes: list[str] = []
        with server.channel(kernel_id, timeout=120) as chan:
            chan.execute("blob = bytearray(16 * 2**20)")
            # Idle now: the policy tries, is refused, backs off and tries again.
            wait_for(lambda: "failed (2 in a row)" in server.log(), timeout=120, what="two refused tries")
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                chan.conn.settimeout(0.5)
                try:
                    msg = json.loads(chan.conn.recv())
                except websocket.WebSocketTimeoutException:
                    continue
                text = msg["content"].get("text") or json.dumps(msg["content"].get("data", {}))
                if "Not hibernated" in text:
                    notes.append(text)
        assert len(notes) == 1, notes
        assert "checkpoint quota reached" in notes[0] and "over your quota of 8 MiB" in notes[0]
        assert state(server, kernel_id) == "running"
        assert 'elastic_checkpoint_space_refusals_total{limit="quota"}' in server.text("/metrics")
    finally:
        server.stop()
