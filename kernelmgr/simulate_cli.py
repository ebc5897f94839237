"""``jupyter elastic simulate``: the adapter around :mod:`kernelmgr.core.simulate`.

It reads the trace and a ``jupyter_server_config.json`` (or ``.py``) through traitlets exactly as
the server does (``ElasticKernels.profiles``, ``ElasticKernels.gpu_inventory``,
``ElasticKernels.allocation_strategy``, ``CullPolicy.*``), so a production configuration replays
unchanged, then prints a table or JSON and optionally draws a plot (matplotlib, optional).
Every user mistake becomes :class:`SimulateError`: one line, exit code 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

from traitlets.config import Config
from traitlets.config.loader import ConfigFileNotFound, JSONFileConfigLoader, PyFileConfigLoader

from kernelmgr.config import CullPolicy, ElasticKernels
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.inventory import GpuInventory
from kernelmgr.core.policy import Policy, build_policy
from kernelmgr.core.profiles import GpuProfile, parse_profiles
from kernelmgr.core.simulate.engine import (
    DEFAULT_GPU_MIB,
    DEFAULT_GPU_MODEL,
    MODES,
    DelayModel,
    Result,
    simulate,
    simulated_inventory,
)
from kernelmgr.core.simulate.trace import Session, parse_trace

LABELS = {
    "static": "static (whole session)",
    "cull_shutdown": "cull + shut down",
    "policy": "elastic policy",
    "pressure": "policy + pressure culling",
}


class SimulateError(Exception):
    """A user mistake (file, JSON, trace, configuration, flag), reported as one line."""


@dataclass(frozen=True)
class Setup:
    profiles: dict[str, GpuProfile]
    policy: Policy
    inventory: GpuInventory | None
    strategy: str


def load_config(path: str | None) -> Config:
    if path is None:
        return Config()
    if not os.path.isfile(path):
        raise SimulateError(f"--config {path!r}: no such file")
    directory, name = os.path.split(os.path.abspath(path))
    loader_class = PyFileConfigLoader if name.endswith(".py") else JSONFileConfigLoader
    try:
        return loader_class(name, path=directory).load_config()
    except ConfigFileNotFound:
        raise SimulateError(f"--config {path!r}: no such file") from None
    except ValueError as err:  # JSONDecodeError is one
        raise SimulateError(f"--config {path!r}: not valid JSON: {err}") from None
    except Exception as err:  # a .py config that raises
        raise SimulateError(f"--config {path!r}: cannot be loaded: {type(err).__name__}: {err}") from None


def build_setup(config: Config, gpus: int | None) -> Setup:
    """Profiles, policy and GPUs from the configuration, validated like the server validates them."""
    elastic = ElasticKernels(config=config)
    try:
        profiles = parse_profiles(elastic.profiles)
        policy = CullPolicy(config=config).build(list(profiles))
        declared = GpuInventory.declared(elastic.gpu_inventory) if elastic.gpu_inventory else None
    except ConfigError as err:
        raise SimulateError(f"configuration: {err}") from None
    model = next(iter(declared), None) if declared is not None else None
    if gpus is not None:
        name = model.name if model else DEFAULT_GPU_MODEL
        inventory: GpuInventory | None = simulated_inventory(
            gpus, model.memory_mib if model else DEFAULT_GPU_MIB, name
        )
    else:
        inventory = None  # as many as needed: the answer is the peak
    return Setup(profiles, policy, inventory, elastic.allocation_strategy)


def with_pressure(setup: Setup, minimum: float) -> Setup:
    """``--pressure-idle-minimum``: the configuration's policy with that minimum, validated alike."""
    p = setup.policy
    try:
        policy = build_policy(
            **p.defaults.to_dict(),
            interval=p.interval,
            rules=[rule.to_dict() for rule in p.rules],
            known_profiles=list(setup.profiles),
            max_concurrent_hibernations=p.max_concurrent_hibernations,
            start_grace=p.start_grace,
            pressure_idle_minimum=minimum,
        )
    except ConfigError as err:
        raise SimulateError(f"--pressure-idle-minimum: {err}") from None
    return replace(setup, policy=policy)


