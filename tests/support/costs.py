"""What a test costs to run, derived from what it uses, so that ``-m pure`` (or server, ...) is honest.

Every collected test gets exactly one of the cost markers in ``COSTS``: the most expensive part it
needs. It is derived from the code the test runs: the test function, every fixture it requests
(directly or through other fixtures), and, transitively, the functions and classes of the test
modules and ``tests/conftest.py`` that those call. Each name they load is compared with ``SOURCES``
(``start_server`` means a real server, ``ControlPlane`` the control plane, ...). A module, class,
test or helper function may also carry a cost marker by hand, for what the code cannot show (a
helper that runs the helm binary): a helper's marker counts for every test that calls it. The
result is the most expensive of all of these; a test for which nothing is found and nothing is
written is an error at collection time (say ``pytestmark = pytest.mark.pure`` when it is pure).

The support modules (``tests/support/``) are not followed: their expensive entry points are listed
in ``SOURCES`` instead, and their other helpers (``wait_for``, ``Gate``, ...) cost nothing.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import sys
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: The cost markers, cheapest first, with what each needs (registered in pyproject.toml).
COSTS = ("pure", "server", "cluster", "browser", "gpu")

#: Qualified names (or prefixes, ending in ".") of what makes a test cost more than ``pure``.
SOURCES: dict[str, str] = {
    # real jupyter_server, ipykernel, JupyterHub processes
    "tests.support.server.start_server": "server",
    "tests.support.server.launch": "server",
    "tests.support.hub.running_hub": "server",
    "tests.support.hub.Hub": "server",
    "tests.support.oracle.Reference": "server",
    "jupyter_client.manager.KernelManager": "server",
    "jupyter_client.manager.AsyncKernelManager": "server",
    "jupyter_client.manager.start_new_kernel": "server",
    "jupyter_client.manager.start_new_async_kernel": "server",
    "jupyter_client.multikernelmanager.": "server",
    "pytest_jupyter.": "server",
    # the real control plane (envtest binaries, kwok, the node runner)
    "tests.support.kube.ControlPlane": "cluster",
    "tests.support.kube.require_envtest": "cluster",
    "tests.support.kube.create_fake_gpu_nodes": "cluster",
    "tests.support.node_runner.": "cluster",
    "tests.support.pod_cluster.": "cluster",
    "tests.support.kernel_pods.kernel_manager": "cluster",
    "tests.support.rbac.apply": "cluster",
    # a real S3-compatible server (SeaweedFS, built from Go modules like the control plane)
    "tests.support.s3.": "cluster",
    # a real browser
    "playwright.": "browser",
}


def rank(cost: str) -> int:
    return COSTS.index(cost)


def source_cost(name: str) -> str | None:
    """The cost of using the object with qualified name ``name``, or None when it costs nothing."""
    for source, cost in SOURCES.items():
        if name == source or (source.endswith(".") and name.startswith(source)):
            return cost
    return None


def qualified_name(obj: Any) -> str | None:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return None


def marked_costs(obj: Any) -> list[str]:
    """The cost markers written on a function or class by hand (``@pytest.mark.cluster``)."""
    marks = getattr(obj, "pytestmark", [])
    if not isinstance(marks, list):
        marks = [marks]
    return [mark.name for mark in marks if getattr(mark, "name", None) in COSTS]


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """A code object and those nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


