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
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import os
import secrets
import signal
from dataclasses import dataclass
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import KernelProvisionerBase
from kubernetes import client, config
from traitlets import Bool, Dict, Float, Integer, List, TraitError, Unicode, validate

from kernelmgr.backends.kubernetes import render_pod_fragment
from kernelmgr.checkpoint.keys import encode_key
from kernelmgr.config import ElasticRuntime
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.modes import KUBERNETES_PROVISIONER
from kernelmgr.kube.access import ExplainedCoreV1Api
from kernelmgr.kube.informer import KERNEL_ID_LABEL, Informer, PodInformer, without_managed_fields
from kernelmgr.kube.namespaces import ensure_namespace, namespace_for
from kernelmgr.kube.node_agents import DEFAULT_INSTANCE, agent_selector
from kernelmgr.kube.nodes import follow_pod_node
from kernelmgr.kube.warm_client import WarmPodClient, WarmPodError
from kernelmgr.kube.warm_pod import ENV_CHECKPOINTS, ENV_TOKEN_FILE
from kernelmgr.nodeagent import DEFAULT_PORT as NODE_AGENT_PORT
from kernelmgr.provisioners.common import (
    AGENT_EXTENSION,
    claim_slice,
    find_runtime,
    mark_launched,
    profile_name_of,
    release_slice,
    with_agent,
)

PROVISIONER_NAME = KUBERNETES_PROVISIONER
APP_LABELS = {"app.kubernetes.io/name": "jupyter-elastic-kernels", "component": "kernel"}
OWNER_ANNOTATION = "elastic.jupyter.org/owner"
SIZE_ANNOTATION = "elastic.jupyter.org/size"
KERNELSPEC_ANNOTATION = "elastic.jupyter.org/kernelspec"
SECRET_MOUNT = "/etc/elastic"
CONNECTION_FILE = "connection.json"
KEY_FILE = "checkpoint.key"
CHECKPOINT_MOUNT = "/var/lib/elastic/checkpoints"
#: Tells the agent the key file sits on a read-only Secret volume (it cannot remove it).
ENV_KEY_MOUNTED = "ELASTIC_CHECKPOINT_KEY_MOUNTED"
#: The pod's entry point (:mod:`kernelmgr.kube.pod_kernel`): ipykernel on the pod's own IP.
POD_KERNEL = "kernelmgr.kube.pod_kernel"
APP_SELECTOR = ",".join(f"{k}={v}" for k, v in APP_LABELS.items())
PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
TMP_MOUNT = "/tmp"
#: The GPU's device plugin (and the NVIDIA container toolkit) own these: a value set in the pod spec
#: could widen the slice (``NVIDIA_VISIBLE_DEVICES=all``) or switch its limits off.
SLICE_ENV_PREFIXES = ("CUDA_", "NVIDIA_")
#: Set by the provisioner itself.
RESERVED_ENV = ("POD_IP", "HOME", "TMPDIR")
#: On a kernel pod that was a warm pod: its checkpoints are in its emptyDir until the server takes them.
WARM_ANNOTATION = "elastic.jupyter.org/warm-pod"
#: The key of a warm pod's Secret that holds the token its HTTP server answers.
WARM_TOKEN_KEY = "warm-token"
#: The entry point of a warm pod (:mod:`kernelmgr.kube.warm_pod`).
WARM_POD = "kernelmgr.kube.warm_pod"


def slice_env_refusal(names: list[str] | set[str], where: str) -> str | None:
    """Why these env names may not be set by ``where``, or ``None`` when they may."""
    escaping = sorted(n for n in names if n.upper().startswith(SLICE_ENV_PREFIXES))
    if escaping:
        return (
            f"{where} may not set {', '.join(escaping)}: CUDA_* and NVIDIA_* variables belong to the GPU's "
            "device plugin, which sets them for the kernel's slice; set in the pod they could expose GPUs "
            "outside the slice or lift its limits. Remove them from the configuration."
        )
    return None


#: Pod resources an admin may set for kernel pods (GPUs are the slice backend's).
POD_RESOURCE_NAMES = ("cpu", "memory", "ephemeral-storage")
DEFAULT_CPU_KERNEL_RESOURCES = {
    "requests": {"cpu": "250m", "memory": "1Gi"},
    "limits": {"cpu": "2", "memory": "4Gi"},
}
DEFAULT_GPU_KERNEL_RESOURCES = {
    "requests": {"cpu": "1", "memory": "4Gi"},
    "limits": {"cpu": "8", "memory": "32Gi"},
}


def pod_resources_refusal(raw: Any, where: str) -> str | None:
    """Why ``raw`` is not a kernel pod's ``{"requests": {...}, "limits": {...}}``, or ``None``."""
    from kubernetes.utils.quantity import parse_quantity

    if not isinstance(raw, dict) or set(raw) - {"requests", "limits"}:
        return f'{where} must be {{"requests": {{...}}, "limits": {{...}}}}, got {raw!r}'
    parsed: dict[str, dict[str, Any]] = {}
    for kind, values in raw.items():
        if not isinstance(values, dict):
            return f"{where}.{kind} must map resource names to quantities, got {values!r}"
        for name, quantity in values.items():
            if name not in POD_RESOURCE_NAMES:
                return (
                    f"{where}.{kind}.{name}: only {', '.join(POD_RESOURCE_NAMES)} may be set here "
                    "(a GPU size's own resources come from its slice backend)"
                )
            try:
                parsed.setdefault(kind, {})[name] = parse_quantity(quantity)
            except (ValueError, TypeError):
                return f"{where}.{kind}.{name}: {quantity!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)"
    for name, request in parsed.get("requests", {}).items():
        limit = parsed.get("limits", {}).get(name)
        if limit is not None and request > limit:
            asked, cap = raw["requests"][name], raw["limits"][name]
            return f"{where}: the {name} request ({asked}) exceeds its limit ({cap})"
    return None


_clients: dict[str, client.ApiClient] = {}
_informers: dict[tuple[str, str], PodInformer] = {}
_agent_informers: dict[tuple[str, str], Informer] = {}
_ensured_namespaces: set[tuple[str, str]] = set()
#: (kubeconfig, namespace, kind, name) of the DRA objects created (or found) by this process.
_ensured_side_objects: set[tuple[str, str, str, str]] = set()


def api_client(kubeconfig: str) -> client.ApiClient:
    """One API client per kubeconfig (``""``: in-cluster when there, else the default kubeconfig)."""
    if kubeconfig not in _clients:
        configuration = client.Configuration()
        if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=kubeconfig or None, client_configuration=configuration)
        _clients[kubeconfig] = client.ApiClient(configuration)
    return _clients[kubeconfig]


