"""The slice allocator: places GPU sizes on devices and remembers who holds what.

Fractions are kept as integer thousandths of a device ("milli-GPUs") so that adding and
removing slices never drifts through floating-point error: three slices of 1/3 always free
exactly what they took. The allocator is the single owner of this state; callers hold no
references into it, and every public method takes one lock, so provisioners running on
different threads (or the event loop and a worker thread) cannot double-book a device.

Placement is deterministic: candidates are ranked by a key that ends in the device index,
so the same sequence of requests always yields the same placement (tests and operators can
predict it).

The inventory may change while kernels hold slices (on Kubernetes, nodes join, leave, are
cordoned or grow): :meth:`SliceAllocator.replace_inventory` swaps in a new snapshot under the
same lock as every other method, so it may be called from any thread (a watch thread calls it
directly). Slices on devices that are still there are kept as they are; a slice with any part
on a device that is gone is taken out whole and returned as *lost*, never kept on a phantom
device, so the caller can tell the kernel's owner and act on it (stop or hibernate the kernel).
A device that comes back later starts empty.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kernelmgr.core.errors import CapacityError, ConfigError
from kernelmgr.core.inventory import GpuDevice, GpuInventory
from kernelmgr.core.profiles import GpuProfile

MILLI = 1000
#: Devices listed at most in a "does not fit" message.
MAX_LISTED = 8
STRATEGIES = ("binpack", "spread")


def to_milli(fraction: float) -> int:
    """A fraction of one device in thousandths (at least 1, so tiny sizes still count)."""
    return max(1, min(MILLI, round(fraction * MILLI)))


@dataclass(frozen=True)
class Placement:
    """The part of one device that a slice holds."""

    device_uuid: str
    milli: int
    memory_mib: int

    @property
    def fraction(self) -> float:
        return self.milli / MILLI


#: Holders named ``warm:<name>`` are warm workloads (a Kubernetes warm pod) holding a slice ahead of
#: any kernel: shown as such, taken over by the kernel that uses one (:meth:`SliceAllocator.transfer`).
WARM_HOLDER_PREFIX = "warm:"
#: Holders of GPUs used by pods that are not kernels (Kubernetes): booked so that no kernel is
#: promised a GPU another workload has (:meth:`SliceAllocator.occupy`).
OTHER_POD_PREFIX = "pod:"


@dataclass(frozen=True)
class Slice:
    """What one kernel (or one warm workload waiting for a kernel) holds: a GPU size placed on one or
    more devices."""

    kernel_id: str
    profile: str
    placements: tuple[Placement, ...]

    @property
    def device_uuids(self) -> tuple[str, ...]:
        return tuple(p.device_uuid for p in self.placements)

    @property
    def warm(self) -> bool:
        """Held by a warm workload, not by a kernel yet."""
        return self.kernel_id.startswith(WARM_HOLDER_PREFIX)

    @property
    def other_pod(self) -> bool:
        """Held by a pod that is not a kernel (its GPUs are not free for kernels)."""
        return self.kernel_id.startswith(OTHER_POD_PREFIX)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel_id": self.kernel_id,
            "profile": self.profile,
            "warm": self.warm,
            "devices": [
                {"uuid": p.device_uuid, "fraction": p.fraction, "memory_mib": p.memory_mib}
                for p in self.placements
            ],
        }


@dataclass(frozen=True)
class InventoryChange:
    """What :meth:`SliceAllocator.replace_inventory` did.

    ``changed`` lists devices that stayed (same uuid) with another record (memory, name, ...);
    their slices are kept, even if the device now reports less than they hold (the workloads
    still run there; the device simply offers nothing until enough is released). ``lost``
    lists the slices that were on a removed device and are no longer held by anyone.
    """

    added: tuple[GpuDevice, ...] = ()
    removed: tuple[GpuDevice, ...] = ()
    changed: tuple[GpuDevice, ...] = ()
    lost: tuple[Slice, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.lost)


@dataclass(frozen=True)
class DeviceUsage:
    """A snapshot of one device: its capacity and the slices on it."""

    device: GpuDevice
    used_milli: int
    used_memory_mib: int
    slices: tuple[Slice, ...]

    @property
    def free_milli(self) -> int:
        return MILLI - self.used_milli

    @property
    def free_memory_mib(self) -> int:
        return self.device.memory_mib - self.used_memory_mib

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.device.to_dict(),
            "used_fraction": self.used_milli / MILLI,
            "free_fraction": self.free_milli / MILLI,
            "used_memory_mib": self.used_memory_mib,
            "free_memory_mib": self.free_memory_mib,
            "slices": [
                {
                    "kernel_id": s.kernel_id,
                    "profile": s.profile,
                    "warm": s.warm,
                    "fraction": p.fraction,
                    "memory_mib": p.memory_mib,
                }
                for s in self.slices
                for p in s.placements
                if p.device_uuid == self.device.uuid
            ],
        }


def describe_size(profile: GpuProfile) -> str:
    """``'small' (25% of a GPU, 10 GiB)`` — how sizes are named in messages."""
    if profile.whole_gpus:
        amount = f"{profile.whole_gpus} whole GPU{'s' if profile.whole_gpus > 1 else ''}"
    else:
        amount = f"{profile.gpu_fraction:.0%} of a GPU"
    if profile.memory_mib is not None:
        amount += f", {profile.memory_mib / 1024:g} GiB"
    return f"{profile.name!r} ({amount})"


class SliceAllocator:
    """Thread-safe placement of GPU sizes on an inventory, binpack or spread."""

    def __init__(
        self,
        inventory: GpuInventory,
        strategy: str = "binpack",
        profile_resource: Callable[[GpuProfile], str | None] | None = None,
    ) -> None:
        """``profile_resource`` (optional) names the platform resource a size is handed out as
        (see :attr:`GpuDevice.resource`); a size is then only placed on devices of that resource
        (or on devices with no resource). ``None`` from it, or no function, means any device.
        """
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"ElasticKernels.allocation_strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
            )
        self.inventory = inventory
        self.strategy = strategy
        self.profile_resource = profile_resource
        self._lock = threading.Lock()
        self._slices: dict[str, Slice] = {}
        self._used_milli: dict[str, int] = {d.uuid: 0 for d in inventory}
        self._used_memory: dict[str, int] = {d.uuid: 0 for d in inventory}
        #: TEST SEAM, ``None`` in production: called by :meth:`allocate` between choosing a
        #: placement and committing it (with the lock held). The check and the commit must be
        #: one step; a test sets this to hold a thread at exactly that point while a second
        #: thread tries to get there, so a missing or misplaced lock shows up as an overbooked
        #: device every time instead of once in a blue moon.
        self.before_commit: Callable[[], None] | None = None

    # -- queries ---------------------------------------------------------------------------

    def slice_of(self, kernel_id: str) -> Slice | None:
        with self._lock:
            return self._slices.get(kernel_id)

    def slices(self) -> list[Slice]:
        with self._lock:
            return list(self._slices.values())

    def usage(self) -> list[DeviceUsage]:
        with self._lock:
            return [self._usage_locked(d) for d in self.inventory]

    def fits(self, profile: GpuProfile, *, warm_gives_way: bool = False) -> bool:
        """Whether ``profile`` could be placed right now (with ``warm_gives_way``: once the warm
        slices are given back, as they are for any kernel that needs their GPU)."""
        with self._lock, self._warm_given_back_locked(warm_gives_way):
            return self._choose_locked(profile) is not None

    def check(self, profile: GpuProfile) -> None:
        """Raise :class:`CapacityError` saying why, if ``profile`` cannot start now.

        Warm slices count as free: a launch takes one of its size or has warm workloads give
        theirs back (:mod:`kernelmgr.kube.warm_pods`), so they never turn a user away.
        """
        with self._lock:
            with self._warm_given_back_locked(True):
                if self._choose_locked(profile) is not None:
                    return
            raise CapacityError(self._no_fit_message_locked(profile))

    def ever_fits(self, profile: GpuProfile) -> bool:
        """Whether ``profile`` could be placed on the current devices if they were empty."""
        devices = self._eligible_devices(profile)  # one snapshot: no lock needed
        if profile.whole_gpus:
            big_enough = [
                d for d in devices if profile.memory_mib is None or d.memory_mib >= profile.memory_mib
            ]
            per_node = Counter(d.node for d in big_enough)
            return any(count >= profile.whole_gpus for count in per_node.values())
        return any(d.memory_mib >= (profile.memory_mib or 0) for d in devices)

    # -- changes ---------------------------------------------------------------------------

    def allocate(self, kernel_id: str, profile: GpuProfile) -> Slice:
        """Place ``profile`` for ``kernel_id``, or raise :class:`CapacityError` saying why not.

        Idempotent for a kernel that already holds a slice of the same size (a restart that
        did not release first must not double-book); a different size is an error.
        """
        with self._lock:
            held = self._slices.get(kernel_id)
            if held is not None:
                if held.profile == profile.name:
                    return held
                raise CapacityError(
                    f"kernel {kernel_id} already holds a GPU slice of size {held.profile!r}; "
                    f"release it before asking for {profile.name!r}"
                )
            placements = self._choose_locked(profile)
            if placements is None:
                raise CapacityError(self._no_fit_message_locked(profile))
            if self.before_commit is not None:
                self.before_commit()
            granted = Slice(kernel_id=kernel_id, profile=profile.name, placements=tuple(placements))
            self._book_locked(granted, +1)
            self._slices[kernel_id] = granted
            return granted

    def release(self, kernel_id: str) -> Slice | None:
        """Free what ``kernel_id`` holds. Safe to call more than once."""
        with self._lock:
            granted = self._slices.pop(kernel_id, None)
            if granted is not None:
                self._book_locked(granted, -1)
            return granted

    def transfer(self, holder: str, kernel_id: str) -> Slice | None:
        """Hand what ``holder`` (a warm workload) holds to ``kernel_id``, on the same devices.

        A kernel that takes a warm pod takes the GPU that pod already has: booking a new slice
        would count the GPU twice. ``None`` when ``holder`` holds nothing (it was released meanwhile);
        raises :class:`CapacityError` when ``kernel_id`` already holds a slice.
        """
        with self._lock:
            if kernel_id in self._slices:
                raise CapacityError(f"kernel {kernel_id} already holds a GPU slice; it cannot take another")
            held = self._slices.pop(holder, None)
            if held is None:
                return None
            granted = Slice(kernel_id=kernel_id, profile=held.profile, placements=held.placements)
            self._slices[kernel_id] = granted
            return granted

    def move_to_node(self, kernel_id: str, profile: GpuProfile, node: str) -> Slice | None:
        """Book ``kernel_id``'s slice on devices of ``node``, where its workload actually runs.

        On Kubernetes the allocator picks devices when a kernel starts, but kube-scheduler binds
        the pod to whichever node fits; once it is bound, the booking follows the pod, so that
        ``/api/elastic/gpus`` names the right node and the next placement counts that node's
        GPUs as taken. Closed devices count (a pod can be bound to a node cordoned since). The
        slice already there is returned as it is; if ``node`` has no room in this allocator's
        view, the booking is kept and ``None`` returned (the caller logs the disagreement).
        """
        with self._lock:
            held = self._slices.get(kernel_id)
            if held is None:
                return None
            nodes = {d.uuid: d.node for d in self.inventory}
            if all(nodes.get(uuid) == node for uuid in held.device_uuids):
                return held
            self._book_locked(held, -1)
            placements = self._choose_locked(profile, node=node)
            if placements is None:
                self._book_locked(held, +1)
                return None
            moved = Slice(kernel_id=kernel_id, profile=held.profile, placements=tuple(placements))
            self._book_locked(moved, +1)
            self._slices[kernel_id] = moved
            return moved

    def occupy(self, holder: str, profile: GpuProfile, node: str) -> Slice | None:
        """Book what a workload running on ``node`` uses (a GPU pod that is not a kernel), closed
        devices included; ``None`` when ``node`` has no room left in this view."""
        with self._lock:
            held = self._slices.get(holder)
            if held is not None:
                return held
            placements = self._choose_locked(profile, node=node)
            if placements is None:
                return None
            granted = Slice(kernel_id=holder, profile=profile.name, placements=tuple(placements))
            self._book_locked(granted, +1)
            self._slices[holder] = granted
            return granted

    def replace_inventory(self, inventory: GpuInventory) -> InventoryChange:
        """Swap in a new snapshot of the devices and reconcile the slices with it.

        Thread-safe (one lock with every other method). Slices with any placement on a device
        that is not in ``inventory`` are released on all their devices and returned in
        :attr:`InventoryChange.lost`; nothing else changes for the other slices.
        """
        with self._lock:
            old = {d.uuid: d for d in self.inventory}
            new = {d.uuid: d for d in inventory}
            added = tuple(d for d in inventory if d.uuid not in old)
            removed = tuple(d for d in self.inventory if d.uuid not in new)
            changed = tuple(d for d in inventory if d.uuid in old and old[d.uuid] != d)
            gone = {d.uuid for d in removed}
            lost = tuple(s for s in self._slices.values() if gone.intersection(s.device_uuids))
            for granted in lost:
                del self._slices[granted.kernel_id]
            self._used_milli = {uuid: 0 for uuid in new}
            self._used_memory = {uuid: 0 for uuid in new}
            for granted in self._slices.values():
                for p in granted.placements:
                    self._used_milli[p.device_uuid] += p.milli
                    self._used_memory[p.device_uuid] += p.memory_mib
            self.inventory = inventory
            return InventoryChange(added=added, removed=removed, changed=changed, lost=lost)

    # -- internals (lock held) -------------------------------------------------------------

    def _book_locked(self, granted: Slice, sign: int) -> None:
        """Add (``+1``) or take away (``-1``) what ``granted`` holds on each of its devices."""
        for p in granted.placements:
            self._used_milli[p.device_uuid] += sign * p.milli
            self._used_memory[p.device_uuid] += sign * p.memory_mib

    @contextlib.contextmanager
    def _warm_given_back_locked(self, given_back: bool) -> Iterator[None]:
        """While inside, the warm slices' bookings are taken away (when ``given_back``)."""
        warm = [s for s in self._slices.values() if s.warm] if given_back else []
        for granted in warm:
            self._book_locked(granted, -1)
        try:
            yield
        finally:
            for granted in warm:
                self._book_locked(granted, +1)

    def _usage_locked(self, device: GpuDevice) -> DeviceUsage:
        on_device = tuple(s for s in self._slices.values() if device.uuid in s.device_uuids)
        return DeviceUsage(
            device=device,
            used_milli=self._used_milli[device.uuid],
            used_memory_mib=self._used_memory[device.uuid],
            slices=on_device,
        )

    def _eligible_devices(self, profile: GpuProfile, node: str | None = None) -> list[GpuDevice]:
        """The devices ``profile`` may be placed on (its resource asked once, not per device): the
        open ones that do not refuse the size, or with ``node`` that node's, closed ones included
        (the workload is there already)."""
        if node is None:
            inventory = [d for d in self.inventory if not d.closed and profile.name not in d.refused_sizes]
        else:
            inventory = [d for d in self.inventory if d.node == node]
        wanted = self.profile_resource(profile) if self.profile_resource is not None else None
        if wanted is None:
            return inventory
        return [d for d in inventory if not d.resource or d.resource == wanted]

    def _choose_locked(self, profile: GpuProfile, node: str | None = None) -> list[Placement] | None:
        if profile.whole_gpus:
            return self._choose_whole_locked(profile, node)
        need_memory = profile.memory_mib or 0

        def take(d: GpuDevice) -> tuple[int, int]:
            """(milli, MiB) the slice would hold on ``d``: all of an exclusive device."""
            if d.exclusive:
                return MILLI, d.memory_mib
            return to_milli(profile.gpu_fraction), need_memory

        candidates = [
            d
            for d in self._eligible_devices(profile, node)
            if d.memory_mib >= need_memory
            and (self._used_milli[d.uuid] == 0 if d.exclusive else True)
            and MILLI - self._used_milli[d.uuid] >= take(d)[0]
            and d.memory_mib - self._used_memory[d.uuid] >= take(d)[1]
        ]
        if not candidates:
            return None

        def remaining(d: GpuDevice) -> tuple[int, int, int]:
            milli, memory = take(d)
            free = MILLI - self._used_milli[d.uuid] - milli
            free_memory = d.memory_mib - self._used_memory[d.uuid] - memory
            if self.strategy == "binpack":
                return (free, free_memory, d.index)
            return (-free, -free_memory, d.index)

        best = min(candidates, key=remaining)
        milli, memory = take(best)
        return [Placement(device_uuid=best.uuid, milli=milli, memory_mib=memory)]

    def _choose_whole_locked(self, profile: GpuProfile, node: str | None = None) -> list[Placement] | None:
        empty = [
            d
            for d in self._eligible_devices(profile, node)
            if self._used_milli[d.uuid] == 0
            and (profile.memory_mib is None or d.memory_mib >= profile.memory_mib)
        ]
        # A kernel's GPUs are on one machine: one node (all local devices share the node "").
        by_node: dict[str, list[GpuDevice]] = {}
        for d in empty:
            by_node.setdefault(d.node, []).append(d)
        nodes = sorted(node for node, devices in by_node.items() if len(devices) >= profile.whole_gpus)
        if not nodes:
            return None
        chosen = sorted(by_node[nodes[0]], key=lambda d: d.index)[: profile.whole_gpus]
        return [Placement(device_uuid=d.uuid, milli=MILLI, memory_mib=d.memory_mib) for d in chosen]

    def _no_fit_message_locked(self, profile: GpuProfile) -> str:
        size = describe_size(profile)
        cluster = self.inventory.source == "kubernetes"
        if not len(self.inventory):
            where = "the cluster has no schedulable GPUs" if cluster else "this server has no GPUs"
            return (
                f"GPU size {size} cannot start: {where} "
                f"({self.inventory.note or 'none found'}). Start a CPU kernel instead."
            )
        eligible = self._eligible_devices(profile)
        if not self.ever_fits(profile):
            where = "the cluster's" if cluster else "this server's"
            devices = _capacity_summary(eligible) if eligible else "none of them hands out this size"
            return (
                f"GPU size {size} can never fit on {where} GPUs ({devices}). "
                "Pick a smaller size, or ask your admin to fix the size."
            )

        def free_milli(d: GpuDevice) -> int:
            return MILLI - self._used_milli[d.uuid]

        # The devices with the most room first (at most MAX_LISTED: a cluster has hundreds).
        shown = sorted(eligible, key=lambda d: (-free_milli(d), d.node, d.index))[:MAX_LISTED]
        shown.sort(key=lambda d: (d.node, d.index))
        free = "; ".join(
            f"{d.name} {d.uuid}: {free_milli(d) / MILLI:.0%} free, "
            f"{(d.memory_mib - self._used_memory[d.uuid]) / 1024:g} GiB free"
            for d in shown
        )
        if len(eligible) > len(shown):
            free += f" (the {len(shown)} with most room of {len(eligible)})"
        return (  # what to do first, the figures after: a cut-off dialog still says it
            f"GPU size {size} does not fit right now. "
            "Pick a smaller size, shut down (or hibernate) a GPU kernel you no longer need, "
            f"or try again later. Free: {free}."
        )


def _capacity_summary(devices: Iterable[GpuDevice]) -> str:
    """``Test GPU with 40 GiB (x3), A100 with 80 GiB``: equal devices counted, not repeated."""
    counts = Counter(f"{d.name} with {d.memory_mib / 1024:g} GiB" for d in devices)
    return ", ".join(text if n == 1 else f"{text} (x{n})" for text, n in counts.items())
