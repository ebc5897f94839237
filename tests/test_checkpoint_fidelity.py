"""Fidelity: what comes back is what was saved, or the restore report says how it differs.

Every round trip goes through the real checkpoint writer and reader (``data.bin`` +
``manifest.json`` on disk, HMAC and digest checked). Notebook code is simulated as in
``test_checkpoint_format``: source exec'd in a dict named ``__main__``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel

from kernelmgr.checkpoint import fidelity
from kernelmgr.checkpoint.agent import CHECKPOINT_CODE, format_report
from kernelmgr.checkpoint.format import restore_checkpoint, write_checkpoint
from kernelmgr.checkpoint.integrity import owner_key
from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.core.manifest import Manifest, VariableRecord
from tests import test_checkpoint_agent as agent_tests
from tests.support.libraries import require

pytestmark = pytest.mark.pure

OWNER = "alice"
KERNEL = "3f2a9c1e-0000-4000-8000-00000000f1d0"
KEY = owner_key(b"f" * 32, OWNER)
ROOT = Path(__file__).resolve().parent.parent


def save(kernel_dir: Path, ns: dict[str, Any], **kwargs: Any) -> Manifest:
    return write_checkpoint(kernel_dir, ns, key=KEY, owner=OWNER, kernel_id=KERNEL, **kwargs)


def load(kernel_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    report = restore_checkpoint(kernel_dir, ns, key=KEY, owner=OWNER, kernel_id=KERNEL)
    assert report is not None
    return ns, report


def round_trip(kernel_dir: Path, ns: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    manifest = save(kernel_dir, ns)
    assert manifest.skipped() == [], [(v.name, v.reason) for v in manifest.skipped()]
    restored, report = load(kernel_dir)
    assert report["not_restored"] == []
    return restored, report


def notebook(source: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(source), ns)
    return ns


@pytest.fixture
def kdir(tmp_path: Path) -> Path:
    return tmp_path / "alice" / KERNEL


@pytest.fixture(autouse=True)
def finalize_widgets() -> Iterator[None]:
    """Finalize this test's widgets now, at a safe point.

    Outside a kernel, an original widget and its restored copy share a comm id in one comm
    registry, so whichever closes second raises ``KeyError`` in ``Widget.__del__``. Left to
    the garbage collector, that can happen inside any later ``ast.parse`` (pytest rewriting
    a module it imports), where Python 3.11 formats the ignored exception's traceback with
    another ``ast.parse`` and aborts the outer one ("AST constructor recursion depth
    mismatch"). Closing them all here, duplicates included, leaves ``__del__`` nothing to do.
    """
    yield
    widgets = sys.modules.get("ipywidgets")
    if widgets is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on some library objects warns (torch's reduce_op)
        found = [obj for obj in gc.get_objects() if isinstance(obj, widgets.Widget)]
    for widget in found:
        if widget.comm is not None:
            with contextlib.suppress(KeyError):  # its id was taken over by its restored copy
                widget.close()
            widget.comm = None  # closed either way: nothing left for __del__ to do
    gc.collect()


def test_a_missing_library_skips_here_and_fails_where_ci_requires_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support import libraries

    monkeypatch.delenv(libraries.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        require("no_such_library_for_elastic_tests")
    monkeypatch.setenv(libraries.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="ELASTIC_REQUIRE_LIBRARIES is set"):
        require("no_such_library_for_elastic_tests")


# --- the generic rule --------------------------------------------------------------------

LIBRARY_CLASSES = """
import threading

def redraw(artist):
    artist.redraws += 1

class Artist:
    # Like matplotlib: pickling blanks the callback, and drops a private attribute.
    def __init__(self):
        self.redraws = 0
        self.callback = redraw
        self._trend = {"slope": 2.0, "points": [1, 2, 3]}
        self.label = "line"

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k != "_trend"}
        state["callback"] = None
        return state

    def changed(self):
        if self.callback is not None:
            self.callback(self)

