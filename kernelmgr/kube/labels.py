"""The labels of kernel pods, warm pods, kept failed pods and their Secrets; and how to read them.

Kubernetes' recommended labels say whose a pod is (``app.kubernetes.io/name``, ``/instance``: the
Helm release, ``/component``: ``kernel``, ``warm-kernel`` or ``kernel-failed``); the project's own
prefixed labels say which kernel and whose (``elastic.jupyter.org/kernel-id``, ``/owner``), so an
admin can ``kubectl get pods -l elastic.jupyter.org/owner=alice``. Never Enterprise Gateway's bare
``component: kernel`` and ``kernel_id``: a NetworkPolicy or a watch selecting those selects EG's kernels
in a shared namespace too, and two releases in one namespace would see each other's pods.

Versions up to 0.x labelled pods with exactly those bare labels. Their pods (and Secrets) are still
running after an upgrade and must be adopted: :func:`kernel_id_of` reads both generations, the pod
watch's :data:`KERNEL_WATCH_SELECTOR` matches both, and nothing writes the old labels any more.
A kept legacy failed pod gets the new labels and loses the old ones; legacy warm pods are deleted at
start like any warm pod an earlier server left.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

NAME_LABEL = "app.kubernetes.io/name"
NAME = "jupyter-elastic-kernels"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
KERNEL_ID_LABEL = "elastic.jupyter.org/kernel-id"
#: The owner as a label value (:func:`label_value`); the exact name is the owner annotation.
OWNER_LABEL = "elastic.jupyter.org/owner"
#: The Helm release's name; outside Helm the project's name.
DEFAULT_INSTANCE = "jupyter-elastic-kernels"

KERNEL = "kernel"
WARM_KERNEL = "warm-kernel"
FAILED_KERNEL = "kernel-failed"

#: What versions up to 0.x wrote (read only, for pods started before an upgrade).
LEGACY_COMPONENT_LABEL = "component"
LEGACY_KERNEL_ID_LABEL = "kernel_id"

#: The kernel pod watch: both generations of kernel pods (and warm pods, which the watch does not
#: keep until a kernel takes one), never a kept failed pod: relabelling a failed pod must take it out
#: of the watch (the API server then sends DELETED). Which pods are this release's kernels is
#: :func:`kernel_id_of`'s decision.
KERNEL_WATCH_SELECTOR = (
    f"{NAME_LABEL}={NAME},{COMPONENT_LABEL} notin ({FAILED_KERNEL}),"
    f"{LEGACY_COMPONENT_LABEL} notin ({FAILED_KERNEL})"
)
#: Every object of the project's (both generations): filtered by :func:`component_of` and the instance.
PROJECT_SELECTOR = f"{NAME_LABEL}={NAME}"

_INVALID = re.compile(r"[^A-Za-z0-9_.-]+")
_EDGES = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
MAX_VALUE = 63


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 of ``[A-Za-z0-9_.-]``, alphanumeric at both ends).

    Kept as it is when it already is one; else every run of other characters becomes ``-`` and 8 hex
    digits of its SHA-256 are added, so ``alice@x.org`` and ``alice-x.org`` get different labels.
    """
    if len(text) <= MAX_VALUE and not _INVALID.search(text) and not _EDGES.search(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    head = _EDGES.sub("", _INVALID.sub("-", text)[: MAX_VALUE - len(digest) - 1])
    return f"{head}-{digest}" if head else digest


def common_labels(instance: str, component: str) -> dict[str, str]:
    """The labels every object the server makes carries."""
    return {NAME_LABEL: NAME, INSTANCE_LABEL: instance, COMPONENT_LABEL: component}


def kernel_labels(instance: str, kernel_id: str, owner: str) -> dict[str, str]:
    """A kernel pod's (and its Secret's) labels."""
    return {**common_labels(instance, KERNEL), KERNEL_ID_LABEL: kernel_id, OWNER_LABEL: label_value(owner)}


def component_of(labels: Mapping[str, str] | None, instance: str) -> str | None:
    """``kernel``, ``warm-kernel`` or ``kernel-failed`` for an object of this release (or a legacy one,
    which had no release); ``None`` for anything else (another release's, EG's, the gateway)."""
    labels = labels or {}
    if labels.get(NAME_LABEL) != NAME:
        return None
    if COMPONENT_LABEL in labels:
        return labels[COMPONENT_LABEL] if labels.get(INSTANCE_LABEL) == instance else None
    return labels.get(LEGACY_COMPONENT_LABEL)


def kernel_id_of(labels: Mapping[str, str] | None, instance: str) -> str | None:
    """The kernel id of a kernel pod or Secret of this release (either generation), else ``None``."""
    if component_of(labels, instance) != KERNEL:
        return None
    labels = labels or {}
    if COMPONENT_LABEL in labels:
        return labels.get(KERNEL_ID_LABEL) or None
    return labels.get(LEGACY_KERNEL_ID_LABEL) or None


def selector(instance: str, component: str) -> str:
    """The label selector of this release's objects of ``component``."""
    return ",".join(f"{k}={v}" for k, v in common_labels(instance, component).items())


def legacy_selector(component: str) -> str:
    """The label selector of the objects of ``component`` an earlier version made (bare labels)."""
    return f"{NAME_LABEL}={NAME},{LEGACY_COMPONENT_LABEL}={component},!{COMPONENT_LABEL}"


def relabel(labels: Mapping[str, str] | None, new: Mapping[str, str]) -> dict[str, str | None]:
    """A merge patch's labels that turn ``labels`` into ``new``: the legacy ones removed."""
    patch: dict[str, str | None] = dict(new)
    for legacy in (LEGACY_COMPONENT_LABEL, LEGACY_KERNEL_ID_LABEL):
        if legacy in (labels or {}):
            patch[legacy] = None
    return patch
