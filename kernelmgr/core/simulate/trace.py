"""The trace format: notebook sessions with their cells, validated with errors that say what to fix.

A trace is ``{"sessions": [{"id", "size", "start", "end", "cells": [[start, end, gpu_util], ...],
"state_mib"}]}``, times in seconds from the trace's start (see docs/simulate.md). Validation is
strict because a trace usually comes from a log export script: a session whose cells overlap
or fall outside it is a bug in that script, and a silent fix would give a wrong answer.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kernelmgr.core.errors import ConfigError

#: Checkpoint size assumed for a session that gives none (MiB).
DEFAULT_STATE_MIB = 0.0
_SESSION_KEYS = {"id", "size", "start", "end", "cells", "state_mib", "user"}


class TraceError(ConfigError):
    """A trace that cannot be replayed; the message names the session and the field."""


@dataclass(frozen=True)
class Cell:
    """One cell execution: seconds from the trace start, and GPU utilisation while it ran."""

    start: float
    end: float
    gpu_util: float


@dataclass(frozen=True)
class Session:
    """One notebook kernel of one user, from when it is started to when it is shut down."""

    id: str
    size: str
    start: float
    end: float
    cells: tuple[Cell, ...]
    state_mib: float = DEFAULT_STATE_MIB
    #: Whose notebook it is (the queue serves each user's first waiter before anyone's second);
    #: a trace without users counts each session as its own user.
    user: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


def _time(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"{where}: must be a number of seconds, got {value!r}")
    if value < 0:
        raise TraceError(f"{where}: must be >= 0 seconds from the trace start, got {value!r}")
    return float(value)


def _cell(where: str, raw: Any, session: Session) -> Cell:
    if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, list | tuple) or len(raw) != 3:
        raise TraceError(f"{where}: must be [start_s, end_s, gpu_util_percent], got {raw!r}")
    start = _time(f"{where}[0] (start)", raw[0])
    end = _time(f"{where}[1] (end)", raw[1])
    util = raw[2]
    if isinstance(util, bool) or not isinstance(util, int | float) or not 0 <= util <= 100:
        raise TraceError(f"{where}[2] (gpu_util_percent): must be a number from 0 to 100, got {util!r}")
    if end < start:
        raise TraceError(f"{where}: end {end:g} is before start {start:g}")
    if start < session.start or end > session.end:
        raise TraceError(
            f"{where}: [{start:g}, {end:g}] is outside the session [{session.start:g}, {session.end:g}]"
        )
    return Cell(start, end, float(util))


def parse_session(position: int, raw: Any, sizes: Collection[str]) -> Session:
    """Validate one session; ``sizes`` are the GPU size names the configuration offers."""
    where = f"sessions[{position}]"
    if not isinstance(raw, Mapping):
        raise TraceError(f"{where}: must be an object with id, size, start, end, cells")
    ident = raw.get("id")
    if not isinstance(ident, str) or not ident:
        raise TraceError(f"{where}.id: required, a non-empty string (got {ident!r})")
    where = f"session {ident!r}"
    unknown = sorted(set(raw) - _SESSION_KEYS)
    if unknown:
        raise TraceError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(sorted(_SESSION_KEYS))}")
    size = raw.get("size")
    if not isinstance(size, str) or size not in sizes:
        raise TraceError(f"{where}.size: unknown GPU size {size!r}; sizes are {', '.join(sizes)}")
    for key in ("start", "end"):
        if key not in raw:
            raise TraceError(f"{where}.{key}: required (seconds from the trace start)")
    start = _time(f"{where}.start", raw["start"])
    end = _time(f"{where}.end", raw["end"])
    if end < start:
        raise TraceError(f"{where}.end: {end:g} is before start {start:g}")
    state = raw.get("state_mib", DEFAULT_STATE_MIB)
    if isinstance(state, bool) or not isinstance(state, int | float) or not 0 <= state < math.inf:
        raise TraceError(f"{where}.state_mib: must be a number of MiB >= 0, got {state!r}")
    cells_raw = raw.get("cells", [])
    if isinstance(cells_raw, str | bytes | Mapping) or not isinstance(cells_raw, list | tuple):
        raise TraceError(f"{where}.cells: must be a list of [start_s, end_s, gpu_util_percent]")
    user = raw.get("user", "")
    if not isinstance(user, str):
        raise TraceError(f"{where}.user: must be a string (the notebook's user), got {user!r}")
    session = Session(ident, size, start, end, (), float(state))
    cells = tuple(_cell(f"{where}.cells[{i}]", c, session) for i, c in enumerate(cells_raw))
    for i in range(1, len(cells)):
        if cells[i].start < cells[i - 1].end:
            raise TraceError(
                f"{where}.cells[{i}]: starts at {cells[i].start:g}, before cells[{i - 1}] ends at "
                f"{cells[i - 1].end:g} (a kernel runs one cell at a time; sort the cells)"
            )
    return Session(ident, size, start, end, cells, float(state), user)


def parse_trace(raw: Any, sizes: Collection[str]) -> list[Session]:
    """Validate a whole trace (the parsed JSON document)."""
    if not isinstance(raw, Mapping) or "sessions" not in raw:
        raise TraceError('trace: must be an object {"sessions": [...]}')
    sessions_raw = raw["sessions"]
    if isinstance(sessions_raw, str | bytes | Mapping) or not isinstance(sessions_raw, list | tuple):
        raise TraceError("trace.sessions: must be a list of sessions")
    sessions = [parse_session(i, s, sizes) for i, s in enumerate(sessions_raw)]
    seen: set[str] = set()
    for session in sessions:
        if session.id in seen:
            raise TraceError(f"session {session.id!r}.id: appears twice; ids must be unique")
        seen.add(session.id)
    return sessions


def trace_to_dict(sessions: list[Session]) -> dict[str, Any]:
    """The JSON shape of a trace (what the generator writes)."""
    return {
        "sessions": [
            {
                "id": s.id,
                "size": s.size,
                "start": s.start,
                "end": s.end,
                "state_mib": s.state_mib,
                **({"user": s.user} if s.user else {}),
                "cells": [[c.start, c.end, c.gpu_util] for c in s.cells],
            }
            for s in sessions
        ]
    }
