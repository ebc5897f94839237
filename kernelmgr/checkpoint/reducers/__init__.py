"""Per-library reducers: how objects of libraries notebooks hold state in are checkpointed.

Plain pickling (and cloudpickle) restores many library objects *different*: detached,
reset or without private state (see ``docs/fidelity.md`` for the list and what each
reducer keeps). Each module here handles one library, found by the top-level package that
defines the object's class (or one of its bases, so a notebook's ``nn.Module`` subclass is
covered too):

``reduce(obj, generic) -> reduce tuple | None``
    called by :class:`~kernelmgr.checkpoint.serialize.GroupPickler` for every object of
    that library; ``None`` leaves the object to the generic rule and plain pickling.
    ``generic(obj)`` is the generic rule's reduce (:mod:`.generic`), for a reducer that
    only adds to it.

A reducer module is imported only when its library is already in ``sys.modules``: a
notebook that never imported bokeh pays nothing for bokeh, and no library is ever imported
just to register its reducer. The functions that rebuild objects on restore live in the
same modules (pickle names them by module and qualified name), so the checkpoint's
reader imports the reducer module, which then imports the library the object needs.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

Reduce = Callable[[Any, Callable[[Any], Any]], Any]

#: Top-level package -> the module here that reduces its objects.
LIBRARIES: dict[str, str] = {
    "numpy": "kernelmgr.checkpoint.reducers.numpy_state",
    "torch": "kernelmgr.checkpoint.reducers.torch_state",
    "matplotlib": "kernelmgr.checkpoint.reducers.matplotlib_state",
    "bokeh": "kernelmgr.checkpoint.reducers.bokeh_state",
    "plotly": "kernelmgr.checkpoint.reducers.plotly_state",
    "ipywidgets": "kernelmgr.checkpoint.reducers.ipywidgets_state",
    "astropy": "kernelmgr.checkpoint.reducers.astropy_state",
}


def _reducer_for(top: str) -> Reduce | None:
    module_name = LIBRARIES.get(top)
    if module_name is None or top not in sys.modules:
        return None
    module = importlib.import_module(module_name)
    reduce: Reduce = module.reduce
    return reduce


def reducer_for_type(cls: type, cache: dict[type, Reduce | None]) -> Reduce | None:
    """The reducer for instances of ``cls`` (first matching base), memoised in ``cache``."""
    try:
        return cache[cls]
    except KeyError:
        pass
    found: Reduce | None = None
    for base in getattr(cls, "__mro__", (cls,)):
        top = (getattr(base, "__module__", None) or "").partition(".")[0]
        if top in LIBRARIES:
            found = _reducer_for(top)
            if found is not None:
                break
    cache[cls] = found
    return found


_STREAM: ContextVar[dict[str, Any] | None] = ContextVar("elastic_reducer_stream", default=None)


@contextlib.contextmanager
def one_stream() -> Iterator[dict[str, Any]]:
    """Scope of one pickle stream: reducers keep per-stream state here (see ``stream_state``)."""
    state: dict[str, Any] = {}
    token = _STREAM.set(state)
    try:
        yield state
    finally:
        _STREAM.reset(token)


def stream_state() -> dict[str, Any]:
    """State a reducer keeps for the stream being written (a fresh dict outside one)."""
    state = _STREAM.get()
    return state if state is not None else {}
