"""Work run in a forked child process that reports to its parent in JSON lines on a pipe.

Why a child and not a thread: a restore's download (:mod:`kernelmgr.checkpoint.prefetch`) runs
while the kernel process starts. Its ranges' threads take the GIL back after every read from
their sockets, and the starting kernel (ipykernel's imports, its shell) holds it most of the
time, so the two take turns on one GIL while other cores sit idle: on a 16-core machine a 1 GiB
download took 1.0-1.1 s beside a starting kernel, 0.4-0.5 s alone. A child has its own GIL.

Forked, not spawned: the launchers start the download before ipykernel runs, with the modules it
needs already imported, so a fork starts at once where a new interpreter would spend its first
0.1 s importing them. The child never returns into the parent's code: it leaves by ``os._exit``
(no exit handlers, no flush of the parent's buffers), and it is killed when its parent dies
(``PR_SET_PDEATHSIG``), so an interrupted kernel leaves no download behind. Linux ties that to
the thread that forked: start a child from a thread that outlives it (the launchers use the main
thread). It ignores SIGINT: an interrupt sent to the kernel's process group is for a cell.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]
#: What the child runs: given a function that sends a message to the parent, it returns the
#: result (a JSON object), or raises.
Work = Callable[[Callable[[Message], None]], Message]

_PR_SET_PDEATHSIG = 1


class ChildFailed(Exception):
    """The child raised (``kind``: the exception's class name, ``str(self)``: its message), or
    exited without a result."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def can_fork() -> bool:
    """Whether this platform forks (Linux and the other POSIX systems)."""
    return hasattr(os, "fork")


class Child:
    """``work`` running in a forked child; ``on_message`` runs in this process, on a reader
    thread, for each message the child sends before its result."""

    def __init__(self, work: Work, on_message: Callable[[Message], None]) -> None:
        read_end, write_end = os.pipe()
        parent = os.getpid()
        with warnings.catch_warnings():
            # Python 3.12 warns that a fork of a threaded process may deadlock in the child: this
            # child only uses sockets, files and threads of its own (a preloaded library's idle
            # workers are not touched).
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _run_child(work, write_end, parent)  # never returns
        os.close(write_end)
        self.pid = pid
        self._on_message = on_message
        self._result: Message | None = None
        self._error: ChildFailed | None = None
        self._lock = threading.Lock()
        self._reaped = False
        self._reader = threading.Thread(
            target=self._read, args=(read_end,), name="checkpoint-child", daemon=True
        )
        self._reader.start()

    def _read(self, read_end: int) -> None:
        try:
            with os.fdopen(read_end, "rb") as pipe:
                for line in pipe:
                    self._take(line)
        finally:
            status = self._reap()
            if self._result is None and self._error is None:
                why = f"the child process ended ({status}) without a result"
                self._error = ChildFailed("ChildExited", why)

    def _take(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:  # a last line cut short by the child's death: it has no result then
            return
        if "message" in event:
            with contextlib.suppress(Exception):  # the parent's side never stops the child
                self._on_message(event["message"])
        elif "result" in event:
            self._result = event["result"]
        elif "error" in event:
            self._error = ChildFailed(str(event["error"]), str(event.get("detail", "")))

    def _reap(self) -> str:
        """Wait for the child's exit (its pipe has closed). Reaped with the lock held, so that
        :meth:`kill` never signals the pid once the system may have given it to another process."""
        while True:
            with self._lock:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere
                    self._reaped = True
                    return "status unknown"
                if pid:
                    self._reaped = True
                    break
            time.sleep(0.01)  # the pipe closes as the child exits: a moment at most
        if os.WIFSIGNALED(status):
            return f"signal {os.WTERMSIG(status)}"
        return f"exit status {os.waitstatus_to_exitcode(status)}"

    def result(self) -> Message:
        """The child's result once it has ended; raises :class:`ChildFailed`."""
        self._reader.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def kill(self) -> None:
        """Stop the child now (its result no longer matters)."""
        with self._lock:
            if not self._reaped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)


def _run_child(work: Work, write_end: int, parent: int) -> None:
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _die_with(parent)
        pipe = os.fdopen(write_end, "wb", buffering=0)

        def send(event: Message) -> None:
            pipe.write(json.dumps(event).encode("utf-8") + b"\n")

        try:
            result = work(lambda message: send({"message": message}))
            send({"result": result})
            status = 0
        except BaseException as exc:
            send({"error": type(exc).__name__, "detail": str(exc)})
    finally:
        os._exit(status)


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent exits (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before that took effect
        os._exit(1)
