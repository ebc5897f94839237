"""JSON models of the REST API, built from the runtime and jupyter_server's kernel model.

Kept apart from the handlers so the CLI's expectations, the handlers and the tests all
read one definition of each field.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from kernelmgr.backends import gpushare
from kernelmgr.backends.isolation import isolation_of
from kernelmgr.config import ElasticRuntime
from kernelmgr.core.kernels import ManagedKernel
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.lifecycle.storage import CheckpointSpace


def elastic_kernel_model(
    runtime: ElasticRuntime,
    jupyter_model: dict[str, Any],
    activity: dict[str, Any] | None = None,
    pod_annotations: Mapping[str, str] | None = None,
    waiting_for_slice: bool = False,
) -> dict[str, Any]:
    """One managed kernel: jupyter_server's fields plus size, state, owner, slice, activity.

    ``pod_annotations`` are those of the kernel's pod (Kubernetes mode): where the mechanism's own
    scheduler wrote which device it gave the pod (gpushare's extender), the slice says so as
    ``assigned``, since the allocator only knows the node's devices, not the one picked there.
    """
    kernel_id = jupyter_model["id"]
    record = runtime.kernels.get(kernel_id)
    granted = runtime.allocator.slice_of(kernel_id)
    slice_model = granted.to_dict() if granted else None
    if slice_model is not None:
        assigned = gpushare.assigned_device(pod_annotations)
        if assigned is not None:
            slice_model["assigned"] = assigned
    return {
        "id": kernel_id,
        "name": jupyter_model.get("name"),
        "profile": record.profile if record else None,
        "state": record.state.value if record else "running",
        "state_reason": record.lifecycle.reason if record else "",
        # Server time of the last state change: a client that polls compares it with an earlier
        # reading to tell "failed and back to running" from "not started yet" (no clock skew).
        "state_since": record.lifecycle.since if record else None,
        "last_error": record.last_error if record else "",
        "execution_state": jupyter_model.get("execution_state"),
        "connections": jupyter_model.get("connections", 0),
        "owner": record.owner if record else runtime.owner,
        "slice": slice_model,
        "activity": {
            "last_activity": jupyter_model.get("last_activity"),
            "gpu_utilization": None,
            "gpu_memory_mib": None,
            "gpu_idle_seconds": None,
            **(activity or {}),
        },
        "checkpoint": _checkpoint(runtime, record.owner, kernel_id) if record else None,
        "resume": _resume_progress(runtime, record, granted is not None, waiting_for_slice)
        if record and record.state is KernelState.RESUMING
        else None,
        "hibernate": _hibernate_progress(runtime, record)
        if record and record.state is KernelState.HIBERNATING
        else None,
    }


def _hibernate_progress(runtime: ElasticRuntime, record: ManagedKernel) -> dict[str, Any]:
    """How much of the checkpoint a hibernation has written (the agent's progress file), and the
    writer's estimate of the whole; ``{}`` before the first bytes."""
    progress = runtime.checkpoints.checkpoint_progress(record.owner, record.kernel_id, record.lifecycle.since)
    if progress is None:
        return {}
    return {
        "written_mib": round(int(progress.get("read_bytes", 0)) / MIB, 1),
        "expected_mib": round(int(progress.get("total_bytes", 0)) / MIB, 1),
    }


MIB = 1024 * 1024


def _resume_progress(
    runtime: ElasticRuntime, record: ManagedKernel, has_slice: bool, waiting_for_slice: bool
) -> dict[str, Any]:
    """Where a resume is: waiting for a GPU slice (its place in the queue, of how many, and a
    guess of the wait from the recent time between grants), waiting for a node (its pod Pending
    for the autoscaler), starting the process, or reading N of M MiB.

    The reading phase comes from the file the kernel's agent writes while it reads its
    checkpoint (:mod:`kernelmgr.checkpoint.progress`); one small read, only when asked.
    """
    if record.waiting_for_node and not has_slice:
        return {"phase": "waiting_for_node", "scale_up_wait_s": runtime.scale_up_wait}
    if waiting_for_slice and not has_slice:
        queue = runtime.slice_queue
        place = queue.position(record.kernel_id, runtime.slices_held)
        estimate = queue.estimate_at(place)
        return {
            "phase": "waiting_for_slice",
            "position": place,
            "waiting": len(queue),
            "estimate_s": None if estimate is None else round(estimate),
        }
    progress = runtime.checkpoints.restore_progress(record.owner, record.kernel_id, record.lifecycle.since)
    if progress is None:
        return {"phase": "starting"}
    return {
        "phase": "restoring",
        "restored_mib": round(int(progress.get("read_bytes", 0)) / MIB, 1),
        "total_mib": round(int(progress.get("total_bytes", 0)) / MIB, 1),
    }


def kernel_pod_annotations(
    runtime: ElasticRuntime, kernel_id: str, pods: Mapping[str, Any]
) -> dict[str, str] | None:
    """The annotations of ``kernel_id``'s pod in ``pods`` (the provisioner's pod watch, kernel id -> pod);
    ``None`` for local kernels and for a kernel whose pod the watch has not seen."""
    if not runtime.mode.in_pods:
        return None
    metadata = getattr(pods.get(kernel_id), "metadata", None)
    if metadata is None:
        return None
    return dict(getattr(metadata, "annotations", None) or {})


def _checkpoint(runtime: ElasticRuntime, owner: str, kernel_id: str) -> dict[str, Any] | None:
    """The committed checkpoint's summary, or why it cannot be read (never raises)."""
    try:
        return runtime.checkpoints.summary(owner, kernel_id)
    except Exception as exc:  # refused or unreadable: the store has already kept it aside
        return {"error": str(exc)}


def profiles_model(runtime: ElasticRuntime, kernelspecs: dict[str, str]) -> dict[str, Any]:
    """The GPU sizes, each with whether it fits now and the kernelspecs that launch it."""
    by_profile: dict[str, list[str]] = {}
    for spec_name, profile_name in kernelspecs.items():
        by_profile.setdefault(profile_name, []).append(spec_name)
    profiles = []
    # Local kernels get the local backend's environment whatever the size's Kubernetes backend.
    local = not runtime.mode.in_pods
    for profile in runtime.profiles.values():
        entry = profile.to_dict()
        entry["kernelspecs"] = sorted(by_profile.get(profile.name, []))
        entry["fits_now"] = runtime.gpus_available and runtime.allocator.fits(profile, warm_gives_way=True)
        entry["fits_ever"] = runtime.gpus_available and runtime.allocator.ever_fits(profile)
        entry["isolation"] = isolation_of(profile, local=local, use_mps=runtime.use_mps).to_dict()
        profiles.append(entry)
    return {
        "gpus_available": runtime.gpus_available,
        "message": _gpu_message(runtime),
        # Seconds a new kernel of a size that does not fit now waits for a slice; 0: refused at once.
        "start_queue_wait": runtime.start_queue_wait,
        "profiles": profiles,
    }


def gpus_model(runtime: ElasticRuntime) -> dict[str, Any]:
    """The inventory with each device's capacity and current slices."""
    return {
        "source": runtime.inventory.source,
        "message": _gpu_message(runtime),
        "strategy": runtime.allocator.strategy,
        "devices": [usage.to_dict() for usage in runtime.allocator.usage()],
        # Kubernetes warm pods per size (each holds one of the slices above, marked "warm").
        "warm_pods": runtime.warm_pods.counts() if runtime.warm_pods is not None else {},
    }


def add_device_activity(model: dict[str, Any], activity_of: Callable[[str], Mapping[str, Any]]) -> None:
    """Each device's live use, from its kernels' latest GPU samples (what the culler already has).

    ``activity_of`` is a kernel's ``activity`` model. A kernel on several GPUs counts an even part
    on each; warm pods and kernels not sampled yet count nothing. Processes outside the server's
    kernels are not seen, so this is the kernels' use of the GPU, not NVML's device total; the
    JupyterLab panel draws it as meters with a short history.
    """
    per_kernel: dict[str, int] = {}
    for device in model["devices"]:
        for entry in device["slices"]:
            if not entry["warm"]:
                per_kernel[entry["kernel_id"]] = per_kernel.get(entry["kernel_id"], 0) + 1
    for device in model["devices"]:
        utilization: float | None = None
        memory: float | None = None
        for entry in device["slices"]:
            if entry["warm"]:
                continue
            sample = activity_of(entry["kernel_id"])
            share = per_kernel[entry["kernel_id"]]
            if sample.get("gpu_utilization") is not None:
                utilization = (utilization or 0.0) + float(sample["gpu_utilization"]) / share
            if sample.get("gpu_memory_mib") is not None:
                memory = (memory or 0.0) + float(sample["gpu_memory_mib"]) / share
        device["activity"] = {
            "gpu_utilization": None if utilization is None else round(min(utilization, 100.0), 1),
            "memory_used_mib": None if memory is None else round(memory, 1),
        }


def _gpu_message(runtime: ElasticRuntime) -> str:
    if runtime.gpus_available:
        return runtime.inventory.note
    return f"No GPUs: {runtime.inventory.note}."


def queue_model(runtime: ElasticRuntime, user: str | None, admin: bool) -> dict[str, Any]:
    """``GET /api/elastic/queue``: the kernels waiting for a GPU slice, in the order they are served.

    An admin sees every entry; a user sees their own (with their place) and only how many others
    wait. ``estimate_s`` is a guess from the recent time between grants (``null`` until two).
    """
    queue = runtime.slice_queue
    held = runtime.slices_held
    now = time.monotonic()
    entries = []
    for place, waiter in enumerate(queue.order(held), start=1):
        if not admin and waiter.owner != user:
            continue
        record = runtime.kernels.get(waiter.key)
        estimate = queue.estimate_at(place)
        entries.append(
            {
                "position": place,
                "kernel_id": waiter.key,
                "owner": waiter.owner,
                "size": waiter.size,
                "priority": waiter.priority,
                "kind": "resume" if record is not None and record.state is KernelState.RESUMING else "start",
                "waited_s": round(now - waiter.since, 1),
                "estimate_s": None if estimate is None else round(estimate),
            }
        )
    return {"waiting": len(queue), "entries": entries}


def storage_model(
    runtime: ElasticRuntime,
    space: CheckpointSpace,
    owners: list[str],
    hibernated_at: Callable[[str], float | None],
    admin: bool,
) -> dict[str, Any]:
    """``GET /api/elastic/storage``: each owner's checkpoints (oldest hibernation first: the first
    to discard), their bytes against the owner's quota, and for admins the volume's free space.
    Blocking (it walks the owners' folders or lists the bucket): call it in a worker thread."""
    volume = runtime.checkpoints.volume_space()
    result: dict[str, Any] = {"volume": None, "owners": []}
    if admin and volume is not None:
        free, total = volume
        reserve = int(total * space.reserve_fraction)
        result["volume"] = {"free_bytes": free, "total_bytes": total, "reserve_bytes": reserve}
    for owner in owners:
        held = runtime.checkpoints.usage(owner)
        rows = []
        for kernel_id, size in held.items():
            record = runtime.kernels.get(kernel_id)
            state = record.state.value if record is not None else "orphaned"
            rows.append(
                {
                    "kernel_id": kernel_id,
                    "state": state,
                    "bytes": size,
                    "hibernated_at": hibernated_at(kernel_id),
                }
            )
        rows.sort(key=lambda row: (row["hibernated_at"] is None, row["hibernated_at"] or 0, row["kernel_id"]))
        result["owners"].append(
            {
                "owner": owner,
                "quota_bytes": space.quota_of(owner),
                "used_bytes": sum(held.values()),
                "checkpoints": rows,
            }
        )
    return result
