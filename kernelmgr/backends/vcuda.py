"""Fractional GPUs through Tencent's gpu-manager (vCUDA).

gpu-manager's device plugin advertises ``tencent.com/vcuda-core`` (100 per GPU) and
``tencent.com/vcuda-memory`` (one unit per 256 MiB); its vCUDA library, mounted into the
container, throttles kernel launches to the core share and fails allocations past the memory
share. That is a user-space hook, so the limits are soft (code that loads the real CUDA library
escapes them, and ``nvidia-smi`` still shows the whole card). Placement needs gpu-manager's
companion scheduler ``gpu-admission`` (as an extender or its own scheduler) for fractions.

A fraction is ``vcuda-core: <compute_percent>`` with ``vcuda-memory: ceil(memory_mib / 256)``
and the annotation ``tencent.com/vcuda-core-limit`` (the hard upper bound of the core share;
without it gpu-manager lets a pod borrow idle cores). ``vcuda-core: 100`` on a fraction is
refused: gpu-manager reads 100 (or any multiple) as whole GPUs and switches limiting off, so a
size with ``compute_percent: 100`` would get an unthrottled GPU while another kernel sits on the
same card. Whole sizes ask for ``100 * N`` cores (exclusive cards) and the memory of the size, if
it has a cap, else no ``vcuda-memory``.

Options: ``scheduler_name`` (where gpu-admission runs as a separate scheduler),
``core_limit`` (bool, default true: write the limit annotation; false lets a kernel borrow idle
cores, at the price of its neighbours).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernelmgr.backends.common import (
    check_dns_subdomain,
    get_bool,
    get_str,
    profile_error,
    reject_unknown_options,
    size_annotations,
    size_labels,
)
from kernelmgr.backends.fragment import PodFragment
from kernelmgr.core.profiles import GpuProfile

OPTION_KEYS = frozenset({"scheduler_name", "core_limit"})
VCUDA_CORE = "tencent.com/vcuda-core"
VCUDA_MEMORY = "tencent.com/vcuda-memory"
CORE_LIMIT_ANNOTATION = "tencent.com/vcuda-core-limit"
#: MiB per ``vcuda-memory`` unit.
MEMORY_UNIT_MIB = 256
CORES_PER_GPU = 100


@dataclass(frozen=True)
class VcudaSettings:
    scheduler_name: str | None
    core_limit: bool


def parse_options(profile: GpuProfile) -> VcudaSettings:
    reject_unknown_options(profile, OPTION_KEYS)
    if profile.is_fractional:
        if profile.memory_mib is None:
            raise profile_error(profile, "memory_mib", "is required for a fractional vCUDA size")
        if profile.compute_percent >= CORES_PER_GPU:
            raise profile_error(
                profile,
                "compute_percent",
                "100 would request tencent.com/vcuda-core: 100, which gpu-manager treats as a whole GPU "
                "with limiting switched off, on a GPU shared with others; use at most 99 for a fraction, "
                "or gpu_fraction 1 for a whole GPU",
            )
    scheduler = get_str(profile, "scheduler_name", example="gpu-admission")
    if scheduler is not None:
        check_dns_subdomain(profile, "scheduler_name", scheduler, example="gpu-admission")
    return VcudaSettings(scheduler_name=scheduler, core_limit=get_bool(profile, "core_limit", True))


def render(profile: GpuProfile, kernel_id: str) -> PodFragment:
    settings = parse_options(profile)
    cores = profile.compute_percent if profile.is_fractional else CORES_PER_GPU * profile.whole_gpus
    limits = {VCUDA_CORE: str(cores)}
    if profile.memory_mib is not None:
        per_gpu = math.ceil(profile.memory_mib / MEMORY_UNIT_MIB)
        limits[VCUDA_MEMORY] = str(per_gpu * max(1, profile.whole_gpus))
    annotations = size_annotations(profile)
    if profile.is_fractional and settings.core_limit:
        annotations[CORE_LIMIT_ANNOTATION] = str(cores)
    return PodFragment(
        limits=limits,
        annotations=annotations,
        labels=size_labels(profile),
        scheduler_name=settings.scheduler_name,
    )
