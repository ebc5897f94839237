"""Admin configuration (traitlets) and the runtime built from it.

``ElasticKernels`` holds the pinned configuration names (``c.ElasticKernels.profiles`` …) so a
plain ``jupyter_server_config.json`` — or a Helm ConfigMap holding one — configures the
project. :meth:`ElasticKernels.build` validates everything once, at start-up, and returns an
:class:`ElasticRuntime`: the validated profiles, the inventory, the allocator and the kernel
registry that the provisioners, the server extension and the gateway share.

Long because it is the one place every traitlet is declared and validated: split, a setting's help
and its check would live in different files.
"""

from __future__ import annotations

import getpass
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from jupyter_core.paths import jupyter_data_dir
from traitlets import Bool, Dict, Enum, Float, Integer, List, Type, Unicode, Union
from traitlets.config import LoggingConfigurable

from kernelmgr.activity.nvml import Nvml, PynvmlNvml, discover_inventory
from kernelmgr.backends.kubernetes import profile_resource, validate_backend_options
from kernelmgr.checkpoint.integrity import load_or_create_secret, migrate_secret
from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.core.allocator import STRATEGIES, InventoryChange, SliceAllocator
from kernelmgr.core.controller import KernelStates
from kernelmgr.core.errors import ConfigError, UnknownProfileError
from kernelmgr.core.inventory import GpuInventory
from kernelmgr.core.kernels import KernelRegistry
from kernelmgr.core.modes import KernelMode
from kernelmgr.core.policy import Policy, build_policy
from kernelmgr.core.profiles import GpuProfile, parse_profiles
from kernelmgr.core.queue import SliceQueue
from kernelmgr.core.units import parse_bytes
from kernelmgr.provisioners.accounts import KernelAccounts
from kernelmgr.warm.pool import WarmPools
from kernelmgr.warm.settings import WarmPoolConfigError, WarmPoolSettings, parse_warm_pool

#: The provisioners a GPU-size kernelspec may name (entry points of this package).
PROVISIONERS = tuple(mode.provisioner for mode in KernelMode)
INVENTORY_SOURCES = ("auto", "declared", "nvml", "kubernetes")

DEFAULT_PROFILES: dict[str, dict[str, Any]] = {
    "small": {"gpu_fraction": 0.25, "memory_mib": 10 * 1024},
    "medium": {"gpu_fraction": 0.5, "memory_mib": 20 * 1024},
    "whole": {"gpu_fraction": 1},
}


