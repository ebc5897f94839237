"""Which processes belong to a kernel: the kernel process and everything it spawned.

A kernel's GPU work often runs in child processes (PyTorch DataLoader workers,
multiprocessing pools, subprocesses), and NVML reports those PIDs, not the kernel's. So
attribution needs the kernel's whole process tree. This reads ``/proc/<pid>/stat`` directly
(no psutil dependency) and tolerates processes exiting mid-scan, which is routine on a busy
host. The tree is rebuilt on every call on purpose: PIDs get reused, so a cached tree could
attribute a stranger's GPU work to a kernel.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PROC = "/proc"


def parent_of(pid: int, proc: str = PROC) -> int | None:
    """The parent PID of ``pid``, or None if it is gone (or unreadable)."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            stat = handle.read()
    except OSError:  # exited between listing and reading, or hidden by hidepid
        return None
    # Field 2 (comm) is in parentheses and may itself contain ")" or spaces: split after the last ")".
    _, closed, rest = stat.rpartition(")")
    fields = rest.split()
    if not closed or len(fields) < 2:
        return None
    try:
        return int(fields[1])  # fields: state, ppid, ...
    except ValueError:
        return None


def children_map(proc: str = PROC) -> dict[int, list[int]]:
    """One scan of ``/proc``: parent PID -> child PIDs, for every process still there when read."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        pid = int(entry)
        parent = parent_of(pid, proc)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    return children


def descendants(pid: int, children: Mapping[int, list[int]] | None = None) -> set[int]:
    """``pid`` and all its descendants.

    ``pid`` itself is always included, even if it is gone, so callers can match it directly.
    Pass ``children`` (from :func:`children_map`) to resolve many roots against one ``/proc``
    scan instead of scanning once per root.
    """
    table = children_map() if children is None else children
    found = {pid}
    pending = [pid]
    while pending:
        for child in table.get(pending.pop(), ()):
            if child not in found:  # guards against a cycle from PID reuse mid-scan
                found.add(child)
                pending.append(child)
    return found
