"""Owner checkpoint folders a server that is not root shares with kernels running as their users' uids.

A kernel that runs as its user's own uid (``user_ids``, the Hub's auth state) must write into its
owner's checkpoint folder, and the server must read, prune and delete what it wrote. A root server
gives the folder away (``chown``). A server that is not root cannot, so the folder stays the
server's and is shared through the server's group G (the gateway pod's ``fsGroup`` or its own gid):

* ``<root>/<owner>`` is the server's, group G, mode ``3773``: setgid (everything a kernel makes in it
  belongs to group G, whatever the kernel's own gid), sticky (only an entry's owner, or the server,
  may rename or delete it), others ``-wx`` (a kernel makes its folder there by name, lists nothing).
* the kernel's agent makes its kernel and checkpoint folders ``2770`` (its own uid, group G): the
  server reaches them through its group, every other uid through nothing (others ``---``). Files
  keep the agent's modes (manifest ``0640``: the server reads it; ``data.bin`` ``0600``).

Why not the alternatives: a group every kernel shares (kernels in G through ``supplementalGroups``)
would let one owner's kernel read another's checkpoints wherever both folders are reachable (a
local gateway, a claim mounted whole); the owner's own gid instead would need a server in every
user's group; POSIX ACLs are not there on every file system (NFSv4 has its own). Kernel pods mount
only their owner's folder (a sub-path) anyway; these modes keep owners apart even where they do not.

The setgid bit only survives if nobody ``chmod``s a folder (Linux drops it when someone outside G
does), so the agent makes its folders with the group bits in the ``mkdir`` itself: its umask is set
to ``007`` for the ``mkdir`` only (the umask is per process: a lock keeps the agent's own threads
out of each other's way; another thread of the kernel creating a file at that instant gets
``007``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

#: ``<root>/<owner>`` shared with the owner's kernels (see the module docstring).
OWNER_FOLDER_MODE = 0o3773
#: A kernel's folders in a shared owner folder: its own and the server's group's.
KERNEL_FOLDER_MODE = 0o770
_UMASK = 0o007
_umask_lock = threading.Lock()


def shared_with_server(folder: str | os.PathLike[str] | int) -> bool:
    """Whether ``folder`` (a path or an open descriptor) is a shared one: setgid, of a group this
    process is not in (the server's)."""
    try:
        info = os.stat(folder)
    except OSError:
        return False
    if not info.st_mode & stat.S_ISGID:
        return False
    return info.st_gid != os.getegid() and info.st_gid not in os.getgroups()


def _existing_parent(path: Path) -> Path:
    for folder in (path, *path.parents):
        if folder.exists():
            return folder
    return path


@contextlib.contextmanager
def _group_umask() -> Iterator[None]:
    with _umask_lock:
        old = os.umask(_UMASK)
        try:
            yield
        finally:
            os.umask(old)


@contextlib.contextmanager
def shared_mkdir(parent: str | os.PathLike[str] | int, mode: int) -> Iterator[int]:
    """Around a ``mkdir`` in ``parent``: the mode to pass (``mode``, or ``2770``'s bits in a shared
    folder, with the umask that keeps them)."""
    if not shared_with_server(parent):
        yield mode
        return
    with _group_umask():
        yield KERNEL_FOLDER_MODE


def make_kernel_dir(path: str | os.PathLike[str], mode: int = 0o700, *, exist_ok: bool = False) -> None:
    """``mkdir -p path`` for the agent: ``mode``, or in a shared owner folder ``2770`` (the server's
    group inherited, with the bits in the ``mkdir`` itself: a ``chmod`` would drop the setgid bit)."""
    target = Path(path)
    if not shared_with_server(_existing_parent(target.parent)):
        target.mkdir(mode=mode, parents=True, exist_ok=exist_ok)
        return
    with _group_umask():
        target.mkdir(mode=KERNEL_FOLDER_MODE, parents=True, exist_ok=exist_ok)


def give_owner_folder(folder: str | os.PathLike[str], uid: int, gid: int) -> None:
    """Make ``folder`` (the server made it) writable by the owner's kernels running as ``uid``/``gid``:
    a root server gives it to them (``chown``); any other server shares it through its own group
    (:data:`OWNER_FOLDER_MODE`). Never follows a link; a folder that is neither the server's nor the
    owner's raises ``PermissionError`` naming it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if os.geteuid() == 0:
            if (info.st_uid, info.st_gid) != (uid, gid):
                os.fchown(fd, uid, gid)
            return
        if info.st_uid == uid and info.st_uid != os.geteuid():
            return  # given earlier by a root server: the owner's own, as before
        if info.st_uid != os.geteuid():
            raise PermissionError(
                f"{folder} belongs to uid {info.st_uid}, neither this server ({os.geteuid()}) nor its owner "
                f"({uid}): remove it (or give it to uid {os.geteuid()})"
            )
        if stat.S_IMODE(info.st_mode) != OWNER_FOLDER_MODE:
            os.fchmod(fd, OWNER_FOLDER_MODE)
    finally:
        os.close(fd)
