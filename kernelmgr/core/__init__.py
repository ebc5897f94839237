"""The core model: GPU sizes, the inventory, the slice allocator and the kernel lifecycle.

Pure Python. Nothing in this package imports tornado, jupyter_server, jupyter_client,
kubernetes or traitlets (``tests/test_architecture.py`` enforces it), so the model can be
reasoned about and tested on its own, and every adapter depends on it rather than the reverse.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names for type checkers, which do not run __getattr__
    from kernelmgr.core.allocator import (
        DeviceUsage,
        InventoryChange,
        Placement,
        Slice,
        SliceAllocator,
        describe_size,
    )
    from kernelmgr.core.errors import (
        CapacityError,
        ConfigError,
        ElasticError,
        InvalidTransitionError,
        UnknownProfileError,
    )
    from kernelmgr.core.inventory import GpuDevice, GpuInventory
    from kernelmgr.core.lifecycle import KernelState, Lifecycle
    from kernelmgr.core.profiles import GpuProfile, parse_profiles

# Public names, imported on first use (PEP 562): the in-kernel checkpoint agent imports
# kernelmgr.core.errors and kernelmgr.core.manifest at every kernel start and resume, and
# importing the allocator, inventory, profiles and lifecycle with them cost ~10 ms there.
_HOMES = {
    "DeviceUsage": "allocator",
    "InventoryChange": "allocator",
    "Placement": "allocator",
    "Slice": "allocator",
    "SliceAllocator": "allocator",
    "describe_size": "allocator",
    "CapacityError": "errors",
    "ConfigError": "errors",
    "ElasticError": "errors",
    "InvalidTransitionError": "errors",
    "UnknownProfileError": "errors",
    "GpuDevice": "inventory",
    "GpuInventory": "inventory",
    "KernelState": "lifecycle",
    "Lifecycle": "lifecycle",
    "GpuProfile": "profiles",
    "parse_profiles": "profiles",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CapacityError",
    "ConfigError",
    "DeviceUsage",
    "ElasticError",
    "GpuDevice",
    "GpuInventory",
    "GpuProfile",
    "InvalidTransitionError",
    "InventoryChange",
    "KernelState",
    "Lifecycle",
    "Placement",
    "Slice",
    "SliceAllocator",
    "UnknownProfileError",
    "describe_size",
    "parse_profiles",
]