class Rebuilt:
    # Like a library that recomputes derived state in __setstate__: its value must win.
    def __init__(self, n):
        self.n = n
        self.derived = "computed at save time"
        self.handle = threading.Lock()  # cannot be pickled: not carried, reported

    def __getstate__(self):
        return {"n": self.n}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.derived = "recomputed"

class Summary:
    # A reduce that rebuilds from a summary: the list comes back shorter.
    def __init__(self, items):
        self.items = list(items)

    def __reduce__(self):
        return (Summary, (self.items[:1],))

artist = Artist()
rebuilt = Rebuilt(3)
summary = Summary([1, 2, 3])
"""


def test_attributes_a_class_drops_or_blanks_are_carried_back(kdir: Path) -> None:
    ns = notebook(LIBRARY_CLASSES)
    r, report = round_trip(kdir, ns)
    artist = r["artist"]
    assert artist._trend == {"slope": 2.0, "points": [1, 2, 3]}
    assert artist.callback is r["redraw"], "the blanked callback is the restored notebook function"
    artist.changed()
    artist.changed()
    assert artist.redraws == 2, "the restored object behaves: its callback runs"
    assert "artist" not in report["differs"]


def test_the_librarys_own_reconstruction_wins_and_what_cannot_be_carried_is_reported(kdir: Path) -> None:
    ns = notebook(LIBRARY_CLASSES)
    r, report = round_trip(kdir, ns)
    assert r["rebuilt"].derived == "recomputed" and r["rebuilt"].n == 3
    assert not hasattr(r["rebuilt"], "handle")
    # Both are true differences: the library recomputed one value, and the lock is gone.
    assert report["differs"]["rebuilt"] == (
        ".derived: str 'computed at save time' -> str 'recomputed'; .handle missing"
    )
    assert report["differs"]["summary"] == ".items: list len=3 -> list len=1"
    assert set(report["differs"]) == {"rebuilt", "summary"}


def test_a_carried_value_that_fails_in_the_stream_does_not_lose_the_variable(kdir: Path) -> None:
    # The probe pickles the attribute alone (fine); in the stream it fails: the writer's last
    # try saves the variable without carried attributes, and the report says what is missing.
    ns = notebook(
        """
        class Flaky:
            calls = 0
            def __reduce__(self):
                Flaky.calls += 1
                if Flaky.calls > 1:
                    raise TypeError("cannot pickle Flaky twice")
                return (Flaky, ())

        class Holder:
            def __init__(self):
                self.value = 41
                self.extra = Flaky()
            def __getstate__(self):
                return {"value": self.value}

        holder = Holder()
        """
    )
    r, report = round_trip(kdir, ns)
    assert r["holder"].value == 41 and not hasattr(r["holder"], "extra")
    assert report["differs"] == {"holder": ".extra missing"}


def test_a_failing_library_reducer_loses_nothing(kdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelmgr.checkpoint import reducers
    from tests.support.broken_reducer import Gauge

    monkeypatch.setitem(reducers.LIBRARIES, "tests", "tests.support.broken_reducer")
    r, report = round_trip(kdir, {"gauge": Gauge(2.5), "other": [1, 2]})
    assert r["gauge"].reading == 2.5 and r["other"] == [1, 2]
    assert report["differs"] == {}


def test_identical_values_report_no_differences(kdir: Path) -> None:
    np = require("numpy")
    pd = require("pandas")
    ns = notebook(
        """
        class Point:
            def __init__(self, x, y):
                self.x, self.y = x, y
        p = Point(1, [2, 3])
        nested = {"a": [1, 2, {"b": (3, 4)}], "s": "text", "f": 1.5, "n": None}
        """
    )
    frame = pd.DataFrame({"a": [1, 2, 3], "b": list("xyz")})
    _ = frame["a"]  # fills pandas' item cache, which pickling drops on purpose
    ns.update(arr=np.arange(12).reshape(3, 4), frame=frame, series=frame["b"], index=frame.index)
    r, report = round_trip(kdir, ns)
    assert report["differs"] == {}
    assert r["p"].y == [2, 3] and r["frame"].equals(frame)


def test_fingerprints_are_in_the_signed_manifest_and_older_manifests_still_load(kdir: Path) -> None:
    ns = notebook(LIBRARY_CLASSES)
    manifest = save(kdir, ns)
    record = next(v for v in manifest.variables if v.name == "summary")
    assert record.fingerprint is not None and record.fingerprint[".items"] == "list len=3"
    again = Manifest.from_json(manifest.to_json())
    assert again.to_dict() == manifest.to_dict()
    plain = VariableRecord("x", "int", "saved", "", group=0, bytes=1)
    assert "fingerprint" not in plain.to_dict()
    assert VariableRecord.from_dict(plain.to_dict()).fingerprint is None


def test_fingerprint_describes_structure_not_contents() -> None:
    np = require("numpy")
    big, other = np.zeros((1000, 3)), np.ones((1000, 3))
    assert (
        fidelity.fingerprint(big)
        == fidelity.fingerprint(other)
        == {"": "numpy.ndarray shape=(1000, 3) dtype=float64"}
    )
    assert fidelity.compare({"": "list len=3"}, {"": "list len=3", "[0]": "int 1"}) is None
    many = {f".a{i}": "int 1" for i in range(5)}
    assert fidelity.compare(many, {}) == ".a0 missing; .a1 missing; .a2 missing (+2 more)"
    # A full fingerprint (MAX_ENTRIES) reached depth 2: a missing attribute (depth 1) is gone,
    # a missing depth-2 entry may just not have been reached.
    full = {"": "T", **{f".x[k{i}]": "int 1" for i in range(fidelity.MAX_ENTRIES - 1)}}
    assert fidelity.compare({".gone": "list len=0"}, full) == ".gone missing"
    assert fidelity.compare({".x[unreached]": "int 1"}, full) is None
    # Huge containers are described by their length, never walked or sorted.
    assert fidelity.fingerprint({f"k{i}": i for i in range(5000)}) == {"": "dict len=5000"}
    assert fidelity.fingerprint(list(range(10**6))) == {
        "": "list len=1000000",
        **{f"[{i}]": f"int {i}" for i in range(4)},
    }


def test_small_arrays_are_compared_by_value(kdir: Path) -> None:
    np = require("numpy")
    ns = notebook(
        """
        import numpy as np

        class Transform:
            # Like astropy's WCS: rebuilt from a rewritten matrix, same shape and dtype.
            def __init__(self, matrix):
                self.matrix = np.asarray(matrix, dtype=float)

            def __reduce__(self):
                return (Transform, (np.round(self.matrix, 1),))

        class Kept:
            def __init__(self, matrix):
                self.matrix = np.asarray(matrix, dtype=float)

        rewritten = Transform([[0.123, 0.0], [0.0, 1.0]])
        kept = Kept([[0.123, 0.0], [0.0, 1.0]])
        table = np.linspace(0, 1, 256)
        """
    )
    restored, report = round_trip(kdir, ns)
    assert report["differs"] == {"rewritten": ".matrix: values differ"}
    assert np.array_equal(restored["kept"].matrix, ns["kept"].matrix)
    saved = fidelity.fingerprint(ns["rewritten"])
    assert saved[".matrix#values"].startswith("values ")
    # A checkpoint written before values were digested compares as before.
    older = {path: text for path, text in saved.items() if not path.endswith(fidelity.VALUES_SUFFIX)}
    assert fidelity.compare(older, fidelity.fingerprint(restored["rewritten"])) is None
    # Only small arrays of plain values: bigger ones and object arrays are never read.
    limit = fidelity.SMALL_ARRAY_BYTES
    assert "#values" in fidelity.fingerprint(np.zeros(limit, dtype=np.uint8))
    assert "#values" not in fidelity.fingerprint(np.zeros(limit + 1, dtype=np.uint8))
    assert "#values" not in fidelity.fingerprint(np.array([object(), object()]))
    # A changed shape is named once, not again as changed values.
    before = {"": "T", ".m": "numpy.ndarray shape=(2,) dtype=int64", ".m#values": "values 1"}
    after = {"": "T", ".m": "numpy.ndarray shape=(3,) dtype=int64", ".m#values": "values 2"}
    assert fidelity.compare(before, after) == (
        ".m: numpy.ndarray shape=(2,) dtype=int64 -> numpy.ndarray shape=(3,) dtype=int64"
    )


def test_the_report_text_names_what_differs() -> None:
    report = {
        "restored": ["a", "b"],
        "bytes": 10,
        "seconds": 0.1,
        "not_restored": [],
        "differs": {"b": ".handle missing"},
    }
    plain, markdown = format_report(report)
    assert plain.endswith("Restored with known differences: b (.handle missing).")
    assert "Restored with known differences:\n- `b` (.handle missing)" in markdown


def test_numpy_views_share_memory_with_their_base_again(kdir: Path) -> None:
    np = require("numpy")
    base = np.arange(12.0).reshape(3, 4)  # itself a view of the 1-D arange
    big = np.arange(1000.0)
    ns = {"base": base, "rows": base[1:], "t": base.T, "col": base[:, 1], "head": big[:10]}
    ns["frozen"] = base[2]
    ns["frozen"].flags.writeable = False
    expected = {name: array.copy() for name, array in ns.items()}
    manifest = save(kdir, ns)
    # The views are saved as windows of the one array that owns the memory: its 96 bytes once.
    # `head` spans 80 of big's 8000 bytes and no variable holds `big`: a copy, as numpy does.
    assert [g.names for g in manifest.groups] == [["base", "rows", "t", "col", "frozen"], ["head"]]
    assert [sum(length for _, length in g.buffers) for g in manifest.groups] == [base.nbytes, 80]
    r, report = load(kdir)
    assert report["differs"] == {}
    for name, array in ns.items():
        assert np.array_equal(r[name], expected[name]) and r[name].strides == array.strides, name
        assert r[name].flags.writeable == array.flags.writeable, name
    r["base"][1, 1] = -1.0
    assert r["rows"][0, 1] == r["t"][1, 1] == r["col"][1] == -1.0


# --- PyTorch -------------------------------------------------------------------------------


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def test_torch_gradient_accumulation_survives(kdir: Path) -> None:
    torch = require("torch")
    model = _model(torch)
    x = torch.randn(16, 4)
    model(x[:8]).sum().backward()  # first micro-batch accumulated, not stepped
    model.eval()
    r, report = round_trip(kdir, {"model": model})
    restored = r["model"]
    assert report["differs"] == {}
    assert restored.training is False
    for (name, before), after in zip(model.named_parameters(), restored.parameters(), strict=True):
        assert after.grad is not None, name
        assert torch.equal(after.grad, before.grad), name
    assert torch.equal(restored[1].running_mean, model[1].running_mean)
    assert int(restored[1].num_batches_tracked) == int(model[1].num_batches_tracked) == 1
    # The second micro-batch adds to what was accumulated, as it would have without a restore.
    model.train()
    restored.train()
    model(x[8:]).sum().backward()
    restored(x[8:]).sum().backward()
    for before, after in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.allclose(after.grad, before.grad)


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_torch_optimizer_and_scheduler_continue_exactly(kdir: Path, kind: str) -> None:
    torch = require("torch")
    model = _model(torch)
    options = {"lr": 0.1, "momentum": 0.9} if kind == "SGD" else {"lr": 0.01}
    optimizer = getattr(torch.optim, kind)(model.parameters(), **options)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def train_step(m: Any, opt: Any, sched: Any) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        sched.step()

    for _ in range(3):
        train_step(model, optimizer, scheduler)
    ns = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    r, report = round_trip(kdir, ns)
    assert report["differs"] == {}
    model2, optimizer2, scheduler2 = r["model"], r["optimizer"], r["scheduler"]
    # Bound to the restored parameters, with the same private state.
    assert optimizer2.param_groups[0]["params"][0] is model2[0].weight
    assert scheduler2.optimizer is optimizer2
    assert optimizer2.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    restored_state = optimizer2.state_dict()["state"]
    assert restored_state.keys() == optimizer.state_dict()["state"].keys()
    for key, state in optimizer.state_dict()["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(restored_state[key][field]), torch.as_tensor(value)), field
    assert scheduler2.state_dict() == scheduler.state_dict()
    # The next steps are the same steps, and torch does not warn that the optimizer's step
    # was overridden after the scheduler wrapped it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            train_step(model, optimizer, scheduler)
            train_step(model2, optimizer2, scheduler2)
    for before, after in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(before, after)
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_torch_hooks_survive(kdir: Path) -> None:
    torch = require("torch")
    ns = notebook(
        """
        import torch
        seen = []
        def record(module, inputs, output):
            seen.append(tuple(output.shape))
        model = torch.nn.Linear(3, 2)
        handle = model.register_forward_hook(record)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
        """
    )
    r, _ = round_trip(kdir, ns)
    r["model"](torch.ones(1, 3))
    assert r["seen"] == [(1, 2)]
    r["optimizer"].step()
    assert r["steps"] == [1]
    r["handle"].remove()
    r["model"](torch.ones(1, 3))
    assert r["seen"] == [(1, 2)]


# --- matplotlib ----------------------------------------------------------------------------


def test_matplotlib_artists_stay_linked_and_redraw(kdir: Path) -> None:
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    (line,) = ax.plot([1, 2, 3])
    image = ax.imshow([[0, 1], [1, 0]])
    fig.canvas.draw()
    r, report = round_trip(kdir, {"fig": fig, "ax": ax, "line": line, "image": image})
    assert report["differs"] == {}
    line2, fig2 = r["line"], r["fig"]
    assert line2.axes is r["ax"] and line2.figure is fig2 and r["ax"].figure is fig2
    fig2.canvas.draw()
    assert not fig2.stale
    line2.set_ydata([3, 2, 1])  # a change must mark the figure for redrawing, as before
    assert fig2.stale and r["ax"].stale
    fig2.canvas.draw()
    r["image"].set_clim(0, 2)
    assert fig2.stale
    plt.close("all")


def test_matplotlib_3d_collections_redraw_their_figure(kdir: Path) -> None:
    matplotlib = require("matplotlib")
    np = require("numpy")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    ax = fig.add_subplot(projection="3d")
    x, y = np.meshgrid(np.arange(4.0), np.arange(4.0))
    surface = ax.plot_surface(x, y, x * y)
    points = ax.scatter([0, 1], [1, 0], [0.5, 0.5])
    fig.canvas.draw()
    r, report = round_trip(kdir, {"fig": fig, "surface": surface, "points": points})
    assert report["differs"] == {}
    assert r["surface"].axes is r["fig"].axes[0] and r["points"].figure is r["fig"]
    for artist in (r["surface"], r["points"]):
        r["fig"].canvas.draw()
        artist.set_alpha(0.3)
        assert r["fig"].stale, type(artist).__name__
    plt.close("all")


# --- plotly --------------------------------------------------------------------------------


def test_plotly_express_figures_keep_their_private_attributes(kdir: Path) -> None:
    px = require("plotly.express")
    pd = require("pandas")
    frame = pd.DataFrame({"x": [1, 2, 3, 4], "y": [2, 1, 4, 3], "g": list("abab")})
    fig = px.scatter(frame, x="x", y="y", color="g")
    fig.update_layout(title="t")
    r, report = round_trip(kdir, {"fig": fig})
    assert report["differs"] == {}
    restored = r["fig"]
    assert restored.to_plotly_json() == fig.to_plotly_json()
    # px's own API reads the private attribute plain pickling drops (AttributeError then).
    assert px.get_trendline_results(restored) == px.get_trendline_results(fig) == []


def test_plotly_figure_widgets_keep_their_figure(kdir: Path) -> None:
    go = require("plotly.graph_objects")
    require("anywidget")
    widget = go.FigureWidget(go.Bar(y=[1, 3, 2]))
    widget.update_layout(title="live")
    r, report = round_trip(kdir, {"widget": widget})
    assert report["differs"] == {}
    # anywidget gives each instance a class of its own, under the module's FigureWidget.
    assert isinstance(r["widget"], sys.modules["plotly.graph_objs._figurewidget"].FigureWidget)

    def figure(fig: Any) -> dict[str, Any]:
        # A FigureWidget numbers its traces for the frontend anew (``uid``) when it is built.
        out = fig.to_plotly_json()
        return {**out, "data": [{k: v for k, v in t.items() if k != "uid"} for t in out["data"]]}

    assert figure(r["widget"]) == figure(widget)
    r["widget"].data[0].y = [0, 0, 1]  # still a working figure
    assert list(r["widget"].data[0].y) == [0, 0, 1]


# --- bokeh ---------------------------------------------------------------------------------


def _bokeh_properties(model: Any) -> str:
    """Every property value of ``model``, models named by id (they are compared one by one)."""
    values = model.properties_with_values(include_defaults=True)
    return repr(
        {k: getattr(v, "id", v) if hasattr(v, "references") else v for k, v in sorted(values.items())}
    )


def test_bokeh_figures_and_renderers_restore_through_bokehs_serialisation(kdir: Path) -> None:
    require("bokeh")
    np = require("numpy")
    from bokeh.models import ColumnDataSource
    from bokeh.plotting import figure

    source = ColumnDataSource({"x": np.arange(5.0), "y": np.arange(5.0) ** 2})
    fig = figure(title="loss", width=300)
    line = fig.line("x", "y", source=source, line_width=3)
    other = figure(title="other")
    other.scatter([1, 2], [3, 4])
    r, report = round_trip(kdir, {"fig": fig, "line": line, "source": source, "other": other})
    assert report["differs"] == {}
    assert r["fig"].renderers[0] is r["line"] and r["line"].data_source is r["source"]
    assert r["fig"].title.text == "loss" and r["line"].glyph.line_width == 3
    assert np.array_equal(r["source"].data["y"], source.data["y"])
    originals = {m.id: m for m in (*fig.references(), *other.references())}
    restored = {m.id: m for m in (*r["fig"].references(), *r["other"].references())}
    assert originals.keys() == restored.keys()
    for model_id, model in originals.items():
        assert _bokeh_properties(restored[model_id]) == _bokeh_properties(model), model_id
    # Still a working model: a change goes through bokeh's property system.
    r["source"].data = {"x": [0.0], "y": [1.0]}
    assert r["line"].data_source.data["y"] == [1.0]


# --- ipywidgets ----------------------------------------------------------------------------


def test_widgets_come_back_with_their_state_and_model_id(kdir: Path) -> None:
    widgets = require("ipywidgets")
    slider = widgets.IntSlider(value=7, min=0, max=10, description="epochs")
    dropdown = widgets.Dropdown(options=["sgd", "adam"], value="adam")
    chosen = widgets.SelectMultiple(options=[1, 2, 3], value=[1, 3])
    box = widgets.VBox([slider, dropdown], layout=widgets.Layout(width="50%"))
    box.add_class("panel")
    ns = {"slider": slider, "dropdown": dropdown, "chosen": chosen, "box": box}
    r, report = round_trip(kdir, ns)
    assert report["differs"] == {}
    for name, widget in ns.items():
        restored = r[name]
        assert type(restored) is type(widget)
        assert restored.get_state() == widget.get_state(), name  # every synced trait, as JSON
        assert restored.model_id == widget.model_id, name  # a frontend's view finds its model again
    assert r["slider"].value == 7 and r["dropdown"].value == "adam" and r["chosen"].value == (1, 3)
    assert r["box"].children[0] is r["slider"] and r["box"].layout.width == "50%"
    r["slider"].value = 9  # a working widget: validation still applies
    assert r["slider"].value == 9
    r["slider"].value = 99
    assert r["slider"].value == 10


# --- a real kernel: hibernate (checkpoint) and resume in a new process ------------------------

KERNEL_SESSION = """
import warnings
import torch, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import ipywidgets as widgets

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
x = torch.randn(8, 4)
model(x[:4]).sum().backward()          # half of an accumulated batch
fig, ax = plt.subplots()
(line,) = ax.plot([1, 2, 3])
slider = widgets.IntSlider(value=3, max=5)

