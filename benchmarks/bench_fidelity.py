"""Fidelity: how many notebook variables come back equal, different or lost, per library.

A set of notebook states of this project's making (``CASES``: one or a few variables each,
as a notebook leaves them), each restored three ways, side by side in one run:

* **checkpoint**: this project's writer and reader (one checkpoint per case, through
  ``data.bin`` + ``manifest.json``, grouping, reducers, the generic rule), with how many of
  the cases that came back different the restore report flagged (``differs``);
* the same checkpoint **without reducers** (plain cloudpickle in the same writer, the
  generic rule off, fingerprints still recorded): what the difference check alone flags;
* **cloudpickle** and **dill**, each variable pickled and unpickled on its own (what a
  per-variable checkpoint built on either does).

A case is *equal* when its behavioural check passes on the restored variables (the check
compares behaviour and state, not ``repr``: the optimizer's next step, the figure redrawn,
the widget's state), *differs* when the variables load but the check fails, *lost* when any
of them fails to pickle or to load. By default it runs inside a real ipykernel (started
with jupyter_client), so widgets hold real comms as in a notebook; ``--in-process`` runs it
here instead. Libraries that are not installed are left out of the table.

Run: ``python benchmarks/bench_fidelity.py [--in-process]``. Prints a Markdown table for
docs/benchmarks.md. *recomputed*: of the cases the checkpoint lost, how many come back equal
when the agent's recompute re-runs the case's source as one recorded cell (the safety rule
of ``kernelmgr.checkpoint.cells`` applies; cases not built from source count as not).

``--overhead [--repeat 5]`` instead times what this costs a checkpoint: the writer with the
reducers, the generic rule and the fingerprints on, beside the same writer with them off.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pickle
import statistics
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import print_header, print_row  # noqa: E402

Namespace = dict[str, Any]


@dataclass
class Case:
    library: str  # the module that must import for the case to run
    name: str
    build: Callable[[], Namespace]
    check: Callable[[Namespace, Namespace], bool]  # (original, restored) -> equal


#: The source each ``notebook()`` namespace was built from, by ``id`` (for the recompute column).
_SOURCES: dict[int, str] = {}


def notebook(source: str) -> Namespace:
    ns: Namespace = {"__name__": "__main__"}
    exec(textwrap.dedent(source), ns)
    _SOURCES[id(ns)] = textwrap.dedent(source)
    return ns


# --- the cases ------------------------------------------------------------------------------


def _python_cases() -> list[Case]:
    def shared() -> Namespace:
        return notebook("b = [1, 2]\nc = [b, b]\nd = {'x': b}")

    def classes() -> Namespace:
        return notebook(
            """
            import functools
            class Point:
                def __init__(self, x, y):
                    self.x, self.y = x, y
                def norm(self):
                    return (self.x ** 2 + self.y ** 2) ** 0.5
            def scale(p, k):
                return Point(p.x * k, p.y * k)
            p = Point(3, 4)
            """
        )

    def dropped() -> Namespace:
        return notebook(
            """
            class Series:
                # pickles its values but drops its private index (like many library classes)
                def __init__(self, values):
                    self.values = list(values)
                    self._index = {v: i for i, v in enumerate(values)}
                def __getstate__(self):
                    return {"values": self.values}
                def position(self, v):
                    return self._index[v]
            s = Series("abc")
            """
        )

    def generator() -> Namespace:
        return notebook("g = (i * i for i in range(10))")

    def summary() -> Namespace:
        return notebook(
            """
            class Window:
                # a __reduce__ that rebuilds from a summary: restored shorter, nothing fails
                def __init__(self, items):
                    self.items = list(items)
                def __reduce__(self):
                    return (Window, (self.items[-2:],))
            w = Window(range(10))
            """
        )

    return [
        Case(
            "builtins",
            "shared lists",
            shared,
            lambda o, r: r["c"][0] is r["c"][1] is r["b"] and r["d"]["x"] is r["b"],
        ),
        Case(
            "builtins",
            "notebook class and function",
            classes,
            lambda o, r: (
                r["scale"](r["p"], 2).norm() == 10.0 and isinstance(r["scale"](r["p"], 1), r["Point"])
            ),
        ),
        Case(
            "builtins", "attribute dropped by __getstate__", dropped, lambda o, r: r["s"].position("c") == 2
        ),
        Case("builtins", "generator", generator, lambda o, r: list(r["g"]) == list(o["g"])),
        Case("builtins", "__reduce__ from a summary", summary, lambda o, r: r["w"].items == o["w"].items),
    ]


def _numpy_pandas_cases() -> list[Case]:
    def arrays() -> Namespace:
        import numpy as np

        data = np.arange(40.0).reshape(10, 4)
        return {"data": data, "train": data[:8], "test": data[8:], "column": data[:, 0]}

    def check_arrays(o: Namespace, r: Namespace) -> bool:
        r["data"][9, 0] = -1.0  # the views see writes into the array they view, as before
        return bool(r["test"][1, 0] == -1.0 and r["column"][9] == -1.0 and (r["train"] == o["train"]).all())

    def generator_state() -> Namespace:
        import numpy as np

        rng = np.random.default_rng(0)
        rng.random(5)
        return {"rng": rng}

    def check_generator(o: Namespace, r: Namespace) -> bool:
        import numpy as np

        return bool(np.array_equal(r["rng"].random(3), o["rng"].random(3)))

    def frame() -> Namespace:
        import pandas as pd

        df = pd.DataFrame({"a": [1, 2, 3], "b": list("xyz")}).set_index("b")
        df.attrs["source"] = "bench"
        return {"df": df}

    return [
        Case("numpy", "array and its views", arrays, check_arrays),
        Case("numpy", "random generator state", generator_state, check_generator),
        Case(
            "pandas",
            "DataFrame with index and attrs",
            frame,
            lambda o, r: r["df"].equals(o["df"]) and r["df"].attrs == {"source": "bench"},
        ),
    ]


def _torch_cases() -> list[Case]:
    def accumulating() -> Namespace:
        import torch

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        model(torch.randn(8, 4)).sum().backward()  # half an accumulated batch
        return {"model": model}

    def check_accumulating(o: Namespace, r: Namespace) -> bool:
        import torch

        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        for ns in (o, r):
            ns["model"](x).sum().backward()
        return all(
            b.grad is not None and torch.equal(a.grad, b.grad)
            for a, b in zip(o["model"].parameters(), r["model"].parameters(), strict=True)
        )

    def training(kind: str) -> Callable[[], Namespace]:
        def build() -> Namespace:
            import torch

            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            opt = getattr(torch.optim, kind)(model.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            x, y = torch.randn(16, 4), torch.randn(16, 2)
            for _ in range(3):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                sched.step()
            return {"model": model, "opt": opt, "sched": sched, "x": x, "y": y}

        return build

    def check_training(o: Namespace, r: Namespace) -> bool:
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "optimizer.step() overridden" warning counts
            for ns in (o, r):
                for _ in range(2):
                    ns["opt"].zero_grad()
                    torch.nn.functional.mse_loss(ns["model"](ns["x"]), ns["y"]).backward()
                    ns["opt"].step()
                    ns["sched"].step()
        return (
            torch.equal(o["model"].weight, r["model"].weight)
            and o["opt"].param_groups[0]["lr"] == r["opt"].param_groups[0]["lr"]
        )

    def hooked() -> Namespace:
        return notebook(
            """
            import torch
            calls = []
            model = torch.nn.Linear(3, 2)
            handle = model.register_forward_hook(lambda m, i, out: calls.append(out.shape[0]))
            """
        )

    def check_hooked(o: Namespace, r: Namespace) -> bool:
        import torch

        r["model"](torch.ones(2, 3))
        called = r["calls"] == [2]
        r["handle"].remove()
        r["model"](torch.ones(2, 3))
        return called and r["calls"] == [2]

    cases = [Case("torch", "model mid gradient accumulation", accumulating, check_accumulating)]
    for kind in ("SGD", "Adam", "AdamW"):
        cases.append(Case("torch", f"model + {kind} + StepLR, next steps", training(kind), check_training))
    cases.append(Case("torch", "forward hook and its handle", hooked, check_hooked))
    return cases


def _matplotlib_cases() -> list[Case]:
    def line() -> Namespace:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        (ln,) = ax.plot([1, 2, 3])
        fig.canvas.draw()
        return {"fig": fig, "ax": ax, "line": ln}

    def check_line(o: Namespace, r: Namespace) -> bool:
        r["fig"].canvas.draw()
        r["line"].set_ydata([3, 2, 1])
        return bool(r["fig"].stale and r["line"].axes is r["ax"] and r["ax"].figure is r["fig"])

    def image() -> Namespace:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        im = ax.imshow([[0, 1], [1, 0]])
        fig.canvas.draw()
        return {"fig": fig, "image": im}

    def check_image(o: Namespace, r: Namespace) -> bool:
        r["fig"].canvas.draw()
        r["image"].set_clim(0, 2)
        return bool(r["fig"].stale)

    def surface() -> Namespace:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        fig = plt.figure()
        ax = fig.add_subplot(projection="3d")
        x, y = np.meshgrid(np.arange(4.0), np.arange(4.0))
        surf = ax.plot_surface(x, y, x * y)
        fig.canvas.draw()
        return {"fig": fig, "surf": surf}

    def check_surface(o: Namespace, r: Namespace) -> bool:
        r["fig"].canvas.draw()
        r["surf"].set_alpha(0.5)
        return bool(r["fig"].stale)

    return [
        Case("matplotlib", "Line2D redraws its figure", line, check_line),
        Case("matplotlib", "AxesImage follows its norm", image, check_image),
        Case("matplotlib", "3-D surface redraws its figure", surface, check_surface),
    ]


def _plotly_cases() -> list[Case]:
    def express() -> Namespace:
        import plotly.express as px

        fig = px.scatter(x=[1, 2, 3, 4], y=[2, 1, 4, 3], color=["a", "b", "a", "b"])
        return {"fig": fig}

    def check_express(o: Namespace, r: Namespace) -> bool:
        import plotly.express as px

        return bool(
            r["fig"].to_plotly_json() == o["fig"].to_plotly_json()
            and px.get_trendline_results(r["fig"]) == px.get_trendline_results(o["fig"])
        )

    return [Case("plotly", "express figure (JSON + trendline results)", express, check_express)]


def _bokeh_cases() -> list[Case]:
    def plot() -> Namespace:
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        source = ColumnDataSource({"x": [1, 2, 3], "y": [3, 1, 2]})
        fig = figure(title="bench")
        line = fig.line("x", "y", source=source)
        return {"fig": fig, "line": line, "source": source}

    def check_plot(o: Namespace, r: Namespace) -> bool:
        def props(model: Any) -> str:
            values = sorted(model.properties_with_values(include_defaults=True).items())
            return repr({k: getattr(v, "id", v) if hasattr(v, "references") else v for k, v in values})

        def by_id(fig: Any) -> list[Any]:
            return sorted(fig.references(), key=lambda m: m.id)

        pairs = zip(by_id(o["fig"]), by_id(r["fig"]), strict=True)
        return r["fig"].renderers[0] is r["line"] and all(props(m) == props(n) for m, n in pairs)

    return [Case("bokeh", "figure, renderer and data source", plot, check_plot)]


def _widget_cases() -> list[Case]:
    def widgets() -> Namespace:
        import ipywidgets as w

        slider = w.IntSlider(value=7, max=10, description="epochs")
        return {"slider": slider, "box": w.VBox([slider, w.Dropdown(options=["a", "b"], value="b")])}

    def check_widgets(o: Namespace, r: Namespace) -> bool:
        return bool(
            r["slider"].get_state() == o["slider"].get_state()
            and r["box"].children[0] is r["slider"]
            and r["slider"].model_id == o["slider"].model_id
        )

    return [Case("ipywidgets", "slider in a box (state, model id)", widgets, check_widgets)]


def _astropy_cases() -> list[Case]:
    def wcs() -> Namespace:
        from astropy.wcs import WCS

        w = WCS(naxis=2)
        w.wcs.cd = [[1e-3, 2e-4], [0.0, 1e-3]]
        w.wcs.ctype = ["RA---TAN", "DEC--TAN"]
        return {"wcs": w}

    def check_wcs(o: Namespace, r: Namespace) -> bool:
        import numpy as np

        w = r["wcs"]
        return bool(w.wcs.has_cd() and np.array_equal(w.wcs.cd, o["wcs"].wcs.cd))

    return [Case("astropy", "WCS with a CD matrix", wcs, check_wcs)]


def all_cases() -> list[Case]:
    cases = [
        *_python_cases(),
        *_numpy_pandas_cases(),
        *_torch_cases(),
        *_matplotlib_cases(),
        *_plotly_cases(),
        *_bokeh_cases(),
        *_widget_cases(),
        *_astropy_cases(),
    ]
    return [c for c in cases if c.library == "builtins" or importlib.util.find_spec(c.library) is not None]


# --- the three ways -------------------------------------------------------------------------


def _variables(ns: Namespace) -> Namespace:
    return {k: v for k, v in ns.items() if not k.startswith("__")}


def restore_checkpoint_way(ns: Namespace, directory: Path) -> tuple[Namespace | None, bool]:
    """This project's checkpoint: (restored namespace or None if anything was lost, flagged)."""
    from kernelmgr.checkpoint.format import restore_checkpoint, write_checkpoint

    key = b"b" * 32
    manifest = write_checkpoint(directory, ns, key=key, owner="bench", kernel_id="bench")
    restored: Namespace = {"__name__": "__main__"}
    report = restore_checkpoint(directory, restored, key=key, owner="bench", kernel_id="bench")
    if manifest.skipped() or report is None or report["not_restored"]:
        return None, False
    return restored, bool(report["differs"])


