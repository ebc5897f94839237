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
from collections.abc import Iterable, Mapping
from typing import Any

from kernelmgr.kube.fields import field_of as _field


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where kernel pods may land, as kube-scheduler filters nodes: their ``nodeSelector`` and
    tolerations (those of the pod manifest, node-lost ones included)."""

    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    #: ``affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms``:
    #: the node must match one of them (none: any node).
    node_terms: tuple[Mapping[str, Any], ...] = ()

    def admits(self, node: Any) -> bool:
        """The node's labels match the selector and the required node affinity, and every
        NoSchedule/NoExecute taint is tolerated (PreferNoSchedule only steers the scheduler)."""
        metadata = _field(node, "metadata")
        labels = _field(metadata, "labels") or {}
        if any(labels.get(key) != value for key, value in self.node_selector.items()):
            return False
        name = str(_field(metadata, "name") or "")
        if self.node_terms and not any(_term_matches(term, labels, name) for term in self.node_terms):
            return False
        for taint in _field(_field(node, "spec"), "taints") or ():
            effect = _field(taint, "effect")
            if effect in ("NoSchedule", "NoExecute") and not any(
                _tolerates(toleration, taint) for toleration in self.tolerations
            ):
                return False
        return True


def size_placements(template: Any, sizes: Iterable[str]) -> dict[str, Placement] | None:
    """Where each GPU size's pods may land (the global selector and tolerations plus the size's
    own, and its required node affinity, as :func:`~kernelmgr.kube.manifests.make_kernel_pod`
    puts them on the pod); ``None`` when no size has placement settings of its own (the global
    :class:`Placement` then says it for all)."""
    from kernelmgr.kube.manifests import tolerations

    names = list(sizes)
    own = {size: template.size_settings(size) for size in names}
    if not any(key in settings for settings in own.values() for key in PLACEMENT_KEYS):
        return None
    return {
        size: Placement(
            {**template.node_selector, **settings.get("nodeSelector", {})},
            tuple(tolerations(template, settings.get("tolerations", ()))),
            tuple(
                ((settings.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution", {})
                .get("nodeSelectorTerms", ())
            ),
        )
        for size, settings in own.items()
    }


#: The keys of a size's pod settings that decide where its pods may land.
PLACEMENT_KEYS = ("nodeSelector", "tolerations", "affinity")


def _term_matches(term: Mapping[str, Any], labels: Mapping[str, str], name: str) -> bool:
    """One node selector term: every expression on the labels and every field (``metadata.name``)
    matches; an empty term matches no node (as the scheduler reads it)."""
    expressions = [(e, labels) for e in term.get("matchExpressions") or ()]
    expressions += [(e, {"metadata.name": name}) for e in term.get("matchFields") or ()]
    return bool(expressions) and all(_expression_matches(e, values) for e, values in expressions)


def _expression_matches(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, operator = expression.get("key", ""), expression.get("operator", "")
    wanted = [str(v) for v in expression.get("values") or ()]
    present = key in labels
    value = labels.get(key, "")
    if operator == "In":
        return present and value in wanted
    if operator == "NotIn":
        return not present or value not in wanted
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(wanted) == 1:
        try:
            have, bound = int(value), int(wanted[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


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
