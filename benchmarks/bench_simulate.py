"""Replay speed of ``jupyter elastic simulate``: 1,000 sessions over 2 simulated days.

An admin tries many policies, so one replay must take seconds, not minutes. This times the
replay of a generated trace (:mod:`kernelmgr.core.simulate.generate`, seeded) under each of
the three policies with the example production configuration
(``examples/jupyter_server_config.json``: CullPolicy with a per-size rule), once with as many
GPUs as the peak needs and once with a GPU count that makes sessions wait (the allocator is
asked again at every release). Reported: wall time (median of ``--rounds``), events handled
(session events, culler ticks, resumes), cost per event, and simulated seconds per wall
second, side by side in one run.

Run: ``python benchmarks/bench_simulate.py [--sessions 1000] [--days 2] [--gpus 48] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernelmgr.core.simulate.engine import MODES, simulate, simulated_inventory  # noqa: E402
from kernelmgr.core.simulate.generate import generate  # noqa: E402
from kernelmgr.simulate_cli import build_setup, load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--days", type=float, default=2.0)
    parser.add_argument("--gpus", type=int, default=48, help="GPU count of the constrained case")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    setup = build_setup(load_config(str(ROOT / "examples" / "jupyter_server_config.json")), None)
    started = time.perf_counter()
    sessions = generate(args.sessions, args.days, seed=0)
    generated = time.perf_counter() - started
    cells = sum(len(s.cells) for s in sessions)
    simulated = max(s.end for s in sessions)
    print(
        f"{len(sessions)} sessions, {cells:,} cells, {args.days:g} days "
        f"(generated in {generated:.2f} s); median of {args.rounds} rounds\n"
    )
    print(
        "| GPUs | policy | wall time | events | per event | simulated s per wall s | peak GPUs "
        "| GPU-hours | ratio to static | slice wait total |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for gpus in (None, args.gpus):
        inventory = simulated_inventory(gpus) if gpus else None
        results = simulate(sessions, setup.profiles, setup.policy, inventory)
        for mode in MODES:
            times = []
            for _ in range(args.rounds):
                begin = time.perf_counter()
                simulate(sessions, setup.profiles, setup.policy, inventory, modes=(mode,))
                times.append(time.perf_counter() - begin)
            wall = statistics.median(times)
            result = results[mode]
            print(
                f"| {gpus or 'as needed'} | {mode} | {wall:.2f} s | {result.events:,} | "
                f"{wall / result.events * 1e6:.1f} µs | {simulated / wall:,.0f} | "
                f"{result.peak_gpus} | {result.gpu_hours:,.0f} | {result.ratio_to_static:.3f} | "
                f"{result.slice_wait_total_s / 3600:,.1f} h |"
            )


if __name__ == "__main__":
    main()
