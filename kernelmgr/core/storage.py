"""Checkpoint storage shared fairly: whether a hibernation may write its checkpoint.

Every user's hibernated kernels go to one volume (or bucket). Without limits one user who
hibernates a few large kernels fills it, and from then on every user's hibernation fails, so no
GPU is released. Two rules, checked before anything is written, from the checkpoint's estimate:

- **the owner's quota** (``max_bytes``): the owner's other checkpoints plus this one. The
  kernel's own stored checkpoint is not counted: a new commit replaces it (it is pruned after).
- **the store's reserve** (``reserve_bytes``, file systems only: a bucket says nothing of its
  free space): the last bytes of the volume are kept for the kernels the store already holds. A
  kernel with a stored checkpoint (resumed, and hibernating again) may use them, since its old
  checkpoint's bytes come back once the new one commits; a kernel new to the store may not, so
  one user's large first checkpoint cannot leave no room for another user's next one.

Pure logic (no store, no server): the numbers come in, a refusal that says what holds the space
and how to free it comes out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kernelmgr.core.units import human_bytes

#: How many of the owner's checkpoints a quota refusal names, largest first.
NAMED_HOLDERS = 5


@dataclass(frozen=True)
class StorageRules:
    """One owner's limits: ``None`` quota means no limit; a reserve of 0 keeps nothing back."""

    max_bytes: int | None = None
    reserve_bytes: int = 0


@dataclass(frozen=True)
class StorageRefusal:
    """Why a checkpoint may not be written: ``limit`` is ``quota``, ``reserve`` or ``full``."""

    limit: str
    message: str

    @property
    def status(self) -> int:
        """HTTP status: over a user's own quota is 403, a volume without room 507."""
        return 403 if self.limit == "quota" else 507


def storage_refusal(
    rules: StorageRules,
    kernel_id: str,
    estimate: int,
    held: Mapping[str, int],
    free: int | None,
    names: Mapping[str, str] | None = None,
) -> StorageRefusal | None:
    """Why ``kernel_id``'s checkpoint of about ``estimate`` bytes may not be written, or ``None``.

    ``held``: the owner's stored bytes per kernel id (this kernel's included, if it has any);
    ``free``: the volume's free bytes, ``None`` when unknown; ``names``: what to call a kernel in
    a message (its notebook), by id.
    """
    others = {kid: size for kid, size in held.items() if kid != kernel_id and size > 0}
    if rules.max_bytes is not None and sum(others.values()) + estimate > rules.max_bytes:
        return StorageRefusal("quota", _over_quota(rules.max_bytes, estimate, others, names or {}))
    if free is None:
        return None
    if estimate > free:
        return StorageRefusal(
            "full",
            f"the checkpoint volume has {human_bytes(free)} free and this checkpoint needs about "
            f"{human_bytes(estimate)}. Ask your administrator to free space or enlarge the volume; "
            "meanwhile the kernel keeps running (delete large variables you no longer need to shrink it)",
        )
    if held.get(kernel_id, 0) <= 0 and free - estimate < rules.reserve_bytes:
        return StorageRefusal(
            "reserve",
            f"the checkpoint volume has {human_bytes(free)} free and its last "
            f"{human_bytes(rules.reserve_bytes)} are kept for the kernels already hibernated there; "
            f"this checkpoint needs about {human_bytes(estimate)}. Ask your administrator to free "
            "space or enlarge the volume; meanwhile the kernel keeps running",
        )
    return None


def _over_quota(limit: int, estimate: int, others: Mapping[str, int], names: Mapping[str, str]) -> str:
    used = sum(others.values())
    largest = sorted(others.items(), key=lambda item: (-item[1], item[0]))[:NAMED_HOLDERS]
    holders = ", ".join(f"{names.get(kid) or kid[:8]} {human_bytes(size)}" for kid, size in largest)
    more = len(others) - len(largest)
    if more > 0:
        holders += f" and {more} more"
    held_text = (
        f"your other checkpoints hold {human_bytes(used)} ({holders})"
        if others
        else ("you hold no other checkpoint")
    )
    return (
        f"checkpoint quota reached: this kernel's checkpoint needs about {human_bytes(estimate)} and "
        f"{held_text}, over your quota of {human_bytes(limit)}. Free space by shutting down "
        "hibernated kernels you no longer need (`jupyter elastic list` shows each one's checkpoint "
        "size), or delete large variables in this kernel; it keeps running meanwhile"
    )
