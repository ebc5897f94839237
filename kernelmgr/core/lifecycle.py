"""The lifecycle of a managed kernel, as a small explicit state machine.

``starting -> running -> hibernating -> hibernated -> resuming -> running``, and ``dead``
from anywhere. Keeping the allowed moves in one table means every adapter (REST handler,
culler, websocket) asks the same question before acting, and an impossible move (resuming a
kernel that is running, hibernating one that is still starting) is refused with one clear
error instead of leaving the kernel half-way.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kernelmgr.core.errors import InvalidTransitionError


class KernelState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    HIBERNATING = "hibernating"
    HIBERNATED = "hibernated"
    RESUMING = "resuming"
    DEAD = "dead"

    def __str__(self) -> str:
        return self.value


S = KernelState

#: Allowed moves. A failed hibernation goes back to running (the kernel keeps its slice);
#: a failed resume goes back to hibernated (the checkpoint is still there); a restart of a
#: running or dead kernel goes through starting again.
TRANSITIONS: dict[KernelState, frozenset[KernelState]] = {
    S.STARTING: frozenset({S.RUNNING, S.DEAD}),
    S.RUNNING: frozenset({S.HIBERNATING, S.STARTING, S.DEAD}),
    S.HIBERNATING: frozenset({S.HIBERNATED, S.RUNNING, S.DEAD}),
    S.HIBERNATED: frozenset({S.RESUMING, S.DEAD}),
    S.RESUMING: frozenset({S.RUNNING, S.HIBERNATED, S.DEAD}),
    S.DEAD: frozenset({S.STARTING}),
}


@dataclass
class Lifecycle:
    """The current state of one kernel, when it was entered, and why."""

    state: KernelState = S.STARTING
    since: float = field(default_factory=time.time)
    reason: str = ""
    clock: Callable[[], float] = field(default=time.time, repr=False)

    def can(self, target: KernelState) -> bool:
        return target in TRANSITIONS[self.state]

    def move(self, target: KernelState, reason: str = "") -> None:
        """Enter ``target`` or raise :class:`InvalidTransitionError` naming both states."""
        if not self.can(target):
            allowed = ", ".join(sorted(s.value for s in TRANSITIONS[self.state])) or "nothing"
            raise InvalidTransitionError(
                f"kernel is {self.state.value} and cannot become {target.value} "
                f"(from {self.state.value}: {allowed})"
            )
        self.state = target
        self.since = self.clock()
        self.reason = reason
