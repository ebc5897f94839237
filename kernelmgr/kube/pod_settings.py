"""Per-GPU-size pod settings and the global pod patch: checked as configuration, applied as plain dicts.

A "1x A100 80GB" size and a "1x L4" size differ in more than their GPU resources: image, cpu/memory,
the nodes they may use, their priority, the container runtime, a ``/dev/shm`` big enough for a
DataLoader's workers. Each size may carry those (``ElasticKubernetesProvisioner.size_pod_settings``,
keys named as the pod spec names them), and one strategic-merge patch (``pod_patch``) covers every
other field of every kernel pod. The checks here are the shape; the API server checks the values
at start-up (:mod:`kernelmgr.kube.dry_run`), so what it would refuse fails before the first kernel.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

#: Where a size's /dev/shm is mounted (a memory-backed emptyDir: it counts towards the memory limit).
SHM_MOUNT = "/dev/shm"
SHM_VOLUME = "dshm"

#: The keys one size's settings may carry.
SIZE_POD_KEYS = (
    "image",
    "resources",
    "priorityClassName",
    "nodeSelector",
    "affinity",
    "tolerations",
    "runtimeClassName",
    "imagePullSecrets",
    "shmSize",
    "ephemeralStorage",
)

#: The list fields strategic merge patches merge by a key rather than replace (as the API server's
#: Pod schema declares them: ``patchMergeKey``); every other list is replaced.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "resourceClaims": "name",
    "topologySpreadConstraints": "topologyKey",
}


def strategic_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` merged as ``kubectl patch --type strategic`` would (the subset a pod
    needs): maps merge, ``null`` removes a key, keyed lists merge item by item (an item with
    ``"$patch": "delete"`` removes its match), other lists and values replace. Inputs stay as they were."""
    merged = copy.deepcopy(dict(base))
    for key, value in patch.items():
        current = merged.get(key)
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(current, Mapping):
            merged[key] = strategic_merge(current, value)
        elif isinstance(value, list) and isinstance(current, list) and key in MERGE_KEYS:
            merged[key] = _merge_list(current, value, MERGE_KEYS[key])
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _merge_list(base: list[Any], patch: list[Any], key: str) -> list[Any]:
    merged = copy.deepcopy(base)
    for item in patch:
        if not isinstance(item, Mapping) or key not in item:
            merged.append(copy.deepcopy(item))
            continue
        at = next(
            (i for i, old in enumerate(merged) if isinstance(old, Mapping) and old.get(key) == item[key]),
            None,
        )
        if item.get("$patch") == "delete":
            if at is not None:
                del merged[at]
        elif at is None:
            merged.append(copy.deepcopy(dict(item)))
        else:
            merged[at] = strategic_merge(merged[at], item)
    return merged


def pull_secrets(raw: list[Any]) -> list[dict[str, str]]:
    """``imagePullSecrets`` as the pod spec wants them, from names or ``{"name": ...}`` items."""
    return [{"name": item} if isinstance(item, str) else {"name": item["name"]} for item in raw]


def quantity_refusal(value: Any, where: str) -> str | None:
    from kubernetes.utils.quantity import parse_quantity

    try:
        if isinstance(value, bool) or parse_quantity(value) <= 0:
            raise ValueError(value)
    except (ValueError, TypeError):
        return f"{where}: {value!r} is not a positive Kubernetes quantity (e.g. 1Gi, 512Mi)"
    return None


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


_SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "image": (lambda v: isinstance(v, str) and bool(v.strip()), "an image reference"),
    "priorityClassName": (lambda v: isinstance(v, str) and bool(v), "a PriorityClass name"),
    "runtimeClassName": (lambda v: isinstance(v, str) and bool(v), "a RuntimeClass name"),
    "nodeSelector": (_is_str_map, "a map of node label to value (strings)"),
    "affinity": (lambda v: isinstance(v, dict), "a pod spec affinity object"),
    "tolerations": (
        lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
        "a list of toleration objects",
    ),
    "imagePullSecrets": (
        lambda v: (
            isinstance(v, list)
            and all(isinstance(s, str) or (isinstance(s, dict) and isinstance(s.get("name"), str)) for s in v)
        ),
        'a list of Secret names (or {"name": ...} items)',
    ),
}


def size_pod_settings_refusal(
    raw: Any, where: str, resources_refusal: Callable[[Any, str], str | None]
) -> str | None:
    """Why ``raw`` is not one size's pod settings, or ``None`` (``where`` names it in the message)."""
    if not isinstance(raw, dict):
        return f"{where} must be an object with any of {', '.join(SIZE_POD_KEYS)}, got {raw!r}"
    for key, value in raw.items():
        here = f"{where}.{key}"
        if key not in SIZE_POD_KEYS:
            return (
                f"{here}: unknown key; allowed keys are {', '.join(SIZE_POD_KEYS)} (pod_patch sets the rest)"
            )
        if key == "resources":
            refusal = resources_refusal(value, here)
        elif key in ("shmSize", "ephemeralStorage"):
            refusal = quantity_refusal(value, here)
        else:
            check, wanted = _SHAPES[key]
            refusal = None if check(value) else f"{here} must be {wanted}, got {value!r}"
        if refusal is not None:
            return refusal
    return None


def pod_patch_refusal(raw: Any, where: str) -> str | None:
    """Why ``raw`` is not a patch of a pod (``{"metadata": {...}, "spec": {...}}``), or ``None``."""
    if not isinstance(raw, dict):
        return f'{where} must be a patch of the pod, {{"metadata": {{...}}, "spec": {{...}}}}, got {raw!r}'
    extra = sorted(set(raw) - {"metadata", "spec"})
    if extra:
        return f"{where}: only metadata and spec may be patched, not {', '.join(extra)}"
    for key, value in raw.items():
        if not isinstance(value, dict):
            return f"{where}.{key} must be an object, got {value!r}"
    return None


def allowed(name: str, names: list[str] | tuple[str, ...]) -> bool:
    """Whether ``name`` is in ``names`` (an entry ending in ``*`` is a prefix)."""
    return any(name.startswith(n[:-1]) if n.endswith("*") else name == n for n in names)


def kernel_environment(
    spec_env: Mapping[str, Any] | None, client_env: Mapping[str, Any] | None, allowed_names: list[str]
) -> dict[str, str]:
    """A kernel pod's own environment: what its kernelspec declares, then the client's ``KERNEL_*``
    variables that ``allowed_names`` lets through (Enterprise Gateway's convention; GatewayClient
    sends every ``KERNEL_*`` of the single-user server). Names the pod sets itself are refused later."""
    env = {str(k): str(v) for k, v in (spec_env or {}).items()}
    for name, value in (client_env or {}).items():
        if isinstance(value, str) and name.startswith("KERNEL_") and allowed(name, allowed_names):
            env[name] = value
    return env