@dataclass
class ElasticRuntime:
    """Everything validated from configuration, shared by the adapters of one process."""

    profiles: dict[str, GpuProfile]
    allocator: SliceAllocator
    base_kernels: list[str]
    checkpoint_root: str
    checkpoints: CheckpointStore
    use_mps: bool = False
    reap_interval: float = 5.0
    checkpoint_timeout: float = 600.0
    resume_timeout: float = 120.0
    start_timeout: float = 120.0
    hibernate_on_shutdown: bool = True
    nvml: Nvml | None = None
    gpu_sample_interval: float = 10.0
    owner: str = field(default_factory=getpass.getuser)
    mode: KernelMode = KernelMode.LOCAL
    background_checkpoint_interval: float = 0.0
    kernels: KernelRegistry = field(default_factory=KernelRegistry)
    #: The kernels waiting for a GPU slice, in the order they are served (resumes).
    slice_queue: SliceQueue = field(default_factory=SliceQueue)
    #: ``ElasticKernels.max_slice_wait``: seconds a resume waits in the queue (0: until interrupted).
    max_slice_wait: float = 0.0
    #: ``ElasticKernels.start_queue_wait``: seconds a new kernel waits in the queue (0: refused at once).
    start_queue_wait: float = 0.0
    #: ``ElasticKernels.scale_up_wait``: seconds a kernel pod that found no slice may stay
    #: Pending for a node the cluster autoscaler adds (0: off, such a kernel waits in the queue).
    scale_up_wait: float = 0.0
    #: ``ElasticKernels.max_checkpoint_bytes``: each owner's checkpoint quota (``None``: none).
    max_checkpoint_bytes: int | None = None
    #: ``ElasticKernels.checkpoint_reserve``: the share of the checkpoint volume kept free for
    #: the kernels it already holds.
    checkpoint_reserve: float = 0.0
    #: The one writer of the kernels' lifecycle states (provisioners report starts and exits to it).
    states: KernelStates = field(init=False)
    #: Sizes removed from ``profiles`` while the server ran (the live file): no longer offered for
    #: new kernels, but the kernels that have one keep it (running, hibernated, resuming).
    retired: dict[str, GpuProfile] = field(default_factory=dict)

    #: Where devices come from at run time: "declared", "nvml", or "kubernetes" (the cluster's
    #: nodes, kept current by :class:`kernelmgr.kube.nodes.NodeInventorySync`, which the server
    #: starts when this says "kubernetes").
    inventory_source: str = "declared"
    #: ``ElasticKernels.warm_pool``, validated; the server starts the pools from it.
    warm_pool: dict[str, WarmPoolSettings] = field(default_factory=dict)
    #: The running pools (:class:`kernelmgr.warm.pool.WarmPools`), set by the server extension.
    warm_pools: WarmPools | None = None
    #: Kubernetes warm pods (:class:`kernelmgr.kube.warm_pods.WarmPods`), set by the server extension
    #: when ``ElasticKubernetesProvisioner.warm_pods`` asks for some. Typed ``Any``: the runtime
    #: must not import the Kubernetes adapter.
    warm_pods: Any = None
    #: The cluster (:class:`kernelmgr.kube.cluster.KubeCluster`: Kubernetes settings, API clients,
    #: pod watches), made and stopped by the server extension in Kubernetes mode. Typed ``Any``:
    #: the runtime must not import the Kubernetes adapter.
    kube: Any = None
    #: With several gateways (``ElasticLeaderElection.enabled``): their Lease
    #: (:class:`kernelmgr.kube.leader.LeaderLease`); ``None``: this server is the only one.
    leader: Any = None
    #: Set by a multi-user gateway (``ElasticGateway.kernel_accounts = "per-user"``): local kernels
    #: then run as their owner's OS account (:mod:`kernelmgr.provisioners.accounts`).
    kernel_accounts: KernelAccounts | None = None
    #: Set by a JupyterHub gateway (``ElasticGateway.user_ids_from_auth_state``): an object with
    #: ``async ids_of(owner) -> (uid, gid)`` that raises :class:`~kernelmgr.core.errors.ElasticError`
    #: saying what the admin must fix when the owner has none. Kernel pods of owners not in
    #: ``ElasticKubernetesProvisioner.user_ids`` then run as those ids. Typed ``Any``: the runtime
    #: must not import the gateway.
    owner_ids: Any = None

    def __post_init__(self) -> None:
        self.states = KernelStates(self.kernels)

    @property
    def inventory(self) -> GpuInventory:
        """The current snapshot of the devices (the allocator's: it changes when nodes do)."""
        return self.allocator.inventory

    def replace_inventory(self, inventory: GpuInventory) -> InventoryChange:
        """Swap in new devices; returns what changed, with the slices lost on removed devices."""
        return self.allocator.replace_inventory(inventory)

    def slices_held(self) -> dict[str, int]:
        """GPU slices each owner's kernels hold now (the slice queue's fair share counts them)."""
        held: dict[str, int] = {}
        for granted in self.allocator.slices():
            record = self.kernels.get(granted.kernel_id)
            if record is not None:
                held[record.owner] = held.get(record.owner, 0) + 1
        return held

    @property
    def gpus_available(self) -> bool:
        return len(self.inventory) > 0

    def waits_for_a_node(self, profile: GpuProfile) -> bool:
        """``profile`` fits on no node now, but the cluster may grow (``scale_up_wait``): its pod is
        created and left Pending for the autoscaler instead of waiting in the slice queue."""
        return self.scale_up_wait > 0 and not self.allocator.fits(profile, warm_gives_way=True)

    def profile(self, name: str) -> GpuProfile:
        """The size ``name``, a retired one included (its kernels still resume with it)."""
        try:
            return self.profiles[name] if name in self.profiles else self.retired[name]
        except KeyError:
            offered = ", ".join(self.profiles) or "none"
            raise UnknownProfileError(f"unknown GPU size {name!r}; sizes offered here: {offered}") from None


