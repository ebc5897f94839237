"""The slice allocator: placement, capacity messages, release and thread safety."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import pytest

from kernelmgr.core.allocator import SliceAllocator
from kernelmgr.core.errors import CapacityError, ConfigError
from kernelmgr.core.inventory import GpuDevice, GpuInventory
from kernelmgr.core.profiles import parse_profile

pytestmark = pytest.mark.pure

QUARTER = parse_profile("quarter", {"gpu_fraction": 0.25, "memory_mib": 10_000})
HALF = parse_profile("half", {"gpu_fraction": 0.5, "memory_mib": 20_000})
THIRD = parse_profile("third", {"gpu_fraction": 1 / 3, "memory_mib": 1_000})
WHOLE = parse_profile("whole", {"gpu_fraction": 1})
TWO = parse_profile("two", {"gpu_fraction": 2})
HUGE = parse_profile("huge", {"gpu_fraction": 0.5, "memory_mib": 100_000})


def inventory(count: int = 2, memory: int = 40_000) -> GpuInventory:
    return GpuInventory.declared(
        [{"uuid": f"GPU-{i}", "name": "Test GPU", "memory_mib": memory} for i in range(count)]
    )


def test_binpack_fills_one_device_first() -> None:
    alloc = SliceAllocator(inventory(), "binpack")
    placed = [alloc.allocate(f"k{i}", QUARTER).device_uuids for i in range(5)]
    assert placed == [("GPU-0",)] * 4 + [("GPU-1",)]


def test_spread_uses_the_emptiest_device() -> None:
    alloc = SliceAllocator(inventory(), "spread")
    placed = [alloc.allocate(f"k{i}", QUARTER).device_uuids[0] for i in range(4)]
    assert placed == ["GPU-0", "GPU-1", "GPU-0", "GPU-1"]


def test_memory_limits_placement_as_well_as_fraction() -> None:
    alloc = SliceAllocator(inventory(count=1, memory=25_000), "binpack")
    alloc.allocate("a", HALF)
    with pytest.raises(CapacityError, match="does not fit right now"):
        alloc.allocate("b", QUARTER)  # 25% compute is free but only 5,000 MiB of memory


def test_thirds_add_up_exactly() -> None:
    alloc = SliceAllocator(inventory(count=1), "binpack")
    for i in range(3):
        alloc.allocate(f"k{i}", THIRD)
    for i in range(3):
        alloc.release(f"k{i}")
    (usage,) = alloc.usage()
    assert usage.used_milli == 0 and usage.used_memory_mib == 0
    alloc.allocate("w", WHOLE)


def test_whole_gpus_need_empty_devices() -> None:
    alloc = SliceAllocator(inventory(count=3), "binpack")
    alloc.allocate("q", QUARTER)
    got = alloc.allocate("t", TWO)
    assert got.device_uuids == ("GPU-1", "GPU-2")
    assert all(p.fraction == 1 and p.memory_mib == 40_000 for p in got.placements)
    with pytest.raises(CapacityError):
        alloc.allocate("w", WHOLE)


def test_capacity_message_names_size_and_what_is_free() -> None:
    alloc = SliceAllocator(inventory(count=1), "binpack")
    alloc.allocate("w", WHOLE)
    with pytest.raises(CapacityError) as caught:
        alloc.allocate("q", QUARTER)
    message = str(caught.value)
    assert "'quarter' (25% of a GPU, 9.76562 GiB)" in message
    assert "GPU-0: 0% free, 0 GiB free" in message
    assert "shut down" in message


def test_size_that_can_never_fit_says_so() -> None:
    alloc = SliceAllocator(inventory(), "binpack")
    with pytest.raises(CapacityError, match="can never fit"):
        alloc.allocate("h", HUGE)
    assert not alloc.ever_fits(HUGE)


def test_no_gpus_message() -> None:
    alloc = SliceAllocator(GpuInventory([], source="none", note="NVML unavailable"), "binpack")
    with pytest.raises(CapacityError, match=r"no GPUs .*NVML unavailable.*CPU kernel"):
        alloc.allocate("q", QUARTER)


def test_allocate_is_idempotent_per_kernel_and_release_is_safe_twice() -> None:
    alloc = SliceAllocator(inventory(count=1), "binpack")
    first = alloc.allocate("k", HALF)
    assert alloc.allocate("k", HALF) == first
    with pytest.raises(CapacityError, match="already holds"):
        alloc.allocate("k", QUARTER)
    assert alloc.release("k") == first
    assert alloc.release("k") is None
    assert alloc.usage()[0].used_milli == 0


def test_check_does_not_allocate() -> None:
    alloc = SliceAllocator(inventory(count=1), "binpack")
    alloc.check(WHOLE)
    alloc.allocate("w", WHOLE)
    with pytest.raises(CapacityError):
        alloc.check(QUARTER)


def test_unknown_strategy() -> None:
    with pytest.raises(ConfigError, match="allocation_strategy must be one of binpack, spread"):
        SliceAllocator(inventory(), "random")


THREE_QUARTERS = parse_profile("three-quarters", {"gpu_fraction": 0.75, "memory_mib": 1_000})


class Rendezvous:
    """A point two threads are meant to reach together, if nothing keeps them apart.

    Installed as the allocator's ``before_commit`` seam: a thread that has chosen a placement
    waits there for the other thread to arrive too. With the allocator's lock the other thread
    cannot arrive (it is blocked in ``allocate``), the wait ends after ``patience`` seconds and
    the first thread commits alone; without the lock both arrive, both commit the same free
    space, and the device is overbooked on every run. ``patience`` only bounds the wait in the
    correct case; the outcome never depends on it.
    """

    def __init__(self, parties: int = 2, patience: float = 1.0) -> None:
        self.parties = parties
        self.patience = patience
        self.arrived = 0
        self.met = False
        self._cond = threading.Condition()

    def __call__(self) -> None:
        with self._cond:
            self.arrived += 1
            self._cond.notify_all()
            if self._cond.wait_for(lambda: self.arrived >= self.parties, timeout=self.patience):
                self.met = True


def test_choice_and_commit_are_one_step() -> None:
    """Two threads ask for 3/4 of the only GPU at once: exactly one may get it.

    Guards the allocator's lock around check-then-commit (remove ``with self._lock`` from
    ``allocate`` and this fails on every run: the rendezvous lets both threads commit).
    """
    alloc = SliceAllocator(inventory(count=1), "binpack")
    meet = Rendezvous()
    alloc.before_commit = meet
    results: dict[str, str] = {}

    def worker(kernel_id: str) -> None:
        try:
            alloc.allocate(kernel_id, THREE_QUARTERS)
            results[kernel_id] = "granted"
        except CapacityError:
            results[kernel_id] = "refused"

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not meet.met, "two threads were between choosing a placement and committing it at once"
    assert sorted(results.values()) == ["granted", "refused"]
    (usage,) = alloc.usage()
    assert usage.used_milli == 750 and len(usage.slices) == 1


def test_concurrent_allocations_never_overbook() -> None:
    """Many threads allocating and releasing at once never overbook a device or lose a slice.

    The ``before_commit`` seam yields the GIL (``time.sleep(0)``) and the switch interval is
    tiny, so without the lock threads interleave between choosing and committing on nearly
    every run instead of almost never (before the seam this test passed 30/30 without the lock).
    """
    alloc = SliceAllocator(inventory(count=2), "binpack")
    alloc.before_commit = lambda: time.sleep(0)
    threads_count, rounds = 16, 20
    barrier = threading.Barrier(threads_count)
    overbooked: list[str] = []
    granted_total: list[int] = []

    def worker(n: int) -> None:
        barrier.wait()
        granted = 0
        for r in range(rounds):
            kernel_id = f"k{n}-{r}"
            try:
                alloc.allocate(kernel_id, QUARTER)
            except CapacityError:
                continue
            granted += 1
            for u in alloc.usage():
                if u.used_milli > 1000 or u.used_memory_mib > u.device.memory_mib:
                    overbooked.append(f"{u.device.uuid}: {u.used_milli} milli, {u.used_memory_mib} MiB")
            if r % 2:
                alloc.release(kernel_id)
        granted_total.append(granted)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(threads_count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(previous)
    assert overbooked == []
    held = alloc.slices()
    assert len(held) <= 8
    usage = {u.device.uuid: u for u in alloc.usage()}
    for uuid, u in usage.items():
        on_device = [p for s in held for p in s.placements if p.device_uuid == uuid]
        assert u.used_milli == sum(p.milli for p in on_device), "the books match the slices held"
        assert u.used_memory_mib == sum(p.memory_mib for p in on_device)
    assert sum(granted_total) >= 8


def test_placement_is_deterministic() -> None:
    def run() -> list[tuple[str, ...]]:
        alloc = SliceAllocator(inventory(count=3), "spread")
        out = []
        for i, size in enumerate([HALF, QUARTER, THIRD, QUARTER, HALF, THIRD]):
            out.append(alloc.allocate(f"k{i}", size).device_uuids)
        return out

    assert run() == run()


def test_usage_lists_slices_per_device() -> None:
    alloc = SliceAllocator(inventory(), "binpack")
    alloc.allocate("a", QUARTER)
    doc = alloc.usage()[0].to_dict()
    assert doc["uuid"] == "GPU-0"
    assert doc["used_fraction"] == 0.25 and doc["free_memory_mib"] == 30_000
    assert doc["slices"] == [
        {"kernel_id": "a", "profile": "quarter", "warm": False, "fraction": 0.25, "memory_mib": 10_000}
    ]


def test_a_kernel_takes_over_a_warm_slice_on_the_same_devices() -> None:
    alloc = SliceAllocator(inventory(), "binpack")
    warm = alloc.allocate("warm:pod-1", QUARTER)
    assert warm.warm and alloc.usage()[0].to_dict()["slices"][0]["warm"] is True
    taken = alloc.transfer("warm:pod-1", "kernel-a")
    assert taken is not None and not taken.warm
    assert taken.placements == warm.placements  # the GPU the warm pod holds, not a second booking
    assert alloc.slice_of("warm:pod-1") is None and alloc.slice_of("kernel-a") == taken
    assert alloc.usage()[0].used_milli == 250
    assert alloc.transfer("warm:pod-1", "kernel-b") is None  # nothing left to take
    alloc.allocate("warm:pod-2", QUARTER)
    with pytest.raises(CapacityError, match="already holds"):
        alloc.transfer("warm:pod-2", "kernel-a")
    assert alloc.slice_of("warm:pod-2") is not None  # a refused transfer keeps the warm booking
    alloc.release("kernel-a")
    assert alloc.usage()[0].used_milli == 250


def test_warm_slices_never_turn_a_kernel_away() -> None:
    alloc = SliceAllocator(inventory(), "binpack")
    whole = parse_profile("whole", {"gpu_fraction": 1})
    alloc.allocate("warm:pod-1", whole)
    alloc.allocate("warm:pod-2", whole)
    alloc.check(whole)  # a launch may start: the warm workloads give their GPUs back
    assert alloc.fits(whole, warm_gives_way=True)
    assert not alloc.fits(whole)  # ... but until they have, nothing is free to allocate
    with pytest.raises(CapacityError):
        alloc.allocate("kernel-a", whole)
    alloc.release("warm:pod-1")
    alloc.allocate("kernel-a", whole)
    alloc.release("warm:pod-2")
    alloc.allocate("kernel-b", whole)
    with pytest.raises(CapacityError, match="does not fit right now"):
        alloc.check(whole)  # kernels do not give way


# -- an inventory that changes at run time (Kubernetes nodes join, leave, are cordoned) -------------


def devices(*specs: tuple[str, str, int]) -> GpuInventory:
    """Devices ``(uuid, node, memory_mib)``, indexed per node in the order given."""
    per_node: dict[str, int] = {}
    out = []
    for uuid, node, memory in specs:
        index = per_node.get(node, 0)
        per_node[node] = index + 1
        out.append(GpuDevice(uuid=uuid, name="Test GPU", memory_mib=memory, index=index, node=node))
    return GpuInventory(out, source="kubernetes")


def test_removed_device_reports_its_slices_lost_and_keeps_the_rest() -> None:
    alloc = SliceAllocator(devices(("a/0", "a", 40_000), ("b/0", "b", 40_000)), "spread")
    on_a = alloc.allocate("k1", HALF)
    on_b = alloc.allocate("k2", HALF)
    assert on_a.device_uuids == ("a/0",) and on_b.device_uuids == ("b/0",)

    change = alloc.replace_inventory(devices(("b/0", "b", 40_000)))

    assert [d.uuid for d in change.removed] == ["a/0"] and not change.added and not change.changed
    assert change.lost == (on_a,)
    assert alloc.slice_of("k1") is None and alloc.slice_of("k2") == on_b
    assert [u.device.uuid for u in alloc.usage()] == ["b/0"]
    assert alloc.release("k1") is None  # releasing a lost slice later is harmless
    (usage,) = alloc.usage()
    assert usage.used_milli == 500 and usage.used_memory_mib == 20_000


def test_a_multi_gpu_slice_is_lost_whole_when_one_of_its_devices_goes() -> None:
    alloc = SliceAllocator(devices(("a/0", "a", 40_000), ("a/1", "a", 40_000)), "binpack")
    granted = alloc.allocate("k", TWO)
    change = alloc.replace_inventory(devices(("a/1", "a", 40_000)))
    assert change.lost == (granted,)
    (usage,) = alloc.usage()
    assert usage.used_milli == 0 and usage.slices == ()
    alloc.allocate("w", WHOLE)  # the surviving device is really free


def test_added_devices_make_a_size_fit_that_did_not() -> None:
    alloc = SliceAllocator(devices(("a/0", "a", 40_000)), "binpack")
    alloc.allocate("k", WHOLE)
    assert not alloc.fits(WHOLE) and not alloc.ever_fits(TWO)
    change = alloc.replace_inventory(
        devices(("a/0", "a", 40_000), ("b/0", "b", 40_000), ("b/1", "b", 40_000))
    )
    assert [d.uuid for d in change.added] == ["b/0", "b/1"] and change.lost == ()
    assert alloc.slice_of("k") is not None and alloc.fits(WHOLE) and alloc.fits(TWO)
    assert alloc.allocate("t", TWO).device_uuids == ("b/0", "b/1")


def test_whole_gpus_of_one_kernel_are_on_one_node() -> None:
    alloc = SliceAllocator(devices(("a/0", "a", 40_000), ("b/0", "b", 40_000)), "binpack")
    assert not alloc.ever_fits(TWO) and not alloc.fits(TWO)
    with pytest.raises(CapacityError, match="can never fit"):
        alloc.allocate("k", TWO)


def test_a_shrunk_device_keeps_its_slices_and_offers_nothing_more() -> None:
    alloc = SliceAllocator(devices(("a/0", "a", 40_000)), "binpack")
    alloc.allocate("k", HALF)
    change = alloc.replace_inventory(devices(("a/0", "a", 10_000)))
    assert [d.memory_mib for d in change.changed] == [10_000] and change.lost == ()
    assert alloc.slice_of("k") is not None and not alloc.fits(QUARTER)


def test_exclusive_devices_hold_one_slice_and_sizes_stay_on_their_resource() -> None:
    mig = [
        GpuDevice(
            f"n/mig-{i}",
            "MIG 1g.10gb",
            10_240,
            i,
            node="n",
            resource="nvidia.com/mig-1g.10gb",
            exclusive=True,
        )
        for i in range(2)
    ]
    gpu = GpuDevice("n/gpu-0", "A100", 81_920, 0, node="n", resource="nvidia.com/gpu")
    small_mig = parse_profile("mig", {"gpu_fraction": 1 / 7, "memory_mib": 10_000, "backend": "mig"})
    resources = {"mig": "nvidia.com/mig-1g.10gb", "quarter": "nvidia.com/gpu", "whole": "nvidia.com/gpu"}
    alloc = SliceAllocator(
        GpuInventory([*mig, gpu], source="kubernetes"),
        "binpack",
        profile_resource=lambda p: resources.get(p.name),
    )
    first = alloc.allocate("m1", small_mig)
    second = alloc.allocate("m2", small_mig)
    assert {first.device_uuids, second.device_uuids} == {("n/mig-0",), ("n/mig-1",)}
    assert first.placements[0].milli == 1000 and first.placements[0].memory_mib == 10_240
    assert not alloc.fits(small_mig)  # the GPU is not a MIG device, and each MIG device holds one slice
    assert alloc.allocate("q", QUARTER).device_uuids == ("n/gpu-0",)
    assert alloc.ever_fits(WHOLE)


def test_random_inventory_changes_keep_the_books_consistent() -> None:
    """Property-style: allocations, releases and inventory swaps in random order never leave a
    slice on a missing device, never overbook a device, and report exactly the slices that were
    on removed devices as lost."""
    import random

    rng = random.Random(8)
    pool = [(f"{node}/gpu-{i}", node, 40_000) for node in "abcd" for i in range(2)]
    sizes = [QUARTER, HALF, THIRD, WHOLE, TWO]
    for _trial in range(40):
        alloc = SliceAllocator(devices(*rng.sample(pool, 4)), rng.choice(["binpack", "spread"]))
        for step in range(60):
            action = rng.random()
            if action < 0.5:
                with contextlib.suppress(CapacityError):
                    alloc.allocate(f"k{step}", rng.choice(sizes))
            elif action < 0.7 and alloc.slices():
                alloc.release(rng.choice(alloc.slices()).kernel_id)
            else:
                before = {s.kernel_id: s for s in alloc.slices()}
                kept = [spec for spec in pool if rng.random() < 0.6]
                change = alloc.replace_inventory(devices(*kept))
                present = {uuid for uuid, _, _ in kept}
                expected_lost = {k for k, s in before.items() if not set(s.device_uuids) <= present}
                assert {s.kernel_id for s in change.lost} == expected_lost
                assert {s.kernel_id for s in alloc.slices()} == set(before) - expected_lost
            present = {d.uuid for d in alloc.inventory}
            for usage in alloc.usage():
                held = [p for s in alloc.slices() for p in s.placements if p.device_uuid == usage.device.uuid]
                assert usage.used_milli == sum(p.milli for p in held) <= 1000
                assert usage.used_memory_mib == sum(p.memory_mib for p in held) <= usage.device.memory_mib
            for s in alloc.slices():
                assert set(s.device_uuids) <= present
                assert len({alloc.inventory.by_uuid(u).node for u in s.device_uuids}) == 1


def test_messages_stay_short_on_a_big_cluster() -> None:
    alloc = SliceAllocator(devices(*[(f"n{i:03}/gpu-0", f"n{i:03}", 40_000) for i in range(300)]), "binpack")
    for i in range(300):
        alloc.allocate(f"k{i}", WHOLE if i else HALF)
    with pytest.raises(CapacityError) as caught:
        alloc.allocate("x", WHOLE)
    message = str(caught.value)
    assert "n000/gpu-0: 50% free" in message and "(the 8 with most room of 300)" in message
    assert len(message) < 1200
    with pytest.raises(
        CapacityError, match=r"can never fit on the cluster's GPUs \(Test GPU with 39.0625 GiB \(x300\)\)"
    ):
        alloc.allocate("y", HUGE)
    alloc.replace_inventory(GpuInventory([], source="kubernetes", note="no node advertises GPUs"))
    with pytest.raises(
        CapacityError, match=r"the cluster has no schedulable GPUs \(no node advertises GPUs\)"
    ):
        alloc.allocate("z", HALF)


def _two_nodes(*, closed: str = "") -> GpuInventory:
    devices = [
        GpuDevice(f"{node}/gpu-{i}", "A100", 40960, index=i, node=node, closed=node == closed)
        for node in ("n1", "n2")
        for i in range(2)
    ]
    return GpuInventory(devices, source="kubernetes")


def test_a_slice_follows_its_pod_to_the_node_the_scheduler_chose() -> None:
    alloc = SliceAllocator(_two_nodes())
    half = HALF
    granted = alloc.allocate("k", half)
    assert granted.device_uuids == ("n1/gpu-0",)  # the allocator's own choice
    moved = alloc.move_to_node("k", half, "n2")
    assert moved is not None and moved.device_uuids == ("n2/gpu-0",)
    assert alloc.slice_of("k") == moved
    used = {u.device.uuid: u.used_milli for u in alloc.usage()}
    assert used == {"n1/gpu-0": 0, "n1/gpu-1": 0, "n2/gpu-0": 500, "n2/gpu-1": 0}  # nothing left behind
    assert alloc.move_to_node("k", half, "n2") == moved  # already there: unchanged


def test_whole_gpus_follow_their_pod_and_a_full_node_keeps_the_booking() -> None:
    alloc = SliceAllocator(_two_nodes())
    two = parse_profile("two", {"gpu_fraction": 2})
    alloc.allocate("a", two)  # n1, both GPUs
    alloc.allocate("b", two)  # n2, both GPUs
    assert alloc.move_to_node("a", two, "n2") is None  # n2 is full in this view: keep n1
    assert alloc.slice_of("a").device_uuids == ("n1/gpu-0", "n1/gpu-1")  # type: ignore[union-attr]
    assert {u.device.uuid: u.used_milli for u in alloc.usage()} == dict.fromkeys(
        ("n1/gpu-0", "n1/gpu-1", "n2/gpu-0", "n2/gpu-1"), 1000
    )
    alloc.release("b")
    moved = alloc.move_to_node("a", two, "n2")
    assert moved is not None and moved.device_uuids == ("n2/gpu-0", "n2/gpu-1")
    assert alloc.fits(two)  # n1 free again


def test_a_pod_on_a_cordoned_node_is_booked_there() -> None:
    alloc = SliceAllocator(_two_nodes(closed="n2"))
    half = HALF
    alloc.allocate("k", half)
    moved = alloc.move_to_node("k", half, "n2")  # bound before the cordon: the pod runs there
    assert moved is not None and moved.device_uuids == ("n2/gpu-0",)
    assert alloc.move_to_node("gone", half, "n2") is None
