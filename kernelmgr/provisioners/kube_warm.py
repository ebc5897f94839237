"""A kernel pod that was a warm pod: taking one from the pool, the hand-off, its checkpoints.

A warm pod (:mod:`kernelmgr.kube.warm_pods`) becomes a kernel's pod in place: relabelled as the
kernel's, handed the checkpoint to restore, then its connection, its owner's key and the agent's
variables over its HTTP protocol (:mod:`kernelmgr.kube.warm_pod`). Its checkpoints stay in its
emptyDir until the server pulls them. Kept apart from the provisioner's cold path, which never
needs any of it; it reads the provisioner of its kernel (``kernel``) through its public members.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import TYPE_CHECKING, Any, Protocol

from kernelmgr.core.kernels import requesting_owner
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.kube.labels import COMPONENT_LABEL, KERNEL, KERNEL_ID_LABEL, OWNER_LABEL, label_value
from kernelmgr.kube.manifests import (
    CONNECTION_FILE,
    KERNELSPEC_ANNOTATION,
    OWNER_ANNOTATION,
    POD_KERNEL,
    SIZE_ANNOTATION,
    WARM_ANNOTATION,
    WARM_TOKEN_KEY,
)
from kernelmgr.kube.pods import finished, pod_failure, running
from kernelmgr.kube.warm_client import WarmPodClient, WarmPodError

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime
    from kernelmgr.core.kernels import LaunchPlan


class WarmKernel(Protocol):
    """What the hand-off reads of its kernel's provisioner (a protocol: no import of it here)."""

    kernel_id: str
    connection_info: Any

    @property
    def extra_annotations(self) -> Any: ...
    @property
    def launch_timeout(self) -> Any: ...
    @property
    def warm_pod_port(self) -> Any: ...
    @property
    def command(self) -> list[str]: ...
    @property
    def own_environment(self) -> bool: ...
    def has_own_ids(self, owner: str | None) -> bool: ...
    @property
    def log(self) -> Any: ...
    @property
    def runtime(self) -> ElasticRuntime: ...
    @property
    def record(self) -> Any: ...
    @property
    def plan(self) -> LaunchPlan: ...
    @property
    def core(self) -> Any: ...
    @property
    def informer(self) -> Any: ...
    @property
    def pod_name(self) -> str: ...
    @property
    def pod_namespace(self) -> str: ...
    @property
    def has_process(self) -> bool: ...


