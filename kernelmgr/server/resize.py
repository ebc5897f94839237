"""Changing a kernel's GPU size: hibernate it, then resume it at another size when that fits.

A kernel's size comes from its kernelspec (one per size, ``python3-gpu-small``), so the kernel
moves to the same base kernelspec's spec of the new size; its next launch (the resume) takes a
slice of that size, waiting its turn in the slice queue like any resume. The variables come back
from the checkpoint, as after any hibernation. The notebook's saved kernelspec is the
notebook's own: it names the old size until the user picks another kernel.
"""

from __future__ import annotations

from typing import Any

from kernelmgr.core.controller import LifecycleError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.server.errors import http_error, no_such_kernel
from kernelmgr.server.kernelspecs import ElasticKernelSpecManager


def size_from_body(body: Any, offered: list[str]) -> str:
    """The ``size`` of ``{"size": "medium"}``; 400 saying what to send otherwise."""
    size = body.get("size") if isinstance(body, dict) else None
    if not isinstance(size, str) or not size:
        raise http_error(
            400, f'send a JSON body {{"size": "<GPU size>"}}, one of: {", ".join(offered) or "none"}'
        )
    return size


async def resize_kernel(km: Any, kernel_id: str, size: str) -> dict[str, Any]:
    """``POST /api/elastic/kernels/{id}/resize``: 404 unknown kernel; 400 unknown or same size;
    409 a kernel without a size, one busy changing state, or a size that never fits these GPUs;
    403 a size over the user's quota at a gateway (checked before the kernel is hibernated).
    Returns the kernel's model once it runs at the new size."""
    runtime = km._require_runtime()
    if kernel_id not in km:
        raise no_such_kernel(kernel_id)
    record = runtime.kernels.get(kernel_id)
    if record is None or record.profile is None:
        raise http_error(
            409,
            f"kernel {kernel_id} has no GPU size: only a kernel of a GPU-size kernelspec can change size",
        )
    offered = sorted(runtime.profiles)
    if size not in runtime.profiles:
        raise http_error(400, f"unknown GPU size {size!r}; the sizes here: {', '.join(offered)}")
    if size == record.profile:
        raise http_error(400, f"kernel {kernel_id} is already of GPU size {size!r}; pick another size")
    profile = runtime.profile(size)
    if not runtime.allocator.ever_fits(profile):
        raise http_error(409, f"GPU size {size!r} never fits on this server's GPUs; pick a smaller size")
    ksm = km.kernel_spec_manager
    spec = ksm.resized(record.kernelspec, size) if isinstance(ksm, ElasticKernelSpecManager) else None
    if spec is None:
        raise http_error(
            409, f"kernel {kernel_id}'s kernelspec {record.kernelspec!r} has no spec of GPU size {size!r}"
        )
    if record.state not in (KernelState.RUNNING, KernelState.HIBERNATED):
        raise http_error(
            409,
            f"kernel {kernel_id} is {record.state.value}: change its size once it is running or hibernated",
        )
    admission = km.hibernator.admission if km.hibernator is not None else None
    if admission is not None:  # a gateway's quota: refused (403) before anything is stopped
        try:
            with admission(record.owner, size, kernel_id):
                pass
        except LifecycleError as exc:
            raise http_error(exc.status, exc.message) from None
    if record.state is KernelState.RUNNING:
        await km.hibernate(kernel_id, "resize")
    if record.state is not KernelState.HIBERNATED:  # a cell woke it meanwhile
        raise http_error(409, f"kernel {kernel_id} is {record.state.value} again: try the size change again")
    kernel = km.get_kernel(kernel_id)
    kernel.kernel_name = spec  # its next launch reads this kernelspec ...
    provisioner = kernel.provisioner
    if provisioner is not None:  # ... through the provisioner, which jupyter_client keeps across launches
        renamed = kernel.kernel_spec
        renamed.interrupt_mode = provisioner.kernel_spec.interrupt_mode  # what the provisioner set
        provisioner.kernel_spec = renamed
    record.kernelspec, record.profile = spec, size
    model: dict[str, Any] = await km.resume(kernel_id, "resize")
    return model
