"""The core model: GPU sizes, the inventory, the slice allocator and the kernel lifecycle.

Pure Python. Nothing in this package imports tornado, jupyter_server, jupyter_client,
kubernetes or traitlets (``tests/test_architecture.py`` enforces it), so the model can be
reasoned about and tested on its own, and every adapter depends on it rather than the reverse.
"""

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
