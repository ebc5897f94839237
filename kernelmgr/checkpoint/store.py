"""The server's view of checkpoints: one directory per kernel under a root, per owner.

The server never unpickles: it locates kernel directories, derives each owner's key for
the agent, reads verified manifests for the REST API, reads the agent's restore report,
and deletes a kernel's checkpoints when the kernel is shut down for good. Everything here
is cheap (manifests only; ``data.bin`` is checked by size, its digest by the agent before
it unpickles).

Paths are built from an owner name and a kernel id that come from requests, so both are
validated to be one plain path component: nothing can point outside the root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.keys import ENV_KEY_FILE, owner_key
from kernelmgr.checkpoint.layout import CURRENT, RESTORE_REPORT, read_current, remove_stale
from kernelmgr.checkpoint.progress import read_progress
from kernelmgr.checkpoint.termination import ENV_CHECKPOINT_ON_SIGTERM
from kernelmgr.checkpoint.verify import load_verified_manifest
from kernelmgr.core.manifest import Manifest

_MAX_COMPONENT = 128


def _check_component(what: str, value: str) -> str:
    """``value`` if it is safe as one path component, else ``ValueError`` saying why."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    if len(value) > _MAX_COMPONENT:
        raise ValueError(f"{what} is longer than {_MAX_COMPONENT} characters")
    if value.startswith("."):
        raise ValueError(f"{what} {value!r} must not start with '.'")
    if any(ch in value for ch in "/\\") or any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{what} {value!r} must not contain '/', '\\\\' or control characters")
    if value != value.strip():
        raise ValueError(f"{what} {value!r} must not start or end with whitespace")
    return value