def recompute_way(ns: Namespace, directory: Path) -> Namespace | None:
    """The checkpoint, then the agent's recompute with the case's source as the one recorded cell."""
    from kernelmgr.checkpoint.cells import plan_recompute, record_cell
    from kernelmgr.checkpoint.format import restore_checkpoint, write_checkpoint
    from kernelmgr.checkpoint.recompute import replay

    source = _SOURCES.get(id(ns))
    if source is None:
        return None
    key = b"b" * 32
    write_checkpoint(directory, ns, key=key, owner="bench", kernel_id="bench")
    restored: Namespace = {"__name__": "__main__"}
    report = restore_checkpoint(directory, restored, key=key, owner="bench", kernel_id="bench")
    if report is None:
        return None
    after = {name: id(value) for name, value in _variables(ns).items()}
    cells = [record_cell(1, source, source, {}, after, ok=True, seconds=0.0)]
    missing = [item["name"] for item in report["not_restored"]]
    outcome = replay(plan_recompute(cells, missing, report["restored"]), restored)
    return None if outcome.not_recomputed else restored


def restore_per_variable(ns: Namespace, dumps: Callable[[Any], bytes]) -> Namespace | None:
    restored: Namespace = {"__name__": "__main__"}
    for name, value in _variables(ns).items():
        try:
            restored[name] = pickle.loads(dumps(value))
        except Exception:
            return None
    return restored


