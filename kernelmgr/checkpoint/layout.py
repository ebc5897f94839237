"""The kernel directory: names in it, the ``current`` pointer, quarantine, and cleanup.

Everything that renames or deletes inside a kernel directory lives here, so the rules that
make a crash safe are in one place:

* a checkpoint is written under ``.partial-<id>/`` and renamed to ``<id>/`` only when
  complete and fsynced; readers never look at ``.partial-*``;
* ``current`` is the single commit point: a checkpoint exists for readers only once
  ``current`` names it, and ``current`` is replaced with ``rename`` (atomic), so a reader
  sees the old name or the new one, never a torn file;
* older checkpoints are deleted only after ``current`` names the new one;
* a checkpoint that fails verification is *moved* to ``quarantine/`` with a reason, never
  deleted automatically: it may be the only copy of someone's work, and an admin may want
  to see what was wrong with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path

from kernelmgr.checkpoint.integrity import fsync_dir
from kernelmgr.checkpoint.safedir import SafeDir, opened

log = logging.getLogger(__name__)

CURRENT = "current"
DATA_FILE = "data.bin"
MANIFEST_FILE = "manifest.json"
#: An encrypted checkpoint's files carry this suffix (``data.bin.aes``, ``manifest.json.aes``): a
#: reader knows from the names alone which it holds (checkpoints from before stay plaintext).
ENCRYPTED_SUFFIX = ".aes"


def file_names(encrypted: bool) -> tuple[str, str]:
    """``(data file, manifest file)`` of a checkpoint, encrypted at rest or not."""
    suffix = ENCRYPTED_SUFFIX if encrypted else ""
    return DATA_FILE + suffix, MANIFEST_FILE + suffix


QUARANTINE = "quarantine"
REASON_FILE = "reason.txt"
RESTORE_REPORT = "restore-report.json"
PARTIAL_PREFIX = ".partial-"
CHECKPOINT_PREFIX = "ckpt-"

#: Out-of-band buffers start at multiples of this in ``data.bin``, so restored arrays are
#: aligned for any dtype and SIMD loads; the only gaps in ``data.bin`` are this padding.
ALIGN = 64

CHECKPOINT_ID_RE = re.compile(r"^ckpt-\d{8}T\d{12}-[0-9a-f]{8}$")


def new_checkpoint_id(now: float | None = None) -> str:
    """``ckpt-<UTC time to the microsecond>-<8 hex>``: sorts by time, never collides."""
    moment = datetime.fromtimestamp(time.time() if now is None else now, tz=timezone.utc)
    return f"{CHECKPOINT_PREFIX}{moment:%Y%m%dT%H%M%S%f}-{secrets.token_hex(4)}"


def is_checkpoint_id(name: str) -> bool:
    return bool(CHECKPOINT_ID_RE.match(name))


def write_file_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` so readers see the old file or the new one, whole.

    Write a temporary file beside it, fsync it (so the new name never points at missing
    data after a crash), rename it over ``path`` (atomic on POSIX), fsync the directory (so
    the rename itself survives a crash).
    """
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


#: ``current`` holds one checkpoint id and a newline; the server reads no more than this of it.
CURRENT_CAP = 256


def read_current(kernel_dir: Path | SafeDir) -> str | None:
    """The committed checkpoint's id, or ``None`` when nothing was ever committed.

    Raises ``ValueError`` when ``current`` does not hold a checkpoint id: its content is
    used as a path, so anything else (``../x``, a symlink, a huge file) is refused rather
    than followed.
    """
    try:
        with opened(kernel_dir) as directory:
            raw = directory.read(CURRENT, CURRENT_CAP)
    except FileNotFoundError:
        return None
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{_where(kernel_dir) / CURRENT} is not a checkpoint name") from None
    if not is_checkpoint_id(text):
        raise ValueError(f"{_where(kernel_dir) / CURRENT} names {text[:80]!r}, which is not a checkpoint")
    return text


def _where(kernel_dir: Path | SafeDir) -> Path:
    return kernel_dir.path if isinstance(kernel_dir, SafeDir) else kernel_dir


