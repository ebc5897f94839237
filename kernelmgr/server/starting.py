"""A new kernel's start, up to its first answer: what jupyter_client leaves undone.

jupyter_client calls a kernel started once its process is launched. Under load that is not
enough, and three things went wrong (issue 34):

* a kernel whose ZeroMQ port was taken by another process between the choice and the bind died,
  and every automatic restart tried the *same* ports again (jupyter_client caches them), so it
  never came up, kept its GPU slice, and was left running at server stop;
* the restarter's relaunch, racing the start, replaced the manager's ``ready`` future, and
  ``MultiKernelManager`` answered ``InvalidStateError`` ("Unhandled error", 500);
* a kernel that crashed at import or hung answered 201 anyway.

So a start here launches with the restarter held off, then (for the elastic local provisioner's
kernels) waits for one ``kernel_info`` reply within ``ElasticKernels.start_timeout``. A process
that fails at its bind (it exits, or hangs after the traceback) is killed and relaunched with new
ports; any other exit, or the timeout, stops the kernel (its slice is released by the
provisioner's cleanup) and answers a JSON error naming the cause with the kernel's last stderr
lines. Only then is the restarter started: from here on a crash restarts as in plain Jupyter.

Before all that, with ``ElasticKernels.start_queue_wait``, a start whose GPU size does not fit
now waits its turn in the slice queue (issue 29), instead of a 409.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import zmq
from jupyter_client.kernelspec import NoSuchKernel
from jupyter_client.multikernelmanager import MultiKernelManager
from jupyter_core.utils import ensure_async
from tornado import web

from kernelmgr import compat
from kernelmgr.core.errors import CapacityError
from kernelmgr.core.kernels import requesting_owner
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.lifecycle import metrics
from kernelmgr.lifecycle.platform import BIND_RETRIES, check_agent, shell_client, stderr_tail, try_send
from kernelmgr.provisioners.local import BIND_ERROR
from kernelmgr.server.errors import http_error
from kernelmgr.server.kernelspecs import ElasticKernelSpecManager


def raise_socket_limit(context: zmq.Context[Any], log: logging.Logger) -> int:
    """Let the server's one ZeroMQ context open as many sockets as its file limit allows.

    libzmq's default is 1023 sockets per context, and jupyter_server shares one context among
    all kernels: each holds several (its IOPub watcher, control socket, and five per open
    notebook), so around a hundred kernels with a notebook each, new sockets failed with
    "Too many open files" while the process had thousands of descriptors left. Must run before
    the context's first socket; returns the limit set.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if soft == resource.RLIM_INFINITY else max(1023, min(soft // 2, 65536))
    try:
        context.set(zmq.MAX_SOCKETS, wanted)
    except zmq.ZMQError as exc:
        log.warning("could not raise the ZeroMQ socket limit to %d: %s", wanted, exc)
        return int(context.get(zmq.MAX_SOCKETS))
    return wanted


class StartWithoutReadyRace(MultiKernelManager):
    """jupyter_server's ``pinned_superclass`` with a start that raises the start's own error.

    jupyter_client's version reads ``km.ready.exception()`` after the start; a restart or a
    shutdown in between has replaced ``ready`` with a pending future, and the read raises
    ``InvalidStateError``. Here the start is awaited directly, and the restarter is held off until
    the kernel has answered (:func:`wait_until_up`).
    """

    async def _async_start_kernel(self, *, kernel_name: str | None = None, **kwargs: Any) -> str:
        km, kernel_name, kernel_id = self.pre_start_kernel(kernel_name, kwargs)
        kwargs["kernel_id"] = kernel_id
        km_: Any = km
        km_._elastic_autorestart = km.autorestart
        km.autorestart = False  # no relaunch behind our back until the kernel first answered
        try:
            await ensure_async(km.start_kernel(**kwargs))
        except BaseException:
            km.autorestart = km_._elastic_autorestart
            raise
        compat.kernels(self)[kernel_id] = km
        return kernel_id


