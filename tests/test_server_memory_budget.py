"""The held-message caps' defaults follow the server's memory limit (issue 48: eight users holding
messages could get a 1 GiB gateway pod killed, since the server-wide cap was 1 GiB itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelmgr.server.memory_budget import (
    MAX_HELD_BYTES,
    cgroup_memory_limit,
    held_bytes_per_user,
    held_bytes_total,
)

pytestmark = pytest.mark.pure

GiB = 1024**3
MiB = 1024**2


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"memory.max": "1073741824\n"}, GiB),
        ({"memory.max": "max\n"}, None),
        ({"memory/memory.limit_in_bytes": "536870912\n"}, 512 * MiB),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1's "no limit"
        ({}, None),
        ({"memory.max": "garbage"}, None),
    ],
)
def test_the_memory_limit_is_read_from_the_cgroup(
    tmp_path: Path, files: dict[str, str], limit: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_memory_limit(tmp_path) == limit


def test_the_caps_fit_the_limit() -> None:
    # The chart's gateway pod (1 GiB): a quarter for held messages, half of that for one user.
    assert held_bytes_total(GiB) == 256 * MiB
    assert held_bytes_per_user(held_bytes_total(GiB)) == 128 * MiB
    # A small pod: one user can never take the whole share.
    assert held_bytes_per_user(held_bytes_total(256 * MiB)) == 32 * MiB
    # No limit (a workstation), or a large one: the old caps.
    assert held_bytes_total(None) == MAX_HELD_BYTES == held_bytes_total(64 * GiB)
    assert held_bytes_per_user(MAX_HELD_BYTES) == 128 * MiB


def test_the_websocket_caps_take_these_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelmgr.server import websocket

    monkeypatch.setattr(websocket, "server_held_bytes_total", lambda: held_bytes_total(512 * MiB))
    cls = websocket.ElasticWebsocketConnection
    connection = cls.__new__(cls)  # the traits alone (traitlets sets them up in __new__)
    assert connection.max_queued_bytes_total == 128 * MiB
    assert connection.max_queued_bytes_per_user == 64 * MiB
