"""The slice queue's order: priority, each owner's first before anyone's second, arrival; backfill
bounded by ``max_bypass``; one claim at a time."""

from __future__ import annotations

import pytest

from kernelmgr.core.queue import SliceQueue

pytestmark = pytest.mark.pure


def keys(queue: SliceQueue) -> list[str]:
    return [waiter.key for waiter in queue.order()]


def test_arrival_order_within_one_priority_and_one_owner() -> None:
    queue = SliceQueue()
    for n, key in enumerate(["a", "b", "c"]):
        queue.join(key, "ann", "small", now=n)
    assert keys(queue) == ["a", "b", "c"]
    assert [queue.position(k) for k in "abc"] == [1, 2, 3]
    assert queue.position("zzz") is None


def test_joining_again_keeps_the_place() -> None:
    queue = SliceQueue()
    queue.join("a", "ann", "small", now=0)
    queue.join("b", "bob", "small", now=1)
    queue.join("a", "ann", "small", now=2)
    assert keys(queue) == ["a", "b"]


def test_higher_priority_goes_first() -> None:
    queue = SliceQueue()
    queue.join("low", "ann", "small", now=0)
    queue.join("high", "bob", "whole", now=1, priority=5)
    assert keys(queue) == ["high", "low"]


def test_each_owners_first_waiter_before_anyones_second() -> None:
    queue = SliceQueue()
    for n in range(3):
        queue.join(f"ann{n}", "ann", "small", now=n)
    queue.join("bob0", "bob", "small", now=10)
    queue.join("cat0", "cat", "small", now=11)
    assert keys(queue) == ["ann0", "bob0", "cat0", "ann1", "ann2"]


def test_a_waiter_behind_one_that_does_not_fit_may_backfill_a_bounded_number_of_times() -> None:
    queue = SliceQueue(max_bypass=2)
    queue.join("big", "ann", "whole", now=0)
    only_small_fits = {"whole": False, "small": True}.__getitem__
    for n in range(2):
        queue.join(f"small{n}", "bob", "small", now=1 + n)
        assert queue.may_take(f"small{n}", only_small_fits)
        queue.granted(f"small{n}", now=1 + n)
        queue.settle(f"small{n}")
    queue.join("small2", "bob", "small", now=5)
    assert not queue.may_take("small2", only_small_fits)  # the head has been overtaken twice
    assert queue.may_take("big", lambda size: True)


def test_nobody_overtakes_a_waiter_that_fits() -> None:
    queue = SliceQueue()
    queue.join("first", "ann", "small", now=0)
    queue.join("second", "bob", "small", now=1)
    assert not queue.may_take("second", lambda size: True)
    assert queue.may_take("first", lambda size: True)


def test_a_newcomer_goes_straight_through_only_when_nobody_waits() -> None:
    queue = SliceQueue()
    assert queue.may_take("new", lambda size: True)
    queue.join("waiting", "ann", "whole", now=0)
    assert not queue.may_take("new", lambda size: True)


def test_one_claim_at_a_time_until_the_slice_is_taken() -> None:
    queue = SliceQueue()
    queue.join("a", "ann", "small", now=0)
    queue.join("b", "bob", "small", now=1)
    assert queue.may_take("a", lambda size: True)
    queue.granted("a", now=2)
    taken: set[str] = set()
    # "a" has not taken its slice yet: the free capacity the check saw is still counted for it.
    assert not queue.may_take("b", lambda size: True, claimed=taken.__contains__)
    taken.add("a")
    assert queue.may_take("b", lambda size: True, claimed=taken.__contains__)


def test_a_waiter_that_leaves_frees_its_place() -> None:
    queue = SliceQueue()
    queue.join("a", "ann", "small", now=0)
    queue.join("b", "bob", "small", now=1)
    queue.leave("a")
    assert queue.position("b") == 1 and len(queue) == 1


def test_the_estimate_needs_two_grants_then_scales_with_the_position() -> None:
    queue = SliceQueue()
    for n, key in enumerate(["a", "b", "c", "d"]):
        queue.join(key, f"user{n}", "small", now=0)
    assert queue.estimate("c") is None
    queue.granted("a", now=10)
    queue.settle("a")
    assert queue.estimate("c") is None
    queue.granted("b", now=40)  # 30 s between grants
    queue.settle("b")
    assert queue.position("d") == 2
    assert queue.estimate("d") == 60


def test_a_wait_counts_warm_slices_as_free() -> None:
    """A warm workload gives its slice back to any kernel that needs it: nobody waits for one."""
    import asyncio

    from kernelmgr.core.allocator import SliceAllocator
    from kernelmgr.core.inventory import GpuDevice, GpuInventory
    from kernelmgr.core.profiles import parse_profile
    from kernelmgr.core.waiting import SliceWaits

    whole = parse_profile("whole", {"gpu_fraction": 1})
    allocator = SliceAllocator(GpuInventory([GpuDevice("gpu-0", "GPU", 40960, 0)], source="declared"))
    allocator.allocate("warm:pool-1", whole)
    waits = SliceWaits(SliceQueue(), allocator, lambda _name: whole, poll=0.01)
    asyncio.run(asyncio.wait_for(waits.wait("k", "ann", whole, 0, "max"), timeout=5))
    assert "k" not in waits.queue


def test_the_queue_listing_shows_a_user_only_their_own_entries(tmp_path: object) -> None:
    """``GET /api/elastic/queue``'s model: another user's kernel ids and owners are not shown to a
    user (only how many wait); an admin sees every entry in order."""
    from kernelmgr.config import ElasticKernels
    from kernelmgr.server.models import queue_model

    runtime = ElasticKernels(
        profiles={"whole": {"gpu_fraction": 1}}, checkpoint_root=str(tmp_path), gpu_inventory=[]
    ).build()
    runtime.slice_queue.join("alice-1", "alice", "whole", now=0)
    runtime.slice_queue.join("bob-1", "bob", "whole", now=1)
    runtime.slice_queue.join("alice-2", "alice", "whole", now=2)
    mine = queue_model(runtime, "alice", admin=False)
    assert mine["waiting"] == 3
    assert [(e["position"], e["kernel_id"]) for e in mine["entries"]] == [(1, "alice-1"), (3, "alice-2")]
    assert "bob" not in str(mine)
    everyone = queue_model(runtime, "carol", admin=True)
    assert [e["kernel_id"] for e in everyone["entries"]] == ["alice-1", "bob-1", "alice-2"]
    assert queue_model(runtime, None, admin=False)["entries"] == []


def test_scale_up_wait_needs_the_inventory_from_the_nodes(tmp_path: object) -> None:
    """A pod left Pending for the autoscaler books its GPU from the nodes: a declared inventory
    cannot (the setting is refused at start-up, saying what to set)."""
    from kernelmgr.config import ElasticKernels
    from kernelmgr.core.errors import ConfigError

    config = ElasticKernels(
        profiles={"whole": {"gpu_fraction": 1}},
        checkpoint_root=str(tmp_path),
        gpu_inventory=[{"uuid": "GPU-a", "name": "A100", "memory_mib": 40960}],
        scale_up_wait=60,
    )
    with pytest.raises(ConfigError) as refused:
        config.build()
    assert 'scale_up_wait needs ElasticKernels.gpu_inventory_source = "kubernetes"' in str(refused.value)