class ElasticKernels(LoggingConfigurable):
    """GPU sizes, the GPU inventory and where checkpoints go."""

    profiles = Dict(
        default_value=DEFAULT_PROFILES,
        config=True,
        help="""GPU sizes offered to users: name -> {display_name, gpu_fraction, memory_mib,
        compute_percent, backend, options}. gpu_fraction is a fraction of one GPU (0 < f < 1) or a
        whole number of GPUs (1, 2, ...); memory_mib is required for fractions. backend names the
        Kubernetes mechanism (whole, mig, shared, hami, volcano, dra); local kernels always get
        CUDA_VISIBLE_DEVICES and a memory cap.""",
    )
    gpu_inventory = List(
        Dict(),
        default_value=[],
        config=True,
        help="""Declared GPUs: a list of {uuid, name, memory_mib[, index, node]}. Empty means
        discover GPUs with NVML; if NVML is unavailable too, only CPU kernels are offered.""",
    )
    gpu_inventory_source = Enum(
        list(INVENTORY_SOURCES),
        default_value="auto",
        config=True,
        help="""Where the GPU inventory comes from. "declared": ElasticKernels.gpu_inventory;
        "nvml": the GPUs of this machine; "kubernetes": the cluster's nodes (nvidia.com/gpu with the
        GPU feature discovery labels, HAMi, MIG resources), kept current by a node watch: nodes that
        join add GPUs, nodes that are cordoned or go NotReady take no new slices (their kernels
        keep theirs), nodes that leave take theirs away, and kernels whose slice was on them are
        reported. "auto": declared if gpu_inventory is set, else nvml.""",
    )
    checkpoint_root = Unicode(
        config=True,
        help="""Directory that holds kernel checkpoints, one subdirectory per owner and kernel. With
        checkpoint_store "s3", only the kernels' local scratch copies (the bucket holds the
        checkpoints): it need not be shared.""",
    )
    checkpoint_store_class = Type(
        default_value=CheckpointStore,
        klass=CheckpointStore,
        config=True,
        help="""The file-system store's class (checkpoint_store "filesystem"): a subclass of
        kernelmgr.checkpoint_store.CheckpointStore, e.g. one that models a shared file system's
        view (the tests' lagging view).""",
    )
    checkpoint_encryption_key_files = List(
        Unicode(),
        default_value=[],
        config=True,
        help="""checkpoint_store "filesystem": master key files (32 bytes, or 64 hex digits; a mounted
        Secret, or locally a file outside checkpoint_root). Non-empty encrypts new checkpoints at
        rest (AES-256-CTR) with a key per owner, wrapped by the first master key and kept in
        checkpoint_root/.owner-keys. Rotation: `jupyter elastic rotate-keys` re-wraps every owner's
        key under a new master key (no checkpoint is rewritten), or put the new key first and keep
        the old ones after it (each owner's key is re-wrapped on its next use).""",
    )
    checkpoint_store = Enum(
        ["filesystem", "s3"],
        default_value="filesystem",
        config=True,
        help="""Where checkpoints are kept. "filesystem": checkpoint_root (a local disk, or a
        ReadWriteMany claim shared with the kernel pods). "s3": an S3-compatible bucket
        (S3Checkpoints.*); kernels upload and download through presigned URLs and hold no credential.""",
    )
    allocation_strategy = Enum(
        list(STRATEGIES),
        default_value="binpack",
        config=True,
        help="""How slices are placed: binpack fills the fullest GPU that fits (keeps whole GPUs
        free for big sizes); spread uses the emptiest (less contention between kernels).""",
    )
    base_kernels = List(
        Unicode(),
        default_value=["python3"],
        config=True,
        help="Kernelspecs that get one GPU-size variant per profile in the launcher.",
    )
    local_mps = Bool(
        False,
        config=True,
        help="""Set CUDA MPS client limits (active thread percentage, pinned memory) for local
        kernels. Only enforced when an MPS control daemon serves the GPUs.""",
    )
    reap_interval = Float(
        5.0,
        config=True,
        help="""Seconds between checks that every kernel holding a GPU slice still has a process;
        a kernel that died gives its slice back at the next check (or at once when autorestart
        notices first).""",
    )

    checkpoint_secret_file = Unicode(
        "",
        config=True,
        help="""File holding the secret that checkpoint HMAC keys are derived from (one key per
        owner). Created (0600, in a 0700 folder) if missing. Default:
        <jupyter data dir>/elastic-secret/checkpoint-secret, readable by the server's account
        only. Never inside checkpoint_root (kernels write there; refused at start-up); a secret
        left at <checkpoint_root>/.secret by an older version is moved here at start-up, so
        existing checkpoints stay valid. On Kubernetes: a mounted Secret's file. Every server
        that reads the same checkpoints (e.g. after a move) needs the same secret.""",
    )
    checkpoint_timeout = Float(
        600.0,
        config=True,
        help="Seconds a kernel may take to write its checkpoint before hibernation gives up "
        "(the kernel then keeps running).",
    )
    resume_timeout = Float(
        120.0,
        config=True,
        help="Seconds a resumed kernel may take to start and answer, plus one second per 20 MiB of "
        "its checkpoint (a big state takes longer to read). Past it the resume fails, the process "
        "it started is stopped, and the kernel stays hibernated.",
    )
    max_slice_wait = Float(
        0.0,
        config=True,
        help="Seconds a resume waits in the queue for a free GPU slice before it fails, saying so "
        "(0: it waits until the user interrupts). Waiting kernels are served by their size's "
        "queue_priority, each user's first before anyone's second, then in arrival order.",
    )
    start_queue_wait = Float(
        0.0,
        config=True,
        help="Seconds a new kernel whose GPU size does not fit now waits in the queue for a slice "
        "(behind the resumes and starts already waiting) before its start fails with 409 saying so. "
        "0: such a start is refused at once, as a size that does not fit has always been.",
    )
    max_checkpoint_bytes = Union(
        [Integer(), Unicode()],
        default_value=None,
        allow_none=True,
        config=True,
        help="""Bytes of checkpoints each user may keep (their hibernated kernels' and the latest
        of their running ones'), as a number or a size such as "20Gi"; None: no limit. A hibernation
        that would go over it is refused before anything is written, and the notebook is told what
        holds the space. A shared gateway sets it per user and group in ElasticQuota.""",
    )
    checkpoint_reserve = Float(
        0.05,
        config=True,
        help="""Share of the checkpoint volume (file system stores) kept free for the kernels whose
        checkpoints it already holds: a kernel hibernating for the first time may not take the
        volume's last bytes, so one user's large checkpoint cannot make another's next one fail.
        0: nothing kept back.""",
    )
    scale_up_wait = Float(
        0.0,
        config=True,
        help="Seconds a kernel pod whose GPU size fits on no node now may stay Pending, so that a "
        "cluster autoscaler sees it and adds a node (a node's boot; its image pull counts in "
        "ElasticKubernetesProvisioner.launch_timeout, the restore in resume_timeout). Such a start or "
        "resume skips the slice queue: kube-scheduler places the pod and the server books the GPU "
        "where it landed. Past it the pod is deleted and the start (503) or resume fails, saying so. "
        'Needs gpu_inventory_source "kubernetes". 0: off (such kernels wait in the queue).',
    )
    start_timeout = Float(
        120.0,
        config=True,
        help="Seconds a new local kernel may take to launch and answer its first kernel_info request. "
        "Past it the kernel is stopped, its slice released, and the start answers 504 with the "
        "kernel's last stderr lines.",
    )
    hibernate_on_shutdown = Bool(
        None,
        allow_none=True,
        config=True,
        help="""What a stopping server does with its running elastic kernels. Unset: per mode, true
        for local kernels (they are processes of this server), false with kernel pods (a pod
        outlives the gateway: an upgrade, drain or restart leaves it running and the next gateway
        adopts it, unpicklable state included). true: hibernate the idle ones (checkpoint, release
        the slice); a kernel running a cell is left running: it checkpoints itself once the cell
        ends (a kernel pod is adopted by the next server). false: a local kernel is shut down, a
        kernel pod is left running for the next server to adopt.""",
    )

    live_config_file = Unicode(
        "",
        config=True,
        help="""A JSON file of the settings that may change while the server runs (CullPolicy,
        ElasticQuota), read at start over the rest of the configuration and re-read every
        live_config_interval seconds: a change is applied without a restart (an invalid one is
        logged and refused). The chart mounts it from a ConfigMap of its own. Empty: none.""",
    )
    live_config_interval = Float(
        10.0,
        config=True,
        help="Seconds between checks of live_config_file for a change.",
    )

    nvml_class = Type(
        default_value=PynvmlNvml,
        klass=object,
        config=True,
        help="""Where NVML is reached (device discovery, per-process GPU activity). The default uses
        pynvml; kernelmgr.activity.nvml_double.FileNvmlDouble is the documented TEST DOUBLE that reads
        scripted devices and activity from $ELASTIC_NVML_DOUBLE_FILE.""",
    )
    kernel_provisioner = Enum(
        list(PROVISIONERS),
        default_value=KernelMode.LOCAL.provisioner,
        config=True,
        help="""What runs a GPU-size kernel: elastic-local-provisioner (a local process, the
        one-machine default) or elastic-kubernetes-provisioner (a pod per kernel; configure it with
        c.ElasticKubernetesProvisioner.*, see the README's Kubernetes section).""",
    )
    background_checkpoint_interval = Float(
        None,
        allow_none=True,
        config=True,
        help="""Seconds between checkpoints of a running kernel that ran cells since its last one (idle
        kernels only; it keeps running), so a kernel whose pod is lost resumes from then. 0: never.
        Default: 600 with elastic-kubernetes-provisioner (a pod can vanish with its node), 0 with the
        local one (a local kernel checkpoints itself when the server dies).""",
    )
    gpu_sample_interval = Float(
        10.0,
        config=True,
        help="Seconds between GPU activity samples (one NVML query per device per sample).",
    )

    warm_pool = Dict(
        default_value={},
        config=True,
        help=(
            "Warm kernels, per base kernelspec: processes started ahead with modules imported and no "
            'GPU touched, taken by resumes (and new kernels with "starts": true). E.g. {"python3": '
            '{"size": 2, "preload": ["torch"], "memory_mib": 8192, "starts": false}}. Off when empty.'
        ),
    )

    def secret_file(self) -> str:
        """``checkpoint_secret_file`` as an absolute path, its default filled in."""
        if self.checkpoint_secret_file:
            return os.path.abspath(os.path.expanduser(self.checkpoint_secret_file))
        return os.path.join(jupyter_data_dir(), "elastic-secret", "checkpoint-secret")

    def checkpoint_directory(self) -> str:
        """``checkpoint_root`` as an absolute path (``~`` expanded)."""
        return os.path.abspath(os.path.expanduser(self.checkpoint_root))

    def _checkpoint_root_default(self) -> str:
        return os.path.join(jupyter_data_dir(), "elastic", "checkpoints")

    def build(self, nvml_factory: Callable[[], Nvml] | None = None) -> ElasticRuntime:
        """Validate the configuration and assemble the runtime; raises :class:`ConfigError`."""
        profiles = self.build_profiles()
        nvml: Nvml = nvml_factory() if nvml_factory is not None else cast(Nvml, self.nvml_class())
        source = self.gpu_inventory_source
        if source == "auto":
            source = "declared" if self.gpu_inventory else "nvml"
        if source == "declared":
            if not self.gpu_inventory:
                raise ConfigError(
                    'ElasticKernels.gpu_inventory_source is "declared" but ElasticKernels.gpu_inventory is '
                    'empty: declare the devices, or use "nvml" or "kubernetes"'
                )
            inventory = GpuInventory.declared(self.gpu_inventory)
        elif source == "nvml":
            inventory = discover_inventory(nvml)
        else:
            if self.gpu_inventory:
                raise ConfigError(
                    'ElasticKernels.gpu_inventory_source is "kubernetes" (devices come from the nodes) but '
                    "ElasticKernels.gpu_inventory declares devices too: remove one of the two"
                )
            # Empty until the node watch has listed the nodes; sizes are offered from the start.
            inventory = GpuInventory(
                [], source="kubernetes", note="the cluster's nodes have not been listed yet"
            )
        if self.gpu_sample_interval <= 0:
            raise ConfigError(
                f"ElasticKernels.gpu_sample_interval must be > 0 seconds, got {self.gpu_sample_interval}"
            )
        allocator = SliceAllocator(
            inventory,
            strategy=self.allocation_strategy,
            profile_resource=profile_resource if source == "kubernetes" else None,
        )
        for profile in profiles.values():
            if inventory.devices and not allocator.ever_fits(profile):
                self.log.warning(
                    "GPU size %r can never fit on the GPUs here (%s); kernels of that size will be refused",
                    profile.name,
                    ", ".join(f"{d.name} {d.memory_mib} MiB" for d in inventory),
                )
        if self.checkpoint_timeout <= 0:
            raise ConfigError(
                f"ElasticKernels.checkpoint_timeout must be > 0 seconds, got {self.checkpoint_timeout}"
            )
        if self.resume_timeout <= 0:
            raise ConfigError(f"ElasticKernels.resume_timeout must be > 0 seconds, got {self.resume_timeout}")
        if self.start_timeout <= 0:
            raise ConfigError(f"ElasticKernels.start_timeout must be > 0 seconds, got {self.start_timeout}")
        if self.start_queue_wait < 0:
            raise ConfigError(
                "ElasticKernels.start_queue_wait must be >= 0 seconds (0: no queue), "
                f"got {self.start_queue_wait}"
            )
        if self.max_slice_wait < 0:
            raise ConfigError(
                f"ElasticKernels.max_slice_wait must be >= 0 seconds (0: no limit), got {self.max_slice_wait}"
            )
        if not 0 <= self.checkpoint_reserve < 1:
            raise ConfigError(
                "ElasticKernels.checkpoint_reserve must be a share of the volume from 0 to below 1, "
                f"got {self.checkpoint_reserve}"
            )
        max_checkpoint_bytes = parse_bytes("ElasticKernels.max_checkpoint_bytes", self.max_checkpoint_bytes)
        if self.scale_up_wait < 0:
            raise ConfigError(
                f"ElasticKernels.scale_up_wait must be >= 0 seconds (0: off), got {self.scale_up_wait}"
            )
        if self.scale_up_wait and source != "kubernetes":
            raise ConfigError(
                'ElasticKernels.scale_up_wait needs ElasticKernels.gpu_inventory_source = "kubernetes" '
                "(the GPU of a pod the scheduler placed on a new node is booked from the nodes), "
                f'not "{source}"; set it, or scale_up_wait = 0'
            )
        if self.reap_interval <= 0:
            raise ConfigError(f"ElasticKernels.reap_interval must be > 0 seconds, got {self.reap_interval}")
        if not self.base_kernels:
            raise ConfigError(
                "ElasticKernels.base_kernels is empty: name at least one kernelspec, e.g. python3"
            )
        try:
            warm_pool = parse_warm_pool(self.warm_pool, list(self.base_kernels))
        except WarmPoolConfigError as exc:
            raise ConfigError(str(exc)) from None
        return ElasticRuntime(
            warm_pool=warm_pool,
            profiles=profiles,
            allocator=allocator,
            inventory_source=source,
            base_kernels=list(self.base_kernels),
            checkpoint_root=self.checkpoint_directory(),
            use_mps=self.local_mps,
            reap_interval=self.reap_interval,
            checkpoints=self._checkpoint_store(),
            checkpoint_timeout=self.checkpoint_timeout,
            resume_timeout=self.resume_timeout,
            start_timeout=self.start_timeout,
            max_slice_wait=self.max_slice_wait,
            start_queue_wait=self.start_queue_wait,
            scale_up_wait=self.scale_up_wait,
            max_checkpoint_bytes=max_checkpoint_bytes,
            checkpoint_reserve=self.checkpoint_reserve,
            hibernate_on_shutdown=self._hibernate_on_shutdown(),
            nvml=nvml,
            gpu_sample_interval=self.gpu_sample_interval,
            mode=KernelMode(self.kernel_provisioner),
            background_checkpoint_interval=self._background_checkpoint_interval(),
        )

    def build_profiles(self) -> dict[str, GpuProfile]:
        """``profiles``, validated (at start, and at each change of the live file)."""
        profiles = parse_profiles(self.profiles)
        for profile in profiles.values():
            validate_backend_options(profile)
        return profiles

    def _hibernate_on_shutdown(self) -> bool:
        """Unset: only local kernels are hibernated at a stop (a kernel pod is adopted instead)."""
        if self.hibernate_on_shutdown is None:
            return not KernelMode(self.kernel_provisioner).in_pods
        return bool(self.hibernate_on_shutdown)

    def _background_checkpoint_interval(self) -> float:
        interval = self.background_checkpoint_interval
        if interval is None:
            return 600.0 if KernelMode(self.kernel_provisioner).in_pods else 0.0
        if interval < 0:
            raise ConfigError(
                f"ElasticKernels.background_checkpoint_interval must be >= 0 seconds (0: off), got {interval}"
            )
        return float(interval)

    def _checkpoint_store(self) -> CheckpointStore:
        root = self.checkpoint_directory()
        secret_file = self.secret_file()
        real_root, real_secret = os.path.realpath(root), os.path.realpath(secret_file)
        if os.path.commonpath([real_root, real_secret]) == real_root:
            raise ConfigError(
                f"ElasticKernels.checkpoint_secret_file {secret_file!r} is inside "
                f"ElasticKernels.checkpoint_root {root!r}, where kernels write: put it in a folder "
                "only the server's account can read (or leave it unset for the default)"
            )
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"ElasticKernels.checkpoint_root {root!r} is not usable ({exc.strerror or exc}); "
                "point it at a writable directory"
            ) from None
        old_secret = os.path.join(root, ".secret")
        try:
            migrate_secret(old_secret, secret_file)
            secret = load_or_create_secret(secret_file)
        except OSError as exc:
            raise ConfigError(
                f"ElasticKernels.checkpoint_secret_file {secret_file!r} is not usable "
                f"({exc.strerror or exc}): point it at a file in a folder the server can write, "
                "or at an existing secret"
            ) from None
        if not self.checkpoint_secret_file and KernelMode(self.kernel_provisioner).in_pods:
            self.log.warning(
                "the checkpoint secret is %s, in this server's own filesystem (a pod's is lost with it, "
                "and its checkpoints with it): set ElasticKernels.checkpoint_secret_file to a mounted "
                "Secret's file",
                secret_file,
            )
        if os.path.lexists(old_secret):
            self._retire_old_secret(old_secret, secret_file, secret)
        if self.checkpoint_store == "s3":
            if self.checkpoint_encryption_key_files:
                raise ConfigError(
                    "ElasticKernels.checkpoint_encryption_key_files is for the file-system store; "
                    'with checkpoint_store "s3" set S3Checkpoints.encryption_key_files instead'
                )
            return S3Checkpoints(parent=self).build(root, secret)
        if self.checkpoint_encryption_key_files:
            masters = read_master_keys(
                self.checkpoint_encryption_key_files, "ElasticKernels.checkpoint_encryption_key_files", root
            )
            return cast(CheckpointStore, self.checkpoint_store_class(root, secret, master_keys=masters))
        return cast(CheckpointStore, self.checkpoint_store_class(root, secret))

    def _retire_old_secret(self, old_secret: str, secret_file: str, secret: bytes) -> None:
        """An older version's ``<checkpoint_root>/.secret`` beside the configured secret file.

        The same bytes: the old copy (on the volume kernels write to) is deleted. Other bytes: the
        checkpoints written before would no longer verify (their kernels would resume empty), so
        the server refuses to start and says how to carry the old secret over.
        """
        try:
            with open(old_secret, "rb") as old:
                same = hmac.compare_digest(old.read(4096), secret)
        except OSError as exc:
            raise ConfigError(
                f"cannot read the old checkpoint secret {old_secret!r} ({exc.strerror or exc})"
            ) from None
        if same:
            os.unlink(old_secret)
            self.log.warning("deleted %s: the same secret is now %s", old_secret, secret_file)
            return
        raise ConfigError(
            f"{old_secret} (the checkpoint secret of an older version, on the checkpoint volume) differs "
            f"from ElasticKernels.checkpoint_secret_file {secret_file}: checkpoints written before verify "
            f"only with the old one. Put its bytes in {secret_file} (on Kubernetes: kubectl create secret "
            "generic <name> --from-file=secret=<its copy> and set the chart's "
            f"checkpointSecret.existingSecret), or delete {old_secret} to give those checkpoints up"
        )


