"""The server in a cluster: it takes over the kernel pods it finds, and follows the nodes' GPUs.

Kernel pods do not die with the server that started them (a local kernel checkpoints itself and
exits; a pod keeps running, holding its GPU). So after a restart, in Kubernetes mode, the server
looks at the kernel pods in its namespace (the shared pod watch's cache, plus one list of their
Secrets for the connection files) and, for each:

* running, with its Secret: adopted as it is — same kernel id, same connection, its slice claimed
  again; the notebook's next cell simply runs;
* ended, still starting, or already hibernated here (a crash between the checkpoint's commit and
  the pod's deletion): the pod and its Secret are deleted, since nothing serves them;

and each kernel the previous server had running whose pod is gone is hibernated from its last
checkpoint (the next cell resumes it, told what was lost) or, without one, forgotten.

With ``ElasticKernels.gpu_inventory_source = "kubernetes"`` the GPU inventory is the nodes'
(:class:`kernelmgr.kube.nodes.NodeInventorySync`). A cordoned or NotReady node keeps its kernels'
slices (its GPUs take nothing new); a slice on a node that left (deleted, or advertising fewer
GPUs) is logged here. What becomes of the kernel follows its pod: evicted or deleted, the kernel is
hibernated from its checkpoint (the provisioner's loss path), still running, it keeps running.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from kernelmgr.core.errors import ConfigError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.kube.cluster import KubeCluster
from kernelmgr.kube.manifests import tolerations
from kernelmgr.kube.namespaces import namespace_for
from kernelmgr.kube.nodes import NodeInventorySync
from kernelmgr.kube.other_gpu_pods import OtherGpuPods
from kernelmgr.kube.placement import Placement, size_placements
from kernelmgr.kube.pods import FoundKernel

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime
    from kernelmgr.lifecycle.service import Hibernator


class PodAdopter(Protocol):
    """What adoption needs of the kernel manager (kept to a protocol: no import of it here)."""

    @property
    def log(self) -> logging.Logger: ...

    @property
    def elastic_runtime(self) -> ElasticRuntime | None: ...

    @property
    def hibernator(self) -> Hibernator | None: ...

    def adopt_running(self, pod: FoundKernel) -> Any:
        """List the kernel of a running pod, connected to it."""


def cluster_of(mkm: PodAdopter) -> KubeCluster:
    """The server's cluster (made by the extension in Kubernetes mode)."""
    runtime = mkm.elastic_runtime
    assert runtime is not None and isinstance(runtime.kube, KubeCluster)
    return runtime.kube


async def adopt_kernel_pods(mkm: PodAdopter, node_sync: NodeInventorySync | None = None) -> list[str]:
    """Adopt the running kernel pods, clean up the others; returns the kernel ids adopted.

    With the nodes' inventory (``node_sync``), only once the nodes were listed: before that the
    server knows no GPUs, so it offers no GPU kernelspec and has no device to claim the slice on,
    and a running pod adopted then would be left unadopted for good.
    """
    hibernator = mkm.hibernator
    assert hibernator is not None
    if node_sync is not None:
        await _nodes_listed(mkm, node_sync)
    adopted: list[str] = []
    found: list[FoundKernel] = []
    cluster = cluster_of(mkm)
    for namespace in _kernel_namespaces(mkm):
        try:
            found += await cluster.find_kernel_pods(namespace)
        except Exception as exc:
            mkm.log.error("Could not look for kernel pods to adopt in %s: %s", namespace, exc)
        try:  # the failed pods a previous server kept for `kubectl logs`: deleted when their time is up
            await cluster.failed_pods.sweep(namespace)
        except Exception as exc:
            mkm.log.warning("Could not look for kept failed pods in %s: %s", namespace, exc)
    runtime = mkm.elastic_runtime
    assert runtime is not None
    previous = set(hibernator.records) | set(hibernator.deferred)
    for pod in found:
        if pod.kernel_id not in previous and pod.owner != runtime.owner:
            continue  # another server's (or another user's) kernel: not ours to adopt or delete
        # Known to this server already: started (or being started: not yet in the kernel manager's
        # table, but registered) or resumed since the pods were listed. Only a pod of a kernel that
        # is hibernated here, with nothing in flight, is a leftover.
        managed = runtime.kernels.get(pod.kernel_id)
        if managed is not None and managed.state is not KernelState.HIBERNATED:
            continue
        if managed is not None and hibernator.controller.in_flight(pod.kernel_id):
            continue
        hibernated_here = managed is not None
        if pod.running and pod.connection_info is not None and not hibernated_here:
            try:
                mkm.adopt_running(pod)
            except Exception as exc:
                # Left running (it holds the user's state): an admin decides; nothing is deleted blindly.
                hibernator.deferred.pop(pod.kernel_id, None)
                mkm.log.error(
                    "Could not adopt the running pod of kernel %s (left as it is): %s", pod.kernel_id, exc
                )
                continue
            hibernator.deferred.pop(pod.kernel_id, None)
            hibernator.track(pod.kernel_id)
            adopted.append(pod.kernel_id)
            continue
        why = (
            "hibernated already"
            if hibernated_here
            else "not running"
            if not pod.running
            else "its Secret is gone"
        )
        mkm.log.info("Deleting the pod of kernel %s left by the previous server (%s)", pod.kernel_id, why)
        await cluster.remove_leftover(pod)
    for kernel_id, record in list(hibernator.deferred.items()):
        hibernator.deferred.pop(kernel_id)
        hibernator.recover_lost(record, "its pod ended while the server was down")
    if adopted:
        mkm.log.info("Adopted %d running kernel pod(s): %s", len(adopted), ", ".join(adopted))
    return adopted