def judge(case: Case, original: Namespace, restored: Namespace | None) -> str:
    """The check runs on the very namespace that was saved (it may go on using it: the
    original optimizer's next step is what the restored one must reproduce)."""
    if restored is None:
        return "lost"
    try:
        return "equal" if case.check(original, restored) else "differs"
    except Exception:
        return "differs"


@contextlib.contextmanager
def _without_reducers() -> Iterator[None]:
    """The writer with plain cloudpickle pickling (fingerprints still recorded)."""
    from kernelmgr.checkpoint import serialize, writer

    def plain_pickler(*args: Any, **kwargs: Any) -> Any:
        return serialize.GroupPickler(*args, **{**kwargs, "carry_dropped": False})

    saved = writer.GroupPickler
    writer.GroupPickler = plain_pickler  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        writer.GroupPickler = saved  # type: ignore[misc]


def run_cases() -> list[dict[str, Any]]:
    import cloudpickle

    try:
        import dill
    except ImportError:
        dill = None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, case in enumerate(all_cases()):
            row: dict[str, Any] = {"library": case.library, "case": case.name}
            original = case.build()
            try:
                restored, flagged = restore_checkpoint_way(original, Path(tmp) / str(index))
            except Exception:
                restored, flagged = None, False
            row["checkpoint"] = judge(case, original, restored)
            row["flagged"] = flagged
            if row["checkpoint"] == "lost":
                original = case.build()
                try:
                    rebuilt = recompute_way(original, Path(tmp) / f"{index}-recompute")
                except Exception:
                    rebuilt = None
                row["recomputed"] = judge(case, original, rebuilt) == "equal"
            # The same checkpoint with the reducers and the generic rule off: what the
            # difference check alone catches of what plain pickling gets wrong.
            original = case.build()
            with _without_reducers():
                try:
                    restored, flagged = restore_checkpoint_way(original, Path(tmp) / f"{index}-plain")
                except Exception:
                    restored, flagged = None, False
            row["unreduced"] = judge(case, original, restored)
            row["unreduced_flagged"] = flagged
            original = case.build()
            row["cloudpickle"] = judge(case, original, restore_per_variable(original, cloudpickle.dumps))
            if dill is not None:
                original = case.build()
                row["dill"] = judge(case, original, restore_per_variable(original, dill.dumps))
            rows.append(row)
    return rows


