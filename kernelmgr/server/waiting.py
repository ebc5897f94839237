"""Stopping a resume that waits for a free GPU slice, from the REST API (a CLI's Ctrl-C).

What an interrupt does from a notebook: the resume stops waiting, the kernel stays hibernated, and
the cells held for it are cancelled. A resume that has its slice already runs to the end.
"""

from __future__ import annotations

from typing import Any

from kernelmgr.server.errors import http_error, no_such_kernel


async def cancel_waiting_resume(km: Any, kernel_id: str) -> None:
    """Stop ``kernel_id``'s resume if it waits for a slice; 404 for an unknown kernel, 409 (saying
    why) when no resume waits."""
    runtime = km._require_runtime()
    if kernel_id not in km:
        raise no_such_kernel(kernel_id)
    record = runtime.kernels.get(kernel_id)
    if record is None or not record.waiting_for_slice:
        state = record.state.value if record else "not an elastic kernel"
        raise http_error(
            409,
            f"kernel {kernel_id} is {state} and not waiting for a GPU slice: nothing to cancel "
            "(a resume that has its slice goes on; shut the kernel down to stop it)",
        )
    from kernelmgr.server.websocket import ElasticWebsocketConnection

    ElasticWebsocketConnection.interrupt_waiting(kernel_id, "waiting for a GPU slice")
    await km._require_hibernator().stop_waiting(kernel_id)
