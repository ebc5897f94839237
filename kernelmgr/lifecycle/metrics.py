"""Prometheus metrics, in jupyter_server's registry (served at ``/metrics``).

Labels are bounded: GPU size names (admin-configured), lifecycle states, reasons and
triggers from fixed sets — never kernel ids or user names, so cardinality does not grow
with use. Gauges that describe the present (kernels by state, slices held, slice-seconds
released so far) are computed at scrape time by a collector from the runtime, so they can
never drift from the truth; events (hibernations, resumes, warnings, durations, bytes) are
counters and histograms updated where they happen.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kernelmgr.core.kernels import KernelRegistry, ManagedKernel, ReleasedSince
from kernelmgr.core.lifecycle import KernelState

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime

DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
BYTES_BUCKETS = (1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 4e9, 1.6e10, 6.4e10)

HIBERNATIONS = Counter(
    "elastic_hibernations_total", "Kernels hibernated, by what asked for it.", ["reason", "size"]
)
HIBERNATION_FAILURES = Counter(
    "elastic_hibernation_failures_total",
    "Hibernations that failed (the kernel kept running).",
    ["reason", "size"],
)
CHECKPOINT_SPACE_REFUSALS = Counter(
    "elastic_checkpoint_space_refusals_total",
    "Checkpoints refused before they were written, for want of room: limit is quota (the owner's "
    "max_checkpoint_bytes), reserve (the volume's last bytes, kept for kernels it holds) or full.",
    ["limit"],
)
HELD_MESSAGE_REFUSALS = Counter(
    "elastic_held_message_refusals_total",
    "Messages for kernels that are not running refused, as holding them would go over a cap: limit "
    "is connection, user or server (the server's share of its memory limit).",
    ["limit"],
)
HELD_MESSAGE_BYTES = Gauge(
    "elastic_held_message_bytes",
    "Bytes of messages the server holds now for kernels that are hibernating, hibernated or resuming.",
)
BACKGROUND_CHECKPOINTS = Counter(
    "elastic_background_checkpoints_total",
    "Checkpoints of running idle kernels taken in the background (what a lost kernel resumes from).",
    ["size"],
)
KERNELS_LOST = Counter(
    "elastic_kernels_lost_total",
    "Running kernels that vanished (pod deleted, evicted, node lost) and were hibernated from their last "
    "checkpoint.",
    ["size"],
)
KERNELS_SAVED_AT_STOP = Counter(
    "elastic_kernels_saved_at_stop_total",
    "Of the lost kernels, those stopped by SIGTERM (evicted, drained, preempted, killed politely) that "
    "checkpointed themselves before they went: hibernated with every finished cell.",
    ["size"],
)
RESUMES = Counter("elastic_resumes_total", "Kernels resumed, by what woke them.", ["trigger", "size"])
RESUME_FAILURES = Counter(
    "elastic_resume_failures_total",
    "Resumes that failed or timed out (the kernel stays hibernated; the user's cell gets the error).",
    ["size"],
)
WARNINGS = Counter("elastic_hibernation_warnings_total", "Idle warnings sent to notebooks.", ["kind", "size"])
REMOVALS = Counter(
    "elastic_removals_total", "Hibernated kernels removed after CullPolicy.hibernated_ttl.", ["size"]
)
LOOP_LAG_SECONDS = Histogram(
    "elastic_event_loop_lag_seconds",
    "How late each 1 s beat of the server's event loop came (what every websocket waited extra).",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
HIBERNATE_SECONDS = Histogram(
    "elastic_hibernate_duration_seconds", "Checkpoint + stop + release.", ["size"], buckets=DURATION_BUCKETS
)
RESUME_SECONDS = Histogram(
    "elastic_resume_duration_seconds",
    "Resume to a responsive kernel (including waiting for a slice).",
    ["size"],
    buckets=DURATION_BUCKETS,
)
RESUME_PATH_SECONDS = Histogram(
    "elastic_resume_path_duration_seconds",
    "Resume to a responsive kernel, by how its process started: warm (a warm pool's) or cold.",
    ["size", "path"],
    buckets=DURATION_BUCKETS,
)
START_SECONDS = Histogram(
    "elastic_kernel_start_duration_seconds",
    "A new kernel's start, from the request to a kernel that answers (waiting in the queue included).",
    ["size"],
    buckets=DURATION_BUCKETS,
)
START_FAILURES = Counter(
    "elastic_kernel_start_failures_total",
    "New kernels that did not start, by why (see failure_reason): capacity, unschedulable, image_pull, "
    "timeout, exited, refused (RBAC or admission), other.",
    ["size", "reason"],
)
CAPACITY_REFUSALS = Counter(
    "elastic_capacity_refusals_total",
    "Starts answered 409 because no GPU slice of the size was free (unserved demand).",
    ["size"],
)
CHECKPOINT_BYTES = Histogram(
    "elastic_checkpoint_bytes", "Size of committed checkpoints.", ["size"], buckets=BYTES_BUCKETS
)


def size_label(profile: str | None) -> str:
    return profile or "cpu"


def failure_reason(message: str) -> str:
    """A start failure's message (the scheduler's, the kubelet's, the launch timeout's) as one of a
    fixed set of reasons: a bounded label."""
    text = message.lower()
    if "unschedulable" in text or "failedscheduling" in text or "didn't match" in text:
        return "unschedulable"
    if "imagepull" in text or "errimage" in text or ("pull" in text and "image" in text):
        return "image_pull"
    if "launch_timeout" in text or "not running after" in text or "timed out" in text:
        return "timeout"
    if "exited with code" in text or "ended" in text:
        return "exited"
    return "other"


class ReleasedSliceSeconds:
    """GPU-seconds not held because kernels were hibernated: fraction × time hibernated.

    The open intervals are on the records (``ManagedKernel.released_since``); only the closed
    totals per size are kept here.
    """

    def __init__(self, kernels: KernelRegistry, clock: Callable[[], float] = time.time) -> None:
        self.kernels = kernels
        self.clock = clock
        self._closed: dict[str, float] = {}

    def hibernated(self, record: ManagedKernel, size: str, fraction: float) -> None:
        record.released_since = ReleasedSince(size, fraction, self.clock())

    def woke(self, record: ManagedKernel) -> None:
        """It holds a slice again, or is removed: its interval is closed into the totals."""
        entry, record.released_since = record.released_since, None
        if entry is not None:
            closed = entry.fraction * (self.clock() - entry.since)
            self._closed[entry.size] = self._closed.get(entry.size, 0.0) + closed

    def totals(self) -> dict[str, float]:
        now = self.clock()
        totals = dict(self._closed)
        for record in self.kernels.all():
            entry = record.released_since
            if entry is not None:
                totals[entry.size] = totals.get(entry.size, 0.0) + entry.fraction * (now - entry.since)
        return totals

    def releasing_now(self) -> float:
        """GPUs (fractions summed) not held at this moment because their kernels are hibernated."""
        return sum(r.released_since.fraction for r in self.kernels.all() if r.released_since is not None)


class RuntimeCollector(Collector):
    """Scrape-time gauges from the runtime: kernels by state and size, slices, released GPU-seconds."""

    def __init__(
        self, runtime_getter: Callable[[], ElasticRuntime | None], released: ReleasedSliceSeconds
    ) -> None:
        self.runtime_getter = runtime_getter
        self.released = released

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        runtime = self.runtime_getter()
        kernels = GaugeMetricFamily(
            "elastic_kernels", "Managed kernels by lifecycle state and GPU size.", labels=["state", "size"]
        )
        slices = GaugeMetricFamily("elastic_slices_allocated", "GPU slices held, by size.", labels=["size"])
        fraction = GaugeMetricFamily(
            "elastic_gpu_fraction_allocated", "Sum of GPU fractions held.", labels=["size"]
        )
        released = CounterMetricFamily(
            "elastic_gpu_seconds_released",
            "GPU-seconds (fraction × seconds) not held while hibernated.",
            labels=["size"],
        )
        if runtime is not None:
            counts: dict[tuple[str, str], int] = {}
            for record in runtime.kernels.all():
                key = (record.state.value, size_label(record.profile))
                counts[key] = counts.get(key, 0) + 1
            for state in KernelState:
                for size in {size_label(p) for p in runtime.profiles} | {"cpu"}:
                    kernels.add_metric([state.value, size], counts.get((state.value, size), 0))
            held: dict[str, list[float]] = {}
            for granted in runtime.allocator.slices():
                held.setdefault(granted.profile, []).append(sum(p.fraction for p in granted.placements))
            for size in runtime.profiles:
                slices.add_metric([size], len(held.get(size, [])))
                fraction.add_metric([size], sum(held.get(size, [])))
        yield from warm_pool_metrics(runtime)
        yield from health_metrics(runtime)
        for size, seconds in self.released.totals().items():
            released.add_metric([size], seconds)
        yield kernels
        yield slices
        yield fraction
        yield released


def health_metrics(runtime: ElasticRuntime | None) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """What an operator alerts on: the slice queue's length, the checkpoint volume's space, and (in
    Kubernetes mode) each watch's re-lists and the age of the last event it applied."""
    queue = GaugeMetricFamily(
        "elastic_slice_queue_length", "Kernels waiting for a GPU slice (resumes and queued starts)."
    )
    free = GaugeMetricFamily(
        "elastic_checkpoint_volume_free_bytes", "Free bytes on the checkpoint volume (checkpoint_root)."
    )
    size = GaugeMetricFamily("elastic_checkpoint_volume_size_bytes", "Size of the checkpoint volume.")
    lists = CounterMetricFamily(
        "elastic_informer_lists",
        "Lists of each watch (the first one and every re-list after 410 Gone or a refusal).",
        labels=["informer"],
    )
    age = GaugeMetricFamily(
        "elastic_informer_last_event_age_seconds",
        "Seconds since each watch last applied a list or an event (bookmarks included).",
        labels=["informer"],
    )
    if runtime is not None:
        queue.add_metric([], len(runtime.slice_queue))
        try:
            usage = shutil.disk_usage(runtime.checkpoint_root)
        except OSError:
            usage = None
        if usage is not None:
            free.add_metric([], usage.free)
            size.add_metric([], usage.total)
        health = getattr(runtime.kube, "informer_health", None)
        for name, listed, seconds in health() if health is not None else []:
            lists.add_metric([name], listed)
            if seconds is not None:
                age.add_metric([name], seconds)
    yield from (queue, free, size, lists, age)