# --- output ---------------------------------------------------------------------------------


def _counts(rows: list[dict[str, Any]], way: str) -> str:
    results = [row.get(way) for row in rows]
    if None in results:
        return "—"
    return " / ".join(str(results.count(kind)) for kind in ("equal", "differs", "lost"))


def _flagged(rows: list[dict[str, Any]], way: str, key: str) -> str:
    """``flagged of differing`` for one way of checkpointing."""
    differing = [row for row in rows if row[way] == "differs"]
    return f"{sum(row[key] for row in differing)} of {len(differing)}" if differing else "—"


def _recomputed(rows: list[dict[str, Any]]) -> str:
    """``recomputed of lost`` by the checkpoint."""
    lost = [row for row in rows if row["checkpoint"] == "lost"]
    return f"{sum(bool(row.get('recomputed')) for row in lost)} of {len(lost)}" if lost else "—"


def print_tables(rows: list[dict[str, Any]]) -> None:
    print("Per library, cases equal / differ / lost:\n")
    print_header(
        ["library", "cases", "checkpoint", "flagged", "without reducers", "flagged", "cloudpickle", "dill",
         "recomputed"]
    )  # fmt: skip
    libraries = list(dict.fromkeys(row["library"] for row in rows))
    for library in [*libraries, "all"]:
        subset = [row for row in rows if library in ("all", row["library"])]
        name = f"**{library}**" if library == "all" else library
        print_row(
            [name, str(len(subset)), _counts(subset, "checkpoint"), _flagged(subset, "checkpoint", "flagged"),
             _counts(subset, "unreduced"), _flagged(subset, "unreduced", "unreduced_flagged"),
             _counts(subset, "cloudpickle"), _counts(subset, "dill"), _recomputed(subset)]
        )  # fmt: skip
    print("\nPer case:\n")
    print_header(["library", "case", "checkpoint", "without reducers", "cloudpickle", "dill"])
    for row in rows:
        mark = " (flagged)" if row["flagged"] else ""
        if row["checkpoint"] == "lost":
            mark += ", recomputed" if row.get("recomputed") else ", not recomputed"
        plain_mark = " (flagged)" if row["unreduced_flagged"] else ""
        print_row(
            [row["library"], row["case"], row["checkpoint"] + mark, row["unreduced"] + plain_mark,
             row["cloudpickle"], row.get("dill", "—")]
        )  # fmt: skip


