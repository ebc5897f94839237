"""``/api/elastic/*`` in a server whose kernels run at a gateway: relayed to the gateway.

In a JupyterHub deployment the user's own server runs JupyterLab, and its kernels live at the
shared gateway (``GatewayClient.url``). The JupyterLab extension asks the server it was loaded
from for ``/api/elastic/kernels``, ``/me`` and the rest; without this relay those answer 404 there,
and the status bar, idle warnings, restore reports and GPUs panel show nothing in the very
deployment where GPUs are shared.

The relay forwards the request (method, path below ``/api/elastic``, query, JSON body) with the
server's own gateway credentials (``GatewayClient``'s auth header: in the example Hub
configuration the server's Hub token, which the gateway maps to the user). So a user sees
exactly what the gateway shows that user, and the gateway keeps deciding ownership and quotas;
the user's server adds only its own authentication (the ``kernels`` resource, as the kernels API).
The gateway's status and JSON body come back unchanged: its 4xx messages are written for the user.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from kernelmgr.server.errors import http_error

#: Only what ``/api/elastic`` serves; anything else is no business of the relay.
_RELAYED_PATH = r"/api/elastic(?P<rest>(?:/[\w.-]+)*)"


class GatewayElasticRelayHandler(APIHandler):
    """Relays ``GET``/``POST /api/elastic/...`` to the gateway as this server's user."""

    auth_resource = "kernels"

    @web.authenticated
    @authorized
    async def get(self, rest: str = "") -> None:
        await self._relay("GET", rest)

    @web.authenticated
    @authorized
    async def post(self, rest: str = "") -> None:
        await self._relay("POST", rest)

    async def _relay(self, method: str, rest: str) -> None:
        gateway = GatewayClient.instance()
        url = url_path_join(gateway.url or "", "api/elastic", rest)
        if self.request.query:
            url = f"{url}?{self.request.query}"
        options: dict[str, Any] = {"method": method, "raise_error": False}
        if method == "POST":
            options["body"] = self.request.body or b"{}"
            options["headers"] = {"Content-Type": "application/json"}
        options = gateway.load_connection_args(**options)
        try:
            answer = await AsyncHTTPClient().fetch(url, **options)
        except HTTPClientError as exc:  # with raise_error=False only "no answer" (599) is raised
            raise http_error(504, f"the kernel gateway at {gateway.url} did not answer: {exc}") from None
        except OSError as exc:
            raise http_error(
                503,
                f"the kernel gateway at {gateway.url} cannot be reached ({exc}); ask your admin to check it",
            ) from None
        self.set_status(answer.code)
        self.set_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
        self.finish(answer.body or b"")


def gateway_relay_handlers() -> list[tuple[str, type[APIHandler]]]:
    """The relay's route, relative to the server's base URL."""
    return [(_RELAYED_PATH, GatewayElasticRelayHandler)]
