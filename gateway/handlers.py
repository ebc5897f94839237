"""``/api/kernels`` and ``/api/kernelspecs`` for many users: jupyter_server's handlers, guarded.

The gateway serves jupyter_server's own kernel and kernelspec handlers (what ``GatewayClient``
speaks), each behind the same rule: a kernel id of another user answers 404, lists hold only the
user's kernels and the GPU sizes offered to them, and a start over quota answers 403 saying
which limit and what is held. Loaded as an ``extra_services`` module in place of the
``kernels`` and ``kernelspecs`` services; it also replaces jupyter_server's shutdown (JSON
errors), event subscription (each user's own kernels' events) and ``/metrics`` (admins and the
Prometheus scrape token) handlers.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

import prometheus_client
from jupyter_server.auth.decorator import allow_unauthenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.kernelspecs.handlers import KernelSpecResourceHandler
from jupyter_server.services import shutdown
from jupyter_server.services.kernels import handlers as kernel_handlers
from jupyter_server.services.kernels.websocket import KernelWebsocketHandler
from jupyter_server.services.kernelspecs import handlers as spec_handlers
from jupyter_server.utils import ensure_async
from tornado import web

from gateway.access import GatewayAccess
from gateway.hub_ids import IdentityRefused, IdentityUnknownYet
from kernelmgr import compat
from kernelmgr.core.kernels import requesting_owner
from kernelmgr.server.errors import http_error, no_such_kernel
from kernelmgr.server.events import OwnEventsWebsocket
from kernelmgr.server.kernelspecs import ElasticKernelSpecManager
from kernelmgr.server.ownership import SETTINGS_KEY, access_of


def _access(handler: Any) -> GatewayAccess | None:
    access = handler.settings.get(SETTINGS_KEY)
    return access if isinstance(access, GatewayAccess) else None


def _profile_of(handler: Any, kernel_name: str) -> str | None:
    ksm = handler.kernel_spec_manager
    if not isinstance(ksm, ElasticKernelSpecManager):
        return None
    try:
        return ksm.profile_of(kernel_name)
    except Exception:  # unknown kernelspec: the start itself answers 404 with the list
        return None


class _Guarded:
    """Mixin: 404 for a kernel id the user may not see, before any method runs."""

    def check_kernel_access(self: Any) -> None:
        kernel_id = self.path_kwargs.get("kernel_id")
        if kernel_id and self.current_user and not access_of(self.settings).may_access(self, kernel_id):
            raise no_such_kernel(kernel_id)


def _client_env(raw: Any) -> dict[str, Any]:
    """The start's ``env`` argument from a request's ``env``: its ``KERNEL_*`` names (Enterprise
    Gateway's convention) over the server's own environment, as a local kernel inherits it."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise http_error(
            400, 'env must be an object of names to strings, e.g. {"KERNEL_WORKING_DIR": "/home/me"}'
        )
    chosen = {k: v for k, v in raw.items() if k.startswith("KERNEL_")}
    return {"env": {**os.environ, **chosen}} if chosen else {}


class MainKernelHandler(kernel_handlers.MainKernelHandler):
    @web.authenticated
    async def get(self) -> None:
        access = access_of(self.settings)
        kernels = await ensure_async(self.kernel_manager.list_kernels())
        kernels = [k for k in kernels if access.may_access(self, k["id"])]
        self.finish(json.dumps(kernels, default=kernel_handlers.json_default))

    @web.authenticated
    async def post(self) -> None:
        """Start a kernel of the user's, within their quota. Of the ``env`` GatewayClient sends, the
        ``KERNEL_*`` names reach the provisioner (``KERNEL_WORKING_DIR``: the notebook's folder)."""
        try:
            model = self.get_json_body() or {}
        except web.HTTPError:
            raise http_error(400, 'the body must be JSON, e.g. {"name": "<kernelspec>"}') from None
        if not isinstance(model, dict):
            raise http_error(400, 'the body must be a JSON object such as {"name": "<kernelspec>"}')
        if model.get("kernel_id") is not None:
            raise http_error(400, "kernel_id cannot be chosen when starting a kernel at the gateway")
        km: Any = self.kernel_manager
        name = model.get("name") or km.default_kernel_name
        if not isinstance(name, str):
            raise http_error(400, "name must be a kernelspec name (a string); list them at /api/kernelspecs")
        options = _client_env(model.get("env"))
        access = _access(self)
        if access is None:  # single-tenant: the server's own user owns every kernel
            kernel_id: str = await km.start_kernel(kernel_name=name, **options)
        else:
            owner = self.current_user.username
            await _check_owner_ids(access, owner)
            token = requesting_owner.set(owner)
            try:
                # The id is chosen first, so the quota counts this start exactly once while it runs.
                kernel_id = km.new_kernel_id()
                with access.reserve_start(owner, _profile_of(self, name), kernel_id):
                    kernel_id = await km.start_kernel(kernel_name=name, kernel_id=kernel_id, **options)
                    if access.runtime.kernels.get(kernel_id) is None:
                        access.started_by[kernel_id] = owner  # a kernel without a GPU size
            finally:
                requesting_owner.reset(token)
        model = await ensure_async(km.kernel_model(kernel_id))
        self.set_header("Location", self.base_url.rstrip("/") + f"/api/kernels/{kernel_id}")
        self.set_status(201)
        self.finish(json.dumps(model, default=kernel_handlers.json_default))


