"""A resume's plan is handed to the launch and taken exactly once; the provisioners' per-kernel
facts (a loss taken over, a stop seen, a restart asked for) live on the kernel's record.

Pure: a runtime built from configuration, the provisioners' shared start (``claim_slice``), no
process.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kernelmgr.config import ElasticKernels, ElasticRuntime
from kernelmgr.core.kernels import FRESH_START, Committed, LaunchPlan, ManagedKernel
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.provisioners.common import claim_slice, find_loss_reports, mark_launched

pytestmark = pytest.mark.pure

PROFILES = {"small": {"gpu_fraction": 0.5, "memory_mib": 1000}}
INVENTORY = [{"uuid": "GPU-0", "name": "Test", "memory_mib": 4000}]


def runtime(tmp_path: Path) -> ElasticRuntime:
    settings = ElasticKernels(profiles=PROFILES, gpu_inventory=INVENTORY, checkpoint_root=str(tmp_path))
    return settings.build()


def test_a_plan_is_taken_once_and_the_next_launch_starts_empty(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    first = claim_slice(rt, "k1", "python3-gpu-small", "small")
    assert first.plan is FRESH_START  # a new kernel: nothing to restore
    mark_launched(rt, "k1", "process launched")
    rt.allocator.release("k1")

    plan = LaunchPlan.restoring(Committed("ckpt-1", 1.0, 10))
    first.record.hand_launch_plan(plan)
    resumed = claim_slice(rt, "k1", "python3-gpu-small", "small")
    assert resumed.plan == LaunchPlan(restore=True, checkpoint="ckpt-1")
    rt.allocator.release("k1")

    restarted = claim_slice(rt, "k1", "python3-gpu-small", "small")  # e.g. the restarter after a crash
    assert restarted.plan is FRESH_START


def test_a_plan_no_launch_took_is_withdrawn() -> None:
    record = ManagedKernel(kernel_id="k", kernelspec="s", profile=None, owner="alice")
    record.hand_launch_plan(LaunchPlan.restoring(Committed("ckpt-2", 1.0)))
    record.hand_launch_plan(None)  # the resume's launch failed before its provisioner took it
    assert record.take_launch_plan() is FRESH_START
    assert LaunchPlan.restoring(None) is FRESH_START  # a resume that discards its checkpoints


def test_the_provisioners_facts_are_on_the_record_and_a_new_launch_clears_them(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    record = claim_slice(rt, "k1", "python3-gpu-small", "small").record
    mark_launched(rt, "k1", "pod running")
    rt.states.stop_seen(record, 50.0)
    rt.states.stop_seen(record, 60.0)  # the first sighting counts
    rt.states.taken_over(record, "evicted")
    rt.states.restart_requested("k1", True)
    assert (record.stop_began, record.taken_over, record.restarting) == (50.0, "evicted", True)
    rt.allocator.release("k1")
    for state in (KernelState.HIBERNATING, KernelState.HIBERNATED, KernelState.RESUMING):
        rt.states.move(record, state, "lost")  # as the controller leaves it before the resume's launch
    claim_slice(rt, "k1", "python3-gpu-small", "small")
    assert (record.stop_began, record.taken_over) == (None, None)
    assert record.restarting  # until the launch serves
    mark_launched(rt, "k1", "pod running")
    assert not record.restarting


def test_losses_are_found_on_the_provisioners_parents_never_on_the_configuration() -> None:
    reports = SimpleNamespace(stopping=lambda kernel_id: None, vanished=lambda *args: True)
    server = SimpleNamespace(kernel_losses=reports, parent=None)
    kernel_manager = SimpleNamespace(parent=server)
    assert find_loss_reports(kernel_manager) is reports
    assert find_loss_reports(SimpleNamespace(parent=SimpleNamespace(kernel_losses=None, parent=None))) is None
