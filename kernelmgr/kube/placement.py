"""Where kernel pods may land, as kube-scheduler filters nodes: their node selector and tolerations.

The node inventory (:mod:`kernelmgr.kube.nodes`) closes the devices of a node kernel pods cannot
land on, so the allocator never answers "fits" for a GPU the scheduler would not give a kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kernelmgr.kube.fields import field_of as _field


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where kernel pods may land, as kube-scheduler filters nodes: their ``nodeSelector`` and
    tolerations (those of the pod manifest, node-lost ones included)."""

    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    def admits(self, node: Any) -> bool:
        """The node's labels match the selector and every NoSchedule/NoExecute taint is tolerated
        (PreferNoSchedule only steers the scheduler: it does not filter)."""
        labels = _field(_field(node, "metadata"), "labels") or {}
        if any(labels.get(key) != value for key, value in self.node_selector.items()):
            return False
        for taint in _field(_field(node, "spec"), "taints") or ():
            effect = _field(taint, "effect")
            if effect in ("NoSchedule", "NoExecute") and not any(
                _tolerates(toleration, taint) for toleration in self.tolerations
            ):
                return False
        return True


def _tolerates(toleration: Mapping[str, Any], taint: Any) -> bool:
    """Kubernetes' rule: same effect (or none named), same key (or none named with ``Exists``),
    and ``Exists``, or ``Equal`` (the default) with the same value."""
    effect = toleration.get("effect") or ""
    if effect and effect != _field(taint, "effect"):
        return False
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if not key:
        return operator == "Exists"
    if key != _field(taint, "key"):
        return False
    return operator == "Exists" or (toleration.get("value") or "") == (_field(taint, "value") or "")
