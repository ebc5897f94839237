"""The lifecycle controller's platform for jupyter_server's kernel managers.

:class:`JupyterKernelPlatform` does what :class:`~kernelmgr.core.controller.LifecycleController`
asks, for whatever provisioner starts the process (a local process, a pod, a warm one): talk to
the in-kernel agent through a private client (kernel_info, the silent checkpoint request), stop
and start the same ``KernelManager`` under the same id and connection, release the slice, and
keep the on-disk record current. It only reads and writes the kernel's own record; state moves
are the controller's.

Long because a checkpoint is one conversation with the kernel (the silent request, the commit it
reports, and with an object store the upload the server then commits) and each of its steps maps a
kernel's failure to the same errors; split across modules, that mapping would be repeated.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import errno
import itertools
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from jupyter_core.utils import ensure_async

from kernelmgr import compat
from kernelmgr.activity.jupyter import JupyterActivity
from kernelmgr.checkpoint.agent import (
    CHECKPOINT_CODE,
    COMMIT_EXPRESSION,
    ESTIMATE_EXPRESSION,
    REPORT_EXPRESSION,
    UPLOAD_EXPRESSION,
    streaming_checkpoint_code,
    upload_code,
)
from kernelmgr.checkpoint.version import compare
from kernelmgr.core.controller import LifecycleError
from kernelmgr.core.errors import CapacityError
from kernelmgr.core.kernels import Committed, LaunchPlan, ManagedKernel
from kernelmgr.lifecycle.checkpoints import committed_of, newer_checkpoint
from kernelmgr.lifecycle.host import KernelHost
from kernelmgr.lifecycle.records import KernelRecords
from kernelmgr.provisioners.local import BIND_ERROR

if TYPE_CHECKING:
    from kernelmgr.checkpoint_store import Upload
    from kernelmgr.config import ElasticRuntime
    from kernelmgr.lifecycle.storage import CheckpointSpace

#: How long a hibernation request waits for a kernel reported busy to report idle.
BUSY_GRACE_SECONDS = 1.0
#: How long a kernel that looks "starting" gets to answer kernel_info before a hibernation is refused.
STARTING_PROBE_SECONDS = 5.0
#: How long a kernel still reported busy after the grace gets to answer kernel_info (an answer
#: means no cell is running) before a hibernation is refused.
BUSY_PROBE_SECONDS = 5.0
#: How long a resumed kernel is asked kernel_info until the server's IOPub subscription hears it.
WATCH_PROBE_SECONDS = 5.0
#: How long each kernel_info ask waits for the IOPub watcher to hear the kernel's busy/idle.
WATCH_HEARD_SECONDS = 0.05
#: A relaunch with new ports is tried at most this many times (each choice is fresh: a repeat
#: collision is a sign of something else, reported then).
BIND_RETRIES = 3


#: A request to a kernel never blocks the server's event loop: its send fails at once (milliseconds)
#: when the socket has no peer, and the caller retries after an asynchronous wait. A kernel that
#: failed to bind its shell port leaves another process's socket on that port (often another
#: kernel's IOPub pipe); ZeroMQ then drops the client's only connection at the refused handshake,
#: and a plain send waited for a peer forever: the whole server stalled (issue 34).
SEND_TIMEOUT_MS = 0


def shell_client(km: Any) -> Any:
    """A private client of the kernel with its shell channel only, whose sends never block."""
    client = km.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    client.shell_channel.socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    return client


def try_send(send: Callable[[], str]) -> str | None:
    """The id of the request ``send()`` sent, or ``None`` when the kernel's socket took nothing."""
    try:
        return send()
    except zmq.Again:
        return None