def run_in_kernel() -> list[dict[str, Any]]:
    """Run the cases in a fresh ipykernel (real comms for widgets, a real ``__main__``)."""
    import os

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"})
    out: list[str] = []
    try:
        code = "from benchmarks.bench_fidelity import run_cases\nimport json\nprint(json.dumps(run_cases()))"
        reply = kc.execute_interactive(
            code,
            timeout=600,
            output_hook=lambda m: (
                out.append(m["content"].get("text", "")) if m["msg_type"] == "stream" else None
            ),
        )
        if reply["content"]["status"] != "ok":
            raise SystemExit(f"the benchmark failed in the kernel: {reply['content'].get('evalue')}")
    finally:
        km.shutdown_kernel(now=True)
    lines = [line for line in "".join(out).splitlines() if line.startswith("[")]
    return list(json.loads(lines[-1]))


# --- what fidelity costs a checkpoint -------------------------------------------------------


def _overhead_states() -> dict[str, Namespace]:
    import numpy as np

    states = {
        "20,000 instances whose __getstate__ drops a dict": notebook(
            """
            class Item:
                def __init__(self, i):
                    self.i, self._meta = i, {"k": i}
                def __getstate__(self):
                    return {"i": self.i}
            items = [Item(i) for i in range(20000)]
            """
        ),
        "20,000 plain instances": notebook(
            """
            class Plain:
                def __init__(self, i):
                    self.i, self.meta = i, {"k": i}
            plains = [Plain(i) for i in range(20000)]
            """
        ),
        "1,000 variables (small dicts)": {f"v{i}": {"a": i, "b": [i, i]} for i in range(1000)},
        "128 MiB float64 array": {"x": np.random.default_rng(0).random(1 << 24)},
    }
    if importlib.util.find_spec("torch") is not None:
        import torch

        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        model(torch.randn(4, 512)).sum().backward()
        optimizer = torch.optim.Adam(model.parameters())
        optimizer.step()
        states["model + Adam, 2.1 M parameters with grads"] = {"model": model, "opt": optimizer}
    return states


