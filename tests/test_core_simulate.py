"""``jupyter elastic simulate``: hand-computed traces through the real policy and allocator,
and the CLI's validation (one line, exit code 2).

Every expected number below is worked out by hand in the comments, from the policy's rules:
with ``idle_timeout`` 600 s, ``warn_before`` 60 s and a tick every 60 s, a kernel idle since
``t`` is warned at the first tick with ``now - t >= 540`` and hibernated at the first tick at
least 60 s later with ``now - t >= 600``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.core.policy import Policy, build_policy
from kernelmgr.core.profiles import parse_profiles
from kernelmgr.core.simulate.engine import DelayModel, Result, simulate, simulated_inventory
from kernelmgr.core.simulate.generate import generate
from kernelmgr.core.simulate.trace import TraceError, parse_trace, trace_to_dict

pytestmark = pytest.mark.pure

PROFILES = parse_profiles(
    {
        "small": {"gpu_fraction": 0.25, "memory_mib": 10240},
        "medium": {"gpu_fraction": 0.5, "memory_mib": 20480},
        "whole": {"gpu_fraction": 1},
    }
)
H = 3600.0


def policy(
    idle_timeout: float = 600,
    warn_before: float = 60,
    rules: list[Any] | None = None,
    max_concurrent_hibernations: int = 4,
) -> Policy:
    return build_policy(
        idle_timeout=idle_timeout,
        interval=60,
        gpu_idle_threshold=5,
        warn_before=warn_before,
        hibernated_ttl=0,
        busy_gpu_idle_warning=0,
        rules=rules or [],
        known_profiles=list(PROFILES),
        max_concurrent_hibernations=max_concurrent_hibernations,
    )


def run(
    sessions: list[dict[str, Any]],
    cull: Policy | None = None,
    gpus: int | None = None,
    delays: DelayModel | None = None,
) -> dict[str, Result]:
    trace = parse_trace({"sessions": sessions}, list(PROFILES))
    inventory = simulated_inventory(gpus) if gpus else None
    return simulate(trace, PROFILES, cull or policy(), inventory, delays or DelayModel(1, 100, 0, 100))


def test_one_session_hibernated_after_its_idle_timeout() -> None:
    # Cell [0, 100] at 90%: idle since 100. Tick 660: idle 560 >= 540 -> warn. Tick 720: idle 620,
    # warned 60 s ago -> hibernate; no state, no fixed cost -> the slice is free at 720.
    r = run([{"id": "a", "size": "small", "start": 0, "end": 3600, "cells": [[0, 100, 90]]}])
    assert r["static"].gpu_hours == pytest.approx(0.25 * 3600 / H)
    assert r["policy"].gpu_hours == pytest.approx(0.25 * 720 / H)
    assert r["policy"].ratio_to_static == pytest.approx(0.2)
    assert (r["policy"].warnings, r["policy"].hibernations, r["policy"].resumes) == (1, 1, 0)
    # jupyter_server-style: no warning, shut down at the same tick (idle 620 >= 600).
    assert r["cull_shutdown"].gpu_hours == pytest.approx(0.25 * 720 / H)
    assert (r["cull_shutdown"].warnings, r["cull_shutdown"].restarts_state_lost) == (0, 0)
    assert [x.peak_gpus for x in r.values()] == [1, 1, 1]


def test_a_busy_cell_is_never_hibernated_and_a_gpu_idle_one_is_noted() -> None:
    # One long cell [0, 3000]: busy, never hibernated; after it ends at 3000: warn at 3540,
    # hibernate at 3600 -> 3600 s held.
    r = run([{"id": "a", "size": "whole", "start": 0, "end": 7200, "cells": [[0, 3000, 90]]}])
    assert r["policy"].gpu_hours == pytest.approx(3600 / H)
    assert r["policy"].hibernations == 1
    # With busy_gpu_idle_warning 300: a cell at 0% GPU is noted once, at the tick at 300 s (GPU
    # idle since the kernel started); a cell at 90% is not. jupyter_server's culler shows no note.
    noting = build_policy(600, 60, 5, 60, 0, 300, [], list(PROFILES))
    for util, notes in ((0, 1), (90, 0)):
        cell = [[0, 3000, util]]
        r = run([{"id": "a", "size": "whole", "start": 0, "end": 7200, "cells": cell}], cull=noting)
        assert (r["policy"].busy_warnings, r["cull_shutdown"].busy_warnings) == (notes, 0)


def test_activity_after_a_warning_cancels_it_and_the_next_idle_period_is_warned_again() -> None:
    # Warned at 660 (idle since 100); a cell at [680, 700] cancels the warning (tick 720: idle 20).
    # Idle since 700: warned again at 1260 (idle 560), hibernated at 1320 (idle 620).
    cells = [[0, 100, 90], [680, 700, 90]]
    r = run([{"id": "a", "size": "small", "start": 0, "end": 3600, "cells": cells}])
    assert (r["policy"].warnings, r["policy"].hibernations) == (2, 1)
    assert r["policy"].gpu_hours == pytest.approx(0.25 * 1320 / H)


def test_idle_past_the_timeout_then_a_resume() -> None:
    # state 200 MiB; delays: start 1 s, read 100 MiB/s -> resume 1 + 2 = 3 s; hibernation
    # fixed 2 s + 200 / 100 = 4 s of checkpoint.
    # policy: hibernate decided at 720, slice free at 724. Cell at 1000 resumes (free slice),
    # ready at 1003, so the rest of the session is 3 s later: the cell ends at 1103. Warn at
    # the first tick with idle >= 540 (1680, idle 577), hibernate at 1740 (idle 637), free at 1744.
    # Held 0..724 and 1000..1744 = 1468 s.
    delays = DelayModel(start_s=1, read_mib_s=100, hibernate_fixed_s=2, write_mib_s=100)
    session = {
        "id": "a",
        "size": "small",
        "start": 0,
        "end": 3600,
        "state_mib": 200,
        "cells": [[0, 100, 90], [1000, 1100, 90]],
    }
    r = run([session], delays=delays)
    p = r["policy"]
    assert p.gpu_hours == pytest.approx(0.25 * 1468 / H)
    assert (p.hibernations, p.resumes, p.warnings, p.restarts_state_lost) == (2, 1, 2, 0)
    assert p.resume_wait_p50_s == pytest.approx(3.0) and p.resume_wait_p95_s == pytest.approx(3.0)
    assert p.resumes_per_session_day == pytest.approx(1 / (3600 / 86400))
    assert p.slice_waits == 0
    # cull + shut down: shut down at 720 (no checkpoint), the cell at 1000 starts a fresh kernel
    # (1 s), its variables lost; the cell ends at 1101, shut down again at 1740 (idle 639).
    # Held 0..720 and 1000..1740 = 1460 s.
    c = r["cull_shutdown"]
    assert c.gpu_hours == pytest.approx(0.25 * 1460 / H)
    assert (c.restarts_state_lost, c.resumes, c.warnings) == (1, 0, 0)
    assert c.resume_wait_p50_s == pytest.approx(1.0)
    assert r["static"].gpu_hours == pytest.approx(0.25)


def test_hibernated_ttl_removal_loses_the_state() -> None:
    # hibernated_ttl 300: hibernated at 720 (no state, no fixed cost), removed at the tick at
    # 1020 (300 s later). The cell at 1500 starts a fresh kernel (1 s): state lost, no resume.
    # The cell runs 1501..1601; idle since 1601: warned at 2160 (idle 559), hibernated at 2220
    # (idle 619), removed again at 2520. Held 0..720 and 1500..2220 (the slice is taken when
    # the restart begins).
    cull = build_policy(600, 60, 5, 60, 300, 0, [], list(PROFILES))
    cells = [[0, 100, 90], [1500, 1600, 90]]
    r = run([{"id": "a", "size": "small", "start": 0, "end": 3600, "cells": cells}], cull=cull)
    p = r["policy"]
    assert (p.removals, p.restarts_state_lost, p.resumes, p.hibernations) == (2, 1, 0, 2)
    assert p.gpu_hours == pytest.approx(0.25 * (720 + 720) / H)


def test_two_sessions_share_one_gpu() -> None:
    # Two half GPUs on one device: both fit at once, nobody waits.
    halves = [
        {"id": "a", "size": "medium", "start": 0, "end": 3600, "cells": []},
        {"id": "b", "size": "medium", "start": 0, "end": 3600, "cells": []},
    ]
    r = run(halves, cull=policy(idle_timeout=0, warn_before=0), gpus=1)
    for result in r.values():
        assert (result.gpu_hours, result.peak_gpus, result.peak_gpus_held) == (pytest.approx(1.0), 1, 1.0)
        assert result.slice_waits == 0
    # Two whole GPUs on one device: b waits for a to end (3600 s), then holds it an hour.
    wholes = [dict(s, size="whole") for s in halves]
    r = run(wholes, cull=policy(idle_timeout=0, warn_before=0), gpus=1)
    assert r["static"].slice_waits == 1
    assert r["static"].slice_wait_total_s == pytest.approx(3600)
    assert r["static"].gpu_hours == pytest.approx(2.0)
    assert r["static"].timeline[-1] == (7200, 0.0)


def test_a_resume_that_waits_for_a_slice() -> None:
    # One GPU. a: whole, cells [0,100] and [1500,1600], 100 MiB of state; b: whole, busy [1000, 2000].
    # Delays: start 1 s, read 100 MiB/s (resume 2 s), checkpoint 0 + 100/100 = 1 s.
    # policy: a hibernated at 720, free at 721; b starts at 1000 on the free GPU. a's cell at
    # 1500 must resume but b holds the GPU until 2000: 500 s wait for the slice, then 2 s to
    # resume -> the user waits 502 s. a's cell runs 2002..2102; warned at 2700 (idle 598),
    # hibernated at 2760 (idle 658), free at 2761. Held: a 0..721 + 2000..2761, b 1000..2000.
    sessions = [
        {
            "id": "a",
            "size": "whole",
            "start": 0,
            "end": 7200,
            "state_mib": 100,
            "cells": [[0, 100, 90], [1500, 1600, 90]],
        },
        {"id": "b", "size": "whole", "start": 1000, "end": 2000, "cells": [[1000, 2000, 90]]},
    ]
    r = run(
        sessions, gpus=1, delays=DelayModel(start_s=1, read_mib_s=100, hibernate_fixed_s=0, write_mib_s=100)
    )
    p = r["policy"]
    assert (p.slice_waits, p.slice_wait_total_s) == (1, pytest.approx(500))
    assert p.resume_wait_p50_s == pytest.approx(502)
    assert p.resumes == 1
    assert p.gpu_hours == pytest.approx((721 + 761 + 1000) / H)
    assert p.peak_gpus == 1
    # static: a holds the GPU all along; b waits from 1000 to 7200 and then holds it 1000 s.
    s = r["static"]
    assert (s.slice_waits, s.slice_wait_total_s) == (1, pytest.approx(6200))
    assert s.gpu_hours == pytest.approx((7200 + 1000) / H)


def test_hibernations_wait_their_turn_and_ask_again_when_it_comes() -> None:
    # Three kernels idle since 100, warned at 660, due at 720; one checkpoint at a time, each
    # taking 100 s (fixed cost, no state). a: 720-820. b waits (still running, holding its
    # slice) and starts at 820 (asked again: still idle), done 920. c starts at 920, done 1020.
    one_at_a_time = policy(max_concurrent_hibernations=1)
    slow = DelayModel(1, 100, 100, 100)
    idle = [{"id": x, "size": "small", "start": 0, "end": 3600, "cells": [[0, 100, 90]]} for x in "abc"]
    r = run(idle, cull=one_at_a_time, delays=slow)["policy"]
    assert r.gpu_hours == pytest.approx(0.25 * (820 + 920 + 1020) / H)
    assert (r.hibernations, r.hibernations_queued, r.hibernations_dropped) == (3, 2, 0)
    # c runs a cell at 800 while it waits: when its turn comes (920) it is idle only 110 s, so the
    # hibernation is dropped. Its next idle period (since 810): warned at tick 1380 (570 s idle),
    # hibernated at 1440 (630 s), a slot being free; done at 1540.
    idle[2]["cells"].append([800, 810, 90])
    r = run(idle, cull=one_at_a_time, delays=slow)["policy"]
    assert r.gpu_hours == pytest.approx(0.25 * (820 + 920 + 1540) / H)
    assert (r.hibernations, r.hibernations_queued, r.hibernations_dropped) == (3, 2, 1)
    assert (r.warnings, r.resumes) == (4, 0)
    # Without the limit (the default of 4) the three checkpoints run together: 820 each.
    r = run([*idle[:2], dict(idle[2], cells=[[0, 100, 90]])], delays=slow)["policy"]
    assert r.gpu_hours == pytest.approx(0.25 * 3 * 820 / H)
    assert (r.hibernations_queued, r.hibernations_dropped) == (0, 0)


def test_per_size_rule_applies() -> None:
    # A rule gives whole GPUs idle_timeout 1200 (warn_before 60): idle since 100, warned at
    # 1260 (idle 1160 >= 1140), hibernated at 1320. The small session keeps the default 720.
    cull = policy(rules=[{"profiles": ["whole"], "idle_timeout": 1200}])
    sessions = [
        {"id": "w", "size": "whole", "start": 0, "end": 3600, "cells": [[0, 100, 90]]},
        {"id": "s", "size": "small", "start": 0, "end": 3600, "cells": [[0, 100, 90]]},
    ]
    r = run(sessions, cull=cull)
    assert r["policy"].gpu_hours == pytest.approx((1320 + 0.25 * 720) / H)
    # Without --gpus there are as many GPUs as needed: a whole one plus one for the small size.
    assert (r["policy"].peak_gpus, r["policy"].slice_waits) == (2, 0)


def test_cli_generate_writes_a_valid_trace(tmp_path: Path) -> None:
    done = cli(tmp_path, "--generate", "5", "--days", "1", "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert len(parse_trace(json.loads(done.stdout), list(PROFILES))) == 5


def test_generator_is_seeded_and_valid() -> None:
    first = generate(30, days=2, seed=7)
    assert trace_to_dict(first) == trace_to_dict(generate(30, days=2, seed=7))
    assert trace_to_dict(first) != trace_to_dict(generate(30, days=2, seed=8))
    # What it writes passes the same validation as a user's trace.
    assert parse_trace(json.loads(json.dumps(trace_to_dict(first))), list(PROFILES)) == first


def test_trace_validation_names_the_session_and_field() -> None:
    with pytest.raises(
        TraceError, match=r"session 'x'\.cells\[1\]: starts at 5, before cells\[0\] ends at 10"
    ):
        parse_trace(
            {
                "sessions": [
                    {"id": "x", "size": "small", "start": 0, "end": 60, "cells": [[0, 10, 1], [5, 20, 1]]}
                ]
            },
            ["small"],
        )


# -- the CLI -------------------------------------------------------------------------------

CONFIG = {"CullPolicy": {"idle_timeout": 600, "warn_before": 60, "interval": 60}}
GOOD = {"sessions": [{"id": "a", "size": "small", "start": 0, "end": 3600, "cells": [[0, 100, 90]]}]}


def cli(
    tmp_path: Path, *args: str, trace: Any = GOOD, config: Any = CONFIG
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "trace.json").write_text(trace if isinstance(trace, str) else json.dumps(trace))
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return subprocess.run(
        [sys.executable, "-m", "kernelmgr.cli", "simulate", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_json_replays_a_config_unchanged(tmp_path: Path) -> None:
    done = cli(tmp_path, "trace.json", "--config", "config.json", "--json", "--gpus", "2")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert set(doc) == {"static", "cull_shutdown", "policy"}
    keys = {
        "gpu_hours", "ratio_to_static", "peak_gpus", "resumes", "resumes_per_session_day",
        "resume_wait_p50_s", "resume_wait_p95_s", "slice_wait_total_s", "restarts_state_lost",
    }  # fmt: skip
    assert keys <= set(doc["policy"])
    # Default delays: the hibernation holds the slice 0.27 s more (docs/benchmarks.md).
    assert doc["policy"]["gpu_hours"] == pytest.approx(0.25 * 720.27 / H, abs=1e-6)
    assert doc["policy"]["warnings"] == 1


def test_cli_reads_a_python_config_too(tmp_path: Path) -> None:
    (tmp_path / "config.py").write_text("c.CullPolicy.idle_timeout = 600\nc.CullPolicy.warn_before = 60\n")
    done = cli(tmp_path, "trace.json", "--config", "config.py", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policy"]["hibernations"] == 1


def test_cli_says_when_the_configuration_culls_nothing(tmp_path: Path) -> None:
    """No CullPolicy in the configuration: three identical columns, and a note that says why."""
    done = cli(tmp_path, "trace.json", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policy"]["hibernations"] == 0
    assert (
        "the default configuration (no --config) sets no CullPolicy.idle_timeout: nothing is culled"
        in done.stderr
    )
    configured = cli(tmp_path, "trace.json", "--config", "config.json", "--json")
    assert configured.stderr == ""


def test_cli_table_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    done = cli(tmp_path, "trace.json", "--config", "config.json", "--plot", "out.png")
    assert done.returncode == 0, done.stderr
    assert "| GPU-hours reserved | 0.25 | 0.05 | 0.05 |" in done.stdout
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD_SESSION = {"id": "s1", "size": "small", "start": 0, "end": 100, "cells": []}
T = ["trace.json"]
C = ["trace.json", "--config", "config.json"]


def bad(**changes: Any) -> dict[str, Any]:
    """A one-session trace with ``changes`` made to the session."""
    return {"sessions": [dict(BAD_SESSION, **changes)]}


@pytest.mark.parametrize(
    ("trace", "config", "args", "expected"),
    [
        (GOOD, CONFIG, ["missing.json"], "trace 'missing.json': no such file"),
        ("{not json", CONFIG, T, "trace 'trace.json': not valid JSON"),
        (bad(end=-1), CONFIG, T, "session 's1'.end: must be >= 0"),
        (bad(start=50, end=10), CONFIG, T, "session 's1'.end: 10 is before start 50"),
        (bad(size="huge"), CONFIG, T, "session 's1'.size: unknown GPU size 'huge'"),
        (bad(cells=[[90, 120, 50]]), CONFIG, T, "session 's1'.cells[0]: [90, 120] is outside the session"),
        (bad(cells=[[1, 2, 150]]), CONFIG, T, "session 's1'.cells[0][2] (gpu_util_percent): must be"),
        (bad(cells=[[3, 2, 50]]), CONFIG, T, "session 's1'.cells[0]: end 2 is before start 3"),
        (bad(state_mib="big"), CONFIG, T, "session 's1'.state_mib: must be a number of MiB"),
        ({"sessions": [BAD_SESSION, BAD_SESSION]}, CONFIG, T, "session 's1'.id: appears twice"),
        (bad(colour=1), CONFIG, T, "session 's1'.colour: unknown key"),
        ([], CONFIG, T, 'trace: must be an object {"sessions": [...]}'),
        (GOOD, "{", C, "--config 'config.json': not valid JSON"),
        (GOOD, CONFIG, ["trace.json", "--config", "nope.json"], "--config 'nope.json': no such file"),
        (GOOD, {"CullPolicy": {"idle_timeout": 60}}, C, "CullPolicy.warn_before (60s) must be shorter"),
        (GOOD, CONFIG, ["trace.json", "--gpus", "0"], "--gpus: must be at least 1"),
        (GOOD, CONFIG, [], "a TRACE.json is required"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, trace: Any, config: Any, args: list[str], expected: str
) -> None:
    done = cli(tmp_path, *args, trace=trace, config=config)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert expected in lines[0]


def test_a_size_that_never_fits_is_a_usage_error(tmp_path: Path) -> None:
    config = {"ElasticKernels": {"gpu_inventory": [{"uuid": "g0", "name": "T4", "memory_mib": 16384}]}}
    trace = {"sessions": [dict(BAD_SESSION, size="medium")]}  # 20 GiB on a 16 GiB GPU
    done = cli(tmp_path, "trace.json", "--config", "config.json", "--gpus", "2", trace=trace, config=config)
    assert done.returncode == 2
    assert "session 's1'.size: GPU size 'medium' can never fit" in done.stderr.strip()


# -- the queue, culling under pressure and Kubernetes delays (issue 29) -----------------------


def pressured(minimum: float) -> Policy:
    return build_policy(
        idle_timeout=0,
        interval=60,
        gpu_idle_threshold=5,
        warn_before=60,
        hibernated_ttl=0,
        busy_gpu_idle_warning=0,
        rules=[],
        known_profiles=list(PROFILES),
        pressure_idle_minimum=minimum,
    )


def test_pressure_culling_gives_a_waiting_user_the_gpu_of_an_idle_one() -> None:
    # One GPU. "idle" runs one cell [0, 10] and sits until 4 h; "waiter" starts at 1000 s.
    # No idle timeout: static and policy make the waiter wait until 4 h (14400 - 1000 = 13400 s).
    # Pressure, minimum 300 s: the tick at 1020 sees a waiter and "idle" idle 1010 s -> warned;
    # at 1080 (warning served) hibernated; the checkpoint takes 0 s (no state): waited 80 s.
    sessions = [
        {"id": "idle", "size": "whole", "start": 0, "end": 4 * H, "state_mib": 0, "cells": [[0, 10, 90]]},
        {"id": "waiter", "size": "whole", "start": 1000, "end": 2 * H, "state_mib": 0, "cells": []},
    ]
    results = run(sessions, pressured(300), gpus=1)
    assert set(results) == {"static", "cull_shutdown", "policy", "pressure"}
    assert results["policy"].slice_wait_total_s == pytest.approx(13400)
    assert results["pressure"].slice_wait_total_s == pytest.approx(80)
    assert results["pressure"].hibernations == 1 and results["pressure"].warnings == 1
    assert results["pressure"].gpu_hours < results["policy"].gpu_hours


def test_the_pressure_column_only_when_a_minimum_is_set() -> None:
    sessions = [{"id": "a", "size": "small", "start": 0, "end": H, "cells": []}]
    assert "pressure" not in run(sessions, policy())


def test_a_kubernetes_pod_delays_each_start_and_a_nodes_first_pod_pulls() -> None:
    # Two sessions on one GPU, one after the other: both wait 5 s for their pod; only the first
    # pays the 60 s pull. Static GPU time: (3600 + 5 + 60) + (3600 + 5) s of a whole GPU.
    sessions = [
        {"id": "first", "size": "whole", "start": 0, "end": H, "cells": []},
        {"id": "second", "size": "whole", "start": 2 * H, "end": 3 * H, "cells": []},
    ]
    delays = DelayModel(1, 100, 0, 100, pod_s=5, pull_s=60)
    static = run(sessions, policy(), gpus=1, delays=delays)["static"]
    assert static.gpu_hours == pytest.approx((2 * H + 70) / H)


def test_a_user_holding_a_gpu_already_waits_behind_one_who_holds_none() -> None:
    # Two GPUs: Ann holds one all along, "holder" the other until 1000 s. Ann asks again at 20
    # (a 2000 s session), Bob at 30 (100 s). At 1000 Bob goes first (Ann holds one already):
    # waited 970, ends 1100; then Ann's at 1100, waited 1080. In arrival order: 980 + 2970.
    sessions = [
        {"id": "ann-0", "user": "ann", "size": "whole", "start": 0, "end": 10000, "cells": []},
        {"id": "holder", "size": "whole", "start": 0, "end": 1000, "cells": []},
        {"id": "ann-1", "user": "ann", "size": "whole", "start": 20, "end": 2020, "cells": []},
        {"id": "bob-1", "user": "bob", "size": "whole", "start": 30, "end": 130, "cells": []},
    ]
    static = run(sessions, policy(), gpus=2)["static"]
    assert static.slice_wait_total_s == pytest.approx(970 + 1080)
