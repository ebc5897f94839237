"""jupyter_server's ``execution_state`` of elastic kernels, following their lifecycle.

jupyter_server keeps its own execution state per kernel (from IOPub status messages) and lists
it in ``/api/kernels``; a hibernated kernel has no process to publish one. Rather than each
lifecycle path setting it by hand (a third state machine that drifted), this module observes
:class:`~kernelmgr.core.controller.KernelStates`' transitions and is the only code that writes
it (``tests/test_architecture.py``):

* ``hibernated`` once a kernel is hibernated (by request, the policy, a loss, or listed again
  after a server restart);
* ``idle`` when a resume has brought it back (jupyter's own IOPub watcher takes over from there);
* ``dead`` when a kernel is dead for good (lost with no checkpoint); a crash that jupyter_client's
  restarter will start again is left to jupyter_server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kernelmgr.core.controller import Transition
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.lifecycle.host import KernelHost

S = KernelState


class ExecutionStates:
    """The observer that keeps jupyter_server's ``execution_state`` in step with the lifecycle."""

    def __init__(self, host: KernelHost) -> None:
        self.host = host

    def __call__(self, transition: Transition) -> None:
        kernel_id = transition.record.kernel_id
        km: Any = self.host.get_kernel(kernel_id) if kernel_id in self.host else None
        if km is None:
            return  # not listed in jupyter_server (yet): a start's first moves, a removed kernel
        after, before = transition.after, transition.before
        if after is S.HIBERNATED or (before is None and after is S.HIBERNATING):
            km.execution_state = "hibernated"
        elif after is S.RUNNING and before is S.RESUMING:
            if getattr(km, "execution_state", None) == "hibernated":
                km.execution_state = "idle"
        elif after is S.DEAD and transition.final:
            km.execution_state = "dead"


def initial(km: Any, state: KernelState) -> None:
    """The first value on a kernel object the server built itself instead of starting it
    (a running pod adopted after a server restart): what its lifecycle state says."""
    km.execution_state = "hibernated" if state in (S.HIBERNATED, S.HIBERNATING) else "idle"


@contextlib.contextmanager
def reading_idle(km: Any) -> Iterator[None]:
    """The kernel reads ``idle`` for the synchronous code in the block, then what it was
    unless something set it meanwhile (the websocket's nudge after a resume; see there)."""
    state = getattr(km, "execution_state", None)
    km.execution_state = "idle"
    try:
        yield
    finally:
        if km.execution_state == "idle":
            km.execution_state = state
