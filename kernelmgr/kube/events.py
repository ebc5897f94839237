"""Kubernetes Events on kernel pods: what the server did to a kernel, where ``kubectl`` looks.

``kubectl describe pod kernel-<id>`` and ``kubectl get events`` show the scheduler's and the kubelet's
story of a pod; an admin also needs the server's: the kernel started, was hibernated (why, how long,
how big its checkpoint), resumed, lost with its node, failed to start (why). One core/v1 Event per
step, ``involvedObject`` the pod (name, namespace and uid: a hibernated kernel's Event names the pod
that was deleted, which ``kubectl get events --field-selector involvedObject.name=<pod>`` still
lists until the API server's event TTL, one hour by default).

Events are best effort: created off the event loop in the background, never awaited by a start or a
hibernation, a refusal (403: the Role lacks ``events create``) logged once. Reasons are a fixed set
(:data:`REASONS`), the message a sentence.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client

#: Lifecycle actions (:mod:`kernelmgr.lifecycle.events`) -> (Event reason, Warning?).
LIFECYCLE_REASONS = {
    "hibernate": ("Hibernated", False),
    "hibernate_failed": ("HibernationFailed", True),
    "resume": ("Resumed", False),
    "lost": ("KernelLost", True),
}
STARTED, LAUNCH_FAILED = "KernelStarted", "LaunchFailed"
REASONS = frozenset({STARTED, LAUNCH_FAILED, *(reason for reason, _ in LIFECYCLE_REASONS.values())})
#: ``source.component`` / ``reportingComponent`` of every Event the server makes.
COMPONENT = "jupyter-elastic-kernels"
#: An Event message longer than this is cut (the API server refuses more than 1 KiB in events.k8s.io).
MAX_MESSAGE = 1024


@dataclass(frozen=True)
class PodRef:
    """The pod an Event is about."""

    namespace: str
    name: str
    uid: str | None = None

    @classmethod
    def of(cls, pod: Any) -> PodRef | None:
        metadata = getattr(pod, "metadata", None)
        if metadata is None or not metadata.name or not metadata.namespace:
            return None
        return cls(metadata.namespace, metadata.name, metadata.uid)


def event_body(ref: PodRef, reason: str, message: str, warning: bool, instance: str) -> dict[str, Any]:
    """A core/v1 Event about ``ref`` (plain dict, the API server validates it)."""
    now = dt.datetime.now(dt.timezone.utc)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": ref.namespace, "name": ref.name}
    if ref.uid:
        involved["uid"] = ref.uid
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{ref.name}.", "namespace": ref.namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class PodEvents:
    """Creates the Events of one server's kernel pods (``core_of(kubeconfig)``: the Core API)."""

    def __init__(
        self,
        core_of: Callable[[str | None], Any],
        find_pod: Callable[[str], Any],
        log: logging.Logger,
        instance: str,
    ) -> None:
        self.core_of = core_of
        #: kernel id -> its pod as the watch saw it last (running, or deleted just now), or None.
        self.find_pod = find_pod
        self.log = log
        self.instance = instance
        self._tasks: set[asyncio.Task[None]] = set()
        self._refused = False

    def record(
        self,
        ref: PodRef | None,
        reason: str,
        message: str,
        warning: bool = False,
        kubeconfig: str | None = None,
    ) -> None:
        """Create the Event in the background (nothing without a pod or a running loop)."""
        if ref is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        body = event_body(ref, reason, message, warning, self.instance)
        task = loop.create_task(self._create(ref.namespace, body, kubeconfig))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def lifecycle(self, action: str, kernel_id: str, msg: str, fields: dict[str, Any]) -> None:
        """A listener of :class:`~kernelmgr.lifecycle.events.LifecycleEvents`: the actions that
        change a kernel's pod become Events on it."""
        if action not in LIFECYCLE_REASONS:
            return
        reason, warning = LIFECYCLE_REASONS[action]
        self.record(PodRef.of(self.find_pod(kernel_id)), reason, f"kernel {kernel_id}: {msg}", warning)

    async def _create(self, namespace: str, body: dict[str, Any], kubeconfig: str | None) -> None:
        try:
            core = self.core_of(kubeconfig)
            await asyncio.to_thread(core.create_namespaced_event, namespace, body)
        except client.ApiException as exc:
            if not self._refused:
                self._refused = exc.status == 403
                self.log.warning(
                    "could not create a Kubernetes Event in %s: %s", namespace, exc.reason or exc
                )
        except Exception as exc:  # best effort: an Event never fails what it reports
            self.log.debug("could not create a Kubernetes Event in %s: %s", namespace, exc)

    async def drain(self) -> None:
        """Wait for the Events still being created (tests, server stop)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