async def _check_owner_ids(access: GatewayAccess, owner: str) -> None:
    """403 saying what the admin must fix when the user's uid cannot be known (their auth state
    lacks it), 503 while the Hub cannot be asked for a uid never read, before anything is reserved;
    the pod's start asks again (cached)."""
    source = access.runtime.owner_ids
    kube = access.runtime.kube
    if source is None or (kube is not None and owner in kube.settings.user_ids):
        return  # the admin's user_ids wins where it names the user
    try:
        await source.ids_of(owner)
    except IdentityUnknownYet as exc:
        raise http_error(503, f"your kernels cannot start now: {exc.message}") from None
    except IdentityRefused as exc:
        raise http_error(403, f"your kernels cannot start: {exc.message}") from None


class KernelHandler(_Guarded, kernel_handlers.KernelHandler):
    async def prepare(self) -> None:  # type: ignore[override]
        await super().prepare()
        self.check_kernel_access()

    @web.authenticated
    async def delete(self, kernel_id: str) -> None:
        await super().delete(kernel_id)  # type: ignore[misc]
        access = _access(self)
        if access is not None:
            access.forget(kernel_id)


class KernelActionHandler(_Guarded, kernel_handlers.KernelActionHandler):
    async def prepare(self) -> None:  # type: ignore[override]
        await super().prepare()
        self.check_kernel_access()


class GuardedKernelWebsocketHandler(_Guarded, KernelWebsocketHandler):
    async def pre_get(self) -> None:
        await super().pre_get()
        self.check_kernel_access()


class MainKernelSpecHandler(spec_handlers.MainKernelSpecHandler):
    """The kernelspec list, holding only the GPU sizes offered to the user."""

    def finish(self, chunk: Any = None) -> Any:
        access = _access(self)
        if access is not None and isinstance(chunk, str) and self.get_status() == 200 and self.current_user:
            model = json.loads(chunk)
            limits = access.limits_for(self.current_user.username)
            model["kernelspecs"] = {
                name: spec
                for name, spec in model.get("kernelspecs", {}).items()
                if limits.allows_profile(_spec_profile(spec))
            }
            chunk = json.dumps(model)
        return super().finish(chunk)


class KernelSpecHandler(spec_handlers.KernelSpecHandler):
    async def prepare(self) -> None:  # type: ignore[override]
        await super().prepare()
        access = _access(self)
        name = self.path_kwargs.get("kernel_name")
        if access is not None and name and self.current_user:
            profile = _profile_of(self, name)
            if not access.limits_for(self.current_user.username).allows_profile(profile):
                raise http_error(404, f"no kernelspec named {name!r} is offered to you")


def _spec_profile(spec: dict[str, Any]) -> str | None:
    elastic = ((spec.get("spec") or {}).get("metadata") or {}).get("elastic") or {}
    profile = elastic.get("profile")
    return str(profile) if profile else None


class ShutdownHandler(APIHandler, shutdown.ShutdownHandler):
    """jupyter_server's ``POST /api/shutdown`` (admins only: the authorizer), with JSON errors."""

    auth_resource = shutdown.AUTH_RESOURCE


class MetricsHandler(JupyterHandler):
    """``/metrics``: for the gateway's admins, and for Prometheus with the scrape token.

    The series are gateway-wide (kernels by state and size, slices, request timings): not for
    every user. Prometheus sends ``Authorization: Bearer <ElasticGateway.metrics_token>``;
    ``ServerApp.authenticate_prometheus = False`` opens it to anyone who reaches the port.
    """

    @allow_unauthenticated
    def get(self) -> None:
        why = self._refusal()
        if why is not None:
            self.set_status(403)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": why}))
            return
        self.set_header("Content-Type", prometheus_client.CONTENT_TYPE_LATEST)
        self.finish(prometheus_client.generate_latest(prometheus_client.REGISTRY))

    def _refusal(self) -> str | None:
        if not self.settings.get("authenticate_prometheus", True):
            return None
        token = str(getattr(getattr(self.serverapp, "gateway_settings", None), "metrics_token", "") or "")
        given = self.request.headers.get("Authorization", "")
        if token and hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return None
        user = self.current_user
        access = _access(self)
        if user is not None and (access is None or access.is_admin(user.username)):
            return None
        return (
            "/metrics is for the gateway's admins and for Prometheus with the scrape token "
            "(Authorization: Bearer <ElasticGateway.metrics_token>)"
        )


_KERNEL, _ACTION = compat.kernel_id_patterns()

default_handlers = [
    (r"/api/kernels", MainKernelHandler),
    (rf"/api/kernels/{_KERNEL}", KernelHandler),
    (rf"/api/kernels/{_KERNEL}/{_ACTION}", KernelActionHandler),
    (rf"/api/kernels/{_KERNEL}/channels", GuardedKernelWebsocketHandler),
    (r"/api/kernelspecs", MainKernelSpecHandler),
    (rf"/api/kernelspecs/{spec_handlers.kernel_name_regex}", KernelSpecHandler),
    (rf"/kernelspecs/{spec_handlers.kernel_name_regex}/(?P<path>.*)", KernelSpecResourceHandler),
    # In place of jupyter_server's own (extra services match first):
    (r"/api/shutdown", ShutdownHandler),
    (r"/api/events/subscribe", OwnEventsWebsocket),
    (r"/metrics", MetricsHandler),
]
