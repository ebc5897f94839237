"""Checkpoint folders opened name by name, never through a symlink, and files read with a size cap.

Why: an owner's folder is writable by that owner's kernels (a kernel pod mounts it as its
``subPath``). A relative symlink made there (``alice/k1 -> ../bob/k2``) still resolves under
the checkpoint root, so a check on the resolved path lets it through, and the server would
read, verify with the wrong key, quarantine, push or delete another owner's checkpoint.
Here every name is opened relative to its parent's descriptor with ``O_NOFOLLOW``: a symlink
(or a FIFO, or a device) anywhere in an owner's tree is refused, and a folder swapped for a
link after it was opened cannot redirect what follows. Deletes walk the tree by
descriptor too, and never follow a link.

Every file the server reads from such a folder is read through :meth:`SafeDir.read` with a
cap, so a kernel cannot make the server read (and hold) a file of any size.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from kernelmgr.checkpoint.sharing import shared_mkdir

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO someone put in place of a file must not block the caller.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafePath(ValueError):
    """A symlink, or something else than a plain folder or file, where the server expects one."""


class TooLarge(ValueError):
    """A file is larger than the server reads."""


def check_name(name: str) -> str:
    """``name`` if it is one plain path component, else ``UnsafePath``."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise UnsafePath(f"{name!r} is not a plain file name")
    return name


#: The longest owner name or kernel id the stores accept as a folder name.
MAX_COMPONENT = 128


def check_component(what: str, value: str) -> str:
    """``value`` if it is safe as one path component, else ``ValueError`` saying why."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    if len(value) > MAX_COMPONENT:
        raise ValueError(f"{what} is longer than {MAX_COMPONENT} characters")
    if value.startswith("."):
        raise ValueError(f"{what} {value!r} must not start with '.'")
    if any(ch in value for ch in "/\\") or any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{what} {value!r} must not contain '/', '\\\\' or control characters")
    if value != value.strip():
        raise ValueError(f"{what} {value!r} must not start or end with whitespace")
    return value


class SafeDir:
    """An open folder; names in it are opened, listed, renamed and removed without following links."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        #: For messages and for handing to a kernel; never opened by the server again.
        self.path = path

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SafeDir:
        """Open a folder given by a trusted path (the root, the agent's own folder)."""
        return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), Path(path))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def subdir(self, name: str, *, create: bool = False, mode: int = 0o700) -> SafeDir:
        """The folder ``name`` in this one (made if ``create``); ``UnsafePath`` for a link or a file."""
        check_name(name)
        if create:
            with contextlib.suppress(FileExistsError), shared_mkdir(self.fd, mode) as made_mode:
                os.mkdir(name, made_mode, dir_fd=self.fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafePath(
                    f"{self.path / name} is a symlink or not a folder: refused (the server follows no links "
                    "in checkpoint folders)"
                ) from None
            raise
        return SafeDir(fd, self.path / name)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(check_name(name), dir_fd=self.fd, follow_symlinks=False)

    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a real folder (a link to one is not)."""
        try:
            return stat.S_ISDIR(self.lstat(name).st_mode)
        except FileNotFoundError:
            return False

    def exists(self, name: str) -> bool:
        try:
            self.lstat(name)
        except FileNotFoundError:
            return False
        return True

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def disk_bytes(self, name: str) -> int:
        """Bytes on disk of ``name`` (a file, or a folder and all below it), no link followed:
        what a user's checkpoints take from the shared volume, leftovers and quarantine included."""
        return _disk_bytes(self.fd, check_name(name), 0)

    def open_file(self, name: str) -> int:
        """A descriptor of the plain file ``name`` (the caller closes it); ``UnsafePath`` otherwise."""
        try:
            fd = os.open(check_name(name), _FILE_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(f"{self.path / name} is a symlink: refused") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePath(f"{self.path / name} is not a plain file: refused")
        os.set_blocking(fd, True)
        return fd

    def read(self, name: str, cap: int) -> bytes:
        """The whole plain file ``name``; :class:`TooLarge` past ``cap`` bytes (never read further)."""
        fd = self.open_file(name)
        try:
            size = os.fstat(fd).st_size
            if size > cap:
                raise TooLarge(f"{self.path / name} has {size} bytes, more than the {cap} the server reads")
            parts = []
            left = cap + 1  # one more: a file that grows while read is refused too
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                parts.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(parts)
        if len(data) > cap:
            raise TooLarge(f"{self.path / name} has more than the {cap} bytes the server reads")
        return data

    def remove(self, name: str) -> None:
        """Delete ``name``: a folder with what is in it, or a file or link (never what a link points at)."""
        info = self.lstat(name)
        if stat.S_ISDIR(info.st_mode):
            _rmtree(self.fd, name, 0)
        else:
            os.unlink(name, dir_fd=self.fd)

    def rename(self, name: str, target: SafeDir, new_name: str) -> None:
        """Move ``name`` (the entry itself: a link moves as a link) to ``target/new_name``."""
        os.rename(check_name(name), check_name(new_name), src_dir_fd=self.fd, dst_dir_fd=target.fd)

    def write_atomic(self, name: str, data: bytes, mode: int = 0o600) -> None:
        """Replace ``name`` with ``data`` whole (a temporary file beside it, fsynced, renamed)."""
        tmp = f".{check_name(name)}.{secrets.token_hex(4)}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd
        )
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise
        self.fsync()

    def create_file(self, name: str, mode: int = 0o600) -> int:
        """A new file's descriptor (replacing a file or link of that name; never writing through one)."""
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISDIR(self.lstat(name).st_mode):
                os.unlink(name, dir_fd=self.fd)
        return os.open(
            check_name(name),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            mode,
            dir_fd=self.fd,
        )

    def fsync(self) -> None:
        os.fsync(self.fd)


#: Folders deeper than this in a checkpoint folder are not removed (an error instead of a crash).
_MAX_DEPTH = 256


def _rmtree(parent: int, name: str, depth: int) -> None:
    """``shutil.rmtree`` relative to a descriptor, never through a link (3.10 has no ``dir_fd`` there)."""
    if depth > _MAX_DEPTH:
        raise OSError(errno.ELOOP, f"folders nested deeper than {_MAX_DEPTH}", name)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)  # ELOOP: it became a link since it was looked at
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    _rmtree(fd, entry.name, depth + 1)
                else:
                    os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _disk_bytes(parent: int, name: str, depth: int) -> int:
    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode):
        return info.st_blocks * 512 if stat.S_ISREG(info.st_mode) else 0
    if depth > _MAX_DEPTH:
        return 0
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError:  # became a link, or vanished, since the stat: nothing of it to count
        return 0
    try:
        total = 0
        with os.scandir(fd) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    total += _disk_bytes(fd, entry.name, depth + 1)
        return total
    finally:
        os.close(fd)


@contextlib.contextmanager
def opened(directory: Path | SafeDir) -> Iterator[SafeDir]:
    """``directory`` as a :class:`SafeDir`: as given, or opened from a trusted path (and closed after)."""
    if isinstance(directory, SafeDir):
        yield directory
        return
    with SafeDir.open(directory) as opened_dir:
        yield opened_dir
