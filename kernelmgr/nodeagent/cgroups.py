"""A process's pod UID, from the cgroup the kubelet put it in.

NVML gives host PIDs and nothing else; the only node-local, API-free and tamper-proof link from
a PID to a pod is the cgroup path (a process cannot move itself out of its pod's cgroup). The
kubelet names that path differently per cgroup driver and QoS class, and cgroup v1 lists one
line per controller while v2 has a single ``0::`` line, so every form below is accepted::

    # cgroupfs driver (v1 and v2)
    /kubepods/burstable/pod4d3c8a2e-1b6f-4c1e-9a4d-2f7e8b9c0d1e/<container id>
    /kubepods/besteffort/pod<uid>/<container id>
    /kubepods/pod<uid>/<container id>                              # Guaranteed: no QoS level
    # systemd driver (v1 and v2): dashes in the UID become underscores
    /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod4d3c8a2e_1b6f_..._0d1e.slice/
        cri-containerd-<id>.scope
    /kubepods.slice/kubepods-pod<uid_with_underscores>.slice/crio-<id>.scope
    # kind / nested kubelets: /kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-...-pod<uid>.slice/...
    # seen from inside a private cgroup namespace (containerd's default on v2): relative paths
    0::/../../burstable/pod<uid>/<container id>

Static (mirror) pods carry a 32-hex-digit UID (the config hash) instead of a dashed UUID; both
are accepted. The UID is returned in the API's form: lower case, dashes.

Nothing is cached: PIDs are reused, so the cgroup is read in the same pass as the NVML sample.
"""

from __future__ import annotations

import re

PROC = "/proc"

_UUID = r"[0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}"
_UID = rf"(?:{_UUID}|[0-9a-fA-F]{{32}})"
# cgroupfs: a whole path component "pod<uid>" (dashes, as the API writes UIDs).
_CGROUPFS = re.compile(rf"^pod({_UID})$")
# systemd: "<prefix>-pod<uid>.slice" where the prefix names the kubepods hierarchy.
_SYSTEMD = re.compile(rf"^(?:[\w.-]*-)?kubepods(?:-[a-z]+)?-pod({_UID})\.slice$")


def pod_uid_from_path(path: str) -> str | None:
    """The pod UID in one cgroup path, or None when the path is not inside a pod."""
    for component in path.split("/"):
        match = _SYSTEMD.match(component) or _CGROUPFS.match(component)
        if match:
            uid = match.group(1).lower()
            if "-" not in uid and "_" not in uid:
                return uid  # a static pod's hash UID
            return uid.replace("_", "-")
    return None


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID in the content of a ``/proc/<pid>/cgroup`` file (v1 or v2), or None.

    Each line is ``hierarchy-id:controllers:path``. All lines of a pod's process name the same
    pod; the first one that names a pod wins, so a v1 controller the kubelet does not manage
    (``/`` or a systemd user slice) is skipped.
    """
    for line in text.splitlines():
        _, sep, rest = line.partition(":")
        _, sep2, path = rest.partition(":")
        if not (sep and sep2):
            continue
        uid = pod_uid_from_path(path.strip())
        if uid is not None:
            return uid
    return None


def read_pod_uid(pid: int, proc_root: str = PROC) -> str | None:
    """The pod UID of ``pid`` from ``<proc_root>/<pid>/cgroup``; None if not in a pod or gone."""
    try:
        with open(f"{proc_root}/{pid}/cgroup", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:  # exited since NVML listed it, or not visible (the agent lacks hostPID)
        return None
    return pod_uid_from_cgroup(text)
