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
        if not isinstance(entry, dict):
            raise WarmPoolConfigError(f"{where} must be a dict with keys {', '.join(FIELDS)}")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise WarmPoolConfigError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(FIELDS)}")
        size = entry.get("size", 1)
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= 64:
            raise WarmPoolConfigError(f"{where}.size must be an integer from 0 to 64, got {size!r}")
        preload = entry.get("preload", [])
        if not isinstance(preload, list) or not all(_module_name(m) for m in preload):
            raise WarmPoolConfigError(
                f'{where}.preload must be a list of module names, e.g. ["torch"], got {preload!r}'
            )
        memory = entry.get("memory_mib", 8192)
        if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
            raise WarmPoolConfigError(f"{where}.memory_mib must be a positive integer (MiB), got {memory!r}")
        starts = entry.get("starts", False)
        if not isinstance(starts, bool):
            raise WarmPoolConfigError(f"{where}.starts must be true or false, got {starts!r}")
        pools[base] = WarmPoolSettings(base, size, tuple(preload), memory, starts)
    return pools
