"""Failed kernel pods kept for a while, so an admin can still read them.

A kernel pod whose container failed on its own (an import error in the image, OOMKilled, a crash)
used to be deleted at once, and ``kubectl logs`` then had nothing to show. Now it is kept for
``ElasticKubernetesProvisioner.failed_pod_retention`` seconds (0: deleted at once, as before):

* relabelled ``app.kubernetes.io/component=kernel-failed``, so it leaves the kernels' pod watch at
  once: it holds no slice (the allocator's slice is released as before; a terminated pod holds no
  node resources either), is no kernel, and a restarted server does not adopt it; the kernel's next pod gets
  another name (the kept pod keeps its own);
* annotated with when it goes (:data:`DELETE_AFTER`), and deleted then by this server, or by the
  next one that starts, whichever comes first (:meth:`FailedPods.sweep`). The deletion names the
  pod's uid: a new pod of the same name is never deleted in its place.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from kubernetes import client

from kernelmgr.kube.labels import (
    COMPONENT_LABEL,
    DEFAULT_INSTANCE,
    FAILED_KERNEL,
    INSTANCE_LABEL,
    KERNEL_ID_LABEL,
    LEGACY_KERNEL_ID_LABEL,
    legacy_selector,
    relabel,
    selector,
)

#: The component label of a kept failed kernel pod (kernel pods are ``kernel``).
FAILED_COMPONENT = FAILED_KERNEL
#: When a kept pod is deleted (RFC 3339, UTC).
DELETE_AFTER = "elastic.jupyter.org/delete-after"


class FailedPods:
    """Keeps failed kernel pods of one server's cluster, and deletes them when their time is up."""

    def __init__(
        self, core_of: Callable[[str | None], Any], log: logging.Logger, instance: str = DEFAULT_INSTANCE
    ) -> None:
        self.instance = instance
        #: kubeconfig -> the Core API (:meth:`KubeCluster.core`).
        self.core_of = core_of
        self.log = log
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def keep(self, pod: Any, seconds: float, kubeconfig: str | None = None) -> bool:
        """Take ``pod`` out of the kernels and keep it ``seconds``; ``False`` if it could not be
        (it is gone, or the patch was refused): the caller deletes it as before."""
        name, namespace = pod.metadata.name, pod.metadata.namespace
        until = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)
        labels = pod.metadata.labels or {}
        # A pod an earlier version started gets this version's labels (and loses the old ones).
        new = {COMPONENT_LABEL: FAILED_COMPONENT, INSTANCE_LABEL: self.instance}
        if LEGACY_KERNEL_ID_LABEL in labels:
            new[KERNEL_ID_LABEL] = labels[LEGACY_KERNEL_ID_LABEL]
        patch = {
            "metadata": {
                "labels": relabel(labels, new),
                "annotations": {DELETE_AFTER: until.strftime("%Y-%m-%dT%H:%M:%SZ")},
            }
        }
        try:
            await asyncio.to_thread(self.core_of(kubeconfig).patch_namespaced_pod, name, namespace, patch)
        except client.ApiException as exc:
            if exc.status != 404:
                self.log.warning("could not keep failed pod %s/%s: %s", namespace, name, exc.reason)
            return False
        self.log.info("Keeping failed kernel pod %s/%s for %g s (kubectl logs)", namespace, name, seconds)
        self._delete_later(namespace, name, pod.metadata.uid, seconds, kubeconfig)
        return True

    async def sweep(self, namespace: str, kubeconfig: str | None = None) -> None:
        """The kept pods in ``namespace`` (a previous server's too): delete those whose time is up,
        and the others when it is."""
        core = self.core_of(kubeconfig)
        kept = []
        for chosen in (selector(self.instance, FAILED_COMPONENT), legacy_selector(FAILED_COMPONENT)):
            listed = await asyncio.to_thread(core.list_namespaced_pod, namespace, label_selector=chosen)
            kept += listed.items
        now = dt.datetime.now(dt.timezone.utc)
        for pod in kept:
            annotations = pod.metadata.annotations or {}
            try:
                until = dt.datetime.fromisoformat(annotations[DELETE_AFTER].replace("Z", "+00:00"))
            except (KeyError, ValueError):
                until = now  # not ours to guess: its time is up
            self._delete_later(
                namespace, pod.metadata.name, pod.metadata.uid, (until - now).total_seconds(), kubeconfig
            )

    def _delete_later(
        self, namespace: str, name: str, uid: str, seconds: float, kubeconfig: str | None
    ) -> None:
        loop = asyncio.get_running_loop()
        key = (namespace, uid)
        if key in self._timers:
            return

        def due() -> None:
            self._timers.pop(key, None)
            task = loop.create_task(self._delete(namespace, name, uid, kubeconfig))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._timers[key] = loop.call_later(max(0.0, seconds), due)

    async def _delete(self, namespace: str, name: str, uid: str, kubeconfig: str | None) -> None:
        body = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid))
        try:
            await asyncio.to_thread(
                self.core_of(kubeconfig).delete_namespaced_pod, name, namespace, body=body
            )
        except client.ApiException as exc:
            if exc.status not in (404, 409):  # gone, or another pod of that name now: not this one
                self.log.warning("could not delete kept pod %s/%s: %s", namespace, name, exc.reason)

    def stop(self) -> None:
        """Forget the timers (server exit): the next server's :meth:`sweep` deletes what is left."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
