"""The GPU inventory: which devices exist and how big they are.

Devices are declared by the admin (``ElasticKernels.gpu_inventory``), discovered through NVML,
or (on Kubernetes) read from the cluster's Node objects by an adapter; either way they end up as
:class:`GpuDevice` records here. An inventory is an immutable snapshot: when the cluster changes,
the adapter builds a new one and hands it to :meth:`SliceAllocator.replace_inventory
<kernelmgr.core.allocator.SliceAllocator.replace_inventory>`, which owns all mutable state about
who holds what and reconciles it with the new snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kernelmgr.core.errors import ConfigError

_KNOWN_KEYS = {"uuid", "name", "memory_mib", "index", "node"}


@dataclass(frozen=True)
class GpuDevice:
    """One GPU (or MIG device) that slices are carved from.

    ``node`` is empty in local mode; on Kubernetes it names the node the device lives on.
    ``resource`` names what hands the device out on that platform (the Kubernetes extended
    resource, e.g. ``nvidia.com/gpu`` or ``nvidia.com/mig-1g.10gb``); empty means "any size may
    be placed here". An ``exclusive`` device holds at most one slice, whatever its size, and
    that slice takes all of it: a MIG instance is handed to one pod whole. A ``closed`` device
    takes no new slice but keeps the ones it has: its node is cordoned, and the kernels there run on.
    """

    uuid: str
    name: str
    memory_mib: int
    index: int
    node: str = ""
    resource: str = ""
    exclusive: bool = False
    closed: bool = False
    #: GPU sizes whose pods may not land here (their own node selector, affinity or tolerations
    #: leave this node out, kernelmgr.kube.placement); the other sizes may.
    refused_sizes: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "name": self.name,
            "memory_mib": self.memory_mib,
            "index": self.index,
            "node": self.node,
            "resource": self.resource,
            "exclusive": self.exclusive,
            "closed": self.closed,
            **({"refused_sizes": sorted(self.refused_sizes)} if self.refused_sizes else {}),
        }


def parse_device(position: int, raw: Mapping[str, Any]) -> GpuDevice:
    """Validate one declared device."""
    where = f"ElasticKernels.gpu_inventory[{position}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be an object with uuid, name and memory_mib, got {raw!r}")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}: unknown key; allowed keys are {', '.join(sorted(_KNOWN_KEYS))}"
        )
    for key in ("uuid", "name"):
        value = raw.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}.{key}: required, a non-empty string (got {value!r})")
    memory = raw.get("memory_mib")
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise ConfigError(f"{where}.memory_mib: required, a positive integer number of MiB (got {memory!r})")
    index = raw.get("index", position)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigError(f"{where}.index: must be a non-negative integer (got {index!r})")
    node = raw.get("node", "")
    if not isinstance(node, str):
        raise ConfigError(f"{where}.node: must be a string (got {node!r})")
    return GpuDevice(uuid=raw["uuid"], name=raw["name"], memory_mib=memory, index=index, node=node)


class GpuInventory:
    """An ordered, immutable set of devices with unique UUIDs.

    ``source`` records where the devices came from ("declared", "nvml", "kubernetes" or "none")
    and ``note`` says why, so the API can tell an admin plainly why no GPU sizes are offered.
    """

    def __init__(self, devices: Iterable[GpuDevice], source: str, note: str = "") -> None:
        self.devices: tuple[GpuDevice, ...] = tuple(devices)
        seen: set[str] = set()
        for device in self.devices:
            if device.uuid in seen:
                raise ConfigError(f"ElasticKernels.gpu_inventory: device uuid {device.uuid!r} appears twice")
            seen.add(device.uuid)
        self.source = source
        self.note = note

    @classmethod
    def declared(cls, raw: Sequence[Mapping[str, Any]]) -> GpuInventory:
        if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
            raise ConfigError(f"ElasticKernels.gpu_inventory must be a list of devices, got {raw!r}")
        devices = [parse_device(i, entry) for i, entry in enumerate(raw)]
        return cls(
            devices,
            source="declared",
            note=f"{len(devices)} device(s) declared in ElasticKernels.gpu_inventory",
        )

    def replaced(self, devices: Iterable[GpuDevice], note: str | None = None) -> GpuInventory:
        """A new snapshot from the same source with other devices (and, optionally, another note)."""
        return GpuInventory(devices, source=self.source, note=self.note if note is None else note)

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[GpuDevice]:
        return iter(self.devices)

    def by_uuid(self, uuid: str) -> GpuDevice:
        for device in self.devices:
            if device.uuid == uuid:
                return device
        raise KeyError(uuid)
