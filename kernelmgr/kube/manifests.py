"""Kernel pods, warm pods and their Secrets, as plain dicts built from plain inputs.

Pure functions (kubespawner's ``make_pod`` shape): no API call, no file, no clock, no runtime. The
provisioner and the warm pods gather what they need first (the owner's key, the agent's environment,
the checkpoint claim's sub-path, checked on disk) and pass it in; the API server validates the result.
``tests/test_kube_manifests.py`` reads them without a cluster.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kernelmgr.backends.kubernetes import render_pod_fragment
from kernelmgr.checkpoint.keys import encode_key
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.kube.labels import DEFAULT_INSTANCE, WARM_KERNEL, common_labels, kernel_labels
from kernelmgr.kube.namespaces import MAX_LABEL, dns_label
from kernelmgr.kube.pod_settings import SHM_MOUNT, SHM_VOLUME, pull_secrets, strategic_merge
from kernelmgr.kube.user_volumes import home_pod_affinity, user_mounts, working_dir
from kernelmgr.kube.warm_pod import ENV_CHECKPOINTS, ENV_TOKEN_FILE

OWNER_ANNOTATION = "elastic.jupyter.org/owner"
SIZE_ANNOTATION = "elastic.jupyter.org/size"
KERNELSPEC_ANNOTATION = "elastic.jupyter.org/kernelspec"
#: On a kernel pod that was a warm pod: its checkpoints are in its emptyDir until the server takes them.
WARM_ANNOTATION = "elastic.jupyter.org/warm-pod"
SECRET_MOUNT = "/etc/elastic"
CONNECTION_FILE = "connection.json"
KEY_FILE = "checkpoint.key"
CHECKPOINT_MOUNT = "/var/lib/elastic/checkpoints"
TMP_MOUNT = "/tmp"
#: Tells the agent the key file sits on a read-only Secret volume (it cannot remove it).
ENV_KEY_MOUNTED = "ELASTIC_CHECKPOINT_KEY_MOUNTED"
#: The pod's entry point (:mod:`kernelmgr.kube.pod_kernel`): ipykernel on the pod's own IP.
POD_KERNEL = "kernelmgr.kube.pod_kernel"
#: The entry point of a warm pod (:mod:`kernelmgr.kube.warm_pod`).
WARM_POD = "kernelmgr.kube.warm_pod"
#: The key of a warm pod's Secret that holds the token its HTTP server answers.
WARM_TOKEN_KEY = "warm-token"
PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
#: The GPU's device plugin (and the NVIDIA container toolkit) own these: a value set in the pod spec
#: could widen the slice (``NVIDIA_VISIBLE_DEVICES=all``) or switch its limits off.
SLICE_ENV_PREFIXES = ("CUDA_", "NVIDIA_")
#: Set by the provisioner itself.
RESERVED_ENV = ("POD_IP", "HOME", "TMPDIR")
NODE_LOST_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


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


@dataclass(frozen=True)
class PodTemplate:
    """What every pod of one configuration shares (made by ``KubeSettings.pod_template``)."""

    image: str = "python:3.12"
    #: The app.kubernetes.io/instance label (the Helm release) of every pod and Secret made.
    instance: str = DEFAULT_INSTANCE
    first_port: int = 52000
    run_as_user: int = 1000
    kernel_home: str = "/home/kernel"
    read_only_root_filesystem: bool = True
    stop_grace_seconds: int = 60
    node_lost_seconds: int = 60
    service_account: str = ""
    checkpoint_claim: str = ""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    extra_annotations: Mapping[str, str] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    #: The pods' requests/limits: for CPU kernels, GPU sizes by default, and per size.
    cpu_resources: Mapping[str, Any] = field(default_factory=dict)
    gpu_resources: Mapping[str, Any] = field(default_factory=dict)
    size_resources: Mapping[str, Any] = field(default_factory=dict)
    #: Per GPU size: image, resources, placement, /dev/shm... (:mod:`kernelmgr.kube.pod_settings`).
    size_pods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: The CPU kernels' pod settings (the same keys as a size's; none of a GPU size's reach them).
    cpu_pods: Mapping[str, Any] = field(default_factory=dict)
    #: /dev/shm of every kernel pod unless its settings name a shmSize ("": the runtime's 64 MiB).
    shm_size: str = ""
    #: Strategic-merge patch applied last to every kernel and warm pod.
    pod_patch: Mapping[str, Any] = field(default_factory=dict)
    #: The owner's volumes (:mod:`kernelmgr.kube.user_volumes`), which of them is HOME, where the
    #: notebooks are on the single-user server, and (ReadWriteOnce homes) the single-user pod to join.
    user_volumes: tuple[Mapping[str, Any], ...] = ()
    home_volume: str = ""
    notebook_root: str = ""
    user_pod_selector: Mapping[str, str] | None = None
    user_pod_namespace: str = ""
    #: Per owner, the (uid, gid) their kernels run as; others run as run_as_user.
    user_ids: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def identity(self, owner: str | None) -> tuple[int, int]:
        """The uid and gid ``owner``'s kernels run as (a warm pod, with no owner yet: run_as_user)."""
        if owner is not None and owner in self.user_ids:
            return self.user_ids[owner]
        return self.run_as_user, self.run_as_user

    @property
    def home(self) -> str:
        """The kernel's HOME: the home volume's mountPath, else the kernel_home emptyDir."""
        for entry in self.user_volumes:
            if entry["name"] == self.home_volume:
                return str(entry["mountPath"])
        return self.kernel_home

    @property
    def warm_pod_port(self) -> int:
        """The port of a warm pod's HTTP server: the one after the kernel's five."""
        return self.first_port + len(PORT_NAMES)

    def resources(self, size: str | None) -> dict[str, Any]:
        """The kernel container's requests/limits before the size's GPU resources are added."""
        chosen = self.cpu_resources if size is None else self.size_resources.get(size, self.gpu_resources)
        own = self.size_settings(size)
        chosen = own.get("resources", chosen)
        resources = {kind: dict(values) for kind, values in chosen.items() if values}
        if "ephemeralStorage" in own:
            resources.setdefault("limits", {})["ephemeral-storage"] = own["ephemeralStorage"]
        return resources

    def size_settings(self, size: str | None) -> Mapping[str, Any]:
        """The pod settings of ``size``, or of the CPU kernels (``None``)."""
        return self.size_pods.get(size, {}) if size is not None else self.cpu_pods


