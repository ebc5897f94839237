"""The cell record: what each executed cell read and wrote, and whether it is safe to re-run.

Some variables cannot be saved (a generator, a lock, an open file) or fail to load. The
cells that produced them are the recipe to rebuild them, so the agent records every cell it
sees: its source, the user variables it *read* (names the compiled cell loads, seen by
walking its AST, functions and lambdas included) and those it *wrote* (names the AST binds,
plus the namespace diff: names whose value was rebound, added or deleted). Recording costs
an AST walk and one ``id()`` per user variable per cell.

What a static walk cannot see, it refuses rather than guesses: a cell that reaches the
namespace indirectly (``exec``, ``eval``, ``globals()``, ``locals()``, ``vars()``,
``__import__``, ``get_ipython()``, which is what magics and ``!`` shell escapes become) is
marked *unsafe*, so it is never re-run. A function called by the cell that changes its
argument in place is not seen (only assignment to an attribute or item, ``del``, augmented
assignment, and the usual in-place methods such as ``append`` are).

**The re-run rule** (:func:`unsafe_reasons`): a cell may be re-run only if it finished
without an error when it ran, and it has no detectable side effect outside the namespace:
no file writes (``open`` with a ``w``/``a``/``x``/``+`` mode, ``write_text``, ``unlink``,
``to_csv``, ``savefig`` ...), no ``os``/``shutil`` file or process calls, no network or
subprocess modules, no ``input()``, no magics or shell escapes, no ``exec``-like access, and
no unseeded randomness (a ``random``/``np.random``/``torch`` draw is allowed only when the
same cell seeds it: a seed set in an earlier cell has been consumed since). Reading files is allowed:
that is how an open file handle is rebuilt.

Long because the cell record and the re-run rule read the same AST walk; much of the length is the
tables of calls with side effects.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernelmgr.checkpoint.namespace import is_machinery

#: Cells kept in the record (oldest dropped first); a long session's record stays small.
MAX_CELLS = 500
#: Larger sources are recorded without their text (they cannot be re-run).
MAX_SOURCE = 64 * 1024

_BUILTINS = frozenset(dir(builtins))
_INDIRECT = frozenset({"exec", "eval", "globals", "locals", "vars", "__import__", "get_ipython", "compile"})
_SIDE_EFFECT_MODULES = frozenset(
    {
        "subprocess",
        "socket",
        "requests",
        "urllib",
        "http",
        "httpx",
        "aiohttp",
        "ftplib",
        "smtplib",
        "multiprocessing",
        "shutil",
        "webbrowser",
        "pty",
        "ctypes",
    }
)
_OS_EFFECTS = frozenset(
    {
        "system",
        "popen",
        "remove",
        "unlink",
        "rmdir",
        "removedirs",
        "rename",
        "replace",
        "renames",
        "mkdir",
        "makedirs",
        "chmod",
        "chown",
        "kill",
        "fork",
        "putenv",
        "unsetenv",
        "truncate",
        "write",
        "symlink",
        "link",
    }
)
_OS_PREFIX_EFFECTS = ("exec", "spawn")
_WRITE_METHODS = frozenset(
    {
        "write_text",
        "write_bytes",
        "touch",
        "unlink",
        "rmdir",
        "mkdir",
        "rename",
        "replace",
        "symlink_to",
        "hardlink_to",
        "to_csv",
        "to_parquet",
        "to_excel",
        "to_json",
        "to_pickle",
        "to_hdf",
        "to_sql",
        "to_feather",
        "savefig",
        "savetxt",
        "save",
        "savez",
        "savez_compressed",
        "tofile",
        "dump",
    }
)
_MUTATING_METHODS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "remove",
        "clear",
        "update",
        "add",
        "discard",
        "setdefault",
        "sort",
        "reverse",
        "appendleft",
        "extendleft",
        "popleft",
        "rotate",
        "resize",
        "fill",
        "put",
        "send",
        "close",
    }
)
_RANDOM_MODULES = ("random", "np.random", "numpy.random", "torch", "torch.cuda")
_RANDOM_CALLS = frozenset(
    {
        "random",
        "rand",
        "randn",
        "randint",
        "randrange",
        "choice",
        "choices",
        "sample",
        "shuffle",
        "permutation",
        "uniform",
        "normal",
        "gauss",
        "random_sample",
        "randperm",
        "integers",
        "multinomial",
        "bernoulli",
        "poisson",
        "default_rng",
    }
)
_SEED_CALLS = frozenset({"seed", "manual_seed", "manual_seed_all"})


def _dotted(node: ast.AST) -> str | None:
    """``np.random.rand`` for an ``Attribute`` chain over a ``Name``; else ``None``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _base_name(node: ast.AST) -> str | None:
    """The variable an ``x.a[0].b`` target changes in place: ``x``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _open_mode(call: ast.Call) -> str:
    """The literal mode of an ``open(...)`` call (``"r"`` by default, ``"?"`` when not literal)."""
    mode: ast.AST | None = call.args[1] if len(call.args) > 1 else None
    for keyword in call.keywords:
        if keyword.arg == "mode":
            mode = keyword.value
    if mode is None:
        return "r"
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return mode.value
    return "?"


@dataclass
class CellAnalysis:
    """What the source says about a cell, before it runs."""

    reads: set[str] = field(default_factory=set)
    writes: set[str] = field(default_factory=set)
    mutates: set[str] = field(default_factory=set)
    unsafe: list[str] = field(default_factory=list)
    random: bool = False
    seeds: bool = False


class _Walker(ast.NodeVisitor):
    def __init__(self) -> None:
        self.out = CellAnalysis()
        self.local: set[str] = set()  # names bound inside functions/lambdas/comprehensions

    def _unsafe(self, why: str) -> None:
        if why not in self.out.unsafe:
            self.out.unsafe.append(why)

    # -- names ----------------------------------------------------------------------------

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            if node.id in _INDIRECT:
                magic = node.id == "get_ipython"
                self._unsafe("uses a magic or shell escape" if magic else f"uses {node.id}()")
            elif node.id == "input":
                self._unsafe("asks for input()")
            self.out.reads.add(node.id)
        else:
            self.out.writes.add(node.id)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._module(alias.name)
            self.out.writes.add((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._module(node.module or "")
        for alias in node.names:
            if alias.name != "*":
                self.out.writes.add(alias.asname or alias.name)

    def _module(self, name: str) -> None:
        top = name.split(".")[0]
        if top in _SIDE_EFFECT_MODULES:
            self._unsafe(f"imports {top} (network, processes or files)")

    def _define(self, name: str) -> None:
        self.out.writes.add(name)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._define(node.name)
        self._scope(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._define(node.name)
        self._scope(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._define(node.name)
        self.generic_visit(node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._scope(node)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp) -> None:
        """A comprehension's loop variables are its own (Python 3 scoping)."""
        inner = _Walker()
        for child in ast.iter_child_nodes(node):
            inner.visit(child)
        own = {
            target.id
            for gen in node.generators
            for target in ast.walk(gen.target)
            if isinstance(target, ast.Name)
        }
        self.out.reads |= inner.out.reads - own
        self.out.writes |= inner.out.writes - own
        self.out.mutates |= inner.out.mutates - own
        for why in inner.out.unsafe:
            self._unsafe(why)
        self.out.random |= inner.out.random
        self.out.seeds |= inner.out.seeds

    visit_ListComp = _comprehension
    visit_SetComp = _comprehension
    visit_DictComp = _comprehension
    visit_GeneratorExp = _comprehension

    def _scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        """Names a function binds are its own; what it loads may be a user variable."""
        inner = _Walker()
        for child in ast.iter_child_nodes(node):
            inner.visit(child)
        params = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        globals_ = {n for s in ast.walk(node) if isinstance(s, ast.Global) for n in s.names}
        own = (inner.out.writes | params) - globals_
        self.out.reads |= inner.out.reads - own
        self.out.writes |= inner.out.writes & globals_
        self.out.mutates |= inner.out.mutates - own
        for why in inner.out.unsafe:
            self._unsafe(why)
        self.out.random |= inner.out.random
        self.out.seeds |= inner.out.seeds

    # -- in-place changes -----------------------------------------------------------------

    def _mutated(self, target: ast.AST) -> None:
        base = _base_name(target)
        if base is not None and not isinstance(target, ast.Name):
            self.out.mutates.add(base)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._mutated(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        base = _base_name(node.target)
        if base is not None:
            self.out.mutates.add(base)  # ``x += [1]`` changes a list in place
            self.out.reads.add(base)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._mutated(target)
        self.generic_visit(node)

    # -- calls ----------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = _dotted(func)
        if isinstance(func, ast.Name) and func.id == "open":
            mode = _open_mode(node)
            if mode == "?" or any(flag in mode for flag in "wax+"):
                self._unsafe("opens a file for writing")
        if isinstance(func, ast.Attribute):
            method = func.attr
            owner = _dotted(func.value) or ""
            os_effect = method in _OS_EFFECTS or method.startswith(_OS_PREFIX_EFFECTS)
            if owner in ("os", "os.path") and os_effect:
                self._unsafe(f"calls os.{method}")
            elif method in _WRITE_METHODS:
                self._unsafe(f"calls .{method}() (writes a file)")
            elif method == "open" and _open_mode(node) not in ("r", "rb", "rt"):
                self._unsafe("opens a file for writing")
            if method in _MUTATING_METHODS:
                base = _base_name(func.value)
                if base is not None:
                    self.out.mutates.add(base)
            if method in _SEED_CALLS:
                self.out.seeds = True
            elif method in _RANDOM_CALLS and owner in _RANDOM_MODULES:
                if method == "default_rng" and (node.args or node.keywords):
                    self.out.seeds = True  # ``np.random.default_rng(0)`` is seeded
                else:
                    self.out.random = True
        if name in ("time.time", "datetime.now", "datetime.datetime.now", "uuid.uuid4"):
            self._unsafe(f"calls {name}() (a different value each run)")
        self.generic_visit(node)


def analyze(source: str) -> CellAnalysis:
    """Walk ``source`` (already transformed from IPython syntax to Python).

    Unparsable source gets an ``unsafe`` reason and no reads or writes.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as exc:
        return CellAnalysis(unsafe=[f"does not parse ({exc.__class__.__name__})"])
    walker = _Walker()
    walker.visit(tree)
    out = walker.out
    out.reads -= _BUILTINS
    out.mutates -= _BUILTINS
    return out


@dataclass
class CellRecord:
    """One executed cell, as kept in the checkpoint manifest (``cells``)."""

    index: int
    source: str
    reads: list[str]
    writes: list[str]
    mutates: list[str] = field(default_factory=list)
    unsafe: list[str] = field(default_factory=list)
    random: bool = False
    seeds: bool = False
    ok: bool = True
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "source": self.source,
            "reads": list(self.reads),
            "writes": list(self.writes),
            "mutates": list(self.mutates),
            "unsafe": list(self.unsafe),
            "random": self.random,
            "seeds": self.seeds,
            "ok": self.ok,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CellRecord:
        """Raises ``ValueError`` for a malformed record (it came from a signed manifest, so
        this means a bug or another format, not tampering)."""

        def names(key: str) -> list[str]:
            value = raw.get(key, [])
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise ValueError(f"cell record {key!r} is not a list of names")
            return list(value)

        index, source = raw.get("index"), raw.get("source")
        if not isinstance(index, int) or not isinstance(source, str):
            raise ValueError("cell record needs an integer index and a source string")
        return cls(
            index=index,
            source=source,
            reads=names("reads"),
            writes=names("writes"),
            mutates=names("mutates"),
            unsafe=names("unsafe"),
            random=bool(raw.get("random", False)),
            seeds=bool(raw.get("seeds", False)),
            ok=bool(raw.get("ok", True)),
            seconds=float(raw.get("seconds", 0.0)),
        )

    def replay_blockers(self) -> list[str]:
        """Why this cell may not be re-run, whatever the plan (empty: it may)."""
        why = list(self.unsafe)
        if not self.ok:
            why.append("raised an error when it ran")
        return why


def record_cell(
    index: int,
    source: str,
    transformed: str,
    before: Mapping[str, int],
    after: Mapping[str, int],
    *,
    ok: bool,
    seconds: float,
) -> CellRecord:
    """The record of one finished cell.

    ``before``/``after`` map each user variable to ``id()`` of its value around the cell:
    a name added, removed or bound to another object was written, whatever the AST says.
    """
    found = analyze(transformed)
    changed = {name for name, _ in after.items() ^ before.items()}  # added, removed or rebound
    writes = {
        name
        for name in (found.writes | changed) & (after.keys() | before.keys())
        if isinstance(name, str) and not is_machinery(name)
    }
    unsafe = list(found.unsafe)
    if len(source) > MAX_SOURCE:
        source, unsafe = "", [*unsafe, f"its source is over {MAX_SOURCE // 1024} KiB and was not kept"]
    return CellRecord(
        index=index,
        source=source,
        reads=sorted(found.reads),
        writes=sorted(writes),
        mutates=sorted(found.mutates),
        unsafe=unsafe,
        random=found.random,
        seeds=found.seeds,
        ok=ok,
        seconds=round(seconds, 3),
    )


@dataclass
class Plan:
    """The cells to re-run to rebuild ``targets``, and what cannot be rebuilt, with why."""

    cells: list[CellRecord]
    targets: list[str]
    impossible: dict[str, str]


def _last_writer(cells: list[CellRecord], name: str, before: int) -> int | None:
    """Position in ``cells`` of the last cell before position ``before`` that wrote ``name``."""
    for pos in range(before - 1, -1, -1):
        if name in cells[pos].writes or name in cells[pos].mutates:
            return pos
    return None


def plan_recompute(cells: list[CellRecord], missing: Iterable[str], available: Iterable[str]) -> Plan:
    """The fewest recorded cells whose re-run rebuilds ``missing`` from ``available``.

    For each missing variable, take the last cell that wrote it; each name that cell read is
    either available *in the version the cell saw* (no later cell rewrote it) or must itself
    be rebuilt by the cell that wrote that version, recursively. A variable is impossible when
    no recorded cell wrote it, when a cell on its path may not be re-run (see the module
    docstring), or when a cell on its path would change, in place, a variable that was
    restored (re-running it would corrupt what came back).
    """
    have = set(available)
    targets = sorted(set(missing))
    impossible: dict[str, str] = {}
    chosen: set[int] = set()
    end = len(cells)

    def need(name: str, before: int, trail: set[int]) -> str | None:
        """Add what rebuilds ``name`` as seen at position ``before``; the reason if impossible."""
        pos = _last_writer(cells, name, before)
        latest = _last_writer(cells, name, end)
        if name in have and pos == latest:
            return None  # the restored value is the version this cell saw
        if pos is None:
            if name in have:
                return f"needs an older value of {name} than the one restored"
            return f"no recorded cell wrote {name}" if name not in _BUILTINS else None
        if pos in trail:
            return None
        cell = cells[pos]
        blockers = cell.replay_blockers()
        if cell.random and not cell.seeds:
            blockers.append("draws random numbers without a seed")
        if blockers:
            return f"cell {cell.index} {blockers[0]}"
        clobbered = sorted(set(cell.mutates) & have)
        if clobbered:
            return f"cell {cell.index} changes {', '.join(clobbered)} in place"
        trail = trail | {pos}
        for read in cell.reads:
            if read in cell.writes and _last_writer(cells, read, pos) is None:
                continue  # bound inside the cell (an import), or from before the record began
            why = need(read, pos, trail)
            if why is not None:
                return why
        chosen.add(pos)
        return None

    for name in targets:
        snapshot = set(chosen)
        why = need(name, end, set())
        if why is not None:
            impossible[name] = why
            chosen.intersection_update(snapshot)
    ordered = [cells[pos] for pos in sorted(chosen)]
    return Plan(cells=ordered, targets=[n for n in targets if n not in impossible], impossible=impossible)
