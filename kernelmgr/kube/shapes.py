"""What the watches keep of each object, cut from the API's JSON before it becomes a model.

The Kubernetes client turns every listed or watched object into its models, which costs about
6 ms and 80 KiB for a kernel pod, most of it the pod's spec (containers, variables, volumes) that
nothing here reads back: the server wrote it. A :class:`Shape` drops those parts from the plain
JSON first and builds the model from what is left: a tenth of the CPU and a third of the memory,
which is what bounds a watch of 10,000 kernel pods (docs/benchmarks.md, "Kernel pod watch memory").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client, watch

Raw = dict[str, Any]


@dataclass(frozen=True)
class Shape:
    """``slim`` cuts a plain JSON object down; ``model`` (a client model class) is built from it."""

    model: Any
    slim: Callable[[Raw], Raw]

    def build(self, raw: Raw) -> Any:
        return self.model.from_dict(self.slim(raw))


def _metadata(raw: Raw) -> Raw:
    """Metadata without ``managedFields`` (a quarter of an object; nobody reads it)."""
    metadata = dict(raw.get("metadata") or {})
    metadata.pop("managedFields", None)
    return metadata


def kernel_pod(raw: Raw) -> Raw:
    """A kernel pod: metadata and status whole, of its spec only the node it runs on and each
    container's memory limit (what a kernel killed for running out of memory is told)."""
    spec = raw.get("spec") or {}
    containers = [
        {"name": c.get("name", ""), "resources": {"limits": {"memory": memory}}}
        for c in spec.get("containers") or ()
        if (memory := ((c.get("resources") or {}).get("limits") or {}).get("memory"))
    ]
    return {
        **raw,
        "metadata": _metadata(raw),
        "spec": {"containers": containers, "nodeName": spec.get("nodeName")},
    }


def gpu_pod(raw: Raw) -> Raw:
    """Any pod, for what it asks of GPUs: its node and its containers' resources."""
    spec = raw.get("spec") or {}

    def resources_only(containers: Any) -> list[Raw]:
        return [{"name": c.get("name", ""), "resources": c.get("resources") or {}} for c in containers or ()]

    slim_spec = {"containers": resources_only(spec.get("containers")), "nodeName": spec.get("nodeName")}
    if spec.get("initContainers"):
        slim_spec["initContainers"] = resources_only(spec["initContainers"])
    return {
        "metadata": _metadata(raw),
        "spec": slim_spec,
        "status": {"phase": (raw.get("status") or {}).get("phase")},
    }


def node(raw: Raw) -> Raw:
    """A node without its image list (often tens of KiB on a real node) and managed fields."""
    status = dict(raw.get("status") or {})
    status.pop("images", None)
    return {**raw, "metadata": _metadata(raw), "status": status}


KERNEL_POD = Shape(client.V1Pod, kernel_pod)
GPU_POD = Shape(client.V1Pod, gpu_pod)
NODE = Shape(client.V1Node, node)


class ShapedWatch(watch.Watch):
    """A watch whose events carry ``shape``'s models (the client would build whole ones)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape

    def unmarshal_event(self, data: str, return_type: Any) -> Raw | None:
        if not data or data.isspace():
            return None
        try:
            event: Raw = json.loads(data)
        except json.JSONDecodeError:
            return None
        event["raw_object"] = raw = event.get("object") or {}
        if event.get("type") in ("BOOKMARK", "ERROR"):
            version = (raw.get("metadata") or {}).get("resourceVersion") if isinstance(raw, dict) else None
            if version:
                self.resource_version = version
            return event
        event["object"] = built = self.shape.build(raw)
        self.resource_version = built.metadata.resource_version
        return event