def make_kernel_pod(
    template: PodTemplate,
    *,
    name: str,
    kernel_id: str,
    cmd: list[str],
    agent_env: Mapping[str, str],
    owner: str,
    kernelspec: str,
    profile: GpuProfile | None,
    checkpoint_sub_path: str | None,
    requested_dir: str | None = None,
    kernel_env: Mapping[str, str] | None = None,
    image: str | None = None,
    secret_env: Sequence[str] = (),
) -> dict[str, Any]:
    """A kernel's pod: ``agent_env`` is the checkpoint agent's environment (paths are replaced by
    the pod's own), ``checkpoint_sub_path`` the owner's folder of the claim (``None``: no claim),
    ``requested_dir`` the notebook's folder on the single-user server (``KERNEL_WORKING_DIR``),
    ``kernel_env`` the kernelspec's and the client's variables, ``image`` the kernelspec's image,
    ``secret_env`` variables read from the pod's Secret (same names as keys), not shown in its spec."""
    own_env = dict(agent_env)
    own_env["ELASTIC_CHECKPOINT_DIR"] = f"{CHECKPOINT_MOUNT}/{kernel_id}"
    own_env[ENV_KEY_MOUNTED] = "1"
    labels = {**template.extra_labels, **kernel_labels(template.instance, kernel_id, owner)}
    annotations = {**template.extra_annotations, OWNER_ANNOTATION: owner, KERNELSPEC_ANNOTATION: kernelspec}
    if profile is not None:
        annotations[SIZE_ANNOTATION] = profile.name
    if template.checkpoint_claim:
        volume = {"name": "checkpoints", "persistentVolumeClaim": {"claimName": template.checkpoint_claim}}
    else:
        volume = {"name": "checkpoints", "emptyDir": {}}
    sub_path = {"subPath": checkpoint_sub_path} if checkpoint_sub_path is not None else {}
    pod = _pod(
        template,
        name,
        cmd,
        own_env,
        labels,
        annotations,
        volume,
        sub_path,
        profile,
        kernel_id,
        owner,
        requested_dir,
    )
    container = pod["spec"]["containers"][0]
    container["env"] += [
        {"name": n, "valueFrom": {"secretKeyRef": {"name": name, "key": n}}} for n in secret_env
    ]
    if image:
        container["image"] = image
    if kernel_env:
        reserved = sorted(n for n in kernel_env if n in RESERVED_ENV or n.startswith("ELASTIC_"))
        refusal = slice_env_refusal(set(kernel_env), f"the kernelspec {kernelspec!r}")
        if refusal is None and reserved:
            refusal = (
                f"the kernelspec {kernelspec!r} may not set {', '.join(reserved)}: the kernel pod sets them"
            )
        if refusal is not None:
            raise ConfigError(refusal)
        # Before the pod's own variables (HOME, TMPDIR, the agent's), after extra_env.
        first = 1 + len(template.extra_env)
        container["env"][first:first] = [{"name": k, "value": v} for k, v in kernel_env.items()]
    return pod