def read_master_keys(paths: list[str], setting: str, data_root: str | None = None) -> list[bytes]:
    """The master keys in ``paths`` (the first is current); :class:`ConfigError` naming ``setting``
    when one is missing or malformed, when ``cryptography`` is not installed, or when one lies in
    ``data_root`` (the volume kernels write to: a master key there protects nothing)."""
    from kernelmgr.objectstore.envelope import read_master_key

    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{setting} needs the 'cryptography' package: pip install 'jupyter-elastic-kernels[objectstore]'"
        ) from None
    masters = []
    for path in paths:
        if data_root is not None:
            real_root = os.path.realpath(data_root)
            if os.path.commonpath([real_root, os.path.realpath(path)]) == real_root:
                raise ConfigError(
                    f"{setting}: {path!r} is inside ElasticKernels.checkpoint_root {data_root!r}, where "
                    "kernels write: keep the master key off the data volume (a mounted Secret)"
                )
        try:
            masters.append(read_master_key(path))
        except FileNotFoundError:
            raise ConfigError(
                f"{setting}: the master key {path!r} does not exist (mount its Secret, or create it: "
                "head -c 32 /dev/urandom > FILE)"
            ) from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{setting}: {exc}") from None
    return masters


class S3Checkpoints(LoggingConfigurable):
    """The bucket checkpoints go to with ``ElasticKernels.checkpoint_store = "s3"``.

    The server's credential comes from its environment (on Kubernetes, a Secret mapped into it);
    kernels never see it: they get presigned URLs for their own checkpoint's objects only.
    """

    endpoint = Unicode(
        "",
        config=True,
        help="""The S3 endpoint URL, e.g. https://s3.us-east-1.amazonaws.com,
        https://storage.googleapis.com, or an in-cluster http://minio:9000. Requests are path-style
        (endpoint/bucket/key). Kernels must reach it too (they upload and download directly).""",
    )
    bucket = Unicode("", config=True, help="The bucket (it must exist unless create_bucket).")
    region = Unicode("us-east-1", config=True, help="The region requests are signed for.")
    prefix = Unicode("", config=True, help="A key prefix for every checkpoint object (to share a bucket).")
    access_key_id_env = Unicode(
        "AWS_ACCESS_KEY_ID",
        config=True,
        help="The environment variable that holds the access key id (never the key in config).",
    )
    secret_access_key_env = Unicode(
        "AWS_SECRET_ACCESS_KEY",
        config=True,
        help="The environment variable that holds the secret access key.",
    )
    presign_seconds = Integer(
        900,
        config=True,
        help="""How long a presigned URL handed to a kernel stays valid (seconds, 60..604800). It must
        cover a checkpoint's upload and a resume's download.""",
    )
    part_size_mib = Integer(
        32, config=True, help="Multipart upload part size (MiB, at least 5: S3's minimum part)."
    )
    create_bucket = Bool(False, config=True, help="Create the bucket at start-up if it is missing.")
    encryption_key_files = List(
        Unicode(),
        default_value=[],
        config=True,
        help="""Master key files (32 bytes, or 64 hex digits; a mounted Secret, never in the bucket):
        non-empty encrypts new checkpoints at rest with a key per owner wrapped by the first one.
        Rotation: put a new key first and keep the older ones after it until every owner's key was
        re-wrapped (each is, on its next use).""",
    )

    def build(self, root: str, secret: bytes) -> CheckpointStore:
        """The object store, checked: every problem is a :class:`ConfigError` naming the setting."""
        from kernelmgr.objectstore.client import Bucket, ObjectStoreError
        from kernelmgr.objectstore.sigv4 import Credentials
        from kernelmgr.objectstore.store import ObjectCheckpointStore

        if not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"S3Checkpoints.endpoint {self.endpoint!r} must be an http:// or https:// URL "
                '(ElasticKernels.checkpoint_store is "s3")'
            )
        if not self.bucket:
            raise ConfigError('S3Checkpoints.bucket is empty (ElasticKernels.checkpoint_store is "s3")')
        access, secret_key = (
            os.environ.get(self.access_key_id_env, ""),
            os.environ.get(self.secret_access_key_env, ""),
        )
        if not access or not secret_key:
            raise ConfigError(
                f"the object store's credential is not in the environment: set {self.access_key_id_env} "
                f"and {self.secret_access_key_env} (S3Checkpoints.access_key_id_env / secret_access_key_env)"
            )
        if not 60 <= self.presign_seconds <= 604800:
            raise ConfigError(
                f"S3Checkpoints.presign_seconds must be between 60 and 604800, got {self.presign_seconds}"
            )
        if self.part_size_mib < 5:
            raise ConfigError(f"S3Checkpoints.part_size_mib must be at least 5, got {self.part_size_mib}")
        bucket = Bucket(self.endpoint, self.bucket, Credentials(access, secret_key, self.region))
        envelope = None
        if self.encryption_key_files:
            from kernelmgr.objectstore.envelope import OwnerKeys

            masters = read_master_keys(self.encryption_key_files, "S3Checkpoints.encryption_key_files")
            envelope = OwnerKeys(bucket, self.prefix.strip("/"), masters)
        try:
            if self.create_bucket:
                bucket.create()
            bucket.request("GET", query={"list-type": "2", "max-keys": "1"})  # reachable, ours
        except (OSError, ObjectStoreError) as exc:
            raise ConfigError(
                f"the object store at {self.endpoint} (bucket {self.bucket!r}) is not usable: {exc}"
            ) from None
        return ObjectCheckpointStore(
            root,
            secret,
            bucket,
            prefix=self.prefix,
            presign_seconds=self.presign_seconds,
            part_size=self.part_size_mib * 1024 * 1024,
            envelope=envelope,
        )