def _ok(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply's content, or the agent's one-line error as a :class:`LifecycleError`."""
    content = reply["content"]
    if content.get("status") != "ok":
        raise LifecycleError(f"{content.get('ename', 'Error')}: {content.get('evalue', '')}".strip(), 500)
    return dict(content)


def _etags(text: str | None) -> list[str]:
    """The ETags (JSON list) a kernel reported for the parts it sent."""
    etags = json.loads(text or "null")
    if not isinstance(etags, list) or not all(isinstance(tag, str) for tag in etags):
        raise LifecycleError("the kernel did not report the uploaded parts", 500)
    return etags


def _expression(reply: dict[str, Any], name: str) -> str | None:
    """The string a user expression evaluated to in ``reply`` (its repr, read back as a literal
    only: never evaluated), or ``None`` when the kernel's agent did not answer it."""
    result = (reply["content"].get("user_expressions") or {}).get(name) or {}
    if result.get("status") != "ok":
        return None
    try:
        value = ast.literal_eval(str((result.get("data") or {}).get("text/plain", "")))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def check_agent(log: logging.Logger, kernel_id: str, kernel_info: dict[str, Any]) -> str | None:
    """Log the agent handshake's warnings (:mod:`kernelmgr.checkpoint.version`); its refusal, if any."""
    check = compare(kernel_info)
    for warning in check.warnings:
        log.warning("kernel %s: %s", kernel_id, warning)
    if check.refusal:
        log.error("kernel %s: %s", kernel_id, check.refusal)
    return check.refusal


def stderr_tail(km: Any) -> str:
    """The kernel's last stderr lines, as its provisioner captured them ("" if it did not)."""
    tail = getattr(getattr(km, "provisioner", None), "stderr_tail", None)
    return str(tail()) if callable(tail) else ""


class KernelDied(LifecycleError):
    """The kernel process ended while the server waited for its reply."""


def disk_full(message: str) -> bool:
    return "no space left" in message.lower()


def kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


class JupyterKernelPlatform:
    """:class:`~kernelmgr.core.controller.KernelPlatform` for jupyter_server's kernel managers.

    Works for whatever provisioner starts the process: it only uses the ``KernelManager``
    (start, stop, kill, a private client) and the runtime (allocator, checkpoint store).
    """

    def __init__(
        self,
        host: KernelHost,
        runtime: ElasticRuntime,
        records: KernelRecords,
        activity: JupyterActivity,
        checkpoint_timeout: float,
        space: CheckpointSpace | None = None,
    ) -> None:
        self.host = host
        self.runtime = runtime
        self.records = records
        self.activity = activity
        self.checkpoint_timeout = checkpoint_timeout
        #: The owner's checkpoint quota and the volume's reserve, checked before a checkpoint
        #: (the Hibernator gives it one; ``None``: no rule applies).
        self.space = space

    def _km(self, kernel_id: str) -> Any:
        return self.host.get_kernel(kernel_id) if kernel_id in self.host else None

    async def ensure_idle(self, kernel_id: str) -> None:
        km = self._km(kernel_id)
        # The server learns "idle" from its own IOPub subscription, which can trail the
        # notebook's by a few milliseconds: give a cell that just finished a moment.
        deadline = time.monotonic() + BUSY_GRACE_SECONDS
        while getattr(km, "execution_state", "unknown") == "busy" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        execution_state = getattr(km, "execution_state", "unknown")
        if execution_state == "starting":
            execution_state = await self._state_after_kernel_info(km)
        if execution_state == "busy" and await self._answers_shell(km, BUSY_PROBE_SECONDS):
            execution_state = "idle"
        if execution_state == "starting":
            raise LifecycleError(f"kernel {kernel_id} is still starting: it can hibernate once it is up")
        if execution_state != "idle":
            raise LifecycleError(
                f"kernel {kernel_id} is {execution_state}: it can hibernate once the running cell finishes "
                "(or after you interrupt it)"
            )

    async def _answers_shell(self, km: Any, timeout: float) -> bool:
        """Whether the kernel answers a kernel_info within ``timeout``: it runs its shell requests
        one at a time, so an answer means no cell is running, whatever the server's "busy" says.

        That "busy" can be stale: jupyter_server before 2.15 recorded the busy/idle of every
        request (a notebook's kernel_info or comm_info, the websocket's nudge, this probe), and
        its IOPub watcher can trail the kernel by seconds on a loaded machine. Without this, a
        hibernation just after a cell was refused (409) and a server stop shut the kernel down
        instead of hibernating it.
        """
        client = shell_client(km)
        try:
            await self.reply(client, client.kernel_info, timeout, km, self.pid_of(km))
        except LifecycleError:  # no answer: a cell is running (or the kernel is gone)
            return False
        finally:
            client.stop_channels()
        return True

    async def _state_after_kernel_info(self, km: Any) -> str:
        """The state of a kernel jupyter_server still calls "starting", after asking it kernel_info.

        ipykernel publishes its first "idle" only around a request, so a kernel started through
        ``/api/kernels`` that no client has talked to stays "starting" however long it has been up,
        and neither a user nor the culler could hibernate it. A kernel_info round trip makes it
        publish busy/idle, which the server's own IOPub watcher records.
        """
        client = shell_client(km)
        try:
            # Asked again while no status arrives: a kernel that has only just started may publish
            # before the server's IOPub subscription is joined (ZeroMQ drops those messages).
            up = lambda: getattr(km, "execution_state", "unknown") != "starting"  # noqa: E731
            await self._ask_until(client, km, up, STARTING_PROBE_SECONDS)
        finally:
            client.stop_channels()
        return str(getattr(km, "execution_state", "unknown"))

    async def checkpoint(self, kernel_id: str) -> Committed:
        km = self._km(kernel_id)
        record = self.runtime.kernels.get(kernel_id)
        if km is None or record is None:
            raise LifecycleError(f"kernel {kernel_id} is gone", 404)
        if not getattr(km.provisioner, "checkpoints_persist", True):
            raise LifecycleError(
                f"kernel {kernel_id} runs in a pod whose checkpoints would die with it: set "
                "c.ElasticKubernetesProvisioner.checkpoint_claim to a PersistentVolumeClaim shared with "
                "this server (mounted at ElasticKernels.checkpoint_root), or keep checkpoints in an "
                "object store (c.ElasticKernels.checkpoint_store = 's3')",
                409,
            )
        self.records.remember(kernel_id, pid=self.pid_of(km))
        record.kernel_info, record.execution_count = {}, 0
        store = self.runtime.checkpoints
        stream: Upload | None = None
        committed = False
        phases = [time.monotonic()]  # where a hibernation's checkpoint spends its time (logged)
        try:
            estimate = await self._estimate(km)
            if self.space is not None:  # before anything is written
                await self.space.check(record.owner, kernel_id, estimate)
            if store.uploads:  # the upload starts first: the kernel sends parts as it writes them
                stream = await self._begin_stream(record.owner, kernel_id, estimate)
            phases.append(time.monotonic())
            record.kernel_info, record.execution_count, reported, uploaded = await self._run_checkpoint(
                km, stream
            )
            phases.append(time.monotonic())
            collect = getattr(km.provisioner, "collect_checkpoint", None)
            if collect is not None:  # a Kubernetes warm pod keeps it in its emptyDir until taken
                await self._collect(collect)
            if reported is None:  # an agent older than the report: the store's own view
                self.host.log.warning(
                    "Kernel %s did not report the checkpoint it committed (an older agent): "
                    "taking the store's newest",
                    kernel_id,
                )
                manifest = await asyncio.to_thread(store.latest, record.owner, kernel_id)
                if manifest is None:
                    raise LifecycleError("the agent reported success but no checkpoint was committed", 500)
            else:
                manifest = await self._commit(km, record.owner, kernel_id, reported, stream, uploaded)
            committed = True
            phases.append(time.monotonic())
            self.host.log.info(
                "Kernel %s checkpoint: %.2f s to start the upload, %.2f s to write (and stream) it, "
                "%.2f s to commit it",
                kernel_id,
                *(later - earlier for earlier, later in itertools.pairwise(phases)),
            )
        except KernelDied:
            committed_by_kernel = await self._committed_by_the_kernel(record.owner, kernel_id)
            if committed_by_kernel is None:
                raise
            self.host.log.warning(
                "Kernel %s exited during its checkpoint after committing checkpoint %s itself "
                "(at SIGTERM, or its server watchdog's); taking that one",
                kernel_id,
                committed_by_kernel.checkpoint_id,
            )
            return committed_by_kernel
        except LifecycleError as exc:
            if disk_full(exc.message):
                raise LifecycleError(exc.message, 507) from None
            raise
        finally:
            if stream is not None and not committed:  # nothing of it is ever read: drop its parts
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(store.abort_upload, stream)
        return committed_of(manifest)

    async def _estimate(self, km: Any) -> int:
        """How big the kernel's checkpoint will be, estimated by its agent before pickling (0 when
        it cannot say): what the storage rules check and what an upload presigns parts for."""
        reply = await self._silent(km, "pass", ESTIMATE_EXPRESSION, 60, name="estimate")
        try:
            return max(0, int(_expression(reply, "estimate") or 0))
        except ValueError:
            return 0  # a wrong estimate costs a second round of parts, nothing else

    async def _begin_stream(self, owner: str, kernel_id: str, estimate: int) -> Upload:
        """Start the upload with part URLs for the estimated size: the kernel streams the parts
        while it writes (``ObjectCheckpointStore.begin_stream``)."""
        store = self.runtime.checkpoints
        try:
            return await asyncio.to_thread(store.begin_stream, owner, kernel_id, estimate)
        except Exception as exc:
            raise LifecycleError(f"the object store refused the upload: {exc}", 502) from None

    async def _collect(self, collect: Callable[[], Any]) -> None:
        try:
            await collect()
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise LifecycleError(f"the server's checkpoint volume is full: {exc}", 507) from None
            raise LifecycleError(f"the checkpoint could not be stored: {exc}", 500) from None
        except RuntimeError as exc:
            raise LifecycleError(str(exc), 500) from None

    async def _commit(
        self,
        km: Any,
        owner: str,
        kernel_id: str,
        reported: str,
        stream: Upload | None = None,
        uploaded: str | None = None,
    ) -> Any:
        """Record the checkpoint the kernel reported: its signed manifest, verified with the owner's
        key (never a checkpoint inferred from the store's listing or ``current``). With an object
        store, the kernel sent ``data.bin``'s parts while it wrote it (``stream``; the parts past
        the URLs it had go now, from its local copy); the server then completes the upload and
        writes the manifest last (the commit)."""
        store = self.runtime.checkpoints
        try:
            manifest = await asyncio.to_thread(store.commit, owner, kernel_id, reported)
        except ValueError as exc:
            raise LifecycleError(
                f"the checkpoint the kernel reported cannot be trusted: {exc}", 500
            ) from None
        if not store.uploads:
            return manifest
        if stream is None or manifest.checkpoint_id != stream.checkpoint_id:
            raise LifecycleError(
                f"the kernel reported checkpoint {manifest.checkpoint_id}, not the one it was asked to "
                f"write ({stream.checkpoint_id if stream else 'none'})",
                500,
            )
        etags = _etags(uploaded)
        try:
            upload = await asyncio.to_thread(store.stream_urls, stream, manifest.data_bytes)
        except ValueError as exc:
            raise LifecycleError(f"the checkpoint cannot be uploaded: {exc}", 507) from None
        try:
            if len(etags) < len(upload.urls):  # it outgrew the estimate: the rest from its copy
                code = upload_code(
                    manifest.checkpoint_id,
                    upload.urls[len(etags) :],
                    upload.part_size,
                    upload.checkpoint_key,
                    first_part=len(etags),
                )
                reply = await self._silent(km, code, UPLOAD_EXPRESSION, self.checkpoint_timeout)
                etags += _etags(_expression(reply, "upload"))
            await asyncio.to_thread(store.finish_upload, upload, etags, reported)
        except (LifecycleError, KernelDied, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise LifecycleError(
                f"the checkpoint could not be committed to the object store: {exc}", 502
            ) from None
        return manifest

    async def _committed_by_the_kernel(self, owner: str, kernel_id: str) -> Committed | None:
        """A checkpoint the kernel committed on its own before it exited, newer than any the server
        knew of; ``None`` if there is none.

        A kernel commits one on its own only when no cell is running (at SIGTERM, or when its
        watchdog thinks the server died) and exits right after, so that checkpoint holds every
        cell the kernel finished: the state a hibernation would have saved.
        """
        record = self.runtime.kernels.get(kernel_id)
        known = record.committed if record else None
        return await newer_checkpoint(self.runtime.checkpoints, owner, kernel_id, known, self.host.log)

    async def _run_checkpoint(
        self, km: Any, stream: Upload | None = None
    ) -> tuple[dict[str, Any], int, str | None, str | None]:
        """Run the agent's checkpoint through a private client.

        Returns the kernel_info content, the number of the last cell the user ran (a silent
        execute's reply carries it without counting itself), the manifest (JSON) the kernel
        reports it committed (``None`` from an agent that does not report it) and, with a
        ``stream`` (an object store's upload), the ETags (JSON) of the parts it sent meanwhile.
        """
        code, expressions = CHECKPOINT_CODE, {"commit": COMMIT_EXPRESSION}
        if stream is not None:
            code = streaming_checkpoint_code(
                stream.checkpoint_id, stream.urls, stream.part_size, stream.checkpoint_key
            )
            expressions["upload"] = UPLOAD_EXPRESSION
        client = shell_client(km)
        pid = self.pid_of(km)
        try:
            # Both requests at once: the kernel answers its shell requests in order, so the
            # checkpoint does not wait a round trip for the kernel_info reply.
            info_id = try_send(client.kernel_info)
            msg_id = try_send(
                lambda: client.execute(
                    code,
                    silent=True,
                    store_history=False,
                    allow_stdin=False,
                    user_expressions=expressions,
                )
            )
            if (
                info_id is None or msg_id is None
            ):  # a running kernel holds its ports: not seen, but never wait
                raise LifecycleError("the kernel's shell socket takes no requests", 503)
            self.activity.internal(msg_id)  # the server's own request is not the user's activity
            info = await self.reply(client, info_id, 30, km, pid)
            reply = await self.reply(client, msg_id, self.checkpoint_timeout, km, pid)
        finally:
            client.stop_channels()
        content = _ok(reply)
        count = content.get("execution_count")
        return (
            dict(info["content"]),
            count if isinstance(count, int) and count > 0 else 0,
            _expression(reply, "commit"),
            _expression(reply, "upload") if stream is not None else None,
        )

    async def _silent(
        self, km: Any, code: str, expression: str, timeout: float, name: str = "upload"
    ) -> dict[str, Any]:
        """The reply to a silent execute of the agent's ``code`` with one user ``expression``."""
        client = shell_client(km)
        pid = self.pid_of(km)
        try:
            msg_id = try_send(
                lambda: client.execute(
                    code,
                    silent=True,
                    store_history=False,
                    allow_stdin=False,
                    user_expressions={name: expression},
                )
            )
            if msg_id is None:
                raise LifecycleError("the kernel's shell socket takes no requests", 503)
            self.activity.internal(msg_id)
            reply = await self.reply(client, msg_id, timeout, km, pid)
        finally:
            client.stop_channels()
        _ok(reply)
        return reply

    async def stop(self, kernel_id: str) -> None:
        """Stop the kernel gracefully (its atexit handlers flush the user's files), keeping
        its id, ports and connection file for the resume.

        The same steps as ``shutdown_kernel(restart=True)`` minus the interrupt (the kernel
        is idle) and with a 10 ms poll instead of 100 ms: a stop is on the hibernate path.
        """
        await self._end_process(kernel_id, graceful=True)

    async def kill(self, kernel_id: str) -> None:
        record = self.runtime.kernels.get(kernel_id)
        if record is not None and record.orphan_pid is not None:
            kill_pid(record.orphan_pid)
            record.orphan_pid = None
        await self._end_process(kernel_id, graceful=False)

    async def _end_process(self, kernel_id: str, graceful: bool) -> None:
        """Stop the process (asking it, or killing it), keeping id, ports and connection file."""
        km = self._km(kernel_id)
        if km is None or not km.has_kernel:
            return
        km.shutting_down = True
        km.stop_restarter()
        await compat.stop_for_restart(km, graceful)

    async def launch(self, kernel_id: str, restore: Committed | None, timeout: float) -> None:
        km = self._km(kernel_id)
        record = self.runtime.kernels.get(kernel_id)
        if km is None or record is None:
            raise LifecycleError(f"kernel {kernel_id} is gone", 404)
        try:
            await self._launch(km, record, kernel_id, restore, timeout)
        finally:
            # A warm pool that held its refill back for this launch refills now.
            if self.runtime.warm_pools is not None:
                self.runtime.warm_pools.launch_settled(kernel_id)

    async def _launch(
        self, km: Any, record: ManagedKernel, kernel_id: str, restore: Committed | None, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        relaunches = 0
        while True:
            await self._start_process(km, record, restore, deadline)
            # The server's own IOPub watcher follows the new process: a pod's new address, or new
            # ports after a bind error (a local kernel on the same ports gets a fresh subscription).
            self.host.new_process(kernel_id)
            # Two budgets: the process (a pod: scheduled, its node booted, its image pulled) has the
            # provisioner's; "kernel restored" (``timeout``) counts from when it runs, so a slow
            # pod start never eats the restore's time.
            try:
                await self._wait_ready(km, kernel_id if restore else None, timeout)
                break
            except LifecycleError:
                # A resume launches on the ports the kernel had before it slept: another process
                # may have taken one since. Relaunched (the provisioner then picks new ports),
                # with the same restore request, a bounded number of times (issue 34).
                if relaunches >= BIND_RETRIES or BIND_ERROR not in stderr_tail(km):
                    raise
                relaunches += 1
                self.host.log.warning(
                    "Kernel %s could not bind its port at its resume (taken while it slept): relaunching "
                    "it with new ports (%d/%d)",
                    kernel_id,
                    relaunches,
                    BIND_RETRIES,
                )
                await self._end_process(kernel_id, graceful=False)
        collect = getattr(km.provisioner, "collect_restore_report", None)
        if restore is not None and collect is not None:
            try:
                await collect()
            except Exception as exc:
                self.host.log.warning("kernel %s: restore report not collected: %s", kernel_id, exc)
        if restore is not None and getattr(km.provisioner, "restore_report_in_pod", False):
            await self._fetch_restore_report(km, record.owner, kernel_id)

    async def _fetch_restore_report(self, km: Any, owner: str, kernel_id: str) -> None:
        """Ask the agent for its restore report and keep it where REST and the CLI read it: its
        folder is a pod's emptyDir the server cannot see (kernel pods with an object store)."""
        try:
            reply = await self._silent(km, "pass", REPORT_EXPRESSION, 30)
            text = _expression(reply, "upload")
            if text is None:
                raise LifecycleError("the agent did not answer", 500)
            await asyncio.to_thread(self.runtime.checkpoints.keep_restore_report, owner, kernel_id, text)
        except (LifecycleError, KernelDied, OSError, ValueError) as exc:
            self.host.log.warning("kernel %s: restore report not collected: %s", kernel_id, exc)

    async def _start_process(
        self, km: Any, record: ManagedKernel, restore: Committed | None, deadline: float
    ) -> None:
        """Start the kernel's process, handing it the plan to restore ``restore``.

        The one place a plan is handed: each attempt hands it again (the launch takes it once,
        in :func:`~kernelmgr.provisioners.common.claim_slice`), and one no launch took is
        withdrawn after, so a later restart starts empty.
        """
        plan = LaunchPlan.restoring(restore)
        launch_args = dict(getattr(km, "_launch_args", {}) or {})
        try:
            while True:
                record.hand_launch_plan(plan)
                try:
                    await km.start_kernel(**launch_args)
                    break
                except CapacityError:  # lost the slice to another start after the check
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            record.hand_launch_plan(None)

    async def _wait_ready(self, km: Any, continue_count_of: str | None, timeout: float) -> None:
        client = shell_client(km)
        kernel_id = str(getattr(km, "kernel_id", ""))
        asked = self.activity.clock()
        try:
            # One kernel_info round trip proves the kernel serves requests (the agent has
            # restored by then: it runs at extension load, before the first request).
            info = await self.reply(client, client.kernel_info, timeout, km, self.pid_of(km), launching=True)
            refusal = check_agent(
                self.host.log, str(getattr(km, "kernel_id", "")), dict(info.get("content") or {})
            )
            if refusal:
                raise LifecycleError(refusal, 500)
            record = self.records.get(continue_count_of) if continue_count_of else None
            if record is not None and record.execution_count > 0:
                # The notebook's cell numbers go on where they stopped (silently: no output).
                code = f"get_ipython().execution_count = {record.execution_count + 1}"
                msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False)
                self.activity.internal(msg_id)
                await self.reply(client, msg_id, timeout, km, self.pid_of(km))
                self.activity.get(record.kernel_id).execution_count = record.execution_count
            await self._until_watched(client, km, kernel_id, asked)
        finally:
            client.stop_channels()

    async def _until_watched(self, client: Any, km: Any, kernel_id: str, since: float) -> None:
        """Return once the server's own IOPub subscription has heard the new process.

        That subscription (jupyter_server's activity watcher, which the cull policy's execution
        tracking rides on) reconnects to the new process on its own, 100 ms or more after the
        process binds; ZeroMQ drops what the kernel publishes before that. A resume answers
        sooner, and the cell that caused it then ran unseen: not counted as use, its "busy"
        missed. So the kernel is asked kernel_info (it publishes busy/idle around each request)
        until the subscription hears one, for at most ``WATCH_PROBE_SECONDS``; past that the
        resume goes on, with a warning.
        """
        heard = lambda: (self.activity.get(kernel_id).iopub_heard or 0.0) >= since  # noqa: E731
        if not await self._ask_until(client, km, heard, WATCH_PROBE_SECONDS):
            # The resume goes on: a cell it lets through is answered anyway.
            self.host.log.warning(
                "Kernel %s: the server's IOPub watcher has not heard it since its start; its first "
                "cell may not count as activity",
                kernel_id,
            )

    async def _ask_until(self, client: Any, km: Any, done: Callable[[], bool], seconds: float) -> bool:
        """Ask the kernel kernel_info (it publishes busy/idle around each request) until ``done()``,
        which the server's own IOPub watcher makes true when it hears them, for at most
        ``seconds``; whether it came true. A kernel that does not answer ends the asking."""
        deadline = time.monotonic() + seconds
        while True:
            heard_by = min(deadline, time.monotonic() + WATCH_HEARD_SECONDS)
            while time.monotonic() < heard_by:
                if done():
                    return True
                await asyncio.sleep(0.01)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await self.reply(client, client.kernel_info, remaining, km, self.pid_of(km))
            except LifecycleError:  # not up yet, gone, or no answer in time
                return False

    def release_slice(self, kernel_id: str) -> None:
        released = self.runtime.allocator.release(kernel_id)
        record = self.runtime.kernels.get(kernel_id)
        if released is not None and record is not None:
            record.released = released

    async def discard_checkpoints(self, kernel_id: str) -> None:
        record = self.runtime.kernels.get(kernel_id)
        kept = self.records.get(kernel_id)
        owner = record.owner if record else kept.owner if kept else None
        if owner is not None:
            await asyncio.to_thread(self.runtime.checkpoints.remove, owner, kernel_id)

    def persist(self, kernel_id: str) -> None:
        self.records.remember(kernel_id)

    async def reply(
        self,
        client: Any,
        request: str | Callable[[], str],
        timeout: float,
        km: Any,
        pid: int | None,
        launching: bool = False,
    ) -> dict[str, Any]:
        """The shell reply to ``request`` (a sent message's id, or the send itself, retried while
        the kernel's socket takes nothing); fails fast if the kernel process dies meanwhile.

        ``launching``: the kernel was just started, so its process ending (or hanging after a
        failed bind) is a failed start, told with its last stderr lines.
        """
        deadline = time.monotonic() + timeout
        msg_id = request if isinstance(request, str) else None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LifecycleError(f"the kernel did not answer within {timeout:g}s", 504)
            try:
                if msg_id is None:
                    assert callable(request)
                    msg_id = try_send(request)
                    if msg_id is None:
                        await asyncio.sleep(min(0.2, remaining))
                        raise TimeoutError  # nothing sent: check on the process, as for no reply
                msg: dict[str, Any] = await client.get_shell_msg(timeout=min(1.0, remaining))
            except Exception:  # queue.Empty from jupyter_client: no message this second
                if launching:
                    tail = stderr_tail(km)
                    if BIND_ERROR in tail:  # ipykernel hangs after some failed binds: do not wait
                        raise LifecycleError(f"the kernel could not bind its ports: {tail}", 503) from None
                    if not await ensure_async(km.is_alive()):
                        raise LifecycleError(
                            f"the kernel exited before it answered; its last stderr lines: {tail or 'none'}",
                            500,
                        ) from None
                    continue
                if self.pid_of(km) != pid or not await ensure_async(km.is_alive()):
                    raise KernelDied(
                        "the kernel process died while writing its checkpoint; the previous checkpoint "
                        "(if any) is unchanged",
                        500,
                    ) from None
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg

    @staticmethod
    def pid_of(km: Any) -> int | None:
        """The pid of the kernel's current process (``None`` when it has none)."""
        process = getattr(getattr(km, "provisioner", None), "process", None)
        return getattr(process, "pid", None)
