"""Checkpoint keys: derived on the server, handed to one kernel, never put in its environment.

The server holds one secret (``ElasticKernels.checkpoint_secret_file``: a file only the server's
account can read, never on the checkpoint volume). A kernel gets only its owner's
key, ``owner_key(secret, owner)``, and gets it in a *file*, not an environment variable:
an environment variable is readable by every later cell (``os.environ``), is inherited by
every child process (``!pip``, ``subprocess``) and shows up in ``/proc/<pid>/environ`` for
as long as the kernel lives. A file can be made readable by its owner only and removed as
soon as the agent has read it. What a file cannot do is hide the key from code running in
the same process afterwards: the agent keeps the key in memory to sign its checkpoints, so
a cell that goes looking (``gc.get_objects()``) can still find it. That is acceptable for
its *own* owner's key (a user forging their own checkpoints gains nothing they could not do
with a cell) and is why a kernel must never be handed anything more than that key.

This module is the one seam every provisioner goes through:

* :func:`owner_key` derives the key (server side);
* :func:`encode_key` is what a key file holds, the same bytes whether the local provisioner
  writes the file (:func:`write_key_file`) or a Kubernetes provisioner puts them in a
  per-kernel Secret mounted into the pod;
* :func:`read_key_file` is what the agent calls at load time; with ``consume=True`` (the local
  handover) it also removes the file, so a later cell cannot simply read it off disk.

``ELASTIC_CHECKPOINT_KEY_FILE`` (:data:`ENV_KEY_FILE`) names the file; nothing else about the
key is in the kernel's environment. With checkpoints encrypted at rest on a file system, the same
file carries a second line: the kernel's encryption key (:func:`read_keys`), handed over the
same way and for the same reasons.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

#: The environment variable that tells the agent where its key file is.
ENV_KEY_FILE = "ELASTIC_CHECKPOINT_KEY_FILE"

#: Length of an owner key (HMAC-SHA256 output).
KEY_BYTES = 32

#: The directory (under the Jupyter runtime directory) that holds the local key files.
KEY_DIR_NAME = "elastic-keys"

_OWNER_KEY_LABEL = b"jupyter-elastic-kernels/owner-key/v1\x00"
_MAX_FILE_BYTES = 4096


class KeyFileError(ValueError):
    """A key file could not be written or is not one the agent may trust; the message says why."""


def owner_key(secret: bytes, owner: str) -> bytes:
    """The key one owner's kernels sign and verify checkpoints with.

    HMAC(secret, label || owner): knowing one owner's key reveals nothing about the secret
    or about another owner's key, so a kernel given its own owner's key learns nothing else.
    """
    if not owner:
        raise ValueError("owner must be a non-empty string")
    return hmac.new(secret, _OWNER_KEY_LABEL + owner.encode("utf-8"), hashlib.sha256).digest()


def encode_key(key: bytes, data_key: bytes | None = None) -> bytes:
    """The contents of a key file: the key in hex and a newline (the same for a Kubernetes Secret),
    then the kernel's encryption key the same way when its checkpoints are encrypted at rest."""
    lines = b""
    for value in (key, data_key):
        if value is None:
            continue
        if len(value) != KEY_BYTES:
            raise ValueError(f"a checkpoint key is {KEY_BYTES} bytes, not {len(value)}")
        lines += value.hex().encode("ascii") + b"\n"
    return lines


def decode_keys(data: bytes, source: str) -> tuple[bytes, bytes | None]:
    """The keys in ``data`` (what :func:`encode_key` wrote): the signing key and the encryption key
    or ``None``; :class:`KeyFileError` naming ``source``."""
    try:
        lines = data.decode("ascii").split()
        keys = [bytes.fromhex(line) for line in lines]
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError(f"{source} does not hold a hex checkpoint key") from None
    if not 1 <= len(keys) <= 2:
        raise KeyFileError(f"{source} holds {len(keys)} keys, a key file holds one or two")
    for key in keys:
        if len(key) != KEY_BYTES:
            raise KeyFileError(f"{source} holds a {len(key)}-byte key, a checkpoint key is {KEY_BYTES} bytes")
    return keys[0], keys[1] if len(keys) == 2 else None


def decode_key(data: bytes, source: str) -> bytes:
    """The signing key in ``data`` (what :func:`encode_key` wrote)."""
    return decode_keys(data, source)[0]


