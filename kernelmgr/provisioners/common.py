"""What every elastic provisioner shares, whatever runs the kernel (a local process or a pod).

The slice bookkeeping must be identical in both: a size that does not fit fails before anything is
started, a failed start gives the slice back, and only a kernel that was simply starting or running
becomes ``dead`` when its slice is released (a hibernation or resume owns the state otherwise).
Keeping it here means the two provisioners cannot drift apart.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, cast

from kernelmgr.config import ElasticRuntime
from kernelmgr.core.allocator import Slice
from kernelmgr.core.controller import LossReports
from kernelmgr.core.kernels import LaunchPlan, ManagedKernel, requesting_owner
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.modes import LOCAL_PROVISIONER

AGENT_EXTENSION = "kernelmgr.checkpoint.agent"


def with_agent(cmd: list[str]) -> list[str]:
    """Load the checkpoint agent into an ipykernel command line (other kernels are left alone)."""
    if any("ipykernel" in part for part in cmd) and not any(AGENT_EXTENSION in part for part in cmd):
        cmd.append(f"--IPKernelApp.extra_extensions={AGENT_EXTENSION}")
    return cmd


def find_runtime(start: Any, provisioner_name: str = LOCAL_PROVISIONER) -> ElasticRuntime:
    """Walk the traitlets ``parent`` chain to the object that carries the runtime."""
    node = start
    while node is not None:
        runtime = getattr(node, "elastic_runtime", None)
        if isinstance(runtime, ElasticRuntime):
            return runtime
        node = getattr(node, "parent", None)
    raise RuntimeError(
        f"{provisioner_name} needs the kernelmgr server extension (it installs the elastic kernel "
        "manager that owns the GPU allocator); enable it with `jupyter server extension enable kernelmgr`"
    )


def find_loss_reports(start: Any) -> LossReports | None:
    """Where this kernel's losses are reported: the ``kernel_losses`` of the server that owns the
    kernels, on the traitlets ``parent`` chain like the runtime; ``None`` without one (a
    provisioner used on its own: nothing takes a vanished kernel over)."""
    node = start
    while node is not None:
        losses = getattr(node, "kernel_losses", None)
        if losses is not None:
            return cast(LossReports, losses)
        node = getattr(node, "parent", None)
    return None


def profile_name_of(kernel_spec: Any) -> str | None:
    """The GPU size a kernelspec asks for (``metadata.elastic.profile``), ``None`` for a CPU kernel."""
    elastic = (getattr(kernel_spec, "metadata", None) or {}).get("elastic") or {}
    profile = elastic.get("profile")
    return str(profile) if profile else None


class Claim(NamedTuple):
    """What a launch begins with: the kernel's record, its slice, and the plan a resume handed it."""

    record: ManagedKernel
    granted: Slice | None
    plan: LaunchPlan


def claim_slice(
    runtime: ElasticRuntime,
    kernel_id: str,
    kernelspec_name: str,
    profile_name: str | None,
    take_over: str | None = None,
    node_may_come: bool = False,
) -> Claim:
    """Register the kernel (or find it, for a resume), take the launch's plan and its slice,
    before anything starts.

    The one place a launch takes its plan (:meth:`ManagedKernel.take_launch_plan`): once, so the
    next launch (a restart) starts empty unless a resume hands it another. A size that does not
    fit raises here; a new kernel is then marked dead and forgotten, while a resume keeps its
    record and checkpoint (the hibernator decides what a failed resume means). ``take_over``
    names a warm holder whose slice the kernel takes instead of booking a new one.
    ``node_may_come`` (a pod, with ``ElasticKernels.scale_up_wait``): a size that fits nowhere now
    claims nothing (``granted`` is ``None``); the pod waits for a node and books where it lands.
    """
    owner = requesting_owner.get() or runtime.owner  # a gateway starts kernels for many users
    record = runtime.states.starting(kernel_id, kernelspec_name, profile_name, owner)
    plan = record.take_launch_plan()
    resuming = record.state is KernelState.RESUMING
    if profile_name is None:
        return Claim(record, None, plan)
    try:
        granted = runtime.allocator.transfer(take_over, kernel_id) if take_over else None
        if granted is None:
            profile = runtime.profile(profile_name)
            if node_may_come and runtime.waits_for_a_node(profile):
                return Claim(record, None, plan)
            granted = runtime.allocator.allocate(kernel_id, profile)
    except Exception as exc:
        if not resuming:
            runtime.states.start_refused(record, str(exc))
        raise
    return Claim(record, granted, plan)


def mark_launched(runtime: ElasticRuntime, kernel_id: str, how: str) -> None:
    """The kernel serves: count the launch, starting → running."""
    runtime.states.launched(kernel_id, how)


def release_slice(runtime: ElasticRuntime, kernel_id: str, reason: str, log: logging.Logger) -> None:
    """Give the slice back (idempotent); a kernel that was only starting or running dies here.

    During a hibernation or a resume the lifecycle controller owns the state and decides what a
    stopped kernel means (hibernated, back to running, resume failed).
    """
    released = runtime.allocator.release(kernel_id)
    runtime.states.ended(kernel_id, reason)
    if released is not None:
        log.info(
            "Released GPU slice of kernel %s (size %s on %s): %s",
            kernel_id,
            released.profile,
            ", ".join(released.device_uuids),
            reason,
        )


#: The notebook's folder, as jupyter_server's GatewayClient sends it (Enterprise Gateway's name).
WORKING_DIR_ENV = "KERNEL_WORKING_DIR"


def requested_dir(launch_kwargs: dict[str, Any]) -> str | None:
    """The folder a kernel start asks for: the client's ``KERNEL_WORKING_DIR``, else the server's
    ``cwd`` (jupyter_server's: the notebook's folder under its root)."""
    env = launch_kwargs.get("env") or {}
    asked = env.get(WORKING_DIR_ENV) if isinstance(env, dict) else None
    if isinstance(asked, str) and asked:
        return asked
    cwd = launch_kwargs.get("cwd")
    return str(cwd) if cwd else None
