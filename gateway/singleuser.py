"""The single-user server's side of a shared gateway: kernels that outlive the user's server.

Set in a JupyterHub single-user server (or any jupyter_server) that runs its kernels at the
gateway::

    c.ServerApp.kernel_manager_class = "gateway.singleuser.ElasticGatewayMappingKernelManager"
    c.ServerApp.session_manager_class = "gateway.singleuser.ElasticGatewaySessionManager"
    c.SessionManager.database_filepath = "/home/<user>/.jupyter/elastic-sessions.db"
    c.ServerApp.kernel_websocket_connection_class = (
        "gateway.singleuser.ElasticGatewayWebSocketConnection"
    )

jupyter_server's stock gateway managers only know the kernels this process started: after the
user's server restarts, the first ``GET /api/sessions`` takes every remote kernel for culled and
deletes its session, so the notebook would get a new, empty kernel. And a stopping server shuts
down every kernel it knows, so the kernels would not outlive it. These two classes fix both:

- a kernel id the gateway still has (running or hibernated) is adopted on first sight, so the
  notebook's persisted session keeps its kernel and the next cell resumes it;
- a stopping server leaves its kernels at the gateway, where the admin's cull policy
  hibernates them (``shutdown_kernels_on_stop`` restores the stock behaviour).

The websocket connection class is for speed only: the stock one relays each of a cell's small
frames with Nagle's algorithm on (both hops), which costs a delayed ACK (~40 ms) per cell.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from jupyter_server.gateway.connections import GatewayWebSocketConnection
from jupyter_server.gateway.gateway_client import gateway_request
from jupyter_server.gateway.managers import GatewayMappingKernelManager, GatewaySessionManager
from tornado import web
from tornado.escape import json_decode
from traitlets import Bool

from kernelmgr import compat
from kernelmgr.server.errors import gateway_refusal


class ElasticGatewayMappingKernelManager(GatewayMappingKernelManager):
    """Knows every kernel the gateway holds for this user, not only those this process started."""

    shutdown_kernels_on_stop = Bool(
        False,
        config=True,
        help="""Shut the user's gateway kernels down when this server stops. Off: they stay at the
        gateway (and are hibernated by its cull policy), and come back when the user does.""",
    )

    async def adopt(self, kernel_id: str) -> bool:
        """Track a kernel the gateway has for this user; ``False`` if the gateway does not have it."""
        if kernel_id in compat.kernels(self):
            return True
        km = self.kernel_manager_factory(parent=self, log=self.log)
        # With an id, the stock manager only fetches the kernel's model (None: a 404), starting nothing.
        await km.start_kernel(kernel_id=kernel_id)
        if km.kernel is None:
            return False
        compat.kernels(self)[kernel_id] = km
        self.log.info("Kernel %s at the gateway adopted (%s)", kernel_id, km.kernel.get("execution_state"))
        return True

    async def start_kernel(self, **kwargs: Any) -> str:  # type: ignore[override]
        """The stock start, with the gateway's refusal (quota, size, capacity) said in its own words."""
        try:
            kernel_id: str = await super().start_kernel(**kwargs)
        except web.HTTPError as err:
            refusal = gateway_refusal(err)
            if refusal is None:
                raise
            raise refusal from err
        return kernel_id

    async def list_kernels(self, **kwargs: Any) -> list[dict[str, Any]]:
        """The gateway's list is this user's kernels: adopt those this process does not know yet."""
        response = await gateway_request(self.kernels_url, method="GET")
        for model in json_decode(response.body):
            if model["id"] not in compat.kernels(self):
                await self.adopt(model["id"])
        models: list[dict[str, Any]] = await super().list_kernels(**kwargs)
        return models

    async def shutdown_all(self, now: bool = False) -> None:  # type: ignore[override]
        if self.shutdown_kernels_on_stop:
            await super().shutdown_all(now=now)
            return
        kernels = compat.kernels(self)
        if kernels:
            self.log.info("Leaving %d kernel(s) at the gateway: they outlive this server", len(kernels))
        kernels.clear()


class ElasticGatewaySessionManager(GatewaySessionManager):
    """A session's kernel counts as culled only when the gateway no longer has it."""

    async def kernel_culled(self, kernel_id: str) -> bool:
        km = self.kernel_manager
        if kernel_id in km:
            return False
        if isinstance(km, ElasticGatewayMappingKernelManager):
            return not await km.adopt(kernel_id)
        return bool(await super().kernel_culled(kernel_id))


def _no_delay(stream: Any) -> None:
    sock = getattr(stream, "socket", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ElasticGatewayWebSocketConnection(GatewayWebSocketConnection):
    """The stock relay to the gateway with Nagle's algorithm off on both of its websockets.

    A cell's answer is several small frames (busy, reply, idle); with Nagle on, each after the
    first waits for the peer's delayed ACK. Tornado turns Nagle back on for a server websocket
    after its handshake, so this runs once the notebook's websocket is up (``connect``) and once
    the websocket to the gateway is (``_connection_done``), on the streams they detached.
    """

    async def connect(self) -> None:
        await super().connect()
        _no_delay(getattr(getattr(self.websocket_handler, "ws_connection", None), "stream", None))

    def _connection_done(self, fut: Any) -> None:
        super()._connection_done(fut)
        _no_delay(getattr(getattr(self.ws, "protocol", None), "stream", None))
