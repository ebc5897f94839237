"""The cull policy: when an idle kernel is warned, hibernated, or finally removed.

Every other culler counts Jupyter messages only, so a silent 3-hour training run looks idle
and a kernel parked on a GPU with no cell running looks busy as soon as someone has the
notebook open. Here a kernel is idle only when *both* signals agree:

* no execution started or finished for ``idle_timeout`` seconds, and
* its GPU utilisation stayed under ``gpu_idle_threshold`` for that long (when GPU activity
  is measurable; otherwise the Jupyter signal decides alone, and the decision says so).

A busy kernel is never hibernated (its cell would be lost). GPU memory held while idle does
not count as activity: frameworks keep memory cached for the whole session.

The decision is a pure function of a :class:`KernelSnapshot` and the clock, so the culler
adapter stays a loop that gathers snapshots and carries out decisions, and every rule here
is tested without a server.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kernelmgr.core.errors import ConfigError
from kernelmgr.core.lifecycle import KernelState

_FIELDS = ("idle_timeout", "gpu_idle_threshold", "warn_before", "hibernated_ttl", "busy_gpu_idle_warning")
#: What a per-size rule may change. The GPU idle threshold is global: the sampler measures
#: "idle since" against one threshold for every kernel.
_OVERRIDABLE = ("idle_timeout", "warn_before", "hibernated_ttl", "busy_gpu_idle_warning")


@dataclass
class CullState:
    """What the culler remembers about one kernel between ticks (on its record)."""

    warned_at: float | None = None
    deadline: float | None = None
    warning: str = ""
    busy_warned: bool = False
    failures: int = 0
    retry_at: float | None = None
    #: The warning or hibernation was decided because another kernel waited for a GPU slice.
    pressure: bool = False


@dataclass(frozen=True)
class Thresholds:
    """The numbers that apply to one GPU size."""

    idle_timeout: float = 0.0
    gpu_idle_threshold: float = 5.0
    warn_before: float = 60.0
    hibernated_ttl: float = 0.0
    busy_gpu_idle_warning: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in _FIELDS}


@dataclass(frozen=True)
class PolicyRule:
    """Overrides for the sizes it names; the first rule that names a size wins."""

    profiles: tuple[str, ...]
    overrides: Mapping[str, float]

    def matches(self, profile: str | None) -> bool:
        return "*" in self.profiles or (profile is not None and profile in self.profiles)

    def to_dict(self) -> dict[str, Any]:
        return {"profiles": list(self.profiles), **dict(self.overrides)}


@dataclass(frozen=True)
class Policy:
    """The admin's policy: defaults, per-size rules, and how often the culler looks."""

    defaults: Thresholds = field(default_factory=Thresholds)
    interval: float = 60.0
    rules: tuple[PolicyRule, ...] = ()
    #: Hibernations (checkpoints) running at once, by the culler and at server shutdown: one
    #: slow checkpoint must not hold up the others, and fifty at once would saturate disk and memory.
    max_concurrent_hibernations: int = 4
    #: Seconds after its start that a kernel which never reported ``idle`` (started by REST and
    #: never connected to: it stays "starting") still counts as busy; after that it counts as idle.
    start_grace: float = 300.0
    #: Idle seconds after which a kernel may be hibernated early because another kernel waits for
    #: a GPU slice (0: never); see :func:`under_pressure`.
    pressure_idle_minimum: float = 0.0

    @property
    def enabled(self) -> bool:
        return (
            self.defaults.idle_timeout > 0
            or self.pressure_idle_minimum > 0
            or any(r.overrides.get("idle_timeout", 0) > 0 for r in self.rules)
        )

    def for_profile(self, profile: str | None) -> Thresholds:
        for rule in self.rules:
            if rule.matches(profile):
                return replace(self.defaults, **dict(rule.overrides))
        return self.defaults

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.defaults.to_dict(),
            "interval": self.interval,
            "enabled": self.enabled,
            "max_concurrent_hibernations": self.max_concurrent_hibernations,
            "start_grace": self.start_grace,
            "pressure_idle_minimum": self.pressure_idle_minimum,
            "rules": [r.to_dict() for r in self.rules],
        }


