"""Fractional GPUs through Aliyun's gpushare (scheduler extender + device plugin).

gpushare splits a GPU by memory only, and only at scheduling time: a pod asks for
``aliyun.com/gpu-mem`` (GiB, or MiB where the device plugin runs with ``--memory-unit=MiB``),
the scheduler extender picks a GPU on the node with that much unclaimed, and the device plugin
hands the container the *whole* device with ``NVIDIA_VISIBLE_DEVICES`` set to it. Nothing limits
what the kernel then allocates or computes ("1 GiB requested, 5-6 GiB used" is the project's most
reported problem); its own user guide asks workloads to cap themselves. So this backend does what
it can: it tells the kernel its share in the variables the frameworks honour (the same ones as
time-slicing, :func:`~kernelmgr.backends.common.framework_share_env`), and the isolation table
says "none".

``aliyun.com/gpu-count`` is the node's number of GPUs as the device plugin advertises it: the
inventory (:mod:`kernelmgr.kube.nodes`) reads it with ``aliyun.com/gpu-mem`` to know the devices'
memory. Pods do not request it: gpushare puts a container on one GPU.

A whole size (``gpu_fraction`` 1) asks for the device's entire memory (option
``device_memory_mib``, required then), so the extender places nothing else beside it. Several
GPUs cannot be asked for through gpushare: use backend ``whole`` there.

Where the extender placed the pod is written back as pod annotations
(``ALIYUN_COM_GPU_MEM_IDX`` the GPU index on the node, ``ALIYUN_COM_GPU_MEM_DEV`` the device's
memory, ``ALIYUN_COM_GPU_MEM_POD`` the pod's request, ``ALIYUN_COM_GPU_MEM_ASSUME_TIME``);
:func:`assigned_device` reads them for ``/api/elastic/kernels``.

Options: ``memory_unit`` (``GiB``, the default, or ``MiB``, as the device plugin's
``--memory-unit``), ``device_memory_mib`` (the GPU's total memory: the exact share for the
frameworks, and the request of a whole size), ``scheduler_name`` (only for clusters that run the
extender behind a second scheduler rather than in the default one's extender list).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernelmgr.backends.common import (
    check_dns_subdomain,
    framework_share_env,
    get_choice,
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

OPTION_KEYS = frozenset({"memory_unit", "device_memory_mib", "scheduler_name"})
UNITS = ("GiB", "MiB")
GPU_MEM = "aliyun.com/gpu-mem"
GPU_COUNT = "aliyun.com/gpu-count"
#: Pod annotations the scheduler extender writes when it binds the pod.
IDX_ANNOTATION = "ALIYUN_COM_GPU_MEM_IDX"
DEV_ANNOTATION = "ALIYUN_COM_GPU_MEM_DEV"
POD_ANNOTATION = "ALIYUN_COM_GPU_MEM_POD"
ASSUME_TIME_ANNOTATION = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
ASSIGNED_ANNOTATION = "ALIYUN_COM_GPU_MEM_ASSIGNED"


@dataclass(frozen=True)
class GpushareSettings:
    memory_unit: str
    device_memory_mib: int | None
    scheduler_name: str | None

    @property
    def unit_mib(self) -> int:
        return 1024 if self.memory_unit == "GiB" else 1


def parse_options(profile: GpuProfile) -> GpushareSettings:
    reject_unknown_options(profile, OPTION_KEYS)
    if profile.gpu_fraction > 1:
        raise profile_error(
            profile,
            "gpu_fraction",
            "gpushare places a container on one GPU; use gpu_fraction <= 1 or backend 'whole' for several",
        )
    unit = get_choice(profile, "memory_unit", UNITS, "GiB")
    assert unit is not None
    device_memory = get_positive_int(profile, "device_memory_mib", example=81920)
    scheduler = get_str(profile, "scheduler_name", example="gpushare-scheduler")
    if scheduler is not None:
        check_dns_subdomain(profile, "scheduler_name", scheduler, example="gpushare-scheduler")
    settings = GpushareSettings(memory_unit=unit, device_memory_mib=device_memory, scheduler_name=scheduler)
    if profile.is_fractional:
        if profile.memory_mib is None:
            raise profile_error(profile, "memory_mib", "is required for a gpushare size (what it asks for)")
        if unit == "GiB" and profile.memory_mib % 1024:
            raise profile_error(
                profile,
                "memory_mib",
                f"{profile.memory_mib} is not a whole number of GiB, the unit aliyun.com/gpu-mem counts in; "
                "use a multiple of 1024, or options.memory_unit 'MiB' if the device plugin runs with "
                "--memory-unit=MiB",
            )
        if device_memory is not None and profile.memory_mib > device_memory:
            raise option_error(
                profile,
                "device_memory_mib",
                f"is smaller than the size's memory_mib ({profile.memory_mib}); give the GPU's total memory",
            )
    elif device_memory is None:
        raise option_error(
            profile,
            "device_memory_mib",
            "is required for a whole-GPU gpushare size: it asks for the GPU's entire memory "
            "(e.g. 81920 for an 80 GiB GPU)",
        )
    return settings


def requested_units(profile: GpuProfile, settings: GpushareSettings) -> int:
    """The ``aliyun.com/gpu-mem`` quantity: the size's memory, or the whole device's, in the unit."""
    mib = profile.memory_mib if profile.is_fractional else settings.device_memory_mib
    assert mib is not None
    return math.ceil(mib / settings.unit_mib)


def render(profile: GpuProfile, kernel_id: str) -> PodFragment:
    settings = parse_options(profile)
    units = requested_units(profile, settings)
    if not profile.is_fractional:
        share = 1.0
    elif settings.device_memory_mib is not None and profile.memory_mib is not None:
        share = profile.memory_mib / settings.device_memory_mib
    else:
        share = profile.gpu_fraction
    return PodFragment(
        limits={GPU_MEM: str(units)},
        env=framework_share_env(profile, share),
        labels=size_labels(profile),
        annotations=size_annotations(profile),
        scheduler_name=settings.scheduler_name,
    )


def _int(value: Any) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def assigned_device(annotations: Mapping[str, str] | None) -> dict[str, Any] | None:
    """The GPU the gpushare extender assigned, from a pod's annotations; ``None`` if it wrote none.

    ``index`` is the GPU's index on the node; ``device_memory`` and ``pod_memory`` are in the
    device plugin's unit (the extender does not say which), ``assume_time`` its nanosecond stamp.
    """
    if not annotations or IDX_ANNOTATION not in annotations:
        return None
    return {
        "mechanism": "gpushare",
        "index": _int(annotations.get(IDX_ANNOTATION)),
        "device_memory": _int(annotations.get(DEV_ANNOTATION)),
        "pod_memory": _int(annotations.get(POD_ANNOTATION)),
        "assume_time": _int(annotations.get(ASSUME_TIME_ANNOTATION)),
        "assigned": annotations.get(ASSIGNED_ANNOTATION) == "true",
    }
