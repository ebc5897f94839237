"""``ElasticKernels.warm_pool``: validated into :class:`WarmPoolSettings`, one per base kernel.

    c.ElasticKernels.warm_pool = {
        "python3": {"size": 2, "preload": ["torch"], "memory_mib": 4096, "starts": False},
    }

``size`` warm processes per base kernelspec (they serve every GPU size of it: a warm process
holds no slice), ``preload`` the modules they import, ``memory_mib`` the most resident memory
all of that pool's processes may use together (the pool stops refilling above it), ``starts``
whether new kernels take a warm process too (resumes always do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KEY = "ElasticKernels.warm_pool"
FIELDS = ("size", "preload", "memory_mib", "starts")


class WarmPoolConfigError(ValueError):
    """One line naming the key to fix."""


@dataclass(frozen=True)
class WarmPoolSettings:
    base_kernel: str
    size: int = 1
    preload: tuple[str, ...] = ()
    memory_mib: int = 8192
    starts: bool = False


def _module_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and all(part.isidentifier() for part in value.split("."))


def check_entry(entry: Any, where: str, fields: tuple[str, ...], error: type[ValueError]) -> dict[str, Any]:
    """``entry`` as a dict of known keys; ``error`` naming ``where`` otherwise. Shared with the
    Kubernetes warm pods' setting (:mod:`kernelmgr.kube.warm_pods`), which has the same fields."""
    if not isinstance(entry, dict):
        raise error(f"{where} must be a dict with keys {', '.join(fields)}")
    unknown = sorted(set(entry) - set(fields))
    if unknown:
        raise error(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(fields)}")
    return entry


def read_count(entry: dict[str, Any], key: str, where: str, error: type[ValueError]) -> int:
    value = entry.get(key, 1)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 64:
        raise error(f"{where}.{key} must be an integer from 0 to 64, got {value!r}")
    return value


def read_preload(entry: dict[str, Any], where: str, error: type[ValueError]) -> tuple[str, ...]:
    preload = entry.get("preload", [])
    if not isinstance(preload, list) or not all(_module_name(m) for m in preload):
        raise error(f'{where}.preload must be a list of module names, e.g. ["torch"], got {preload!r}')
    return tuple(preload)


def read_starts(entry: dict[str, Any], where: str, error: type[ValueError]) -> bool:
    starts = entry.get("starts", False)
    if not isinstance(starts, bool):
        raise error(f"{where}.starts must be true or false, got {starts!r}")
    return starts


def parse_warm_pool(raw: Any, base_kernels: list[str]) -> dict[str, WarmPoolSettings]:
    """Validate the whole setting; raises :class:`WarmPoolConfigError` at the first mistake."""
    if not isinstance(raw, dict):
        raise WarmPoolConfigError(f"{KEY} must be a dict of base kernelspec name to settings")
    pools: dict[str, WarmPoolSettings] = {}
    for base, entry in raw.items():
        where = f"{KEY}[{base!r}]"
        if base not in base_kernels:
            raise WarmPoolConfigError(
                f"{where}: {base!r} is not in ElasticKernels.base_kernels ({', '.join(base_kernels)})"
            )
        entry = check_entry(entry, where, FIELDS, WarmPoolConfigError)
        size = read_count(entry, "size", where, WarmPoolConfigError)
        preload = read_preload(entry, where, WarmPoolConfigError)
        memory = entry.get("memory_mib", 8192)
        if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
            raise WarmPoolConfigError(f"{where}.memory_mib must be a positive integer (MiB), got {memory!r}")
        starts = read_starts(entry, where, WarmPoolConfigError)
        pools[base] = WarmPoolSettings(base, size, preload, memory, starts)
    return pools
