"""A synthetic notebook workload, for tests, demos and the benchmark.

The model (documented in docs/simulate.md) follows what studies of interactive notebook GPU use
report (NotebookOS, ASPLOS'25, on Adobe's trace: GPUs busy a small fraction of the time they
are held) with plain, tunable distributions rather than a fit to any one trace:

* sessions arrive during working hours (09:00-18:00 of each day, uniform), a fifth of them at
  any hour (batch users, other time zones);
* a session lasts a log-normal time, median 2 h, cut to [10 min, 12 h];
* inside it, the user works in **bursts**: a geometric number of cells (mean 6), separated by
  **think times** (exponential, mean 40 s); between bursts a longer pause (exponential, mean
  25 min: meetings, reading, lunch);
* a cell runs a log-normal time, median 8 s; 4% are training cells of 5-60 min;
* 70% of cells use the GPU (utilisation 40-95%), training cells 85-100%, the others 0%;
* GPU sizes are drawn by weight (default small 50%, medium 30%, whole 20%), and the kernel's
  state to checkpoint is log-normal, median 400 MiB, cut to 16 GiB.

Seeded: the same arguments always give the same trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from kernelmgr.core.simulate.trace import Cell, Session

DEFAULT_SIZES: Mapping[str, float] = {"small": 0.5, "medium": 0.3, "whole": 0.2}


@dataclass(frozen=True)
class WorkloadModel:
    """The knobs of the generator (seconds unless named otherwise)."""

    session_median_s: float = 2 * 3600
    session_sigma: float = 0.8
    session_min_s: float = 600
    session_max_s: float = 12 * 3600
    off_hours_share: float = 0.2
    burst_cells_mean: float = 6.0
    think_mean_s: float = 40.0
    pause_mean_s: float = 25 * 60
    cell_median_s: float = 8.0
    cell_sigma: float = 1.2
    training_share: float = 0.04
    training_min_s: float = 5 * 60
    training_max_s: float = 60 * 60
    gpu_cell_share: float = 0.7
    state_median_mib: float = 400.0
    state_max_mib: float = 16 * 1024
    sizes: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_SIZES))


def _session(rng: random.Random, model: WorkloadModel, ident: str, start: float) -> Session:
    length = rng.lognormvariate(math.log(model.session_median_s), model.session_sigma)
    end = start + min(model.session_max_s, max(model.session_min_s, length))
    cells: list[Cell] = []
    t = start + rng.expovariate(1 / model.think_mean_s)
    while t < end:
        burst = 1 + int(rng.expovariate(1 / max(1e-9, model.burst_cells_mean - 1)))
        for _ in range(burst):
            if rng.random() < model.training_share:
                duration = rng.uniform(model.training_min_s, model.training_max_s)
                util = rng.uniform(85, 100)
            else:
                duration = rng.lognormvariate(math.log(model.cell_median_s), model.cell_sigma)
                util = rng.uniform(40, 95) if rng.random() < model.gpu_cell_share else 0.0
            if t + duration > end:
                break
            cells.append(Cell(round(t, 3), round(t + duration, 3), round(util, 1)))
            t += duration + rng.expovariate(1 / model.think_mean_s)
        t += rng.expovariate(1 / model.pause_mean_s)
    names, weights = zip(*model.sizes.items(), strict=True)
    size = rng.choices(names, weights)[0]
    state = min(model.state_max_mib, rng.lognormvariate(math.log(model.state_median_mib), 1.0))
    return Session(ident, size, round(start, 3), round(end, 3), tuple(cells), round(state, 1))


def generate(
    sessions: int, days: float = 1.0, seed: int = 0, model: WorkloadModel | None = None
) -> list[Session]:
    """``sessions`` sessions spread over ``days`` days, sorted by start."""
    model = model or WorkloadModel()
    rng = random.Random(seed)
    whole_days = max(1, math.ceil(days))
    horizon = days * 86400
    out: list[Session] = []
    for i in range(sessions):
        day = rng.randrange(whole_days)
        if rng.random() < model.off_hours_share:
            start = rng.uniform(0, horizon)
        else:
            start = min(horizon, day * 86400 + rng.uniform(9 * 3600, 18 * 3600))
        out.append(_session(rng, model, f"s{i:05d}", start))
    out.sort(key=lambda s: (s.start, s.id))
    return out