def _with_stderr(message: str, tail: str) -> str:
    return f"{message}. Its last stderr lines:\n{tail}" if tail else f"{message} (it wrote nothing to stderr)"


async def _first_reply(km: Any, deadline: float, reply: dict[str, Any] | None = None) -> str:
    """``up`` once the kernel answers kernel_info (its content put in ``reply``); ``exited`` if its
    process ends; ``bind error`` if it wrote one (and hangs); ``timeout``."""
    client = shell_client(km)
    try:
        msg_id = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            try:
                msg_id = msg_id or try_send(client.kernel_info)
                if msg_id is None:
                    await asyncio.sleep(min(0.2, remaining))
                    raise TimeoutError  # its socket took nothing yet: is the process still there?
                msg = await client.get_shell_msg(timeout=min(0.5, remaining))
            except Exception:  # queue.Empty: nothing this half second; is the process still there?
                if not await ensure_async(km.is_alive()):
                    return "exited"
                if BIND_ERROR in stderr_tail(km):
                    # ipykernel raised at its bind but does not exit: the sockets it had bound
                    # already keep ZeroMQ's context from terminating (linger), so it hangs.
                    return "bind error"
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                if reply is not None:
                    reply.update(msg.get("content") or {})
                return "up"
    finally:
        client.stop_channels()


async def wait_until_up(mkm: Any, kernel_id: str, timeout: float) -> None:
    """Wait until the kernel just started answers; stop it and raise an HTTP error otherwise."""
    km = mkm.get_kernel(kernel_id)
    relaunchable = callable(getattr(km.provisioner, "choose_new_ports", None))
    if not relaunchable and not getattr(km.provisioner, "first_reply_at_start", False):
        # The elastic local provisioner's kernels are waited for, and kernel pods unless their
        # nodes run nothing (kwok; ElasticKubernetesProvisioner.wait_for_first_reply): a real
        # kubelet reports a container Running before a failing import ends it.
        _start_restarter(km)
        return
    deadline = time.monotonic() + timeout
    relaunches = 0
    while True:
        info: dict[str, Any] = {}
        outcome = await _first_reply(km, deadline, info)
        if kernel_id not in mkm or mkm.get_kernel(kernel_id) is not km:
            raise http_error(409, f"kernel {kernel_id} was shut down while it was starting")
        if outcome == "up":
            refusal = check_agent(mkm.log, kernel_id, info)
            if refusal:
                await _stop(mkm, kernel_id)
                raise http_error(500, f"kernel {kernel_id} refused: {refusal}")
            break
        tail = stderr_tail(km)
        if (
            relaunchable
            and outcome in ("exited", "bind error")
            and BIND_ERROR in tail
            and relaunches < BIND_RETRIES
        ):
            relaunches += 1
            mkm.log.warning(
                "Kernel %s could not bind its port (taken since it was chosen): relaunching it with new "
                "ports (%d/%d)",
                kernel_id,
                relaunches,
                BIND_RETRIES,
            )
            try:
                await _relaunch_with_new_ports(mkm, kernel_id, km)
            except Exception as exc:  # e.g. its slice was taken while the process was gone
                message = f"kernel {kernel_id} could not be relaunched after a bind error: {exc}"
                await _stop(mkm, kernel_id)
                raise http_error(503, message) from None
            continue
        if outcome == "bind error":
            message = _with_stderr(f"kernel {kernel_id}: {relaunches + 1} binds failed", tail)
            http_status = 503
        elif outcome == "exited":
            status = getattr(getattr(km.provisioner, "process", None), "returncode", None)
            exited = f"exited (status {status})" if status is not None else "exited"  # a pod: in the tail
            message = _with_stderr(f"kernel {kernel_id} {exited} before it answered", tail)
            http_status = 500
        else:
            message = _with_stderr(
                f"kernel {kernel_id} did not answer within {timeout:g}s "
                "(ElasticKernels.start_timeout) and was stopped",
                tail,
            )
            http_status = 504
        mkm.log.error("Start failed: %s", message)
        await _stop(mkm, kernel_id)
        raise http_error(http_status, message)
    _start_restarter(km)


