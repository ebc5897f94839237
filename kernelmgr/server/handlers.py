"""REST handlers under ``/api/elastic``.

Thin: each reads the runtime or the kernel manager and writes a model from
:mod:`kernelmgr.server.models`. Authentication and authorization are jupyter_server's
(``kernels`` resource), so the same tokens and the same JupyterHub scopes apply.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_server.auth.decorator import allow_unauthenticated, authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.services.sessions.handlers import SessionRootHandler
from tornado import web

from kernelmgr.checkpoint.version import agent_info
from kernelmgr.config import ElasticRuntime
from kernelmgr.server.errors import gateway_refusal, http_error, no_such_kernel
from kernelmgr.server.kernelmanager import ElasticMappingKernelManager
from kernelmgr.server.kernelspecs import ElasticKernelSpecManager
from kernelmgr.server.models import (
    add_device_activity,
    gpus_model,
    profiles_model,
    queue_model,
    storage_model,
)
from kernelmgr.server.ownership import access_of
from kernelmgr.server.resize import resize_kernel, size_from_body

AUTH_RESOURCE = "kernels"
_KERNEL_ID = r"(?P<kernel_id>[\w-]+)"


class ElasticHandler(APIHandler):
    """Base: access to the runtime and JSON output."""

    auth_resource = AUTH_RESOURCE

    @property
    def runtime(self) -> ElasticRuntime:
        runtime = self.settings.get("elastic_runtime")
        if not isinstance(runtime, ElasticRuntime):
            raise http_error(503, "the kernelmgr extension is not loaded")
        return runtime

    @property
    def elastic_kernel_manager(self) -> ElasticMappingKernelManager:
        km = self.kernel_manager
        if not isinstance(km, ElasticMappingKernelManager):
            raise http_error(503, "the kernelmgr extension's kernel manager is not installed")
        return km

    def write_json(self, payload: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(payload))

    async def prepare(self) -> None:  # type: ignore[override]
        """Another user's kernel id answers 404 on every path, as an unknown id does."""
        await super().prepare()
        kernel_id = self.path_kwargs.get("kernel_id")
        if kernel_id and self.current_user and not access_of(self.settings).may_access(self, kernel_id):
            raise no_such_kernel(kernel_id)


