"""The kernel's own guard against losing its variables when the server dies.

Elastic kernels are launched without ipykernel's parent poller (which calls ``os._exit`` the
moment the server's process disappears, mid-checkpoint or not). Instead this watchdog notices
the server is gone, waits until no cell is running, checkpoints the namespace, flushes the files
the notebook left open (the exit is ``os._exit``, from this thread: the main thread sits in the
kernel's event loop) and exits. The next server start finds the committed checkpoint and lists
the kernel as hibernated, so a crashed or killed server costs the user nothing but a resume.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from kernelmgr.checkpoint.quick_exit import checkpoint_and_exit

log = logging.getLogger(__name__)


def server_alive(server_pid: int, original_ppid: int) -> bool:
    """Whether the server that launched us is still there.

    Checks both the pid (still exists) and our parent (not re-parented to init or a
    subreaper), because a pid can be reused but a parent change is definitive.
    """
    if os.getppid() != original_ppid:
        return False
    try:
        os.kill(server_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServerWatchdog:
    """Calls ``on_server_gone`` once, when the server is gone and no cell is running."""

    def __init__(
        self,
        server_pid: int,
        on_server_gone: Callable[[], None],
        is_busy: Callable[[], bool],
        interval: float = 1.0,
        exit_process: Callable[[int], None] = os._exit,
        before_exit: Callable[[], object] | None = None,
    ) -> None:
        self.server_pid = server_pid
        self.original_ppid = os.getppid()
        self.on_server_gone = on_server_gone
        self.is_busy = is_busy
        self.interval = interval
        self.exit_process = exit_process
        #: Runs just before the exit, whether the checkpoint committed or not: ``os._exit`` skips
        #: the interpreter's shutdown, so whatever must reach the disk (the files the notebook
        #: left open) is flushed here.
        self.before_exit = before_exit
        self._thread = threading.Thread(target=self._run, name="elastic-server-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while server_alive(self.server_pid, self.original_ppid):
            time.sleep(self.interval)
        log.warning("the Jupyter server (pid %s) is gone; checkpointing before exit", self.server_pid)
        while self.is_busy():
            time.sleep(self.interval)
        checkpoint_and_exit(
            self.on_server_gone, self.before_exit, self.exit_process, log, "after the server died"
        )
