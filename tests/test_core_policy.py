"""The cull policy as a pure function: idle = no execution AND no GPU activity, busy is safe."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kernelmgr.core.errors import ConfigError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.policy import (
    Action,
    KernelSnapshot,
    activity_resets_warning,
    build_policy,
    decide,
    under_pressure,
)

pytestmark = pytest.mark.pure


def policy(**overrides: object):  # type: ignore[no-untyped-def]
    settings = {
        "idle_timeout": 600,
        "interval": 30,
        "gpu_idle_threshold": 5,
        "warn_before": 120,
        "hibernated_ttl": 0,
        "busy_gpu_idle_warning": 0,
        "rules": [],
        "known_profiles": ("small", "whole"),
    }
    settings.update(overrides)
    return build_policy(**settings)  # type: ignore[arg-type]


def snap(**fields: object) -> KernelSnapshot:
    base = KernelSnapshot(
        kernel_id="k",
        profile="small",
        state=KernelState.RUNNING,
        execution_state="idle",
        started=0.0,
        last_execution=0.0,
        gpu_available=True,
        gpu_idle_seconds=10_000.0,
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def test_active_kernel_is_left_alone() -> None:
    assert decide(policy(), snap(last_execution=900.0), now=1000.0).action is Action.NOTHING


def test_warning_comes_first_then_hibernation_after_warn_before() -> None:
    p = policy()
    warn = decide(p, snap(), now=480.0)
    assert warn.action is Action.WARN and warn.deadline == 600.0
    assert decide(p, snap(warned_at=480.0), now=590.0).action is Action.NOTHING
    hibernate = decide(p, snap(warned_at=480.0), now=600.0)
    assert hibernate.action is Action.HIBERNATE
    assert "no cell run and no GPU activity" in hibernate.reason


def test_late_first_look_still_warns_before_hibernating() -> None:
    """A kernel found idle far past the timeout is warned, and gets the full warn_before."""
    decision = decide(policy(), snap(), now=5000.0)
    assert decision.action is Action.WARN and decision.deadline == 5120.0
    assert decide(policy(), snap(warned_at=5000.0), now=5060.0).action is Action.NOTHING


def test_no_warning_configured_hibernates_directly() -> None:
    assert decide(policy(warn_before=0), snap(), now=600.0).action is Action.HIBERNATE


def test_gpu_activity_keeps_a_silent_kernel() -> None:
    """No cell has run for an hour, but the GPU is working (a background job): not idle."""
    decision = decide(policy(), snap(gpu_idle_seconds=3.0), now=3600.0)
    assert decision.action is Action.NOTHING


def test_busy_kernel_is_never_hibernated() -> None:
    busy = snap(execution_state="busy", last_execution=0.0, gpu_idle_seconds=99_999.0)
    assert decide(policy(), busy, now=99_999.0).action is Action.NOTHING


def test_busy_but_gpu_idle_gets_one_warning_when_configured() -> None:
    p = policy(busy_gpu_idle_warning=1800)
    busy = snap(execution_state="busy", gpu_idle_seconds=2000.0)
    assert decide(p, busy, now=3000.0).action is Action.WARN_BUSY
    assert decide(p, replace(busy, busy_warned=True), now=3000.0).action is Action.NOTHING
    assert decide(policy(), busy, now=3000.0).action is Action.NOTHING


def test_a_kernel_that_never_became_idle_counts_idle_after_the_start_grace() -> None:
    """Started by REST and never connected to: it stays "starting" and must not hold its GPU for ever."""
    never = snap(execution_state="starting", started=0.0, last_execution=None)
    p = policy(idle_timeout=45, warn_before=15, start_grace=120)
    assert decide(p, never, now=119.0).action is Action.NOTHING  # still in its grace: maybe starting
    warn = decide(p, never, now=120.0)
    assert warn.action is Action.WARN and "idle for 120s" in warn.reason
    assert decide(p, replace(never, warned_at=120.0), now=135.0).action is Action.HIBERNATE
    busy = replace(never, execution_state="busy")  # a running cell stays safe whatever its age
    assert decide(p, busy, now=10_000.0).action is Action.NOTHING


def test_the_start_grace_is_checked_and_shown() -> None:
    with pytest.raises(ConfigError, match=r"CullPolicy\.start_grace must be >= 0"):
        policy(start_grace=-1)
    assert policy().to_dict()["start_grace"] == 300.0


def test_without_gpu_measurement_jupyter_activity_decides_and_says_so() -> None:
    decision = decide(policy(warn_before=0), snap(gpu_available=False, gpu_idle_seconds=None), now=700.0)
    assert decision.action is Action.HIBERNATE
    assert "GPU activity not measurable" in decision.reason


def test_rules_per_size_first_match_wins() -> None:
    p = policy(
        rules=[
            {"profiles": ["whole"], "idle_timeout": 60, "warn_before": 0},
            {"profiles": ["*"], "idle_timeout": 6000},
            {"profiles": ["whole"], "idle_timeout": 1},
        ]
    )
    assert p.for_profile("whole").idle_timeout == 60
    assert p.for_profile("small").idle_timeout == 6000
    assert decide(p, snap(profile="whole"), now=61.0).action is Action.HIBERNATE
    assert decide(p, snap(profile="small"), now=61.0).action is Action.NOTHING


def test_zero_timeout_disables() -> None:
    p = policy(idle_timeout=0, warn_before=0)
    assert not p.enabled
    assert decide(p, snap(), now=1e9).action is Action.NOTHING


def test_retry_back_off_is_respected() -> None:
    assert decide(policy(warn_before=0), snap(retry_at=2000.0), now=1000.0).action is Action.NOTHING


def test_ttl_removes_long_hibernated_kernels() -> None:
    p = policy(hibernated_ttl=86_400)
    asleep = snap(state=KernelState.HIBERNATED, hibernated_at=0.0)
    assert decide(p, asleep, now=86_399.0).action is Action.NOTHING
    removed = decide(p, asleep, now=86_400.0)
    assert removed.action is Action.REMOVE and "hibernated_ttl" in removed.reason
    assert decide(policy(), asleep, now=1e9).action is Action.NOTHING


def test_activity_after_a_warning_cancels_it() -> None:
    p = policy()
    warned = snap(warned_at=500.0, last_execution=0.0)
    assert not activity_resets_warning(warned, p, now=550.0)
    assert activity_resets_warning(replace(warned, last_execution=540.0), p, now=550.0)
    assert activity_resets_warning(replace(warned, execution_state="busy"), p, now=550.0)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"idle_timeout": -1}, "CullPolicy.idle_timeout must be >= 0"),
        ({"interval": 0}, "CullPolicy.interval must be >= 1"),
        ({"gpu_idle_threshold": 150}, "CullPolicy.gpu_idle_threshold must be between 0 and 100"),
        ({"warn_before": "soon"}, "CullPolicy.warn_before must be a number"),
        ({"warn_before": 700}, "warn_before (700s) must be shorter than idle_timeout (600s)"),
        ({"rules": [{"idle_timeout": 5}]}, "CullPolicy.rules[0].profiles must list GPU size names"),
        ({"rules": [{"profiles": ["huge"]}]}, "unknown GPU size 'huge'"),
        ({"rules": [{"profiles": ["small"], "timeout": 5}]}, "CullPolicy.rules[0].timeout: unknown key"),
        ({"rules": "whole=60"}, "CullPolicy.rules must be a list"),
    ],
)
def test_bad_policy_names_the_key(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        policy(**overrides)
    assert fragment in str(caught.value)


def test_policy_document() -> None:
    doc = policy(rules=[{"profiles": ["whole"], "idle_timeout": 60, "warn_before": 30}]).to_dict()
    assert doc["idle_timeout"] == 600 and doc["enabled"] is True
    assert doc["rules"] == [{"profiles": ["whole"], "idle_timeout": 60.0, "warn_before": 30.0}]


def test_rule_that_makes_warning_longer_than_timeout_is_refused_naming_the_size() -> None:
    with pytest.raises(ConfigError, match="for GPU size 'whole'"):
        policy(rules=[{"profiles": ["whole"], "idle_timeout": 60}])


def test_gpu_idle_threshold_is_global_and_rules_cannot_change_it() -> None:
    with pytest.raises(ConfigError, match=r"rules\[0\]\.gpu_idle_threshold: unknown key"):
        policy(rules=[{"profiles": ["whole"], "gpu_idle_threshold": 50}])


# -- culling under pressure (issue 29) ---------------------------------------------------------


def test_under_pressure_picks_the_longest_idle_one_per_waiting_kernel() -> None:
    p = policy(pressure_idle_minimum=300, warn_before=60)
    kernels = [
        snap(kernel_id="recent", last_execution=900.0),  # idle 100 s: not yet
        snap(kernel_id="old", last_execution=0.0),  # idle 1000 s
        snap(kernel_id="older", last_execution=-500.0),  # idle 1500 s
        snap(kernel_id="busy", last_execution=0.0, execution_state="busy"),
        snap(kernel_id="asleep", state=KernelState.HIBERNATED),
        snap(kernel_id="warnable", last_execution=750.0),  # idle 250 s: warned 60 s before 300
    ]
    assert under_pressure(p, kernels, now=1000.0, waiting=1) == ["older"]
    assert under_pressure(p, kernels, now=1000.0, waiting=5) == ["older", "old", "warnable"]
    assert under_pressure(p, kernels, now=1000.0, waiting=0) == []
    assert under_pressure(policy(), kernels, now=1000.0, waiting=3) == []  # off by default


def test_pressure_makes_the_minimum_the_idle_timeout_with_the_usual_warning() -> None:
    p = policy(pressure_idle_minimum=300, warn_before=60)
    idle_400 = snap(last_execution=600.0)
    assert decide(p, idle_400, now=1000.0).action is Action.NOTHING  # 400 s < idle_timeout 600
    warn = decide(p, idle_400, now=1000.0, pressure=True)
    assert warn.action is Action.WARN
    hibernate = decide(p, replace(idle_400, warned_at=1000.0), now=1060.0, pressure=True)
    assert hibernate.action is Action.HIBERNATE and "pressure_idle_minimum" in hibernate.reason
    # The queue emptied before the deadline: the warning given under pressure is dropped.
    assert activity_resets_warning(replace(idle_400, warned_at=1000.0), p, now=1060.0)


def test_pressure_applies_to_a_size_without_idle_culling() -> None:
    p = policy(idle_timeout=0, warn_before=0, pressure_idle_minimum=300)
    assert p.enabled
    assert decide(p, snap(last_execution=0.0), now=1000.0).action is Action.NOTHING
    assert decide(p, snap(last_execution=0.0), now=1000.0, pressure=True).action is Action.HIBERNATE


def test_the_pressure_minimum_must_leave_room_for_the_warning() -> None:
    with pytest.raises(ConfigError, match="pressure_idle_minimum"):
        policy(pressure_idle_minimum=100, warn_before=120)
    with pytest.raises(ConfigError, match="pressure_idle_minimum"):
        policy(pressure_idle_minimum=-1)