def shared_informer(kubeconfig: str, namespace: str) -> PodInformer:
    """The one pod watch per cluster and namespace, started on first use."""
    key = (kubeconfig, namespace)
    if key not in _informers:
        # Its own client: the watch holds a connection for minutes at a time.
        watch_api = client.ApiClient(api_client(kubeconfig).configuration)
        _informers[key] = PodInformer(watch_api, namespace, APP_SELECTOR).start()
    return _informers[key]


def kernel_pods() -> dict[str, Any]:
    """kernel id -> its pod, from every kernel pod watch's cache (one per kernel namespace in use)."""
    pods: dict[str, Any] = {}
    for informer in list(_informers.values()):
        pods.update(informer.items())
    return pods


def agent_informer(kubeconfig: str, namespace: str, instance: str = DEFAULT_INSTANCE) -> Informer:
    """The one watch over the node activity agent pods of release ``instance`` in ``namespace``
    (:func:`~kernelmgr.kube.node_agents.agent_selector`: name, instance and component labels), started
    on first use; keyed by pod name. Needs ``list`` and ``watch`` on pods there."""
    key = (kubeconfig, namespace)
    if key not in _agent_informers:
        watch_api = client.ApiClient(api_client(kubeconfig).configuration)
        _agent_informers[key] = Informer(
            ExplainedCoreV1Api(watch_api).list_namespaced_pod,
            key=lambda pod: pod.metadata.name,
            name=f"node-agents-{namespace}",
            list_args=(namespace,),
            list_kwargs={"label_selector": agent_selector(instance)},
            transform=without_managed_fields,
        ).start()
    return _agent_informers[key]


def stop_shared_informers() -> None:
    """Stop every pod watch (server exit, tests)."""
    for informer in [*_informers.values(), *_agent_informers.values()]:
        informer.stop()
    _informers.clear()
    _agent_informers.clear()
    _ensured_namespaces.clear()
    _ensured_side_objects.clear()


def pod_failure(pod: Any, events: list[Any] | None = None) -> str:
    """Why a pod is not running, in the words of the scheduler, the kubelet and the events."""
    if pod is None:
        return "the pod is gone"
    reasons: list[str] = []
    status = pod.status
    for condition in (status.conditions if status else None) or []:
        if condition.status != "True" and condition.reason:
            reasons.append(f"{condition.type}: {condition.reason}: {condition.message or ''}".strip())
    for container in (status.container_statuses if status else None) or []:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason and waiting.reason != "ContainerCreating":
            reasons.append(f"container {container.name}: {waiting.reason}: {waiting.message or ''}".strip())
        terminated = container.state.terminated if container.state else None
        if terminated is not None:
            reasons.append(f"container {container.name} exited with code {terminated.exit_code}")
    for event in events or []:
        said = any(str(event.message) in known for known in reasons)  # the scheduler says it twice
        if event.type == "Warning" and not said:
            reasons.append(f"{event.reason}: {event.message}")
    phase = status.phase if status else "Unknown"
    return f"phase {phase}; " + ("; ".join(reasons) if reasons else "no condition or event says why")


def _running(pod: Any) -> bool:
    status = pod.status if pod is not None else None
    return status is not None and status.phase == "Running" and bool(status.pod_ip)


def _finished(pod: Any) -> bool:
    return pod is None or (pod.status is not None and pod.status.phase in ("Succeeded", "Failed"))


def _evicted(pod: Any) -> bool:
    """Being deleted without us asking (an eviction, a node drained or lost): the kernel is going."""
    return pod is not None and pod.metadata.deletion_timestamp is not None


#: How long past a stopping pod's deadline (``deletionTimestamp``: the end of its grace period) the
#: server still waits for it to end before it takes the kernel over from its newest checkpoint.
STOP_DEADLINE_MARGIN = dt.timedelta(seconds=5)


def _not_ready(pod: Any) -> bool:
    """The pod's ``Ready`` condition is ``False``: the node controller says so of every pod on a node
    that stopped answering (nothing there will end the pod or write a checkpoint)."""
    conditions = (pod.status.conditions if pod.status is not None else None) or []
    return any(c.type == "Ready" and c.status == "False" for c in conditions)


def _stopping_gracefully(pod: Any, now: dt.datetime) -> bool:
    """Deleted or evicted by someone else, its grace period not over, on a node that answers.

    Its kernel got SIGTERM and may be checkpointing what changed
    (:mod:`kernelmgr.checkpoint.termination`): the server waits for the pod to end before it
    reads the newest checkpoint, rather than killing it (``grace=0``) and losing that work.
    """
    deadline = pod.metadata.deletion_timestamp if pod is not None else None
    if deadline is None or _finished(pod) or _not_ready(pod):
        return False
    return now < deadline + STOP_DEADLINE_MARGIN


def _stop_began(pod: Any) -> float | None:
    """When Kubernetes started stopping ``pod`` (its deadline less its grace period), epoch seconds."""
    deadline = pod.metadata.deletion_timestamp if pod is not None else None
    if deadline is None:
        return None
    return float(deadline.timestamp() - (pod.metadata.deletion_grace_period_seconds or 0))


def _loss(pod: Any) -> str:
    """Why a running kernel's pod vanished, in a user's words."""
    if pod is None:
        return "its pod was deleted"
    status = pod.status
    if status is not None and status.reason:
        return f"its pod was {status.reason.lower()}: {status.message or ''}".rstrip(": ")
    if pod.metadata.deletion_timestamp is not None:
        return f"its pod was deleted on node {pod.spec.node_name}"
    return f"its pod ended on node {pod.spec.node_name}: {pod_failure(pod)}"


def exit_code(pod: Any) -> int:
    """The kernel container's exit code; a pod gone without one counts as killed (-9)."""
    statuses = (pod.status.container_statuses if pod is not None and pod.status else None) or []
    for container in statuses:
        terminated = container.state.terminated if container.state else None
        if terminated is not None:
            return int(terminated.exit_code)
    return -9 if pod is None else 1


@dataclass
class FoundKernel:
    """A kernel pod found in the cluster (a previous server's), read from its labels and Secret."""

    kernel_id: str
    namespace: str
    kernelspec: str
    owner: str
    size: str | None
    running: bool
    #: The Secret's connection file with the pod's IP; ``None`` when the Secret is gone.
    connection_info: dict[str, Any] | None
    pod_name: str = ""
    #: The pod was a warm pod (:mod:`kernelmgr.kube.warm_pods`): its checkpoints must be collected.
    warm: bool = False


