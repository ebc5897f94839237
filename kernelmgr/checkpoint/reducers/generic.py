"""The generic rule: keep what an object's own pickling drops or blanks, when it can be kept.

Many classes pickle through a ``__getstate__``/``__reduce__`` that leaves attributes out
(plotly express figures drop ``_px_trendlines``, a torch optimizer drops its hooks) or
writes ``None`` over them (matplotlib artists blank ``stale_callback``, so a restored line
no longer redraws its figure). The library does it because *some* values there cannot be
pickled (a lambda in plain pickle, a lock, a handle) or because it recomputes them; the
value in the user's object is often perfectly picklable.

The rule, for an instance whose class customises its pickling and whose ``__dict__`` holds
such an attribute:

1. the object is reduced by its own ``__reduce_ex__`` as usual;
2. each attribute its state leaves out or sets to ``None`` (names saying *cache* or *lock*
   excepted: derived or process-local) is *probed*: pickled alone with the same pickler
   rules into a sink that gives up past :data:`PROBE_LIMIT` bytes. Those that pickle are
   carried beside the state;
3. on restore the library's own ``__setstate__`` (or its state setter, or plain ``BUILD``)
   runs first, then a carried attribute is put back only where the restored object lacks
   it, holds ``None``, or holds an empty container of the same type: the library's own
   reconstruction always wins where it produced something.

What cannot be carried is not guessed at: the difference check of
:mod:`kernelmgr.checkpoint.fidelity` then reports it.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import re
from collections.abc import Callable
from typing import Any

from kernelmgr.checkpoint.fidelity import plain_data

#: In-band bytes one carried attribute may take; a probe past it gives up on that attribute.
PROBE_LIMIT = 64 << 10

_SKIP_NAME = re.compile(r"cache|lock|mutex|thread", re.IGNORECASE)
_MISSING = object()
_OBJECT_REDUCE_EX = object.__reduce_ex__
_OBJECT_REDUCE = object.__reduce__
_OBJECT_GETSTATE = getattr(object, "__getstate__", None)


class _TooBig(Exception):
    """The probe wrote more than :data:`PROBE_LIMIT` bytes."""


class _Sink(io.RawIOBase):
    def __init__(self) -> None:
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.count += size
        if self.count > PROBE_LIMIT:
            raise _TooBig
        return size


def customises_pickling(cls: type) -> bool:
    """Whether ``cls`` decides its own pickled state (otherwise pickle keeps ``__dict__`` whole)."""
    return (
        cls.__reduce_ex__ is not _OBJECT_REDUCE_EX
        or cls.__reduce__ is not _OBJECT_REDUCE
        or getattr(cls, "__getstate__", None) is not _OBJECT_GETSTATE
    )


def _state_dict(state: Any) -> dict[str, Any] | None:
    """The instance-dict part of a reduce state, ``None`` when it is opaque or absent."""
    if isinstance(state, dict):
        return state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict | type(None)):
        merged = dict(state[0] or {})
        if isinstance(state[1], dict):
            merged.update(state[1])
        return merged
    return None


def _ids_in(value: Any, depth: int = 2) -> set[int]:
    """Ids of the objects ``value`` holds directly (containers, two levels): already saved."""
    found = {id(value)}
    if depth and isinstance(value, tuple | list):
        for item in value:
            found |= _ids_in(item, depth - 1)
    elif depth and isinstance(value, dict):
        for item in value.values():
            found |= _ids_in(item, depth - 1)
    return found


def _empty_like(current: Any, saved: Any) -> bool:
    if current is None:
        return True
    try:
        return type(current) is type(saved) and len(current) == 0 < len(saved)
    except TypeError:
        return False


class Carried:
    """What the restored object gets: the library's own state, then the carried attributes,
    then each ``after(obj, data)`` a library reducer added (see :func:`then`)."""

    __slots__ = ("after", "extras", "setter", "state")

    def __init__(
        self,
        state: Any,
        extras: dict[str, Any],
        setter: Callable[[Any, Any], Any] | None,
        after: tuple[tuple[Callable[[Any, Any], Any], Any], ...] = (),
    ) -> None:
        self.state = state
        self.extras = extras
        self.setter = setter
        self.after = after

    def __reduce__(self) -> tuple[Any, ...]:
        return (Carried, (self.state, self.extras, self.setter, self.after))


def then(rv: tuple[Any, ...], after: Callable[[Any, Any], Any], data: Any) -> tuple[Any, ...]:
    """``rv`` with ``after(obj, data)`` run once the object's state is set on restore.

    ``after`` must be importable by name (a module-level function), like any reconstructor.
    """
    func, args, state, listitems, dictitems, setter = (*rv, None, None, None, None)[:6]
    if setter is apply_carried and isinstance(state, Carried):
        carried = Carried(state.state, state.extras, state.setter, (*state.after, (after, data)))
    else:
        carried = Carried(state, {}, setter, ((after, data),))
    return (func, args, carried, listitems, dictitems, apply_carried)


def _default_build(obj: Any, state: Any) -> None:
    """What pickle's ``BUILD`` does for an object without ``__setstate__``."""
    slots = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if state:
        obj.__dict__.update(state)
    if slots:
        for name, value in slots.items():
            setattr(obj, name, value)