def _number(where: str, value: Any, minimum: float = 0.0, maximum: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where} must be a number of seconds (or percent), got {value!r}")
    if not minimum <= value <= maximum:
        bound = f">= {minimum:g}" if maximum == math.inf else f"between {minimum:g} and {maximum:g}"
        raise ConfigError(f"{where} must be {bound}, got {value!r}")
    return float(value)


def _check_thresholds(where: str, values: Mapping[str, Any]) -> dict[str, float]:
    checked: dict[str, float] = {}
    for name, value in values.items():
        maximum = 100.0 if name == "gpu_idle_threshold" else math.inf
        checked[name] = _number(f"{where}.{name}", value, 0.0, maximum)
    return checked


def build_policy(
    idle_timeout: Any,
    interval: Any,
    gpu_idle_threshold: Any,
    warn_before: Any,
    hibernated_ttl: Any,
    busy_gpu_idle_warning: Any,
    rules: Sequence[Any],
    known_profiles: Sequence[str] = (),
    max_concurrent_hibernations: Any = 4,
    start_grace: Any = 300.0,
    pressure_idle_minimum: Any = 0.0,
) -> Policy:
    """Validate the ``CullPolicy.*`` settings into a :class:`Policy`, naming any bad key."""
    defaults = _check_thresholds(
        "CullPolicy",
        {
            "idle_timeout": idle_timeout,
            "gpu_idle_threshold": gpu_idle_threshold,
            "warn_before": warn_before,
            "hibernated_ttl": hibernated_ttl,
            "busy_gpu_idle_warning": busy_gpu_idle_warning,
        },
    )
    every = _number("CullPolicy.interval", interval, 1.0)
    grace = _number("CullPolicy.start_grace", start_grace)
    pressure = _number("CullPolicy.pressure_idle_minimum", pressure_idle_minimum)
    if (
        isinstance(max_concurrent_hibernations, bool)
        or not isinstance(max_concurrent_hibernations, int)
        or max_concurrent_hibernations < 1
    ):
        raise ConfigError(
            "CullPolicy.max_concurrent_hibernations must be a whole number of at least 1, "
            f"got {max_concurrent_hibernations!r}"
        )
    parsed: list[PolicyRule] = []
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise ConfigError(f"CullPolicy.rules must be a list of rules, got {rules!r}")
    for position, raw in enumerate(rules):
        where = f"CullPolicy.rules[{position}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"{where} must be an object like {{'profiles': ['whole'], 'idle_timeout': 600}}"
            )
        profiles = raw.get("profiles")
        if isinstance(profiles, str):
            profiles = [profiles]
        if not profiles or not all(isinstance(p, str) for p in profiles):
            raise ConfigError(
                f"{where}.profiles must list GPU size names (or '*'), got {raw.get('profiles')!r}"
            )
        unknown = [p for p in profiles if p != "*" and known_profiles and p not in known_profiles]
        if unknown:
            raise ConfigError(
                f"{where}.profiles names unknown GPU size {unknown[0]!r}; "
                f"sizes are {', '.join(known_profiles)}"
            )
        extra = sorted(set(raw) - {"profiles", *_OVERRIDABLE})
        if extra:
            raise ConfigError(
                f"{where}.{extra[0]}: unknown key; allowed: profiles, {', '.join(_OVERRIDABLE)}"
            )
        overrides = _check_thresholds(where, {k: v for k, v in raw.items() if k != "profiles"})
        parsed.append(PolicyRule(profiles=tuple(profiles), overrides=overrides))
    thresholds = Thresholds(**defaults)
    candidate = Policy(thresholds, every, tuple(parsed))
    for size in (None, *known_profiles):
        limits = candidate.for_profile(size)
        if limits.idle_timeout and limits.warn_before >= limits.idle_timeout:
            scope = "" if size is None else f" for GPU size {size!r}"
            raise ConfigError(
                f"CullPolicy.warn_before ({limits.warn_before:g}s) must be shorter than idle_timeout "
                f"({limits.idle_timeout:g}s){scope}, or 0 to hibernate without warning"
            )
        if pressure and limits.warn_before >= pressure:
            scope = "" if size is None else f" for GPU size {size!r}"
            raise ConfigError(
                f"CullPolicy.warn_before ({limits.warn_before:g}s) must be shorter than "
                f"pressure_idle_minimum ({pressure:g}s){scope}: the warning comes before the hibernation"
            )
    return Policy(
        defaults=thresholds,
        interval=every,
        rules=tuple(parsed),
        max_concurrent_hibernations=max_concurrent_hibernations,
        start_grace=grace,
        pressure_idle_minimum=pressure,
    )


