"""Where kernel pods may land, as kube-scheduler filters nodes: their node selector and tolerations.

The node inventory (:mod:`kernelmgr.kube.nodes`) closes the devices of a node kernel pods cannot
land on, so the allocator never answers "fits" for a GPU the scheduler would not give a kernel.
A pod that fit nowhere and waited for a new node books its GPU where the scheduler put it
(:func:`book_where_placed`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
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


async def book_where_placed(
    runtime: Any, holder: str, profile: Any, node: str, within: float, log: Any
) -> Any:
    """Book ``holder``'s ``profile`` on ``node``, where kube-scheduler placed a pod that had no slice
    (``ElasticKernels.scale_up_wait``): the scheduler decided, the server books what it decided.

    A node the autoscaler just added may reach the scheduler before this server's node watch:
    tried again, every half second, for ``within`` seconds; ``None`` (logged) if it never fits
    this view, and the pod runs unbooked rather than be killed for a view that lags.
    """
    deadline = time.monotonic() + within
    while True:
        granted = runtime.allocator.occupy(holder, profile, node)
        if granted is not None:
            log.info("%s: slice booked on %s, the node its pod was placed on", holder, node)
            return granted
        if time.monotonic() >= deadline:
            log.warning(
                "%s: its pod was placed on node %s, where this server counts no room for size %s "
                "after %g s; it runs without a booked slice",
                holder,
                node,
                profile.name,
                within,
            )
            return None
        await asyncio.sleep(0.5)