def private_key_dir(parent: str | os.PathLike[str]) -> Path:
    """``<parent>/elastic-keys``, created 0700; refused unless it is a directory only we can enter.

    ``parent`` is the Jupyter runtime directory (where connection files, which hold the
    kernels' message keys, already live): local to the machine and private to the user,
    unlike a checkpoint root that may be a shared volume. The checks stop a key file from
    being written where another user could read it or swap it (a directory they created or
    a symlink they planted).
    """
    directory = Path(parent) / KEY_DIR_NAME
    Path(parent).mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise KeyFileError(f"{directory} is not a directory; remove it so a private one can be created")
    if info.st_uid != os.geteuid():
        raise KeyFileError(f"{directory} belongs to another user (uid {info.st_uid}); remove it")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700)  # ours, but created with a looser mode: tighten it
    return directory


def key_file_path(directory: str | os.PathLike[str], kernel_id: str) -> Path:
    """Where the key of ``kernel_id`` is handed over, inside a :func:`private_key_dir`."""
    if not kernel_id or "/" in kernel_id or "\\" in kernel_id or kernel_id.startswith("."):
        raise ValueError(f"kernel id {kernel_id!r} cannot name a file")
    return Path(directory) / f"kernel-{kernel_id}.key"


def write_key_file(
    path: str | os.PathLike[str],
    key: bytes,
    owner: tuple[int, int] | None = None,
    data_key: bytes | None = None,
) -> Path:
    """Write ``key`` (and ``data_key``, when checkpoints are encrypted at rest) to ``path``
    readable by its owner only (0600), replacing any previous file.

    ``owner`` (uid, gid): the account the file is for, when that is not ours (a kernel running
    as its owner's account, started by a root gateway); the file is handed over before it
    gets its name.

    The bytes go to a new temporary file beside ``path`` created with ``O_EXCL`` (so it cannot
    be a file or symlink someone else prepared) and mode 0600 from the start (never briefly
    readable by others), then are renamed over ``path`` (atomic: the agent sees the old
    file or the new one, whole). Not fsynced: the file matters only until the kernel reads
    it, and a machine crash ends the kernel too.
    """
    target = Path(path)
    data = encode_key(key, data_key)
    tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # the umask can only clear bits; say the mode anyway
            if owner is not None:
                os.fchown(fd, *owner)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return target


def remove_key_file(path: str | os.PathLike[str]) -> None:
    """Remove a key file that was handed over (already consumed or not)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def read_key_file(path: str | os.PathLike[str], *, consume: bool = True) -> bytes:
    """The signing key in ``path`` (see :func:`read_keys`)."""
    return read_keys(path, consume=consume)[0]


def read_keys(
    path: str | os.PathLike[str], *, consume: bool = True, remove: bool = True
) -> tuple[bytes, bytes | None]:
    """The keys in ``path`` (signing, encryption or ``None``); with ``consume`` (a file handed
    over locally) the file is removed, unless ``remove=False`` (the restore download that starts
    before the agent, :mod:`kernelmgr.checkpoint.prefetch`, reads it with the same checks and
    leaves it for the agent, which removes it).

    ``consume=True`` expects exactly what :func:`write_key_file` made: a regular file (not a
    symlink) owned by this user and readable by nobody else; anything else is refused
    (:class:`KeyFileError`), because then someone else may have read or planted the key.
    ``consume=False`` is for a read-only mount the kernel cannot remove from (a Kubernetes
    Secret volume: files there are symlinks into a ``..data`` directory, owned by root with
    the pod's group); it refuses only a file that every user may read.
    """
    source = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if consume:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(source, flags)
    except FileNotFoundError:
        raise KeyFileError(
            f"key file {source} does not exist (it is removed once read: one key file per kernel start)"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KeyFileError(f"key file {source} is a symlink; refusing it") from None
        raise KeyFileError(f"key file {source} cannot be read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"key file {source} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if consume and info.st_uid != os.geteuid():
            raise KeyFileError(f"key file {source} belongs to uid {info.st_uid}, not to this user")
        if mode & (0o077 if consume else 0o007):
            raise KeyFileError(f"key file {source} has mode {mode:o}: others could have read the key")
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        raise KeyFileError(f"key file {source} is too large to hold a key")
    keys = decode_keys(data, f"key file {source}")
    if consume and remove:
        try:
            remove_key_file(source)
        except OSError as exc:
            raise KeyFileError(
                f"key file {source} could not be removed after reading: {exc.strerror or exc}"
            ) from None
    return keys


__all__ = [
    "ENV_KEY_FILE",
    "KEY_BYTES",
    "KeyFileError",
    "decode_key",
    "decode_keys",
    "encode_key",
    "key_file_path",
    "owner_key",
    "private_key_dir",
    "read_key_file",
    "read_keys",
    "remove_key_file",
    "write_key_file",
]