class CullPolicy(LoggingConfigurable):
    """When idle elastic kernels are warned, hibernated and finally removed.

    A kernel is idle when it has not executed for ``idle_timeout`` seconds *and* its GPU
    utilisation stayed under ``gpu_idle_threshold`` percent for that long (GPU activity is
    used where NVML can measure it). Busy kernels are never hibernated. Elastic kernels follow
    this policy only; jupyter_server's ``MappingKernelManager.cull_*`` settings still apply to
    non-elastic (CPU) kernels, which they would shut down.
    """

    idle_timeout = Float(
        0.0,
        config=True,
        help="Seconds without execution and without GPU activity before hibernation (0 = off).",
    )
    interval = Float(60.0, config=True, help="Seconds between policy checks.")
    gpu_idle_threshold = Float(
        5.0, config=True, help="GPU utilisation (percent) at or under which a kernel's GPU counts as idle."
    )
    warn_before = Float(
        60.0,
        config=True,
        help="Seconds before hibernation that connected notebooks are warned (0 = no warning).",
    )
    hibernated_ttl = Float(
        0.0,
        config=True,
        help="Seconds a kernel may stay hibernated before it and its checkpoint are removed (0 = never).",
    )
    busy_gpu_idle_warning = Float(
        0.0,
        config=True,
        help="Warn (never hibernate) when a cell has been running but the GPU idle this many seconds "
        "(0 = off).",
    )
    max_concurrent_hibernations = Integer(
        4,
        config=True,
        help="""Hibernations (checkpoints) that may run at the same time, by the policy and when the
        server stops; the others wait their turn. A slow checkpoint then holds up no other kernel's
        warning or hibernation, and many idle kernels do not all write checkpoints at once.""",
    )
    start_grace = Float(
        300.0,
        config=True,
        help="""Seconds after its start that a kernel which never became idle (started by REST and never
        connected to, so it stays "starting") counts as busy; after that the policy counts it idle
        from its start, and warns and hibernates it like any idle kernel.""",
    )
    pressure_idle_minimum = Float(
        0.0,
        config=True,
        help="""Seconds of idleness after which a kernel may be hibernated early, before idle_timeout,
        because another kernel waits in the queue for a GPU slice (0: never). The longest-idle
        kernels go first, one per waiting kernel, warned warn_before seconds ahead as usual; a busy
        kernel never. Must be longer than warn_before.""",
    )
    rules = List(
        Dict(),
        default_value=[],
        config=True,
        help="""Per-size overrides, first match wins: [{"profiles": ["whole"], "idle_timeout": 600}].
        Keys: profiles (sizes, or "*") and any of idle_timeout, warn_before, hibernated_ttl,
        busy_gpu_idle_warning (gpu_idle_threshold is global).""",
    )

    def build(self, known_profiles: list[str]) -> Policy:
        return build_policy(
            idle_timeout=self.idle_timeout,
            interval=self.interval,
            gpu_idle_threshold=self.gpu_idle_threshold,
            warn_before=self.warn_before,
            hibernated_ttl=self.hibernated_ttl,
            busy_gpu_idle_warning=self.busy_gpu_idle_warning,
            rules=self.rules,
            known_profiles=known_profiles,
            max_concurrent_hibernations=self.max_concurrent_hibernations,
            start_grace=self.start_grace,
            pressure_idle_minimum=self.pressure_idle_minimum,
        )