def _add_user_files(
    template: PodTemplate, pod: dict[str, Any], owner: str, requested_dir: str | None
) -> None:
    """The owner's volumes, their HOME on one of them, the notebook's folder as working directory,
    and (a ReadWriteOnce home) the node of the owner's single-user pod."""
    slug = dns_label(owner, MAX_LABEL)
    spec = pod["spec"]
    container = spec["containers"][0]
    volumes, mounts = user_mounts(list(template.user_volumes), slug)
    if template.home_volume:  # HOME is the user's, not an emptyDir
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "home"]
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "home"]
    spec["volumes"] += volumes
    container["volumeMounts"] += mounts
    home = template.home if template.home_volume else None
    chosen = working_dir(requested_dir, template.notebook_root, home, list(template.user_volumes))
    if chosen is not None:
        container["workingDir"] = chosen
    # The kubelet would otherwise chown a whole home at every start (fsGroup); once is enough.
    spec["securityContext"]["fsGroupChangePolicy"] = "OnRootMismatch"
    if template.user_pod_selector is not None:
        join = home_pod_affinity(template.user_pod_selector, template.user_pod_namespace, slug)
        affinity = spec.setdefault("affinity", {})
        terms = affinity.setdefault("podAffinity", {}).setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", []
        )
        terms += join["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def make_kernel_secret(
    *,
    name: str,
    kernel_id: str,
    owner: str,
    connection_info: Mapping[str, Any],
    checkpoint_key: bytes,
    instance: str = DEFAULT_INSTANCE,
    env: Mapping[str, str] | None = None,
    data_key: bytes | None = None,
) -> dict[str, Any]:
    """Connection file and checkpoint key (made owned by the pod once the pod exists), and the
    values of the pod's ``secret_env`` variables."""
    info = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in connection_info.items()}
    info["ip"] = "0.0.0.0"  # the pod's IP is not known yet: kernelmgr.kube.pod_kernel puts it in
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": kernel_labels(instance, kernel_id, owner)},
        "type": "Opaque",
        "stringData": {
            CONNECTION_FILE: json.dumps(info),
            KEY_FILE: encode_key(checkpoint_key, data_key).decode(),
            **(env or {}),
        },
    }


def make_warm_pod(
    template: PodTemplate, *, name: str, profile: GpuProfile, preload: tuple[str, ...]
) -> dict[str, Any]:
    """A warm pod of ``profile``: the size's resources and a kernel pod's environment, but no owner,
    no key and no checkpoint claim (an emptyDir for the one kernel it will serve)."""
    own_env = {ENV_TOKEN_FILE: f"{SECRET_MOUNT}/{WARM_TOKEN_KEY}", ENV_CHECKPOINTS: CHECKPOINT_MOUNT}
    labels = {**template.extra_labels, **common_labels(template.instance, WARM_KERNEL)}
    annotations = {**template.extra_annotations, SIZE_ANNOTATION: profile.name}
    cmd = ["python", "-m", WARM_POD, "--port", str(template.warm_pod_port), *preload]
    volume = {"name": "checkpoints", "emptyDir": {}}
    pod = _pod(template, name, cmd, own_env, labels, annotations, volume, {}, profile, name)
    pod["spec"]["containers"][0]["ports"].append({"name": "warm", "containerPort": template.warm_pod_port})
    return pod


def make_warm_secret(name: str, token: str, instance: str = DEFAULT_INSTANCE) -> dict[str, Any]:
    """The token a warm pod's HTTP server answers."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": common_labels(instance, WARM_KERNEL)},
        "type": "Opaque",
        "stringData": {WARM_TOKEN_KEY: token},
    }


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """The patch that makes a Secret owned by its pod (garbage-collected with it)."""
    return {"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}]}}


def checkpoint_sub_path(claim_path: str, owner_dir: str) -> str:
    """The owner's folder inside the claim: the only checkpoints a kernel pod can see."""
    prefix = claim_path.strip("/")
    return f"{prefix}/{owner_dir}" if prefix else owner_dir