class Action(str, enum.Enum):
    NOTHING = "nothing"
    WARN = "warn"
    HIBERNATE = "hibernate"
    WARN_BUSY = "warn_busy"
    REMOVE = "remove"


@dataclass(frozen=True)
class KernelSnapshot:
    """What the culler knows about one kernel at one moment (epoch seconds)."""

    kernel_id: str
    profile: str | None
    state: KernelState
    execution_state: str
    started: float
    last_execution: float | None = None
    busy_since: float | None = None
    gpu_available: bool = False
    gpu_idle_seconds: float | None = None
    hibernated_at: float | None = None
    warned_at: float | None = None
    busy_warned: bool = False
    retry_at: float | None = None


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    #: For warnings: when the kernel will be hibernated if nothing happens.
    deadline: float | None = None


NOTHING = Decision(Action.NOTHING)


def idle_seconds(snapshot: KernelSnapshot, now: float) -> tuple[float, str]:
    """How long the kernel has been idle by the signals available, and which ones."""
    since = snapshot.last_execution if snapshot.last_execution is not None else snapshot.started
    jupyter_idle = max(0.0, now - since)
    if snapshot.gpu_available and snapshot.gpu_idle_seconds is not None:
        return min(jupyter_idle, snapshot.gpu_idle_seconds), "no cell run and no GPU activity"
    return jupyter_idle, "no cell run; GPU activity not measurable here"


def never_idle(policy: Policy, snapshot: KernelSnapshot, now: float) -> bool:
    """A kernel still "starting" ``start_grace`` seconds after its start: nobody ever talked to it
    (papermill crashed, an API client left), so nothing runs in it; counting it busy would hold its
    GPU slice for ever."""
    return snapshot.execution_state == "starting" and now - snapshot.started >= policy.start_grace


def decide(policy: Policy, snapshot: KernelSnapshot, now: float, pressure: bool = False) -> Decision:
    """What to do with one kernel now; ``pressure``: another kernel waits for its GPU (the kernel
    was picked by :func:`under_pressure`), so ``pressure_idle_minimum`` is its idle timeout."""
    limits = _under(policy, policy.for_profile(snapshot.profile), pressure)
    if snapshot.state is KernelState.HIBERNATED:
        expired = (
            limits.hibernated_ttl > 0
            and snapshot.hibernated_at is not None
            and now - snapshot.hibernated_at >= limits.hibernated_ttl
        )
        if expired:
            return Decision(
                Action.REMOVE,
                f"hibernated for more than {limits.hibernated_ttl:g}s (CullPolicy.hibernated_ttl)",
            )
        return NOTHING
    if snapshot.state is not KernelState.RUNNING or limits.idle_timeout <= 0:
        return NOTHING
    if snapshot.execution_state != "idle" and not never_idle(policy, snapshot, now):
        if (
            snapshot.execution_state == "busy"
            and limits.busy_gpu_idle_warning > 0
            and not snapshot.busy_warned
            and snapshot.gpu_available
            and snapshot.gpu_idle_seconds is not None
            and snapshot.gpu_idle_seconds >= limits.busy_gpu_idle_warning
        ):
            return Decision(
                Action.WARN_BUSY,
                f"a cell has been running for a while but the GPU has been idle for "
                f"{snapshot.gpu_idle_seconds:.0f}s",
            )
        return NOTHING  # a busy kernel is never hibernated
    idle, signals = idle_seconds(snapshot, now)
    if snapshot.retry_at is not None and now < snapshot.retry_at:
        return NOTHING
    warned = snapshot.warned_at is not None
    if limits.warn_before > 0 and not warned:
        if idle >= limits.idle_timeout - limits.warn_before:
            deadline = now + max(limits.warn_before, limits.idle_timeout - idle)
            return Decision(Action.WARN, f"idle for {idle:.0f}s ({signals})", deadline)
        return NOTHING
    warning_served = not limits.warn_before or (
        snapshot.warned_at is not None and now - snapshot.warned_at >= limits.warn_before
    )
    if idle >= limits.idle_timeout and warning_served:
        setting = "pressure_idle_minimum" if pressure else "idle_timeout"
        return Decision(
            Action.HIBERNATE,
            f"idle for {idle:.0f}s ({signals}); CullPolicy.{setting} is {limits.idle_timeout:g}s"
            + (" and another kernel waits for a GPU slice" if pressure else ""),
        )
    return NOTHING


