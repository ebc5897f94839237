"""Room for a checkpoint, asked before it is written: the owner's quota and the store's reserve.

A hibernation that would go over its owner's ``max_checkpoint_bytes``, or take the checkpoint
volume's last free bytes, is refused before the kernel writes anything (the rules:
:mod:`kernelmgr.core.storage`); the kernel keeps running with its slice, the refusal says what
holds the space. Without this one user's large checkpoints fill the shared volume and every
user's next hibernation fails part-way (507), so no GPU is released at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from kernelmgr.core.controller import LifecycleError
from kernelmgr.core.storage import StorageRefusal, StorageRules, storage_refusal
from kernelmgr.lifecycle import metrics

if TYPE_CHECKING:
    from kernelmgr.checkpoint_store import CheckpointStore


class CheckpointSpaceRefused(LifecycleError):
    """A checkpoint refused before it was written, for want of room (quota, reserve or a full volume)."""

    def __init__(self, message: str, status: int, limit: str, detail: str = "") -> None:
        super().__init__(message, status)
        self.limit = limit
        #: The rule's own words (what holds the space, how to free it), for the notebook.
        self.detail = detail or message

    @classmethod
    def of(cls, refusal: StorageRefusal) -> CheckpointSpaceRefused:
        return cls(refusal.message, refusal.status, refusal.limit)


class CheckpointSpace:
    """Checks a checkpoint's estimate against its owner's quota and the volume's free space."""

    def __init__(
        self, store: CheckpointStore, max_bytes: int | None = None, reserve_fraction: float = 0.0
    ) -> None:
        self.store = store
        #: The quota of an owner: the server's ``ElasticKernels.max_checkpoint_bytes``, or a shared
        #: gateway's per-user and per-group ``ElasticQuota`` (set by the gateway).
        self.quota_of: Callable[[str], int | None] = lambda owner: max_bytes
        self.reserve_fraction = reserve_fraction

    async def check(self, owner: str, kernel_id: str, estimate: int) -> None:
        """Raise :class:`CheckpointSpaceRefused` when ``estimate`` bytes do not fit (blocking
        reads in a worker thread: the store's listing or a walk of the owner's folder)."""
        quota = self.quota_of(owner)
        space = await asyncio.to_thread(self.store.volume_space)
        held = await asyncio.to_thread(self.store.usage, owner) if quota is not None or space else {}
        free, total = space if space is not None else (None, 0)
        rules = StorageRules(max_bytes=quota, reserve_bytes=int(total * self.reserve_fraction))
        refusal = storage_refusal(rules, kernel_id, max(0, estimate), held, free)
        if refusal is not None:
            metrics.CHECKPOINT_SPACE_REFUSALS.labels(refusal.limit).inc()
            raise CheckpointSpaceRefused.of(refusal)