class Walk:
    """The costs found in the code reachable from some functions; each function is read once.

    Calls are followed into the modules under ``root`` (the test modules and conftest), not into
    ``root/support`` (its entry points are in ``SOURCES``) nor out of the tests.
    """

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.found: dict[str, str] = {}  # cost -> the first name that showed it
        self._seen: dict[int, Any] = {}
        self._followed: dict[str, bool] = {}  # module name -> whether its code is followed

    def _follows(self, module: Any) -> bool:
        if not isinstance(module, str):
            return False
        if module not in self._followed:
            file = getattr(sys.modules.get(module), "__file__", None)
            path = Path(file).resolve() if file else None
            self._followed[module] = (
                path is not None
                and path.is_relative_to(self.root)
                and not path.is_relative_to(self.root / "support")
            )
        return self._followed[module]

    def cost(self) -> str | None:
        return max(self.found, key=rank) if self.found else None

    def note(self, cost: str, why: str) -> None:
        """Record that ``cost`` is needed, and the first reason seen for it."""
        self.found.setdefault(cost, why)

    def follow(self, obj: Any) -> None:
        """Read a function or class of the test modules (and what it calls); anything else is a leaf."""
        if callable(obj):
            with contextlib.suppress(ValueError):  # a cycle of __wrapped__
                obj = inspect.unwrap(obj)
        if id(obj) in self._seen:
            return
        self._seen[id(obj)] = obj  # kept, so that no other object gets its id during the walk
        for marked in marked_costs(obj):
            self.note(marked, f"{qualified_name(obj)} is marked {marked}")
        name = qualified_name(obj)
        if name is not None and (cost := source_cost(name)) is not None:
            self.note(cost, name)
            return
        if not self._follows(getattr(obj, "__module__", None)):
            return
        if isinstance(obj, type):
            for member in vars(obj).values():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property):
                    member = member.fget
                if isinstance(member, types.FunctionType):
                    self.follow(member)
        elif isinstance(obj, types.FunctionType):
            aliases: dict[str, str] = {}  # shared by the function's inner functions, for their closures
            for code in _codes(obj.__code__):
                self._read(code, obj.__globals__, aliases)

    def _read(self, code: types.CodeType, globals_: dict[str, Any], aliases: dict[str, str]) -> None:
        """Note what ``code`` loads: globals, ``module.attribute``, imports (local ones included), and
        ``x = pytest.importorskip("module")`` followed by ``x.attribute`` (``aliases``: x -> module)."""
        current: Any = None  # the object the last loads resolved to, for ``module.attribute``
        dotted: str | None = None  # the module name the last loads spelled, when it is not loaded
        imported: str | None = None  # the module of the last IMPORT_NAME, for its IMPORT_FROMs
        binds: str | None = None  # the module the next STORE binds (``import x``, importorskip)
        skipped_import = False  # the last load was pytest.importorskip: its string argument is a module
        for instruction in dis.get_instructions(code):
            op, arg = instruction.opname, instruction.argval
            if op in ("PRECALL", "CALL", "PUSH_NULL", "KW_NAMES", "CACHE", "NOP"):
                continue
            if op in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(arg, str):
                if dotted is not None:
                    dotted = f"{dotted}.{arg}"
                    self._name(dotted)
                current = getattr(current, arg, None) if isinstance(current, types.ModuleType) else None
                if current is not None:
                    self.follow(current)
                skipped_import = current is pytest.importorskip
                continue
            if op == "LOAD_CONST" and skipped_import and isinstance(arg, str):
                self._name(arg)
                binds, skipped_import = arg, False
                continue
            if op == "IMPORT_NAME" and isinstance(arg, str):
                self._name(arg)
                imported, binds = arg, arg.partition(".")[0]
                continue
            if op == "IMPORT_FROM" and imported is not None and isinstance(arg, str):
                self._name(f"{imported}.{arg}")
                binds = None
                continue
            if op.startswith("STORE_") and binds is not None and isinstance(arg, str):
                aliases[arg] = binds
            if not op.startswith("STORE_") or binds is not None:
                imported = None
            current, dotted, binds, skipped_import = None, None, None, False
            if op in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(arg, str):
                current = globals_.get(arg)
                if current is not None:
                    self.follow(current)
                    skipped_import = current is pytest.importorskip
                else:
                    dotted = aliases.get(arg)
            elif op in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE") and isinstance(arg, str):
                dotted = aliases.get(arg)

    def _name(self, name: str) -> None:
        """Note a qualified name reached by import or attribute, and follow it when it is loaded."""
        if (cost := source_cost(name)) is not None:
            self.note(cost, name)
            return
        module, _, attribute = name.rpartition(".")
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, attribute):
            self.follow(getattr(loaded, attribute))


def fixture_functions(item: pytest.Item) -> Iterable[Any]:
    """The functions of every fixture ``item`` requests, directly or through other fixtures."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [fixturedef.func for defs in info.name2fixturedefs.values() for fixturedef in defs]


def derive(item: pytest.Item, root: Path) -> tuple[str | None, dict[str, str]]:
    """The cost ``item`` needs (None when nothing shows one) and, per cost, what showed it."""
    walk = Walk(root)
    for marker in item.iter_markers():
        if marker.name in COSTS:
            walk.note(marker.name, f"marked {marker.name}")
    function = getattr(item, "function", None)
    if function is not None:
        walk.follow(function)
    for func in fixture_functions(item):
        walk.follow(func)
    return walk.cost(), walk.found


def assign(items: list[pytest.Item], root: Path) -> None:
    """Give each item exactly one cost marker, or stop the run naming the items that show none.

    ``root`` is the folder of the test modules (calls are followed there); markers written by hand
    on modules and classes are moved onto the items, so that ``-m`` sees only the one given here.
    """
    costs = {item.nodeid: derive(item, root)[0] for item in items}  # before any marker is moved
    missing = [nodeid for nodeid, cost in costs.items() if cost is None]
    for item in items:
        cost = costs[item.nodeid]
        for node in item.listchain():
            node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in COSTS]
        if cost is not None:
            item.add_marker(cost)
    if missing:
        files = sorted({nodeid.split("::")[0] for nodeid in missing})
        raise pytest.UsageError(
            f"{len(missing)} test(s) have no cost marker and use nothing that shows one, in "
            + ", ".join(files)
            + f" (first: {missing[0]}). Add `pytestmark = pytest.mark.pure` to the module when they "
            + "start no server, kernel or cluster, or the marker of what they need: "
            + ", ".join(COSTS)
            + " (tests/support/costs.py)."
        )