def load_trace(path: str, profiles: dict[str, GpuProfile]) -> list[Session]:
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except FileNotFoundError:
        raise SimulateError(f"trace {path!r}: no such file") from None
    except IsADirectoryError:
        raise SimulateError(f"trace {path!r}: is a directory, not a JSON file") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise SimulateError(f"trace {path!r}: not valid JSON: {err}") from None
    try:
        return parse_trace(raw, list(profiles))
    except ConfigError as err:
        raise SimulateError(f"trace {path!r}: {err}") from None


def run(
    trace: str,
    config: str | None,
    gpus: int | None,
    delays: DelayModel,
    pressure_idle_minimum: float | None = None,
) -> tuple[Setup, list[Session], dict[str, Result]]:
    setup = build_setup(load_config(config), gpus)
    if pressure_idle_minimum is not None:
        setup = with_pressure(setup, pressure_idle_minimum)
    sessions = load_trace(trace, setup.profiles)
    try:
        results = simulate(sessions, setup.profiles, setup.policy, setup.inventory, delays, setup.strategy)
    except ConfigError as err:
        raise SimulateError(f"trace {trace!r}: {err}") from None
    return setup, sessions, results


def _cell(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}" if abs(value) < 1000 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


ROWS = (
    ("GPU-hours reserved", "gpu_hours", ""),
    ("ratio to static", "ratio_to_static", "x"),
    ("peak GPUs in use", "peak_gpus", ""),
    ("peak GPUs held (sum of sizes)", "peak_gpus_held", ""),
    ("hibernations", "hibernations", ""),
    ("resumes", "resumes", ""),
    ("resumes per session-day", "resumes_per_session_day", ""),
    ("resume wait p50", "resume_wait_p50_s", " s"),
    ("resume wait p95", "resume_wait_p95_s", " s"),
    ("starts/resumes that waited for a slice", "slice_waits", ""),
    ("slice wait total", "slice_wait_total_s", " s"),
    ("restarts with state lost", "restarts_state_lost", ""),
    ("idle warnings shown", "warnings", ""),
)


def render_table(results: dict[str, Result]) -> str:
    """A Markdown table (readable in a terminal, pasteable into a README)."""
    header = "| | " + " | ".join(LABELS[m] for m in MODES if m in results) + " |"
    lines = [header, "|---" * (1 + len(results)) + "|"]
    for label, key, unit in ROWS:
        values = [_cell(results[m].to_dict()[key], unit) for m in MODES if m in results]
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def plot(results: dict[str, Result], path: str, title: str) -> None:
    """GPUs held over time under each policy, with the table under it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimulateError("--plot needs matplotlib: pip install matplotlib") from None
    figure, (axes, table_axes) = plt.subplots(
        2, 1, figsize=(10, 7.5), gridspec_kw={"height_ratios": [3, 2]}, constrained_layout=True
    )
    modes = [m for m in MODES if m in results]
    for mode in modes:
        timeline = results[mode].timeline
        if timeline:
            xs = [t / 3600 for t, _ in timeline]
            ys = [held for _, held in timeline]
            axes.step(xs, ys, where="post", label=f"{LABELS[mode]}: {results[mode].gpu_hours:,.1f} GPU-h")
    axes.set_xlabel("hours from trace start")
    axes.set_ylabel("GPUs held (sum of sizes)")
    axes.set_title(title)
    axes.legend(loc="upper right")
    axes.grid(alpha=0.3)
    table_axes.axis("off")
    cells = [[_cell(results[m].to_dict()[key], unit) for m in modes] for _label, key, unit in ROWS]
    table = table_axes.table(
        cellText=cells,
        rowLabels=[label for label, _k, _u in ROWS],
        colLabels=[LABELS[m] for m in modes],
        loc="center",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    try:
        figure.savefig(path, dpi=110)
    except OSError as err:
        raise SimulateError(f"--plot {path!r}: cannot write: {err.strerror or err}") from None
    finally:
        plt.close(figure)
