"""The slice allocator: placement, capacity messages, release and thread safety."""

from __future__ import annotations

import threading

import pytest

from kernelmgr.core.allocator import SliceAllocator
from kernelmgr.core.errors import CapacityError, ConfigError
from kernelmgr.core.inventory import GpuInventory
from kernelmgr.core.profiles import parse_profile

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


def test_concurrent_allocations_never_overbook() -> None:
    alloc = SliceAllocator(inventory(count=2), "binpack")
    granted: list[str] = []
    refused: list[str] = []
    barrier = threading.Barrier(16)

    def worker(n: int) -> None:
        barrier.wait()
        try:
            alloc.allocate(f"k{n}", QUARTER)
            granted.append(f"k{n}")
        except CapacityError:
            refused.append(f"k{n}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 8 and len(refused) == 8
    assert all(u.used_milli == 1000 for u in alloc.usage())


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
    assert doc["slices"] == [{"kernel_id": "a", "profile": "quarter", "fraction": 0.25, "memory_mib": 10_000}]
