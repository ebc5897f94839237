"""The user's files in their kernel pods: volumes per owner, HOME, and the notebook's working directory.

In a z2jh deployment the notebook lives on the user's home volume beside their single-user server;
a kernel pod elsewhere sees none of it, and ``pd.read_csv("data.csv")`` fails. The admin lists the
volumes (``ElasticKubernetesProvisioner.user_volumes``): a claim by name template (``claim-{owner}``,
z2jh's) or any volume source, with ``{owner}`` in names and sub-paths, mounted into each of that
owner's kernel pods. One of them may hold HOME (``home_volume``), so ``pip install --user`` and
``~/.cache`` survive a hibernation. The working directory follows the notebook (``KERNEL_WORKING_DIR``,
which jupyter_server's GatewayClient sends, or the server's own ``cwd``), mapped from the single-user
server's ``notebook_root`` onto the home volume. Pure: plain values in, plain dicts out.
"""

from __future__ import annotations

import copy
import posixpath
import re
from collections.abc import Mapping
from typing import Any

#: A user volume ``home`` is the pod's volume ``user-home``: clear of the pod's own volumes' names.
VOLUME_PREFIX = "user-"
ENTRY_KEYS = ("name", "claimName", "volume", "mountPath", "subPath", "readOnly")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,56}[a-z0-9])?$")
#: The two ways a ReadWriteOnce home can work, named in ``home_access_mode``.
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")


def expand(value: Any, owner: str) -> Any:
    """``value`` with ``{owner}`` replaced in every string (``owner``: its DNS-1123 label form)."""
    if isinstance(value, str):
        return value.replace("{owner}", owner)
    if isinstance(value, Mapping):
        return {k: expand(v, owner) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v, owner) for v in value]
    return copy.deepcopy(value)


def user_volume_refusal(entries: Any, where: str, reserved_paths: tuple[str, ...]) -> str | None:
    """Why ``entries`` is not a list of user volumes, or ``None``."""
    if not isinstance(entries, list):
        return f"{where} must be a list of volumes, got {entries!r}"
    names: set[str] = set()
    for i, entry in enumerate(entries):
        here = f"{where}[{i}]"
        if not isinstance(entry, dict):
            return f"{here} must be an object with name, mountPath and claimName or volume, got {entry!r}"
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            return f"{here}.{unknown[0]}: unknown key; allowed keys are {', '.join(ENTRY_KEYS)}"
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name in names:
            return f"{here}.name must be a unique DNS-1123 label of at most 58 characters, got {name!r}"
        names.add(name)
        if ("claimName" in entry) == ("volume" in entry):
            return f"{here} needs one of claimName (e.g. 'claim-{{owner}}') or volume (a pod volume source)"
        if "claimName" in entry and (not isinstance(entry["claimName"], str) or not entry["claimName"]):
            return f"{here}.claimName must be a claim name (template), got {entry['claimName']!r}"
        if "volume" in entry and (not isinstance(entry["volume"], dict) or len(entry["volume"]) != 1):
            return (
                f'{here}.volume must be one volume source, e.g. {{"nfs": {{...}}}}, got {entry["volume"]!r}'
            )
        mount = entry.get("mountPath")
        if not isinstance(mount, str) or not mount.startswith("/"):
            return f"{here}.mountPath must be an absolute path, got {mount!r}"
        clash = [p for p in reserved_paths if _within(mount, p) or _within(p, mount)]
        if clash:
            return f"{here}.mountPath {mount!r} overlaps the kernel pod's own {clash[0]!r}"
        sub_path = entry.get("subPath", "")
        if not isinstance(sub_path, str) or sub_path.startswith("/") or ".." in sub_path.split("/"):
            return f"{here}.subPath must be a relative path without '..', got {sub_path!r}"
        if not isinstance(entry.get("readOnly", False), bool):
            return f"{here}.readOnly must be true or false"
    return None


def _within(path: str, root: str) -> bool:
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def user_mounts(
    entries: list[Mapping[str, Any]], owner: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod volumes and the container mounts of ``owner``'s volumes."""
    volumes, mounts = [], []
    for entry in entries:
        name = VOLUME_PREFIX + entry["name"]
        if "claimName" in entry:
            volumes.append(
                {"name": name, "persistentVolumeClaim": {"claimName": expand(entry["claimName"], owner)}}
            )
        else:
            volumes.append({"name": name, **expand(entry["volume"], owner)})
        mount: dict[str, Any] = {"name": name, "mountPath": entry["mountPath"]}
        if entry.get("subPath"):
            mount["subPath"] = expand(entry["subPath"], owner)
        if entry.get("readOnly"):
            mount["readOnly"] = True
        mounts.append(mount)
    return volumes, mounts


def working_dir(
    requested: str | None, notebook_root: str, home: str | None, entries: list[Mapping[str, Any]]
) -> str | None:
    """Where the kernel starts: the notebook's folder as the pod sees it, or ``None`` (the image's).

    ``requested`` is the single-user server's path (``KERNEL_WORKING_DIR``, or relative to its root);
    under ``notebook_root`` it maps onto ``home`` (the home volume's mountPath). Only a folder on one
    of the user's volumes is used: anything else would be a folder the pod does not have.
    """
    if not requested:
        return None
    if ".." in requested.split("/"):
        return None
    if home is not None:
        if not requested.startswith("/"):
            requested = posixpath.join(home, requested)
        elif notebook_root and _within(requested, notebook_root):
            rest = posixpath.relpath(posixpath.normpath(requested), posixpath.normpath(notebook_root))
            requested = home if rest == "." else posixpath.join(home, rest)
    path = posixpath.normpath(requested)
    if not path.startswith("/"):
        return None
    return path if any(_within(path, e["mountPath"]) for e in entries) else None


def home_pod_affinity(selector: Mapping[str, str], namespace: str, owner: str) -> dict[str, Any]:
    """The pod affinity that puts a kernel pod on the node of its owner's single-user pod (whose
    ReadWriteOnce home can be mounted on that node only)."""
    term: dict[str, Any] = {
        "labelSelector": {"matchLabels": {k: expand(v, owner) for k, v in selector.items()}},
        "topologyKey": "kubernetes.io/hostname",
    }
    if namespace:
        term["namespaces"] = [namespace]
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
