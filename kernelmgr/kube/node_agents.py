"""The server's side of the node activity agents: fetch every node's ``/activity``, merge per kernel.

Each GPU node runs ``jupyter elastic node-agent`` (:mod:`kernelmgr.nodeagent`), which reports
GPU use per *pod UID* (and the kernel id from the processes' environment when it can read it).
This module asks all agents at once and turns their reports into activity per *kernel id*.

Wired into the server by :mod:`kernelmgr.server.cluster_activity` (Kubernetes mode), which:

1. finds the agent pods with one watch (the chart's labels: name, instance and component, see
   :func:`agent_selector`) and gives them to :func:`agent_urls` (pod IP + port). No Service: the
   server needs every agent, not one behind a load balancer. Each request carries the agents'
   shared token (a Secret mounted in the server and the agents): an agent answers no one else.
2. passes ``uid_to_kernel`` built from the kernel-pod watch's cache
   (``{pod.metadata.uid: pod.metadata.labels["kernel_id"]}``): the cgroup-derived pod UID is proof
   of which pod a process belongs to, while the environment's kernel id is only a hint that code in
   the pod could fake (see :mod:`kernelmgr.nodeagent.environ`). With a mapping, it wins, and pods
   outside it are reported in ``unmapped``, never attributed to a kernel.
3. calls :meth:`NodeAgentClient.collect` on the culler's GPU-sampling timer, on the event loop (it
   is async and never raises), and feeds each kernel's ``gpu_utilization`` / ``gpu_memory_mib`` to
   the same idle bookkeeping as local mode. A kernel whose node's agent is in ``errors`` counts as
   "not measured" (like NVML unavailable locally), not as idle.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from kernelmgr.nodeagent import DEFAULT_PORT

#: The labels that mark node agent pods, as the Helm chart (and deploy/kubernetes/node-agent.yaml) set
#: them: name, instance (the Helm release) and component, all three. A pod with only the generic
#: component label (anyone's "node-agent") is not an agent of ours, and is never sent the token.
AGENT_NAME_LABEL = "app.kubernetes.io/name"
AGENT_NAME = "jupyter-elastic-kernels"
AGENT_INSTANCE_LABEL = "app.kubernetes.io/instance"
DEFAULT_INSTANCE = "jupyter-elastic-kernels"
AGENT_COMPONENT_LABEL = "app.kubernetes.io/component"
AGENT_COMPONENT = "node-agent"
DEFAULT_TIMEOUT = 5.0


def agent_labels(instance: str = DEFAULT_INSTANCE) -> dict[str, str]:
    """The labels an agent pod of release ``instance`` carries."""
    return {
        AGENT_NAME_LABEL: AGENT_NAME,
        AGENT_INSTANCE_LABEL: instance,
        AGENT_COMPONENT_LABEL: AGENT_COMPONENT,
    }


def agent_selector(instance: str = DEFAULT_INSTANCE) -> str:
    """The label selector of the pod watch that finds the agents of release ``instance``."""
    return ",".join(f"{key}={value}" for key, value in agent_labels(instance).items())


AGENT_SELECTOR = agent_selector()


def _field(obj: Any, *path: tuple[str, str]) -> Any:
    """Follow ``path`` of (client attribute, JSON key) pairs through a client model or a dict."""
    for attribute, key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, Mapping) else getattr(obj, attribute, None)
    return obj


def agent_urls(pods: Iterable[Any], port: int = DEFAULT_PORT, instance: str = DEFAULT_INSTANCE) -> list[str]:
    """Base URLs of the running node agent pods among ``pods`` (client models or dicts).

    Only pods with every label of :func:`agent_labels` (``instance``'s), in phase Running, with a
    pod IP; sorted, no duplicates, IPv6 addresses bracketed.
    """
    urls = set()
    wanted = agent_labels(instance)
    for pod in pods:
        labels = _field(pod, ("metadata", "metadata"), ("labels", "labels")) or {}
        if any(labels.get(key) != value for key, value in wanted.items()):
            continue
        if _field(pod, ("status", "status"), ("phase", "phase")) != "Running":
            continue
        ip = _field(pod, ("status", "status"), ("pod_ip", "podIP"))
        if not ip:
            continue
        host = f"[{ip}]" if ":" in ip else ip
        urls.add(f"http://{host}:{port}")
    return sorted(urls)


@dataclass
class KernelGpuActivity:
    """One kernel's GPU use, merged over every pod and node that reported it.

    Usually one pod; two while a resumed kernel's new pod starts and the old one is still
    terminating. ``gpu_utilization`` is the highest over them (None when only MIG devices, or
    nothing, measured it), memory the sum, ``sampled_at`` the oldest of the reports used.
    """

    kernel_id: str
    gpu_utilization: float | None = None
    gpu_memory_mib: int = 0
    devices: list[str] = field(default_factory=list)
    pod_uids: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    sampled_at: float | None = None
    #: "pod-watch" when the server's pod UID mapping named the kernel, else "environ".
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel_id": self.kernel_id,
            "gpu_utilization": self.gpu_utilization,
            "gpu_memory_mib": self.gpu_memory_mib,
            "devices": self.devices,
            "pod_uids": self.pod_uids,
            "nodes": self.nodes,
            "sampled_at": self.sampled_at,
            "source": self.source,
        }


@dataclass
class ClusterActivity:
    """What :meth:`NodeAgentClient.collect` learned: per kernel, plus what it could not use."""

    kernels: dict[str, KernelGpuActivity] = field(default_factory=dict)
    #: pod UID -> the agent's report of a GPU pod no kernel id could be given to (plus its node).
    unmapped: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: agent URL -> why its report is missing or empty (unreachable, timeout, bad answer, NVML).
    errors: dict[str, str] = field(default_factory=dict)
    #: agent URL -> {"node", "sampled_at"} for every agent that answered.
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Pods whose processes claim a kernel id other than the one the pod watch gives.
    conflicts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernels": {k: v.to_dict() for k, v in sorted(self.kernels.items())},
            "unmapped": self.unmapped,
            "errors": self.errors,
            "nodes": self.nodes,
            "conflicts": self.conflicts,
        }


class NodeAgentClient:
    """Fetches ``/activity`` from many agents concurrently; every failure is data, never raised."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, token: str = "") -> None:
        self.timeout = timeout
        #: The agents' shared token (``jupyter elastic node-agent --token-file``), sent as a bearer token.
        self.token = token

    async def fetch(self, base_url: str) -> dict[str, Any]:
        """One agent's ``/activity`` document; raises on any failure (``collect`` catches)."""
        response = await AsyncHTTPClient().fetch(
            f"{base_url.rstrip('/')}/activity",
            connect_timeout=self.timeout,
            request_timeout=self.timeout,
            headers={"Authorization": f"Bearer {self.token}"} if self.token else None,
        )
        doc = json.loads(response.body)
        if not isinstance(doc, dict) or not isinstance(doc.get("pods"), dict):
            raise ValueError("not a node agent /activity document (no 'pods' object)")
        return doc

    async def _fetch_or_error(self, base_url: str) -> dict[str, Any] | str:
        try:
            return await asyncio.wait_for(self.fetch(base_url), timeout=self.timeout * 2)
        except HTTPClientError as exc:
            if exc.code == 599:  # tornado's code for "no HTTP answer" (timeouts, closed connections)
                return f"no answer from {base_url}/activity: {exc.message}"
            return f"HTTP {exc.code} from {base_url}/activity: {exc.message}"
        except asyncio.TimeoutError:
            return f"no answer from {base_url}/activity within {self.timeout:g}s"
        except ValueError as exc:  # bad JSON or shape
            return f"bad answer from {base_url}/activity: {exc}"
        except Exception as exc:  # connection refused, DNS, reset...: report, never raise
            return f"cannot reach {base_url}/activity: {exc}"

    async def collect(
        self, urls: Sequence[str], uid_to_kernel: Mapping[str, str] | None = None
    ) -> ClusterActivity:
        """Ask every agent at once and merge their reports per kernel id.

        With ``uid_to_kernel`` (pod UID -> kernel id, from the server's pod watch) only that
        mapping names kernels; without it, the kernel ids the agents read from the processes'
        environments are used.
        """
        unique = list(dict.fromkeys(url.rstrip("/") for url in urls))
        answers = await asyncio.gather(*(self._fetch_or_error(url) for url in unique))
        result = ClusterActivity()
        for url, answer in zip(unique, answers, strict=True):
            if isinstance(answer, str):
                result.errors[url] = answer
                continue
            node = str(answer.get("node") or url)
            sampled_at = answer.get("sampled_at")
            result.nodes[url] = {"node": node, "sampled_at": sampled_at}
            nvml = answer.get("nvml", "ok")
            if nvml != "ok":
                result.errors[url] = f"node {node}: {nvml}"
            for uid, pod in answer["pods"].items():
                if isinstance(pod, dict):
                    _merge(result, url, node, sampled_at, str(uid), pod, uid_to_kernel)
        return result


def _merge(
    result: ClusterActivity,
    url: str,
    node: str,
    sampled_at: Any,
    uid: str,
    pod: dict[str, Any],
    uid_to_kernel: Mapping[str, str] | None,
) -> None:
    hinted = pod.get("kernel_id")
    if uid_to_kernel is not None:
        kernel_id, source = uid_to_kernel.get(uid), "pod-watch"
        if kernel_id is not None and hinted and hinted != kernel_id:
            result.conflicts.append(
                f"pod {uid} on {node} is kernel {kernel_id}, but its processes say {hinted}"
            )
    else:
        kernel_id, source = hinted, "environ"
    if not kernel_id:
        result.unmapped[uid] = {**pod, "node": node, "agent": url}
        return
    merged = result.kernels.setdefault(kernel_id, KernelGpuActivity(kernel_id, source=source))
    utilization = pod.get("gpu_utilization")
    if isinstance(utilization, (int, float)):
        current = merged.gpu_utilization
        merged.gpu_utilization = float(utilization) if current is None else max(current, float(utilization))
    merged.gpu_memory_mib += int(pod.get("gpu_memory_mib") or 0)
    merged.devices = list(dict.fromkeys([*merged.devices, *pod.get("devices", [])]))
    merged.pod_uids.append(uid)
    if node not in merged.nodes:
        merged.nodes.append(node)
    if isinstance(sampled_at, (int, float)):
        merged.sampled_at = sampled_at if merged.sampled_at is None else min(merged.sampled_at, sampled_at)