class ProfilesHandler(ElasticHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        ksm = self.kernel_spec_manager
        names = ksm.elastic_kernel_names() if isinstance(ksm, ElasticKernelSpecManager) else {}
        self.write_json(profiles_model(self.runtime, names))


class GpusHandler(ElasticHandler):
    """The inventory. An admin sees every slice; a user sees their own kernels' slices (and warm
    pods'), and of other users' slices only how many there are and how much they hold."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        model = gpus_model(self.runtime)
        add_device_activity(model, self.elastic_kernel_manager.activity_of)
        access = access_of(self.settings)
        if not access.is_admin_request(self):
            for device in model["devices"]:
                shown = [s for s in device["slices"] if s["warm"] or access.may_access(self, s["kernel_id"])]
                hidden = [s for s in device["slices"] if s not in shown]
                device["slices"] = shown
                device["other_users"] = {
                    "slices": len(hidden),
                    "fraction": sum(s["fraction"] for s in hidden),
                    "memory_mib": sum(s["memory_mib"] for s in hidden),
                }
        self.write_json(model)


class KernelsHandler(ElasticHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        access = access_of(self.settings)
        await self.elastic_kernel_manager.refresh_checkpoints()  # manifests read off the event loop
        models = self.elastic_kernel_manager.elastic_models()
        self.write_json([model for model in models if access.may_access(self, model["id"])])


class KernelHandler(ElasticHandler):
    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        if kernel_id in self.elastic_kernel_manager:
            await self.elastic_kernel_manager.refresh_checkpoints([kernel_id])  # off the event loop
        self.write_json(self.elastic_kernel_manager.elastic_model(kernel_id))


class PolicyHandler(ElasticHandler):
    """The effective cull policy: defaults, rules, and what applies to each GPU size."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        policy = self.settings.get("elastic_policy")
        if policy is None:
            raise http_error(503, "the kernelmgr extension is not loaded")
        runtime = self.runtime
        culler = self.elastic_kernel_manager.culler
        sampler = culler.sampler if culler is not None else None
        self.write_json(
            {
                **policy.to_dict(),
                "per_size": {name: policy.for_profile(name).to_dict() for name in runtime.profiles},
                "gpu_activity": sampler.source()
                if sampler is not None and runtime.gpus_available
                else "unavailable",
                "gpu_sample_interval": runtime.gpu_sample_interval,
                # How long a hibernation may take: clients (the CLI) wait that long, not less.
                "checkpoint_timeout": runtime.checkpoint_timeout,
                "jupyter_server_culling": {
                    "cull_idle_timeout": self.kernel_manager.cull_idle_timeout,
                    "applies_to": "non-elastic kernels only (it shuts them down); "
                    "elastic kernels follow this policy",
                },
            }
        )


class HibernateHandler(ElasticHandler):
    """Checkpoint the kernel, stop it, release its slice; 409 if it is busy or not elastic."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        self.write_json(await self.elastic_kernel_manager.hibernate(kernel_id, "api"))


class ReportHandler(ElasticHandler):
    """The last restore report the kernel's agent wrote (kept on disk, so it outlives restarts)."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        self.write_json(await self.elastic_kernel_manager.elastic_report(kernel_id))


class ResumeHandler(ElasticHandler):
    """Bring a hibernated kernel back now (the next execute would do it anyway)."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        self.write_json(await self.elastic_kernel_manager.resume(kernel_id, "api"))


class ResizeHandler(ElasticHandler):
    """Change the GPU size: hibernate, then resume at ``{"size": ...}`` when it fits."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        size = size_from_body(self.get_json_body(), sorted(self.runtime.profiles))
        self.write_json(await resize_kernel(self.elastic_kernel_manager, kernel_id, size))


class CancelHandler(ElasticHandler):
    """Stop a resume that is waiting for a free GPU slice; the kernel stays hibernated."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        self.write_json(await self.elastic_kernel_manager.cancel_wait(kernel_id))


class ActivityHandler(ElasticHandler):
    """ "Keep running": counts as activity and cancels the idle warning (JupyterLab's button)."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        self.write_json(self.elastic_kernel_manager.keep_running(kernel_id))


class QueueHandler(ElasticHandler):
    """The kernels waiting for a GPU slice: all for an admin, a user's own otherwise."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        admin = access_of(self.settings).is_admin_request(self)
        user = getattr(self.current_user, "username", None)
        self.write_json(queue_model(self.runtime, user, admin))


class StorageHandler(ElasticHandler):
    """Checkpoint storage: a user's checkpoints against their quota (an admin's: every owner's,
    and the volume's free space), oldest first, for choosing what to discard."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        access = access_of(self.settings)
        admin = access.is_admin_request(self)
        km = self.elastic_kernel_manager
        if km.hibernator is None:
            raise http_error(503, "the kernelmgr extension is not loaded")
        runtime = self.runtime
        owners = {r.owner for r in runtime.kernels.all() if access.may_access(self, r.kernel_id)}
        mine = access.owner_of_request(self, runtime.owner)
        owners |= {mine} if mine else set()
        records = km.hibernator.records

        def hibernated_at(kernel_id: str) -> float | None:
            record = records.get(kernel_id)
            return record.hibernated_at if record is not None else None

        model = await asyncio.to_thread(
            storage_model, runtime, km.hibernator.space, sorted(owners), hibernated_at, admin
        )
        self.write_json(model)


class MeHandler(ElasticHandler):
    """Who is asking: whether they are an admin, and (for admins) the GPU-hours hibernation released.

    JupyterLab's GPUs panel shows every GPU only to admins. One user's server: its user is the admin.
    """

    @web.authenticated
    @authorized
    async def get(self) -> None:
        admin = access_of(self.settings).is_admin_request(self)
        user = self.current_user
        km = self.elastic_kernel_manager
        tally = km.hibernator.released if admin and km.hibernator is not None else None
        released = tally.totals() if tally is not None else None
        self.write_json(
            {
                "user": getattr(user, "username", None),
                "admin": admin,
                "gpu_hours_released": {size: seconds / 3600 for size, seconds in released.items()}
                if released is not None
                else None,
                # The trend: the share of a GPU held by no one right now because its kernels sleep.
                "gpus_released_now": tally.releasing_now() if tally is not None else None,
            }
        )


class VersionHandler(ElasticHandler):
    """This server's package version and checkpoint format (what it accepts of a kernel's agent,
    :mod:`kernelmgr.checkpoint.version`), for ``python -m kernelmgr.image_check --gateway URL`` in a
    kernel image (the chart's ``helm test``). Open like jupyter_server's ``/api``: versions only."""

    @allow_unauthenticated
    async def get(self) -> None:
        self.write_json(agent_info())


class LeaderHandler(ElasticHandler):
    """``GET /api/elastic/leader``: 200 when this gateway serves kernels (it holds the Lease and took
    the kernels over, or it is the only gateway), else 503 saying who does. The readiness probe of a
    gateway with replicas (the Service then sends kernel traffic to the leader only); open like
    ``/api``: it tells only which gateway pod leads."""

    @allow_unauthenticated
    async def get(self) -> None:
        runtime = self.settings.get("elastic_runtime")
        leader = runtime.leader if isinstance(runtime, ElasticRuntime) else None
        if leader is None:
            self.write_json({"leader": True, "identity": None})
            return
        if not leader.ready():
            self.set_status(503)
            holder = leader.holder()
            self.write_json(
                {
                    "message": f"standby: the Lease {leader.namespace}/{leader.name} is held by "
                    f"{holder or 'nobody yet'}",
                    "leader": False,
                    "identity": leader.identity,
                    "holder": holder,
                }
            )
            return
        self.write_json({"leader": True, "identity": leader.identity})


class SessionsPreflightHandler(SessionRootHandler):
    """``POST /api/sessions`` with the GPU-size check done first.

    jupyter_server's sessions handler turns every error from starting a kernel into a 500;
    checking the size before delegating gives notebook users the same 4xx message as
    ``POST /api/kernels``. Everything else is jupyter_server's own handler.
    """

    @web.authenticated
    @authorized
    async def post(self) -> None:
        model = self.get_json_body() or {}
        kernel = model.get("kernel") or {}
        name = kernel.get("name")
        path = model.get("path")
        km = self.kernel_manager
        if name and not kernel.get("id") and isinstance(km, ElasticMappingKernelManager):
            exists = path is not None and await self.session_manager.session_exists(path=path)
            if not exists:
                try:
                    km.check_size(name)
                except web.HTTPError as err:
                    if err.status_code != 404:  # unknown kernelspecs keep jupyter_server's answer
                        raise
        delegated = super().post()
        if delegated is not None:
            await delegated


class GatewaySessionsHandler(SessionRootHandler):
    """``POST /api/sessions`` in a server whose kernels run at a gateway: the gateway's 4xx stays.

    jupyter_server answers 500 for any error while starting a session's kernel; a gateway that
    refuses a start (over quota, a GPU size not offered) answers 403 or 409 with a message for the
    user, and the notebook should show that message with that status, not a server error.
    """

    @web.authenticated
    @authorized
    async def post(self) -> None:
        try:
            delegated = super().post()
            if delegated is not None:
                await delegated
        except web.HTTPError as err:
            cause = err.__cause__
            if err.status_code == 500 and isinstance(cause, web.HTTPError) and 400 <= cause.status_code < 500:
                # GatewayClient's error ("Error from Gateway: [%s] %s...") or the singleuser
                # manager's translation of it: the gateway's own message, with its status.
                refusal = gateway_refusal(cause)
                if refusal is not None:
                    raise refusal from None
                message = str(cause.args[0]) if cause.args else str(cause.log_message)
                raise http_error(cause.status_code, message) from None
            raise


def gateway_mode_handlers() -> list[tuple[str, type[APIHandler]]]:
    """What the extension serves in a server whose kernels run at a gateway."""
    return [(r"/api/sessions", GatewaySessionsHandler)]


def elastic_handlers() -> list[tuple[str, type[APIHandler]]]:
    """Routes, relative to the server's base URL."""
    return [
        (r"/api/elastic/profiles", ProfilesHandler),
        (r"/api/elastic/gpus", GpusHandler),
        (r"/api/elastic/kernels", KernelsHandler),
        (rf"/api/elastic/kernels/{_KERNEL_ID}", KernelHandler),
        (rf"/api/elastic/kernels/{_KERNEL_ID}/hibernate", HibernateHandler),
        (r"/api/elastic/policy", PolicyHandler),
        (rf"/api/elastic/kernels/{_KERNEL_ID}/resume", ResumeHandler),
        (rf"/api/elastic/kernels/{_KERNEL_ID}/report", ReportHandler),
        (rf"/api/elastic/kernels/{_KERNEL_ID}/cancel", CancelHandler),
        (rf"/api/elastic/kernels/{_KERNEL_ID}/resize", ResizeHandler),
        (r"/api/sessions", SessionsPreflightHandler),
        (rf"/api/elastic/kernels/{_KERNEL_ID}/activity", ActivityHandler),
        (r"/api/elastic/me", MeHandler),
        (r"/api/elastic/storage", StorageHandler),
        (r"/api/elastic/queue", QueueHandler),
        (r"/api/elastic/version", VersionHandler),
        (r"/api/elastic/leader", LeaderHandler),
    ]