class ElasticKubernetesProvisioner(KernelProvisionerBase):
    """A kernel in its own pod, holding its GPU slice for the pod's life."""

    #: Set with the warm pod a launch took: ``resume`` or ``start`` (the pool's counters).
    _warm_use = "start"

    namespace = Unicode(
        "default",
        config=True,
        help="Namespace of the kernel pods (with namespace_template: set per kernel from the template).",
    )
    namespace_template = Unicode(
        "",
        config=True,
        help="One namespace per user, e.g. 'jupyter-{owner}' ({owner}: the kernel's owner as a DNS-1123 "
        "label, with a short hash when it had to be changed). Empty: every kernel in `namespace`.",
    )
    create_namespace = Bool(
        False,
        config=True,
        help="Create a missing kernel namespace (with namespace_labels) and bind namespace_cluster_role "
        "to the server there. Needs deploy/kubernetes/rbac-namespaces.yaml. Off: the admin makes them.",
    )
    namespace_labels = Dict(
        {"pod-security.kubernetes.io/enforce": "restricted"},
        config=True,
        help="Labels of the namespaces the server creates (Pod Security Admission 'restricted' by default).",
    )
    namespace_cluster_role = Unicode(
        "jupyter-elastic-kernels:kernel-pods",
        config=True,
        help="ClusterRole holding the kernel pod rules (deploy/kubernetes/rbac.yaml), bound to the server "
        "in each namespace it creates.",
    )
    namespace_network_policies = List(
        Dict(),
        config=True,
        help="""NetworkPolicies (manifests without a namespace) created in each namespace the server
        creates (create_namespace), before its first kernel pod: the Helm chart passes the ones it
        renders in its own kernel namespaces (only the gateway reaches kernel pods; kernel pods'
        egress denied but for DNS, the gateway and the allow-list: no cloud metadata, no private
        ranges). Empty: none, and a created namespace lets its kernels reach anything.""",
    )
    kubeconfig = Unicode(
        "", config=True, help="Kubeconfig file; empty: in-cluster configuration, else the default kubeconfig."
    )
    image = Unicode("quay.io/jupyter/scipy-notebook:latest", config=True, help="Kernel image.")
    command = List(
        Unicode(),
        default_value=[
            "python",
            "-m",
            "kernelmgr.kube.pod_kernel",
            "-f",
            f"{SECRET_MOUNT}/{CONNECTION_FILE}",
        ],
        config=True,
        help="""Kernel command. The default runs ipykernel on the pod's IP with the checkpoint agent
        (kernelmgr must be installed in the image); another ipykernel command gets the agent added,
        and must itself listen on $(POD_IP): the connection file's address is 0.0.0.0.""",
    )
    service_account = Unicode("", config=True, help="ServiceAccount of the pods (empty: no API token).")
    node_selector = Dict(config=True, help="spec.nodeSelector of the pods.")
    tolerations: List[Any] = List(config=True, help="spec.tolerations of the pods.")
    node_lost_seconds = Integer(
        60,
        config=True,
        help="""Seconds a kernel pod stays bound to a node that stopped answering (not-ready or
        unreachable) before Kubernetes evicts it; the server then hibernates the kernel from its
        last checkpoint and the next cell resumes it on a healthy node. Kubernetes' default is 300.""",
    )
    stop_grace_seconds = Integer(
        60,
        min=1,
        config=True,
        help="""spec.terminationGracePeriodSeconds of the pods: how long a kernel whose pod Kubernetes
        stops unasked (an eviction, a drain, a preemption) has to let its running cell finish and
        checkpoint what changed before it is killed. Size it for the largest state a kernel holds
        (its checkpoint time: see docs/benchmarks.md); Kubernetes' default is 30.""",
    )
    extra_labels = Dict(config=True, help="Labels added to the pods.")
    extra_annotations = Dict(config=True, help="Annotations added to the pods.")
    run_as_user = Integer(1000, config=True, help="Non-root user the kernel runs as.")
    extra_env = Dict(
        value_trait=Unicode(),
        config=True,
        help="Environment variables added to the kernel container. CUDA_* and NVIDIA_* are refused: "
        "the GPU's device plugin sets them, and overriding them would let a kernel see GPUs outside "
        "its slice. Names the provisioner sets itself (POD_IP, HOME, TMPDIR, ELASTIC_*) are refused too.",
    )
    read_only_root_filesystem = Bool(
        True,
        config=True,
        help="readOnlyRootFilesystem for the kernel container; HOME and /tmp are writable emptyDirs.",
    )
    kernel_home = Unicode(
        "/home/kernel", config=True, help="HOME of the kernel: a writable emptyDir mounted there."
    )
    launch_timeout = Float(300.0, config=True, help="Seconds until a pod must be Running.")
    stop_timeout = Float(60.0, config=True, help="Seconds to wait for a deleted pod to be gone.")
    first_port = Integer(52000, config=True, help="Kernel ports: this one and the four after it.")
    checkpoint_claim = Unicode(
        "",
        config=True,
        help="""PersistentVolumeClaim (ReadWriteMany) holding the checkpoints, mounted by the server at
        ElasticKernels.checkpoint_root too. Empty: an emptyDir, and kernels cannot hibernate.""",
    )
    checkpoint_claim_path = Unicode(
        "",
        config=True,
        help="""Where ElasticKernels.checkpoint_root is inside checkpoint_claim (the server's volume
        subPath); empty: the claim's root. Each pod mounts only <this>/<owner>.""",
    )

    node_agent_namespace = Unicode(
        "",
        config=True,
        help="""Namespace of the node activity agent pods (deploy/kubernetes/node-agent.yaml), which
        the server finds with one pod watch (node_agent_instance's labels) and asks
        for each kernel pod's GPU activity. Empty: `namespace` (the kernel namespace, where the
        server's Role already allows the watch). A namespace enforcing Pod Security "restricted"
        refuses the agents (hostPID, host /proc): then give them their own namespace, name it here,
        and bind the server a Role with pods list/watch there.""",
    )
    node_agent_port = Integer(
        NODE_AGENT_PORT, config=True, help="Port of the node agents' /activity (their --port)."
    )
    node_agent_instance = Unicode(
        DEFAULT_INSTANCE,
        config=True,
        help="""The app.kubernetes.io/instance label of the node agent pods (the Helm release's name):
        only pods with this label, app.kubernetes.io/name=jupyter-elastic-kernels and
        app.kubernetes.io/component=node-agent are asked (and sent node_agent_token_file's token).""",
    )
    node_agent_token_file = Unicode(
        "",
        config=True,
        help="""File holding the node agents' token (a Secret mounted in the server and given to the
        agents' --token-file): sent with every /activity request; an agent refuses requests without it.
        Empty: none is sent (agents started with --no-token only).""",
    )
    warm_pods = Dict(
        config=True,
        help="""Warm pods per GPU size, e.g. {"gpu-1": {"count": 1, "preload": ["torch"], "starts": false}}:
        `count` pods that hold a slice of the size and have imported `preload`, taken by resumes (and by
        new kernels with `starts`). They hold GPUs nobody uses: off by default. Needs checkpoint_claim
        and one kernel namespace (not namespace_template). See docs/architecture.md#warm-pods.""",
    )

    cpu_kernel_resources = Dict(
        DEFAULT_CPU_KERNEL_RESOURCES,
        config=True,
        help="""requests/limits (cpu, memory, ephemeral-storage) of a CPU kernel's pod. With this
        provisioner the server never runs a kernel itself: each base kernelspec (ElasticKernels.
        base_kernels) is offered as '<name>-cpu' (e.g. python3-cpu), a pod without a GPU slice, and
        the base name answers 404 naming it. A dedicated setting rather than a GPU size with no GPU:
        sizes are what quotas, the allocator and the cull rules count.""",
    )
    resources = Dict(
        DEFAULT_GPU_KERNEL_RESOURCES,
        config=True,
        help="""requests/limits (cpu, memory, ephemeral-storage) of a GPU-size kernel's pod (and its
        warm pods), unless size_resources names the size. The size's GPU resources are added by its
        slice backend.""",
    )
    size_resources = Dict(
        config=True,
        help="""Per GPU size, requests/limits replacing `resources` for that size's pods, e.g.
        {"whole": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "64Gi"}}}.""",
    )

    @validate("cpu_kernel_resources", "resources")
    def _check_resources(self, proposal: Any) -> dict[str, Any]:
        refusal = pod_resources_refusal(
            proposal["value"], f"ElasticKubernetesProvisioner.{proposal['trait'].name}"
        )
        if refusal is not None:
            raise TraitError(refusal)
        return dict(proposal["value"])

    @validate("size_resources")
    def _check_size_resources(self, proposal: Any) -> dict[str, Any]:
        for size, raw in proposal["value"].items():
            refusal = pod_resources_refusal(raw, f"ElasticKubernetesProvisioner.size_resources[{size!r}]")
            if refusal is not None:
                raise TraitError(refusal)
        return dict(proposal["value"])

    def check_sizes(self, sizes: list[str]) -> None:
        """Refuse (ConfigError, at server start) size_resources naming a size that does not exist."""
        unknown = sorted(set(self.size_resources) - set(sizes))
        if unknown:
            raise ConfigError(
                f"ElasticKubernetesProvisioner.size_resources names unknown GPU sizes {unknown}; "
                f"sizes: {', '.join(sizes) or 'none'}"
            )

    def pod_resources(self, size: str | None) -> dict[str, Any]:
        """The kernel container's requests/limits before the size's GPU resources are added."""
        chosen = self.cpu_kernel_resources if size is None else self.size_resources.get(size, self.resources)
        return {kind: dict(values) for kind, values in chosen.items() if values}

    @validate("extra_env")
    def _check_extra_env(self, proposal: Any) -> dict[str, str]:
        env = dict(proposal["value"])
        refusal = slice_env_refusal(set(env), "ElasticKubernetesProvisioner.extra_env")
        reserved = sorted(n for n in env if n in RESERVED_ENV or n.startswith("ELASTIC_"))
        if refusal is None and reserved:
            refusal = (
                f"ElasticKubernetesProvisioner.extra_env may not set {', '.join(reserved)}: "
                "the provisioner sets them (kernel_home sets HOME)"
            )
        if refusal is not None:
            raise TraitError(refusal)
        return env

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Signals cannot reach a pod: jupyter_client must interrupt with a control message.
        self.kernel_spec.interrupt_mode = "message"
        self._informer: PodInformer | None = None
        self._restarting = False
        self._pod_name = f"kernel-{self.kernel_id}"
        self._launched = False
        #: Why the kernel's pod vanished while it ran, once the server took the kernel over
        #: (hibernated from its checkpoint): until the next launch there is no process, and
        #: ``poll()`` must not report an exit (the restarter would start it again, empty).
        self._lost: str | None = None
        #: We asked the pod to go (shutdown, restart, hibernation): its end is no loss.
        self._stopping = False
        #: When Kubernetes began stopping the running pod unasked (epoch seconds), once seen.
        self._stop_began: float | None = None
        #: The warm pod this launch took (:mod:`kernelmgr.kube.warm_pods`), until it serves.
        self._warm: Any = None
        #: The running pod was a warm pod: its checkpoints are collected from it over HTTP.
        self._warm_origin = False
        self._warm_client: WarmPodClient | None = None

    # ---- plumbing

    @property
    def runtime(self) -> ElasticRuntime:
        return find_runtime(self.parent, PROVISIONER_NAME)

    @property
    def core(self) -> Any:
        """Typed ``Any``: the client's generated stubs do not accept the plain dict manifests we send.

        A 403 from any call raises :class:`~kernelmgr.kube.access.KubeForbidden` naming the rule
        the server's Role lacks (or ``KubeRefused`` with the reason, when admission refused).
        """
        return ExplainedCoreV1Api(api_client(self.kubeconfig))

    @property
    def informer(self) -> PodInformer:
        if self._informer is None:
            self._informer = shared_informer(self.kubeconfig, self.namespace)
        return self._informer

    @property
    def warm_pod_port(self) -> int:
        """The port of a warm pod's HTTP server: the one after the kernel's five."""
        return self.first_port + len(PORT_NAMES)

    @property
    def has_process(self) -> bool:
        """A pod was created and not cleaned up yet (ended or not: ``poll()`` says which), as a
        local provisioner's process object outlives the process until ``cleanup()``."""
        return self._launched

    # ---- launch

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        self._lost = None
        self._stopping = False
        self._stop_began = None
        self._pod_name = f"kernel-{self.kernel_id}"
        self._warm_origin = False
        self._warm_client = None
        runtime = self.runtime
        kernelspec_name = getattr(self.parent, "kernel_name", "") or ""
        size = profile_name_of(self.kernel_spec)
        self._warm = self._take_warm_pod(size)
        try:
            self._record, self._granted = claim_slice(
                runtime,
                self.kernel_id,
                kernelspec_name,
                size,
                take_over=self._warm.holder if self._warm else None,
            )
        except BaseException:
            if self._warm is not None:
                runtime.allocator.release(self._warm.holder)
                runtime.warm_pods.give_back(self._warm, "the kernel could not take it")
                self._warm = None
            raise
        self._record.launch_path = "warm" if self._warm is not None else "cold"
        try:
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

    def _take_warm_pod(self, size: str | None) -> Any:
        """A ready warm pod of ``size`` for this launch, or ``None`` (it starts cold).

        Without one, warm pods that hold the GPU this launch needs give it back first: they never
        keep a kernel from a GPU.
        """
        runtime = self.runtime
        pool = runtime.warm_pods
        if pool is None or size is None or runtime.allocator.slice_of(self.kernel_id) is not None:
            return None  # (a restarting kernel keeps the slice it holds, and starts in a new cold pod)
        record = runtime.kernels.get(self.kernel_id)
        use = "resume" if record is not None and record.state is KernelState.RESUMING else "start"
        warm = None
        if pool.serves(size, use):
            if POD_KERNEL not in self.command:
                pool.miss(size, "not_poolable")
            else:
                warm = pool.take(size, use)
        if warm is None:
            profile = runtime.profile(size)
            given = pool.make_room(lambda: runtime.allocator.fits(profile))
            if given:
                self.log.info("kernel %s: %d warm pod(s) gave their GPU back for it", self.kernel_id, given)
        else:
            self._warm_use = use
        return warm

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

        One pod watch per namespace in use (``shared_informer``), not one cluster-wide watch: the
        server then needs no right to read pods outside the kernel namespaces (docs/architecture.md).
        """
        if self.namespace_template:
            self.namespace = namespace_for(self.namespace_template, self._record.owner)
        key = (self.kubeconfig, self.namespace)
        if self.create_namespace and key not in _ensured_namespaces:
            created = await asyncio.to_thread(
                ensure_namespace,
                api_client(self.kubeconfig),
                self.namespace,
                labels=dict(self.namespace_labels),
                cluster_role=self.namespace_cluster_role,
                network_policies=[dict(policy) for policy in self.namespace_network_policies],
            )
            _ensured_namespaces.add(key)
            if created:
                self.log.info(
                    "Created namespace %s for the kernels of %s", self.namespace, self._record.owner
                )

    def _command(self) -> list[str]:
        cmd = list(self.command)
        if POD_KERNEL in cmd:
            cmd.append(f"--IPKernelApp.extra_extensions={AGENT_EXTENSION}")
            return cmd
        return with_agent(cmd)

    def pod_manifest(self, cmd: list[str]) -> dict[str, Any]:
        """The kernel pod (pure: tests read it, the API server validates it)."""
        runtime = self.runtime
        record = self._record
        store = runtime.checkpoints
        agent_env = store.agent_env(
            record.owner,
            self.kernel_id,
            key_file=f"{SECRET_MOUNT}/{KEY_FILE}",
            restore=record.restore_on_start,
            restore_checkpoint=record.restore_checkpoint,
            # A pod evicted, preempted or drained gets SIGTERM and its grace period: the kernel
            # checkpoints what changed onto the volume, and the server resumes it from there.
            checkpoint_on_sigterm=True,
        )
        store.kernel_dir(record.owner, self.kernel_id)  # refuses unsafe owner names and kernel ids
        agent_env["ELASTIC_CHECKPOINT_DIR"] = f"{CHECKPOINT_MOUNT}/{self.kernel_id}"
        agent_env[ENV_KEY_MOUNTED] = "1"
        labels = {**self.extra_labels, **APP_LABELS, KERNEL_ID_LABEL: self.kernel_id}
        annotations = {
            **self.extra_annotations,
            OWNER_ANNOTATION: record.owner,
            KERNELSPEC_ANNOTATION: record.kernelspec,
        }
        if self._granted is not None:
            annotations[SIZE_ANNOTATION] = self._granted.profile
        return self._pod(
            self._pod_name,
            cmd,
            agent_env,
            labels,
            annotations,
            self._checkpoint_volume(),
            self._checkpoint_sub_path(),
            self._granted.profile if self._granted is not None else None,
            self.kernel_id,
        )

    def _pod(
        self,
        name: str,
        cmd: list[str],
        own_env: dict[str, str],
        labels: dict[str, str],
        annotations: dict[str, str],
        checkpoint_volume: dict[str, Any],
        checkpoint_sub_path: dict[str, str],
        size: str | None,
        fragment_id: str,
    ) -> dict[str, Any]:
        """What a kernel pod and a warm pod share: security, the environment every kernel sees
        (so a warm kernel's is a cold one's), volumes, ports, placement and the size's resources."""
        runtime = self.runtime
        env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        env += [{"name": k, "value": v} for k, v in self.extra_env.items()]
        # The root filesystem is read-only: HOME (IPython's profile, Jupyter's runtime files) and
        # /tmp are emptyDirs.
        env += [{"name": "HOME", "value": self.kernel_home}, {"name": "TMPDIR", "value": TMP_MOUNT}]
        env += [{"name": k, "value": v} for k, v in own_env.items()]
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": self.stop_grace_seconds,
            "automountServiceAccountToken": bool(self.service_account),
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": self.run_as_user,
                "runAsGroup": self.run_as_user,
                "fsGroup": self.run_as_user,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "kernel",
                    "image": self.image,
                    "command": cmd,
                    "env": env,
                    "ports": [
                        {"name": n.split("_")[0], "containerPort": self.first_port + i}
                        for i, n in enumerate(PORT_NAMES)
                    ],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "runAsNonRoot": True,
                        "readOnlyRootFilesystem": self.read_only_root_filesystem,
                    },
                    "resources": self.pod_resources(size),
                    "volumeMounts": [
                        {"name": "connection", "mountPath": SECRET_MOUNT, "readOnly": True},
                        {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT, **checkpoint_sub_path},
                        {"name": "home", "mountPath": self.kernel_home},
                        {"name": "tmp", "mountPath": TMP_MOUNT},
                    ],
                }
            ],
            "volumes": [
                # 0440 with fsGroup: the kernel's group reads it, nobody else (the agent checks).
                {"name": "connection", "secret": {"secretName": name, "defaultMode": 0o440}},
                checkpoint_volume,
                {"name": "home", "emptyDir": {}},
                {"name": "tmp", "emptyDir": {}},
            ],
        }
        if self.service_account:
            spec["serviceAccountName"] = self.service_account
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        spec["tolerations"] = self._tolerations()
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": spec,
        }
        slice_env: set[str] = set()
        if size is not None:
            fragment = render_pod_fragment(runtime.profile(size), fragment_id)
            pod = fragment.apply_to(pod)
            slice_env = set(fragment.env)  # the slice backend's own limits (MPS) may set CUDA_*
        named = {e["name"] for c in pod["spec"]["containers"] for e in c.get("env") or []}
        refusal = slice_env_refusal(named - slice_env, f"the pod {name}")
        if refusal is not None:
            raise ConfigError(refusal)
        return pod

    def _tolerations(self) -> list[dict[str, Any]]:
        """The configured tolerations, plus how long to wait for a node that stopped answering."""
        tolerations = [dict(t) for t in self.tolerations]
        for taint in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(t.get("key") == taint for t in tolerations):
                tolerations.append(
                    {
                        "key": taint,
                        "operator": "Exists",
                        "effect": "NoExecute",
                        "tolerationSeconds": self.node_lost_seconds,
                    }
                )
        return tolerations

    def _checkpoint_volume(self) -> dict[str, Any]:
        if not self.checkpoint_claim:
            return {"name": "checkpoints", "emptyDir": {}}
        return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": self.checkpoint_claim}}

    def _checkpoint_sub_path(self) -> dict[str, str]:
        """The owner's folder of the claim: the only checkpoints this pod can see."""
        if not self.checkpoint_claim:
            return {}
        owner_dir = self.runtime.checkpoints.kernel_dir(self._record.owner, self.kernel_id).parent
        owner_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # a kubelet would create it as root
        prefix = self.checkpoint_claim_path.strip("/")
        return {"subPath": f"{prefix}/{owner_dir.name}" if prefix else owner_dir.name}

    @property
    def checkpoints_persist(self) -> bool:
        """Whether a checkpoint written by the pod outlives it (and the server can read it)."""
        return bool(self.checkpoint_claim)

    def secret_manifest(self) -> dict[str, Any]:
        """Connection file and checkpoint key (made owned by the pod once the pod exists)."""
        info = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in self.connection_info.items()}
        info["ip"] = "0.0.0.0"  # the pod's IP is not known yet: kernelmgr.kube.pod_kernel puts it in
        key = encode_key(self.runtime.checkpoints.key_for(self._record.owner)).decode()
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": self._pod_name,
                "labels": {**APP_LABELS, KERNEL_ID_LABEL: self.kernel_id},
            },
            "type": "Opaque",
            "stringData": {CONNECTION_FILE: json.dumps(info), KEY_FILE: key},
        }

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        try:
            info = await self._launch(cmd)
        except BaseException:
            await self._delete_pod(grace=0, wait=False)
            await self._delete_secret()
            self._launched = False
            release_slice(self.runtime, self.kernel_id, "kernel pod failed to start", self.log)
            raise
        self._restarting = False
        mark_launched(self.runtime, self.kernel_id, "pod running")
        return info

    async def _ensure_side_objects(self) -> None:
        """Create what the size's pod refers to besides itself (a DRA size's ResourceClaimTemplate,
        or its shared ResourceClaim), once per namespace: named after their content, so an existing
        one is the same object and a changed size gets a new name."""
        if self._granted is None:
            return
        fragment = render_pod_fragment(self.runtime.profile(self._granted.profile), self.kernel_id)
        for side in fragment.side_objects:
            key = (self.kubeconfig, self.namespace, side["kind"], side["metadata"]["name"])
            if key in _ensured_side_objects:
                continue
            resource: Any = client.ResourceV1Api(api_client(self.kubeconfig))  # plain dict manifests
            create = (
                resource.create_namespaced_resource_claim_template
                if side["kind"] == "ResourceClaimTemplate"
                else resource.create_namespaced_resource_claim
            )
            try:
                await asyncio.to_thread(create, self.namespace, side)
            except client.ApiException as exc:
                if exc.status != 409:  # 409: made already (by us, earlier, or another server)
                    raise RuntimeError(
                        f"could not create {side['kind']} {side['metadata']['name']} in {self.namespace} "
                        f"for GPU size {self._granted.profile}: {exc.status} {exc.reason}"
                    ) from None
            _ensured_side_objects.add(key)

    async def _launch(self, cmd: list[str]) -> KernelConnectionInfo:
        if self._warm is not None:
            warm, self._warm = self._warm, None
            pool = self.runtime.warm_pods
            try:
                info = await self._launch_warm(warm, cmd)
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
                self._pod_name = f"kernel-{self.kernel_id}"
                self._launched = self._stopping = self._warm_origin = False
                self._warm_client = None
            else:
                pool.hit(warm.size, self._warm_use)
                return info
        core = self.core
        await self._ensure_side_objects()
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
        owner = {"apiVersion": "v1", "kind": "Pod", "name": self._pod_name, "uid": pod.metadata.uid}
        await asyncio.to_thread(
            core.patch_namespaced_secret,
            self._pod_name,
            self.namespace,
            {"metadata": {"ownerReferences": [owner]}},
        )
        uid = pod.metadata.uid

        def ready_or_done(seen: Any) -> bool:
            if seen is None or seen.metadata.uid != uid:
                return False
            return _running(seen) or _finished(seen)

        seen: Any
        try:
            seen = await self.informer.wait_for(self.kernel_id, ready_or_done, self.launch_timeout)
        except TimeoutError:
            seen = self.informer.get(self.kernel_id)
            events = await asyncio.to_thread(self._events)
            raise RuntimeError(
                f"kernel pod {self.namespace}/{self._pod_name} not running after {self.launch_timeout:g} s: "
                f"{pod_failure(seen, events)}"
            ) from None
        if not _running(seen):
            raise RuntimeError(f"kernel pod {self.namespace}/{self._pod_name} ended: {pod_failure(seen)}")
        self.connection_info["ip"] = seen.status.pod_ip
        self.log.info("Kernel %s runs in pod %s at %s", self.kernel_id, self._pod_name, seen.status.pod_ip)
        self._follow_pod_node(seen)
        return self.connection_info

    async def _launch_warm(self, warm: Any, cmd: list[str]) -> KernelConnectionInfo:
        """Make ``warm`` this kernel's pod: relabelled as such, handed the checkpoint to restore, then
        its connection, its owner's key and the agent's variables (:mod:`kernelmgr.kube.warm_pod`)."""
        core, record, store = self.core, self._record, self.runtime.checkpoints
        self._pod_name = warm.name
        self._launched = True  # the pod is this kernel's now: a failure below deletes it
        self._warm_origin = True
        annotations = {
            **self.extra_annotations,
            OWNER_ANNOTATION: record.owner,
            KERNELSPEC_ANNOTATION: record.kernelspec,
            SIZE_ANNOTATION: warm.size,
            WARM_ANNOTATION: "true",
        }
        labels = {**APP_LABELS, KERNEL_ID_LABEL: self.kernel_id}
        await asyncio.to_thread(
            core.patch_namespaced_pod,
            warm.name,
            self.namespace,
            {"metadata": {"labels": labels, "annotations": annotations}},
        )
        seen: Any = await self.informer.wait_for(
            self.kernel_id,
            lambda pod: pod is not None and (_running(pod) or _finished(pod)),
            self.launch_timeout,
        )
        if not _running(seen) or not seen.status.pod_ip:
            raise RuntimeError(f"warm pod {warm.name} ended: {pod_failure(seen)}")
        pod_client = WarmPodClient(seen.status.pod_ip, self.warm_pod_port, warm.token)
        store.kernel_dir(record.owner, self.kernel_id)  # refuses unsafe owner names and kernel ids
        if record.restore_on_start and record.restore_checkpoint:
            # Verified again with the owner's key, right before it is sent (refused: WarmPodError).
            sent = await asyncio.to_thread(
                pod_client.push_checkpoint, self.kernel_id, store, record.owner, record.restore_checkpoint
            )
            self.log.info(
                "kernel %s: checkpoint (%d bytes) sent to warm pod %s", self.kernel_id, sent, warm.name
            )
        agent_env = store.agent_env(
            record.owner,
            self.kernel_id,
            key_file="(written by the warm pod)",
            restore=record.restore_on_start,
            restore_checkpoint=record.restore_checkpoint,
        )
        for name in ("ELASTIC_CHECKPOINT_DIR", "ELASTIC_CHECKPOINT_KEY_FILE"):
            agent_env.pop(name)  # paths inside the pod: the pod sets them
        connection = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in self.connection_info.items()}
        connection.pop("ip", None)
        handoff = {
            "kernel_id": self.kernel_id,
            "connection": connection,
            "key": store.key_for(record.owner).hex(),
            "env": agent_env,
            "args": cmd[cmd.index(POD_KERNEL) + 3 :],
        }
        await asyncio.to_thread(pod_client.handoff, handoff)
        # A restarted server adopts the kernel from its pod and Secret, as a cold kernel's.
        await asyncio.to_thread(
            core.patch_namespaced_secret,
            warm.name,
            self.namespace,
            {
                "metadata": {"labels": labels},
                "stringData": {CONNECTION_FILE: json.dumps({**connection, "ip": "0.0.0.0"})},
            },
        )
        self._warm_client = pod_client
        self.connection_info["ip"] = seen.status.pod_ip
        self.log.info("Kernel %s took warm pod %s at %s", self.kernel_id, warm.name, seen.status.pod_ip)
        self._follow_pod_node(seen)
        return self.connection_info

    async def _warm_pod_client(self) -> WarmPodClient | None:
        """The HTTP client of this kernel's pod if it was a warm pod (read back after an adoption)."""
        if not self._warm_origin or not self._launched:
            return None
        if self._warm_client is None:
            only_this = f"metadata.name={self._pod_name}"  # list, not get: the Role has no get on Secrets
            listed = await asyncio.to_thread(
                self.core.list_namespaced_secret, self.namespace, field_selector=only_this
            )
            data = listed.items[0].data or {} if listed.items else {}
            token = base64.b64decode(data.get(WARM_TOKEN_KEY, "")).decode()
            pod = self.informer.get(self.kernel_id)
            if not token or pod is None or not pod.status.pod_ip:
                raise RuntimeError(
                    f"warm pod {self._pod_name} has no token or no IP: its checkpoint cannot be read"
                )
            self._warm_client = WarmPodClient(pod.status.pod_ip, self.warm_pod_port, token)
        return self._warm_client

    async def collect_checkpoint(self) -> None:
        """Commit in the server's store the checkpoint the agent just wrote, when it is in a warm pod's
        emptyDir (a cold pod writes to the shared claim itself). The hibernator calls it before it
        stops the pod: the pod is never deleted before its checkpoint is committed here."""
        pod_client = await self._warm_pod_client()
        if pod_client is None:
            return
        store, owner = self.runtime.checkpoints, self._record.owner
        try:
            committed = await asyncio.to_thread(pod_client.pull_checkpoint, self.kernel_id, store, owner)
        except WarmPodError as exc:
            raise RuntimeError(
                f"the checkpoint could not be taken from warm pod {self._pod_name}: {exc}"
            ) from None
        store.forget_cached(owner, self.kernel_id)
        self.log.info(
            "kernel %s: checkpoint %s collected from warm pod %s", self.kernel_id, committed, self._pod_name
        )

    async def collect_restore_report(self) -> None:
        """Copy the agent's restore report from a warm pod into the store (REST and CLI read it there)."""
        pod_client = await self._warm_pod_client()
        if pod_client is not None:
            store, owner = self.runtime.checkpoints, self._record.owner
            await asyncio.to_thread(pod_client.pull_restore_report, self.kernel_id, store, owner)

    # ---- warm pods (the pool in kernelmgr.kube.warm_pods creates them through the configured provisioner)

    def warm_pod_manifest(self, name: str, size: str, preload: tuple[str, ...]) -> dict[str, Any]:
        """A warm pod of ``size``: the size's resources and a kernel pod's environment, but no owner,
        no key and no checkpoint claim (an emptyDir for the one kernel it will serve)."""
        own_env = {ENV_TOKEN_FILE: f"{SECRET_MOUNT}/{WARM_TOKEN_KEY}", ENV_CHECKPOINTS: CHECKPOINT_MOUNT}
        labels = {**self.extra_labels, **APP_LABELS, "component": "warm-kernel"}
        annotations = {**self.extra_annotations, SIZE_ANNOTATION: size}
        cmd = ["python", "-m", WARM_POD, "--port", str(self.warm_pod_port), *preload]
        pod = self._pod(
            name, cmd, own_env, labels, annotations, {"name": "checkpoints", "emptyDir": {}}, {}, size, name
        )
        pod["spec"]["containers"][0]["ports"].append({"name": "warm", "containerPort": self.warm_pod_port})
        return pod

    async def create_warm_pod(self, name: str, settings: Any, token: str) -> None:
        core = self.core
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "labels": {**APP_LABELS, "component": "warm-kernel"}},
            "type": "Opaque",
            "stringData": {WARM_TOKEN_KEY: token},
        }
        await asyncio.to_thread(core.create_namespaced_secret, self.namespace, secret)
        try:
            pod = await asyncio.to_thread(
                core.create_namespaced_pod,
                self.namespace,
                self.warm_pod_manifest(name, settings.size, settings.preload),
            )
        except BaseException:
            with contextlib.suppress(client.ApiException):
                await asyncio.to_thread(core.delete_namespaced_secret, name, self.namespace)
            raise
        owner = {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod.metadata.uid}
        await asyncio.to_thread(
            core.patch_namespaced_secret, name, self.namespace, {"metadata": {"ownerReferences": [owner]}}
        )

    async def delete_warm_pod(self, name: str) -> None:
        """Delete a warm pod and its Secret (gone already: nothing to do)."""
        for delete in (self.core.delete_namespaced_pod, self.core.delete_namespaced_secret):
            try:
                await asyncio.to_thread(delete, name, self.namespace, grace_period_seconds=0)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise

    def _follow_pod_node(self, pod: Any) -> None:
        """Book the slice on the node kube-scheduler bound the pod to (cluster inventory only)."""
        self._granted = follow_pod_node(self.runtime, self.kernel_id, self._granted, pod, self.log)

    def _events(self) -> list[Any]:
        """The pod's events: read once, only to explain a failed launch."""
        try:
            return list(
                self.core.list_namespaced_event(
                    self.namespace, field_selector=f"involvedObject.name={self._pod_name}"
                ).items
            )
        except client.ApiException:
            return []

    # ---- a restarted server finds its kernels

    async def find_kernel_pods(self) -> list[FoundKernel]:
        """The kernel pods in this provisioner's namespace, from the watch's cache and one list of
        the kernels' Secrets (the connection files): what a restarted server adopts."""
        if not await asyncio.to_thread(self.informer.wait_synced, self.launch_timeout):
            raise RuntimeError(f"the pod watch in {self.namespace} did not sync; kernels not adopted")
        listed = await asyncio.to_thread(
            self.core.list_namespaced_secret, self.namespace, label_selector=APP_SELECTOR
        )
        connections: dict[str, dict[str, Any]] = {}
        for secret in listed.items:
            kernel_id = (secret.metadata.labels or {}).get(KERNEL_ID_LABEL)
            raw = (secret.data or {}).get(CONNECTION_FILE)
            if kernel_id and raw:
                connections[kernel_id] = json.loads(base64.b64decode(raw))
        found = []
        for pod in self.informer.items().values():
            labels, annotations = pod.metadata.labels or {}, pod.metadata.annotations or {}
            kernel_id = labels.get(KERNEL_ID_LABEL)
            if not kernel_id or OWNER_ANNOTATION not in annotations:
                continue
            info = connections.get(kernel_id)
            running = _running(pod) and pod.metadata.deletion_timestamp is None
            if info is not None and running:
                info = {**info, "ip": pod.status.pod_ip, "key": str(info.get("key", "")).encode()}
            found.append(
                FoundKernel(
                    kernel_id=kernel_id,
                    namespace=self.namespace,
                    kernelspec=annotations.get(KERNELSPEC_ANNOTATION, ""),
                    owner=annotations[OWNER_ANNOTATION],
                    size=annotations.get(SIZE_ANNOTATION),
                    running=running,
                    connection_info=info,
                    pod_name=pod.metadata.name,
                    warm=annotations.get(WARM_ANNOTATION) == "true",
                )
            )
        return found

    def adopt(self, found: FoundKernel) -> KernelConnectionInfo:
        """Take over a running kernel pod: its slice claimed again, its connection as it was."""
        assert found.connection_info is not None
        self.namespace = found.namespace
        runtime = self.runtime
        self._record, self._granted = claim_slice(runtime, self.kernel_id, found.kernelspec, found.size)
        if self._record.owner != found.owner:
            self._record.owner = found.owner
        self.connection_info = found.connection_info  # type: ignore[assignment]
        self._launched = True
        self._pod_name = found.pod_name or self._pod_name
        self._warm_origin = found.warm
        self._follow_pod_node(self.informer.get(self.kernel_id))
        mark_launched(runtime, self.kernel_id, "adopted after a server restart")
        return self.connection_info

    async def remove_leftover(self, found: FoundKernel) -> None:
        """Delete a kernel pod and Secret nobody serves any more (ended, or never started), under
        the name the pod has (a warm pod a kernel took keeps its own)."""
        self.namespace = found.namespace
        self._pod_name = found.pod_name or self._pod_name
        self._launched = True
        with contextlib.suppress(client.ApiException, TimeoutError):
            await self._delete_pod(grace=0, wait=True)
        await self._delete_secret()
        self._launched = False

    # ---- life and death

    async def poll(self) -> int | None:
        if self._lost is not None:
            return None  # the server hibernated it from its checkpoint; the next cell resumes it
        if not self._launched:
            return 0
        pod = self.informer.get(self.kernel_id)
        if not _finished(pod) and not _evicted(pod):
            return None
        if self._stop_began is None:  # a pod deleted between two polls: its last state tells
            self._stop_began = _stop_began(
                pod if pod is not None else self.informer.last_deleted(self.kernel_id)
            )
        if not self._stopping and _stopping_gracefully(pod, dt.datetime.now(dt.timezone.utc)):
            # Stopped by Kubernetes: the kernel checkpoints itself within its grace period; the
            # notebook's messages wait for the resume instead of going to a process about to end.
            if self.runtime.kernel_stopping is not None:
                self.runtime.kernel_stopping(self.kernel_id)
            return None
        if not self._restarting:
            if await self._taken_over_as_lost(pod):
                return None
            release_slice(self.runtime, self.kernel_id, "kernel pod ended", self.log)
        return exit_code(pod)

    async def _taken_over_as_lost(self, pod: Any) -> bool:
        """The pod of a running kernel vanished unasked: offer the kernel to the server.

        Deleted, evicted, or stranded on a node that stopped answering: the server hibernates the
        kernel from its last checkpoint if it has one (``True``). What is left of the pod and its
        Secret goes now, so the resume can create them again under the same names.
        """
        runtime = self.runtime
        record = runtime.kernels.get(self.kernel_id)
        if self._stopping or runtime.kernel_lost is None:
            return False
        if record is None or record.state is not KernelState.RUNNING:
            return False
        why = _loss(pod)
        if not runtime.kernel_lost(self.kernel_id, why, self._stop_began):
            return False
        self._lost = why
        self.log.warning("Kernel %s lost its pod %s: %s", self.kernel_id, self._pod_name, why)
        with contextlib.suppress(client.ApiException, TimeoutError):
            await self._delete_pod(grace=0, wait=False)
        await self._delete_secret()
        self._launched = False
        return True

    async def wait(self) -> int | None:
        if not self._launched:
            return None
        pod = await self.informer.wait_for(self.kernel_id, _finished, self.stop_timeout + self.launch_timeout)
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

    async def _delete_pod(self, grace: int | None, wait: bool) -> None:
        if not self._launched:
            return
        self._stopping = True
        try:
            await asyncio.to_thread(
                self.core.delete_namespaced_pod, self._pod_name, self.namespace, grace_period_seconds=grace
            )
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        if wait:
            await self.informer.wait_for(self.kernel_id, lambda pod: pod is None, self.stop_timeout)

    async def _create_secret_and_pod(self, cmd: list[str]) -> Any:
        core = self.core
        await asyncio.to_thread(core.create_namespaced_secret, self.namespace, self.secret_manifest())
        self._launched = True
        return await asyncio.to_thread(core.create_namespaced_pod, self.namespace, self.pod_manifest(cmd))

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
            await asyncio.to_thread(self.core.delete_namespaced_secret, self._pod_name, self.namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                self.log.warning("could not delete Secret %s: %s", self._pod_name, exc.reason)

    async def shutdown_requested(self, restart: bool = False) -> None:
        self._restarting = restart
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
            pod_name=self._pod_name, launched=self._launched, namespace=self.namespace, warm=self._warm_origin
        )
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self._launched = bool(provisioner_info.get("launched"))
        self.namespace = provisioner_info.get("namespace") or self.namespace
        self._pod_name = provisioner_info.get("pod_name") or self._pod_name
        self._warm_origin = bool(provisioner_info.get("warm"))
