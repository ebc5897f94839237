"""bokeh: models (figures, renderers, data sources) through bokeh's own serialisation.

bokeh models pickle but do not unpickle: their property containers notify owners that
``__setstate__`` has not set yet (``AttributeError: ... '_owners'``). bokeh has its own
format for exactly this job, the one it sends to the browser: ``Serializer`` turns a model
and every model it references into plain data, ``Deserializer`` builds them back.

Identity is kept within a checkpoint group: the first model met in a pickle stream is
serialised with everything it references into one *graph*; every other model of that graph
met later (the renderer held in its own variable, say) is saved as "model ``id`` of that
graph", so after a restore ``fig.renderers[0] is line`` still holds. What is not kept: the
``Document`` a shown model belonged to, and Python callbacks attached with ``on_change``
(bokeh serialises only what the browser sees); a model comes back unattached, ready to be
shown again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class Graph:
    """One serialised bokeh model graph; unpickles to ``{model id: model}``."""

    __slots__ = ("buffers", "content")

    def __init__(self, content: Any, buffers: Any) -> None:
        self.content = content
        self.buffers = buffers

    def __reduce__(self) -> tuple[Any, ...]:
        return (load_graph, (self.content, self.buffers))


def load_graph(content: Any, buffers: Any) -> dict[str, Any]:
    from bokeh.core.serialization import Deserializer, Serialized

    root = Deserializer().deserialize(Serialized(content, buffers))
    return {model.id: model for model in root.references()}


def model_in(graph: dict[str, Any], model_id: str) -> Any:
    return graph[model_id]


def reduce(obj: Any, generic: Callable[[Any], tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    model_module = sys.modules.get("bokeh.model")
    if model_module is None or not isinstance(obj, model_module.Model):
        return None
    from bokeh.core.serialization import Serializer

    graphs: dict[str, Graph] = _graphs_of_current_stream()
    graph = graphs.get(obj.id)
    if graph is None:
        serialized = Serializer(deferred=False).serialize(obj)
        graph = Graph(serialized.content, serialized.buffers)
        for model in obj.references():
            graphs.setdefault(model.id, graph)
    return (model_in, (graph, obj.id))


def _graphs_of_current_stream() -> dict[str, Graph]:
    """Graphs already written in the pickle stream being produced (see ``stream_state``)."""
    from kernelmgr.checkpoint.reducers import stream_state

    state: dict[str, Graph] = stream_state().setdefault("bokeh", {})
    return state
