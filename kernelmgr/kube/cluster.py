"""The cluster, as the server sees it: its settings, its API clients and its watches.

One :class:`KubeCluster` per server, made and stopped by the extension and carried by the runtime
(``ElasticRuntime.kube``): each kernel's provisioner, the adoption at start, the node inventory,
the node agents' sampler and the warm pods ask it, so nothing needs a provisioner of its own (a
made-up kernel id) to read the settings or call the API, and no client or watch sits in a module
global. One API client per kubeconfig (a kernelspec may name another); one pod watch per kernel
namespace in use, not one cluster-wide watch: the server needs no right to read pods elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client, config

from kernelmgr import __version__
from kernelmgr.kube.access import ExplainedCoreV1Api, Fence
from kernelmgr.kube.events import PodEvents
from kernelmgr.kube.failed_pods import FailedPods
from kernelmgr.kube.informer import Informer, PodInformer, without_managed_fields
from kernelmgr.kube.labels import KERNEL, KERNEL_WATCH_SELECTOR, kernel_id_of, legacy_selector, selector
from kernelmgr.kube.leader import default_identity
from kernelmgr.kube.manifests import (
    CONNECTION_FILE,
    KERNELSPEC_ANNOTATION,
    OWNER_ANNOTATION,
    SIZE_ANNOTATION,
    WARM_ANNOTATION,
)
from kernelmgr.kube.namespaces import ensure_namespace
from kernelmgr.kube.node_agents import agent_selector
from kernelmgr.kube.pods import FoundKernel, finished, pod_failure, running
from kernelmgr.kube.settings import KubeSettings


class PodNotRunning(RuntimeError):
    """A kernel's pod did not run (not scheduled, image not pulled, ended at once): the message
    says why, from its conditions, container states and events, for the user's start answer."""


