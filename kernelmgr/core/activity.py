"""What is known about a kernel's use: its executions (from Jupyter's messages) and its GPU
(from NVML or the node agents). Kept on the kernel's record; the adapters in
:mod:`kernelmgr.activity` and :mod:`kernelmgr.server.cluster_activity` fill them in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ExecutionActivity:
    """Timestamps (epoch seconds) of one kernel's executions."""

    started: float
    last_execution_start: float | None = None
    last_execution_end: float | None = None
    busy_since: float | None = None
    #: The execution count of the latest cell (so a resumed kernel continues the numbering).
    execution_count: int = 0
    #: When the server's own IOPub subscription last heard the kernel (any message): a resume
    #: lets cells through only once it has (see ``JupyterKernelPlatform._until_watched``).
    iopub_heard: float | None = None

    @property
    def last_execution(self) -> float | None:
        stamps = [s for s in (self.last_execution_start, self.last_execution_end) if s is not None]
        return max(stamps) if stamps else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "last_execution_start": self.last_execution_start,
            "last_execution_end": self.last_execution_end,
            "busy_since": self.busy_since,
        }


@dataclass
class GpuActivity:
    """What NVML says about one kernel at one sample.

    ``utilization`` is the highest SM % over the kernel's processes and measurable devices in
    the latest sample (0 when nothing ran); ``idle_seconds`` is the time since it was last above
    the busy threshold, counted from when the kernel was first measured if it never was.
    """

    available: bool
    reason: str = ""
    utilization: float | None = None
    memory_mib: int | None = None
    idle_seconds: float | None = None
    last_busy: float | None = None
    sampled_at: float | None = None
    #: Where the numbers come from: "nvml" (local), "node-agents" (Kubernetes).
    origin: str = "nvml"

    @property
    def source(self) -> str:
        """A short human-readable origin for the numbers, shown by the API."""
        if not self.available:
            return f"unavailable: {self.reason}"
        return f"{self.origin}: {self.reason}" if self.reason else self.origin

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_utilization": None if self.utilization is None else round(self.utilization, 1),
            "gpu_memory_mib": self.memory_mib,
            "gpu_idle_seconds": None if self.idle_seconds is None else round(self.idle_seconds, 1),
            "gpu_activity_source": self.source,
        }
