"""Fractional GPUs through Volcano's vGPU device plugin.

Volcano's vGPU support is HAMi-core behind Volcano's scheduler: the same user-space limits,
requested as ``volcano.sh/vgpu-number`` (GPUs), ``volcano.sh/vgpu-memory`` (MiB per GPU) and
``volcano.sh/vgpu-cores`` (% of the SMs). It is offered for clusters that already run Volcano,
where a second GPU scheduler (HAMi's) is not wanted.

Unlike HAMi there is no webhook that routes pods to the right scheduler, so the fragment sets
``schedulerName: volcano``; a pod left on the default scheduler would be bound by a scheduler
that does not understand the vGPU resources. The limits are enforced by the same LD_PRELOAD
hook as HAMi, so ``CUDA_DISABLE_CONTROL`` is stripped for the same reason (see ``hami``).

Options: ``scheduler_name`` (default ``volcano``), ``queue`` (annotation
``scheduling.volcano.sh/queue-name``; without it Volcano uses its default queue).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelmgr.backends.common import (
    check_dns_subdomain,
    get_str,
    profile_error,
    reject_unknown_options,
    size_annotations,
    size_labels,
)
from kernelmgr.backends.fragment import PodFragment
from kernelmgr.backends.hami import FORBIDDEN_ENV
from kernelmgr.core.profiles import GpuProfile

OPTION_KEYS = frozenset({"scheduler_name", "queue"})
DEFAULT_SCHEDULER = "volcano"
QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"


@dataclass(frozen=True)
class VolcanoSettings:
    scheduler_name: str
    queue: str | None


def parse_options(profile: GpuProfile) -> VolcanoSettings:
    reject_unknown_options(profile, OPTION_KEYS)
    if profile.is_fractional and profile.memory_mib is None:
        raise profile_error(profile, "memory_mib", "is required for a fractional Volcano vGPU size")
    scheduler = get_str(profile, "scheduler_name", DEFAULT_SCHEDULER, example=DEFAULT_SCHEDULER)
    assert scheduler is not None
    check_dns_subdomain(profile, "scheduler_name", scheduler, example=DEFAULT_SCHEDULER)
    queue = get_str(profile, "queue", example="default")
    if queue is not None:
        check_dns_subdomain(profile, "queue", queue, example="default")
    return VolcanoSettings(scheduler_name=scheduler, queue=queue)


def render(profile: GpuProfile, kernel_id: str) -> PodFragment:
    settings = parse_options(profile)
    if profile.is_fractional:
        limits = {"volcano.sh/vgpu-number": "1", "volcano.sh/vgpu-cores": str(profile.compute_percent)}
    else:
        limits = {"volcano.sh/vgpu-number": str(profile.whole_gpus), "volcano.sh/vgpu-cores": "100"}
    if profile.memory_mib is not None:
        limits["volcano.sh/vgpu-memory"] = str(profile.memory_mib)
    annotations = size_annotations(profile)
    if settings.queue is not None:
        annotations[QUEUE_ANNOTATION] = settings.queue
    return PodFragment(
        limits=limits,
        annotations=annotations,
        labels=size_labels(profile),
        scheduler_name=settings.scheduler_name,
        forbidden_env=FORBIDDEN_ENV,
    )