def tolerations(template: PodTemplate, own: Any = ()) -> list[dict[str, Any]]:
    """The configured tolerations (global, then the size's ``own``), plus how long to wait for a
    node that stopped answering."""
    chosen = [dict(t) for t in (*template.tolerations, *own)]
    for taint in NODE_LOST_TAINTS:
        if not any(t.get("key") == taint for t in chosen):
            chosen.append(
                {
                    "key": taint,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": template.node_lost_seconds,
                }
            )
    return chosen


def _pod(
    template: PodTemplate,
    name: str,
    cmd: list[str],
    own_env: dict[str, str],
    labels: dict[str, str],
    annotations: dict[str, str],
    checkpoint_volume: dict[str, Any],
    sub_path: dict[str, str],
    profile: GpuProfile | None,
    fragment_id: str,
    owner: str | None = None,
    requested_dir: str | None = None,
) -> dict[str, Any]:
    """What a kernel pod and a warm pod share: security, the environment every kernel sees
    (so a warm kernel's is a cold one's), volumes, ports, placement and the size's resources."""
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    env += [{"name": k, "value": v} for k, v in template.extra_env.items()]
    # The root filesystem is read-only: HOME (IPython's profile, Jupyter's runtime files) and
    # /tmp are emptyDirs.
    env += [{"name": "HOME", "value": template.home}, {"name": "TMPDIR", "value": TMP_MOUNT}]
    env += [{"name": k, "value": v} for k, v in own_env.items()]
    user, group = template.identity(owner)
    own = template.size_settings(profile.name if profile is not None else None)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": template.stop_grace_seconds,
        "automountServiceAccountToken": bool(template.service_account),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": user,
            "runAsGroup": group,
            # The Secret's 0440 files and the volumes that honour fsGroup are the kernel's group's.
            "fsGroup": group,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "kernel",
                "image": own.get("image", template.image),
                "command": cmd,
                # A kernel that fails (exits non-zero) leaves its last log lines in its status, where
                # the start error quotes them: its pod is deleted at once, and `kubectl logs` with it.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "env": env,
                "ports": [
                    {"name": n.split("_")[0], "containerPort": template.first_port + i}
                    for i, n in enumerate(PORT_NAMES)
                ],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "runAsNonRoot": True,
                    "readOnlyRootFilesystem": template.read_only_root_filesystem,
                },
                "resources": template.resources(profile.name if profile is not None else None),
                "volumeMounts": [
                    {"name": "connection", "mountPath": SECRET_MOUNT, "readOnly": True},
                    {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT, **sub_path},
                    {"name": "home", "mountPath": template.kernel_home},
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
    shm = own.get("shmSize", template.shm_size)
    if shm:
        # The runtime's is 64 MiB: a DataLoader with workers (shared memory) dies with a bus error.
        spec["volumes"].append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
        spec["containers"][0]["volumeMounts"].append({"name": SHM_VOLUME, "mountPath": SHM_MOUNT})
    if template.service_account:
        spec["serviceAccountName"] = template.service_account
    # A size's node selector and tolerations add to the global ones (its own keys win).
    node_selector = {**template.node_selector, **own.get("nodeSelector", {})}
    if node_selector:
        spec["nodeSelector"] = node_selector
    spec["tolerations"] = tolerations(template, own.get("tolerations", ()))
    for key in ("priorityClassName", "runtimeClassName", "affinity"):
        if key in own:
            spec[key] = copy.deepcopy(own[key])
    if "imagePullSecrets" in own:
        spec["imagePullSecrets"] = pull_secrets(own["imagePullSecrets"])
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": spec,
    }
    if owner is not None and template.user_volumes:  # a kernel's pod (a warm pod has no owner yet)
        _add_user_files(template, pod, owner, requested_dir)
    slice_env: set[str] = set()
    if profile is not None:
        fragment = render_pod_fragment(profile, fragment_id)
        pod = fragment.apply_to(pod)
        slice_env = set(fragment.env)  # the slice backend's own limits (MPS) may set CUDA_*
    if template.pod_patch:
        pod = strategic_merge(pod, template.pod_patch)
    named = {e["name"] for c in pod["spec"]["containers"] for e in c.get("env") or []}
    refusal = slice_env_refusal(named - slice_env, f"the pod {name}")
    if refusal is not None:
        raise ConfigError(refusal)
    return pod
