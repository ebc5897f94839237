"""Warm pods: per GPU size, pods that already hold a slice and imported the frameworks, for kernels to take.

A local warm process can take any slice later (CUDA reads ``CUDA_VISIBLE_DEVICES`` when it
initialises); a pod cannot: its GPU resources are fixed when it is scheduled. So a warm pod holds a
slice of its size from the start, booked in the allocator under ``warm:<pod name>``
(:data:`~kernelmgr.core.allocator.WARM_HOLDER_PREFIX`), shown as warm in ``/api/elastic/gpus`` and the
metrics, never counted as a kernel. That is the trade-off an admin makes with
``ElasticKubernetesProvisioner.warm_pods`` (default off): GPUs held by nobody, for resumes and starts
that skip scheduling, image start and the framework import. A launch that needs room a warm pod holds
takes it back (:meth:`WarmPods.make_room`): warm pods never keep a user from a GPU.

A kernel that takes a warm pod (:meth:`WarmPods.take`) takes its slice
(:meth:`~kernelmgr.core.allocator.SliceAllocator.transfer`) and the pod: relabelled as the kernel's,
handed its connection, its owner's key and the checkpoint to restore over the pod's HTTP protocol
(:mod:`kernelmgr.kube.warm_pod`, :mod:`kernelmgr.kube.warm_client`). A pod serves one kernel, once,
and is deleted when that kernel hibernates or ends; the pool refills in the background.

The pool lives in one namespace (the ``namespace`` setting): with ``namespace_template`` each
owner's kernels run in their own, where no pod made before its owner was known can go, so warm pods
are refused there. Leftover warm pods of an earlier server are deleted at start (they hold no one's
state); pods already taken were relabelled as kernel pods and are adopted as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernelmgr.core.allocator import WARM_HOLDER_PREFIX
from kernelmgr.core.errors import CapacityError, ConfigError
from kernelmgr.kube.labels import WARM_KERNEL, legacy_selector, selector
from kernelmgr.kube.manifests import (
    POD_KERNEL,
    make_warm_pod,
    make_warm_secret,
    owner_reference,
)
from kernelmgr.kube.nodes import follow_pod_node
from kernelmgr.kube.warm_client import WarmPodClient, WarmPodError
from kernelmgr.warm.settings import check_entry, read_count, read_preload, read_starts

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime
    from kernelmgr.kube.cluster import KubeCluster

KEY = "ElasticKubernetesProvisioner.warm_pods"
FIELDS = ("count", "preload", "starts")
MISS_REASONS = ("empty", "preload_failed", "not_poolable", "handoff_failed")
#: Seconds between two looks at the pool when nothing asks for one sooner.
LOOK_INTERVAL = 5.0
#: While a pod is starting, it is looked at this often.
STARTING_INTERVAL = 0.5
#: Seconds the pool waits for a pod's status answer.
STATUS_TIMEOUT = 5.0


class WarmPodsConfigError(ValueError):
    """One line naming the key to fix."""


@dataclass(frozen=True)
class WarmPodSettings:
    size: str
    count: int = 1
    preload: tuple[str, ...] = ()
    starts: bool = False


def parse_warm_pods(raw: Any, sizes: list[str]) -> dict[str, WarmPodSettings]:
    """Validate ``warm_pods``; raises :class:`WarmPodsConfigError` at the first mistake."""
    if not isinstance(raw, dict):
        raise WarmPodsConfigError(f"{KEY} must be a dict of GPU size to settings")
    pools: dict[str, WarmPodSettings] = {}
    for size, entry in raw.items():
        where = f"{KEY}[{size!r}]"
        if size not in sizes:
            raise WarmPodsConfigError(f"{where}: {size!r} is not a GPU size ({', '.join(sizes) or 'none'})")
        entry = check_entry(entry, where, FIELDS, WarmPodsConfigError)
        count = read_count(entry, "count", where, WarmPodsConfigError)
        preload = read_preload(entry, where, WarmPodsConfigError)
        pools[size] = WarmPodSettings(size, count, preload, read_starts(entry, where, WarmPodsConfigError))
    return pools


def build_warm_pods(cluster: KubeCluster, runtime: ElasticRuntime, log: logging.Logger) -> WarmPods | None:
    """The pool the cluster's ``warm_pods`` setting asks for (``None``: none); :class:`ConfigError`
    in one line when it cannot work with the rest of the configuration."""
    kube = cluster.settings
    if not kube.warm_pods:
        return None
    try:
        settings = parse_warm_pods(kube.warm_pods, list(runtime.profiles))
    except WarmPodsConfigError as exc:
        raise ConfigError(str(exc)) from None
    if kube.namespace_template:
        raise ConfigError(
            f"{KEY} needs one kernel namespace: with namespace_template each owner's kernels run in their "
            "own, where a pod made before its owner is known cannot go"
        )
    if not kube.checkpoint_claim:
        raise ConfigError(
            f"{KEY} needs ElasticKubernetesProvisioner.checkpoint_claim: a kernel that took a warm pod may "
            "resume later in a cold one, which reads its checkpoint from the claim"
        )
    if POD_KERNEL not in kube.command:
        raise ConfigError(
            f"{KEY} needs the default ElasticKubernetesProvisioner.command ({POD_KERNEL}): a warm pod "
            "becomes that kernel in its own process"
        )
    return WarmPods(cluster, runtime, settings, log)


def warm_pod_name(size: str) -> str:
    """``warm-<size as a DNS label part>-<8 hex>``."""
    label = re.sub(r"[^a-z0-9-]+", "-", size.lower()).strip("-")[:40] or "size"
    return f"warm-{label}-{secrets.token_hex(4)}"


@dataclass
class WarmPod:
    name: str
    size: str
    token: str
    ip: str | None = None
    ready: bool = False
    #: Seen in a list of the warm pods (one just created may not be, once).
    listed: bool = False
    created: float = field(default_factory=time.monotonic)

    @property
    def holder(self) -> str:
        return f"{WARM_HOLDER_PREFIX}{self.name}"


class WarmPods:
    """The warm pods of one server, in the cluster's ``namespace``."""

    def __init__(
        self,
        cluster: KubeCluster,
        runtime: ElasticRuntime,
        settings: dict[str, WarmPodSettings],
        log: logging.Logger | None = None,
    ) -> None:
        self.cluster = cluster
        self.kube = cluster.settings
        self.runtime = runtime
        self.settings = settings
        self.namespace = cluster.settings.namespace
        self.log = log or logging.getLogger(__name__)
        self.pods: dict[str, list[WarmPod]] = {size: [] for size in settings}
        #: Why a size stopped refilling (its preload fails: it would again).
        self.broken: dict[str, tuple[str, str]] = {}
        self.hits: dict[tuple[str, str], int] = {}
        self.misses: dict[tuple[str, str], int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._deleting: set[asyncio.Task[None]] = set()
        self._capacity_logged: set[str] = set()
        #: Until when a size makes no new warm pod (its last one never became ready).
        self._backoff: dict[str, float] = {}

    # -- what the server and the provisioner ask -----------------------------------------------

    def counts(self) -> dict[str, dict[str, int]]:
        """``{size: {"ready": n, "starting": m}}``."""
        return {
            size: {"ready": sum(p.ready for p in pods), "starting": sum(not p.ready for p in pods)}
            for size, pods in self.pods.items()
        }

    def serves(self, size: str | None, use: str) -> bool:
        settings = self.settings.get(size) if size else None
        return settings is not None and (use == "resume" or settings.starts)

    def take(self, size: str, use: str) -> WarmPod | None:
        """A ready warm pod of ``size``, now the caller's (its slice still booked under its holder
        until the caller transfers it), or ``None``: the launch starts cold. Counted either way."""
        pod = None
        if size in self.broken:
            reason = self.broken[size][0]
        else:
            pod = next((p for p in self.pods.get(size, []) if p.ready), None)
            reason = "empty"
        if pod is None:
            self.miss(size, reason)
        else:
            self.pods[size].remove(pod)
        self._wake.set()
        return pod

    def hit(self, size: str, use: str) -> None:
        """A kernel serves from a warm pod it took (``use``: resume or start)."""
        self.hits[(size, use)] = self.hits.get((size, use), 0) + 1

    def miss(self, size: str, reason: str) -> None:
        """A launch the pool serves started cold (``reason``: one of :data:`MISS_REASONS`)."""
        self.misses[(size, reason)] = self.misses.get((size, reason), 0) + 1

    def make_room(self, fits: Callable[[], bool]) -> int:
        """Give back warm slices (starting pods first) until ``fits()`` says the launch fits; how
        many were given back. Their pods are deleted in the background."""
        given = 0
        order = sorted(
            (pod for pods in self.pods.values() for pod in pods),
            key=lambda p: p.ready,  # a pod still starting is the cheaper one to lose
        )
        for pod in order:
            if fits():
                break
            self._drop(pod, "its GPU is needed by a kernel")
            given += 1
        return given

    def give_back(self, pod: WarmPod, why: str) -> None:
        """A taken pod that could not become the kernel: delete it (its slice is the caller's)."""
        self.log.warning("warm pod %s dropped: %s", pod.name, why)
        self._delete_later(pod.name)

    # -- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await self._remove_leftovers()
        except Exception as exc:
            self.log.error("warm pods: could not list leftovers in %s: %s", self.namespace, exc)
        while not self._closed:
            try:
                await self.look()
            except Exception as exc:
                self.log.warning("warm pods: %s", exc)
            starting = any(not p.ready for pods in self.pods.values() for p in pods)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), STARTING_INTERVAL if starting else LOOK_INTERVAL)

    async def _list(self, chosen: str | None = None) -> list[Any]:
        """This release's warm pods in the namespace (not yet taken), one API call; ``chosen``: those
        of another label selector."""
        chosen = chosen or selector(self.kube.instance, WARM_KERNEL)
        core = self.cluster.core()
        listed = await asyncio.to_thread(core.list_namespaced_pod, self.namespace, label_selector=chosen)
        return list(listed.items)

    async def look(self) -> None:
        """One round: forget pods that are gone, mark the ones that became ready, create what is missing."""
        seen = {pod.metadata.name: pod for pod in await self._list()}
        for size, pods in self.pods.items():
            for pod in list(pods):
                await self._check(size, pod, seen.get(pod.name))
        for size, settings in self.settings.items():
            if self._backoff.get(size, 0.0) > time.monotonic():
                continue
            while not self._closed and size not in self.broken and len(self.pods[size]) < settings.count:
                if not await self._create(settings):
                    break

    async def _check(self, size: str, pod: WarmPod, seen: Any) -> None:
        if seen is None:  # gone (deleted by someone), unless only just created and not listed yet
            if pod.listed or time.monotonic() - pod.created > self.kube.launch_timeout:
                self._drop(pod, "its pod is gone")
            return
        pod.listed = True
        if seen.metadata.deletion_timestamp is not None or seen.status.phase in ("Succeeded", "Failed"):
            self._drop(pod, "its pod ended")
            return
        if pod.ready:
            return
        waited = time.monotonic() - pod.created
        if waited > self.kube.launch_timeout:
            # Unschedulable (the cluster has no room the allocator knows of), an image that does not
            # pull, a preload that hangs: give the GPU back and wait as long before the next try.
            self._backoff[size] = time.monotonic() + self.kube.launch_timeout
            self.log.warning(
                "warm pod %s (%s) not ready after %.0f s (phase %s); dropped, the next in %.0f s",
                pod.name,
                size,
                waited,
                seen.status.phase,
                self.kube.launch_timeout,
            )
            self._drop(pod, "it did not become ready in time")
            return
        if seen.status.phase != "Running" or not seen.status.pod_ip:
            return
        if pod.ip is None:  # first seen running: its slice follows it to its node
            granted = self.runtime.allocator.slice_of(pod.holder)
            follow_pod_node(self.runtime, pod.holder, granted, seen, self.log)
        pod.ip = seen.status.pod_ip
        try:
            status = await asyncio.to_thread(self.client(pod).status)
        except WarmPodError:
            return  # its HTTP server is not up yet
        if status.get("state") == "ready":
            pod.ready = True
            self.log.info(
                "warm pod %s (%s) ready: preloaded in %.2f s", pod.name, size, status.get("seconds", 0)
            )
        elif status.get("state") == "failed":
            reason = str(status.get("reason", "unknown"))
            self.broken[size] = ("preload_failed", reason)
            self.log.error("warm pods of %s disabled, kernels start cold: %s", size, reason)
            self._drop(pod, "its preload failed")

    def client(self, pod: WarmPod) -> WarmPodClient:
        """A client for the pool's own looks (status): a short deadline, so a pod that stalls does
        not hold up the pool, or a worker thread, for long."""
        assert pod.ip is not None
        return WarmPodClient(pod.ip, self.kube.warm_pod_port, pod.token, timeout=STATUS_TIMEOUT)

    async def _create(self, settings: WarmPodSettings) -> bool:
        name = warm_pod_name(settings.size)
        pod = WarmPod(name=name, size=settings.size, token=secrets.token_urlsafe(32))
        try:
            self.runtime.allocator.allocate(pod.holder, self.runtime.profile(settings.size))
        except CapacityError as exc:
            if settings.size not in self._capacity_logged:
                self._capacity_logged.add(settings.size)
                self.log.info("warm pods of %s wait for a free GPU: %s", settings.size, exc)
            return False
        self._capacity_logged.discard(settings.size)
        self.pods[settings.size].append(pod)
        try:
            await self._create_pod(name, settings, pod.token)
        except Exception as exc:
            self.log.error("warm pod %s for %s could not be created: %s", name, settings.size, exc)
            self._drop(pod, "it could not be created")
            return False
        self.log.info(
            "warm pod %s created for %s (preload: %s)",
            name,
            settings.size,
            ", ".join(settings.preload) or "nothing",
        )
        return True

    async def _create_pod(self, name: str, settings: WarmPodSettings, token: str) -> None:
        """The pod and its token's Secret (owned by the pod): Secret first, so the pod finds it."""
        core = self.cluster.core()
        secret = make_warm_secret(name, token, self.kube.instance)
        await asyncio.to_thread(core.create_namespaced_secret, self.namespace, secret)
        manifest = make_warm_pod(
            self.kube.pod_template(),
            name=name,
            profile=self.runtime.profile(settings.size),
            preload=settings.preload,
        )
        try:
            pod = await asyncio.to_thread(core.create_namespaced_pod, self.namespace, manifest)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(core.delete_namespaced_secret, name, self.namespace)
            raise
        owner = owner_reference(name, pod.metadata.uid)
        await asyncio.to_thread(core.patch_namespaced_secret, name, self.namespace, owner)

    async def _delete_pod(self, name: str) -> None:
        """Delete a warm pod and its Secret (gone already: nothing to do)."""
        await self.cluster.delete_pod_and_secret(self.namespace, name)

    def _drop(self, pod: WarmPod, why: str) -> None:
        """Release the pod's slice now, delete the pod in the background."""
        pods = self.pods.get(pod.size, [])
        if pod in pods:
            pods.remove(pod)
        self.runtime.allocator.release(pod.holder)
        self.log.info("warm pod %s dropped: %s", pod.name, why)
        self._delete_later(pod.name)
        self._wake.set()

    def _delete_later(self, name: str) -> None:
        task = asyncio.get_running_loop().create_task(self._delete_pod(name))
        self._deleting.add(task)
        task.add_done_callback(self._deleting.discard)

    async def _remove_leftovers(self) -> None:
        # An earlier version's warm pods too (bare labels): nothing would take or delete them.
        for pod in await self._list() + await self._list(legacy_selector(WARM_KERNEL)):
            self.log.info("warm pods: deleting %s, left by an earlier server", pod.metadata.name)
            await self._delete_pod(pod.metadata.name)

    async def close(self) -> None:
        """Server stop: delete every warm pod not taken, give their slices back."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for pods in self.pods.values():
            for pod in list(pods):
                self.runtime.allocator.release(pod.holder)
                with contextlib.suppress(Exception):
                    await self._delete_pod(pod.name)
            pods.clear()
        if self._deleting:
            await asyncio.gather(*self._deleting, return_exceptions=True)


__all__ = [
    "MISS_REASONS",
    "WarmPod",
    "WarmPodSettings",
    "WarmPods",
    "WarmPodsConfigError",
    "build_warm_pods",
    "parse_warm_pods",
]