def publish_current(kernel_dir: Path | SafeDir, checkpoint_id: str) -> None:
    """The commit point: make ``current`` name ``checkpoint_id``."""
    data = f"{checkpoint_id}\n".encode("ascii")
    if isinstance(kernel_dir, SafeDir):
        kernel_dir.write_atomic(CURRENT, data, mode=0o644)
    else:
        write_file_atomic(kernel_dir / CURRENT, data, mode=0o644)


def remove_stale(kernel_dir: Path | SafeDir, keep: str | None) -> None:
    """Delete what a crashed or superseded write left: ``.partial-*``, temp files, and
    every ``ckpt-*`` except ``keep`` (the committed one, ``None`` if nothing is).

    When ``current`` is unreadable, no ``ckpt-*`` is deleted: which one was committed is
    unknown, and deleting could lose the only good copy. Called by the kernel's own agent
    before and after it writes (one agent writes a kernel directory at a time), and by the
    server once that kernel's process has stopped. A link is removed as a link: what it
    points at is never touched.
    """
    try:
        with opened(kernel_dir) as directory:
            _remove_stale(directory, keep)
    except (FileNotFoundError, NotADirectoryError):
        return


def _remove_stale(directory: SafeDir, keep: str | None) -> None:
    try:
        read_current(directory)
        current_known = True
    except ValueError:
        current_known = False
    for name in directory.names():
        stale = (
            name.startswith(PARTIAL_PREFIX)
            or (name.startswith(".") and name.endswith(".tmp"))
            or (current_known and is_checkpoint_id(name) and name != keep)
        )
        if not stale:
            continue
        try:
            directory.remove(name)
        except OSError as exc:
            log.warning("could not remove %s: %s", directory.path / name, exc)


def quarantined_path(kernel_dir: Path | SafeDir, checkpoint_id: str) -> Path | None:
    """Where ``checkpoint_id`` was quarantined, if it was (a real folder, not a link)."""
    try:
        with opened(kernel_dir) as directory, directory.subdir(QUARANTINE) as box:
            return box.path / checkpoint_id if box.is_dir(checkpoint_id) else None
    except (OSError, ValueError):
        return None


#: ``reason.txt`` is one line the server wrote; it reads no more than this of it.
REASON_CAP = 64 * 1024


def quarantine_reason(kernel_dir: Path | SafeDir, name: str) -> str:
    """The first line of ``quarantine/<name>/reason.txt``."""
    try:
        with (
            opened(kernel_dir) as directory,
            directory.subdir(QUARANTINE) as box,
            box.subdir(name) as kept,
        ):
            lines = kept.read(REASON_FILE, REASON_CAP).decode("utf-8", "replace").splitlines()
    except (OSError, ValueError):
        return "it was quarantined earlier"
    return lines[0] if lines else "it was quarantined earlier"


def quarantine(kernel_dir: Path | SafeDir, checkpoint_id: str, reason: str) -> Path | None:
    """Move a checkpoint aside with ``reason.txt``; return where it went.

    ``None`` when the checkpoint directory is gone (another process quarantined it first
    or it was never there). ``current`` is left alone: the next commit replaces it, and
    a reader that finds ``current`` naming a quarantined checkpoint refuses it again with
    the recorded reason instead of reporting "no checkpoint". The entry is moved as it is:
    a link is moved as a link (what it points at stays where it is); ``quarantine`` itself
    must be a real folder.
    """
    with opened(kernel_dir) as directory, directory.subdir(QUARANTINE, create=True) as box:
        target = checkpoint_id
        suffix = 1
        while box.exists(target):
            target = f"{checkpoint_id}.{suffix}"
            suffix += 1
        try:
            directory.rename(checkpoint_id, box, target)
        except FileNotFoundError:
            return quarantined_path(directory, checkpoint_id)
        stamp = datetime.now(tz=timezone.utc).isoformat()
        if box.is_dir(target):
            with box.subdir(target) as kept:
                fd = kept.create_file(REASON_FILE)
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(f"{reason}\nquarantined at {stamp}\n")
        with contextlib.suppress(OSError):
            box.fsync()
        where = box.path / target
    log.warning("quarantined checkpoint %s: %s", where, reason)
    return where
