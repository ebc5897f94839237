"""matplotlib: artists come back wired to each other, so changes still reach the figure.

matplotlib pickles figures well, but cuts two kinds of links on purpose, because in general
they may not pickle:

* ``Artist.stale_callback`` (how a changed line marks its axes and figure for redrawing) is
  written as ``None``: the generic rule (:mod:`.generic`) carries it back, since the
  callbacks matplotlib installs are module-level functions;
* a ``CallbackRegistry`` keeps only the connections explicitly marked picklable. The others
  include matplotlib's own wiring: a colormap norm notifying its colorizer, the colorizer
  notifying its image. After a plain restore, ``image.set_clim(...)`` changes the norm and
  nothing redraws. This reducer keeps, besides the marked ones, every connection to a
  *bound method of a matplotlib object* (its internal wiring, which pickles as "that
  object's method"); connections to user callbacks stay dropped as matplotlib decides.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any


def _is_internal(callback: Any) -> bool:
    if not isinstance(callback, types.MethodType):
        return False
    module = getattr(type(callback.__self__), "__module__", "") or ""
    return module == "matplotlib" or module.startswith("matplotlib.")


def reduce(obj: Any, generic: Callable[[Any], tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    cbook = sys.modules.get("matplotlib.cbook")
    if cbook is None or type(obj) is not cbook.CallbackRegistry:
        return None
    rv = obj.__reduce_ex__(5)
    if not isinstance(rv, tuple) or len(rv) < 3 or not isinstance(rv[2], dict):
        return None
    state = dict(rv[2])
    kept = {signal: dict(entries) for signal, entries in state.get("callbacks", {}).items()}
    for signal, entries in obj.callbacks.items():
        for cid, proxy in entries.items():
            callback = proxy()
            if callback is not None and cid not in kept.get(signal, {}) and _is_internal(callback):
                kept.setdefault(signal, {})[cid] = callback
    state["callbacks"] = kept
    return (*rv[:2], state, *rv[3:])
