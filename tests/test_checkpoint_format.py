"""The checkpoint format, store and integrity, on plain dicts (no kernel, no server).

Notebook code is simulated by exec-ing source in a dict whose ``__name__`` is
``__main__``: functions defined there have that dict as their globals and classes have
``__module__ == "__main__"``, exactly as in a kernel's user namespace.
"""

from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import tracemalloc
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.checkpoint import layout, writer
from kernelmgr.checkpoint.errors import CheckpointFailed, CheckpointRefused
from kernelmgr.checkpoint.format import (
    ALIGN,
    remap_device,
    restore_checkpoint,
    write_checkpoint,
)
from kernelmgr.checkpoint.grouping import group_variables
from kernelmgr.checkpoint.integrity import (
    load_or_create_secret,
    manifest_hmac,
    manifest_is_authentic,
    owner_key,
)
from kernelmgr.checkpoint.serialize import RestoreContext, _rebuild_storage, restoring
from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.core.manifest import FORMAT, GroupRecord, Manifest, ManifestError, VariableRecord

pytestmark = pytest.mark.pure

SECRET = b"s" * 32
OWNER = "alice"
KERNEL = "3f2a9c1e-0000-4000-8000-000000000001"
KEY = owner_key(SECRET, OWNER)
ROOT = Path(__file__).resolve().parent.parent


def save(kernel_dir: Path, ns: dict[str, Any], **kwargs: Any) -> Manifest:
    return write_checkpoint(kernel_dir, ns, key=KEY, owner=OWNER, kernel_id=KERNEL, **kwargs)


def load(kernel_dir: Path, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    options = {"key": KEY, "owner": OWNER, "kernel_id": KERNEL, **kwargs}
    report = restore_checkpoint(kernel_dir, ns, **options)
    assert report is not None
    return ns, report


def notebook(source: str, **preset: Any) -> dict[str, Any]:
    """A namespace as a notebook would leave it after running ``source``."""
    ns: dict[str, Any] = {"__name__": "__main__", **preset}
    exec(textwrap.dedent(source), ns)
    return ns


def entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


@pytest.fixture
def kdir(tmp_path: Path) -> Path:
    return tmp_path / OWNER / KERNEL


# --- objects used to prove "nothing was unpickled" -----------------------------------------


def touch(path: str) -> str:
    """Runs at unpickling time: leaves a file behind as evidence."""
    Path(path).write_text("unpickled")
    return path


class Marker:
    """Unpickling it creates a file, so a test can tell whether unpickling happened."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (touch, (self.path,))


# --- round trips ---------------------------------------------------------------------------


def test_plain_values_round_trip(kdir: Path) -> None:
    ns = notebook(
        """
        n = 42
        big = 2 ** 100
        s = "héllo"
        raw = b"\\x00\\x01"
        nums = [1, 2.5, None, True]
        table = {"a": (1, 2), "b": {3, 4}, 5: frozenset({6})}
        nothing = None
        """
    )
    manifest = save(kdir, ns)
    restored, report = load(kdir)
    for name in ("n", "big", "s", "raw", "nums", "table", "nothing"):
        assert restored[name] == ns[name], name
    assert report["restored"] == ["n", "big", "s", "raw", "nums", "table", "nothing"]
    assert report["not_restored"] == [] and report["refused"] is None
    assert report["checkpoint"] == manifest.checkpoint_id
    assert (kdir / "current").read_text().strip() == manifest.checkpoint_id


def test_manifest_records_types_versions_totals_and_timings(kdir: Path) -> None:
    manifest = save(kdir, notebook("import json\nx = [1, 2]\ngen = (i for i in ())"))
    assert manifest.format == FORMAT and manifest.owner == OWNER and manifest.kernel_id == KERNEL
    assert manifest.python.count(".") == 2
    assert "cloudpickle" in manifest.libraries
    by_name = {v.name: v for v in manifest.variables}
    assert by_name["x"].type == "list" and by_name["x"].status == "saved" and by_name["x"].bytes > 0
    assert by_name["json"].type == "module"
    assert by_name["gen"].status == "skipped" and by_name["gen"].group is None
    assert manifest.totals["saved"] == 2 and manifest.totals["skipped"] == 1
    assert manifest.totals["bytes"] == (kdir / manifest.checkpoint_id / "data.bin").stat().st_size
    assert set(manifest.timings) >= {"serialize", "write", "fsync", "total"}
    on_disk = Manifest.from_json((kdir / manifest.checkpoint_id / "manifest.json").read_text())
    assert on_disk == manifest
    summary = manifest.summary()
    assert summary["id"] == manifest.checkpoint_id and summary["created"].endswith("Z")
    assert summary["saved"] == ["json", "x"]
    assert summary["not_saved"] == [
        {"name": "gen", "type": "generator", "reason": "TypeError: cannot pickle 'generator' object"}
    ]


def test_ipython_machinery_is_not_saved(kdir: Path) -> None:
    ns = notebook("x = 1", In=[""], Out={}, get_ipython=print, exit=None, quit=None, _=5, _i1="x = 1")
    manifest = save(kdir, ns, skip={"hidden_by_shell"})
    ns["hidden_by_shell"] = 3
    assert [v.name for v in manifest.variables] == ["x"]


def test_shared_references_survive_within_and_across_variables(kdir: Path) -> None:
    ns = notebook(
        """
        b = [1]
        c = [b, b]
        d = {"x": b}
        alias = c
        unrelated = [1]
        def f(): return 1
        g = f
        """
    )
    manifest = save(kdir, ns)
    groups = [g.names for g in manifest.groups]
    assert ["b", "c", "d", "alias"] in groups and ["unrelated"] in groups and ["f", "g"] in groups
    r, _ = load(kdir)
    assert r["c"][0] is r["c"][1] is r["d"]["x"] is r["b"]
    assert r["alias"] is r["c"] and r["g"] is r["f"]
    r["b"].append(2)
    assert r["d"]["x"] == [1, 2]


def test_grouping_cap_loses_only_identity() -> None:
    shared = [0]
    ns = {"a": [list(range(50)), shared], "b": [shared]}
    assert [g.names for g in group_variables(ns, ["a", "b"])] == [["a", "b"]]
    capped = group_variables(ns, ["a", "b"], max_objects=1)
    assert [g.names for g in capped] == [["a"], ["b"]] and capped[0].truncated


def test_generator_is_skipped_with_its_reason(kdir: Path) -> None:
    ns = notebook("gen = (i for i in range(3))\nok = 1")
    manifest = save(kdir, ns)
    skipped = manifest.skipped()
    assert [v.name for v in skipped] == ["gen"]
    assert skipped[0].reason == "TypeError: cannot pickle 'generator' object"
    r, report = load(kdir)
    assert "gen" not in r and r["ok"] == 1
    assert report["not_restored"] == [
        {
            "name": "gen",
            "type": "generator",
            "reason": "generator: TypeError: cannot pickle 'generator' object",
            "stage": "save",
        }
    ]


def test_a_bad_member_does_not_lose_its_group(kdir: Path) -> None:
    ns = notebook(
        """
        shared = [1, 2]
        good = {"k": shared}
        bad = (shared, (i for i in range(3)))
        """
    )
    manifest = save(kdir, ns)
    by_name = {v.name: v for v in manifest.variables}
    assert by_name["shared"].status == by_name["good"].status == "saved"
    assert by_name["bad"].status == "skipped" and "generator" in by_name["bad"].reason
    r, _ = load(kdir)
    assert r["good"] == {"k": [1, 2]} and r["shared"] == [1, 2]
    # Saved one by one: the values survive, the identity between them does not.
    assert r["good"]["k"] is not r["shared"]
    # The failed attempt left nothing behind in data.bin: every byte is accounted for.
    data_size = manifest.data_bytes
    used = sum(g.nbytes for g in manifest.groups)
    assert used <= data_size < used + ALIGN * (1 + sum(len(g.buffers) for g in manifest.groups))


# --- notebook code ------------------------------------------------------------------------

NOTEBOOK_CODE = """
import functools
scale = 2

def double(x):
    return x * scale

class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm1(self):
        return abs(self.x) + abs(self.y) + offset()

def offset():
    return 0

def make_adder(n):
    def add(x):
        return x + n
    return add

def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)

