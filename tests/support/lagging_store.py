"""A file-system checkpoint store whose view of ``current`` lags, as a second NFS client's does.

NFS clients cache attributes and lookups (``acdirmin``/``acdirmax``, ``lookupcache``): a server
that reads ``current`` right after a kernel on another node replaced it can see the previous one.
Here the lag never ends: once this server has read a kernel's ``current``, it keeps seeing what it
read then, while the kernels' side of the folder moves on (they write and rename as always). The
checkpoint files themselves are real; only the server's view of which one is current is stale.
"""

from __future__ import annotations

from typing import Any

from kernelmgr.checkpoint.verify import load_verified_checkpoint
from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.core.manifest import Manifest


class LaggingViewStore(CheckpointStore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen: dict[tuple[str, str], str | None] = {}

    def latest(self, owner: str, kernel_id: str) -> Manifest | None:
        key = (owner, kernel_id)
        if key not in self._seen:
            manifest = super().latest(owner, kernel_id)
            self._seen[key] = manifest.checkpoint_id if manifest is not None else None
            return manifest
        seen = self._seen[key]
        if seen is None:
            return None
        with self.open_kernel_dir(owner, kernel_id) as directory:
            return load_verified_checkpoint(directory, self.key_for(owner), owner, kernel_id, seen)
