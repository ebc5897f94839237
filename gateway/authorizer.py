"""What a gateway user may do beyond their own kernels: operations on the whole gateway are the admins'.

jupyter_server asks its ``Authorizer`` before every ``@authorized`` handler method, naming a
resource (``server``, ``events``, ``api``, ``kernels``, ...) and an action (``read``, ``write``,
``execute``). Ownership of kernels is :class:`gateway.access.GatewayAccess`'s (404 for another
user's kernel); this authorizer keeps what acts on every user at once for the gateway's admins
(:meth:`GatewayAccess.is_admin`):

- ``server``: ``POST /api/shutdown`` (it ends every user's kernels);
- ``events``, ``write``: ``POST /api/events`` (a forged lifecycle event names any kernel);
- ``api`` on ``/api/status``: kernel and connection counts of the whole gateway;
- ``sessions``: nobody; the gateway keeps no notebook sessions, and a session's kernel would start
  outside the per-user start path (its owner and quota).

A refusal answers 403 with a message that says what is admin-only. Subscribing to events stays
open to users: :class:`kernelmgr.server.events.OwnEventsWebsocket` sends them only their own
kernels' events. Installed by ``jupyter elastic-gateway`` in JupyterHub mode.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.auth.authorizer import Authorizer
from jupyter_server.auth.identity import User
from jupyter_server.services.api.handlers import APIStatusHandler, IdentityHandler

from gateway.access import GatewayAccess
from kernelmgr.server.errors import http_error
from kernelmgr.server.ownership import SETTINGS_KEY

ADMIN_ONLY = "is for the gateway's admins only (ElasticGateway.admin_users, admin_groups or Hub admins)"


class GatewayAuthorizer(Authorizer):
    """Users act on their own kernels; what reaches every user's is for admins."""

    def is_authorized(self, handler: Any, user: User, action: str, resource: str) -> bool:
        access = handler.settings.get(SETTINGS_KEY)
        if not isinstance(access, GatewayAccess):
            return True  # single-tenant: the token's holder is the admin
        why = refusal(handler, action, resource, access.is_admin(user.username))
        if why is None:
            return True
        self.log.warning("elastic-gateway: refused %s on %s to %s: %s", action, resource, user.username, why)
        if _serving(handler, resource):
            # The request itself: say why (the decorator's own 403 only names the resource).
            raise http_error(403, why)
        return False  # a permissions query (/api/me?permissions=...): just "no"


def refusal(handler: Any, action: str, resource: str, admin: bool) -> str | None:
    """Why ``action`` on ``resource`` is refused, or ``None``."""
    if resource == "sessions":
        return (
            "the gateway keeps no notebook sessions: start a kernel with POST /api/kernels "
            "(your Jupyter server does that for your notebooks)"
        )
    if admin:
        return None
    if resource == "server":
        return f"shutting the gateway down {ADMIN_ONLY}"
    if resource == "events" and action == "write":
        return f"posting events {ADMIN_ONLY}; kernel lifecycle events come from the gateway itself"
    if resource == "api" and isinstance(handler, APIStatusHandler):
        return f"the gateway's status (all users' kernels and connections) {ADMIN_ONLY}; yours: /api/kernels"
    return None


def _serving(handler: Any, resource: str) -> bool:
    """Whether the check is the one guarding ``handler``'s own request."""
    return getattr(handler, "auth_resource", None) == resource and not isinstance(handler, IdentityHandler)
