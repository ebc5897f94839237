"""A GPU process's kernel id, from the environment its pod started it with.

Kernel pods get ``ELASTIC_KERNEL_ID`` from ``CheckpointStore.agent_env``, and children
(DataLoader workers, subprocesses) inherit it, so the agent can name the kernel without asking
the Kubernetes API for the pod's labels. It is a *hint*, not proof: code in the pod can start a
process with any environment, so a pod can claim another kernel's id for its own activity. The
pod UID (from the cgroup, which a process cannot leave) is what identifies the pod; the server
should map UID -> kernel from its own pod watch and use this id only where it has no mapping
(see :mod:`kernelmgr.kube.node_agents`).

Reading another user's ``/proc/<pid>/environ`` needs ``CAP_SYS_PTRACE`` (kernel pods run as
non-root users): without it the read fails and the id is simply unknown.
"""

from __future__ import annotations

import re

from kernelmgr.checkpoint.agent import ENV_KERNEL_ID
from kernelmgr.nodeagent.cgroups import PROC

#: What a kernel id may look like; anything else in the variable is ignored, not reported.
KERNEL_ID = re.compile(r"^[\w-]{1,128}$")
#: Environments are small; a bigger file is read only this far.
MAX_ENVIRON_BYTES = 1 << 20


def environ_value(environ: bytes, name: str) -> str | None:
    """The value of ``name`` in a NUL-separated ``KEY=VALUE`` block, or None."""
    prefix = name.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode("utf-8", errors="replace")
    return None


def read_kernel_id(pid: int, proc_root: str = PROC) -> str | None:
    """``ELASTIC_KERNEL_ID`` of ``pid`` if set, well-formed and readable; else None."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as handle:
            environ = handle.read(MAX_ENVIRON_BYTES)
    except OSError:  # gone, or not ours to read (no CAP_SYS_PTRACE)
        return None
    value = environ_value(environ, ENV_KERNEL_ID)
    return value if value is not None and KERNEL_ID.match(value) else None