class Summary:
    def __init__(self, items):
        self.items = list(items)
    def __reduce__(self):
        return (Summary, (self.items[:1],))

summary = Summary([1, 2, 3])
"""

KERNEL_CHECK = """
model(x[4:]).sum().backward()
grad_after = model.weight.grad.clone()
fig.canvas.draw()
line.set_ydata([3, 2, 1])
print("stale", fig.stale, "slider", slider.value, slider.model_id)
"""


def _output(kc: Any, code: str) -> tuple[list[str], list[str]]:
    texts: list[str] = []
    shown: list[str] = []

    def hook(message: dict[str, Any]) -> None:
        content = message["content"]
        if message["msg_type"] == "stream":
            texts.append(content["text"])
        elif message["msg_type"] in ("display_data", "execute_result"):
            shown.append(content["data"].get("text/plain", ""))
        elif message["msg_type"] == "error":
            texts.append("\n".join(content["traceback"]))

    reply = kc.execute_interactive(code, timeout=120, output_hook=hook)
    assert reply["content"]["status"] == "ok", texts
    return texts, shown


def test_a_real_kernel_resumes_gradients_figures_widgets_and_reports_differences(tmp_path: Path) -> None:
    for name in ("torch", "matplotlib", "ipywidgets"):
        require(name)
    store = CheckpointStore(tmp_path / "checkpoints", agent_tests.SECRET)

    def start(restore: bool) -> Any:
        env = {**os.environ, **agent_tests.agent_env(store, restore=restore), "PYTHONPATH": str(ROOT)}
        extension = f"--IPKernelApp.extensions=['{agent_tests.EXTENSION}']"
        return start_new_kernel(extra_arguments=[extension], env=env)

    km, kc = start(False)
    try:
        _output(kc, KERNEL_SESSION)
        reply = kc.execute_interactive(CHECKPOINT_CODE, silent=True, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        # What the resumed kernel must compute: the same cell, run here without a restore.
        reference, _ = _output(kc, KERNEL_CHECK)
        _, grad_reference = _output(kc, "grad_after.tolist()")
        _, slider_id = _output(kc, "slider.model_id")
    finally:
        km.shutdown_kernel(now=True)
    summary = store.summary(agent_tests.OWNER, agent_tests.KERNEL)
    assert summary is not None and summary["not_saved"] == [], summary

    km, kc = start(True)
    try:
        texts, shown = _output(kc, KERNEL_CHECK)
        [report] = [text for text in shown if text.startswith("Kernel resumed")]
        assert "Restored with known differences: summary (.items: list len=3 -> list len=1)." in report
        assert "Not restored" not in report
        assert texts == reference == [f"stale True slider 3 {slider_id[0].strip(chr(39))}\n"]
        _, grad = _output(kc, "grad_after.tolist()")
        assert grad == grad_reference  # the accumulation went on from the saved gradient
    finally:
        km.shutdown_kernel(now=True)
    written = store.restore_report(agent_tests.OWNER, agent_tests.KERNEL)
    assert written is not None
    assert written["differs"] == {"summary": ".items: list len=3 -> list len=1"}


# --- astropy -------------------------------------------------------------------------------


def _wcs_text(wcs: Any) -> str:
    """astropy's full description of a WCS's parameters, without memory addresses and the
    capacity allocated for PV/PS cards (``npvmax``/``npsmax``: room, not parameters)."""
    text = re.sub(r"0x[0-9a-f]+", "0x", str(wcs.wcs))
    return "\n".join(line for line in text.splitlines() if not re.match(r"\s*np[vs]max:", line))


def test_astropy_wcs_keeps_its_cd_matrix(kdir: Path) -> None:
    require("astropy")
    np = require("numpy")
    from astropy.wcs import WCS

    cd_wcs = WCS(naxis=2)
    cd_wcs.wcs.cd = [[1e-3, 2e-4], [0.0, 1e-3]]
    cd_wcs.wcs.ctype = ["RA---TAN", "DEC--TAN"]
    cd_wcs.wcs.crval = [10.0, 20.0]
    cd_wcs.wcs.crpix = [5.0, 5.0]
    pc_wcs = WCS(naxis=2)
    pc_wcs.wcs.pc = [[0.5, 0.1], [0.0, 1.0]]
    pc_wcs.wcs.cdelt = [2e-3, 1e-3]
    pc_wcs.wcs.ctype = ["RA---TAN", "DEC--TAN"]
    r, report = round_trip(kdir, {"cd_wcs": cd_wcs, "pc_wcs": pc_wcs})
    assert report["differs"] == {}
    restored = r["cd_wcs"]
    assert restored.wcs.has_cd() and not restored.wcs.has_pc()
    assert np.array_equal(restored.wcs.cd, cd_wcs.wcs.cd)
    assert _wcs_text(restored) == _wcs_text(cd_wcs)
    assert r["pc_wcs"].wcs.has_pc() and np.array_equal(r["pc_wcs"].wcs.pc, pc_wcs.wcs.pc)
    pixels = np.array([[1.0, 2.0], [30.0, 40.0]])
    for name, original in (("cd_wcs", cd_wcs), ("pc_wcs", pc_wcs)):
        assert np.allclose(r[name].all_pix2world(pixels, 0), original.all_pix2world(pixels, 0)), name


# --- cycles ----------------------------------------------------------------------------------


def test_three_hibernate_resume_cycles_keep_everything(tmp_path: Path) -> None:
    """What is restored is checkpointed again: nothing the reducers kept is lost on the next
    cycle (a carried callback, a rebuilt widget, a bokeh graph, a view, a gradient)."""
    torch = require("torch")
    np = require("numpy")
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    widgets = require("ipywidgets")
    require("bokeh")
    require("astropy")
    import matplotlib.pyplot as plt
    from astropy.wcs import WCS
    from bokeh.plotting import figure

    ns = notebook(LIBRARY_CLASSES)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model(torch.ones(2, 3)).sum().backward()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    optimizer.step()
    fig, ax = plt.subplots()
    (line,) = ax.plot([1, 2, 3])
    image = ax.imshow([[0, 1], [1, 0]])
    plot = figure(title="cycles")
    renderer = plot.line([1, 2], [3, 4])
    slider = widgets.IntSlider(value=4, max=9)
    wcs = WCS(naxis=2)
    wcs.wcs.cd = [[1e-3, 0.0], [0.0, 1e-3]]
    data = np.arange(20.0).reshape(5, 4)
    ns.update(model=model, optimizer=optimizer, fig=fig, line=line, image=image, plot=plot)
    ns.update(renderer=renderer, slider=slider, wcs=wcs, data=data, head=data[:2])
    grads = [p.grad.clone() for p in model.parameters()]
    adam = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    slider_state, slider_id = slider.get_state(), slider.model_id

    current = ns
    for cycle in range(3):
        current, report = round_trip(tmp_path / f"cycle-{cycle}", current)
        # The two classes built to differ do so once; after that each checkpoint is compared
        # with what it saved, which comes back the same.
        expected = {"rebuilt", "summary"} if cycle == 0 else set()
        assert set(report["differs"]) == expected, (cycle, report["differs"])

    r = current
    assert r["artist"]._trend == {"slope": 2.0, "points": [1, 2, 3]} and r["artist"].callback is r["redraw"]
    assert all(torch.equal(p.grad, g) for p, g in zip(r["model"].parameters(), grads, strict=True))
    assert r["optimizer"].param_groups[0]["params"][0] is r["model"].weight
    assert all(torch.equal(r["optimizer"].state[r["model"].weight][k], v) for k, v in adam.items())
    r["fig"].canvas.draw()
    r["line"].set_ydata([0, 0, 0])
    assert r["fig"].stale
    r["fig"].canvas.draw()
    r["image"].set_clim(0, 3)
    assert r["fig"].stale
    assert r["plot"].renderers[0] is r["renderer"] and r["plot"].title.text == "cycles"
    assert r["slider"].get_state() == slider_state and r["slider"].model_id == slider_id
    assert r["wcs"].wcs.has_cd()
    r["data"][0, 0] = -1.0
    assert r["head"][0, 0] == -1.0
    plt.close("all")
