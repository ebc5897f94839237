"""One active gateway among several: a ``coordination.k8s.io`` Lease, held and renewed.

Two gateway replicas (``replicas: 2``) share the kernel pods and the kernel records in the API;
only the holder of the Lease may write them. The others are standbys: they answer no kernel
operation, and the Service sends them nothing (it selects the serving label,
:mod:`kernelmgr.kube.serving_label`, or, without one, readiness) until the holder stops renewing and
one of them takes the Lease over.

Timing (the same rules as client-go's leader election): the holder renews every ``retry_period``;
a standby takes over once it has seen the same Lease record, unrenewed, for ``lease_duration``
on its own clock (no clock is compared across machines). The holder counts itself fenced as soon
as its last successful renewal is older than ``renew_deadline`` (< ``lease_duration``), by its
monotonic clock, so a holder stopped, partitioned or starved (SIGSTOP, a paused VM) knows it lost
the Lease before any standby may take it, and :meth:`LeaderLease.check` refuses every write from
then on. A gateway that loses the Lease exits (its pod restarts as a standby): its kernels are the
new holder's, and anything it still did to them would race the new holder.

Failover time: a SIGKILLed holder is replaced within ``lease_duration + retry_period`` (plus the
new holder's adoption of the running pods, one list).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from traitlets import Bool, Float, Unicode
from traitlets.config import LoggingConfigurable

from kernelmgr.core.errors import ConfigError


class Fenced(RuntimeError):
    """A write refused because this gateway does not hold the Lease (a standby, or a fenced leader)."""


def default_identity() -> str:
    """The pod's name in a cluster (its hostname), plus the process id: unique per gateway process."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{os.getpid()}"


