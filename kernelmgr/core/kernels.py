"""The registry of managed kernels: one record per kernel with everything known about it.

jupyter_server knows a kernel's id, kernelspec and Jupyter execution state; the record adds
what it does not: the GPU size, the owner, the lifecycle state, the committed checkpoint and
what the last hibernation or loss left to tell. Every per-kernel fact of the lifecycle lives
here, so forgetting a kernel is removing its record. Keyed by kernel id; survives a kernel
process ending (a hibernated kernel has no process but is still a kernel). Thread-safe,
because provisioners may run on other threads than handlers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernelmgr.core.activity import ExecutionActivity, GpuActivity
from kernelmgr.core.lifecycle import KernelState, Lifecycle
from kernelmgr.core.policy import CullState

if TYPE_CHECKING:
    from kernelmgr.core.allocator import Slice

#: The user a kernel being started belongs to, set by a shared gateway's start handler for the
#: duration of the start (asyncio copies it into the tasks the start creates); ``None``: the
#: server's own user. Read where the kernel is registered, so its checkpoints, keys and
#: namespace follow from it.
requesting_owner: ContextVar[str | None] = ContextVar("requesting_owner", default=None)


@dataclass(frozen=True)
class Committed:
    """A checkpoint that is committed on stable storage."""

    checkpoint_id: str
    created: float
    size: int = 0


@dataclass
class Loss:
    """Why a running kernel was hibernated without being asked (its pod or process vanished),
    from which checkpoint, and when it was told to stop (``None``: it was not, e.g. its node
    vanished); told to the notebook when it resumes."""

    why: str
    committed: Committed
    stop_began: float | None = None


@dataclass(frozen=True)
class ReleasedSince:
    """A hibernated kernel's released slice, for the released GPU-seconds metric."""

    size: str
    fraction: float
    since: float


@dataclass
class ManagedKernel:
    """One kernel under elastic management."""

    kernel_id: str
    kernelspec: str
    profile: str | None
    owner: str
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    created: float = field(default_factory=time.time)
    launches: int = 0
    last_error: str = ""
    #: Set while resuming: the next launch restores the committed checkpoint.
    restore_on_start: bool = False
    #: With ``restore_on_start``: the checkpoint id the server verified, the only one the
    #: kernel may restore (an older checkpoint put back in place is refused).
    restore_checkpoint: str | None = None
    #: How the last launch started its process: ``cold`` (a new process) or ``warm`` (a warm
    #: pool's, with the frameworks already imported); the resume metrics are split by it.
    launch_path: str = "cold"
    #: The last checkpoint committed on stable storage, as the lifecycle controller knows it.
    committed: Committed | None = None
    #: A resume of this kernel is waiting for a free GPU slice now (its shown phase).
    waiting_for_slice: bool = False
    #: Taken with the last checkpoint: the kernel_info reply, and the kernel's own last cell
    #: number (the server's IOPub watcher can lag behind the notebook's).
    kernel_info: dict[str, Any] = field(default_factory=dict)
    execution_count: int = 0
    #: The slice the last stop gave back (the released-seconds metric reads it once).
    released: Slice | None = None
    #: A process a previous server left running (its pid): it checkpoints itself and exits.
    orphan_pid: int | None = None
    #: Set when the kernel was lost rather than hibernated; cleared by the resume that tells it.
    loss: Loss | None = None
    #: Set while Kubernetes stops the kernel's pod and the kernel checkpoints itself; done
    #: once the server has taken it over (or it ended otherwise).
    stopping: asyncio.Future[None] | None = None
    #: Its executions, from Jupyter's IOPub messages (the cull policy's Jupyter signal).
    activity: ExecutionActivity = field(default_factory=lambda: ExecutionActivity(started=time.time()))
    #: The latest GPU sample of its processes (``None``: not sampled, e.g. it holds no slice).
    gpu: GpuActivity | None = None
    #: What the culler remembers between ticks: the warning given, failed hibernations.
    cull: CullState = field(default_factory=CullState)
    #: While hibernated: the slice it does not hold, counted by the released GPU-seconds metric.
    released_since: ReleasedSince | None = None

    @property
    def state(self) -> KernelState:
        return self.lifecycle.state


class KernelRegistry:
    """Thread-safe map of kernel id to :class:`ManagedKernel`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernels: dict[str, ManagedKernel] = {}

    def register(
        self,
        kernel_id: str,
        kernelspec: str,
        profile: str | None,
        owner: str,
        state: KernelState = KernelState.STARTING,
    ) -> ManagedKernel:
        """Add a kernel, or return the existing record (a restart keeps its record)."""
        with self._lock:
            record = self._kernels.get(kernel_id)
            if record is None:
                record = ManagedKernel(
                    kernel_id=kernel_id,
                    kernelspec=kernelspec,
                    profile=profile,
                    owner=owner,
                    lifecycle=Lifecycle(state=state),
                )
                self._kernels[kernel_id] = record
            return record

    def get(self, kernel_id: str) -> ManagedKernel | None:
        with self._lock:
            return self._kernels.get(kernel_id)

    def remove(self, kernel_id: str) -> ManagedKernel | None:
        with self._lock:
            return self._kernels.pop(kernel_id, None)

    def all(self) -> list[ManagedKernel]:
        with self._lock:
            return list(self._kernels.values())

    def __contains__(self, kernel_id: object) -> bool:
        with self._lock:
            return kernel_id in self._kernels

    def __len__(self) -> int:
        with self._lock:
            return len(self._kernels)
