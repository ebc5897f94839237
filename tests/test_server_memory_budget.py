"""The held-message caps' defaults follow the server's memory limit (issue 48: eight users holding
messages could get a 1 GiB gateway pod killed, since the server-wide cap was 1 GiB itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelmgr.server.memory_budget import (
    MAX_CONNECTIONS,
    MAX_HELD_BYTES,
    cgroup_memory_limit,
    connections_per_user,
    connections_total,
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


def _fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def _limit_file(folder: Path, name: str, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def test_a_service_below_the_mount_reads_its_own_cgroup_and_its_parents(tmp_path: Path) -> None:
    """No cgroup namespace (a systemd service, a container without one): the process's folder is
    below the mount, and the tightest limit on the way up binds it."""
    root = tmp_path / "cgroup"
    # cgroup v2: /system.slice/gateway.service with MemoryMax, its slice without a limit.
    mountinfo = f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw\n"
    proc = _fake_proc(tmp_path, "0::/system.slice/gateway.service\n", mountinfo)
    _limit_file(root / "system.slice", "memory.max", "max\n")
    _limit_file(root / "system.slice" / "gateway.service", "memory.max", f"{512 * MiB}\n")
    assert cgroup_memory_limit(root, proc) == 512 * MiB
    # A parent's tighter limit binds the child.
    _limit_file(root / "system.slice", "memory.max", f"{256 * MiB}\n")
    assert cgroup_memory_limit(root, proc) == 256 * MiB


def test_a_v1_memory_controller_mounted_beside_others_is_found(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    mountinfo = (
        f"32 31 0:29 / {root / 'cpu'} rw,relatime - cgroup cgroup rw,cpu\n"
        f"35 31 0:32 / {root / 'memory'} rw,relatime - cgroup cgroup rw,memory\n"
    )
    proc = _fake_proc(tmp_path, "4:memory:/gateway\n1:cpu:/elsewhere\n", mountinfo)
    _limit_file(root / "memory", "memory.limit_in_bytes", "9223372036854771712\n")  # the root: none
    _limit_file(root / "memory" / "gateway", "memory.limit_in_bytes", f"{384 * MiB}\n")
    assert cgroup_memory_limit(root, proc) == 384 * MiB
    # A process outside the mount's view (another namespace's path) falls back to the mount's root.
    (tmp_path / "other").mkdir()
    other = _fake_proc(tmp_path / "other", "4:memory:/gateway\n", mountinfo.replace(" / ", " /pods/x "))
    assert cgroup_memory_limit(root, other) is None


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


def test_the_connection_caps_fit_the_limit() -> None:
    """A kernel websocket costs the server about 400 KiB: 10,000 of them (the old cap) would need
    4 GiB, and 128 for each of 20 users would fill the chart's 1 GiB gateway pod."""
    assert connections_total(GiB) == 512 and connections_per_user(512) == 128
    assert connections_total(256 * MiB) == 128 and connections_per_user(128) == 32
    assert connections_total(16 * MiB) == 16  # a floor: a tiny pod still serves a few notebooks
    assert connections_total(None) == MAX_CONNECTIONS == connections_total(64 * GiB)
    assert connections_per_user(MAX_CONNECTIONS) == 128


def test_the_websocket_connection_caps_take_these_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelmgr.server import websocket

    monkeypatch.setattr(websocket, "server_connections_total", lambda: connections_total(GiB))
    cls = websocket.ElasticWebsocketConnection
    connection = cls.__new__(cls)
    assert connection.max_connections == 512
    assert connection.max_connections_per_user == 128
