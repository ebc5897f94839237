"""Reading a Kubernetes object's field the same way whether it came as the client's model or as a
plain dict (tests, and manifests built here): snake_case attribute or camelCase key."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


def field_of(obj: Any, name: str) -> Any:
    """``obj.name``, or ``obj["name"]``/``obj["nameInCamelCase"]`` for a mapping; ``None`` if absent."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name)
        return obj.get(name, obj.get(camel))
    return getattr(obj, name, None)
