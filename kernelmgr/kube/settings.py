"""The Kubernetes settings: one traitlets ``Configurable`` for the kernel pods and the cluster.

The server's :class:`~kernelmgr.kube.cluster.KubeCluster` holds one, configured from the server's
configuration; each kernel's provisioner is one too (it subclasses this), so a kernelspec's
``metadata.kernel_provisioner.config`` can still override a setting for its own kernels.

Config sections: ``ElasticKubernetesProvisioner`` (the documented name, what the Helm chart renders)
and ``KubeSettings``; both apply, and ``ElasticKubernetesProvisioner`` wins where both set a key.

Long because every Kubernetes setting is one trait here with its help text and its check: the one
place the generated settings reference, the chart's ConfigMap and the provisioner all read.
"""

from __future__ import annotations

import os
from typing import Any

from traitlets import Bool, Dict, Enum, Float, Integer, List, TraitError, Unicode, validate
from traitlets.config import LoggingConfigurable

from kernelmgr import __version__
from kernelmgr.core.errors import ConfigError
from kernelmgr.kube.manifests import (
    CHECKPOINT_MOUNT,
    CONNECTION_FILE,
    POD_KERNEL,
    PORT_NAMES,
    RESERVED_ENV,
    SECRET_MOUNT,
    TMP_MOUNT,
    PodTemplate,
    slice_env_refusal,
)
from kernelmgr.kube.node_agents import DEFAULT_INSTANCE
from kernelmgr.kube.pod_settings import (
    SHM_MOUNT,
    pod_patch_refusal,
    quantity_refusal,
    size_pod_settings_refusal,
)
from kernelmgr.kube.user_volumes import ACCESS_MODES, user_volume_refusal
from kernelmgr.nodeagent import DEFAULT_PORT as NODE_AGENT_PORT

#: The project's kernel image at this version (scripts/images.sh builds it; the chart's default).
KERNEL_IMAGE = f"jupyter-elastic-kernels-kernel:{__version__}"

#: The section users (and the Helm chart) write the settings under.
SECTION = "ElasticKubernetesProvisioner"

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


def user_ids_refusal(raw: Any, where: str) -> str | None:
    """Why ``raw`` is not one owner's ``{"uid": N, "gid": M}``, or ``None``."""
    if not isinstance(raw, dict) or "uid" not in raw or set(raw) - {"uid", "gid"}:
        return f'{where} must be {{"uid": N, "gid": M}} (gid optional: the uid), got {raw!r}'
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{where}.{key} must be a number >= 0, got {value!r}"
    if raw["uid"] == 0:
        return f"{where}.uid 0 is root: kernel pods run as non-root (runAsNonRoot)"
    return None


def ids_of(raw: dict[str, int]) -> tuple[int, int]:
    """(uid, gid) of a checked ``user_ids`` entry."""
    return int(raw["uid"]), int(raw.get("gid", raw["uid"]))


def shared_group_refusal(owner: str, gid: int, claim: bool) -> str | None:
    """Why ``owner``'s kernels may not run with ``gid``, or ``None``. A server that is not root shares
    the owners' checkpoint folders through its own group (:mod:`kernelmgr.checkpoint.sharing`): a
    kernel in that group could not keep its folders from the other kernels in it."""
    if not claim or os.geteuid() == 0 or gid != os.getegid():
        return None
    return (
        f"{owner!r} would run with gid {gid}, the server's own group, through which it shares the owners' "
        "checkpoint folders on checkpoint_claim: give them their own gid (or run the server as root)"
    )


