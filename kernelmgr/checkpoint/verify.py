"""Deciding whether a committed checkpoint may be trusted, before anything is unpickled.

Two stages, both refusing (quarantine + :class:`CheckpointRefused`) on any doubt:

1. :func:`load_verified_manifest` (cheap, used by the server and the agent): the manifest
   parses, its HMAC verifies under the owner's key, it names this owner, kernel and
   checkpoint, ``data.bin`` has the recorded size, and every region the manifest points
   at lies inside the file without overlapping another. The last check matters because
   the reader allocates buffers from these numbers before the data digest is known.
2. The data digest, checked by the reader while it reads ``data.bin`` (``reader.py``).
"""

from __future__ import annotations

import stat
from pathlib import Path

from kernelmgr.checkpoint import cipher
from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.integrity import manifest_is_authentic
from kernelmgr.checkpoint.layout import (
    ALIGN,
    DATA_FILE,
    MANIFEST_FILE,
    file_names,
    quarantine,
    quarantine_reason,
    quarantined_path,
    read_current,
)
from kernelmgr.checkpoint.safedir import SafeDir, opened
from kernelmgr.core.manifest import Manifest, ManifestError

#: How many times a reader follows ``current`` when it changes under it (a commit that
#: deletes the checkpoint being read); after that it gives up rather than spin.
_ATTEMPTS = 3


class Untrusted(Exception):
    """Internal: why one checkpoint directory cannot be trusted."""


def check_layout(manifest: Manifest, size: int) -> None:
    """Raise :class:`Untrusted` unless every group region lies inside ``size`` bytes, in order."""
    if manifest.data_bytes != size:
        raise Untrusted(f"{DATA_FILE} has {size} bytes, the manifest says {manifest.data_bytes}")
    end = 0
    regions = sorted(region for group in manifest.groups for region in group.regions())
    for offset, length in regions:
        if offset < end:
            raise Untrusted(f"the manifest points at overlapping regions of {DATA_FILE} (offset {offset})")
        if offset - end >= ALIGN:
            raise Untrusted(f"the manifest leaves an unexplained gap in {DATA_FILE} (offset {end})")
        end = offset + length
        if end > size:
            raise Untrusted(
                f"the manifest points past the end of {DATA_FILE} (offset {offset}, {length} bytes)"
            )
    if size - end >= ALIGN:
        raise Untrusted(f"{DATA_FILE} has {size - end} bytes the manifest does not account for")


#: The server and the agent read no larger manifest (a variable's record is ~200 bytes: this is
#: well over 100,000 variables), so a kernel cannot make the server parse a file of any size.
MANIFEST_CAP = 32 * 1024 * 1024


#: Said when a checkpoint is encrypted at rest and no key came with the request to read it.
NO_KEY = (
    "checkpoint {id} is encrypted at rest and no key was given to read it: the server needs its "
    "master key (ElasticKernels.checkpoint_encryption_key_files)"
)


def _verify_dir(
    kernel_dir: SafeDir,
    checkpoint_id: str,
    key: bytes,
    owner: str,
    kernel_id: str,
    data_key: bytes | None = None,
    data_file: Path | None = None,
) -> Manifest:
    """``data_key`` (the kernel's key): a checkpoint encrypted at rest (its files' names say so)
    has its manifest decrypted with it; without it such a checkpoint is refused, not quarantined
    (the checkpoint is not at fault). ``data_file``: where ``data.bin`` is instead of beside
    its manifest (a download's memory file: named by this process, not found in the folder)."""
    try:
        with kernel_dir.subdir(checkpoint_id) as directory:
            encrypted = directory.exists(file_names(True)[1])
            data_name, manifest_name = file_names(encrypted)
            if encrypted and data_key is None:
                raise CheckpointRefused(NO_KEY.format(id=checkpoint_id))
            text = directory.read(manifest_name, MANIFEST_CAP)
            data_info = directory.lstat(data_name) if data_file is None else data_file.stat()
    except FileNotFoundError as exc:
        named = str(exc.filename or "")
        missing = DATA_FILE if named.startswith(DATA_FILE) or named == str(data_file) else MANIFEST_FILE
        raise Untrusted(f"{missing} is missing") from None
    except ValueError as exc:  # a link, not a plain file, too large
        raise Untrusted(str(exc)) from None
    except OSError as exc:
        raise Untrusted(f"{MANIFEST_FILE} cannot be read: {exc}") from None
    if not stat.S_ISREG(data_info.st_mode):
        raise Untrusted(f"{DATA_FILE} is not a plain file (a link or something else)")
    if encrypted and data_key is not None:
        text = cipher.crypt(cipher.manifest_key(cipher.checkpoint_key(data_key, checkpoint_id)), 0, text)
    return check_manifest(text, data_info.st_size, key, owner, kernel_id, checkpoint_id)


