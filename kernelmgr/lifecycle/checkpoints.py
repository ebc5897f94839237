"""What the lifecycle asks the checkpoint store: the newest committed checkpoint, as the
controller's :class:`~kernelmgr.core.kernels.Committed`, and whether one is newer than known."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.core.kernels import Committed


def committed_of(manifest: Any) -> Committed:
    """What the controller knows of a committed checkpoint (id, time, size) from its manifest."""
    return Committed(manifest.checkpoint_id, manifest.created, int(manifest.summary().get("bytes") or 0))


def latest_or_none(store: CheckpointStore, owner: str, kernel_id: str, log: logging.Logger) -> Any:
    """The newest committed manifest, or ``None`` when there is none or it cannot be trusted
    (refused by its integrity check or unreadable: the store keeps it aside; logged here)."""
    try:
        return store.latest(owner, kernel_id)
    except Exception as exc:
        log.error("Kernel %s: its checkpoint cannot be used: %s", kernel_id, exc)
        return None


async def newer_checkpoint(
    store: CheckpointStore, owner: str, kernel_id: str, known: Committed | None, log: logging.Logger
) -> Committed | None:
    """The kernel's committed checkpoint (verified) when it is newer than ``known``; else ``None``.

    Newer means another id and a later ``created``: an older checkpoint put back in place is
    never taken. A checkpoint that cannot be read or verified counts as none (logged).
    """
    try:
        manifest = await asyncio.to_thread(store.latest, owner, kernel_id)
    except Exception as exc:  # refused or unreadable: no better than none
        log.warning("Kernel %s: its newest checkpoint is not usable: %s", kernel_id, exc)
        return None
    if manifest is None:
        return None
    if known is not None and (
        manifest.checkpoint_id == known.checkpoint_id or manifest.created <= known.created
    ):
        return None
    return committed_of(manifest)
