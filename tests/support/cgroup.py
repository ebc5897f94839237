"""A memory cgroup of the test's own, for a process that must live under a memory limit as in a pod.

cgroup v1's memory controller (``/sys/fs/cgroup/memory``, this machine's) or v2's unified tree;
root only. A process moved in keeps running, and reads the limit as its own; what it allocates
from then on is charged to the group, what it held before stays with its old group (v2, and v1 on
kernels without ``move_charge_at_immigrate``), so a test that needs its whole size reads the
process's own peak (:func:`peak_rss`). Tests skip where no group can be made.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


@dataclass
class MemoryCgroup:
    path: Path
    v1: bool

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def peak(self) -> int:
        """The most memory the group has used (bytes)."""
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        """Processes the kernel killed in this group for going over its limit."""
        name = "memory.oom_control" if self.v1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A new memory cgroup limited to ``limit`` bytes; its processes go back to the parent after."""
    v1 = (V1 / "memory.limit_in_bytes").exists()
    parent = V1 if v1 else V2
    path = parent / f"elastic-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here (needs root and a cgroup file system): {exc}")
    group = MemoryCgroup(path, v1)
    try:
        try:
            if v1:
                with contextlib.suppress(OSError):  # gone from recent kernels (EINVAL): see above
                    (path / "memory.move_charge_at_immigrate").write_text("3\n")
                (path / "memory.limit_in_bytes").write_text(f"{limit}\n")
            else:
                (path / "memory.max").write_text(f"{limit}\n")
        except OSError as exc:
            pytest.skip(f"cannot limit a cgroup's memory here (no memory controller for it): {exc}")
        yield group
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            path.rmdir()


def peak_rss(pid: int) -> int:
    """The most resident memory process ``pid`` has had (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")
