"""How much of its memory the server lets messages held for sleeping kernels, and kernel
websockets, take by default.

Messages for a kernel that is hibernating, hibernated or resuming wait in the server's memory
until it is back (:mod:`kernelmgr.server.websocket`). Their server-wide cap must fit the memory the
server may use, or users together could get it killed for everyone (a gateway pod's limit is
1 GiB in the chart, which was also the cap). So the default is a share of the process's cgroup
memory limit, where it has one, and never above :data:`MAX_HELD_BYTES`.
"""

from __future__ import annotations

import functools
from pathlib import Path

#: The cap without a memory limit (a server on a workstation), and the most any default allows.
MAX_HELD_BYTES = 1024 * 1024 * 1024
#: One user's default share: at most this, and at most half the server's cap.
MAX_HELD_BYTES_PER_USER = 128 * 1024 * 1024
#: The share of the memory limit held messages may take: the rest is the server's own (its kernels'
#: records and watches, the Python heap, a message's copies while it is parsed and sent).
HELD_SHARE = 4
#: What one kernel websocket costs the server: 350 to 430 KiB measured with a running kernel (its
#: ZeroMQ sockets and their buffers, tornado's), rounded up.
CONNECTION_BYTES = 512 * 1024
#: The connection cap without a memory limit, and the most any default allows.
MAX_CONNECTIONS = 10000
#: One user's default: at most this many, and at most a quarter of the server's cap.
MAX_CONNECTIONS_PER_USER = 128
#: cgroup v1 says "no limit" with a huge number (the page-rounded maximum of a signed 64-bit value).
_NO_LIMIT_V1 = 1 << 60
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF = Path("/proc/self")


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc: Path = PROC_SELF) -> int | None:
    """This process's cgroup memory limit in bytes, or None: none set or none readable (not
    Linux, no cgroup file system).

    In a pod the container's own cgroup is the mount's root (a cgroup namespace); a gateway run as
    a service (systemd's ``MemoryMax``, a container without a cgroup namespace) sits deeper: its
    own folder comes from ``/proc/self/cgroup`` and the mounts, and the tightest limit on the way
    up to the mount counts (a parent's limit binds its children)."""
    limits = [limit for folder in _own_cgroup_folders(root, proc) if (limit := _limit_in(folder)) is not None]
    return min(limits) if limits else None


def _limit_in(folder: Path) -> int | None:
    """The limit one cgroup folder sets (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``)."""
    for path in (folder / "memory.max", folder / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        try:
            limit = int(text)
        except ValueError:
            return None  # "max" (v2's no limit), or unreadable
        return None if limit >= _NO_LIMIT_V1 else limit
    return None


def _own_cgroup_folders(root: Path, proc: Path) -> list[Path]:
    """The folders of this process's memory cgroup and its parents up to the mounts (v2 and v1),
    then the mounts' roots (where a pod's container sees its own cgroup)."""
    folders: list[Path] = []
    for mount, mount_root, path in _memory_mounts(proc):
        if mount.is_relative_to(root) and (
            path == mount_root or path.startswith(mount_root.rstrip("/") + "/")
        ):
            own = mount / path[len(mount_root) :].lstrip("/")
            while own != mount and own.is_relative_to(mount):
                folders.append(own)
                own = own.parent
    folders += [root, root / "memory"]
    return folders


def _memory_mounts(proc: Path) -> list[tuple[Path, str, str]]:
    """(mount point, the cgroup it shows as its root, this process's cgroup path) for the v2
    mount and the v1 memory controller's, from ``/proc/self/mountinfo`` and ``/proc/self/cgroup``."""
    try:
        mountinfo = (proc / "mountinfo").read_text().splitlines()
        memberships = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return []
    paths: dict[str, str] = {}  # "v2" or "memory" -> this process's cgroup path
    for line in memberships:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["memory"] = path
    found = []
    for line in mountinfo:
        fields = line.split()
        if "-" not in fields:
            continue
        tail = fields[fields.index("-") + 1 :]
        mount_root, mount_point = fields[3], Path(fields[4])
        kind = (
            "v2"
            if tail[:1] == ["cgroup2"]
            else "memory"
            if tail[:1] == ["cgroup"] and "memory" in tail[-1].split(",")
            else ""
        )
        if kind and kind in paths:
            found.append((mount_point, mount_root, paths[kind]))
    return found


def held_bytes_total(limit: int | None) -> int:
    """The server-wide default cap on held message bytes, given its memory limit."""
    return MAX_HELD_BYTES if limit is None else min(MAX_HELD_BYTES, limit // HELD_SHARE)


def held_bytes_per_user(total: int) -> int:
    """One user's default cap: no single user may take more than half the server's."""
    return min(MAX_HELD_BYTES_PER_USER, total // 2)


@functools.cache
def server_held_bytes_total() -> int:
    """:func:`held_bytes_total` for this process's own limit, read once: every kernel websocket
    asks for it as it opens, on the event loop, and the limit is the process's, not the
    connection's."""
    return held_bytes_total(cgroup_memory_limit())


def connections_total(limit: int | None) -> int:
    """The server-wide default cap on kernel websockets: what a share of its memory limit pays for
    (the same share as held messages: each quarter fits beside the other and the server itself)."""
    if limit is None:
        return MAX_CONNECTIONS
    return max(MAX_CONNECTIONS_PER_USER // 8, min(MAX_CONNECTIONS, limit // HELD_SHARE // CONNECTION_BYTES))


def connections_per_user(total: int) -> int:
    """One user's default cap: a quarter of the server's at most, so a few cannot take them all."""
    return min(MAX_CONNECTIONS_PER_USER, max(1, total // 4))


@functools.cache
def server_connections_total() -> int:
    """:func:`connections_total` for this process's own limit, read once (as the held bytes')."""
    return connections_total(cgroup_memory_limit())
