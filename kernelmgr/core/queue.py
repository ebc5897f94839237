"""Who gets the next free GPU slice: an ordered queue of the kernels waiting for one.

Without it every waiting resume polled the allocator on its own timer, so whoever happened to
look first after a release won: a small size slipped into every gap and a whole-GPU resume could
wait for ever. Here waiters are ordered by

1. priority (per GPU size, higher first),
2. fair share: the owner with fewer kernels holding or waiting ahead goes first (each owner's
   first before anyone's second, counting the slices they hold already, so one user's ten
   notebooks do not push another user's one to the back),
3. arrival.

A waiter behind one that does not fit may take a slice that fits it (backfill: the GPU would
stay idle otherwise), but only ``max_bypass`` times per waiter ahead: after that the slices freed
are kept for the head until it fits. A waiter that was let through is *claiming* until the
caller's ``claimed`` says its slice is taken (or it settles): meanwhile nobody else goes, so
two waiters never count the same free capacity. The queue knows nothing of the allocator or the clock's
source: callers pass ``fits`` and ``now``, so the server's controller and the simulator share it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

#: The slices each owner holds now (the caller knows; the queue only sees waiters). Asked once per
#: ordering: a waiter polls the queue, so one pass over the slices, not one per waiter.
Held = Callable[[], Mapping[str, int]]


def _none_held() -> Mapping[str, int]:
    return {}


#: How often a waiter may be overtaken by smaller ones before freed capacity is held for it.
DEFAULT_MAX_BYPASS = 3
#: Weight of the newest interval in the moving average of time between grants.
_EWMA = 0.3


@dataclass
class Waiter:
    """One kernel waiting for a slice of ``size``."""

    key: str
    owner: str
    size: str
    priority: int
    since: float
    seq: int
    bypassed: int = 0


@dataclass
class SliceQueue:
    """The waiting kernels, in the order they will be served (see the module's docstring)."""

    max_bypass: int = DEFAULT_MAX_BYPASS
    _waiters: dict[str, Waiter] = field(default_factory=dict)
    _claiming: set[str] = field(default_factory=set)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _last_grant: float | None = None
    _grant_interval: float | None = None

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, key: object) -> bool:
        return key in self._waiters

    def join(self, key: str, owner: str, size: str, now: float, priority: int = 0) -> None:
        """``key`` waits (joining again keeps its place)."""
        if key not in self._waiters:
            self._waiters[key] = Waiter(key, owner, size, priority, now, next(self._seq))

    def leave(self, key: str) -> None:
        """``key`` stops waiting without a slice (cancelled, timed out, removed)."""
        self._waiters.pop(key, None)

    def order(self, held: Held = _none_held) -> list[Waiter]:
        """The waiters in the order they are served."""
        holding = held()
        share: dict[tuple[int, str], int] = {}
        ranked = []
        for waiter in sorted(self._waiters.values(), key=lambda w: w.seq):
            nth = share.get((waiter.priority, waiter.owner), holding.get(waiter.owner, 0))
            share[(waiter.priority, waiter.owner)] = nth + 1
            ranked.append(((-waiter.priority, nth, waiter.seq), waiter))
        return [waiter for _rank, waiter in sorted(ranked, key=lambda pair: pair[0])]

    def position(self, key: str, held: Held = _none_held) -> int | None:
        """1 for the next to be served; ``None`` if ``key`` is not waiting."""
        for place, waiter in enumerate(self.order(held), start=1):
            if waiter.key == key:
                return place
        return None

    def may_take(
        self,
        key: str,
        fits: Callable[[str], bool],
        claimed: Callable[[str], bool] = lambda _key: True,
        held: Held = _none_held,
    ) -> bool:
        """Whether ``key`` may take a slice now: nobody let through before is still claiming
        theirs, it fits, no waiter ahead of it fits, and none ahead of it has been overtaken
        ``max_bypass`` times already. A key not in the queue may go only when nobody waits."""
        self._claiming = {other for other in self._claiming if other != key and not claimed(other)}
        if self._claiming:
            return False
        if key not in self._waiters:
            return not self._waiters
        for waiter in self.order(held):
            if waiter.key == key:
                return fits(waiter.size)
            if fits(waiter.size) or waiter.bypassed >= self.max_bypass:
                return False
        return False

    def granted(self, key: str, now: float, held: Held = _none_held) -> None:
        """``key`` goes for its slice: it leaves the line (claiming until ``claimed`` says so or it
        settles), and every waiter it overtook counts one bypass."""
        self._claiming.add(key)
        if key not in self._waiters:
            return
        for waiter in self.order(held):
            if waiter.key == key:
                break
            waiter.bypassed += 1
        del self._waiters[key]
        if self._last_grant is not None:
            interval = max(0.0, now - self._last_grant)
            previous = self._grant_interval
            self._grant_interval = interval if previous is None else _EWMA * interval + (1 - _EWMA) * previous
        self._last_grant = now

    def settle(self, key: str) -> None:
        """``key``'s resume ended (slice taken, or failed): it claims nothing any more."""
        self._claiming.discard(key)
        self._waiters.pop(key, None)

    def estimate(self, key: str, held: Held = _none_held) -> float | None:
        """Seconds until ``key`` is served, from the recent time between grants; ``None`` until
        two grants have been seen (no basis for a guess)."""
        return self.estimate_at(self.position(key, held))

    def estimate_at(self, place: int | None) -> float | None:
        """:meth:`estimate` for a known place in the queue."""
        if place is None or self._grant_interval is None:
            return None
        return place * self._grant_interval