class CheckpointStore:
    """Checkpoints under ``root``: ``<root>/<owner>/<kernel_id>/`` per kernel."""

    def __init__(self, root: str | os.PathLike[str], secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the checkpoint secret must be at least 16 bytes")
        self.root = Path(root)
        self._secret = secret
        # Summaries by (owner, kernel id), valid while ``current`` is the same file:
        # ``/api/elastic/kernels`` must not read and verify every manifest per request; one
        # ``stat`` tells whether a new checkpoint was committed since (commits replace it).
        self._summaries: dict[tuple[str, str], tuple[tuple[int, int, int], dict[str, Any] | None]] = {}

    def kernel_dir(self, owner: str, kernel_id: str) -> Path:
        """The kernel directory (not created). Raises ``ValueError`` for unsafe names."""
        path = self.root / _check_component("owner", owner) / _check_component("kernel id", kernel_id)
        resolved_root = self.root.resolve()
        if resolved_root not in path.resolve().parents:
            raise ValueError(f"kernel directory for {owner!r}/{kernel_id!r} would be outside {self.root}")
        return path

    def key_for(self, owner: str) -> bytes:
        """The key ``owner``'s kernels sign and verify with.

        Hand it to a kernel only through :mod:`kernelmgr.checkpoint.keys` (a key file), never
        in its environment, and never hand a kernel the secret or another owner's key.
        """
        return owner_key(self._secret, _check_component("owner", owner))

    def agent_env(
        self,
        owner: str,
        kernel_id: str,
        *,
        key_file: str | os.PathLike[str],
        restore: bool,
        restore_checkpoint: str | None = None,
        restore_mapped: bool = False,
        checkpoint_on_sigterm: bool = False,
    ) -> dict[str, str]:
        """The environment variables the agent reads (see :mod:`kernelmgr.checkpoint.agent`).

        ``key_file`` is where the caller put (or will mount) this owner's key; the key itself
        is not in the environment. With ``restore``, ``restore_checkpoint`` is the id of the
        checkpoint the server verified when the kernel hibernated: the agent refuses any other
        (an older checkpoint put back in place must not be restored silently). ``restore_mapped``:
        the agent may map big arrays from the checkpoint file (only where no one but the
        server's own user can rewrite it: see ``reader._map_region``). ``checkpoint_on_sigterm``:
        SIGTERM checkpoints what changed before the kernel exits (where the checkpoint outlives
        the process: see :mod:`kernelmgr.checkpoint.termination`).
        """
        env = {
            "ELASTIC_CHECKPOINT_DIR": str(self.kernel_dir(owner, kernel_id)),
            ENV_KEY_FILE: os.fspath(key_file),
            "ELASTIC_KERNEL_ID": kernel_id,
            "ELASTIC_OWNER": owner,
            "ELASTIC_RESTORE": "1" if restore else "0",
        }
        if restore and restore_checkpoint:
            env["ELASTIC_RESTORE_CHECKPOINT"] = restore_checkpoint
        if restore and restore_mapped:
            env["ELASTIC_RESTORE_MAPPED"] = "1"
        if checkpoint_on_sigterm:
            env[ENV_CHECKPOINT_ON_SIGTERM] = "1"
        return env

    def latest(self, owner: str, kernel_id: str) -> Manifest | None:
        """The committed checkpoint's manifest, verified; ``None`` if there is none.

        Raises :class:`CheckpointRefused` (after quarantining it) when it fails
        verification.
        """
        return load_verified_manifest(
            self.kernel_dir(owner, kernel_id), self.key_for(owner), owner, kernel_id
        )

    def has_checkpoint(self, owner: str, kernel_id: str) -> bool:
        """Whether ``current`` names a checkpoint (without verifying it)."""
        try:
            return read_current(self.kernel_dir(owner, kernel_id)) is not None
        except ValueError:
            return False

    def summary(self, owner: str, kernel_id: str) -> dict[str, Any] | None:
        """The REST shape of the committed checkpoint, or ``None`` (cached until :meth:`forget_cached`)."""
        key = (owner, kernel_id)
        try:
            info = os.stat(self.kernel_dir(owner, kernel_id) / CURRENT)
        except OSError:
            self._summaries.pop(key, None)
            return None  # nothing committed (or the kernel is gone)
        signature = (info.st_ino, info.st_mtime_ns, info.st_size)
        cached = self._summaries.get(key)
        if cached is not None and cached[0] == signature:
            return cached[1]
        value = self.read_summary(owner, kernel_id)
        self._summaries[key] = (signature, value)
        return value

    def forget_cached(self, owner: str, kernel_id: str) -> None:
        """The kernel's checkpoint changed (committed, removed): read it again next time."""
        self._summaries.pop((owner, kernel_id), None)

    def read_summary(self, owner: str, kernel_id: str) -> dict[str, Any] | None:
        """The REST shape of the committed checkpoint, read and verified now, or ``None``.

        Always has ``refused`` (``None``, or why the checkpoint was refused) and
        ``quarantined`` (``None``, or where a refused checkpoint was kept).
        """
        try:
            manifest = self.latest(owner, kernel_id)
        except CheckpointRefused as exc:
            return {
                "id": exc.quarantined.name if exc.quarantined is not None else None,
                "created": None,
                "bytes": 0,
                "saved": [],
                "not_saved": [],
                "seconds": 0.0,
                "refused": exc.reason,
                "quarantined": str(exc.quarantined) if exc.quarantined is not None else None,
            }
        if manifest is None:
            return None
        return {**manifest.summary(), "refused": None, "quarantined": None}

    def restore_report(self, owner: str, kernel_id: str) -> dict[str, Any] | None:
        """The report the agent wrote after its last restore, or ``None``."""
        path = self.kernel_dir(owner, kernel_id) / RESTORE_REPORT
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing, unreadable, or half-written by hand
            return None
        return report if isinstance(report, dict) else None

    def restore_progress(self, owner: str, kernel_id: str, since: float) -> dict[str, Any] | None:
        """How far the kernel's agent has read its checkpoint in a restore begun after ``since``."""
        return read_progress(self.kernel_dir(owner, kernel_id), since)

    def prune(self, owner: str, kernel_id: str) -> None:
        """Delete superseded checkpoints and leftovers, keeping the committed one.

        Only while the kernel's process is stopped (hibernated): its agent is then not writing.
        """
        directory = self.kernel_dir(owner, kernel_id)
        try:
            committed = read_current(directory)
        except ValueError:
            return  # unknown which one is committed: keep everything
        remove_stale(directory, keep=committed)

    def remove(self, owner: str, kernel_id: str) -> None:
        """Delete the kernel directory, quarantine included (the kernel is gone for good)."""
        directory = self.kernel_dir(owner, kernel_id)
        self.forget_cached(owner, kernel_id)
        shutil.rmtree(directory, ignore_errors=True)
        if directory.exists():
            shutil.rmtree(directory)  # raise the real error
        with contextlib.suppress(OSError):
            directory.parent.rmdir()  # the owner directory, once it is empty