def _micro_time(when: dt.datetime) -> str:
    """A Lease's MicroTime, as the API server parses it (always six fraction digits)."""
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderLease:
    """Acquire and renew one Lease on a thread; :meth:`holds` says whether writes are allowed."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        log: logging.Logger | None = None,
    ) -> None:
        if not 0 < retry_period < renew_deadline < lease_duration:
            raise ValueError(
                "the Lease timings need 0 < retry_period < renew_deadline < lease_duration, got "
                f"{retry_period}, {renew_deadline}, {lease_duration}"
            )
        from kubernetes import client  # the Kubernetes extra: imported where used, so the settings need none

        self.api: Any = client.CoordinationV1Api(api)  # Any: we send plain dict bodies
        self._api_exception = client.ApiException
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.log = log or logging.getLogger(__name__)
        #: Called once, on the lease thread, when this gateway becomes the holder.
        self.on_started: list[Callable[[], None]] = []
        #: Called once, on the lease thread, when a holder lost the Lease (after it is fenced).
        self.on_lost: list[Callable[[], None]] = []
        self.leading = False
        self.lost = False
        #: Set by the gateway once, holding the Lease, it has taken the kernels over (ready to serve).
        self.serving = False
        self._renewed_at = -float("inf")  # monotonic time of the last successful acquire/renew
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, resourceVersion) seen last
        self._observed_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what the rest of the gateway asks

    def holds(self) -> bool:
        """This gateway holds the Lease and renewed it within ``renew_deadline`` (monotonic clock)."""
        return self.leading and not self.lost and time.monotonic() - self._renewed_at < self.renew_deadline

    def check(self, what: str = "write to the cluster") -> None:
        """Raise :class:`Fenced` unless this gateway holds the Lease (before every write)."""
        if not self.holds():
            raise Fenced(
                f"this gateway ({self.identity}) does not hold the Lease {self.namespace}/{self.name}"
                f" and may not {what}: another gateway serves the kernels"
            )

    def ready(self) -> bool:
        """Holds the Lease and has taken the kernels over: the readiness probe's answer."""
        return self.serving and self.holds()

    def holder(self) -> str | None:
        """The holder last seen (this gateway's identity while it holds the Lease)."""
        if self.holds():
            return self.identity
        return None if self._observed is None else self._observed[0]

    # ---- the thread

    def start(self) -> LeaderLease:
        self._thread = threading.Thread(target=self._run, name="elastic-leader-lease", daemon=True)
        self._thread.start()
        return self

    def stop(self, release: bool = True) -> None:
        """Stop renewing; with ``release``, empty the holder so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.retry_period + 5)
        if release and self.holds():
            try:
                lease = self.api.read_namespaced_lease(self.name, self.namespace)
                if lease.spec.holder_identity == self.identity:
                    body = {
                        "metadata": {"resourceVersion": lease.metadata.resource_version},
                        "spec": {"holderIdentity": None, "leaseDurationSeconds": 1},
                    }
                    self.api.patch_namespaced_lease(self.name, self.namespace, body)
            except Exception as exc:  # the standby then waits out the lease duration
                self.log.warning("Could not release the Lease %s/%s: %s", self.namespace, self.name, exc)
        self.leading = False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._try_once()
            except Exception as exc:
                self.log.warning("Lease %s/%s: %s", self.namespace, self.name, exc)
            if self.leading and not self.holds():
                self._lose("its last renewal is older than the renew deadline")
                return
            self._stop.wait(self.retry_period)

    def _try_once(self) -> None:
        # Before the request: a renewal counts from when it was sent, never from its late answer.
        sent = time.monotonic()
        now = dt.datetime.now(dt.timezone.utc)
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except self._api_exception as exc:
            if exc.status != 404:
                raise
            body = {
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(now, now, 0),
            }
            try:
                self.api.create_namespaced_lease(self.namespace, body)
            except self._api_exception as created:
                if created.status == 409:
                    return  # another gateway made it first: read it next time
                raise
            self._acquired(sent)
            return
        spec = lease.spec
        observed = (spec.holder_identity, spec.renew_time, lease.metadata.resource_version)
        if observed != self._observed:
            self._observed = observed
            self._observed_at = time.monotonic()
        mine = spec.holder_identity == self.identity
        if not mine:
            if self.leading:
                self._lose(f"{spec.holder_identity} holds it now")
                return
            free = not spec.holder_identity
            expired = time.monotonic() - self._observed_at > float(
                spec.lease_duration_seconds or self.lease_duration
            )
            if not (free or expired):
                return
        transitions = int(spec.lease_transitions or 0) + (0 if mine else 1)
        acquired = spec.acquire_time if mine and spec.acquire_time is not None else now
        body = {
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": lease.metadata.resource_version,
            },
            "spec": self._spec(acquired, now, transitions),
        }
        try:
            # The resourceVersion makes this a compare-and-swap: of two standbys, one wins.
            self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except self._api_exception as exc:
            if exc.status == 409:
                return  # someone else wrote it since we read it: read again
            raise
        if not mine:
            self.log.info(
                "Took over the Lease %s/%s from %r", self.namespace, self.name, spec.holder_identity
            )
        self._acquired(sent)

    def _spec(self, acquired: dt.datetime, now: dt.datetime, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration)),
            "acquireTime": _micro_time(acquired),
            "renewTime": _micro_time(now),
            "leaseTransitions": transitions,
        }

    def _acquired(self, sent: float) -> None:
        if self.lost:
            return
        self._renewed_at = sent
        if not self.leading:
            self.leading = True
            self.log.info("This gateway (%s) holds the Lease %s/%s", self.identity, self.namespace, self.name)
            for callback in list(self.on_started):
                callback()

    def _lose(self, why: str) -> None:
        self.lost = True
        self.leading = False
        self.log.critical(
            "This gateway (%s) lost the Lease %s/%s (%s): it writes nothing more",
            self.identity,
            self.namespace,
            self.name,
            why,
        )
        for callback in list(self.on_lost):
            callback()


class ElasticLeaderElection(LoggingConfigurable):
    """More than one gateway (Kubernetes mode): the Lease that makes one of them the active one."""

    enabled = Bool(
        False,
        config=True,
        help="""Run as one of several gateway replicas: only the holder of the Lease serves kernels and
        writes to the cluster; the others wait (not ready) and take over when it stops renewing. The
        Helm chart turns it on. Off: this gateway is the only one and writes without asking.""",
    )
    lease_name = Unicode(
        "jupyter-elastic-kernels-gateway",
        config=True,
        help="Name of the coordination.k8s.io Lease, in ElasticKubernetesProvisioner.state_namespace "
        "(empty: ElasticKubernetesProvisioner.namespace).",
    )
    identity = Unicode(
        "",
        config=True,
        help="This gateway's name in the Lease (empty: the pod's name, from POD_NAME or the hostname, "
        "and the pid).",
    )
    serving_label = Unicode(
        "",
        config=True,
        help="""A label key the holder puts on its own pod (value "true") once it serves the kernels, and
        every gateway takes off its pod as it starts; the gateway Service selects it, so standbys can be
        Ready and a rolling update hands over without a gap (the Helm chart sets
        elastic.jupyter.org/serving). Needs POD_NAME and POD_NAMESPACE (the downward API) and patch
        on pods in the gateway's namespace. Empty: only the holder is Ready, and the Service
        selects readiness.""",
    )
    lease_duration = Float(
        15.0,
        config=True,
        help="Seconds a standby waits, seeing the Lease unrenewed, before it takes over (the failover time, "
        "plus retry_period and the adoption of the running pods).",
    )
    renew_deadline = Float(
        10.0,
        config=True,
        help="Seconds after its last renewal at which the holder stops writing and exits (< lease_duration).",
    )
    retry_period = Float(
        2.0,
        config=True,
        help="Seconds between the holder's renewals and the standbys' tries (< renew_deadline).",
    )

    def build(self, api: Any, namespace: str, identity: str) -> LeaderLease:
        """The Lease to start; ConfigError when the timings do not nest."""
        try:
            return LeaderLease(
                api,
                namespace,
                self.lease_name,
                self.identity or identity,
                lease_duration=self.lease_duration,
                renew_deadline=self.renew_deadline,
                retry_period=self.retry_period,
                log=self.log,
            )
        except ValueError as exc:
            raise ConfigError(f"ElasticLeaderElection: {exc}") from None