async def _nodes_listed(mkm: PodAdopter, node_sync: NodeInventorySync, every: float = 30.0) -> None:
    """Wait for the first list of the nodes, saying why every ``every`` s while it does not come."""
    while not await asyncio.to_thread(node_sync.wait_until, lambda _inventory: True, every):
        failure = node_sync.informer.failure
        mkm.log.warning(
            "Adopting the kernel pods waits for the first list of the nodes (%s)",
            failure.message if failure is not None else "not answered yet",
        )


def _kernel_namespaces(mkm: PodAdopter) -> list[str]:
    """Where kernel pods may be: the configured namespace, and with ``namespace_template`` the
    namespace of every owner the previous server had kernels of (from its registry)."""
    settings = cluster_of(mkm).settings
    namespaces = [settings.namespace]
    hibernator = mkm.hibernator
    if settings.namespace_template and hibernator is not None:
        owners = sorted({record.owner for record in hibernator.records.values()})
        for owner in owners:
            try:
                namespace = namespace_for(settings.namespace_template, owner)
            except ConfigError:
                continue
            if namespace not in namespaces:
                namespaces.append(namespace)
    return namespaces


def start_node_inventory(runtime: ElasticRuntime, log: logging.Logger) -> NodeInventorySync:
    """Keep the allocator's inventory equal to the cluster's schedulable GPUs (one node watch), with
    the GPUs of pods that are not kernels booked (one cluster-wide pod watch)."""
    assert isinstance(runtime.kube, KubeCluster)

    def lost(slices: Any) -> None:
        for granted in slices:
            if granted.other_pod:
                continue  # booked again by OtherGpuPods.retry where the node still has it
            log.warning(
                "Kernel %s: the node of its GPU slice (%s) left the inventory; the kernel follows its pod",
                granted.kernel_id,
                ", ".join(granted.device_uuids),
            )

    template = runtime.kube.settings.pod_template()
    placement = Placement(dict(template.node_selector), tuple(tolerations(template)))
    sync = NodeInventorySync(
        runtime.kube.api(),
        runtime.allocator,
        on_lost=lost,  # logs only: fine on the watch thread
        placement=placement,
        sizes=size_placements(template, runtime.profiles),
    )
    if runtime.kube.settings.count_other_gpu_pods:
        others = OtherGpuPods(runtime.kube.api(), runtime.allocator, replicas=sync.replicas)
        sync.after_change.append(others.retry)
        sync.companions.append(others.start())
        runtime.kube.extra_informers.append(others.informer)
    runtime.kube.extra_informers.append(sync.informer)  # their health on /metrics
    return sync.start()
