"""Per-kernel GPU activity in Kubernetes mode, from the node activity agents.

In a cluster the server cannot ask NVML itself (the kernels run on other nodes, in other PID
namespaces). Each GPU node runs ``jupyter elastic node-agent`` (deploy/kubernetes/node-agent.yaml),
which reports GPU use per pod UID. :class:`ClusterGpuSampler` plays the role the local
:class:`~kernelmgr.activity.gpu.GpuActivitySampler` plays in local mode, for the culler's
sampling timer:

* the agents are found through ONE pod watch (the chart's name, instance and component labels, in
  ``ElasticKubernetesProvisioner.node_agent_namespace``, default the kernel namespace), never a
  list per sample; their pod IPs and ``node_agent_port`` give the URLs, and each request carries
  the agents' shared token (``node_agent_token_file``);
* pod UID -> kernel id comes from the kernel pod watches' caches (the cgroup-derived pod UID is
  proof of which pod a process is in; the kernel id an agent reads from a process's environment is
  only a hint and is not used);
* each sample asks every agent at once (:meth:`NodeAgentClient.collect`, async, never raises) and
  feeds each kernel's utilisation to the same idle bookkeeping as the local sampler
  (:class:`~kernelmgr.activity.gpu.IdleTrack`, keyed by the kernel's pod UID: a resumed kernel
  in a new pod starts afresh).

A kernel is "not measured" (``available=False``, never idle) when its pod is not in the watch's
cache, when no agent runs on its pod's node, or when that agent did not answer or has no NVML. An
agent that answered and lists no GPU process of the kernel's pod means the kernel used no GPU: 0 %.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kernelmgr.activity.gpu import GpuActivity, IdleTrack, track
from kernelmgr.core.errors import ConfigError
from kernelmgr.kube.node_agents import (
    DEFAULT_INSTANCE,
    ClusterActivity,
    NodeAgentClient,
    agent_selector,
    agent_urls,
)

if TYPE_CHECKING:  # the Kubernetes client is an extra: imported where a sampler is started
    from kernelmgr.kube.cluster import KubeCluster
    from kernelmgr.kube.informer import Informer

ORIGIN = "node-agents"


class ClusterGpuSampler:
    """Samples the node agents and attributes their reports to kernels; call :meth:`sample` periodically.

    ``agents`` is the watch over the agent pods; ``kernel_pods`` returns kernel id -> pod from the
    kernel pod watches' caches. Neither is asked anything but its cache.
    """

    def __init__(
        self,
        agents: Informer,
        kernel_pods: Callable[[], Mapping[str, Any]],
        port: int,
        busy_threshold: float = 5.0,
        client: NodeAgentClient | None = None,
        clock: Callable[[], float] = time.time,
        namespace: str = "",
        instance: str = DEFAULT_INSTANCE,
    ) -> None:
        self.agents = agents
        self.instance = instance
        self.kernel_pods = kernel_pods
        self.port = port
        self.busy_threshold = busy_threshold
        self.client = client or NodeAgentClient()
        self.namespace = namespace
        self._clock = clock
        self._tracks: dict[str, IdleTrack] = {}
        #: The last :meth:`NodeAgentClient.collect` result (``None`` before the first sample).
        self.last: ClusterActivity | None = None
        #: agent URL -> node of the agent pod, at the last sample.
        self.agent_nodes: dict[str, str] = {}

    def source(self) -> str:
        """Where GPU activity comes from, as the policy endpoint shows it."""
        if self.agents.failure is not None:
            return f"unavailable: the node agent pod watch is refused: {self.agents.failure}"
        if self.last is None:
            return f"{ORIGIN} (not sampled yet)"
        if not self.agent_nodes:
            where = f" in namespace {self.namespace}" if self.namespace else ""
            return f"unavailable: no running node agent pods ({agent_selector(self.instance)}){where}"
        if self.last.errors:
            failing = "; ".join(f"{url}: {why}" for url, why in sorted(self.last.errors.items()))
            count = f"{len(self.last.errors)} of {len(self.agent_nodes)}"
            return f"{ORIGIN}: {count} agent(s) not usable ({failing})"
        return ORIGIN

    def forget(self, kernel_id: str) -> None:
        """Drop what is remembered about a kernel (it stopped or was hibernated)."""
        self._tracks.pop(kernel_id, None)

    def uid_to_kernel(self, pods: Mapping[str, Any]) -> dict[str, str]:
        """pod UID -> kernel id, from the kernel pod watches' caches."""
        return {pod.metadata.uid: kernel_id for kernel_id, pod in pods.items() if pod.metadata.uid}

    async def sample(self, kernels: Mapping[str, Sequence[str]]) -> dict[str, GpuActivity]:
        """One round of every agent; the activity of each kernel given (kernel id -> its slice's devices)."""
        pods = dict(self.kernel_pods())
        agent_pods = list(self.agents.items().values())
        nodes: dict[str, str] = {}
        for pod in agent_pods:
            for url in agent_urls([pod], self.port, self.instance):
                nodes[url] = str(getattr(pod.spec, "node_name", "") or "")
        self.agent_nodes = nodes
        urls = sorted(nodes)
        result = await self.client.collect(urls, self.uid_to_kernel(pods)) if urls else ClusterActivity()
        self.last = result
        now = self._clock()
        # A kernel not in this sample (hibernated, removed) starts afresh with its next pod.
        for gone in self._tracks.keys() - kernels.keys():
            del self._tracks[gone]
        return {
            kernel_id: self._activity(kernel_id, devices, pods, result, now)
            for kernel_id, devices in kernels.items()
        }

    def _activity(
        self,
        kernel_id: str,
        devices: Sequence[str],
        pods: Mapping[str, Any],
        result: ClusterActivity,
        now: float,
    ) -> GpuActivity:
        pod = pods.get(kernel_id)
        uid = pod.metadata.uid if pod is not None else None
        if pod is None or not uid:
            self.forget(kernel_id)
            return GpuActivity(
                False, "the kernel's pod is not in the pod watch", sampled_at=now, origin=ORIGIN
            )
        kernel_track = track(self._tracks, kernel_id, uid)

        def unmeasured(reason: str) -> GpuActivity:
            kernel_track.unmeasured()
            return GpuActivity(False, reason, last_busy=kernel_track.last_busy, sampled_at=now, origin=ORIGIN)

        if not devices:
            return unmeasured("the kernel has no GPU slice")
        node = pod.spec.node_name if pod.spec is not None else None
        if not node:
            return unmeasured("the kernel's pod is not on a node yet")
        here = [url for url, agent_node in self.agent_nodes.items() if agent_node == node]
        if not here:
            return unmeasured(f"no node agent is running on node {node}")
        errors = [result.errors[url] for url in here if url in result.errors]
        if errors:
            return unmeasured(f"node agent on {node}: {errors[0]}")
        reported = result.kernels.get(kernel_id)
        if reported is None:  # the agent answered and saw no GPU process in the kernel's pod
            utilization: float | None = 0.0
            memory = 0
        else:
            utilization, memory = reported.gpu_utilization, reported.gpu_memory_mib
        idle = kernel_track.measured(utilization, now, self.busy_threshold)
        if utilization is None:
            reason = "MIG device(s): no per-process utilisation there, memory only"
            return GpuActivity(True, reason, None, memory, None, kernel_track.last_busy, now, ORIGIN)
        return GpuActivity(True, "", utilization, memory, idle, kernel_track.last_busy, now, ORIGIN)


def start_cluster_sampler(cluster: KubeCluster, busy_threshold: float) -> ClusterGpuSampler:
    """The sampler for a server in Kubernetes mode, with the cluster's settings."""
    settings = cluster.settings
    namespace = settings.node_agent_namespace or settings.namespace
    instance = settings.node_agent_instance
    return ClusterGpuSampler(
        cluster.agent_informer(namespace, instance),
        cluster.kernel_pods,
        settings.node_agent_port,
        busy_threshold=busy_threshold,
        client=NodeAgentClient(token=read_agent_token(settings.node_agent_token_file)),
        namespace=namespace,
        instance=instance,
    )


def read_agent_token(path: str) -> str:
    """The node agents' token from ``ElasticKubernetesProvisioner.node_agent_token_file`` ("" when unset)."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as file:
            token = file.read().strip()
    except OSError as exc:
        raise ConfigError(
            f"ElasticKubernetesProvisioner.node_agent_token_file {path!r}: {exc.strerror or exc}"
        ) from None
    if not token:
        raise ConfigError(f"ElasticKubernetesProvisioner.node_agent_token_file {path!r} is empty")
    return token