def _start_restarter(km: Any) -> None:
    """The restarter held off during the start, started now (if the kernel had one)."""
    km.autorestart = getattr(km, "_elastic_autorestart", True)
    km.start_restarter()


async def _stop(mkm: Any, kernel_id: str) -> None:
    """Stop a kernel whose start failed (its provisioner's cleanup releases the slice)."""
    if kernel_id not in mkm:
        return  # already gone (a concurrent delete): nothing to stop
    try:
        await mkm.shutdown_kernel(kernel_id, now=True)
    except Exception:
        mkm.log.exception("could not stop kernel %s after its failed start", kernel_id)


async def _relaunch_with_new_ports(mkm: Any, kernel_id: str, km: Any) -> None:
    """Relaunch a kernel whose process failed at its bind, on ports chosen again."""
    mkm.stop_watching_activity(kernel_id)
    # ``now``: kills the process (it may hang after the error) and reaps it; the slice is kept.
    await ensure_async(km.shutdown_kernel(now=True, restart=True))
    choose = getattr(km.provisioner, "choose_new_ports", None)
    if callable(choose):
        choose()
    await ensure_async(km.start_kernel(**compat.launch_args(km)))
    compat.set_ports(mkm, kernel_id, km.ports)
    mkm.start_watching_activity(kernel_id)


async def wait_for_start_turn(km: Any, kernel_id: str, profile: GpuProfile) -> None:
    """A new kernel whose size does not fit now waits its turn in the slice queue, at most
    ``ElasticKernels.start_queue_wait`` seconds; a 409 saying so past it."""
    runtime = km.elastic_runtime
    hibernator = km.hibernator
    if runtime is None or hibernator is None:
        return
    owner = requesting_owner.get() or runtime.owner
    try:
        await hibernator.controller.waits.wait(
            kernel_id, owner, profile, runtime.start_queue_wait, "ElasticKernels.start_queue_wait"
        )
    except CapacityError as exc:
        raise http_error(409, exc.message) from None


async def measured_start(start: Awaitable[str], size: str) -> str:
    """Await a new kernel's ``start``, counting for /metrics its time to an answering kernel, or why
    it failed (a 409 for capacity also counts as unserved demand); the request's own faults (an
    unknown size, no account) are not failed starts."""
    began = time.monotonic()
    try:
        started = await start
    except web.HTTPError as exc:
        message = str(exc.log_message or "")
        if exc.status_code == 409:
            metrics.CAPACITY_REFUSALS.labels(size=size).inc()
            reason = "capacity"
        elif exc.status_code == 503:
            reason = metrics.failure_reason(message)
        elif exc.status_code == 500 and "could not start" in message:
            reason = "refused"  # RBAC or an admission policy
        else:
            raise
        metrics.START_FAILURES.labels(size=size, reason=reason).inc()
        raise
    except Exception:
        metrics.START_FAILURES.labels(size=size, reason="other").inc()
        raise
    metrics.START_SECONDS.labels(size=size).observe(time.monotonic() - began)
    return started


def measured(start: Callable[..., Coroutine[Any, Any, str]]) -> Callable[..., Coroutine[Any, Any, str]]:
    """``km._async_start_kernel``, measured (:func:`measured_start`) when it makes a new kernel."""

    @functools.wraps(start)
    async def wrapper(km: Any, *, kernel_id: str | None = None, **kwargs: Any) -> str:
        started = start(km, kernel_id=kernel_id, **kwargs)
        if kernel_id is not None and kernel_id in km:
            return await started
        name = kwargs.get("kernel_name") or km.default_kernel_name
        return await measured_start(started, size_of(km.kernel_spec_manager, name))

    return wrapper


def size_of(ksm: Any, kernel_name: str) -> str:
    """The size label of a kernelspec (``cpu`` for one without a GPU size, or an unknown one)."""
    try:
        profile = ksm.profile_of(kernel_name) if isinstance(ksm, ElasticKernelSpecManager) else None
    except NoSuchKernel:
        profile = None
    return metrics.size_label(profile)
