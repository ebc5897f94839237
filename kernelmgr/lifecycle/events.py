"""jupyter_events for the elastic lifecycle (hibernate, resume, warn, remove, lost).

Registered in the ServerApp's event logger beside jupyter_server's own ``kernel_actions``
schema, so whatever an operator already collects from jupyter_server picks these up too.
Only the logger object is used here (no jupyter_server import); who may subscribe to which
events is the server's business (:mod:`kernelmgr.server.events`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Called with (action, kernel id, message, fields) for every event, logger or not (the Kubernetes
#: Events on kernel pods, :mod:`kernelmgr.kube.events`). Must not block; an exception is dropped.
Listener = Callable[[str, str, str, dict[str, Any]], None]

SCHEMA_ID = "https://events.jupyter.org/jupyter_elastic_kernels/kernel_lifecycle/v1"
SCHEMA_PATH = Path(__file__).parent / "event_schemas" / "kernel_lifecycle" / "v1.yaml"


class LifecycleEvents:
    """Emits lifecycle events, or does nothing when there is no event logger."""

    def __init__(self, event_logger: Any | None) -> None:
        self.logger = event_logger
        self.listeners: list[Listener] = []
        if event_logger is not None:
            event_logger.register_event_schema(SCHEMA_PATH)

    def emit(self, action: str, kernel_id: str, msg: str, **fields: Any) -> None:
        present = {key: value for key, value in fields.items() if value is not None}
        for listener in list(self.listeners):
            try:
                listener(action, kernel_id, msg, present)
            except Exception:
                continue
        if self.logger is None:
            return
        data = {"action": action, "kernel_id": kernel_id, "msg": msg, **present}
        self.logger.emit(schema_id=SCHEMA_ID, data=data)