@functools.lru_cache
def cached(x):
    return x + 1

def make_dangling():
    def inner():
        return never
    return inner
    never = 1

p = Point(1, -2)
points = [p, Point(3, 4)]
dangling = make_dangling()
add3 = make_adder(3)
square = lambda v: v * v
"""


def test_notebook_functions_and_classes_restore(kdir: Path) -> None:
    ns = notebook(NOTEBOOK_CODE)
    save(kdir, ns)
    r, report = load(kdir)
    assert report["not_restored"] == []
    assert isinstance(r["p"], r["Point"]) and all(isinstance(q, r["Point"]) for q in r["points"])
    assert r["double"](5) == 10 and r["add3"](1) == 4 and r["square"](3) == 9 and r["fact"](5) == 120
    assert r["cached"](1) == 2
    with pytest.raises(NameError):  # its closure cell was empty when saved, and still is
        r["dangling"]()
    # Notebook functions see the restored namespace, including names defined later.
    assert r["double"].__globals__ is r
    r["scale"] = 10
    assert r["double"](5) == 50
    r["offset"] = lambda: 100
    assert r["p"].norm1() == 103
    assert r["functools"] is sys.modules["functools"]


def test_modules_are_saved_by_name(kdir: Path) -> None:
    import collections.abc as cabc

    manifest = save(kdir, notebook("import json\nimport os.path as osp", cabc=cabc))
    assert manifest.data_bytes < 1000
    r, _ = load(kdir)
    assert r["json"] is sys.modules["json"] and r["osp"] is sys.modules["os.path"] and r["cabc"] is cabc


def test_a_group_that_fails_to_load_does_not_stop_the_others(kdir: Path) -> None:
    gone = types.ModuleType("elastic_test_vanishing")
    exec("class Thing:\n    pass\n", gone.__dict__)
    gone.Thing.__module__ = "elastic_test_vanishing"
    sys.modules["elastic_test_vanishing"] = gone
    try:
        save(kdir, {"mod": gone, "thing": gone.Thing(), "kept": [1]})
    finally:
        del sys.modules["elastic_test_vanishing"]
    r, report = load(kdir)
    assert r["kept"] == [1] and "mod" not in r and "thing" not in r
    reasons = {item["name"]: item["reason"] for item in report["not_restored"]}
    assert set(reasons) == {"mod", "thing"}
    assert "ModuleNotFoundError" in reasons["mod"] and "elastic_test_vanishing" in reasons["mod"]


# --- numpy, pandas, torch -----------------------------------------------------------------


def test_numpy_arrays_come_back_writable_and_without_a_copy(kdir: Path) -> None:
    np = pytest.importorskip("numpy")
    ns = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "f": np.asfortranarray(np.ones((3, 5))),
        "strided": np.arange(10)[::2],
        "objects": np.array([[1], "x"], dtype=object),
        "empty": np.zeros(0),
    }
    manifest = save(kdir, ns)
    assert len(manifest.groups[0].buffers) == 1 and manifest.groups[0].buffers[0][0] % ALIGN == 0
    r, _ = load(kdir)
    for name, value in ns.items():
        assert r[name].dtype == value.dtype and r[name].shape == value.shape, name
        assert r[name].tolist() == value.tolist(), name
    assert r["f"].flags.f_contiguous
    a = r["a"]
    assert a.flags.writeable
    a[0, 0] = 7
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, bytearray)
    assert len(base.obj) == a.nbytes


def test_large_arrays_cost_no_extra_copy_to_write_or_read(kdir: Path) -> None:
    np = pytest.importorskip("numpy")
    size = 100 << 20
    ns = {"big": np.ones(size // 8)}
    tracemalloc.start()
    try:
        save(kdir, ns)
        _, write_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        r, _ = load(kdir)
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert write_peak < 8 << 20, f"writing 100 MiB allocated {write_peak >> 20} MiB"
    # The 100 MiB are read into one private anonymous mapping (invisible to tracemalloc):
    # the array lives on exactly that memory, and nothing else of any size was allocated.
    assert read_peak - before < 8 << 20, f"reading allocated {(read_peak - before) >> 20} MiB on the heap"
    big = r["big"]
    base: Any = big
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
    assert len(base.obj) == size and not base.readonly and big.flags.writeable
    assert big.sum() == size // 8
    big[0] = 5  # private: writing to it changes this array only
    assert big[0] == 5 and big.sum() == size // 8 + 4


def test_big_buffers_are_read_into_private_mappings_and_small_ones_into_bytearrays() -> None:
    from kernelmgr.checkpoint.reader import MAPPED_MIN, _allocate

    small = _allocate(MAPPED_MIN - 1)
    assert isinstance(small, bytearray) and len(small) == MAPPED_MIN - 1
    big = _allocate(MAPPED_MIN)
    assert isinstance(big, mmap.mmap) and len(big) == MAPPED_MIN
    if hasattr(os, "fork"):
        big[:4] = b"abcd"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            big[:4] = b"zzzz"
            os._exit(0)
        os.waitpid(pid, 0)
        assert big[:4] == b"abcd", "a child's writes must not reach the parent (MAP_PRIVATE)"


def mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), if any."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(part, 16) for part in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_mapped_restore_gives_writable_copy_on_write_arrays_and_never_writes_the_file(kdir: Path) -> None:
    """``map_buffers``: big buffers are views of ``data.bin`` mapped privately. Several arrays,
    so that most start off a page boundary; writes reach the arrays, never the file (a second
    restore still verifies and sees the saved values); small ones are read as before."""
    np = pytest.importorskip("numpy")
    ns = {
        "a": np.arange(300_000, dtype=np.float64),  # 2.3 MiB
        "b": np.full((700, 500), 3, dtype=np.int32),  # 1.3 MiB
        "c": np.arange(1000, dtype=np.int16),  # small: read into a bytearray
        "d": np.linspace(0, 1, 200_001),
    }
    manifest = save(kdir, ns)
    offsets = [offset for group in manifest.groups for offset, length in group.buffers if length >= 1 << 20]
    assert len(offsets) == 3 and any(offset % mmap.ALLOCATIONGRANULARITY for offset in offsets)
    data = kdir / manifest.checkpoint_id / "data.bin"
    before = data.read_bytes()
    r, report = load(kdir, map_buffers=True)
    assert report["restored"] == ["a", "b", "c", "d"]
    for name, value in ns.items():
        assert r[name].dtype == value.dtype and r[name].shape == value.shape, name
        assert np.array_equal(r[name], value), name
    for name in ("a", "b", "d"):
        assert mapped_file(r[name].ctypes.data) == str(data), name  # not read into new memory
        assert r[name].flags.writeable and r[name].ctypes.data % ALIGN == 0, name
    assert mapped_file(r["c"].ctypes.data) is None
    r["a"][:] = -1
    r["b"][0, 0] = 99
    r["d"][-1] = 7.5
    assert data.read_bytes() == before
    again, _ = load(kdir, map_buffers=True)
    assert np.array_equal(again["a"], ns["a"]) and again["b"][0, 0] == 3 and again["d"][-1] == 1.0


def test_torch_tensors_restore_from_mapped_buffers(kdir: Path) -> None:
    """A tensor's storage is rebuilt over the mapped region (``torch.frombuffer``), writable, and
    the module's parameters come back equal."""
    torch = pytest.importorskip("torch")
    ns = {"t": torch.arange(400_000, dtype=torch.float32), "layer": torch.nn.Linear(600, 600)}
    manifest = save(kdir, ns)
    data = kdir / manifest.checkpoint_id / "data.bin"
    r, report = load(kdir, map_buffers=True)
    assert report["restored"] == ["t", "layer"] and not report["not_restored"]
    assert torch.equal(r["t"], ns["t"]) and torch.equal(r["layer"].weight, ns["layer"].weight)
    assert mapped_file(r["t"].data_ptr()) == str(data)
    r["t"][0] = 5
    assert r["t"][0] == 5 and torch.equal(load(kdir, map_buffers=True)[0]["t"], ns["t"])


