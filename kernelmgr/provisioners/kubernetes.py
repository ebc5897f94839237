"""``elastic-kubernetes-provisioner``: one pod per kernel, holding the kernel's GPU slice.

The slice is taken from the runtime's allocator exactly as the local provisioner does
(:mod:`kernelmgr.provisioners.common`), so a size that does not fit fails before any API call.
The pod gets the size's resources from its slice backend (:mod:`kernelmgr.backends.kubernetes`).
Connection info (fixed ports, fresh HMAC key) and the owner's checkpoint key go in a Secret that the
pod mounts read-only and that the pod owns (garbage-collected with it). The pod IP comes from the
one shared pod watch (:mod:`kernelmgr.kube.informer`); API calls run in worker threads, never on
the event loop. Interrupts go as ``interrupt_request`` messages (a signal cannot cross the API);
kill and terminate delete the pod and wait until the watch sees it gone, so the GPU is really free.

Checkpoints go to a PersistentVolumeClaim shared with the server (``checkpoint_claim``), mounted at
the owner's sub-path only, so a kernel pod sees its owner's checkpoints and nobody else's. A hibernation
deletes the pod (its slice is then really free); a resume creates a new pod, wherever a slice is free,
with the same connection key and ports (a new IP: the server's channels reconnect), and the agent
restores there. Without a claim, checkpoints land in an ``emptyDir`` that dies with the pod and the
server refuses to hibernate such kernels (it could not read the checkpoint).

Rights, namespaces and pod security (one namespace or one per owner, Pod Security "restricted",
no CUDA_*/NVIDIA_* from configuration): ``deploy/kubernetes/`` and docs/architecture.md.

Long because it implements jupyter_client's whole provisioner interface for a pod (launch, poll,
signals, cleanup, adoption); the cluster side is already in ``kube/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import secrets
import signal
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import KernelProvisionerBase
from kubernetes import client

from kernelmgr.backends.kubernetes import render_pod_fragment
from kernelmgr.checkpoint.agent import ENV_RESTORE_DATA_URL, ENV_RESTORE_KEY, ENV_RESTORE_MANIFEST_URL
from kernelmgr.checkpoint.sharing import give_owner_folder
from kernelmgr.config import ElasticRuntime
from kernelmgr.core.errors import ElasticError
from kernelmgr.core.kernels import FRESH_START, LaunchPlan, ManagedKernel
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.modes import KUBERNETES_PROVISIONER
from kernelmgr.kube.cluster import KubeCluster
from kernelmgr.kube.events import LAUNCH_FAILED, STARTED, PodRef
from kernelmgr.kube.informer import PodInformer
from kernelmgr.kube.manifests import (
    KEY_FILE,
    POD_KERNEL,
    PORT_NAMES,
    SECRET_MOUNT,
    checkpoint_sub_path,
    make_kernel_pod,
    make_kernel_secret,
    owner_reference,
)
from kernelmgr.kube.namespaces import namespace_for
from kernelmgr.kube.nodes import follow_pod_node
from kernelmgr.kube.placement import book_where_placed
from kernelmgr.kube.pod_kernel import ARGV_SEPARATOR
from kernelmgr.kube.pod_settings import kernel_environment
from kernelmgr.kube.pods import (
    FoundKernel,
    evicted,
    exit_code,
    failed_on_its_own,
    finished,
    loss,
    pod_failure,
    stopping_gracefully,
)
from kernelmgr.kube.settings import KubeSettings, shared_group_refusal
from kernelmgr.kube.warm_client import WarmPodError
from kernelmgr.provisioners.common import (
    AGENT_EXTENSION,
    claim_slice,
    find_loss_reports,
    find_runtime,
    mark_launched,
    profile_name_of,
    release_slice,
    requested_dir,
    with_agent,
)
from kernelmgr.provisioners.kube_warm import WarmHandoff

PROVISIONER_NAME = KUBERNETES_PROVISIONER
#: What an object store adds to the agent's environment that the pod spec must not show.
SECRET_ENV = (ENV_RESTORE_MANIFEST_URL, ENV_RESTORE_DATA_URL, ENV_RESTORE_KEY)


# KernelProvisionerMeta derives from MetaHasTraits at run time; mypy cannot see it (type(...) base).
class ElasticKubernetesProvisioner(KernelProvisionerBase, KubeSettings):  # type: ignore[metaclass]
    """A kernel in its own pod, holding its GPU slice for the pod's life.

    Its settings are :class:`~kernelmgr.kube.settings.KubeSettings` (the server's configuration,
    overridden by the kernelspec's ``kernel_provisioner.config``); the API clients and pod watches
    are the server's :class:`~kernelmgr.kube.cluster.KubeCluster`'s.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Signals cannot reach a pod: jupyter_client must interrupt with a control message.
        self.kernel_spec.interrupt_mode = "message"
        self._pod_name = f"kernel-{self.kernel_id}"
        #: The namespace of this kernel's pod (namespace_template: its owner's).
        self._namespace = self.namespace
        self._launched = False
        #: We asked this pod to go (shutdown, restart, hibernation, a failed launch): its end is
        #: no loss. The pod handle's, not the kernel's: a warm pod given up for a cold one resets it.
        #: (The kernel's facts, a restart asked for, a stop seen and a loss taken over, are on its
        #: record: ``restarting``, ``stop_began``, ``taken_over``.)
        self._stopping = False
        #: The pod whose death the notebooks were told of (its uid): told once, not at each poll.
        self._death_told: str | None = "-"
        #: The plan this launch took from the record (``claim_slice``): read by the pod, cold or warm.
        self._plan = FRESH_START
        #: The warm pod this launch took (:mod:`kernelmgr.kube.warm_pods`), until it serves.
        self._warm: Any = None
        #: The uid of the last pod whose unasked failure was logged (once per pod, not per poll).
        self._failure_logged: str | None = None
        #: Names of this kernel's failed pods kept for ``kubectl logs`` (failed_pod_retention).
        self._kept_pods: set[str] = set()
        #: The hand-off to (and checkpoints from) the warm pod this kernel's pod was.
        self.warm = WarmHandoff(self)
        #: The notebook's folder on the single-user server (:mod:`kernelmgr.kube.user_volumes`).
        self._requested_dir: str | None = None
        #: The kernelspec's env and the client's allowed KERNEL_* (kube.pod_settings.kernel_environment).
        self._kernel_env: dict[str, str] = {}
        #: The GPU size of a pod created without a slice (it fit nowhere; ElasticKernels.scale_up_wait):
        #: it waits Pending for a node, and books its slice where the scheduler placed it.
        self._unplaced: str | None = None
        #: Agent variables the pod reads from its Secret (an object store's restore URLs and key).
        self._secret_env: dict[str, str] = {}
        #: The owner's (uid, gid) learned for this launch (runtime.owner_ids: the Hub's auth state),
        #: when user_ids does not name them.
        self._learned_ids: tuple[int, int] | None = None

    # ---- plumbing

    @property
    def restore_report_in_pod(self) -> bool:
        """The agent's restore report stays in the pod (no claim, no warm pod to pull it from):
        the server asks the agent for it."""
        return not self.checkpoint_claim and not self.warm.origin and self.runtime.checkpoints.uploads

    @property
    def checkpoints_persist(self) -> bool:
        """Whether a checkpoint written by a pod outlives it: on the shared claim, or sent to an
        object store (the pod's emptyDir is then only its scratch space)."""
        return bool(self.checkpoint_claim) or self.runtime.checkpoints.uploads

    @property
    def runtime(self) -> ElasticRuntime:
        return find_runtime(self.parent, PROVISIONER_NAME)

    @property
    def cluster(self) -> KubeCluster:
        cluster = self.runtime.kube
        if not isinstance(cluster, KubeCluster):
            raise RuntimeError(f"{PROVISIONER_NAME} needs the server's KubeCluster (ElasticRuntime.kube)")
        return cluster

    @property
    def core(self) -> Any:
        """The Core API with this kernel's kubeconfig (see :meth:`KubeCluster.core`)."""
        return self.cluster.core(self.kubeconfig)

    @property
    def informer(self) -> PodInformer:
        return self.cluster.pod_informer(self._namespace, self.kubeconfig)

    @property
    def pod_name(self) -> str:
        return self._pod_name

    @property
    def pod_namespace(self) -> str:
        return self._namespace

    @property
    def record(self) -> ManagedKernel:
        """This kernel's record (set by ``pre_launch`` or ``adopt``)."""
        return self._record

    @property
    def plan(self) -> LaunchPlan:
        """What this launch does (restore which checkpoint), taken once by ``pre_launch``."""
        return self._plan

    @property
    def has_process(self) -> bool:
        """A pod was created and not cleaned up yet (ended or not: ``poll()`` says which), as a
        local provisioner's process object outlives the process until ``cleanup()``."""
        return self._launched

    # ---- launch

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        self._stopping = False
        self._pod_name = self._new_pod_name()
        self.warm.reset()
        runtime = self.runtime
        kernelspec_name = getattr(self.parent, "kernel_name", "") or ""
        size = profile_name_of(self.kernel_spec)
        self._warm = self.warm.take(size)
        try:
            self._record, self._granted, self._plan = claim_slice(
                runtime,
                self.kernel_id,
                kernelspec_name,
                size,
                take_over=self._warm.holder if self._warm else None,
                node_may_come=self._warm is None,
            )
        except BaseException:
            if self._warm is not None:
                runtime.allocator.release(self._warm.holder)
                runtime.warm_pods.give_back(self._warm, "the kernel could not take it")
                self._warm = None
            raise
        self._record.launch_path = "warm" if self._warm is not None else "cold"
        self._unplaced = size if size is not None and self._granted is None else None
        self._requested_dir = requested_dir(kwargs) or self._requested_dir
        self._kernel_env = (
            kernel_environment(self.kernel_spec.env, kwargs.get("env"), list(self.client_env))
            or self._kernel_env
        )
        try:
            self._learned_ids = await self._owner_ids(self._record.owner)
            # The owner's encryption key (a bucket or a file: read once per owner, off the event
            # loop, before pod_manifest); a file system's encrypted checkpoints need it to start.
            if self._plan.restore or runtime.checkpoints.file_keys is not None:
                await asyncio.to_thread(runtime.checkpoints.prepare, self._record.owner)
            await self._select_namespace()
            self.informer  # noqa: B018  (start the watch now: the pod's first events must be seen)
            ports = {name: self.first_port + i for i, name in enumerate(PORT_NAMES)}
            info: dict[str, Any] = {
                **ports,
                "ip": "",
                # The kernel manager's session key, as a local kernel gets it: the same for the
                # kernel's whole life (resumes, restarts, a server restart that recovered it), and
                # the one open websockets sign with.
                "key": self._session_key(),
                "transport": "tcp",
                "signature_scheme": "hmac-sha256",
                "kernel_name": kernelspec_name,
            }
            self.connection_info = info  # type: ignore[assignment]
            kwargs = await super().pre_launch(**kwargs)
        except BaseException:
            if self._warm is not None:  # its slice is the kernel's now, released just below
                runtime.warm_pods.give_back(self._warm, "the launch that took it failed")
                self._warm = None
            release_slice(runtime, self.kernel_id, "launch preparation failed", self.log)
            raise
        kwargs["cmd"] = self._command()
        return kwargs

    async def _owner_ids(self, owner: str) -> tuple[int, int] | None:
        """The owner's (uid, gid) from runtime.owner_ids (the Hub's auth state), asked at every
        launch (a resume too, so a changed uid is followed); ``None`` when user_ids names the owner
        (the admin's map wins) or no source is set. A source that has none for the owner raises:
        the kernel then never starts, rather than run as run_as_user, which may be someone else's."""
        source = self.runtime.owner_ids
        if source is None or owner in self.user_ids:
            return None
        uid, gid = await source.ids_of(owner)
        refusal = shared_group_refusal(owner, int(gid), bool(self.checkpoint_claim))
        if refusal is not None:
            raise ElasticError(refusal)
        return int(uid), int(gid)

    def has_own_ids(self, owner: str | None) -> bool:
        """Whether ``owner``'s kernels run as their own uid (user_ids, or the Hub's auth state): a
        warm pod, made before it had an owner, runs as run_as_user and cannot serve them."""
        return owner is not None and (owner in self.user_ids or self.runtime.owner_ids is not None)

    def _session_key(self) -> bytes:
        key = getattr(getattr(self.parent, "session", None), "key", None)
        if isinstance(key, bytes) and key:
            return key
        known = (self.connection_info or {}).get("key")
        if known:
            return known if isinstance(known, bytes) else str(known).encode()
        return secrets.token_hex(32).encode()

    async def _select_namespace(self) -> None:
        """The owner's namespace with namespace_template; made first when create_namespace is on.

        One pod watch per namespace in use, not one cluster-wide watch: the server then needs no
        right to read pods outside the kernel namespaces (docs/architecture.md).
        """
        if self.namespace_template:
            self._namespace = namespace_for(self.namespace_template, self._record.owner)
        if await self.cluster.ensure_namespace(self, self._namespace):
            self.log.info("Created namespace %s for the kernels of %s", self._namespace, self._record.owner)

    def _command(self) -> list[str]:
        cmd = list(self.command)
        if POD_KERNEL in cmd and self.runs_own_argv:
            # The entry point writes the pod's connection file, then runs the kernelspec's argv on it.
            return [*cmd, ARGV_SEPARATOR, *with_agent(list(self.kernel_spec.argv))]
        if POD_KERNEL in cmd:
            cmd.append(f"--IPKernelApp.extra_extensions={AGENT_EXTENSION}")
            return cmd
        return with_agent(cmd)

    @property
    def runs_own_argv(self) -> bool:
        """Whether this kernel's pod runs its kernelspec's argv (kernelspec_argv)."""
        return bool(self._base_kernelspec()) and self._base_kernelspec() in self.kernelspec_argv

    @property
    def own_environment(self) -> bool:
        """Whether this kernel needs a pod of its own kernelspec's making (its image or argv): a warm
        pod, made for the size with the size's image and entry point, cannot serve it."""
        return self.runs_own_argv or self._base_kernelspec() in self.kernelspec_images

    def pod_manifest(self, cmd: list[str]) -> dict[str, Any]:
        """The kernel pod (:func:`~kernelmgr.kube.manifests.make_kernel_pod`), once the owner's
        checkpoint folder is checked (and made, on the claim: a kubelet would make it as root)."""
        runtime, record = self.runtime, self._record
        store = runtime.checkpoints
        agent_env = store.agent_env(
            record.owner,
            self.kernel_id,
            key_file=f"{SECRET_MOUNT}/{KEY_FILE}",
            restore=self._plan.restore,
            restore_checkpoint=self._plan.checkpoint,
            # A pod evicted, preempted or drained gets SIGTERM and its grace period: the kernel
            # checkpoints what changed onto the volume, and the server resumes it from there. (With
            # an object store it lands in the pod's emptyDir and is lost: the server resumes from
            # the bucket's last commit; the guard still lets the cell finish and flushes files.)
            checkpoint_on_sigterm=True,
        )
        # The presigned restore URLs (and the checkpoint's key): in the pod's Secret, not its spec,
        # which anyone who may read pods in the namespace can see.
        self._secret_env = {name: agent_env.pop(name) for name in SECRET_ENV if name in agent_env}
        owner_dir = store.kernel_dir(record.owner, self.kernel_id).parent  # refuses unsafe names
        sub_path = None
        if self.checkpoint_claim:
            owner_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._give_owner(owner_dir, record.owner)
            sub_path = checkpoint_sub_path(self.checkpoint_claim_path, owner_dir.name)
        return make_kernel_pod(
            self._template_for(record.owner),
            name=self._pod_name,
            kernel_id=self.kernel_id,
            cmd=cmd,
            agent_env=agent_env,
            owner=record.owner,
            kernelspec=record.kernelspec,
            profile=runtime.profile(self._size) if self._size is not None else None,
            checkpoint_sub_path=sub_path,
            requested_dir=self._requested_dir,
            kernel_env=self._kernel_env,
            image=self.kernelspec_images.get(self._base_kernelspec()),
            secret_env=sorted(self._secret_env),
        )

    @property
    def _size(self) -> str | None:
        """The GPU size the pod asks for: its slice's, or the one it waits for a node with."""
        return self._granted.profile if self._granted is not None else self._unplaced

    def _template_for(self, owner: str) -> Any:
        """The pod template, with the owner's learned (uid, gid) added under the admin's user_ids."""
        template = self.pod_template()
        if self._learned_ids is None or owner in template.user_ids:
            return template
        return dataclasses.replace(template, user_ids={**template.user_ids, owner: self._learned_ids})

    def _give_owner(self, owner_dir: Any, owner: str) -> None:
        """Make the owner's checkpoint folder theirs when their kernels run as their own uid
        (user_ids, or the Hub's auth state): a folder the server made is the server's, and their
        kernel could not write there."""
        template = self._template_for(owner)
        if owner not in template.user_ids:
            return
        uid, gid = template.identity(owner)
        give_owner_folder(owner_dir, uid, gid)  # chown (a root server), or shared through its group

    def _base_kernelspec(self) -> str:
        """The base kernelspec this kernel's GPU-size (or CPU) kernelspec was made from."""
        elastic = (self.kernel_spec.metadata or {}).get("elastic") or {}
        return str(elastic.get("base_kernelspec") or "")

    def secret_manifest(self) -> dict[str, Any]:
        """Connection file and checkpoint key (:func:`~kernelmgr.kube.manifests.make_kernel_secret`)."""
        return make_kernel_secret(
            name=self._pod_name,
            kernel_id=self.kernel_id,
            owner=self._record.owner,
            connection_info=self.connection_info,
            checkpoint_key=self.runtime.checkpoints.key_for(self._record.owner),
            env=self._secret_env,
            data_key=self.runtime.checkpoints.data_key_for(self._record.owner, self.kernel_id),
            instance=self.instance,
        )

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        try:
            info = await self._launch(cmd)
        except BaseException as exc:
            pod = PodRef(self._namespace, self._pod_name)
            self.cluster.events.record(
                pod, LAUNCH_FAILED, f"kernel {self.kernel_id}: {exc}", True, self.kubeconfig
            )
            await self._delete_pod(grace=0, wait=False)
            await self._delete_secret()
            self._launched = False
            release_slice(self.runtime, self.kernel_id, "kernel pod failed to start", self.log)
            raise
        mark_launched(self.runtime, self.kernel_id, "pod running")
        seen = PodRef.of(self.informer.get(self.kernel_id))
        how = f"{self._record.launch_path} start" if self._record.launch_path else "started"
        size = self._granted.profile if self._granted is not None else "cpu"
        message = f"kernel {self.kernel_id} of {self._record.owner} running (size {size}, {how})"
        self.cluster.events.record(seen, STARTED, message, kubeconfig=self.kubeconfig)
        return info

    async def _launch(self, cmd: list[str]) -> KernelConnectionInfo:
        if self._warm is not None:
            warm, self._warm = self._warm, None
            pool = self.runtime.warm_pods
            self._pod_name = warm.name
            self._launched = True  # the pod is this kernel's now: a failure below deletes it
            try:
                took = await self.warm.launch(warm, cmd)
                self.connection_info["ip"] = took.status.pod_ip
                self._follow_pod_node(took)
            except (WarmPodError, client.ApiException, TimeoutError, RuntimeError) as exc:
                pool.miss(warm.size, "handoff_failed")
                self.log.warning(
                    "kernel %s could not take warm pod %s (%s); it starts cold",
                    self.kernel_id,
                    warm.name,
                    exc,
                )
                with contextlib.suppress(client.ApiException, TimeoutError):
                    await self._delete_pod(grace=0, wait=True)
                self._record.launch_path = "cold"
                self._pod_name = self._new_pod_name()
                self._launched = self._stopping = False
                self.warm.reset()
            else:
                pool.hit(warm.size, self.warm.use)
                return self.connection_info
        core = self.core
        size = self._size
        if size is not None:
            fragment = render_pod_fragment(self.runtime.profile(size), self.kernel_id)
            await self.cluster.ensure_side_objects(
                self.kubeconfig, self._namespace, size, list(fragment.side_objects)
            )
        # Secret, pod, then the Secret's owner: the pod must find its Secret at once (a kubelet
        # retries a missing Secret volume with back-off, seconds per start), and the Secret must
        # die with the pod. Three API calls per start.
        try:
            pod = await self._create_secret_and_pod(cmd)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            await self._remove_leftovers()
            pod = await self._create_secret_and_pod(cmd)
        await asyncio.to_thread(
            core.patch_namespaced_secret,
            self._pod_name,
            self._namespace,
            owner_reference(self._pod_name, pod.metadata.uid),
        )
        if self._unplaced is not None:
            pod = await self._wait_for_a_node(pod, self._unplaced)
        seen = await self.cluster.wait_running(
            self.informer, self.kernel_id, pod, self._namespace, self.launch_timeout, self.kubeconfig
        )
        self.connection_info["ip"] = seen.status.pod_ip
        self.log.info("Kernel %s runs in pod %s at %s", self.kernel_id, self._pod_name, seen.status.pod_ip)
        self._follow_pod_node(seen)
        return self.connection_info

    async def _wait_for_a_node(self, pod: Any, size: str) -> Any:
        """The pod fit on no node: it stays Pending, where a cluster autoscaler sees it and adds a
        node, at most ``ElasticKernels.scale_up_wait`` seconds (the node's boot; its image pull is
        in ``launch_timeout``); then its slice is booked on the node kube-scheduler bound it to."""
        runtime, record = self.runtime, self._record
        wait = runtime.scale_up_wait
        self.log.info(
            "Kernel %s: no node has a free GPU of size %s; pod %s waits Pending for a node (at most %g s)",
            self.kernel_id,
            size,
            self._pod_name,
            wait,
        )
        record.waiting_for_node = True
        try:
            placed = await self.cluster.wait_scheduled(
                self.informer, self.kernel_id, pod, self._namespace, wait, self.kubeconfig
            )
        finally:
            record.waiting_for_node = False
        node = str(placed.spec.node_name)
        self._granted = await book_where_placed(
            runtime, self.kernel_id, runtime.profile(size), node, self.launch_timeout, self.log
        )
        self._unplaced = None if self._granted is not None else size
        return placed

    async def collect_checkpoint(self) -> None:
        """Commit in the server's store the checkpoint the agent just wrote, when it is in a warm pod's
        emptyDir (a cold pod writes to the shared claim itself). The hibernator calls it before it
        stops the pod: the pod is never deleted before its checkpoint is committed here."""
        await self.warm.collect_checkpoint()

    async def collect_restore_report(self) -> None:
        """Copy the agent's restore report from a warm pod into the store (REST and CLI read it there)."""
        await self.warm.collect_restore_report()

    def _follow_pod_node(self, pod: Any) -> None:
        """Book the slice on the node kube-scheduler bound the pod to (cluster inventory only)."""
        self._granted = follow_pod_node(self.runtime, self.kernel_id, self._granted, pod, self.log)

    # ---- a restarted server finds its kernels (KubeCluster.find_kernel_pods)

    def adopt(self, found: FoundKernel) -> KernelConnectionInfo:
        """Take over a running kernel pod: its slice claimed again, its connection as it was."""
        assert found.connection_info is not None
        self._namespace = found.namespace
        runtime = self.runtime
        self._record, self._granted, self._plan = claim_slice(
            runtime, self.kernel_id, found.kernelspec, found.size
        )
        if self._record.owner != found.owner:
            self._record.owner = found.owner
        self.connection_info = found.connection_info  # type: ignore[assignment]
        self._launched = True
        self._pod_name = found.pod_name or self._pod_name
        self.warm.origin = found.warm
        self._follow_pod_node(self.informer.get(self.kernel_id))
        mark_launched(runtime, self.kernel_id, "adopted after a server restart")
        return self.connection_info

    # ---- life and death

    async def poll(self) -> int | None:
        runtime = self.runtime
        record = runtime.kernels.get(self.kernel_id)
        if record is not None and record.taken_over is not None:
            return None  # the server hibernated it from its checkpoint; the next cell resumes it
        if not self._launched:
            return 0
        pod = self.informer.get(self.kernel_id)
        if not finished(pod) and not evicted(pod):
            return None
        if record is not None and record.stop_began is None:
            # A pod deleted between two polls: its last state tells.
            last = pod if pod is not None else self.informer.last_deleted(self.kernel_id)
            began = self.informer.stop_began(self.kernel_id, last)
            runtime.states.stop_seen(record, began)
        if not self._stopping and stopping_gracefully(pod, dt.datetime.now(dt.timezone.utc)):
            # Stopped by Kubernetes: the kernel checkpoints itself within its grace period; the
            # notebook's messages wait for the resume instead of going to a process about to end.
            losses = find_loss_reports(self.parent)
            if losses is not None:
                losses.stopping(self.kernel_id)
            return None
        if record is None or not record.restarting:
            if await self._taken_over_as_lost(pod):
                return None
            self._tell_died(pod)  # first: releasing the slice makes the kernel read as dead
            release_slice(self.runtime, self.kernel_id, "kernel pod ended", self.log)
        code = exit_code(pod)
        if code != 0 and not self._stopping and pod is not None and pod.metadata.uid != self._failure_logged:
            # The pod is deleted when the kernel restarts or stops: its last output stays here.
            self._failure_logged = pod.metadata.uid
            self.log.warning("Kernel %s's pod %s ended: %s", self.kernel_id, self._pod_name, pod_failure(pod))
        return code

    def _tell_died(self, pod: Any) -> None:
        """A running kernel's pod ended on its own and is not taken over: the cell it ran is
        answered now, with the cause (once per pod; the restarter starts it again, empty)."""
        record = self.runtime.kernels.get(self.kernel_id)
        uid = pod.metadata.uid if pod is not None else None
        if self._stopping or record is None or record.state is not KernelState.RUNNING:
            return
        if uid == self._death_told:
            return
        self._death_told = uid
        losses = find_loss_reports(self.parent)
        if losses is not None:
            losses.died(self.kernel_id, loss(pod))

    async def _taken_over_as_lost(self, pod: Any) -> bool:
        """The pod of a running kernel vanished unasked: offer the kernel to the server.

        Deleted, evicted, or stranded on a node that stopped answering: the server hibernates the
        kernel from its last checkpoint if it has one (``True``). What is left of the pod and its
        Secret goes now, so the resume can create them again under the same names.
        """
        runtime = self.runtime
        record = runtime.kernels.get(self.kernel_id)
        losses = find_loss_reports(self.parent)
        if self._stopping or losses is None:
            return False
        if record is None or record.state is not KernelState.RUNNING:
            return False
        why = loss(pod)
        if not losses.vanished(self.kernel_id, why, record.stop_began):
            return False
        runtime.states.taken_over(record, why)
        self.log.warning("Kernel %s lost its pod %s: %s", self.kernel_id, self._pod_name, why)
        with contextlib.suppress(client.ApiException, TimeoutError):
            await self._delete_pod(grace=0, wait=False)
        await self._delete_secret()
        self._launched = False
        return True

    def stderr_tail(self) -> str:
        """Why the kernel's pod ended, with the container's last log lines (its termination message):
        what the server quotes when a kernel exits before its first answer (start or resume)."""
        pod = self.informer.get(self.kernel_id) or self.informer.last_deleted(self.kernel_id)
        return pod_failure(pod) if finished(pod) and pod is not None else ""

    @property
    def first_reply_at_start(self) -> bool:
        """The server waits for this kernel's first reply before its start answers
        (:func:`kernelmgr.server.starting.wait_until_up`)."""
        return bool(self.wait_for_first_reply)

    async def wait(self) -> int | None:
        if not self._launched:
            return None
        pod = await self.informer.wait_for(self.kernel_id, finished, self.stop_timeout + self.launch_timeout)
        return exit_code(pod)

    async def send_signal(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            await self.kill()
        elif signum == signal.SIGTERM:
            await self.terminate()
        else:  # SIGINT goes as interrupt_request (interrupt_mode "message"); others cannot cross the API
            self.log.debug("signal %s not sent to kernel pod %s", signum, self._pod_name)

    async def kill(self, restart: bool = False) -> None:
        await self._delete_pod(grace=0, wait=True)

    async def terminate(self, restart: bool = False) -> None:
        await self._delete_pod(grace=None, wait=True)

    def _new_pod_name(self) -> str:
        """``kernel-<id>``, or another name while a failed pod of this kernel is kept under it."""
        name, n = f"kernel-{self.kernel_id}", 0
        while name in self._kept_pods:
            n += 1
            name = f"kernel-{self.kernel_id}-{n}"
        return name

    async def _keep_if_failed(self) -> bool:
        """The pod failed on its own (not asked to stop): keep it ``failed_pod_retention`` seconds
        for ``kubectl logs`` instead of deleting it (:mod:`kernelmgr.kube.failed_pods`). It leaves
        the kernels' watch at once, so for the kernel it is gone."""
        pod = self.informer.get(self.kernel_id)
        if self._stopping or self.failed_pod_retention <= 0 or not failed_on_its_own(pod):
            return False
        if pod is None or pod.metadata.name != self._pod_name:
            return False
        if not await self.cluster.failed_pods.keep(pod, self.failed_pod_retention, self.kubeconfig):
            return False
        self._kept_pods.add(self._pod_name)
        return True

    async def _delete_pod(self, grace: int | None, wait: bool) -> None:
        if not self._launched:
            return
        if await self._keep_if_failed():
            self._stopping = True
            if wait:
                await self.informer.wait_for(self.kernel_id, lambda pod: pod is None, self.stop_timeout)
            return
        self._stopping = True
        try:
            await asyncio.to_thread(
                self.core.delete_namespaced_pod, self._pod_name, self._namespace, grace_period_seconds=grace
            )
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        if wait:
            await self.informer.wait_for(self.kernel_id, lambda pod: pod is None, self.stop_timeout)

    async def _create_secret_and_pod(self, cmd: list[str]) -> Any:
        core = self.core
        pod = self.pod_manifest(cmd)  # first: it says what the Secret holds besides the keys
        await asyncio.to_thread(core.create_namespaced_secret, self._namespace, self.secret_manifest())
        self._launched = True
        return await asyncio.to_thread(core.create_namespaced_pod, self._namespace, pod)

    async def _remove_leftovers(self) -> None:
        """This kernel's pod and Secret from an earlier launch are still there (a stop whose pod
        deletion was refused, say, until an admin added the right): remove them, then start
        afresh. Rare, so it costs nothing on the usual path (three API calls per start)."""
        self.log.warning("Removing kernel %s's leftover pod and Secret before it starts", self.kernel_id)
        self._launched = True
        try:
            await self._delete_pod(grace=0, wait=True)
        finally:
            self._launched = False
            self._stopping = False
        await self._delete_secret()

    async def _delete_secret(self) -> None:
        """Delete the kernel's Secret now rather than leave it to the garbage collector (best effort)."""
        try:
            await asyncio.to_thread(self.core.delete_namespaced_secret, self._pod_name, self._namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                self.log.warning("could not delete Secret %s: %s", self._pod_name, exc.reason)

    async def shutdown_requested(self, restart: bool = False) -> None:
        self.runtime.states.restart_requested(self.kernel_id, restart)
        self._stopping = True

    async def cleanup(self, restart: bool = False) -> None:
        if self._launched:
            # A kernel that exited on a shutdown request leaves a Succeeded pod: delete it, so
            # nothing of the kernel is left in the cluster (its Secret goes with it, as owner).
            # Not again when a kill has already seen it gone (a request that would only 404).
            try:
                if self.informer.get(self.kernel_id) is not None:
                    await self._delete_pod(grace=0, wait=True)
            except TimeoutError:
                self.log.warning("kernel pod %s still there after %g s", self._pod_name, self.stop_timeout)
            await self._delete_secret()
        self._launched = False
        if restart:
            return
        release_slice(self.runtime, self.kernel_id, "kernel shut down", self.log)
        self.runtime.kernels.remove(self.kernel_id)

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        """Pods take longer than processes to start (scheduling, image, volumes)."""
        return max(recommended, 60.0)

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info.update(
            pod_name=self._pod_name,
            launched=self._launched,
            namespace=self._namespace,
            warm=self.warm.origin,
            requested_dir=self._requested_dir,
            kernel_env=self._kernel_env,
        )
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self._launched = bool(provisioner_info.get("launched"))
        self._namespace = provisioner_info.get("namespace") or self._namespace
        self._pod_name = provisioner_info.get("pod_name") or self._pod_name
        self.warm.origin = bool(provisioner_info.get("warm"))
        self._requested_dir = provisioner_info.get("requested_dir") or self._requested_dir
        self._kernel_env = dict(provisioner_info.get("kernel_env") or self._kernel_env)