class KubeCluster:
    """The settings, API clients and pod watches of one server's cluster."""

    def __init__(self, settings: KubeSettings | None = None, log: logging.Logger | None = None) -> None:
        self.settings = settings if settings is not None else KubeSettings()
        self.log = log or logging.getLogger(__name__)
        self._clients: dict[str, client.ApiClient] = {}
        self._informers: dict[tuple[str, str], PodInformer] = {}
        self._agent_informers: dict[tuple[str, str], Informer] = {}
        self._namespaces: set[tuple[str, str]] = set()
        #: (kubeconfig, namespace, kind, name) of the DRA objects created (or found) by this server.
        self._side_objects: set[tuple[str, str, str, str]] = set()
        #: Other watches whose health /metrics shows (the node inventory's, the other GPU pods').
        self.extra_informers: list[Informer] = []
        #: Failed kernel pods kept for ``kubectl logs`` (ElasticKubernetesProvisioner.failed_pod_retention).
        self.failed_pods = FailedPods(self.core, self.log, self.settings.instance)
        #: Kubernetes Events on kernel pods (start, hibernate, resume, loss, failure).
        self.events = PodEvents(self.core, self.last_seen_pod, self.log, self.settings.instance)
        #: Who this gateway is in the API server's audit log (the clients' User-Agent) and in the Lease.
        self.identity = default_identity()
        #: Set with more than one gateway (ElasticLeaderElection): every write asks it first.
        self.fence: Fence | None = None

    def _kubeconfig(self, kubeconfig: str | None) -> str:
        return self.settings.kubeconfig if kubeconfig is None else kubeconfig

    def api(self, kubeconfig: str | None = None) -> client.ApiClient:
        """The API client of ``kubeconfig`` (``""``: in-cluster when there, else the default
        kubeconfig; ``None``: the settings' own)."""
        kubeconfig = self._kubeconfig(kubeconfig)
        if kubeconfig not in self._clients:
            configuration = client.Configuration()
            if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)
            else:
                config.load_kube_config(config_file=kubeconfig or None, client_configuration=configuration)
            api = client.ApiClient(configuration)
            api.user_agent = f"jupyter-elastic-kernels/{__version__} ({self.identity})"
            self._clients[kubeconfig] = api
        return self._clients[kubeconfig]

    def core(self, kubeconfig: str | None = None) -> Any:
        """Typed ``Any``: the client's generated stubs do not accept the plain dict manifests we send.

        A 403 from any call raises :class:`~kernelmgr.kube.access.KubeForbidden` naming the rule
        the server's Role lacks (or ``KubeRefused`` with the reason, when admission refused).
        """
        return ExplainedCoreV1Api(self.api(kubeconfig), self.fence)

    def pod_informer(self, namespace: str | None = None, kubeconfig: str | None = None) -> PodInformer:
        """The one watch over the kernel pods of ``namespace``, started on first use."""
        key = (self._kubeconfig(kubeconfig), namespace or self.settings.namespace)
        if key not in self._informers:
            # Its own client: the watch holds a connection for minutes at a time.
            watch_api = client.ApiClient(self.api(key[0]).configuration)
            self._informers[key] = PodInformer(
                watch_api, key[1], KERNEL_WATCH_SELECTOR, instance=self.settings.instance
            ).start()
        return self._informers[key]

    def watched_namespaces(self) -> set[str]:
        """The namespaces with a kernel pod watch."""
        return {namespace for _, namespace in self._informers}

    def kernel_pods(self) -> dict[str, Any]:
        """kernel id -> its pod, from every kernel pod watch's cache (one per kernel namespace in use)."""
        pods: dict[str, Any] = {}
        for informer in list(self._informers.values()):
            pods.update(informer.items())
        return pods

    def informer_health(self) -> list[tuple[str, int, float | None]]:
        """(name, lists so far, seconds since its last list or event) of every watch of the server."""
        now = time.monotonic()
        informers = [*self._informers.values(), *self._agent_informers.values(), *self.extra_informers]
        return [
            (i.name, i.lists, None if i.last_event_at is None else now - i.last_event_at) for i in informers
        ]

    def last_seen_pod(self, kernel_id: str) -> Any | None:
        """The kernel's pod as a watch saw it last: there now, else the one deleted last."""
        for informer in list(self._informers.values()):
            pod = informer.get(kernel_id) or informer.last_deleted(kernel_id)
            if pod is not None:
                return pod
        return None

    def agent_informer(self, namespace: str | None = None, instance: str | None = None) -> Informer:
        """The one watch over the node activity agent pods of release ``instance`` in ``namespace``
        (:func:`~kernelmgr.kube.node_agents.agent_selector`: name, instance and component labels),
        started on first use; keyed by pod name. Needs ``list`` and ``watch`` on pods there."""
        settings = self.settings
        namespace = namespace or settings.node_agent_namespace or settings.namespace
        key = (settings.kubeconfig, namespace)
        if key not in self._agent_informers:
            watch_api = client.ApiClient(self.api().configuration)
            self._agent_informers[key] = Informer(
                ExplainedCoreV1Api(watch_api).list_namespaced_pod,
                key=lambda pod: pod.metadata.name,
                name=f"node-agents-{namespace}",
                list_args=(namespace,),
                list_kwargs={"label_selector": agent_selector(instance or settings.node_agent_instance)},
                transform=without_managed_fields,
            ).start()
        return self._agent_informers[key]

    async def ensure_namespace(self, owner_settings: KubeSettings, namespace: str) -> bool:
        """Make a kernel namespace once (with ``create_namespace``); whether this call created it."""
        key = (owner_settings.kubeconfig, namespace)
        if not owner_settings.create_namespace or key in self._namespaces:
            return False
        created = await asyncio.to_thread(
            ensure_namespace,
            self.api(owner_settings.kubeconfig),
            namespace,
            labels=dict(owner_settings.namespace_labels),
            cluster_role=owner_settings.namespace_cluster_role,
            network_policies=[dict(policy) for policy in owner_settings.namespace_network_policies],
            fence=self.fence,
        )
        self._namespaces.add(key)
        return bool(created)

    async def ensure_side_objects(self, kubeconfig: str, namespace: str, size: str, sides: list[Any]) -> None:
        """Create what a size's pod refers to besides itself (a DRA size's ResourceClaimTemplate,
        or its shared ResourceClaim), once per namespace: named after their content, so an existing
        one is the same object and a changed size gets a new name."""
        for side in sides:
            key = (kubeconfig, namespace, side["kind"], side["metadata"]["name"])
            if key in self._side_objects:
                continue
            resource: Any = client.ResourceV1Api(self.api(kubeconfig))  # plain dict manifests
            create = (
                resource.create_namespaced_resource_claim_template
                if side["kind"] == "ResourceClaimTemplate"
                else resource.create_namespaced_resource_claim
            )
            if self.fence is not None:
                self.fence(f"create {side['kind']}")
            try:
                await asyncio.to_thread(create, namespace, side)
            except client.ApiException as exc:
                if exc.status != 409:  # 409: made already (by us, earlier, or another server)
                    raise RuntimeError(
                        f"could not create {side['kind']} {side['metadata']['name']} in {namespace} "
                        f"for GPU size {size}: {exc.status} {exc.reason}"
                    ) from None
            self._side_objects.add(key)

    async def wait_running(
        self,
        informer: PodInformer,
        kernel_id: str,
        pod: Any,
        namespace: str,
        timeout: float,
        kubeconfig: str | None = None,
    ) -> Any:
        """The kernel's just created ``pod`` as the watch sees it Running with an IP; RuntimeError
        explaining why not (conditions, container states, and then its events) when it ended or
        did not run within ``timeout``."""
        return await self._wait_pod(
            informer,
            kernel_id,
            pod,
            namespace,
            timeout,
            kubeconfig,
            running,
            "not running",
            "ElasticKubernetesProvisioner.launch_timeout",
        )

    async def wait_scheduled(
        self,
        informer: PodInformer,
        kernel_id: str,
        pod: Any,
        namespace: str,
        timeout: float,
        kubeconfig: str | None = None,
    ) -> Any:
        """The kernel's Pending ``pod`` once kube-scheduler bound it to a node (one a cluster
        autoscaler may add meanwhile); :class:`PodNotRunning` saying why not (the scheduler's
        reason) when it ended or was not placed within ``timeout`` (``scale_up_wait``)."""
        return await self._wait_pod(
            informer,
            kernel_id,
            pod,
            namespace,
            timeout,
            kubeconfig,
            lambda seen: bool(seen.spec.node_name),
            "not placed on a node",
            "ElasticKernels.scale_up_wait",
        )

    async def _wait_pod(
        self,
        informer: PodInformer,
        kernel_id: str,
        pod: Any,
        namespace: str,
        timeout: float,
        kubeconfig: str | None,
        reached: Callable[[Any], bool],
        not_yet: str,
        setting: str,
    ) -> Any:
        uid, name = pod.metadata.uid, pod.metadata.name

        def ready_or_done(seen: Any) -> bool:
            if seen is None or seen.metadata.uid != uid:
                return False
            return bool(reached(seen)) or finished(seen)

        def events() -> list[Any]:  # read once, only to explain a failed launch
            core = self.core(kubeconfig)
            try:
                return list(
                    core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
                )
            except client.ApiException:
                return []

        try:
            seen = await informer.wait_for(kernel_id, ready_or_done, timeout)
        except TimeoutError:
            seen = informer.get(kernel_id)
            explained = pod_failure(seen, await asyncio.to_thread(events))
            raise PodNotRunning(
                f"kernel pod {namespace}/{name} {not_yet} after {timeout:g} s ({setting}): {explained}"
            ) from None
        if finished(seen):
            raise PodNotRunning(f"kernel pod {namespace}/{name} ended: {pod_failure(seen)}")
        return seen

    async def delete_pod_and_secret(self, namespace: str, name: str, kubeconfig: str | None = None) -> None:
        """Delete a pod and its Secret now (``grace=0``; gone already: nothing to do)."""
        core = self.core(kubeconfig)
        for delete in (core.delete_namespaced_pod, core.delete_namespaced_secret):
            try:
                await asyncio.to_thread(delete, name, namespace, grace_period_seconds=0)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise

    async def find_kernel_pods(self, namespace: str) -> list[FoundKernel]:
        """The kernel pods in ``namespace``, from the watch's cache and one list of the kernels'
        Secrets (the connection files): what a restarted server adopts."""
        informer = self.pod_informer(namespace)
        if not await asyncio.to_thread(informer.wait_synced, self.settings.launch_timeout):
            raise RuntimeError(f"the pod watch in {namespace} did not sync; kernels not adopted")
        core = self.core()
        instance = self.settings.instance
        secrets = []  # this version's, and those of kernels an earlier version started (bare labels)
        for chosen in (selector(instance, KERNEL), legacy_selector(KERNEL)):
            listed = await asyncio.to_thread(core.list_namespaced_secret, namespace, label_selector=chosen)
            secrets += listed.items
        connections: dict[str, dict[str, Any]] = {}
        for secret in secrets:
            kernel_id = kernel_id_of(secret.metadata.labels, instance)
            raw = (secret.data or {}).get(CONNECTION_FILE)
            if kernel_id and raw:
                connections[kernel_id] = json.loads(base64.b64decode(raw))
        found = []
        for pod in informer.items().values():
            labels, annotations = pod.metadata.labels or {}, pod.metadata.annotations or {}
            kernel_id = kernel_id_of(labels, instance)
            if not kernel_id or OWNER_ANNOTATION not in annotations:
                continue
            info = connections.get(kernel_id)
            alive = running(pod) and pod.metadata.deletion_timestamp is None
            if info is not None and alive:
                info = {**info, "ip": pod.status.pod_ip, "key": str(info.get("key", "")).encode()}
            found.append(
                FoundKernel(
                    kernel_id=kernel_id,
                    namespace=namespace,
                    kernelspec=annotations.get(KERNELSPEC_ANNOTATION, ""),
                    owner=annotations[OWNER_ANNOTATION],
                    size=annotations.get(SIZE_ANNOTATION),
                    running=alive,
                    connection_info=info,
                    pod_name=pod.metadata.name,
                    warm=annotations.get(WARM_ANNOTATION) == "true",
                )
            )
        return found

    async def remove_leftover(self, found: FoundKernel) -> None:
        """Delete a kernel pod and Secret nobody serves any more (ended, or never started), under
        the name the pod has (a warm pod a kernel took keeps its own), and wait until it is gone."""
        name = found.pod_name or f"kernel-{found.kernel_id}"
        core = self.core()
        try:
            await asyncio.to_thread(core.delete_namespaced_pod, name, found.namespace, grace_period_seconds=0)
        except client.ApiException as exc:
            if exc.status != 404:
                self.log.warning("could not delete pod %s: %s", name, exc.reason)
        else:
            informer = self.pod_informer(found.namespace)
            try:
                await informer.wait_for(found.kernel_id, lambda pod: pod is None, self.settings.stop_timeout)
            except TimeoutError:
                self.log.warning("pod %s still there after %g s", name, self.settings.stop_timeout)
        try:
            await asyncio.to_thread(core.delete_namespaced_secret, name, found.namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                self.log.warning("could not delete Secret %s: %s", name, exc.reason)

    def stop(self) -> None:
        """Stop every watch (server exit, tests); joins their threads: call it off the event loop."""
        for informer in [*self._informers.values(), *self._agent_informers.values()]:
            informer.stop()
        self.failed_pods.stop()
        self._informers.clear()
        self._agent_informers.clear()
        self._namespaces.clear()
        self._side_objects.clear()
