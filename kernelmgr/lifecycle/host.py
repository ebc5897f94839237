"""What the lifecycle needs from the server that holds the kernels: a small protocol.

jupyter_server's kernel manager (:class:`kernelmgr.server.kernelmanager.ElasticMappingKernelManager`)
implements it; the lifecycle modules take a :class:`KernelHost` instead of importing it, so
the dependency runs one way, from ``server/`` to ``lifecycle/``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from kernelmgr.core.lifecycle import KernelState

if TYPE_CHECKING:
    from kernelmgr.lifecycle.records import KernelRecord


class KernelHost(Protocol):
    """The kernels jupyter_server knows, by id: each a ``KernelManager`` that keeps its id,
    ports and connection file across the processes a hibernation stops and a resume starts."""

    log: logging.Logger
    #: New kernels whose start has not finished (the server still waits for their first answer):
    #: not the lifecycle's to hibernate yet, since stopping one ends its start with an error.
    starting_kernels: set[str]

    def __contains__(self, kernel_id: str) -> bool: ...

    def get_kernel(self, kernel_id: str) -> Any:
        """The kernel's ``KernelManager``."""

    def adopt_hibernated(self, record: KernelRecord, state: KernelState = KernelState.HIBERNATED) -> None:
        """List a kernel a previous server left (hibernated, or still checkpointing itself)."""

    async def shutdown_kernel(self, kernel_id: str, now: bool = False, restart: bool = False) -> None:
        """Shut the kernel down for good (the culler's removal)."""

    def remove_kernel(self, kernel_id: str) -> Any:
        """Drop a kernel from the listing (it ended before any checkpoint)."""

    def new_process(self, kernel_id: str) -> None:
        """The kernel has a new process (a new pod, or new ports): the server's own watchers follow it."""