class WarmHandoff:
    """The warm-pod side of one kernel's provisioner."""

    def __init__(self, kernel: WarmKernel) -> None:
        self.kernel = kernel
        #: The running pod was a warm pod: its checkpoints are collected from it over HTTP.
        self.origin = False
        self.client: WarmPodClient | None = None
        #: Set with the warm pod a launch took: ``resume`` or ``start`` (the pool's counters).
        self.use = "start"

    def reset(self) -> None:
        self.origin = False
        self.client = None

    def take(self, size: str | None) -> Any:
        """A ready warm pod of ``size`` for this launch, or ``None`` (it starts cold).

        Without one, warm pods that hold the GPU this launch needs give it back first: they never
        keep a kernel from a GPU.
        """
        k = self.kernel
        runtime = k.runtime
        pool = runtime.warm_pods
        if pool is None or size is None or runtime.allocator.slice_of(k.kernel_id) is not None:
            return None  # (a restarting kernel keeps the slice it holds, and starts in a new cold pod)
        record = runtime.kernels.get(k.kernel_id)
        use = "resume" if record is not None and record.state is KernelState.RESUMING else "start"
        owner = record.owner if record is not None else (requesting_owner.get() or runtime.owner)
        warm = None
        if pool.serves(size, use):
            if POD_KERNEL not in k.command or k.own_environment or k.has_own_ids(owner):
                pool.miss(size, "not_poolable")
            else:
                warm = pool.take(size, use)
        if warm is None:
            profile = runtime.profile(size)
            given = pool.make_room(lambda: runtime.allocator.fits(profile))
            if given:
                k.log.info("kernel %s: %d warm pod(s) gave their GPU back for it", k.kernel_id, given)
        else:
            self.use = use
        return warm

    async def launch(self, warm: Any, cmd: list[str]) -> Any:
        """Make ``warm`` (the kernel's pod already) serve the kernel: relabelled as its pod, handed
        the checkpoint to restore, then its connection, its owner's key and the agent's variables
        (:mod:`kernelmgr.kube.warm_pod`); the pod as the watch last saw it, running."""
        k = self.kernel
        core, record, plan, store = k.core, k.record, k.plan, k.runtime.checkpoints
        self.origin = True
        annotations = {
            **k.extra_annotations,
            OWNER_ANNOTATION: record.owner,
            KERNELSPEC_ANNOTATION: record.kernelspec,
            SIZE_ANNOTATION: warm.size,
            WARM_ANNOTATION: "true",
        }
        # The pool's pod carries this release's name and instance already.
        labels = {COMPONENT_LABEL: KERNEL, KERNEL_ID_LABEL: k.kernel_id}
        labels[OWNER_LABEL] = label_value(record.owner)
        await asyncio.to_thread(
            core.patch_namespaced_pod,
            warm.name,
            k.pod_namespace,
            {"metadata": {"labels": labels, "annotations": annotations}},
        )
        seen: Any = await k.informer.wait_for(
            k.kernel_id,
            lambda pod: pod is not None and (running(pod) or finished(pod)),
            k.launch_timeout,
        )
        if not running(seen) or not seen.status.pod_ip:
            raise RuntimeError(f"warm pod {warm.name} ended: {pod_failure(seen)}")
        pod_client = WarmPodClient(seen.status.pod_ip, k.warm_pod_port, warm.token)
        store.kernel_dir(record.owner, k.kernel_id)  # refuses unsafe owner names and kernel ids
        if plan.restore and plan.checkpoint:
            # Verified again with the owner's key, right before it is sent (refused: WarmPodError).
            sent = await asyncio.to_thread(
                pod_client.push_checkpoint, k.kernel_id, store, record.owner, plan.checkpoint
            )
            k.log.info("kernel %s: checkpoint (%d bytes) sent to warm pod %s", k.kernel_id, sent, warm.name)
        agent_env = store.agent_env(
            record.owner,
            k.kernel_id,
            key_file="(written by the warm pod)",
            restore=plan.restore,
            restore_checkpoint=plan.checkpoint,
        )
        for name in ("ELASTIC_CHECKPOINT_DIR", "ELASTIC_CHECKPOINT_KEY_FILE"):
            agent_env.pop(name)  # paths inside the pod: the pod sets them
        connection = {
            key: (v.decode() if isinstance(v, bytes) else v) for key, v in k.connection_info.items()
        }
        connection.pop("ip", None)
        handoff = {
            "kernel_id": k.kernel_id,
            "connection": connection,
            "key": store.key_for(record.owner).hex(),
            "data_key": (store.data_key_for(record.owner, k.kernel_id) or b"").hex(),
            "env": agent_env,
            "args": cmd[cmd.index(POD_KERNEL) + 3 :],
        }
        await asyncio.to_thread(pod_client.handoff, handoff)
        # A restarted server adopts the kernel from its pod and Secret, as a cold kernel's.
        await asyncio.to_thread(
            core.patch_namespaced_secret,
            warm.name,
            k.pod_namespace,
            {
                "metadata": {"labels": labels},
                "stringData": {CONNECTION_FILE: json.dumps({**connection, "ip": "0.0.0.0"})},
            },
        )
        self.client = pod_client
        k.log.info("Kernel %s took warm pod %s at %s", k.kernel_id, warm.name, seen.status.pod_ip)
        return seen

    async def pod_client(self) -> WarmPodClient | None:
        """The HTTP client of this kernel's pod if it was a warm pod (read back after an adoption)."""
        k = self.kernel
        if not self.origin or not k.has_process:
            return None
        if self.client is None:
            only_this = f"metadata.name={k.pod_name}"  # list, not get: the Role has no get on Secrets
            core = k.core
            listed = await asyncio.to_thread(
                core.list_namespaced_secret, k.pod_namespace, field_selector=only_this
            )
            data = listed.items[0].data or {} if listed.items else {}
            token = base64.b64decode(data.get(WARM_TOKEN_KEY, "")).decode()
            pod = k.informer.get(k.kernel_id)
            if not token or pod is None or not pod.status.pod_ip:
                raise RuntimeError(
                    f"warm pod {k.pod_name} has no token or no IP: its checkpoint cannot be read"
                )
            self.client = WarmPodClient(pod.status.pod_ip, k.warm_pod_port, token)
        return self.client

    async def collect_checkpoint(self) -> None:
        """Commit in the server's store the checkpoint the agent wrote in the pod's emptyDir."""
        pod_client = await self.pod_client()
        if pod_client is None:
            return
        k = self.kernel
        store, owner = k.runtime.checkpoints, k.record.owner
        try:
            committed = await asyncio.to_thread(pod_client.pull_checkpoint, k.kernel_id, store, owner)
        except WarmPodError as exc:
            raise RuntimeError(
                f"the checkpoint could not be taken from warm pod {k.pod_name}: {exc}"
            ) from None
        store.forget_cached(owner, k.kernel_id)
        k.log.info("kernel %s: checkpoint %s collected from warm pod %s", k.kernel_id, committed, k.pod_name)

    async def collect_restore_report(self) -> None:
        """Copy the agent's restore report from the pod into the store (REST and CLI read it there)."""
        pod_client = await self.pod_client()
        if pod_client is not None:
            k = self.kernel
            await asyncio.to_thread(
                pod_client.pull_restore_report, k.kernel_id, k.runtime.checkpoints, k.record.owner
            )
