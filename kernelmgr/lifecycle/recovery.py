"""What a previous server left: kernels it hibernated, kernels still checkpointing themselves
(their process outlived it), and, in Kubernetes, kernels whose pods may still run.

Read from the state file at start-up; nothing here blocks the server's start. A local orphan
is listed ``hibernating`` until its process exits with a committed checkpoint (the controller's
:meth:`~kernelmgr.core.controller.LifecycleController.adopt_orphan`); a pod's kernel waits in
:attr:`Recovery.deferred` until :mod:`kernelmgr.server.adoption` finds its pod or not.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

from kernelmgr.core.controller import LifecycleController
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.kernels import Committed, Loss
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.profiles import parse_profile
from kernelmgr.lifecycle.checkpoints import committed_of, latest_or_none
from kernelmgr.lifecycle.host import KernelHost
from kernelmgr.lifecycle.records import KernelRecord, KernelRecords

if TYPE_CHECKING:
    from kernelmgr.config import ElasticRuntime


class Recovery:
    """Re-lists the kernels of the previous server run; one per server."""

    def __init__(
        self,
        host: KernelHost,
        runtime: ElasticRuntime,
        controller: LifecycleController,
        records: KernelRecords,
    ) -> None:
        self.host = host
        self.runtime = runtime
        self.controller = controller
        self.records = records
        #: Kernels that ran in pods when the previous server stopped, until adoption decides.
        self.deferred: dict[str, KernelRecord] = {}

    def _size_known(self, name: str) -> bool:
        return name in self.runtime.profiles or name in self.runtime.retired

    def _keep_removed_size(self, kernel_id: str, record: KernelRecord) -> None:
        """A size removed while its kernel was hibernated (or the server down) comes back from the
        record's copy, retired: the kernel stays listed and resumes with it; no new kernel gets it."""
        name, definition = record.profile, record.profile_definition
        if name is None or self._size_known(name) or not isinstance(definition, dict):
            return
        fields = {key: value for key, value in definition.items() if key not in ("name", "whole_gpus")}
        try:
            self.runtime.retired[name] = parse_profile(name, fields)
        except ConfigError as exc:
            self.host.log.error("Kernel %s: its record's GPU size %r is unreadable: %s", kernel_id, name, exc)
            return
        self.host.log.warning(
            "GPU size %r is no longer configured: kept from the record of kernel %s for the kernels "
            "that have it (not offered for new kernels)",
            name,
            kernel_id,
        )

    def recover(self) -> list[str]:
        """Re-register the kernels a previous server run left hibernated (or hibernating).

        A kernel hibernated by the previous run is listed at once. One whose process is
        still alive (the previous server died while it ran: its watchdog checkpoints it once
        its running cell ends, however long that takes) is listed as ``hibernating`` and
        becomes ``hibernated`` when its process exits with a committed checkpoint; a resume
        waits for that. Nothing here blocks the server's start. Returns the ids re-registered.
        """
        try:
            previous = self.records.state_file.load()
        except ValueError as exc:
            self.host.log.error("%s", exc)
            return []
        adopted: list[str] = []
        in_pods = self.runtime.mode.in_pods
        for kernel_id, record in previous.items():
            self._keep_removed_size(kernel_id, record)
            if in_pods and record.state != KernelState.HIBERNATED.value:
                # Its pod may still run: kernelmgr.server.adoption looks, then adopts it or recovers it.
                self.deferred[kernel_id] = record
                self.records[kernel_id] = record  # kept on disk until adoption decides
                continue
            if record.profile is not None and not self._size_known(record.profile):
                self.host.log.error(
                    "Kernel %s was hibernated with GPU size %r, which is no longer configured and "
                    "which its record (written by an older version) does not define; its checkpoint "
                    "is kept but the kernel is not listed: add the size back to resume it",
                    kernel_id,
                    record.profile,
                )
                continue
            orphan = record.pid if record.state != KernelState.HIBERNATED.value else None
            if orphan is not None and _alive(orphan):
                record.state = KernelState.HIBERNATING.value
                self.host.adopt_hibernated(record, state=KernelState.HIBERNATING)
                self.records[kernel_id] = record
                managed = self.runtime.kernels.get(kernel_id)
                if managed is not None:
                    managed.orphan_pid = orphan
                self._adopt_orphan_soon(kernel_id, record, orphan)
                adopted.append(kernel_id)
                continue
            manifest = latest_or_none(self.runtime.checkpoints, record.owner, kernel_id, self.host.log)
            if manifest is None:
                self.host.log.warning(
                    "Kernel %s (%s) ended with the previous server before any checkpoint; it is gone",
                    kernel_id,
                    record.state,
                )
                continue
            if record.state != KernelState.HIBERNATED.value or record.checkpoint_id is None:
                # A kernel the server had not stopped may have checkpointed itself since: take the
                # committed one. A hibernated kernel keeps the id verified when it hibernated, so an
                # older checkpoint put back while the server was down is refused on resume.
                record.checkpoint_id = manifest.checkpoint_id
            record.state = KernelState.HIBERNATED.value
            record.pid = None
            self.host.adopt_hibernated(record)
            self.records[kernel_id] = record
            managed = self.runtime.kernels.get(kernel_id)
            if managed is not None:
                # The id verified when it hibernated (not the newest one on disk: see above).
                managed.committed = Committed(
                    record.checkpoint_id, manifest.created, int(manifest.summary().get("bytes") or 0)
                )
            adopted.append(kernel_id)
        self.records.state_file.save(self.records)
        if adopted:
            self.host.log.info("Recovered %d hibernated kernel(s): %s", len(adopted), ", ".join(adopted))
        return adopted

    def recover_lost(self, record: KernelRecord, why: str) -> bool:
        """A kernel that was running when the previous server stopped, and whose pod is gone:
        hibernated from its last checkpoint (the next cell is told what was lost), else forgotten."""
        kernel_id = record.kernel_id
        manifest = latest_or_none(self.runtime.checkpoints, record.owner, kernel_id, self.host.log)
        if manifest is None:
            self.host.log.warning("Kernel %s %s before any checkpoint; it is gone", kernel_id, why)
            self.records.pop(kernel_id, None)
            self.records.save()
            return False
        record.checkpoint_id = manifest.checkpoint_id
        record.state = KernelState.HIBERNATED.value
        record.pid = None
        self.host.adopt_hibernated(record)
        self.records[kernel_id] = record
        committed = committed_of(manifest)
        managed = self.runtime.kernels.get(kernel_id)
        if managed is not None:
            managed.committed = committed
            managed.loss = Loss(why, committed)
        self.records.remember(kernel_id, pid=None, hibernated_at=time.time())
        return True

    def _adopt_orphan_soon(self, kernel_id: str, record: KernelRecord, pid: int) -> None:
        """Once the loop runs: wait (without blocking it) for the orphan to checkpoint and exit."""

        async def wait_for_exit() -> Committed | None:
            self.host.log.info(
                "Kernel %s (pid %d) outlived the previous server; waiting for it to checkpoint itself",
                kernel_id,
                pid,
            )
            while _alive(pid):
                await asyncio.sleep(0.2)
            managed = self.runtime.kernels.get(kernel_id)
            if managed is not None:
                managed.orphan_pid = None
            manifest = await asyncio.to_thread(
                latest_or_none, self.runtime.checkpoints, record.owner, kernel_id, self.host.log
            )
            if manifest is None:
                self.host.log.warning("Kernel %s ended before any checkpoint; it is gone", kernel_id)
                self.records.pop(kernel_id, None)
                if kernel_id in self.host:
                    self.host.remove_kernel(kernel_id)
                return None
            self.records.remember(kernel_id, pid=None, checkpoint_id=manifest.checkpoint_id)
            return committed_of(manifest)

        asyncio.get_event_loop().call_soon(self.controller.adopt_orphan, kernel_id, wait_for_exit)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (our own reaped-later children are zombies)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # not ours (pid reused by another user's process)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
