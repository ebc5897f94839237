"""Per-user and per-group limits on GPU kernels, and the check a start or resume must pass.

Pure logic (no web framework), so the rules are tested on their own and read the same in the
gateway's handlers and in its resume admission. Three limits, each optional:

- ``profiles``: the GPU sizes a user may pick (their kernelspec list shows only these);
- ``max_kernels``: how many kernels a user may have, hibernated ones included (each one is a
  notebook's state the gateway keeps);
- ``max_gpu``: how much GPU a user may hold at once, as the sum of the sizes' GPU fractions of
  kernels that hold a slice; hibernated kernels hold none, so they do not count;
- ``max_checkpoint_bytes``: how much of the shared checkpoint store a user's checkpoints may
  take (bytes or a size such as ``"20Gi"``), checked before each hibernation writes anything.

The effective limits of a user: the defaults; then, for every group the user is in that sets a
limit, the most generous of those groups (a larger number, more sizes); then the user's own
entry, which wins outright. ``None`` means unlimited.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kernelmgr.core.errors import ConfigError
from kernelmgr.core.units import parse_bytes

LIMIT_KEYS = ("max_kernels", "max_gpu", "profiles", "max_checkpoint_bytes")


@dataclass(frozen=True)
class Limits:
    """What one user may hold; ``None`` in a field: no limit."""

    max_kernels: int | None = None
    max_gpu: float | None = None
    profiles: frozenset[str] | None = None
    max_checkpoint_bytes: int | None = None

    def allows_profile(self, profile: str | None) -> bool:
        """CPU kernels (no GPU size) are always allowed; GPU sizes only when listed."""
        return profile is None or self.profiles is None or profile in self.profiles


def parse_limits(where: str, raw: Any, known_profiles: Iterable[str]) -> dict[str, Any]:
    """Validate one configured entry; returns only the keys it sets. Raises :class:`ConfigError`."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a mapping of {', '.join(LIMIT_KEYS)}, not {raw!r}")
    unknown = sorted(set(raw) - set(LIMIT_KEYS))
    if unknown:
        raise ConfigError(f"{where} has unknown keys {unknown}; allowed: {', '.join(LIMIT_KEYS)}")
    parsed: dict[str, Any] = {}
    if "max_kernels" in raw:
        value = raw["max_kernels"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{where}.max_kernels must be a whole number >= 0 or null, not {value!r}")
        parsed["max_kernels"] = value
    if "max_gpu" in raw:
        value = raw["max_gpu"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
            raise ConfigError(f"{where}.max_gpu must be a number of GPUs >= 0 or null, not {value!r}")
        parsed["max_gpu"] = float(value) if value is not None else None
    if "max_checkpoint_bytes" in raw:
        value = raw["max_checkpoint_bytes"]
        parsed["max_checkpoint_bytes"] = parse_bytes(f"{where}.max_checkpoint_bytes", value)
    if "profiles" in raw:
        value = raw["profiles"]
        if value is not None:
            if not isinstance(value, list | tuple) or not all(isinstance(p, str) for p in value):
                raise ConfigError(f"{where}.profiles must be a list of GPU size names or null, not {value!r}")
            known = set(known_profiles)
            missing = sorted(set(value) - known)
            if missing:
                raise ConfigError(
                    f"{where}.profiles names unknown GPU sizes {missing}; sizes: {', '.join(sorted(known))}"
                )
            value = frozenset(value)
        parsed["profiles"] = value
    return parsed


def _more_generous(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return None
    if isinstance(a, frozenset):
        return a | b
    return max(a, b)


@dataclass(frozen=True)
class QuotaTable:
    """The admin's limits: defaults, per group, per user (each validated by :func:`parse_limits`)."""

    default: Mapping[str, Any]
    groups: Mapping[str, Mapping[str, Any]]
    users: Mapping[str, Mapping[str, Any]]

    def limits_for(self, user: str, groups: Iterable[str] = ()) -> Limits:
        values: dict[str, Any] = {key: self.default.get(key) for key in LIMIT_KEYS}
        from_groups: dict[str, Any] = {}
        for group in sorted(set(groups)):
            for key, value in self.groups.get(group, {}).items():
                from_groups[key] = _more_generous(from_groups[key], value) if key in from_groups else value
        values.update(from_groups)
        values.update(self.users.get(user, {}))
        return Limits(**values)


@dataclass(frozen=True)
class Holding:
    """What a user holds now: kernels (hibernated included) and GPU (sum of fractions of slices)."""

    kernels: int
    gpu: float


def refusal(
    limits: Limits, holding: Holding, profile: str | None, fraction: float, new_kernel: bool
) -> str | None:
    """Why a start (``new_kernel``) or a resume of a kernel of ``profile`` is over quota, or ``None``."""
    if not limits.allows_profile(profile):
        allowed = ", ".join(sorted(limits.profiles or ())) or "none"
        return f"GPU size {profile!r} is not offered to you; your sizes: {allowed}"
    if new_kernel and limits.max_kernels is not None and holding.kernels + 1 > limits.max_kernels:
        return (
            f"kernel quota reached: you have {holding.kernels} of {limits.max_kernels} kernels "
            "(hibernated ones included); shut one down first"
        )
    if limits.max_gpu is not None and fraction > 0 and holding.gpu + fraction > limits.max_gpu + 1e-9:
        return (
            f"GPU quota reached: your running kernels hold {holding.gpu:g} of {limits.max_gpu:g} GPU and "
            f"this size needs {fraction:g} more; hibernate or shut down a kernel first"
        )
    return None