def _write_once(ns: Namespace, directory: Path) -> float:
    from kernelmgr.checkpoint.format import write_checkpoint

    names = [k for k in ns if not k.startswith("__")]
    started = time.perf_counter()
    write_checkpoint(directory, ns, key=b"b" * 32, owner="b", kernel_id="b", names=names)
    return time.perf_counter() - started


def run_overhead(repeat: int) -> None:
    """Checkpoint write time with the reducers, generic rule and fingerprints on, beside with
    them off (the writer's plain cloudpickle path: GroupPickler(carry_dropped=False), no
    fingerprint). The three modes take turns within each round (medians of ``repeat``)."""
    from kernelmgr.checkpoint import serialize, writer

    def plain_pickler(*args: Any, **kwargs: Any) -> Any:
        return serialize.GroupPickler(*args, **{**kwargs, "carry_dropped": False})

    def no_fingerprint(value: Any) -> None:
        return None

    modes = ("plain", "fingerprints", "all")
    print_header(["state", "plain (s)", "+ fingerprints (s)", "+ reducers, generic rule (s)", "ratio"])
    with tempfile.TemporaryDirectory() as tmp:
        for label, ns in _overhead_states().items():
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for round_ in range(repeat):
                for mode in modes[round_ % 3 :] + modes[: round_ % 3]:
                    pickler, fingerprint = writer.GroupPickler, writer.fingerprint_unless_plain
                    if mode != "all":
                        writer.GroupPickler = plain_pickler  # type: ignore[assignment,misc]
                    if mode == "plain":
                        writer.fingerprint_unless_plain = no_fingerprint  # type: ignore[assignment]
                    try:
                        times[mode].append(_write_once(ns, Path(tmp) / f"{len(times[mode])}-{mode}"))
                    finally:
                        writer.GroupPickler, writer.fingerprint_unless_plain = pickler, fingerprint  # type: ignore[misc]
            medians = [statistics.median(times[mode]) for mode in modes]
            print_row([label, *(f"{t:.3f}" for t in medians), f"{medians[2] / medians[0]:.2f}×"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-process", action="store_true", help="run here, not in a fresh ipykernel")
    parser.add_argument("--overhead", action="store_true", help="time what fidelity costs a checkpoint")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per overhead measurement (median)")
    args = parser.parse_args()
    if args.overhead:
        run_overhead(args.repeat)
        return
    rows = run_cases() if args.in_process else run_in_kernel()
    print_tables(rows)


if __name__ == "__main__":
    main()
