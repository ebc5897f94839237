"""Fractional GPUs through HAMi (hami-core mode).

HAMi lets a pod ask for part of a GPU by memory and compute: ``nvidia.com/gpu`` is the
number of physical GPUs, ``nvidia.com/gpumem`` the MiB it may use on each, and
``nvidia.com/gpucores`` the percentage of the SMs. The HAMi scheduler packs pods onto devices
by those numbers, and HAMi-core (``libvgpu.so``, loaded through ``/etc/ld.so.preload``) makes
them true inside the container: allocations past the limit fail with out-of-memory and
``nvidia-smi`` reports the limit as the device's total memory. It is the default backend for
fractional sizes because it is the only widely deployed mechanism that gives each kernel an
arbitrary memory cap of its own.

The enforcement is a user-space hook, so anything that skips the hook escapes the limits.
HAMi's device plugin skips mounting ``/etc/ld.so.preload`` when the container's environment
has ``CUDA_DISABLE_CONTROL=true`` (an escape hatch for debugging), which would let a notebook
user take the whole GPU by setting one variable in their kernelspec or pod template. The
fragment therefore lists it in ``forbidden_env``, and ``apply_to`` strips it. (It cannot see
values coming from ``envFrom``; admins must not put it in ConfigMaps mounted into kernels.)

``schedulerName`` is left alone by default: HAMi's mutating webhook sets it to its own
scheduler for every pod that requests HAMi resources, and a hard-coded name would break
installations that renamed the scheduler. Set option ``scheduler_name`` where the webhook is
disabled.

Whole sizes (``gpu_fraction`` N >= 1) ask for N GPUs with ``gpucores: 100``, which HAMi
treats as exclusive use, and a memory cap only if the size has one.

Options: ``scheduler_name``, ``gpu_type`` (string or list, e.g. ``"A100"`` →
annotation ``nvidia.com/use-gputype``), ``gpu_scheduler_policy`` (``binpack`` packs kernels
onto few GPUs, ``spread`` spreads them → annotation ``hami.io/gpu-scheduler-policy``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelmgr.backends.common import (
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
from kernelmgr.core.profiles import GpuProfile

OPTION_KEYS = frozenset({"scheduler_name", "gpu_type", "gpu_scheduler_policy"})
POLICIES = ("binpack", "spread")
GPU_TYPE_ANNOTATION = "nvidia.com/use-gputype"
POLICY_ANNOTATION = "hami.io/gpu-scheduler-policy"
#: Env that turns HAMi-core off in the container (see the module docstring).
FORBIDDEN_ENV = ("CUDA_DISABLE_CONTROL",)


@dataclass(frozen=True)
class HamiSettings:
    scheduler_name: str | None
    gpu_types: tuple[str, ...]
    policy: str | None


def parse_options(profile: GpuProfile) -> HamiSettings:
    reject_unknown_options(profile, OPTION_KEYS)
    if profile.is_fractional and profile.memory_mib is None:
        raise profile_error(profile, "memory_mib", "is required for a fractional HAMi size (its memory cap)")
    scheduler = get_str(profile, "scheduler_name", example="hami-scheduler")
    if scheduler is not None:
        check_dns_subdomain(profile, "scheduler_name", scheduler, example="hami-scheduler")
    gpu_types = get_str_list(profile, "gpu_type", example="A100")
    if any("," in t for t in gpu_types):
        raise option_error(profile, "gpu_type", "write several GPU types as a list, e.g. ['A100', 'H100']")
    policy = get_choice(profile, "gpu_scheduler_policy", POLICIES, None)
    return HamiSettings(scheduler_name=scheduler, gpu_types=gpu_types, policy=policy)


def render(profile: GpuProfile, kernel_id: str) -> PodFragment:
    settings = parse_options(profile)
    if profile.is_fractional:
        limits = {"nvidia.com/gpu": "1", "nvidia.com/gpucores": str(profile.compute_percent)}
    else:
        limits = {"nvidia.com/gpu": str(profile.whole_gpus), "nvidia.com/gpucores": "100"}
    if profile.memory_mib is not None:
        limits["nvidia.com/gpumem"] = str(profile.memory_mib)
    annotations = size_annotations(profile)
    if settings.gpu_types:
        annotations[GPU_TYPE_ANNOTATION] = ",".join(settings.gpu_types)
    if settings.policy is not None:
        annotations[POLICY_ANNOTATION] = settings.policy
    return PodFragment(
        limits=limits,
        annotations=annotations,
        labels=size_labels(profile),
        scheduler_name=settings.scheduler_name,
        forbidden_env=FORBIDDEN_ENV,
    )
