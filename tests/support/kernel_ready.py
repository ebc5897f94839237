"""Waiting for a kernel that no KernelManager started (a pod's, a container's, a bare process's).

jupyter_client's ``wait_for_ready`` asks the heartbeat channel whether the kernel is alive, and a
channel with no manager behind it calls a kernel dead when it has not answered a ping within a
second of the channels starting: a kernel that binds its sockets later than that (a restore, a
loaded machine) is reported dead while it is starting. Here the process itself says whether it
died, and up means a kernel_info reply on shell and a message on IOPub (a SUB socket subscribes a
while after it connects; what the kernel publishes before that is lost, so a cell run on the reply
alone could wait for outputs already sent).
"""

from __future__ import annotations

import queue
import subprocess
import time
from collections.abc import Callable
from typing import Any


def still_running(process: subprocess.Popen[Any]) -> Callable[[], str | None]:
    """For :func:`wait_for_kernel_info`: why ``process`` is not running (its exit code), or None."""
    return lambda: None if process.poll() is None else f"the kernel's process exited ({process.returncode})"


def wait_for_kernel_info(client: Any, exited: Callable[[], str | None], timeout: float) -> dict[str, Any]:
    """Ask ``client``'s kernel for kernel_info until it answers on shell and IOPub; its reply.

    ``exited`` says why the kernel can no longer answer (its process ended), or None while it may:
    the wait fails at once then, with that reason, instead of at the deadline.
    """
    deadline = time.monotonic() + timeout
    reply: dict[str, Any] | None = None
    heard_iopub = False
    while reply is None or not heard_iopub:
        why = exited()
        if why is not None:
            raise AssertionError(f"no kernel_info reply: {why}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no kernel_info reply and IOPub status in {timeout} s")
        if reply is None:
            msg_id = client.kernel_info()
            try:
                msg = client.get_shell_msg(timeout=2)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                reply = msg
        try:
            client.get_iopub_msg(timeout=0.5 if reply is None else 2)
            heard_iopub = True
        except queue.Empty:
            reply = None  # ask again: its status went out before IOPub was listening
    return reply
