"""Who receives the lifecycle events (:mod:`kernelmgr.lifecycle.events`) in a shared server:
a subscriber gets only the events of kernels they may access."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from jupyter_server.services.events.handlers import SubscribeWebsocket

from kernelmgr.server.ownership import access_of


class OwnEventsWebsocket(SubscribeWebsocket):
    """``/api/events/subscribe`` for a shared server: a user receives their own kernels' events only.

    jupyter_server's stream sends every event to every subscriber. Here an admin
    (``KernelAccess.is_admin_request``) still gets all of them; anyone else only events that name a
    kernel they may access (``kernel_id``), decided when the event is emitted, while the kernel's
    owner is still known (a removed kernel's last events arrive after its record is gone, so the
    kernels once seen as the user's are remembered for the socket's life).
    """

    _everything = False

    def open(self) -> None:
        access = access_of(self.settings)
        self._everything = access.is_admin_request(self)
        self._mine: set[str] = set()
        if not self._everything:
            self._mine.update(k for k in self.kernel_manager.list_kernel_ids() if access.may_access(self, k))
        super().open()

    def event_listener(self, logger: Any, schema_id: str, data: dict[str, Any]) -> Coroutine[Any, Any, None]:
        """Called by the event logger as the event is emitted; returns the delivery to schedule."""
        if self._everything or self._may_see(data):
            return super().event_listener(logger, schema_id, data)
        return _nothing()

    def _may_see(self, data: dict[str, Any]) -> bool:
        kernel_id = data.get("kernel_id")
        if not isinstance(kernel_id, str):
            return False  # not about one kernel: gateway-wide, for admins
        if kernel_id in self._mine:
            return True
        if access_of(self.settings).may_access(self, kernel_id):
            self._mine.add(kernel_id)
            return True
        return False


async def _nothing() -> None:
    """The delivery of an event this subscriber does not receive."""