def apply_carried(obj: Any, carried: Carried) -> Any:
    """The state setter of a carried reduce: library first, then fill the gaps it left."""
    if carried.setter is not None:
        carried.setter(obj, carried.state)
    elif carried.state is not None:
        setstate = getattr(obj, "__setstate__", None)
        if setstate is not None:
            setstate(carried.state)
        else:
            _default_build(obj, carried.state)
    attributes = obj.__dict__
    for name, value in carried.extras.items():
        current = attributes.get(name, _MISSING)
        if current is _MISSING or _empty_like(current, value):
            attributes[name] = value
    for function, data in carried.after:
        function(obj, data)
    return obj


def reduce_keeping_dropped(
    obj: Any, dispatch_table: Any, probe: Callable[[Any], bool], protocol: int
) -> tuple[Any, ...] | None:
    """The reduce of ``obj`` with the attributes its own pickling drops carried along.

    ``None`` when the rule does not apply (no instance dict, pickling not customised, a
    reducer registered in ``dispatch_table`` or copyreg, a reduce that names a global).
    ``probe(value)`` says whether ``value`` pickles within the limit.
    """
    cls = type(obj)
    attributes = getattr(obj, "__dict__", None)
    if type(attributes) is not dict or not attributes or isinstance(obj, type):
        return None
    if cls in dispatch_table or cls in copyreg.dispatch_table or not customises_pickling(cls):
        return None  # (callers may remember this per class: it depends on the class only)
    rv = obj.__reduce_ex__(protocol)
    if not isinstance(rv, tuple) or not 2 <= len(rv) <= 6:
        return None
    func, args, state, listitems, dictitems, setter = (*rv, None, None, None, None)[:6]
    kept = _state_dict(state)
    if kept is None and state is not None:
        return rv  # an opaque state: the class restores itself its own way
    in_args = _ids_in(args) if kept is None else set()
    extras: dict[str, Any] = {}
    for name, value in attributes.items():
        if value is None or not isinstance(name, str) or _SKIP_NAME.search(name):
            continue
        if kept is not None and kept.get(name) is not None:
            continue  # the library keeps it (a dropped or blanked one reads as None here)
        if id(value) in in_args:
            continue  # rebuilt from the constructor arguments
        if plain_data(value) or probe(value):
            extras[name] = value
    if not extras:
        return rv
    return (func, args, Carried(state, extras, setter), listitems, dictitems, apply_carried)


def probe_with(make_pickler: Callable[[io.RawIOBase], pickle.Pickler]) -> Callable[[Any], bool]:
    """A probe that pickles a value alone with ``make_pickler``'s rules into a bounded sink."""

    def probe(value: Any) -> bool:
        try:
            make_pickler(_Sink()).dump(value)
        except Exception:
            return False
        return True

    return probe
