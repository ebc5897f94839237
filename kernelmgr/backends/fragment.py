"""``PodFragment``: what a Kubernetes slice backend adds to a kernel pod.

A backend never sees or builds the whole pod. The pod template belongs to the operator (image,
volumes, security context, service account); the backend only knows how to ask its GPU
mechanism for one size. Keeping the two apart means the same template works with every
mechanism, and a backend can be tested by rendering alone.

``apply_to`` is the one place where the two meet. It works on a deep copy, so a template that
the provisioner reuses for every kernel can never pick up one kernel's GPU request, and it
refuses to guess when the named container is missing: a GPU request put on the wrong
container (or silently dropped) would give the kernel either no GPU or a GPU nobody accounts
for.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


def _frozen(mapping: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class PodFragment:
    """Pod-spec pieces that request one GPU size from one mechanism.

    Quantities are strings, as Kubernetes writes them (``"3000"``, ``"1"``). Mappings are
    read-only views and claim/side-object dicts are copied on ``apply_to``, so a fragment can
    be cached and shared between kernels of the same size.
    """

    #: Container ``resources.limits`` (extended resources are limit-only; requests follow).
    limits: Mapping[str, str] = field(default_factory=dict)
    #: Merged into ``metadata.annotations`` of the pod.
    annotations: Mapping[str, str] = field(default_factory=dict)
    #: Merged into ``metadata.labels`` of the pod.
    labels: Mapping[str, str] = field(default_factory=dict)
    #: ``spec.schedulerName``; ``None`` leaves the pod's own value alone.
    scheduler_name: str | None = None
    #: Environment variables for the container (replacing same-named entries).
    env: Mapping[str, str] = field(default_factory=dict)
    #: Merged into ``spec.nodeSelector``.
    node_selector: Mapping[str, str] = field(default_factory=dict)
    #: ``spec.resourceClaims`` entries (DRA).
    pod_resource_claims: tuple[dict[str, Any], ...] = ()
    #: ``containers[].resources.claims`` entries (DRA).
    container_claims: tuple[dict[str, Any], ...] = ()
    #: Objects to create beside the pod (e.g. a ``ResourceClaimTemplate``), namespace unset.
    side_objects: tuple[dict[str, Any], ...] = ()
    #: Env names removed from the container because they would defeat the mechanism.
    forbidden_env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("limits", "annotations", "labels", "env", "node_selector"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        overlap = sorted(set(self.env) & set(self.forbidden_env))
        if overlap:
            raise ValueError(f"PodFragment sets and forbids the same env variables: {', '.join(overlap)}")

    def apply_to(self, pod: Mapping[str, Any], container: str = "kernel") -> dict[str, Any]:
        """Return a new pod manifest with this fragment merged into ``container``.

        The input is left untouched. Fragment values win over the pod's on the same key:
        limits, env, node selector, labels, annotations, scheduler name, and claims with the
        same ``name``. If the container already has ``resources.requests`` for one of the
        fragment's resources, that request is set to the limit, because Kubernetes rejects an
        extended-resource request that differs from its limit.
        """
        new: dict[str, Any] = copy.deepcopy(dict(pod))
        spec = new.get("spec")
        if not isinstance(spec, dict) or not isinstance(spec.get("containers"), list):
            raise ValueError("pod manifest has no spec.containers list to apply the GPU size to")
        containers: list[Any] = spec["containers"]
        target = next((c for c in containers if isinstance(c, dict) and c.get("name") == container), None)
        if target is None:
            names = ", ".join(repr(c.get("name")) for c in containers if isinstance(c, dict)) or "none"
            raise ValueError(
                f"pod manifest has no container named {container!r} to apply the GPU size to "
                f"(containers: {names})"
            )

        metadata = new.setdefault("metadata", {})
        if self.labels:
            metadata["labels"] = {**(metadata.get("labels") or {}), **self.labels}
        if self.annotations:
            metadata["annotations"] = {**(metadata.get("annotations") or {}), **self.annotations}

        if self.scheduler_name is not None:
            spec["schedulerName"] = self.scheduler_name
        if self.node_selector:
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **self.node_selector}
        if self.pod_resource_claims:
            spec["resourceClaims"] = _merge_named(spec.get("resourceClaims"), self.pod_resource_claims)

        resources = target.setdefault("resources", {})
        if self.limits:
            resources["limits"] = {**(resources.get("limits") or {}), **self.limits}
            requests = resources.get("requests")
            if requests:
                resources["requests"] = {key: self.limits.get(key, value) for key, value in requests.items()}
        if self.container_claims:
            resources["claims"] = _merge_named(resources.get("claims"), self.container_claims)
        if not resources:
            del target["resources"]

        dropped = set(self.forbidden_env) | set(self.env)
        if dropped:
            kept = [
                e for e in target.get("env") or [] if not (isinstance(e, dict) and e.get("name") in dropped)
            ]
            kept.extend({"name": name, "value": value} for name, value in self.env.items())
            if kept:
                target["env"] = kept
            else:
                target.pop("env", None)
        return new


def _merge_named(existing: Any, added: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Append ``added`` entries to a list of ``{"name": ...}`` dicts, replacing same names."""
    names = {entry["name"] for entry in added}
    kept = [e for e in existing or [] if not (isinstance(e, dict) and e.get("name") in names)]
    return kept + [copy.deepcopy(entry) for entry in added]
