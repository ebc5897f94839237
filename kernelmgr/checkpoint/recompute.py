"""Rebuilding, on resume, the variables a checkpoint could not hold, by re-running cells.

:func:`~kernelmgr.checkpoint.cells.plan_recompute` picks the cells; this module runs them.
They run in the kernel's own namespace (so a function or lambda they define sees the user's
globals, as it did), but what they rebind is put back afterwards: a restored variable keeps
its restored value, a name the replay made up on the way (a loop variable) is removed, and
only the variables being rebuilt stay, and only when every planned cell ran (a failure
rolls the namespace back). Output is swallowed (``stdout``/``stderr``): the user
sees one line in the restore report, not the replayed cells' prints. A time limit bounds the
whole replay (``SIGALRM`` on the main thread; elsewhere a planned cell slower, when it first
ran, than the limit is not started).
"""

from __future__ import annotations

import contextlib
import io
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kernelmgr.checkpoint.cells import CellRecord, Plan

#: Seconds the whole replay may take, unless the agent is told otherwise.
DEFAULT_LIMIT = 30.0


class ReplayTimeout(Exception):
    """The replay ran past its time limit."""


@dataclass
class Outcome:
    """What a replay rebuilt, and what it could not, with why."""

    recomputed: list[str] = field(default_factory=list)
    not_recomputed: dict[str, str] = field(default_factory=dict)
    cells: list[int] = field(default_factory=list)
    seconds: float = 0.0


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise ReplayTimeout(f"re-running the cells took over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def replay(
    plan: Plan,
    namespace: dict[str, Any],
    *,
    transform: Callable[[str], str] = lambda source: source,
    limit: float = DEFAULT_LIMIT,
) -> Outcome:
    """Run ``plan``'s cells in a copy of ``namespace``; copy its targets back into it."""
    outcome = Outcome(not_recomputed=dict(plan.impossible))
    if not plan.targets:
        return outcome
    started = time.perf_counter()
    slow = [cell for cell in plan.cells if cell.seconds > limit]
    if slow:
        why = f"cell {slow[0].index} took {slow[0].seconds:g} s when it ran, over the {limit:g} s limit"
        outcome.not_recomputed.update(dict.fromkeys(plan.targets, why))
        return outcome
    touched = {name for cell in plan.cells for name in cell.writes} - set(plan.targets)
    kept = {name: namespace[name] for name in touched if name in namespace}
    current: CellRecord | None = None
    try:
        with (
            _time_limit(limit),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            for current in plan.cells:
                code = compile(transform(current.source), f"<elastic replay of cell {current.index}>", "exec")
                exec(code, namespace)  # the user's own cell, from the signed manifest
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        where = f"cell {current.index}" if current is not None else "the replay"
        if isinstance(exc, ReplayTimeout):
            why = str(exc)
        else:
            why = f"{where} failed when re-run: {type(exc).__name__}: {exc}"
        outcome.not_recomputed.update(dict.fromkeys(plan.targets, why))
        outcome.seconds = round(time.perf_counter() - started, 3)
        for name in plan.targets:
            namespace.pop(name, None)
        _put_back(namespace, touched, kept)
        return outcome
    _put_back(namespace, touched, kept)
    for name in plan.targets:
        if name in namespace:
            outcome.recomputed.append(name)
        else:
            outcome.not_recomputed[name] = "the re-run cells did not define it"
    outcome.cells = [cell.index for cell in plan.cells]
    outcome.seconds = round(time.perf_counter() - started, 3)
    return outcome


def _put_back(namespace: dict[str, Any], touched: set[str], kept: dict[str, Any]) -> None:
    """Undo what the replay bound besides its targets."""
    for name in touched:
        if name in kept:
            namespace[name] = kept[name]
        else:
            namespace.pop(name, None)
