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


@dataclass(frozen=True)
class LaunchPlan:
    """What a kernel's next launch does, handed by a resume to that launch and taken once.

    ``restore``: the agent restores a checkpoint before the kernel serves; ``checkpoint``: the
    id the server verified, the only one the kernel may restore (an older checkpoint put back in
    place is refused). :data:`FRESH_START` (nothing handed) starts the kernel empty: a new
    kernel, a restart, a relaunch after a crash.
    """

    restore: bool = False
    checkpoint: str | None = None

    @classmethod
    def restoring(cls, committed: Committed | None) -> LaunchPlan:
        """Restore ``committed`` (``None``: start empty, its checkpoints discarded)."""
        return cls(True, committed.checkpoint_id) if committed is not None else FRESH_START


#: The plan of every launch no resume handed one to.
FRESH_START = LaunchPlan()


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
    #: The plan a resume handed to the next launch, until that launch takes it
    #: (:meth:`hand_launch_plan`, :meth:`take_launch_plan`).
    _launch_plan: LaunchPlan | None = field(default=None, repr=False)
    #: How the last launch started its process: ``cold`` (a new process) or ``warm`` (a warm
    #: pool's, with the frameworks already imported); the resume metrics are split by it.
    launch_path: str = "cold"
    #: The last checkpoint committed on stable storage, as the lifecycle controller knows it.
    committed: Committed | None = None
    #: A resume of this kernel is waiting for a free GPU slice now (its shown phase).
    waiting_for_slice: bool = False
    #: Its pod waits Pending for a node a cluster autoscaler adds (``scale_up_wait``): no slice yet.
    waiting_for_node: bool = False
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
    #: Set while Kubernetes stops the kernel's pod and the kernel checkpoints itself, and from a
    #: loss's report until its takeover (what notebooks send is held meanwhile); done once the
    #: server has taken it over (or it ended otherwise).
    stopping: asyncio.Future[None] | None = None
    #: When Kubernetes began stopping the running pod unasked (epoch seconds), once a
    #: provisioner saw it; told with the loss. Cleared by the next launch.
    stop_began: float | None = None
    #: Why the process or pod vanished, once the server took the kernel over (hibernated from
    #: its checkpoint): until the next launch there is no process, and a poll must not report an
    #: exit (the restarter would start the kernel again, empty). Cleared by the next launch.
    taken_over: str | None = None
    #: Its process was asked to end for a restart (or a hibernation's stop): the exit a poll
    #: sees meanwhile is no crash, and the slice stays. Cleared when the next launch serves.
    restarting: bool = False
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

    def hand_launch_plan(self, plan: LaunchPlan | None) -> None:
        """The resume's side: what the next launch must do (``None``: withdraw a plan no launch
        took, so a later restart starts empty)."""
        self._launch_plan = plan

    def take_launch_plan(self) -> LaunchPlan:
        """The launch's side, once per launch: the plan handed to it, now cleared, or
        :data:`FRESH_START` when none was (a new kernel, a restart)."""
        plan, self._launch_plan = self._launch_plan or FRESH_START, None
        return plan


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
