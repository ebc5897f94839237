"""GPU sizes ("profiles"): what a notebook user picks in the launcher.

A profile is the user-facing unit of GPU sharing. It says how much of a GPU a kernel gets
(a fraction of one device, or a whole number of devices) and how much GPU memory it may use.
How that is enforced is the job of a slice backend; the profile only names the backend and
carries its settings, so the same sizes work locally and on Kubernetes.

Profiles come from admin configuration (``ElasticKernels.profiles``), a mapping of name to a
plain dict, and are validated here with messages that say which key to fix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kernelmgr.core.errors import ConfigError

#: Kubernetes-side mechanisms a profile can name. Local mode always uses the local backend.
BACKENDS = ("whole", "mig", "shared", "hami", "volcano", "dra", "gpushare", "vcuda")

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
_KNOWN_KEYS = {
    "display_name",
    "gpu_fraction",
    "memory_mib",
    "compute_percent",
    "backend",
    "options",
    "queue_priority",
}


@dataclass(frozen=True)
class GpuProfile:
    """One GPU size.

    ``gpu_fraction`` is either a float in (0, 1) — a slice of one device — or a whole number
    ``n >= 1`` — ``n`` entire devices. ``memory_mib`` is the memory the kernel may use on each
    device it gets; for whole devices ``None`` means "all of it".
    """

    name: str
    display_name: str
    gpu_fraction: float
    memory_mib: int | None
    compute_percent: int
    backend: str
    options: Mapping[str, Any] = field(default_factory=dict)
    #: Kernels of a size with a higher priority are served first when several wait for a slice.
    queue_priority: int = 0

    @property
    def whole_gpus(self) -> int:
        """Number of entire devices this size takes (0 for a fractional slice)."""
        return int(self.gpu_fraction) if self.gpu_fraction >= 1 else 0

    @property
    def is_fractional(self) -> bool:
        return self.gpu_fraction < 1

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape used by the REST API and the CLI."""
        return {
            "name": self.name,
            "display_name": self.display_name,
            "gpu_fraction": self.gpu_fraction,
            "whole_gpus": self.whole_gpus,
            "memory_mib": self.memory_mib,
            "compute_percent": self.compute_percent,
            "backend": self.backend,
            "options": dict(self.options),
            "queue_priority": self.queue_priority,
        }


def _fail(name: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"ElasticKernels.profiles[{name!r}].{key}: {problem}")


def _parse_fraction(name: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise _fail(name, "gpu_fraction", f"must be a number, got {raw!r}")
    value = float(raw)
    if not math.isfinite(value) or value <= 0:
        raise _fail(name, "gpu_fraction", f"must be > 0, got {raw!r}")
    if value > 1 and not value.is_integer():
        raise _fail(
            name,
            "gpu_fraction",
            f"must be a fraction in (0, 1] or a whole number of GPUs (1, 2, ...), got {raw!r}",
        )
    return value


def _default_display_name(name: str, fraction: float, memory_mib: int | None) -> str:
    if memory_mib is not None:
        return f"GPU {name} ({memory_mib / 1024:g} GiB)"
    if fraction >= 1:
        count = int(fraction)
        return f"GPU {name} ({count} GPU{'s' if count > 1 else ''})"
    return f"GPU {name} ({fraction:.0%} of a GPU)"


def parse_profile(name: str, raw: Mapping[str, Any]) -> GpuProfile:
    """Validate one profile entry of the admin's configuration."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"ElasticKernels.profiles: size name {name!r} must be 1-32 lowercase letters, digits or '-' "
            "(it becomes part of kernelspec names and Kubernetes labels)"
        )
    if not isinstance(raw, Mapping):
        raise ConfigError(f"ElasticKernels.profiles[{name!r}] must be an object, got {raw!r}")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise _fail(name, unknown[0], f"unknown key; allowed keys are {', '.join(sorted(_KNOWN_KEYS))}")
    if "gpu_fraction" not in raw:
        raise _fail(name, "gpu_fraction", "is required (e.g. 0.25 for a quarter GPU, 1 for a whole GPU)")
    fraction = _parse_fraction(name, raw["gpu_fraction"])

    memory = raw.get("memory_mib")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
        raise _fail(name, "memory_mib", f"must be a positive integer number of MiB, got {memory!r}")
    if memory is None and fraction < 1:
        raise _fail(name, "memory_mib", "is required for a fractional GPU size (how much memory it may use)")

    compute = raw.get("compute_percent", max(1, min(100, round(fraction * 100))))
    if isinstance(compute, bool) or not isinstance(compute, int) or not 1 <= compute <= 100:
        raise _fail(name, "compute_percent", f"must be an integer from 1 to 100, got {compute!r}")

    backend = raw.get("backend", "whole" if fraction >= 1 else "hami")
    if backend not in BACKENDS:
        raise _fail(name, "backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "whole" and fraction < 1:
        raise _fail(
            name, "backend", "'whole' hands out entire GPUs; use gpu_fraction >= 1 or another backend"
        )

    options = raw.get("options", {})
    if not isinstance(options, Mapping):
        raise _fail(name, "options", f"must be an object, got {options!r}")

    display = raw.get("display_name") or _default_display_name(name, fraction, memory)
    if not isinstance(display, str):
        raise _fail(name, "display_name", f"must be a string, got {display!r}")

    priority = raw.get("queue_priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise _fail(
            name, "queue_priority", f"must be a whole number (higher is served first), got {priority!r}"
        )

    return GpuProfile(
        name=name,
        display_name=display,
        gpu_fraction=fraction,
        memory_mib=memory,
        compute_percent=compute,
        backend=backend,
        options=dict(options),
        queue_priority=priority,
    )


def parse_profiles(raw: Mapping[str, Any]) -> dict[str, GpuProfile]:
    """Validate the whole ``ElasticKernels.profiles`` mapping, keeping its order."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"ElasticKernels.profiles must be an object of name -> size, got {raw!r}")
    return {name: parse_profile(name, entry) for name, entry in raw.items()}
