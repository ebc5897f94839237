"""Byte counts as people write and read them: ``10Gi`` in a configuration, ``1.5 GiB`` in a message."""

from __future__ import annotations

import re
from typing import Any

from kernelmgr.core.errors import ConfigError

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_FACTORS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def human_bytes(count: Any) -> str:
    """``80 B``, ``1.5 KiB``, ``300 MiB``, ``10 GiB``: at most three significant digits, never an
    exponent (a checkpoint of 80 bytes is not ``7.45058e-08 GiB``)."""
    if count is None:
        return "-"
    value = float(count)
    unit = 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(value)} B"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    text = f"{value:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text} {_UNITS[unit]}"


def parse_bytes(where: str, value: Any) -> int | None:
    """A byte count from a whole number or a Kubernetes-style size (``"10Gi"``, ``"500M"``);
    ``None`` stays ``None`` (no limit). Raises :class:`ConfigError` naming ``where``."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    factor = _FACTORS.get(match.group(2).lower()) if match else None
    if match is None or factor is None:
        raise ConfigError(
            f'{where} must be a number of bytes or a size such as "10Gi" or "500Mi", not {value!r}'
        )
    return int(float(match.group(1)) * factor)
