"""ipywidgets: a widget is saved as its synced trait values and built again from them.

A live widget holds a comm (with a thread lock) and cannot be pickled at all. What defines
it is its *state*: its public traits, synced or not (a dropdown's ``options`` and ``value``
live only in Python), except the comm and read-only ones, plus ``_dom_classes`` (the
user's CSS classes); private traits such as ``_model_name`` or ``_options_labels`` are set
by the class or derived. That covers value, bounds, description, layout and style
(themselves widgets, saved the same way, so a layout shared by two widgets stays shared)
and the children of a box.

On restore the widget is constructed again with those values and with its **old model
id**, so the comm it opens carries the same id: a notebook page still showing the widget
finds its model again when the kernel sends it (the view reconnects); with no frontend the
comm goes nowhere, as for any widget created then. What is not kept: observers added with
``observe``/``on_click`` (Python callbacks the widget does not own as state) and traits
that are not synced.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

#: Public traits of every widget that are machinery, not state.
_NOT_STATE = frozenset({"comm", "keys", "log"})


def reduce(obj: Any, generic: Callable[[Any], tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    widgets = sys.modules.get("ipywidgets")
    if widgets is None or not isinstance(obj, widgets.Widget):
        return None
    state = {
        key: getattr(obj, key)
        for key, trait in obj.traits().items()
        if (not key.startswith("_") or key == "_dom_classes")
        and key not in _NOT_STATE
        and not getattr(trait, "read_only", False)
    }
    model_id = obj._model_id if obj.comm is not None else None
    return (rebuild_widget, (type(obj), model_id), state, None, None, set_widget_state)


def rebuild_widget(cls: Any, model_id: str | None) -> Any:
    """An empty widget of ``cls``, not yet opened (its state is set before the comm opens)."""
    widget = cls.__new__(cls)
    widget._elastic_model_id = model_id
    return widget


def set_widget_state(widget: Any, state: dict[str, Any]) -> Any:
    """Run the widget's constructor with the saved state: traits set, then the comm opened."""
    model_id = widget.__dict__.pop("_elastic_model_id", None)
    options = {key: state[key] for key in _ordered(state)}
    if model_id is not None:
        options["model_id"] = model_id
    type(widget).__init__(widget, **options)
    return widget


def _ordered(state: dict[str, Any]) -> list[str]:
    """Options before what depends on them (a selection's ``index``/``value``/``label``)."""
    first = [key for key in ("options", "min", "max") if key in state]
    return first + [key for key in state if key not in first]