def warm_pool_metrics(runtime: ElasticRuntime | None) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Warm pools at scrape time: local warm processes (per base kernelspec) and Kubernetes warm pods
    (per GPU size, each holding a slice), by state; hand-offs; and cold starts by reason."""
    yield from _pool_metrics(
        "elastic_warm_pool_processes",
        "elastic_warm_pool",
        "Warm processes (no slice, not kernels) per base kernelspec, ready or still importing.",
        "warm process",
        "kernel",
        runtime.warm_pools if runtime is not None else None,
    )
    yield from _pool_metrics(
        "elastic_warm_pods",
        "elastic_warm_pod",
        "Kubernetes warm pods (each holding a slice of its size, not kernels), ready or still starting.",
        "warm pod",
        "size",
        runtime.warm_pods if runtime is not None else None,
    )


def _pool_metrics(
    gauge: str, counters: str, help_text: str, what: str, key: str, pools: Any
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    members = GaugeMetricFamily(gauge, help_text, labels=[key, "state"])
    hits = CounterMetricFamily(
        f"{counters}_hits", f"Launches that took a {what}, by use (resume, start).", labels=[key, "use"]
    )
    misses = CounterMetricFamily(
        f"{counters}_misses",
        f"Launches a {what} would serve that started cold, by reason.",
        labels=[key, "reason"],
    )
    if pools is not None:
        for name, counts in pools.counts().items():
            for state, count in counts.items():
                members.add_metric([name, state], count)
        for (name, use), count in pools.hits.items():
            hits.add_metric([name, use], count)
        for (name, reason), count in pools.misses.items():
            misses.add_metric([name, reason], count)
    yield members
    yield hits
    yield misses


_collector: RuntimeCollector | None = None


def install_collector(
    runtime_getter: Callable[[], ElasticRuntime | None], released: ReleasedSliceSeconds
) -> None:
    """Register the scrape-time collector once per process (the registry is process-wide)."""
    global _collector
    if _collector is not None:
        REGISTRY.unregister(_collector)
    _collector = RuntimeCollector(runtime_getter, released)
    REGISTRY.register(_collector)
