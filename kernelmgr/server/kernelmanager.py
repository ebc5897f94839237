"""The elastic kernel manager installed into jupyter_server.

It is jupyter_server's own ``AsyncMappingKernelManager`` (so ``/api/kernels``, sessions,
websockets, culling and restarts behave exactly as users know them) plus:

* it carries the :class:`~kernelmgr.config.ElasticRuntime` provisioners find through their ``parent`` chain;
* it checks a GPU size *before* anything is created, so a size that is unknown or does not
  fit fails at once with a 4xx JSON message naming the size, what is free and what to do —
  instead of jupyter_client logging a traceback and the user seeing a 500;
* it keeps hibernated kernels registered (no process, same id, same sessions) and knows what
  shutdown, interrupt, restart and culling mean for them;
* on server exit it hibernates idle local kernels instead of killing them and leaves kernel pods
  running for the next server (``hibernate_on_shutdown``), and on start it re-registers the
  hibernated kernels of the previous run.

Long because it is jupyter_server's one kernel manager: each verb (start, shutdown, interrupt,
restart) meets the GPU sizes, hibernation and the Lease here; what could leave did
(``starting.py``, ``waiting.py``, ``leadership.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from jupyter_client.kernelspec import NoSuchKernel
from jupyter_client.provisioning import KernelProvisionerFactory as KPF
from jupyter_core.utils import ensure_async
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager

from kernelmgr import compat
from kernelmgr.config import ElasticRuntime
from kernelmgr.core.controller import LifecycleError, LossReports
from kernelmgr.core.errors import CapacityError, UnknownProfileError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.kube import optional as kube_optional
from kernelmgr.lifecycle.records import KernelRecord
from kernelmgr.lifecycle.scheduler import DEFAULT_LIMIT
from kernelmgr.lifecycle.service import Hibernator
from kernelmgr.provisioners.accounts import AccountError
from kernelmgr.server import execution_state
from kernelmgr.server.culler import Culler
from kernelmgr.server.errors import http_error, no_such_kernel
from kernelmgr.server.kernelspecs import ElasticKernelSpecManager
from kernelmgr.server.leadership import require_lease, require_serving
from kernelmgr.server.models import elastic_kernel_model, kernel_pod_annotations
from kernelmgr.server.starting import (
    StartWithoutReadyRace,
    measured,
    raise_socket_limit,
    wait_for_start_turn,
    wait_until_up,
)
from kernelmgr.server.waiting import cancel_waiting_resume


@contextlib.contextmanager
def _answered_as_http(what: str) -> Iterator[None]:
    """A refused or failed hibernate/resume as the HTTP answer that says why.

    A Kubernetes refusal (the server's RBAC, an admission policy) is the admin's to fix: 500 with
    the rule to add, not jupyter_server's bare "Unhandled error".
    """
    try:
        yield
    except LifecycleError as exc:
        raise http_error(exc.status, exc.message) from None
    except kube_optional.refusals() as exc:
        raise http_error(500, f"could not {what}: {exc}") from None


NOT_HIBERNATED = "could not hibernate at shutdown: left running, to checkpoint itself once its cell ends"
ADOPTED = "left running in its pod for the next server to adopt"


class ElasticMappingKernelManager(AsyncMappingKernelManager):
    """jupyter_server's kernel manager with GPU sizes checked up front."""

    elastic_runtime: ElasticRuntime | None = None
    hibernator: Hibernator | None = None
    culler: Culler | None = None
    _exiting = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pinned_superclass = StartWithoutReadyRace  # no ``km.ready`` race at start (issue 34)
        raise_socket_limit(self.context, self.log)
        #: Kernels launched but not yet answering: a server stop shuts them down, never leaves them.
        self.starting_kernels: set[str] = set()

    @property
    def kernel_losses(self) -> LossReports | None:
        """Where the provisioners of these kernels report a process or pod gone unasked (found on
        their ``parent`` chain): the lifecycle's loss service, once the extension has made it."""
        return self.hibernator.loss if self.hibernator is not None else None

    def _check_kernel_id(self, kernel_id: str) -> None:
        culler = self.culler
        if culler is not None and kernel_id in culler.tombstones and kernel_id not in self:
            raise http_error(404, culler.tombstones[kernel_id])
        super()._check_kernel_id(kernel_id)

    def new_process(self, kernel_id: str) -> None:
        """The kernel has a new process (a resume: a new pod, or new ports after a bind error):
        the server's own IOPub watcher subscribes to it afresh."""
        self.stop_watching_activity(kernel_id)
        compat.set_ports(self, kernel_id, compat.kernels(self)[kernel_id].ports)
        self.start_watching_activity(kernel_id)

    def start_watching_activity(self, kernel_id: str) -> None:
        """jupyter_server's IOPub watcher, also feeding execution activity to the cull policy."""
        super().start_watching_activity(kernel_id)
        hibernator = self.hibernator
        kernel = compat.kernels(self)[kernel_id]
        stream = getattr(kernel, "_activity_stream", None)
        original = getattr(stream, "_recv_callback", None)
        if hibernator is None or stream is None or original is None:
            return
        activity = hibernator.activity
        session = kernel.session
        activity.restarted(kernel_id)

        def record(msg_list: list[Any]) -> None:
            # Reads the raw frames (signature, header, parent, metadata, content) with plain JSON
            # decoding: jupyter_server's own watcher, called next, already verifies the signature,
            # and ``Session.deserialize`` would parse every date in the headers a second time —
            # a fifth of the server's time per message on the execute path.
            try:
                _idents, fed = session.feed_identities(msg_list, copy=True)
                msg_type = session.unpack(fed[1])["msg_type"]
                parent = session.unpack(fed[2])
                wanted = msg_type in ("status", "execute_input")
                content = session.unpack(fed[4]) if wanted else None
                activity.observe(kernel_id, msg_type, parent or {}, content)
            except Exception:  # never let bookkeeping break jupyter_server's own watcher
                self.log.debug("could not read IOPub message of %s for activity", kernel_id, exc_info=True)
            original(msg_list)

        stream.on_recv(record)

    def _require_runtime(self) -> ElasticRuntime:
        if self.elastic_runtime is None:
            raise http_error(503, "the kernelmgr extension has not finished loading; try again")
        return self.elastic_runtime

    def check_size(self, kernel_name: str, queued: bool = False) -> GpuProfile | None:
        """Refuse, with a 4xx that says what to do, a kernelspec whose GPU size is unknown or full.

        ``queued``: a size that fits later is returned (the start waits its turn in the slice
        queue). With ``scale_up_wait`` one that fits nowhere now passes: its pod waits for a node.
        """
        runtime = self._require_runtime()
        ksm = self.kernel_spec_manager
        try:
            profile_name = ksm.profile_of(kernel_name) if isinstance(ksm, ElasticKernelSpecManager) else None
        except NoSuchKernel:
            if isinstance(ksm, ElasticKernelSpecManager):
                raise http_error(404, ksm.not_offered(kernel_name)) from None
            raise http_error(404, f"no kernelspec named {kernel_name!r}; see /api/kernelspecs") from None
        if profile_name in runtime.retired and profile_name not in runtime.profiles:
            # Removed from ElasticKernels.profiles while the server ran: its kernels keep it, no new one.
            assert isinstance(ksm, ElasticKernelSpecManager)
            raise http_error(
                404,
                f"GPU size {profile_name!r} is no longer offered (removed from ElasticKernels.profiles; "
                "its kernels keep it); start one of: "
                f"{', '.join(sorted(ksm.elastic_kernel_names())) or 'none'} (see /api/kernelspecs)",
            )
        try:
            profile = runtime.profile(profile_name) if profile_name is not None else None
        except UnknownProfileError as exc:
            raise http_error(400, f"kernelspec {kernel_name!r} asks for an {exc.message}") from None
        if profile is None or runtime.waits_for_a_node(profile):
            return None
        if queued and runtime.allocator.ever_fits(profile):
            return profile
        try:
            runtime.allocator.check(profile)
        except CapacityError as exc:
            raise http_error(409, exc.message) from None
        return None

    async def _async_start_kernel(
        self, *, kernel_id: str | None = None, path: Any = None, **kwargs: Any
    ) -> str:
        queued: str | None = None
        require_serving(self.elastic_runtime)
        if kernel_id is None or kernel_id not in self:
            runtime = self._require_runtime()
            name = kwargs.get("kernel_name") or self.default_kernel_name
            waits_for = self.check_size(name, queued=runtime.start_queue_wait > 0)
            if waits_for is not None:
                kernel_id = queued = kernel_id or self.new_kernel_id()
                await wait_for_start_turn(self, queued, waits_for)
        elif self.hibernator is not None and self.hibernator.is_hibernated(kernel_id):
            return kernel_id  # an existing, hibernated kernel: the next execute resumes it
        try:
            started: str = await super()._async_start_kernel(kernel_id=kernel_id, path=path, **kwargs)
        except CapacityError as exc:  # lost a race with another start after the check
            raise http_error(409, exc.message) from None
        except UnknownProfileError as exc:
            raise http_error(400, exc.message) from None
        except kube_optional.refusals() as exc:  # RBAC or an admission policy: the admin's to fix
            raise http_error(500, f"could not start the kernel: {exc}") from None
        except kube_optional.launch_failures() as exc:  # not scheduled, not pulled, ended: say why
            raise http_error(503, f"could not start the kernel: {exc}") from None
        except AccountError as exc:  # a multi-user gateway: no OS account for this user's kernels
            raise http_error(403, exc.message) from None
        finally:
            if queued is not None and self.elastic_runtime is not None:
                self.elastic_runtime.slice_queue.settle(queued)
        timeout = self.elastic_runtime.start_timeout if self.elastic_runtime is not None else 120.0
        self.starting_kernels.add(started)
        try:
            await wait_until_up(self, started, timeout)
        finally:
            self.starting_kernels.discard(started)
        if self.hibernator is not None and self.hibernator.state_of(started) is not None:
            self.hibernator.track(started)
        return started

    start_kernel = _async_start_kernel = measured(_async_start_kernel)  # type: ignore[assignment]

    # -- hibernated kernels inside jupyter_server's kernel life ----------------------------

    def _hibernated(self, kernel_id: str) -> bool:
        return self.hibernator is not None and self.hibernator.is_hibernated(kernel_id)

    async def _async_shutdown_kernel(
        self, kernel_id: str, now: bool | None = False, restart: bool | None = False
    ) -> None:
        require_lease(self.elastic_runtime, "shut a kernel down")
        hibernator = self.hibernator
        if hibernator is not None and not restart and hibernator.state_of(kernel_id) is not None:
            # A delete (or TTL removal) cancels what is in flight first: a resume stops the process
            # it launched and frees the slice; a hibernation leaves the kernel running, to be
            # shut down below. Nothing outlives the delete, and no checkpoint is written after it.
            await hibernator.cancel_operations(kernel_id)
        if hibernator is not None and self._hibernated(kernel_id) and not restart:
            # No process to stop: unregister it (and, unless the server is exiting, forget it).
            hibernator.cancel_resume(kernel_id)
            self._check_kernel_id(kernel_id)
            self._unregister(kernel_id).cleanup_connection_file()
            if not self._exiting:
                await hibernator.forget(kernel_id)
            self.log.info(
                "Hibernated kernel %s shut down%s", kernel_id, "" if self._exiting else " and forgotten"
            )
            return
        await super()._async_shutdown_kernel(kernel_id, now=now, restart=restart)
        if hibernator is not None and not restart:
            await hibernator.forget(kernel_id)

    shutdown_kernel = _async_shutdown_kernel  # type: ignore[assignment]

    def _running_elastic_kernels(self) -> list[str]:
        """Elastic kernels that are up and running (one never up is shut down: nothing to save)."""
        runtime = self._require_runtime()
        return [
            record.kernel_id
            for record in runtime.kernels.all()
            if record.state is KernelState.RUNNING
            and record.kernel_id in self
            and record.kernel_id not in self.starting_kernels
        ]

    async def _async_shutdown_all(self, now: bool = False) -> None:
        runtime = self.elastic_runtime
        hibernator = self.hibernator
        if hibernator is not None and runtime is not None and runtime.hibernate_on_shutdown and not now:
            limit = (
                self.culler.policy.max_concurrent_hibernations if self.culler is not None else DEFAULT_LIMIT
            )
            await hibernator.hibernate_all(self._running_elastic_kernels(), limit)
            for kernel_id in self._running_elastic_kernels():  # could not hibernate (busy, disk full)
                self._leave_running(kernel_id)
        elif runtime is not None and runtime.mode.in_pods and not now:  # pods outlive the server:
            for kernel_id in self._running_elastic_kernels():  # the next adopts them, unpicklables too
                self._leave_running(kernel_id, ADOPTED)
        self._exiting = True
        await super()._async_shutdown_all(now=now)
        if hibernator is not None:
            await hibernator.drain()
        if runtime is not None and runtime.mode.in_pods:
            # The kernels' pods are gone: nothing waits on the watch now (joins threads: off the loop).
            await asyncio.to_thread(runtime.kube.stop)

    shutdown_all = _async_shutdown_all  # type: ignore[assignment]

    def _leave_running(self, kernel_id: str, why: str = NOT_HIBERNATED) -> None:
        """At a server stop, leave an elastic kernel that could not hibernate (a cell running) to
        itself instead of shutting it down, which would lose its variables and its checkpoints.

        A local kernel's watchdog sees the server gone, lets the cell finish, checkpoints and
        exits; the next start lists it ``hibernating``, then ``hibernated`` (as after a crash). A
        kernel pod keeps running and the next server adopts it as it is.
        """
        self.get_kernel(kernel_id).stop_restarter()
        self._unregister(kernel_id)
        self.log.warning("Kernel %s %s", kernel_id, why)

    def _unregister(self, kernel_id: str) -> Any:
        """Drop ``kernel_id`` from this manager without stopping any process; return its manager."""
        self.stop_watching_activity(kernel_id)
        self.stop_buffering(kernel_id)
        km = self.remove_kernel(kernel_id)
        compat.forget(self, kernel_id)
        return km

    async def interrupt_kernel(self, kernel_id: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        require_lease(self.elastic_runtime, "interrupt a kernel")
        if self.hibernator is not None and (
            self._hibernated(kernel_id) or self.hibernator.is_going_to_sleep(kernel_id)
        ):
            # JupyterLab's toolbar interrupts over REST: the same as the websocket message. Cells
            # held for the kernel do not run, a wait for a slice stops, and a process that is
            # writing its checkpoint is never sent SIGINT.
            from kernelmgr.server.websocket import ElasticWebsocketConnection

            ElasticWebsocketConnection.interrupt_waiting(kernel_id)
            self.hibernator.cancel_resume(kernel_id)
            return
        await ensure_async(super().interrupt_kernel(kernel_id, *args, **kwargs))

    async def restart_kernel(self, kernel_id: str, now: bool = False) -> Any:  # type: ignore[override]
        require_lease(self.elastic_runtime, "restart a kernel")
        if self.hibernator is not None and self._hibernated(kernel_id):
            # Restart means "fresh kernel": start it without restoring the checkpoint.
            try:
                await self.hibernator.resume(kernel_id, "restart", restore=False)
            except LifecycleError as exc:
                raise http_error(exc.status, exc.message) from None
            return None
        return await super().restart_kernel(kernel_id, now=now)

    async def cull_kernel_if_idle(self, kernel_id: str) -> None:
        runtime = self.elastic_runtime
        if runtime is not None and kernel_id in runtime.kernels:
            return  # elastic kernels follow CullPolicy (hibernate, never kill); see the README
        await super().cull_kernel_if_idle(kernel_id)

    def adopt_hibernated(self, record: KernelRecord, state: KernelState = KernelState.HIBERNATED) -> None:
        """Register a kernel hibernated by a previous server run, without starting it.

        ``state`` is ``hibernating`` for a kernel whose orphaned process is still checkpointing.
        """
        runtime = self._require_runtime()
        km = self.kernel_manager_factory(
            connection_file=os.path.join(self.connection_dir, f"kernel-{record.kernel_id}.json"),
            parent=self,
            log=self.log,
            kernel_name=record.kernelspec,
            kernel_spec_manager=self.kernel_spec_manager,
        )
        km.kernel_id = record.kernel_id
        km.reason = ""
        km.last_activity = datetime.now(timezone.utc)
        km.ready.set_result(None)  # nothing pending: websockets may connect at once
        compat.mark_started(km, {"cwd": record.cwd} if record.cwd else {})
        compat.register(self, record.kernel_id, km, ports=False)
        # Listed in ``state``: the transition observer sets jupyter's execution_state.
        runtime.states.adopted(record.kernel_id, record.kernelspec, record.profile, record.owner, state)

    def adopt_running(self, found: Any) -> None:
        """Register a kernel pod that a previous server started and that still runs.

        Same id, same connection (from the pod's Secret), its slice claimed again; from here on it
        is served exactly like a kernel this server started (activity, restarts, hibernation).
        """
        kernel_id = found.kernel_id
        km = self.kernel_manager_factory(
            connection_file=os.path.join(self.connection_dir, f"kernel-{kernel_id}.json"),
            parent=self,
            log=self.log,
            kernel_name=found.kernelspec,
            kernel_spec_manager=self.kernel_spec_manager,
        )
        km.kernel_id = kernel_id
        km.provisioner = KPF.instance(parent=self.parent).create_provisioner_instance(
            kernel_id, km.kernel_spec, parent=km
        )
        info = km.provisioner.adopt(found)
        with contextlib.suppress(FileNotFoundError):  # the previous server's copy: the Secret is the truth
            os.remove(km.connection_file)
        compat.adopt_connection(km, info)
        compat.mark_started(km, {})
        km.ready.set_result(None)
        compat.connect_control(km)
        execution_state.initial(km, KernelState.RUNNING)
        km.reason = ""
        km.last_activity = datetime.now(timezone.utc)
        compat.register(self, kernel_id, km)
        self.start_watching_activity(kernel_id)
        self.add_restart_callback(kernel_id, lambda: self._handle_kernel_died(kernel_id), "dead")
        km.start_restarter()

    async def reap_dead_slices(self) -> None:
        """Poll every kernel that holds a slice, so a dead process gives its slice back.

        jupyter_client's restarter polls kernels only while autorestart is on; with it off a
        crashed kernel would keep its GPU until someone shut it down. ``is_alive`` reaches the
        provisioner's ``poll()``, which releases the slice when the process is gone.
        """
        runtime = self._require_runtime()
        for granted in runtime.allocator.slices():
            if granted.kernel_id in self:
                await ensure_async(self.get_kernel(granted.kernel_id).is_alive())

    def elastic_model(self, kernel_id: str) -> dict[str, Any]:
        """The ``/api/elastic/kernels/{id}`` model; 404 when the id is not a kernel here."""
        runtime = self._require_runtime()
        if kernel_id not in self:
            raise no_such_kernel(kernel_id)
        return elastic_kernel_model(
            runtime,
            self.kernel_model(kernel_id),
            self.activity_of(kernel_id),
            self._pod_annotations(kernel_id),
            self._waiting(kernel_id),
        )

    async def elastic_report(self, kernel_id: str) -> dict[str, Any]:
        """``GET /api/elastic/kernels/{id}/report``: the last restore report; 404 for an unknown id.

        The agent writes ``restore-report.json`` beside the checkpoints after each restore (one
        atomic rename), so the report is there after a server restart too; ``null`` until the
        kernel was first resumed. The kernel writes that file, so it is read in a thread, with a
        size cap (``CheckpointStore.restore_report``): never on the event loop.
        """
        runtime = self._require_runtime()
        if kernel_id not in self:
            raise no_such_kernel(kernel_id)
        record = runtime.kernels.get(kernel_id)
        owner = record.owner if record else runtime.owner
        report = await asyncio.to_thread(runtime.checkpoints.restore_report, owner, kernel_id)
        return {"id": kernel_id, "restore_report": report}

    async def refresh_checkpoints(self, kernel_ids: list[str] | None = None) -> None:
        """Read in a thread the checkpoint summaries the models below need (of ``kernel_ids``, or
        every kernel), so building the models on the event loop reads no manifest."""
        runtime = self._require_runtime()
        ids = list(self.list_kernel_ids()) if kernel_ids is None else kernel_ids
        keys = [(record.owner, record.kernel_id) for record in map(runtime.kernels.get, ids) if record]
        if keys:
            await asyncio.to_thread(runtime.checkpoints.refresh_summaries, keys)

    def elastic_models(self) -> list[dict[str, Any]]:
        runtime = self._require_runtime()
        return [
            elastic_kernel_model(
                runtime,
                model,
                self.activity_of(model["id"]),
                self._pod_annotations(model["id"]),
                self._waiting(model["id"]),
            )
            for model in self.list_kernels()
        ]

    def _pod_annotations(self, kernel_id: str) -> dict[str, str] | None:
        """The annotations of the kernel's pod from the pod watch's cache (Kubernetes mode), else ``None``."""
        runtime = self._require_runtime()
        if not runtime.mode.in_pods:
            return None
        return kernel_pod_annotations(runtime, kernel_id, runtime.kube.kernel_pods())

    def _waiting(self, kernel_id: str) -> bool:
        record = self.elastic_runtime.kernels.get(kernel_id) if self.elastic_runtime else None
        return record is not None and record.waiting_for_slice

    def keep_running(self, kernel_id: str) -> dict[str, Any]:
        """``POST /api/elastic/kernels/{id}/activity``: the user wants the kernel kept running.

        Counts as activity (the idle clock starts again, as if a cell had just finished) and
        cancels a pending idle warning at once, so the next policy check does not hibernate it.
        409 for a kernel that is not running: there is nothing to keep.
        """
        runtime = self._require_runtime()
        if kernel_id not in self:
            raise no_such_kernel(kernel_id)
        record = runtime.kernels.get(kernel_id)
        if record is None or self.hibernator is None:
            raise http_error(409, f"kernel {kernel_id} is not an elastic kernel: no cull policy applies")
        if record.state is not KernelState.RUNNING:
            raise http_error(
                409,
                f"kernel {kernel_id} is {record.state.value}, not running: run a cell to resume it instead",
            )
        self.hibernator.activity.get(kernel_id).last_execution_end = time.time()
        if self.culler is not None:
            self.culler.cancel_warning(kernel_id)
        return self.elastic_model(kernel_id)

    def activity_of(self, kernel_id: str) -> dict[str, Any]:  # GPU use, idle time: the model's "activity"
        return self.culler.activity_model(kernel_id) if self.culler is not None else {}

    async def hibernate(self, kernel_id: str, reason: str = "api") -> dict[str, Any]:
        """``POST /api/elastic/kernels/{id}/hibernate``; returns the kernel model."""
        with _answered_as_http(f"hibernate kernel {kernel_id}"):
            await self._require_hibernator().hibernate(kernel_id, reason)
        return self.elastic_model(kernel_id)

    async def resume(self, kernel_id: str, reason: str = "api") -> dict[str, Any]:
        """``POST /api/elastic/kernels/{id}/resume``; returns the kernel model."""
        with _answered_as_http(f"resume kernel {kernel_id}"):
            await self._require_hibernator().resume(kernel_id, reason)
        return self.elastic_model(kernel_id)

    async def cancel_wait(self, kernel_id: str) -> dict[str, Any]:
        """``POST /api/elastic/kernels/{id}/cancel`` (:mod:`kernelmgr.server.waiting`)."""
        await cancel_waiting_resume(self, kernel_id)
        return self.elastic_model(kernel_id)

    def _require_hibernator(self) -> Hibernator:
        if self.hibernator is None:
            raise http_error(503, "the kernelmgr extension has not finished loading; try again")
        return self.hibernator
