"""Every per-kernel fact is on the kernel's record, so removing a kernel forgets it everywhere.

A kernel is given every kind of per-kernel state the components keep (execution activity, a
culler warning, a GPU sample and idle track, a released slice, an operation slot, its entry in
the registry file), then removed the way a delete removes it (``Hibernator.forget``). Then
every object reachable from the culler (which reaches the hibernator, the runtime, the
sampler, the controller...) is searched for the kernel's id: a per-kernel map kept beside the
record, and not cleared, is found.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import types
from pathlib import Path

import pytest

from kernelmgr.activity.gpu import GpuActivitySampler
from kernelmgr.core.policy import Action
from tests.test_hibernation_culler_concurrency import POLICY, build_culler

pytestmark = pytest.mark.pure

#: Kept on purpose after a removal: why the kernel is gone (bounded; see ``Tombstones``).
BY_DESIGN = ("tombstones",)


def holders(root: object, needle: str, max_depth: int = 12) -> list[str]:
    """Paths from ``root`` to every container key, member or attribute equal to ``needle``."""
    found: list[str] = []
    seen: set[int] = set()
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, logging.Logger)
    skip += (asyncio.AbstractEventLoop, logging.Handler)

    def visit(obj: object, path: str, depth: int) -> None:
        if obj == needle and isinstance(obj, str):
            found.append(path)
            return
        if depth > max_depth or id(obj) in seen or isinstance(obj, (*skip, str, bytes, int, float)):
            return
        seen.add(id(obj))
        if isinstance(obj, types.MethodType):
            visit(obj.__self__, f"{path}.__self__", depth + 1)
        elif isinstance(obj, dict):
            for key, value in list(obj.items()):
                visit(key, f"{path} key", depth + 1)
                visit(value, f"{path}[{key!r}]", depth + 1)
        elif isinstance(obj, list | tuple | set | frozenset):
            for n, item in enumerate(list(obj)):
                visit(item, f"{path}[{n}]", depth + 1)
        else:
            names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
            attributes = {
                **{name: getattr(obj, name, None) for name in names},
                **getattr(obj, "__dict__", {}),
            }
            for name, value in attributes.items():
                if name not in BY_DESIGN:
                    visit(value, f"{path}.{name}", depth + 1)
            if hasattr(obj, "_entries") and not hasattr(obj, "__dict__"):  # e.g. an OrderedDict-like
                visit(obj._entries, f"{path}._entries", depth + 1)

    visit(root, "culler", 0)
    return found


def test_removing_a_kernel_leaves_no_entry_in_any_component(tmp_path: Path) -> None:
    culler, _fake, _ = build_culler(tmp_path, POLICY, {"whole-stays": 1, "whole-goes": 60})
    runtime, hibernator = culler.runtime, culler.hibernator
    assert runtime.nvml is not None
    sampler = culler.sampler = GpuActivitySampler(runtime.nvml)
    device = runtime.inventory.devices[0].uuid
    goes = runtime.kernels.get("whole-goes")
    assert goes is not None

    async def scenario() -> None:
        # Every kind of per-kernel fact the components keep (its execution activity is set by
        # build_culler: idle for 60 s):
        decided = dict(await culler.tick())
        assert decided["whole-goes"].action is Action.WARN and goes.cull.warning
        sampler.sample({"whole-goes": (424242, [device])})  # an idle track for its process
        hibernator.released.hibernated(goes, "whole", 1.0)
        hibernator.controller._slot("whole-goes")
        hibernator.records.remember("whole-goes", pid=None)
        assert holders(culler, "whole-goes"), "the search finds the kernel before it is removed"
        # A delete: jupyter_server drops its KernelManager, then the Hibernator forgets the kernel.
        culler.mkm.kernels.pop("whole-goes")  # type: ignore[attr-defined]
        await hibernator.forget("whole-goes")
        await culler.sample()  # the next GPU sample, without the kernel
        assert holders(culler, "whole-goes") == []
        assert holders(culler, "whole-stays"), "the other kernel is still known"

    asyncio.run(scenario())


def test_the_search_finds_a_map_kept_beside_the_record(tmp_path: Path) -> None:
    culler, _fake, _ = build_culler(tmp_path, POLICY, {"k": 1})
    culler.hibernator.warnings = {"k": "a warning"}  # type: ignore[attr-defined]
    culler.runtime.kernels.remove("k")
    culler.mkm.kernels.pop("k")  # type: ignore[attr-defined]
    assert [path.rsplit(".", 1)[-1] for path in holders(culler, "k")] == ["warnings key"]
