"""Whole GPUs through the device plugin: ``nvidia.com/gpu: N``.

The plain case, and the only one with full isolation for free: the device plugin hands the
container N entire devices and nothing else can be scheduled on them. It is also the fallback
every cluster with the NVIDIA device plugin supports, so whole-GPU sizes default to it.

Option ``resource_name`` covers device plugins that advertise under another name (another
vendor, or a ``RESOURCE_PREFIX``); it must still mean "one entire device".
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelmgr.backends.common import (
    check_resource_name,
    get_str,
    profile_error,
    reject_unknown_options,
    size_annotations,
    size_labels,
)
from kernelmgr.backends.fragment import PodFragment
from kernelmgr.core.profiles import GpuProfile

OPTION_KEYS = frozenset({"resource_name"})
DEFAULT_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class WholeSettings:
    resource_name: str
    count: int


def parse_options(profile: GpuProfile) -> WholeSettings:
    reject_unknown_options(profile, OPTION_KEYS)
    if profile.whole_gpus < 1:
        raise profile_error(
            profile,
            "backend",
            "'whole' hands out entire GPUs; use gpu_fraction >= 1 or a sharing backend (hami, mig, ...)",
        )
    name = get_str(profile, "resource_name", DEFAULT_RESOURCE, example=DEFAULT_RESOURCE)
    assert name is not None
    check_resource_name(profile, "resource_name", name, example=DEFAULT_RESOURCE)
    return WholeSettings(resource_name=name, count=profile.whole_gpus)


def render(profile: GpuProfile, kernel_id: str) -> PodFragment:
    settings = parse_options(profile)
    return PodFragment(
        limits={settings.resource_name: str(settings.count)},
        labels=size_labels(profile),
        annotations=size_annotations(profile),
    )
