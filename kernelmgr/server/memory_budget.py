"""How much of its memory the server lets messages held for sleeping kernels take, by default.

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
#: cgroup v1 says "no limit" with a huge number (the page-rounded maximum of a signed 64-bit value).
_NO_LIMIT_V1 = 1 << 60
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """This process's cgroup memory limit in bytes (v2 ``memory.max``, else v1), or None: none set
    or none readable (not Linux, no cgroup file system)."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            return None
        return None if limit >= _NO_LIMIT_V1 else limit
    return None


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
