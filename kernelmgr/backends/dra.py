"""GPU sizes as Dynamic Resource Allocation claims (``resource.k8s.io/v1``).

DRA is the standard successor of device plugins (stable in Kubernetes 1.35): a pod names
*claims*, and a claim describes the device it needs by device class and CEL selectors over
attributes the driver publishes (product, MIG profile, memory, ...). Modelling sizes as
claims now lets whole and MIG sizes move from device-plugin names to DRA without changing
what users pick.

The fragment carries the claim's description as a side object and references it from the
pod (``spec.resourceClaims`` entry ``gpu``, ``resources.claims`` of the kernel container).
Side objects are named ``elastic-gpu-<size>-<hash of their spec>``: one object per size that
every kernel of the size reuses, and a *new* name when the admin changes the size, because a
template's spec is immutable once created and a stale one would silently keep handing out
the old device. The provisioner creates them if absent; an "already exists" is success.

What a claim can express depends on the size:

* whole sizes: a ``ResourceClaimTemplate`` for ``count`` = N devices of class
  ``gpu.nvidia.com``; every kernel gets its own claim and its own GPUs;
* MIG sizes (option ``mig_profile``): a template for one device of class ``mig.nvidia.com``
  whose ``profile`` attribute is the profile — hardware-isolated, as with the device plugin;
* other fractional sizes need option ``sharing``, because a template gives every pod its
  own claim and therefore a *whole* device, whatever the size says:

  - ``"MPS"``: one shared ``ResourceClaim`` per size that every kernel of the size joins (the
    only way several pods share one device under DRA), configured with the NVIDIA driver's
    ``GpuConfig`` MPS sharing so that each client gets ``compute_percent`` % of the SMs and
    ``memory_mib`` of pinned memory. All kernels of the size then share *one* GPU per
    namespace; the allocator must admit at most ``1 / gpu_fraction`` of them. Needs the
    driver's ``MPSSupport`` feature gate (alpha).
  - ``"consumable"``: a template requesting ``capacity.requests.memory`` on devices that
    allow multiple allocations (Kubernetes ``DRAConsumableCapacity``, the NVIDIA driver's
    consumable shares). The scheduler packs kernels by memory, but nothing caps a kernel's
    usage at run time: the same "best effort" as time-slicing.

Options: ``device_class`` (default ``gpu.nvidia.com``, or ``mig.nvidia.com`` with
``mig_profile``), ``selectors`` (extra CEL expressions, e.g.
``"device.attributes['gpu.nvidia.com'].productName.matches('H100')"``), ``mig_profile``,
``sharing``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kernelmgr.backends.common import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    check_dns_subdomain,
    get_choice,
    get_str,
    get_str_list,
    option_error,
    profile_error,
    reject_unknown_options,
    size_annotations,
    size_labels,
)
from kernelmgr.backends.fragment import PodFragment
from kernelmgr.backends.mig import check_mig_profile
from kernelmgr.core.profiles import GpuProfile

OPTION_KEYS = frozenset({"device_class", "selectors", "mig_profile", "sharing"})
SHARING_MODES = ("MPS", "consumable")
API_VERSION = "resource.k8s.io/v1"
GPU_CLASS = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
NVIDIA_DRIVER = "gpu.nvidia.com"
#: Name of the claim inside the pod and of the device request inside the claim.
CLAIM_NAME = "gpu"


@dataclass(frozen=True)
class DraSettings:
    device_class: str
    selectors: tuple[str, ...]
    mig_profile: str | None
    sharing: str | None
    count: int


def parse_options(profile: GpuProfile) -> DraSettings:
    reject_unknown_options(profile, OPTION_KEYS)
    raw_mig = profile.options.get("mig_profile")
    mig_profile = None if raw_mig is None else check_mig_profile(profile, "mig_profile", raw_mig)
    device_class = get_str(
        profile, "device_class", MIG_CLASS if mig_profile else GPU_CLASS, example=GPU_CLASS
    )
    assert device_class is not None
    check_dns_subdomain(profile, "device_class", device_class, example=GPU_CLASS)
    selectors = get_str_list(
        profile, "selectors", example="device.attributes['gpu.nvidia.com'].productName == 'H100'"
    )
    sharing = get_choice(profile, "sharing", SHARING_MODES, None)

    if mig_profile is not None:
        if profile.gpu_fraction > 1:
            raise profile_error(
                profile,
                "gpu_fraction",
                "a MIG size is one MIG device; use gpu_fraction <= 1 with mig_profile",
            )
        if sharing is not None:
            raise option_error(
                profile, "sharing", "is not supported together with mig_profile; remove one of them"
            )
        return DraSettings(device_class, selectors, mig_profile, None, 1)

    if not profile.is_fractional:
        if sharing is not None:
            raise option_error(
                profile,
                "sharing",
                "only applies to fractional sizes (gpu_fraction < 1); remove it for whole GPUs",
            )
        return DraSettings(device_class, selectors, None, None, profile.whole_gpus)

    if sharing is None:
        raise option_error(
            profile,
            "sharing",
            "is required for a fractional DRA size without mig_profile: a claim template gives every kernel "
            "a whole device; write 'MPS' (kernels of this size share one GPU, limits enforced by MPS) or "
            "'consumable' (scheduler packs by memory, no runtime limit), or set mig_profile",
        )
    if profile.memory_mib is None:
        raise profile_error(profile, "memory_mib", "is required for a fractional DRA size")
    if sharing == "MPS" and device_class != GPU_CLASS:
        raise option_error(
            profile,
            "sharing",
            f"'MPS' uses the NVIDIA DRA driver's GpuConfig and needs device_class {GPU_CLASS!r}, "
            f"not {device_class!r}",
        )
    return DraSettings(device_class, selectors, None, sharing, 1)


def _device_claim(profile: GpuProfile, settings: DraSettings) -> dict[str, Any]:
    """The ``DeviceClaim`` (``spec.devices``) of the claim or template."""
    expressions = list(settings.selectors)
    if settings.mig_profile is not None:
        expressions.insert(0, f"device.attributes['{NVIDIA_DRIVER}'].profile == '{settings.mig_profile}'")
    exactly: dict[str, Any] = {
        "deviceClassName": settings.device_class,
        "allocationMode": "ExactCount",
        "count": settings.count,
    }
    if expressions:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in expressions]
    if settings.sharing == "consumable":
        exactly["capacity"] = {"requests": {"memory": f"{profile.memory_mib}Mi"}}
    devices: dict[str, Any] = {"requests": [{"name": CLAIM_NAME, "exactly": exactly}]}
    if settings.sharing == "MPS":
        devices["config"] = [
            {
                "requests": [CLAIM_NAME],
                "opaque": {
                    "driver": NVIDIA_DRIVER,
                    "parameters": {
                        "apiVersion": "resource.nvidia.com/v1beta1",
                        "kind": "GpuConfig",
                        "sharing": {
                            "strategy": "MPS",
                            "mpsConfig": {
                                "defaultActiveThreadPercentage": profile.compute_percent,
                                "defaultPinnedDeviceMemoryLimit": f"{profile.memory_mib}Mi",
                            },
                        },
                    },
                },
            }
        ]
    return devices


def _object_name(profile: GpuProfile, spec: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]
    return f"elastic-gpu-{profile.name}-{digest}"


def claim_object(profile: GpuProfile) -> dict[str, Any]:
    """The side object for ``profile``: a ``ResourceClaimTemplate``, or for MPS a shared ``ResourceClaim``."""
    settings = parse_options(profile)
    claim_spec = {"devices": _device_claim(profile, settings)}
    labels = {**size_labels(profile), MANAGED_BY_LABEL: MANAGED_BY}
    if settings.sharing == "MPS":
        return {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": _object_name(profile, claim_spec), "labels": labels},
            "spec": claim_spec,
        }
    template_spec = {"metadata": {"labels": labels}, "spec": claim_spec}
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": _object_name(profile, template_spec), "labels": labels},
        "spec": template_spec,
    }


def render(profile: GpuProfile, kernel_id: str) -> PodFragment:
    side = claim_object(profile)
    name = side["metadata"]["name"]
    if side["kind"] == "ResourceClaim":
        pod_claim = {"name": CLAIM_NAME, "resourceClaimName": name}
    else:
        pod_claim = {"name": CLAIM_NAME, "resourceClaimTemplateName": name}
    return PodFragment(
        labels=size_labels(profile),
        annotations=size_annotations(profile),
        pod_resource_claims=(pod_claim,),
        container_claims=({"name": CLAIM_NAME},),
        side_objects=(side,),
    )
