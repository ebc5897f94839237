"""Shared GPUs through the NVIDIA device plugin's time-slicing or MPS replicas.

The device plugin can advertise each GPU as several replicas; a pod that gets one replica
gets the *whole* physical device. With time-slicing nothing isolates the sharers: every
kernel sees all the GPU's memory, CUDA interleaves their work, and one kernel that allocates
everything makes the others fail with out-of-memory. (With the plugin's MPS mode the MPS
daemon does cap each client at total/replicas memory and 100/replicas % of the SMs, but that
split is fixed per node, not per size.) Sizes on this backend are therefore "best effort",
and the allocator must keep the number of kernels per GPU at or below the replica count.

Because nothing enforces the share, the fragment tells the kernel what its share is, in the
variables the common frameworks honour without code changes:

* ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (and no preallocation): JAX otherwise grabs 75 % of the
  device at first use, which alone would starve the other sharers;
* ``TF_FORCE_GPU_ALLOW_GROWTH=true``: TensorFlow otherwise maps nearly all memory up front;
* ``ELASTIC_GPU_MEMORY_MIB`` / ``ELASTIC_GPU_FRACTION`` / ``ELASTIC_GPU_PROFILE``: for the
  in-kernel agent (which can call ``torch.cuda.set_per_process_memory_fraction``) and user code.

With ``mps: true`` it also sets the MPS client limits ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``; a client can only tighten the daemon's limits this
way, which is what a size smaller than the node's replica share wants.

Options: ``resource_name`` (default ``nvidia.com/gpu.shared``, the plugin's name with
``renameByDefault: true``; use ``nvidia.com/gpu`` when it is false), ``mps`` (bool),
``device_memory_mib`` (the GPU's total memory, to turn ``memory_mib`` into an exact JAX
fraction; without it the size's ``gpu_fraction`` is used).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelmgr.backends.common import (
    check_resource_name,
    framework_share_env,
    get_bool,
    get_positive_int,
    get_str,
    option_error,
    profile_error,
    reject_unknown_options,
    size_annotations,
    size_labels,
)
from kernelmgr.backends.fragment import PodFragment
from kernelmgr.core.profiles import GpuProfile

OPTION_KEYS = frozenset({"resource_name", "mps", "device_memory_mib"})
DEFAULT_RESOURCE = "nvidia.com/gpu.shared"


@dataclass(frozen=True)
class SharedSettings:
    resource_name: str
    mps: bool
    device_memory_mib: int | None


def parse_options(profile: GpuProfile) -> SharedSettings:
    reject_unknown_options(profile, OPTION_KEYS)
    if profile.gpu_fraction > 1:
        raise profile_error(
            profile,
            "gpu_fraction",
            "a shared replica is a share of one GPU (and the device plugin rejects requests for more "
            "than one with failRequestsGreaterThanOne); use gpu_fraction <= 1 or backend 'whole'",
        )
    name = get_str(profile, "resource_name", DEFAULT_RESOURCE, example=DEFAULT_RESOURCE)
    assert name is not None
    check_resource_name(profile, "resource_name", name, example=DEFAULT_RESOURCE)
    device_memory = get_positive_int(profile, "device_memory_mib", example=81920)
    if device_memory is not None and profile.memory_mib is not None and profile.memory_mib > device_memory:
        raise option_error(
            profile,
            "device_memory_mib",
            f"is smaller than the size's memory_mib ({profile.memory_mib}); give the GPU's total memory",
        )
    return SharedSettings(
        resource_name=name, mps=get_bool(profile, "mps", False), device_memory_mib=device_memory
    )


def render(profile: GpuProfile, kernel_id: str) -> PodFragment:
    settings = parse_options(profile)
    if profile.memory_mib is not None and settings.device_memory_mib is not None:
        share = profile.memory_mib / settings.device_memory_mib
    else:
        share = profile.gpu_fraction
    env = framework_share_env(profile, share)
    if settings.mps:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(profile.compute_percent)
        if profile.memory_mib is not None:
            # Ordinals are as the container sees its devices: it gets exactly one, device 0.
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={profile.memory_mib}M"
    return PodFragment(
        limits={settings.resource_name: "1"},
        env=env,
        labels=size_labels(profile),
        annotations=size_annotations(profile),
    )
