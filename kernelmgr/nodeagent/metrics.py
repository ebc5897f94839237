"""The node agent's Prometheus text, built from its latest sample at scrape time.

Names follow the server's (:mod:`kernelmgr.lifecycle.metrics`): ``elastic_`` prefix, base units
(bytes, seconds). Unlike the server, the per-pod gauges carry ``pod_uid`` and ``kernel_id``
labels: that is their point, and cardinality stays bounded by the pods holding a GPU on this
node *now* — a separate registry per agent, rebuilt on every scrape, so a pod's series vanish
with it instead of accumulating.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kernelmgr.nodeagent.sampler import NodeSample

_MIB = 1024 * 1024
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SampleCollector(Collector):
    """Gauges from whatever sample ``latest`` returns (None before the first pass)."""

    def __init__(self, latest: Callable[[], NodeSample | None]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sample = self.latest()
        labels = ["node", "pod_uid", "kernel_id"]
        utilization = GaugeMetricFamily(
            "elastic_node_pod_gpu_utilization_percent",
            "Highest SM utilisation of the pod's GPU processes since the previous sample "
            "(absent on MIG devices, where NVML has no per-process utilisation).",
            labels=labels,
        )
        memory = GaugeMetricFamily(
            "elastic_node_pod_gpu_memory_bytes", "GPU memory held by the pod's processes.", labels=labels
        )
        processes = GaugeMetricFamily(
            "elastic_node_pod_gpu_processes", "The pod's processes on a GPU.", labels=labels
        )
        outside_memory = GaugeMetricFamily(
            "elastic_node_unattributed_gpu_memory_bytes",
            "GPU memory held by processes in no pod (or gone from /proc).",
            labels=["node"],
        )
        outside_processes = GaugeMetricFamily(
            "elastic_node_unattributed_gpu_processes",
            "GPU processes in no pod (or gone from /proc).",
            labels=["node"],
        )
        nvml_up = GaugeMetricFamily(
            "elastic_node_nvml_up", "1 when NVML answered in the latest sample, else 0.", labels=["node"]
        )
        devices = GaugeMetricFamily("elastic_node_gpu_devices", "GPUs NVML lists.", labels=["node"])
        sampled = GaugeMetricFamily(
            "elastic_node_last_sample_timestamp_seconds", "When the latest sample was taken.", labels=["node"]
        )
        duration = GaugeMetricFamily(
            "elastic_node_sample_duration_seconds", "How long the latest sample took.", labels=["node"]
        )
        if sample is not None:
            node = sample.node
            for uid, pod in sorted(sample.pods.items()):
                values = [node, uid, pod.kernel_id or ""]
                if pod.gpu_utilization is not None:
                    utilization.add_metric(values, pod.gpu_utilization)
                memory.add_metric(values, pod.gpu_memory_mib * _MIB)
                processes.add_metric(values, len(pod.pids))
            outside = sample.unattributed
            outside_memory.add_metric([node], outside.gpu_memory_mib * _MIB)
            outside_processes.add_metric([node], len(outside.pids) + len(outside.missing_pids))
            nvml_up.add_metric([node], 0 if sample.error else 1)
            devices.add_metric([node], len(sample.devices))
            sampled.add_metric([node], sample.sampled_at)
            duration.add_metric([node], sample.duration_seconds)
        yield from (
            utilization,
            memory,
            processes,
            outside_memory,
            outside_processes,
            nvml_up,
            devices,
            sampled,
            duration,
        )


def render(latest: Callable[[], NodeSample | None]) -> bytes:
    """The exposition text for the sample ``latest`` returns."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SampleCollector(latest))
    return generate_latest(registry)
