"""Which variables must be pickled together so that shared objects stay shared.

Pickling each variable on its own keeps one bad object from losing the rest, but it
breaks aliasing: after ``b = [1]; c = [b, b]; d = {"x": b}``, pickling ``c`` and ``d``
separately brings back two different lists. Pickle preserves identity only *within* one
stream, so variables whose object graphs meet must share a stream: a *group*. Groups are
the connected components of "these two variables reach a common object", found here with
a union-find over object ids.

What is traversed: containers and instances, through ``gc.get_referents`` (the same edges
the garbage collector follows). What is not:

* atoms (str, bytes, numbers, bool, None): immutable, their identity does not matter;
* classes and modules: pickled by reference (or, for notebook classes, tracked by
  cloudpickle so every group gets the same class back), so reaching the same class from
  two variables must not glue them together;
* functions: they link the variables that hold them (so ``g = f`` stays ``g is f``) but
  are not entered, because a notebook function's globals *is* the user namespace and
  would glue everything together;
* the namespace dict itself, for the same reason;
* torch tensors are also linked through their storage, and numpy arrays through the array
  that owns their memory, so views held by two variables are grouped (and then restored
  as views of one storage / one array).

The cap: at most ``max_objects`` referents are examined per variable. Beyond it the rest of
that variable's graph is not looked at, so sharing deeper than that is not detected: the
variables are then pickled in separate groups, each keeps a correct *copy* of the shared
object, and only the identity between them is lost. The cap bounds the time a checkpoint
spends here on huge pure-Python structures (a list of ten million floats).
"""

from __future__ import annotations

import builtins
import gc
import sys
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_OBJECTS = 100_000

_ATOMS: tuple[type, ...] = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    type(Ellipsis),
    type,
    types.ModuleType,
    types.BuiltinFunctionType,
    types.CodeType,
    range,
)
_LINK_ONLY: tuple[type, ...] = (types.FunctionType,)


@dataclass
class VariableGroup:
    """Names to pickle in one stream, with a rough size estimate (for progress messages)."""

    names: list[str]
    approx_bytes: int = 0
    truncated: bool = False


@dataclass
class _UnionFind:
    parent: list[int] = field(default_factory=list)

    def add(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def approx_size(obj: Any) -> int:
    """A cheap size estimate: buffer sizes for arrays and tensors, ``getsizeof`` otherwise."""
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int) and not isinstance(obj, memoryview):
        return nbytes
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        try:
            return int(obj.untyped_storage().nbytes())
        except Exception:
            return 0
    try:
        return sys.getsizeof(obj)
    except Exception:
        return 0


def _extra_keys(obj: Any) -> Iterator[tuple[str, str, int]]:
    """Identities beyond ``id()``: a tensor's storage, a numpy array's memory owner (views
    share it, their ids differ, and numpy views are opaque to ``gc.get_referents``)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and type(obj) is numpy.ndarray:
        root = obj
        while type(root.base) is numpy.ndarray:
            root = root.base
        yield ("numpy-memory", "", id(root))
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        try:
            storage = obj.untyped_storage()
            if storage.nbytes():
                yield ("torch-storage", str(obj.device), int(storage.data_ptr()))
        except Exception:
            return


def _referents(obj: Any) -> Iterable[Any]:
    """The objects ``obj`` refers to (object arrays are opaque to the gc, so read them).

    A weak reference links to its referent: classes that pickle one dereference it in
    their ``__getstate__`` (torch's hook handles hold their module's hook dict so), and the
    restored handle must reach the restored dict, not a copy, to ``remove()`` the hook.
    """
    if isinstance(obj, weakref.ref):
        referent = obj()
        return [] if referent is None else [referent]
    dtype = getattr(obj, "dtype", None)
    if dtype is not None and getattr(dtype, "hasobject", False) and hasattr(obj, "flat"):
        return list(obj.flat)
    return gc.get_referents(obj)


def group_variables(
    namespace: Mapping[str, Any],
    names: Sequence[str],
    *,
    max_objects: int = DEFAULT_MAX_OBJECTS,
    stop: Iterable[Any] = (),
) -> list[VariableGroup]:
    """Partition ``names`` into groups of variables that reach a common object.

    Groups come out in the order of their first name in ``names``; names inside a group
    keep that order too. ``stop`` lists objects never entered (the namespace and the
    builtins dict, which generators reach through their frames, always are).
    """
    stop_ids = {id(namespace), id(vars(builtins)), *(id(o) for o in stop)}
    owner: dict[object, int] = {}
    keep_alive: list[Any] = []
    sets = _UnionFind()
    sizes: list[int] = []
    truncated: list[bool] = []

    for index, name in enumerate(names):
        sets.add()
        sizes.append(0)
        truncated.append(False)
        budget = max_objects
        pending = [namespace[name]]
        while pending:
            obj = pending.pop()
            if isinstance(obj, _ATOMS):
                if isinstance(obj, str | bytes):
                    sizes[index] += len(obj)
                continue
            key = id(obj)
            if key in stop_ids:
                continue
            first = owner.get(key)
            if first is not None:
                if first != index:
                    sets.union(first, index)
                continue
            owner[key] = index
            keep_alive.append(obj)
            sizes[index] += approx_size(obj)
            for extra in _extra_keys(obj):
                other = owner.setdefault(extra, index)
                if other != index:
                    sets.union(other, index)
            if isinstance(obj, _LINK_ONLY):
                continue
            try:
                children = _referents(obj)
            except Exception:
                continue
            for child in children:
                if budget <= 0:
                    truncated[index] = True
                    pending.clear()
                    break
                budget -= 1
                if isinstance(child, _ATOMS):
                    if isinstance(child, str | bytes):
                        sizes[index] += len(child)
                    continue
                pending.append(child)

    by_root: dict[int, VariableGroup] = {}
    order: list[VariableGroup] = []
    for index, name in enumerate(names):
        root = sets.find(index)
        group = by_root.get(root)
        if group is None:
            group = by_root[root] = VariableGroup(names=[])
            order.append(group)
        group.names.append(name)
        group.approx_bytes += sizes[index]
        group.truncated = group.truncated or truncated[index]
    return order