class KubeSettings(LoggingConfigurable):
    """Where and how kernel pods run; read from the ``ElasticKubernetesProvisioner`` section."""

    @classmethod
    def section_names(cls) -> list[str]:
        names = super().section_names()
        return names if SECTION in names else [*names, SECTION]

    namespace = Unicode(
        "default",
        config=True,
        help="Namespace of the kernel pods (with namespace_template: set per kernel from the template).",
    )
    state_namespace = Unicode(
        "",
        config=True,
        help="Namespace of the server's own state in the API: the kernel records (one ConfigMap per "
        "kernel) and, with several gateways, the Lease. Empty: `namespace`. The chart sets the "
        "gateway's namespace, where a Role of its own grants these (not the kernel ClusterRole, which "
        "every kernel namespace binds).",
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
    image = Unicode(
        KERNEL_IMAGE,
        config=True,
        help="Kernel image: one with this package at the server's version (docs/images.md). The "
        "default is the project's kernel image (images/kernel/Containerfile), as the chart's default.",
    )
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
    count_other_gpu_pods = Bool(
        True,
        config=True,
        help="""With ElasticKernels.gpu_inventory_source = "kubernetes": book the GPUs
        (nvidia.com/gpu), time-slicing replicas (their share of a GPU) and MIG instances
        (nvidia.com/mig-<profile>, mixed strategy) that pods other than kernels hold on the nodes,
        so that no kernel is
        promised one of them (one cluster-wide pod watch: needs list and watch on pods in every
        namespace). Off: every advertised GPU counts as the kernels' own.""",
    )
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
    run_as_user = Integer(
        1000, config=True, help="Non-root user (and group) of the kernels, unless user_ids names their owner."
    )
    user_ids = Dict(
        config=True,
        help="""Per owner, the uid and gid their kernels run as, e.g. {"alice": {"uid": 1001, "gid":
        1001}} (gid defaults to the uid), so files a kernel writes on a uid-owned home (NFS) are the
        user's. Owners not listed run as run_as_user. From the admin's configuration only (rendered
        from the directory that owns the homes), never from the client: a KERNEL_UID a user could
        send would let them claim anyone's files (docs/pods.md). Checkpoints: the server gives each
        listed owner's checkpoint folder to their uid, so with checkpoint_claim it must run as root.""",
    )
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
    failed_pod_retention = Float(
        300.0,
        min=0,
        config=True,
        help="""Seconds a kernel pod that failed on its own (a container that exited with an error,
        OOMKilled ...) is kept for ``kubectl logs`` and ``kubectl describe`` before it is deleted; 0
        deletes it at once. A kept pod leaves the kernels' watch (label component=kernel-failed):
        it holds no slice, is no kernel, is never adopted, and the kernel's next pod gets another
        name.""",
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
    instance = Unicode(
        DEFAULT_INSTANCE,
        config=True,
        help="""The app.kubernetes.io/instance label of the kernel pods, warm pods and Secrets this server
        makes (the Helm release's name). The server adopts, counts and deletes only pods of its own
        instance (and pods of versions before 0.x labels, which had none): two releases can share a
        namespace.""",
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
    wait_for_first_reply = Bool(
        True,
        config=True,
        help="""A new kernel's start waits, once its pod runs, for the kernel's first kernel_info reply
        (within ElasticKernels.start_timeout): a container that exits at once (an image without the
        package, a failing import) is then a failed start quoting its last log lines, not a kernel
        that dies after the 201. Off only where nodes run no kernels (kwok simulations).""",
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

    size_pod_settings = Dict(
        config=True,
        help="""Per GPU size, pod settings (pod spec names): image, resources (requests/limits of cpu,
        memory, ephemeral-storage; replaces `resources`/size_resources; requests = limits gives
        Guaranteed QoS), priorityClassName, nodeSelector and tolerations (added to node_selector /
        tolerations), affinity, runtimeClassName, imagePullSecrets (names), shmSize (a memory-backed
        emptyDir at /dev/shm: PyTorch DataLoader workers need more than the runtime's 64 MiB; it counts
        towards the memory limit) and ephemeralStorage (the container's ephemeral-storage limit), e.g.
        {"a100": {"image": "registry/torch:2", "nodeSelector": {"gpu": "a100"}, "shmSize": "8Gi"}}.
        The API server checks each size's pod at start-up (a dry-run; see validate_pods_at_start).""",
    )
    cpu_pod_settings = Dict(
        config=True,
        help="""The CPU kernels' ('<name>-cpu') pod settings, with a GPU size's keys (size_pod_settings):
        image, resources (replaces cpu_kernel_resources), priorityClassName, nodeSelector and
        tolerations (added to node_selector / tolerations), affinity, runtimeClassName,
        imagePullSecrets, shmSize, ephemeralStorage; e.g. {"nodeSelector": {"pool": "cpu"},
        "image": "registry/kernel-slim:1"} keeps CPU kernels off the GPU nodes.""",
    )
    shm_size = Unicode(
        "1Gi",
        config=True,
        help="""/dev/shm of every kernel and warm pod: a memory-backed emptyDir of this size (it counts
        towards the pod's memory limit only as far as it is used). Container runtimes give 64 MiB, and
        multiprocessing with shared memory (a PyTorch DataLoader with workers) then dies with a bus
        error. A size's (or cpu_pod_settings') shmSize wins; empty: the runtime's 64 MiB.""",
    )
    pod_patch = Dict(
        config=True,
        help="""A strategic-merge patch ({"metadata": {...}, "spec": {...}}) applied last to every kernel
        and warm pod, for what no setting covers (topologySpreadConstraints, dnsConfig, an extra volume
        or sidecar...): maps merge, null removes a key, containers/volumes/env merge by name, other
        lists replace. Kernel pods must still pass the namespace's Pod Security level.""",
    )
    validate_pods_at_start = Bool(
        True,
        config=True,
        help="""At start-up, send a CPU kernel's pod and each GPU size's pod to the API server as a
        dry-run create in `namespace`: a value it refuses (a missing PriorityClass or RuntimeClass, an
        unknown field in pod_patch, Pod Security) stops the server with one line naming the size and
        the field. Skipped, with a warning, when the namespace does not exist yet or the API server
        cannot be reached.""",
    )

    user_volumes = List(
        Dict(),
        config=True,
        help="""The user's volumes, mounted into each of their kernel pods (docs/pods.md), e.g. z2jh's
        home: [{"name": "home", "claimName": "claim-{owner}", "mountPath": "/home/jovyan"}], or any
        volume source: {"name": "data", "volume": {"nfs": {"server": "nfs", "path": "/export"}},
        "mountPath": "/data", "subPath": "{owner}", "readOnly": false}. {owner} is the kernel's owner
        as a DNS-1123 label (the name itself when it is one: KubeSpawner's 'safe' slug for plain names).
        Warm pods cannot serve such kernels (a warm pod has no owner): warm_pods is refused with them.""",
    )
    home_volume = Unicode(
        "",
        config=True,
        help="""The name of the user_volumes entry that is the kernel's HOME (instead of an emptyDir
        at kernel_home), so `pip install --user`, ~/.cache/huggingface and ~/.cache/torch survive a
        hibernation, and the notebook's folder (KERNEL_WORKING_DIR under notebook_root) is found.""",
    )
    notebook_root = Unicode(
        "/home/jovyan",
        config=True,
        help="""Where home_volume is on the single-user server: the notebook's folder there
        (KERNEL_WORKING_DIR, which GatewayClient sends, or the server's own cwd) maps from under this
        onto home_volume's mountPath, and becomes the kernel's working directory.""",
    )
    home_access_mode = Enum(
        ACCESS_MODES,
        default_value="ReadWriteMany",
        config=True,
        help="""How the user's volumes can be mounted. ReadWriteMany (NFS, EFS, CephFS, Filestore): on
        any node, at the same time as the single-user server. ReadWriteOnce (EBS, PD, most block
        storage): on one node only, so each kernel pod is pinned (required pod affinity) to the node of
        its owner's single-user pod (user_pod_selector, user_pod_namespace): that node must have the
        GPU, or the kernel fails to start with the scheduler's reason. See docs/pods.md.""",
    )
    user_pod_selector = Dict(
        default_value={"component": "singleuser-server", "hub.jupyter.org/username": "{owner}"},
        value_trait=Unicode(),
        config=True,
        help="Labels of an owner's single-user pod (z2jh's by default; {owner} as in user_volumes), "
        "joined by kernel pods when home_access_mode is ReadWriteOnce.",
    )
    user_pod_namespace = Unicode(
        "", config=True, help="Namespace of the single-user pods (empty: the kernel pod's own)."
    )

    client_env = List(
        Unicode(),
        config=True,
        help="""The client's KERNEL_* variables that reach the kernel pod (names, or prefixes ending in
        *, e.g. ["KERNEL_PROJECT", "KERNEL_EXTRA_*"]; ["KERNEL_*"]: all, as Enterprise Gateway does).
        jupyter_server's GatewayClient sends every KERNEL_* variable of the single-user server (and
        GatewayClient.allowed_envs). KERNEL_WORKING_DIR is read for the working directory either way.
        The env a kernelspec declares always reaches its pods.""",
    )
    kernelspec_images = Dict(
        value_trait=Unicode(),
        config=True,
        help="""Per base kernelspec (ElasticKernels.base_kernels), the image of its pods, e.g.
        {"python3": "registry/kernel-torch:2.5", "jax": "registry/kernel-jax:0.4"}: several
        environments, each an image; it wins over a size's image (size_pod_settings).""",
    )
    kernelspec_argv = List(
        Unicode(),
        config=True,
        help="""Base kernelspecs whose own argv runs in their pods, e.g. ["jax"] for an admin's
        kernelspec of another Python environment inside the image: {"argv": ["/opt/conda/envs/jax/bin/
        python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]}. The pod's entry point
        (`command`, kernelmgr.kube.pod_kernel) writes the pod's connection file and runs that argv
        with it; the checkpoint agent is loaded when that environment has kernelmgr. Other
        kernelspecs run `command` (their argv names the server's Python, not the image's).""",
    )

    @validate("user_volumes")
    def _check_user_volumes(self, proposal: Any) -> list[Any]:
        reserved = (SECRET_MOUNT, CHECKPOINT_MOUNT, TMP_MOUNT, SHM_MOUNT)
        refusal = user_volume_refusal(
            proposal["value"], "ElasticKubernetesProvisioner.user_volumes", reserved
        )
        if refusal is not None:
            raise TraitError(refusal)
        return list(proposal["value"])

    def check_user_files(self) -> None:
        """Refuse (ConfigError, at server start) user-volume settings that cannot work together."""
        names = [entry["name"] for entry in self.user_volumes]
        where = "ElasticKubernetesProvisioner"
        self.check_owner_folders()
        if self.home_volume and self.home_volume not in names:
            raise ConfigError(
                f"{where}.home_volume {self.home_volume!r} is not a user_volumes entry; entries: "
                f"{', '.join(names) or 'none'}"
            )
        if not self.user_volumes:
            if self.home_access_mode == "ReadWriteOnce":
                raise ConfigError(
                    f"{where}.home_access_mode ReadWriteOnce needs user_volumes (the home to follow)"
                )
            return
        if self.warm_pods:
            raise ConfigError(
                f"{where}.warm_pods cannot be used with user_volumes: a warm pod is made before it has an "
                "owner, so it cannot mount the owner's volumes"
            )
        if not self.home_volume:
            for entry in self.user_volumes:
                mount = entry["mountPath"].rstrip("/")
                home = self.kernel_home.rstrip("/")
                if mount == home or mount.startswith(home + "/") or home.startswith(mount + "/"):
                    raise ConfigError(
                        f"{where}.user_volumes entry {entry['name']!r} is mounted at {entry['mountPath']!r}, "
                        f"over the kernel_home emptyDir {self.kernel_home!r}: make it the home_volume"
                    )

    def check_owner_folders(self) -> None:
        """Refuse (ConfigError) a user_ids gid this server cannot share checkpoint folders with."""
        for owner, raw in self.user_ids.items():
            refusal = shared_group_refusal(owner, ids_of(raw)[1], bool(self.checkpoint_claim))
            if refusal is not None:
                raise ConfigError(f"ElasticKubernetesProvisioner.user_ids: {refusal}")

    @validate("size_pod_settings")
    def _check_size_pod_settings(self, proposal: Any) -> dict[str, Any]:
        for size, raw in proposal["value"].items():
            where = f"ElasticKubernetesProvisioner.size_pod_settings[{size!r}]"
            refusal = size_pod_settings_refusal(raw, where, pod_resources_refusal)
            if refusal is not None:
                raise TraitError(refusal)
        return dict(proposal["value"])

    @validate("user_ids")
    def _check_user_ids(self, proposal: Any) -> dict[str, Any]:
        for owner, ids in proposal["value"].items():
            refusal = user_ids_refusal(ids, f"ElasticKubernetesProvisioner.user_ids[{owner!r}]")
            if refusal is not None:
                raise TraitError(refusal)
        return dict(proposal["value"])

    @validate("cpu_pod_settings")
    def _check_cpu_pod_settings(self, proposal: Any) -> dict[str, Any]:
        where = "ElasticKubernetesProvisioner.cpu_pod_settings"
        refusal = size_pod_settings_refusal(proposal["value"], where, pod_resources_refusal)
        if refusal is not None:
            raise TraitError(refusal)
        return dict(proposal["value"])

    @validate("shm_size")
    def _check_shm_size(self, proposal: Any) -> str:
        value = str(proposal["value"]).strip()
        refusal = quantity_refusal(value, "ElasticKubernetesProvisioner.shm_size") if value else None
        if refusal is not None:
            raise TraitError(f"{refusal}, or empty for the runtime's 64 MiB")
        return value

    @validate("pod_patch")
    def _check_pod_patch(self, proposal: Any) -> dict[str, Any]:
        refusal = pod_patch_refusal(proposal["value"], "ElasticKubernetesProvisioner.pod_patch")
        if refusal is not None:
            raise TraitError(refusal)
        return dict(proposal["value"])

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
        """Refuse (ConfigError, at server start) size_resources or size_pod_settings naming a size
        that does not exist."""
        self.check_user_files()
        if self.kernelspec_argv and POD_KERNEL not in self.command:
            raise ConfigError(
                "ElasticKubernetesProvisioner.kernelspec_argv needs the default command "
                f"(python -m {POD_KERNEL} ...), which writes the connection file the argv is given"
            )
        for trait in ("size_resources", "size_pod_settings"):
            unknown = sorted(set(getattr(self, trait)) - set(sizes))
            if unknown:
                raise ConfigError(
                    f"ElasticKubernetesProvisioner.{trait} names unknown GPU sizes {unknown}; "
                    f"sizes: {', '.join(sizes) or 'none'}"
                )

    def pod_resources(self, size: str | None) -> dict[str, Any]:
        """The kernel container's requests/limits before the size's GPU resources are added."""
        return self.pod_template().resources(size)

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

    @property
    def warm_pod_port(self) -> int:
        """The port of a warm pod's HTTP server: the one after the kernel's five."""
        return self.first_port + len(PORT_NAMES)

    @property
    def checkpoints_persist(self) -> bool:
        """Whether a checkpoint written by a pod outlives it (and the server can read it)."""
        return bool(self.checkpoint_claim)

    def pod_template(self) -> PodTemplate:
        """What the manifest functions read of these settings."""
        return PodTemplate(
            image=self.image,
            instance=self.instance,
            first_port=self.first_port,
            run_as_user=self.run_as_user,
            kernel_home=self.kernel_home,
            read_only_root_filesystem=self.read_only_root_filesystem,
            stop_grace_seconds=self.stop_grace_seconds,
            node_lost_seconds=self.node_lost_seconds,
            service_account=self.service_account,
            checkpoint_claim=self.checkpoint_claim,
            extra_env=dict(self.extra_env),
            extra_labels=dict(self.extra_labels),
            extra_annotations=dict(self.extra_annotations),
            node_selector=dict(self.node_selector),
            tolerations=tuple(dict(t) for t in self.tolerations),
            cpu_resources=dict(self.cpu_kernel_resources),
            gpu_resources=dict(self.resources),
            size_resources=dict(self.size_resources),
            size_pods={size: dict(own) for size, own in self.size_pod_settings.items()},
            cpu_pods=dict(self.cpu_pod_settings),
            shm_size=self.shm_size,
            pod_patch=dict(self.pod_patch),
            user_volumes=tuple(dict(entry) for entry in self.user_volumes),
            home_volume=self.home_volume,
            notebook_root=self.notebook_root,
            user_pod_selector=dict(self.user_pod_selector)
            if self.home_access_mode == "ReadWriteOnce"
            else None,
            user_pod_namespace=self.user_pod_namespace,
            user_ids={owner: ids_of(raw) for owner, raw in self.user_ids.items()},
        )
