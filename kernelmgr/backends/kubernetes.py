"""Dispatch from a GPU size to the Kubernetes mechanism that provides it.

Each mechanism lives in its own module (``whole``, ``mig``, ``shared``, ``hami``, ``volcano``,
``dra``, ``gpushare``, ``vcuda``) with the same three members: ``OPTION_KEYS``, ``parse_options``
(checks the size's ``options`` and raises ``ConfigError`` naming the bad key) and ``render``
(size → ``PodFragment``).
This module only maps the profile's ``backend`` name to that module, so the provisioner and the
configuration loader never branch on vendor names themselves.

``validate_backend_options`` is meant to run when configuration is loaded, so a bad option
fails the server start; ``render_pod_fragment`` checks again, so it is safe to call on a
profile that was built some other way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kernelmgr.backends import dra, gpushare, hami, mig, shared, vcuda, volcano, whole
from kernelmgr.backends.common import profile_error
from kernelmgr.backends.fragment import PodFragment
from kernelmgr.core.profiles import GpuProfile


@dataclass(frozen=True)
class SliceBackend:
    """One Kubernetes mechanism: its option keys, validator and renderer."""

    name: str
    option_keys: frozenset[str]
    validate: Callable[[GpuProfile], object]
    render: Callable[[GpuProfile, str], PodFragment]


REGISTRY: Mapping[str, SliceBackend] = MappingProxyType(
    {
        "whole": SliceBackend("whole", whole.OPTION_KEYS, whole.parse_options, whole.render),
        "mig": SliceBackend("mig", mig.OPTION_KEYS, mig.parse_options, mig.render),
        "shared": SliceBackend("shared", shared.OPTION_KEYS, shared.parse_options, shared.render),
        "hami": SliceBackend("hami", hami.OPTION_KEYS, hami.parse_options, hami.render),
        "volcano": SliceBackend("volcano", volcano.OPTION_KEYS, volcano.parse_options, volcano.render),
        "dra": SliceBackend("dra", dra.OPTION_KEYS, dra.parse_options, dra.render),
        "gpushare": SliceBackend("gpushare", gpushare.OPTION_KEYS, gpushare.parse_options, gpushare.render),
        "vcuda": SliceBackend("vcuda", vcuda.OPTION_KEYS, vcuda.parse_options, vcuda.render),
    }
)


def backend_for(profile: GpuProfile) -> SliceBackend:
    """The mechanism named by ``profile.backend``."""
    backend = REGISTRY.get(profile.backend)
    if backend is None:
        raise profile_error(
            profile, "backend", f"must be one of {', '.join(REGISTRY)} on Kubernetes, got {profile.backend!r}"
        )
    return backend


def validate_backend_options(profile: GpuProfile) -> None:
    """Raise ``ConfigError`` if the size's ``options`` do not suit its backend."""
    backend_for(profile).validate(profile)


def render_pod_fragment(profile: GpuProfile, kernel_id: str) -> PodFragment:
    """The pod-spec fragment that requests ``profile`` for the kernel ``kernel_id``.

    Today every backend renders the same fragment for every kernel of a size (the kernel id
    is accepted so that per-kernel objects can be added without changing callers).
    """
    return backend_for(profile).render(profile, kernel_id)


def profile_resource(profile: GpuProfile) -> str | None:
    """The node resource whose devices a size is placed on, for the allocator's bookkeeping.

    It matches :attr:`GpuDevice.resource <kernelmgr.core.inventory.GpuDevice.resource>` of the
    devices :mod:`kernelmgr.kube.nodes` reads from the cluster's nodes: ``nvidia.com/gpu`` for
    whole GPUs, HAMi and single-strategy MIG (HAMi nodes advertise ``nvidia.com/gpu`` too, and a
    whole size there gets a whole card), the size's own ``nvidia.com/mig-<profile>`` for mixed
    MIG, the configured resource name for time-slicing/MPS replicas, ``aliyun.com/gpu-mem`` for
    gpushare and ``tencent.com/vcuda-core`` for vCUDA (their nodes' GPUs). ``None`` (any device) for the
    backends whose capacity is not read from nodes (Volcano vGPU, DRA) and for local sizes.
    """
    backend = REGISTRY.get(profile.backend)
    if backend is None:
        return None
    if backend.name == "whole":
        return whole.parse_options(profile).resource_name
    if backend.name == "shared":
        return shared.parse_options(profile).resource_name
    if backend.name == "hami":
        return "nvidia.com/gpu"
    if backend.name == "gpushare":
        return gpushare.GPU_MEM
    if backend.name == "vcuda":
        return vcuda.VCUDA_CORE
    if backend.name == "mig":
        settings = mig.parse_options(profile)
        if settings.strategy == "mixed" and settings.mig_profile is not None:
            return mig.mig_resource_name(settings.mig_profile)
        return "nvidia.com/gpu"
    return None