def check_manifest(
    text: bytes, data_size: int, key: bytes, owner: str, kernel_id: str, checkpoint_id: str
) -> Manifest:
    """The manifest in ``text`` if it is authentic under ``key`` and names this owner, kernel and
    checkpoint, and ``data.bin`` (``data_size`` bytes) holds what it says; else :class:`Untrusted`."""
    try:
        manifest = Manifest.from_json(text)
    except ManifestError as exc:
        raise Untrusted(exc.message) from None
    if not manifest_is_authentic(key, manifest):
        raise Untrusted(
            "its HMAC does not verify: the manifest or data was modified, or it was written "
            "with another owner's key"
        )
    if manifest.owner != owner:
        raise Untrusted(f"it belongs to owner {manifest.owner!r}, not {owner!r}")
    if manifest.kernel_id != kernel_id:
        raise Untrusted(f"it belongs to kernel {manifest.kernel_id!r}, not {kernel_id!r}")
    if manifest.checkpoint_id != checkpoint_id:
        raise Untrusted(f"its manifest names checkpoint {manifest.checkpoint_id!r}, not {checkpoint_id!r}")
    check_layout(manifest, data_size)
    return manifest


def refuse(kernel_dir: Path | SafeDir, checkpoint_id: str, reason: str) -> CheckpointRefused:
    """Quarantine ``checkpoint_id`` and build the error to raise (refused either way)."""
    try:
        return CheckpointRefused(reason, quarantine(kernel_dir, checkpoint_id, reason))
    except (OSError, ValueError) as exc:
        return CheckpointRefused(f"{reason} (and it could not be moved to quarantine: {exc})")


def load_verified_manifest(
    kernel_dir: Path | SafeDir, key: bytes, owner: str, kernel_id: str, data_key: bytes | None = None
) -> Manifest | None:
    """The committed checkpoint's manifest, verified; ``None`` if nothing is committed.

    Raises :class:`CheckpointRefused` (after quarantining) when it cannot be trusted, and
    again, with the recorded reason, each time ``current`` still names a checkpoint that
    was quarantined earlier.
    """
    try:
        with opened(kernel_dir) as directory:
            return _load_verified(directory, key, owner, kernel_id, data_key)
    except FileNotFoundError:
        return None  # no kernel folder: nothing was ever committed


def load_verified_checkpoint(
    kernel_dir: Path | SafeDir,
    key: bytes,
    owner: str,
    kernel_id: str,
    checkpoint_id: str,
    data_key: bytes | None = None,
    data_file: Path | None = None,
) -> Manifest | None:
    """Checkpoint ``checkpoint_id``'s manifest, verified, read by its id (never through ``current``);
    ``None`` when that checkpoint is not there. ``data_file``: where its ``data.bin`` is, when
    not beside the manifest (a download's memory file).

    The id is the one the kernel reported and the server recorded: ``current`` may be stale (a
    shared file system's attribute cache) or put back to an older checkpoint, so it is not asked.
    Raises :class:`CheckpointRefused` (after quarantining) when it cannot be trusted.
    """
    try:
        with opened(kernel_dir) as directory:
            if not directory.exists(checkpoint_id):
                earlier = quarantined_path(directory, checkpoint_id)
                if earlier is not None:
                    raise CheckpointRefused(quarantine_reason(directory, checkpoint_id), earlier)
                return None
            try:
                return _verify_dir(directory, checkpoint_id, key, owner, kernel_id, data_key, data_file)
            except Untrusted as exc:
                raise refuse(directory, checkpoint_id, str(exc)) from None
    except FileNotFoundError:
        return None


def _load_verified(
    kernel_dir: SafeDir, key: bytes, owner: str, kernel_id: str, data_key: bytes | None = None
) -> Manifest | None:
    for _ in range(_ATTEMPTS):
        try:
            checkpoint_id = read_current(kernel_dir)
        except ValueError as exc:
            raise CheckpointRefused(str(exc)) from None
        if checkpoint_id is None:
            return None
        try:
            return _verify_dir(kernel_dir, checkpoint_id, key, owner, kernel_id, data_key)
        except Untrusted as exc:
            reason = str(exc)
        try:
            still_current = read_current(kernel_dir) == checkpoint_id
        except ValueError:
            still_current = False
        if not still_current:
            continue
        if not kernel_dir.exists(checkpoint_id):
            earlier = quarantined_path(kernel_dir, checkpoint_id)
            if earlier is not None:
                raise CheckpointRefused(quarantine_reason(kernel_dir, checkpoint_id), earlier)
            raise CheckpointRefused(f"checkpoint {checkpoint_id} is missing")
        raise refuse(kernel_dir, checkpoint_id, reason)
    raise CheckpointRefused(f"the committed checkpoint in {kernel_dir.path} kept changing while it was read")
