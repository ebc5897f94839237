"""The kernel's answer to SIGTERM: let the running cell finish, checkpoint what changed, exit.

Why: Kubernetes stops a pod with SIGTERM and kills it after the pod's grace period (30 s unless
the pod says otherwise): a node drained for maintenance, a pod evicted or preempted by one of
higher priority, a spot node reclaimed; systemd stops a local server's kernels the same way.
ipykernel leaves SIGTERM to the operating system's default, which ends the process at once:
every variable since the last checkpoint was lost, and so were the bytes still buffered in the
files the notebook left open. With this guard the kernel

1. lets a running cell finish (a namespace cannot be checkpointed half-way through a cell) and
   its ``execute_reply`` go out (ipykernel sends it a loop turn after the cell's last hook: an
   exit in between would leave the notebook waiting for a reply that never comes);
2. writes and commits a checkpoint if a cell ran since the last committed one;
3. flushes the open files (and runs IPython's exit work when the namespace is saved);
4. exits, with status 143 (:data:`EXIT_AFTER_SIGTERM`) when the checkpoint committed (or none
   was needed), 1 when it failed.

The server waits for a stopping kernel pod to end (within its grace period) before it
hibernates the kernel from its newest checkpoint, so the next cell resumes it with nothing lost.

What it does not do:

- A SIGTERM after the server asked the kernel to shut down (a user deleting or restarting it)
  keeps the default, immediate end, a running cell or not (a Python-level handler, which runs
  mid-cell, sees to that): a deleted kernel must not leave a checkpoint behind.
- A cell still running when the grace period ends is killed with the process, SIGKILL cannot
  be caught; the newest committed checkpoint stays the one the kernel resumes from (a commit is
  atomic, so it is never half-written).

The work is done on the kernel's event loop (``loop.add_signal_handler``): that is the one place
where no cell and no message handler is half-way through, so the checkpoint sees a namespace no
cell is changing and no message is left half-sent. It also wakes an idle kernel: a plain Python
signal handler runs only when the main thread runs bytecode, and an idle kernel's main thread
sleeps in ``epoll`` while the signal may be delivered to any of its other threads.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from kernelmgr.checkpoint.quick_exit import checkpoint_and_exit

_log = logging.getLogger(__name__)

#: Turns the guard on in a kernel; set by the provisioners whose checkpoints outlive the process
#: (a local kernel, a kernel pod with its checkpoint volume), not by a warm pod, whose
#: checkpoints stay in the pod until the server collects them.
ENV_CHECKPOINT_ON_SIGTERM = "ELASTIC_CHECKPOINT_ON_SIGTERM"

#: The exit status of a kernel that committed its checkpoint at SIGTERM (128 + SIGTERM, what a shell
#: reports for a process SIGTERM ended): the local provisioner resumes such a kernel from that
#: checkpoint instead of restarting it empty.
EXIT_AFTER_SIGTERM = 128 + signal.SIGTERM


class TerminationGuard:
    """Handles SIGTERM once: checkpoint when idle, then exit (see the module's docstring)."""

    def __init__(
        self,
        *,
        checkpoint: Callable[[], object],
        is_busy: Callable[[], bool],
        shutdown_requested: Callable[[], bool],
        schedule: Callable[[Callable[[], None]], None],
        before_exit: Callable[[], object] | None = None,
        exit_process: Callable[[int], None] = os._exit,
        end_now: Callable[[], None] | None = None,
        reply_follows: Callable[[], bool] = lambda: False,
        log: logging.Logger = _log,
    ) -> None:
        self.checkpoint = checkpoint
        self.is_busy = is_busy
        self.shutdown_requested = shutdown_requested
        #: Runs a callback on the kernel's event loop, after what it is doing now.
        self.schedule = schedule
        self.before_exit = before_exit
        self.exit_process = exit_process
        #: The default SIGTERM: the process ends at once, as without the guard.
        self.end_now = end_now or _default_sigterm
        #: Whether the cell that just finished is an execute request whose reply is still to be
        #: sent (and :meth:`reply_sent` will be called once it is).
        self.reply_follows = reply_follows
        self.log = log
        self.signalled = False
        self._waiting_for_cell = False
        self._reply_pending = False

    def on_signal(self, signum: int, frame: Any) -> None:
        """The Python-level handler: runs on the main thread at its next bytecode, a running cell
        included. After a shutdown request the kernel ends at once, as without the guard (a user
        deleting a kernel busy in a long cell); anything else waits for the loop's callback."""
        if self.shutdown_requested():
            self.end_now()

    def on_sigterm(self) -> None:
        """The loop's SIGTERM callback."""
        if self.signalled:
            return  # a second SIGTERM changes nothing: the first one's work is under way
        self.signalled = True
        self._when_idle()

    def cell_finished(self) -> None:
        """Called after every cell: a SIGTERM that came during it is handled now, or once the
        cell's reply is sent when one follows."""
        if self.reply_follows():
            self._reply_pending = True
            return
        self._go_on_if_waiting()

    def reply_sent(self) -> None:
        """Called once an ``execute_reply`` has been sent."""
        self._reply_pending = False
        self._go_on_if_waiting()

    def _go_on_if_waiting(self) -> None:
        if self._waiting_for_cell:
            self._waiting_for_cell = False
            self.schedule(self._when_idle)

    def _when_idle(self) -> None:
        if self.shutdown_requested():
            self.log.info("SIGTERM after a shutdown request: ending now, no checkpoint")
            self.end_now()
            return
        # An async cell awaiting: the loop runs, the cell is not done; or done, its reply not sent.
        if self.is_busy() or self._reply_pending:
            self.log.warning("SIGTERM: checkpointing once the running cell has finished and answered")
            self._waiting_for_cell = True
            return
        self.log.warning("SIGTERM: checkpointing before exit")
        checkpoint_and_exit(
            self.checkpoint, self.before_exit, self.exit_process, self.log, "at SIGTERM", EXIT_AFTER_SIGTERM
        )


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def kernel_loop(shell: Any) -> Any:
    """The tornado loop ``shell``'s kernel will run on the main thread (``None`` without a kernel).

    The extension loads before ipykernel starts its loop; ``IOLoop.current()`` is what ipykernel
    itself asks for then, so both get the main thread's asyncio loop.
    """
    if getattr(shell, "kernel", None) is None:
        return None
    from tornado.ioloop import IOLoop

    return IOLoop.current()


def install(guard: TerminationGuard, loop: Any) -> Callable[[], None]:
    """Make ``guard`` the SIGTERM handler of ``loop`` (a tornado loop over asyncio); return how to undo it.

    Raises ``ValueError``/``RuntimeError`` off the main thread (asyncio's rule for signals).
    """
    asyncio_loop = loop.asyncio_loop
    # asyncio wakes the loop through its wakeup fd and runs ``on_sigterm`` there; the Python-level
    # handler it leaves does nothing, so it is replaced by the guard's (which the loop does not need).
    asyncio_loop.add_signal_handler(signal.SIGTERM, guard.on_sigterm)
    signal.signal(signal.SIGTERM, guard.on_signal)
    return lambda: asyncio_loop.remove_signal_handler(signal.SIGTERM)


def watch_replies(shell: Any, on_reply: Callable[[], None]) -> Callable[[], bool]:
    """Call ``on_reply`` after ``shell``'s kernel sends an ``execute_reply``; return whether the
    message the kernel is handling now is an execute request (so a reply will follow).

    Where the kernel has no session to wrap, the answer is always no: the guard then goes on at
    the cell's end, as it did before replies were watched.
    """
    kernel = getattr(shell, "kernel", None)
    session: Any = getattr(kernel, "session", None)
    send = getattr(session, "send", None)
    get_parent = getattr(kernel, "get_parent", None)
    if send is None or get_parent is None:
        return lambda: False

    def send_and_tell(stream: Any, msg_or_type: Any, *args: Any, **kwargs: Any) -> Any:
        msg = send(stream, msg_or_type, *args, **kwargs)
        if isinstance(msg, dict) and msg.get("msg_type") == "execute_reply":
            on_reply()
        return msg

    session.send = send_and_tell

    def in_execute_request() -> bool:
        try:
            parent = get_parent("shell") or {}
        except Exception:
            return False
        return bool((parent.get("header") or {}).get("msg_type") == "execute_request")

    return in_execute_request


def watch_shutdown(shell: Any) -> Callable[[], bool]:
    """Whether the server asked ``shell``'s kernel to shut down (or restart) since now.

    ipykernel answers a ``shutdown_request`` by calling ``do_shutdown`` on its control thread;
    the instance's method is wrapped to note it first.
    """
    asked = threading.Event()
    kernel = getattr(shell, "kernel", None)
    original = getattr(kernel, "do_shutdown", None)
    if kernel is None or original is None:
        return asked.is_set
    if getattr(original, "_elastic_shutdown_watch", None) is not None:
        return original._elastic_shutdown_watch

    def do_shutdown(*args: Any, **kwargs: Any) -> Any:
        asked.set()
        return original(*args, **kwargs)

    do_shutdown._elastic_shutdown_watch = asked.is_set  # type: ignore[attr-defined]
    kernel.do_shutdown = do_shutdown
    return asked.is_set


__all__ = [
    "ENV_CHECKPOINT_ON_SIGTERM",
    "EXIT_AFTER_SIGTERM",
    "TerminationGuard",
    "install",
    "kernel_loop",
    "watch_replies",
    "watch_shutdown",
]