def test_mapped_arrays_outlive_their_pruned_checkpoint(kdir: Path) -> None:
    """The next checkpoint commits and the old one is pruned while its arrays are still mapped."""
    np = pytest.importorskip("numpy")
    first = save(kdir, {"x": np.arange(400_000, dtype=np.float64)})
    r, _ = load(kdir, map_buffers=True)
    second = save(kdir, {"x": r["x"] * 2})
    layout.remove_stale(kdir, keep=second.checkpoint_id)
    assert not (kdir / first.checkpoint_id).exists() and (kdir / second.checkpoint_id).exists()
    assert r["x"][-1] == 399_999 and float(r["x"].sum()) == float(np.arange(400_000).sum())
    r2, _ = load(kdir, map_buffers=True)
    assert r2["x"][-1] == 799_998


def test_a_tampered_array_is_refused_when_mapped_too(kdir: Path) -> None:
    np = pytest.importorskip("numpy")
    manifest = save(kdir, {"x": np.zeros(300_000)})
    data = kdir / manifest.checkpoint_id / "data.bin"
    offset, length = manifest.groups[0].buffers[0]
    with open(data, "r+b") as handle:
        handle.seek(offset + length // 2)
        handle.write(b"\x01")
    with pytest.raises(CheckpointRefused, match="digest"):
        load(kdir, map_buffers=True)


def test_a_file_that_cannot_be_mapped_is_read(kdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    np = pytest.importorskip("numpy")
    from kernelmgr.checkpoint import reader

    save(kdir, {"x": np.arange(300_000, dtype=np.float64)})

    def no_mapping(fileno: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        if fileno != -1:
            raise OSError(errno.ENODEV, "No such device")  # what a file system without mmap says
        return real_mmap(fileno, *args, **kwargs)

    real_mmap = mmap.mmap
    monkeypatch.setattr(reader.mmap, "mmap", no_mapping)
    r, _ = load(kdir, map_buffers=True)
    base: Any = r["x"]
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, real_mmap)
    assert mapped_file(r["x"].ctypes.data) is None  # anonymous memory, read into
    assert np.array_equal(r["x"], np.arange(300_000, dtype=np.float64))


def fake_sync_file_range(code: int, calls: list[tuple[int, int, int]]) -> Callable[[], Any]:
    """Stands in for libc's ``sync_file_range``: fails every call with ``code`` (0: succeeds)."""
    import ctypes

    def func(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((offset, length, flags))
        if code:
            ctypes.set_errno(code)
            return -1
        return 0

    return lambda: func


def test_a_write_error_reported_by_the_writeback_hint_aborts_the_checkpoint(
    kdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = save(kdir, {"v": "old"})
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(writer, "_sync_file_range", fake_sync_file_range(errno.EIO, calls))
    with pytest.raises(CheckpointFailed, match="could not write the checkpoint"):
        save(kdir, {"v": "new", "blob": bytearray(2 * writer.WRITEBACK_CHUNK)})
    assert calls and entries(kdir) == {"current", old.checkpoint_id}
    assert load(kdir)[0]["v"] == "old"


def test_a_file_system_without_writeback_hints_still_gets_its_checkpoint(
    kdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(writer, "_sync_file_range", fake_sync_file_range(errno.EINVAL, calls))
    blob = os.urandom(3 * writer.WRITEBACK_CHUNK)
    save(kdir, {"blob": bytearray(blob)})
    assert len(calls) == 1  # refused once, then never asked again
    assert load(kdir)[0]["blob"] == blob


def test_writeback_ranges_follow_the_writer(kdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(writer, "_sync_file_range", fake_sync_file_range(0, calls))
    manifest = save(kdir, {"blob": bytearray(5 * writer.WRITEBACK_CHUNK)})
    queued = [(o, n) for o, n, flags in calls if flags == 2]
    waited = [(o, n) for o, n, flags in calls if flags == 7]
    assert queued[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(queued))
    assert queued[-1][0] + queued[-1][1] <= manifest.data_bytes
    assert waited == queued[: len(waited)] and len(queued) - len(waited) == 2


def test_writeback_hints_leave_the_data_intact(kdir: Path) -> None:
    """Big checkpoints are handed to the disk in ranges while written; the bytes are unchanged."""
    blob = os.urandom(3 * writer.WRITEBACK_CHUNK + 12345)
    manifest = save(kdir, {"blob": bytearray(blob), "small": [1, 2]})
    r, report = load(kdir)
    assert r["blob"] == blob and r["small"] == [1, 2] and report["refused"] is None
    assert {"write", "fsync", "digest"} <= set(manifest.timings)


def test_pandas_dataframe_round_trip(kdir: Path) -> None:
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"i": range(1000), "f": [0.5] * 1000, "s": ["x"] * 1000})
    df["c"] = pd.Categorical(["a", "b"] * 500)
    manifest = save(kdir, {"df": df, "col": df["f"]})
    assert manifest.totals["buffers"] >= 2
    r, _ = load(kdir)
    pd.testing.assert_frame_equal(r["df"], df)
    pd.testing.assert_series_equal(r["col"], df["f"])


def test_torch_tensors_round_trip(kdir: Path) -> None:
    torch = pytest.importorskip("torch")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    ns = {
        "w": torch.randn(3, 4, dtype=torch.bfloat16),
        "grad": torch.ones(2, 2, requires_grad=True),
        "param": torch.nn.Parameter(torch.zeros(3)),
        "ints": torch.tensor([1, 2, 3], dtype=torch.int64),
        "flags": torch.tensor([True, False]),
        "half": torch.ones(5, dtype=torch.float16),
        "base": base,
        "view": base[1:, ::2],
        "transposed": base.t(),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "empty": torch.zeros(0, 3),
        "model": torch.nn.Linear(4, 2),
    }
    manifest = save(kdir, ns)
    assert manifest.totals["skipped"] == 0
    r, report = load(kdir)
    assert report["not_restored"] == [] and report["remapped"] == []
    for name in (
        "w",
        "grad",
        "param",
        "ints",
        "flags",
        "half",
        "base",
        "view",
        "transposed",
        "conj",
        "empty",
    ):
        got, want = r[name], ns[name]
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride(), name
        assert torch.equal(got.detach(), want.detach().resolve_conj()), name
        assert got.requires_grad == want.requires_grad, name
    assert isinstance(r["param"], torch.nn.Parameter) and r["param"].requires_grad
    assert r["w"].dtype == torch.bfloat16
    # Views of one storage, held by different variables, still share it.
    assert r["view"].untyped_storage().data_ptr() == r["base"].untyped_storage().data_ptr()
    r["base"][1, 0] = 100.0
    assert r["view"][0, 0].item() == 100.0 and r["transposed"][0, 1].item() == 100.0
    x = torch.ones(1, 4)
    assert torch.equal(r["model"](x), ns["model"](x))
    loss = (r["grad"] * 2).sum()
    loss.backward()
    assert torch.equal(r["grad"].grad, torch.full((2, 2), 2.0))


def test_device_remapping_decision() -> None:
    assert remap_device("cpu", 0) == ("cpu", None)
    assert remap_device("cuda:0", 1) == ("cuda:0", None)
    assert remap_device("cuda:1", 2) == ("cuda:1", None)
    assert remap_device("cuda:1", 1) == ("cuda:0", "cuda:1 -> cuda:0")
    assert remap_device("cuda:1", 0) == ("cpu", "cuda:1 -> cpu")
    assert remap_device("cuda", 0) == ("cpu", "cuda:0 -> cpu")
    assert remap_device("mps", 0) == ("cpu", "mps -> cpu")


def test_a_gpu_storage_comes_back_on_the_cpu_when_there_is_no_gpu() -> None:
    torch = pytest.importorskip("torch")
    context = RestoreContext({}, cuda_count=0)
    with restoring(context):
        storage = _rebuild_storage(memoryview(bytearray(b"\x01\x02\x03\x04")), 4, "cuda:1")
    assert storage.device == torch.device("cpu") and bytes(storage) == b"\x01\x02\x03\x04"
    assert context.remapped == ["cuda:1 -> cpu"]


# --- commits, crashes and full disks -------------------------------------------------------


def test_a_second_checkpoint_replaces_the_first_only_once_committed(kdir: Path) -> None:
    first = save(kdir, {"v": 1})
    second = save(kdir, {"v": 2})
    assert entries(kdir) == {"current", second.checkpoint_id}
    assert load(kdir)[0]["v"] == 2
    assert first.checkpoint_id < second.checkpoint_id


def test_a_crash_before_the_commit_point_keeps_the_old_checkpoint(
    kdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = save(kdir, {"v": "old"})
    monkeypatch.setattr(writer, "publish_current", crash_before_commit)
    with pytest.raises(KeyboardInterrupt):
        save(kdir, {"v": "new"})
    monkeypatch.undo()
    assert layout.read_current(kdir) == old.checkpoint_id
    assert load(kdir)[0]["v"] == "old"
    newer = save(kdir, {"v": "newer"})
    assert entries(kdir) == {"current", newer.checkpoint_id}


def crash_before_commit(directory: Path, checkpoint_id: str) -> None:
    """Stands in for ``publish_current``: the process dies right before the commit point."""
    raise KeyboardInterrupt


def fail_after(limit: int) -> Callable[[int, memoryview], int]:
    """A write function for a disk that fills up after ``limit`` bytes."""
    written = 0

    def write(fd: int, data: memoryview) -> int:
        nonlocal written
        room = limit - written
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        count = os.write(fd, data[:room])
        written += count
        return count

    return write


def test_big_buffers_reach_the_disk_in_write_calls_of_at_most_one_mib(kdir: Path) -> None:
    # Bigger calls let Linux fill the page cache with high-order folios, which were 3-6x
    # slower to get on the benchmark VM (writer.WRITE_CALL); the bytes must still all arrive.
    sizes: list[int] = []

    def recording(fd: int, data: memoryview) -> int:
        sizes.append(len(data))
        return os.write(fd, data)

    blob = bytearray(os.urandom(1 << 16)) * 600  # 37.5 MiB: two digest chunks and a tail
    save(kdir, {"blob": blob, "v": 1}, write_fn=recording)
    assert max(sizes) == writer.WRITE_CALL
    assert sum(sizes) > len(blob)
    assert load(kdir)[0]["blob"] == blob


def test_disk_full_leaves_the_committed_checkpoint_alone(kdir: Path) -> None:
    old = save(kdir, {"v": "old"})
    payload = {"v": "new", "blob": bytearray(3 << 20)}
    with pytest.raises(CheckpointFailed) as caught:
        save(kdir, payload, write_fn=fail_after(1 << 20))
    message = str(caught.value)
    assert message.startswith("no space left on device while writing the checkpoint (wrote 1.0 of ")
    assert "MiB) — free space in " in message and str(kdir) in message
    assert entries(kdir) == {"current", old.checkpoint_id}
    assert load(kdir)[0]["v"] == "old"


def test_disk_full_on_a_real_small_filesystem(tmp_path: Path) -> None:
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mountpoint)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        kdir = mountpoint / OWNER / KERNEL
        old = save(kdir, {"v": "old"})
        with pytest.raises(CheckpointFailed, match=r"^no space left on device .* free space in "):
            save(kdir, {"v": "new", "blob": bytearray(4 << 20)})
        assert entries(kdir) == {"current", old.checkpoint_id}
        assert load(kdir)[0]["v"] == "old"
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False)


CRASH_WRITER = """
import os, sys, time
from kernelmgr.checkpoint.format import write_checkpoint
directory, key = sys.argv[1], bytes.fromhex(sys.argv[2])

written = 0

def slow(fd, data):
    # Halfway through the data, the writer stops until it is killed: the kill lands mid-write
    # however slow the machine is (no race between the writer and the test's polling).
    global written
    count = os.write(fd, data[: 1 << 20])
    written += count
    if written >= 16 << 20:
        print("halfway", flush=True)
        time.sleep(600)
    return count

print("writing", flush=True)
write_checkpoint(directory, {"v": "new", "big": bytearray(64 << 20)}, key=key, owner=sys.argv[3],
                 kernel_id=sys.argv[4], write_fn=slow)
print("done", flush=True)
"""


def test_kill_9_in_the_middle_of_a_write_keeps_the_old_checkpoint(kdir: Path) -> None:
    old = save(kdir, {"v": "old"})
    process = subprocess.Popen(
        [sys.executable, "-c", CRASH_WRITER, str(kdir), KEY.hex(), OWNER, KERNEL],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"writing\n"
        assert process.stdout.readline() == b"halfway\n", "the writer never got going"
        partials = list(kdir.glob(".partial-*/data.bin"))
        assert len(partials) == 1 and partials[0].stat().st_size >= 16 << 20, partials
        partial_data = partials[0]
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL
    assert layout.read_current(kdir) == old.checkpoint_id
    assert partial_data.exists()
    assert load(kdir)[0]["v"] == "old"
    newer = save(kdir, {"v": "newer"})
    assert entries(kdir) == {"current", newer.checkpoint_id}


# --- integrity ----------------------------------------------------------------------------


@pytest.fixture
def marked(kdir: Path, tmp_path: Path) -> tuple[Manifest, Path]:
    """A committed checkpoint holding a Marker, and the file unpickling it would create."""
    evidence = tmp_path / "unpickled.txt"
    manifest = save(kdir, {"marker": Marker(evidence), "x": 1})
    return manifest, evidence


def assert_refused_and_quarantined(
    kdir: Path, manifest: Manifest, evidence: Path, reason: str, **kw: Any
) -> None:
    with pytest.raises(CheckpointRefused, match=reason) as caught:
        load(kdir, **kw)
    assert not evidence.exists(), "something was unpickled from a refused checkpoint"
    kept = kdir / "quarantine" / manifest.checkpoint_id
    assert caught.value.quarantined == kept
    assert (kept / "manifest.json").exists() and (kept / "data.bin").exists()
    assert reason.split(" ")[0] in (kept / "reason.txt").read_text()
    assert not (kdir / manifest.checkpoint_id).exists()
    # Asking again refuses again, with the same reason, without unpickling.
    with pytest.raises(CheckpointRefused, match=reason):
        load(kdir, **kw)
    assert not evidence.exists()


def test_the_marker_really_runs_when_a_checkpoint_is_trusted(
    kdir: Path, marked: tuple[Manifest, Path]
) -> None:
    _, evidence = marked
    r, _ = load(kdir)
    assert evidence.read_text() == "unpickled" and r["x"] == 1


def test_tampered_data_is_refused_before_unpickling(kdir: Path, marked: tuple[Manifest, Path]) -> None:
    manifest, evidence = marked
    data = kdir / manifest.checkpoint_id / "data.bin"
    content = bytearray(data.read_bytes())
    content[-3] ^= 0xFF
    data.write_bytes(content)
    assert_refused_and_quarantined(kdir, manifest, evidence, "does not match the manifest's digest")


def test_tampered_manifest_is_refused(kdir: Path, marked: tuple[Manifest, Path]) -> None:
    manifest, evidence = marked
    path = kdir / manifest.checkpoint_id / "manifest.json"
    raw = json.loads(path.read_text())
    raw["variables"][1]["type"] = "something-else"
    path.write_text(json.dumps(raw))
    assert_refused_and_quarantined(kdir, manifest, evidence, "HMAC does not verify")


def test_another_owners_key_is_refused(kdir: Path, marked: tuple[Manifest, Path]) -> None:
    manifest, evidence = marked
    other = owner_key(SECRET, "mallory")
    assert_refused_and_quarantined(kdir, manifest, evidence, "HMAC does not verify", key=other)


def test_a_checkpoint_of_another_kernel_is_refused(kdir: Path, marked: tuple[Manifest, Path]) -> None:
    manifest, evidence = marked
    assert_refused_and_quarantined(kdir, manifest, evidence, "belongs to kernel", kernel_id="someone-else")


def test_missing_data_and_malformed_manifest_are_refused(kdir: Path, marked: tuple[Manifest, Path]) -> None:
    manifest, evidence = marked
    (kdir / manifest.checkpoint_id / "data.bin").unlink()
    with pytest.raises(CheckpointRefused, match=r"data\.bin is missing"):
        load(kdir)
    fresh = save(kdir, {"marker": Marker(evidence)})
    (kdir / fresh.checkpoint_id / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointRefused, match="not valid JSON"):
        load(kdir)
    assert not evidence.exists()
    assert sorted(p.name for p in (kdir / "quarantine").iterdir()) == sorted(
        [manifest.checkpoint_id, fresh.checkpoint_id]
    )


def test_current_must_name_a_checkpoint(kdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = save(kdir, {"x": 1})
    (kdir / "current").write_text("../../etc\n")
    with pytest.raises(CheckpointRefused, match="not a checkpoint"):
        load(kdir)
    # A write cannot tell which checkpoint was committed, so it deletes none before its commit...
    monkeypatch.setattr(writer, "publish_current", crash_before_commit)
    with pytest.raises(KeyboardInterrupt):
        save(kdir, {"x": 2})
    monkeypatch.undo()
    assert (kdir / first.checkpoint_id).is_dir()
    # ...and once its own commit is in place, the older ones go.
    second = save(kdir, {"x": 3})
    assert entries(kdir) == {"current", second.checkpoint_id}


def test_nothing_committed_means_no_report(kdir: Path) -> None:
    assert restore_checkpoint(kdir, {}, key=KEY, owner=OWNER, kernel_id=KERNEL) is None


def test_secret_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "checkpoint.secret"
    secret = load_or_create_secret(path)
    assert len(secret) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(path) == secret
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.secret"]


def test_owner_keys_differ_and_sign_manifests(kdir: Path) -> None:
    assert owner_key(SECRET, "alice") != owner_key(SECRET, "bob")
    assert owner_key(SECRET, "alice") != owner_key(b"t" * 32, "alice")
    manifest = save(kdir, {"x": 1})
    assert manifest_is_authentic(KEY, manifest)
    assert not manifest_is_authentic(owner_key(SECRET, "bob"), manifest)
    assert manifest.hmac == manifest_hmac(KEY, manifest)


# --- the manifest ------------------------------------------------------------------------


def example_manifest() -> Manifest:
    return Manifest(
        checkpoint_id="ckpt-20250101T000000000000-0123abcd",
        kernel_id=KERNEL,
        owner=OWNER,
        created=1735689600.0,
        python="3.11.7",
        libraries={"numpy": "2.0.0"},
        variables=[
            VariableRecord("x", "list", "saved", "", 0, 10),
            VariableRecord("g", "generator", "skipped", "TypeError: cannot pickle 'generator' object"),
        ],
        groups=[GroupRecord(0, ["x"], 0, 10, [(64, 80)])],
        totals={"bytes": 144, "saved": 1, "skipped": 1},
        timings={"total": 0.25},
        data_digest="00" * 32,
        digest_algorithm="blake3",
        hmac="ab" * 32,
    )


def test_manifest_json_round_trip_and_summary() -> None:
    manifest = example_manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert '"digest_algorithm": "blake3"' in manifest.to_json()
    assert manifest.summary() == {
        "id": "ckpt-20250101T000000000000-0123abcd",
        "created": "2025-01-01T00:00:00Z",
        "bytes": 144,
        "saved": ["x"],
        "not_saved": [
            {"name": "g", "type": "generator", "reason": "TypeError: cannot pickle 'generator' object"}
        ],
        "seconds": 0.25,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda raw: raw.pop("owner"), "missing owner"),
        (lambda raw: raw.update(format="other/9"), "unsupported checkpoint format"),
        (lambda raw: raw.update(created="yesterday"), "created must be a number"),
        (lambda raw: raw["variables"][0].update(status="maybe"), r"variables\[0\].status"),
        (lambda raw: raw["groups"][0].update(buffers=[[1]]), r"groups\[0\].buffers\[0\]"),
        (lambda raw: raw["groups"][0].update(pickle_offset=-1), "must be >= 0"),
        (lambda raw: raw["groups"][0].update(pickle_length=True), "must be an integer"),
        (lambda raw: raw["variables"][0].update(group=7), "not listed in group 7"),
        (lambda raw: raw.update(variables={}), "variables must be a list"),
    ],
)
def test_malformed_manifests_are_rejected_clearly(
    change: Callable[[dict[str, Any]], Any], message: str
) -> None:
    raw = example_manifest().to_dict()
    change(raw)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(raw)


def test_manifest_from_json_rejects_non_json() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(b"\xff\xfe")
    with pytest.raises(ManifestError, match="must be an object"):
        Manifest.from_json("[]")


# --- the store ---------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    yield CheckpointStore(tmp_path / "root", SECRET)


@pytest.mark.parametrize(
    "bad", ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "x\x00", " padded", "x" * 200]
)
def test_store_refuses_names_that_could_escape_the_root(store: CheckpointStore, bad: str) -> None:
    with pytest.raises(ValueError):
        store.kernel_dir(bad, KERNEL)
    with pytest.raises(ValueError):
        store.kernel_dir(OWNER, bad)


def test_store_reads_what_the_agent_writes(store: CheckpointStore) -> None:
    assert store.latest(OWNER, KERNEL) is None and store.summary(OWNER, KERNEL) is None
    assert store.restore_report(OWNER, KERNEL) is None
    directory = store.kernel_dir(OWNER, KERNEL)
    assert directory == store.root / OWNER / KERNEL
    assert store.key_for(OWNER) == KEY
    env = store.agent_env(OWNER, KERNEL, key_file="/k", restore=True, restore_checkpoint="ckpt-1")
    assert env["ELASTIC_CHECKPOINT_KEY_FILE"] == "/k" and env["ELASTIC_RESTORE"] == "1"
    assert env["ELASTIC_RESTORE_CHECKPOINT"] == "ckpt-1"
    assert KEY.hex() not in json.dumps(env)
    manifest = save(directory, {"x": [1], "gen": (i for i in range(0))})
    latest = store.latest(OWNER, KERNEL)
    assert latest is not None and latest.checkpoint_id == manifest.checkpoint_id
    summary = store.summary(OWNER, KERNEL)
    assert summary is not None and summary["saved"] == ["x"] and summary["refused"] is None
    assert store.has_checkpoint(OWNER, KERNEL)
    # Another owner's store view never verifies alice's checkpoint.
    assert store.latest("bob", KERNEL) is None


def test_store_quarantines_a_bad_checkpoint_and_reports_it(store: CheckpointStore) -> None:
    directory = store.kernel_dir(OWNER, KERNEL)
    manifest = save(directory, {"x": 1})
    (directory / manifest.checkpoint_id / "data.bin").write_bytes(b"short")
    with pytest.raises(CheckpointRefused, match=r"data\.bin has 5 bytes"):
        store.latest(OWNER, KERNEL)
    summary = store.summary(OWNER, KERNEL)
    assert summary is not None and "data.bin has 5 bytes" in summary["refused"]
    assert summary["quarantined"] == str(directory / "quarantine" / manifest.checkpoint_id)
    store.remove(OWNER, KERNEL)
    # The owner's directory stays: a kernel pod may be mounting it (a kubelet would make it root's).
    assert not directory.exists() and directory.parent.is_dir()
    store.remove(OWNER, KERNEL)  # removing twice is fine


def test_pickle_streams_hold_no_big_buffers(kdir: Path) -> None:
    """Out-of-band buffers really are out of band: the pickle streams stay tiny."""
    np = pytest.importorskip("numpy")
    manifest = save(kdir, {"a": np.zeros(1 << 20), "b": np.ones(1 << 18)})
    assert all(g.pickle_length < 1024 for g in manifest.groups)
    data = (kdir / manifest.checkpoint_id / "data.bin").read_bytes()
    group = manifest.groups[0]
    stream = data[group.pickle_offset : group.pickle_offset + group.pickle_length]
    buffers = [data[o : o + n] for o, n in group.buffers]
    assert pickle.loads(stream, buffers=buffers)["a"].shape == (1 << 20,)


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_data_digest_does_not_depend_on_how_the_bytes_arrive(algorithm: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kernelmgr.checkpoint.integrity import DIGEST_CHUNK, DataDigest

    blob = os.urandom(DIGEST_CHUNK * 2 + 12345)
    whole = DataDigest(algorithm=algorithm)
    whole.update(blob)
    with ThreadPoolExecutor(2) as pool:
        pieces = DataDigest(pool, algorithm)
        pieces.update(blob[:100])
        mark = pieces.mark()
        pieces.update(b"junk that a failed group wrote" * 1000)
        pieces.rollback(mark)
        for start in range(100, len(blob), 7_000_001):
            pieces.update(memoryview(blob)[start : start + 7_000_001])
        assert pieces.hexdigest() == whole.hexdigest()
    other = DataDigest(algorithm=algorithm)
    other.update(blob[:-1] + b"\x00" if blob[-1] else blob[:-1] + b"\x01")
    assert other.hexdigest() != whole.hexdigest()
    assert DataDigest(algorithm="sha256" if algorithm == "blake3" else "blake3").hexdigest() != (
        DataDigest(algorithm=algorithm).hexdigest()
    )


# --- the data digest's algorithm -------------------------------------------------------


def test_new_checkpoints_use_blake3_and_legacy_sha256_ones_still_restore_and_are_checked(
    kdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel without blake3 writes SHA-256 in the manifest's original shape (what every
    checkpoint before BLAKE3 is); it restores, and a flipped byte is still refused."""
    assert save(kdir, {"a": bytearray(b"new" * 1000)}).digest_algorithm == "blake3"
    assert load(kdir)[0]["a"] == bytearray(b"new" * 1000)
    monkeypatch.setattr(writer, "default_digest_algorithm", lambda: "sha256")
    manifest = save(kdir, {"a": bytearray(b"old" * 1000)})
    assert manifest.digest_algorithm == "sha256"
    raw = json.loads((kdir / manifest.checkpoint_id / layout.MANIFEST_FILE).read_text())
    assert "data_sha256" in raw and "data_digest" not in raw and "digest_algorithm" not in raw
    assert load(kdir)[0]["a"] == bytearray(b"old" * 1000)
    data = kdir / manifest.checkpoint_id / layout.DATA_FILE
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(CheckpointRefused, match="digest"):
        load(kdir)


def test_a_blake3_checkpoint_where_blake3_is_missing_is_refused_and_kept(
    kdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = save(kdir, {"a": 1})
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 now raises ImportError
    with pytest.raises(CheckpointRefused, match="blake3 package is not installed") as refused:
        load(kdir)
    assert refused.value.quarantined is None
    monkeypatch.delitem(sys.modules, "blake3")
    assert (kdir / manifest.checkpoint_id / layout.DATA_FILE).exists()
    assert load(kdir)[0]["a"] == 1  # the same checkpoint, once blake3 is back


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"digest_algorithm": "md5"}, "unknown data digest algorithm 'md5'"),
        ({"digest_algorithm": "sha256"}, "unknown data digest algorithm 'sha256'"),
        ({"data_sha256": "00" * 32}, "both data_sha256 and data_digest"),
    ],
)
def test_manifest_digest_fields_are_checked(change: dict[str, Any], message: str) -> None:
    raw = json.loads(example_manifest().to_json())
    raw.update(change)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(raw)