def _under(policy: Policy, limits: Thresholds, pressure: bool) -> Thresholds:
    """The thresholds while another kernel waits: the pressure minimum caps the idle timeout."""
    minimum = policy.pressure_idle_minimum
    if not pressure or minimum <= 0:
        return limits
    timeout = min(limits.idle_timeout, minimum) if limits.idle_timeout > 0 else minimum
    return replace(limits, idle_timeout=timeout)


def under_pressure(
    policy: Policy, snapshots: Sequence[KernelSnapshot], now: float, waiting: int
) -> list[str]:
    """The kernels to hibernate early because ``waiting`` kernels wait for a GPU slice.

    Running kernels with no cell running, idle long enough to be warned before the pressure
    minimum, the longest idle first, one per waiting kernel. A waiting kernel is only a kernel:
    freeing one slice per waiter is a guess (sizes differ), so the culler asks again each tick.
    """
    minimum = policy.pressure_idle_minimum
    if minimum <= 0 or waiting <= 0:
        return []
    eligible: list[tuple[float, str]] = []
    for snapshot in snapshots:
        if snapshot.state is not KernelState.RUNNING or snapshot.profile is None:
            continue
        if snapshot.execution_state != "idle" and not never_idle(policy, snapshot, now):
            continue
        idle, _signals = idle_seconds(snapshot, now)
        limits = _under(policy, policy.for_profile(snapshot.profile), True)
        if idle >= limits.idle_timeout - limits.warn_before:
            eligible.append((idle, snapshot.kernel_id))
    eligible.sort(key=lambda pair: -pair[0])
    return [kernel_id for _idle, kernel_id in eligible[:waiting]]


def activity_resets_warning(
    snapshot: KernelSnapshot, policy: Policy, now: float, pressure: bool = False
) -> bool:
    """A warned kernel that became active again: drop the warning (one per idle period)."""
    if snapshot.warned_at is None:
        return False
    limits = _under(policy, policy.for_profile(snapshot.profile), pressure)
    if snapshot.execution_state == "busy":
        return True
    idle, _signals = idle_seconds(snapshot, now)
    return idle < limits.idle_timeout - limits.warn_before


@dataclass(frozen=True)
class Review:
    """One culler tick's view of one kernel (see :func:`review`)."""

    decision: Decision
    #: Activity since the warning cancelled it: the caller forgets the warning it showed.
    warning_cancelled: bool


def review(policy: Policy, snapshot: KernelSnapshot, now: float, pressure: bool = False) -> Review:
    """What a culler tick does with one kernel: activity cancels a warning (one per idle
    period), then :func:`decide`. The server's culler and the simulator both call this, so a
    simulation answers what the server would do."""
    cancelled = activity_resets_warning(snapshot, policy, now, pressure)
    if cancelled:
        snapshot = replace(snapshot, warned_at=None)
    return Review(decide(policy, snapshot, now, pressure), cancelled)
