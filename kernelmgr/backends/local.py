"""Local slice backend: the environment a local kernel process gets for its slice.

On one machine there is no scheduler or device plugin, so the slice is handed to the kernel
as environment variables that CUDA and the common frameworks read at start-up:

* ``CUDA_VISIBLE_DEVICES`` by UUID (stable across reboots and unaffected by index
  reordering), with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so indices inside the kernel match
  ``nvidia-smi``;
* the memory cap, as ``ELASTIC_GPU_MEMORY_MIB`` (for the in-kernel agent and user code) and
  in the framework knobs that honour a cap without code changes: JAX's
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` and no preallocation, TensorFlow's allow-growth;
* with MPS configured, the client-side limits ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, which an MPS server enforces.

Without MPS these are soft limits: the kernel is told its share, nothing stops it taking
more. The README says so.
"""

from __future__ import annotations

from kernelmgr.backends.common import framework_share_env
from kernelmgr.core.allocator import Slice
from kernelmgr.core.inventory import GpuInventory
from kernelmgr.core.profiles import GpuProfile

#: Variables this backend owns; a kernel never inherits stale values of these from the server.
MANAGED_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "ELASTIC_GPU_PROFILE",
    "ELASTIC_GPU_FRACTION",
    "ELASTIC_GPU_MEMORY_MIB",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "ELASTIC_GPU_MEMORY_FRACTION",
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)


def cpu_environment() -> dict[str, str]:
    """Environment for a kernel without a slice: no GPU is visible to it."""
    return {"CUDA_VISIBLE_DEVICES": ""}


def local_environment(
    profile: GpuProfile, granted: Slice, inventory: GpuInventory, use_mps: bool = False
) -> dict[str, str]:
    """The variables a local kernel needs to see exactly its slice."""
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(granted.device_uuids),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "ELASTIC_GPU_PROFILE": profile.name,
        "ELASTIC_GPU_FRACTION": f"{profile.gpu_fraction:g}",
        "ELASTIC_GPU_MEMORY_MIB": str(min(p.memory_mib for p in granted.placements)),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    if profile.is_fractional:
        placement = granted.placements[0]
        device = inventory.by_uuid(placement.device_uuid)
        # The same framework knobs as the Kubernetes backends that enforce no memory cap.
        env.update(framework_share_env(profile, placement.memory_mib / device.memory_mib))
        env["ELASTIC_GPU_MEMORY_MIB"] = str(placement.memory_mib)
        if use_mps:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(profile.compute_percent)
            # Device ordinals here are as the kernel sees them (its visible devices), so always 0.
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={placement.memory_mib}M"
    return env
