"""plotly: figures through plotly's own serialisation, private attributes carried.

A plotly figure reduces itself to its JSON form (``to_dict()``, plus its subplot grid) and
is rebuilt by its class from it: plotly's own serialisation, kept as is. What that form
leaves out are private attributes plotly express sets (``_px_trendlines``, read back by
``px.get_trendline_results``); the generic rule (:mod:`.generic`) carries them.

This module exists so that plotly's rule is the one used for every figure: a
``FigureWidget`` is also an ipywidget, and the ipywidgets reducer (its trait state) would
otherwise take it and lose the figure's data. Its comm is opened anew, like any widget's,
and it is rebuilt by the first class of its MRO that its module names: anywidget gives
each instance a class of its own, which cloudpickle would save by value (a restored
figure widget would then be an instance of a copy, failing ``isinstance``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def reduce(obj: Any, generic: Callable[[Any], tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    base = sys.modules.get("plotly.basedatatypes")
    if base is None or not isinstance(obj, base.BaseFigure):
        return None
    rv = generic(obj)
    if rv is None:
        rv = obj.__reduce__()
    if rv[0] is type(obj):
        rv = (_importable_class(type(obj)), *rv[1:])
    return rv


def _importable_class(cls: type) -> type:
    """The first class in ``cls``'s MRO that its module names (anywidget gives every
    ``FigureWidget`` instance a class of its own, which would be pickled by value)."""
    for base in cls.__mro__:
        module = sys.modules.get(base.__module__)
        if module is not None and getattr(module, base.__qualname__, None) is base:
            return base
    return cls
