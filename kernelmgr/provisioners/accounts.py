"""Local kernels that run as their owner's OS account (a multi-user gateway on one machine).

Why: a multi-user gateway that starts every user's kernel as its own OS user gives each user's
cells the rights of every other user's kernel: they read each other's connection files (and
then run code in those kernels), the master checkpoint secret (and forge anyone's checkpoints)
and the gateway's own ``/proc/<pid>/environ`` (its Hub token). Unix already separates users;
this module makes the gateway use it, as JupyterHub's ``LocalProcessSpawner`` does: the gateway
runs as root and each kernel process drops to its owner's account before it executes anything
(``setgid``/``setgroups``/``setuid`` in the child, via ``subprocess``'s ``user``, ``group``,
``extra_groups`` and ``umask``).

What each kernel gets, and why it is safe for root to prepare it:

* ``<runtime_root>/`` and ``<runtime_root>/<account>/``: root's, mode 0711. The connection files
  (kernel message keys) are written here by root and then handed to the account (0600): the
  kernel opens its own by name, nobody else can read it, and since only root can create or
  rename entries, no user can plant a symlink that root would write through.
* ``<runtime_root>/<account>/keys/`` and ``.../home/``: the account's own, 0700. The checkpoint
  key file goes to ``keys/`` (the agent removes it once read, so the account must own that
  folder); root only creates files there with ``O_EXCL | O_NOFOLLOW`` and renames them (a
  rename replaces a planted symlink, it does not follow it). ``home/`` is ``HOME`` for an
  account without a home directory of its own (IPython keeps its history there).
* ``<checkpoint_root>/<owner>/``: the account's, 0700, in a root-owned root (0711): the kernel
  writes its checkpoints there, other users cannot even list it, and root (the gateway) reads all.

Directories are made with plain ``os.mkdir`` and checked with ``lstat`` (a symlink is refused,
never followed), and ownership is given with ``lchown``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelmgr.core.errors import ConfigError, ElasticError

#: Variables of the gateway's environment a kernel never inherits: the Hub's service variables
#: (its API token above all) and Jupyter's own server variables.
SECRET_PREFIXES = ("JUPYTERHUB_", "JPY_", "JUPYTER_GATEWAY_")
#: ... nor anything whose name says it holds a credential.
SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE_?KEY|COOKIE", re.IGNORECASE)
#: Set per account, or left to the account's defaults (the gateway's values point at root's files).
ACCOUNT_VARIABLES = (
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "MAIL",
    "XDG_RUNTIME_DIR",
    "JUPYTER_RUNTIME_DIR",
    "JUPYTER_CONFIG_DIR",
    "JUPYTER_DATA_DIR",
    "IPYTHONDIR",
)

KEYS_DIR = "keys"
HOME_DIR = "home"


class AccountError(ElasticError):
    """A kernel's owner has no usable OS account, or its folders cannot be made safely."""


@dataclass(frozen=True)
class KernelAccount:
    """The OS account one owner's kernels run as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def popen_kwargs(self) -> dict[str, Any]:
        """What ``subprocess.Popen`` needs to start a process as this account, with a 077 umask."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups), "umask": 0o077}


def scrub_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the gateway's secrets (see :data:`SECRET_PREFIXES`, :data:`SECRET_WORDS`)."""
    return {
        name: value
        for name, value in env.items()
        if not name.startswith(SECRET_PREFIXES)
        and not SECRET_WORDS.search(name)
        and name not in ACCOUNT_VARIABLES
    }


def _check_dir(path: Path, uid: int, mode: int) -> None:
    """``path`` is a real directory (not a symlink) owned by ``uid``; its mode is set to ``mode``.

    Checked and changed through one descriptor opened with ``O_NOFOLLOW``: nothing can be
    swapped in between the check and the ``fchmod``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise AccountError(f"{path} is not a directory ({exc.strerror}): remove it") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != uid:
            raise AccountError(f"{path} belongs to uid {info.st_uid}, expected {uid}: remove it")
        if stat.S_IMODE(info.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_dir(path: Path, uid: int, gid: int, mode: int) -> Path:
    """Create ``path`` (one level, never through a symlink) owned by ``uid:gid`` with ``mode``.

    An existing directory is accepted only if it is a real directory owned by ``uid``.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        os.lchown(path, uid, gid)
    _check_dir(path, uid, mode)
    return path


def _traversable_by_others(path: Path) -> str | None:
    """The first folder from ``/`` to ``path`` that other users cannot enter, or ``None``."""
    current = Path(path).resolve()
    for folder in (*reversed(current.parents), current):
        try:
            mode = os.stat(folder).st_mode
        except OSError:
            return None  # not created yet: made below by us, traversable
        if not mode & stat.S_IXOTH:
            return str(folder)
    return None


class KernelAccounts:
    """Resolves owners to OS accounts and prepares what their kernels may touch.

    ``template`` maps a Hub user name to an account name (``"{username}"``: the same name;
    ``"jupyter-{username}"``: a prefix). ``runtime_root`` holds the per-account runtime folders,
    ``checkpoint_root`` the per-owner checkpoint folders.
    """

    def __init__(self, template: str, runtime_root: str | os.PathLike[str], checkpoint_root: str) -> None:
        self.template = template
        self.runtime_root = Path(runtime_root)
        self.checkpoint_root = Path(checkpoint_root)

    # -- start-up ------------------------------------------------------------------------

    @staticmethod
    def check_template(template: str) -> None:
        """ConfigError unless ``template`` formats with ``{username}`` alone."""
        try:
            template.format(username="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"ElasticGateway.kernel_account {template!r} is not a template with only {{username}} "
                f"in it ({exc!r}); e.g. '{{username}}' or 'jupyter-{{username}}'"
            ) from None

    def prepare(self) -> None:
        """Create the root-owned folders (0711) and check kernels can reach them; ConfigError if not."""
        self.check_template(self.template)
        for what, folder in (
            ("ElasticGateway.kernel_runtime_dir", self.runtime_root),
            ("ElasticKernels.checkpoint_root", self.checkpoint_root),
        ):
            try:
                folder.parent.mkdir(parents=True, exist_ok=True)
                make_dir(folder, 0, 0, 0o711)
            except (OSError, AccountError) as exc:
                raise ConfigError(f"{what} {str(folder)!r} cannot hold kernel files: {exc}") from None
            closed = _traversable_by_others(folder)
            if closed is not None:
                raise ConfigError(
                    f"{what} {str(folder)!r} is inside {closed}, which other users cannot enter, so kernels "
                    f"running as their owners cannot reach it: choose another folder (or chmod o+x {closed})"
                )

    # -- per kernel ----------------------------------------------------------------------

    def account_for(self, owner: str) -> KernelAccount:
        """The account ``owner``'s kernels run as; AccountError when there is none or it is root."""
        name = self.template.format(username=owner)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise AccountError(
                f"no system account {name!r} for user {owner!r} (ElasticGateway.kernel_account is "
                f"{self.template!r}): create it (useradd {name}) before they start kernels"
            ) from None
        if entry.pw_uid == 0:
            raise AccountError(f"user {owner!r} maps to {name!r}, which is root: a kernel never runs as root")
        groups = tuple(gid for gid in os.getgrouplist(name, entry.pw_gid) if gid != entry.pw_gid)
        return KernelAccount(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)

    def runtime_dir(self, account: KernelAccount) -> Path:
        """``<runtime_root>/<account>``: root's, 0711 (connection files are handed over in it)."""
        return make_dir(self.runtime_root / account.name, 0, 0, 0o711)

    def keys_dir(self, account: KernelAccount) -> Path:
        """``<runtime_root>/<account>/keys``: the account's, 0700 (the agent removes its key file)."""
        return make_dir(self.runtime_dir(account) / KEYS_DIR, account.uid, account.gid, 0o700)

    def home_of(self, account: KernelAccount) -> Path:
        """The account's home if it has one of its own, else ``<runtime_root>/<account>/home`` (0700)."""
        with contextlib.suppress(OSError):
            info = os.stat(account.home)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == account.uid:
                return Path(account.home)
        return make_dir(self.runtime_dir(account) / HOME_DIR, account.uid, account.gid, 0o700)

    def owner_checkpoints(self, account: KernelAccount, owner: str) -> Path:
        """``<checkpoint_root>/<owner>``, the account's with 0700.

        A folder left by a shared-account gateway (root's) is handed over with what it holds
        (``lchown`` on each entry, no symlink followed), so the owner's kernels can read and
        replace their earlier checkpoints.
        """
        folder = self.checkpoint_root / owner
        try:
            os.mkdir(folder, 0o700)
            os.lchown(folder, account.uid, account.gid)
        except FileExistsError:
            info = os.lstat(folder)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == 0:
                _hand_over_tree(folder, account)
        _check_dir(folder, account.uid, 0o700)
        return folder

    def hand_over(self, path: Path, account: KernelAccount) -> None:
        """Give a file root wrote in a root-owned folder (a connection file) to the account."""
        os.lchown(path, account.uid, account.gid)

    def environment(self, env: dict[str, str], account: KernelAccount) -> dict[str, str]:
        """The kernel's environment: ``env`` without the gateway's secrets, with the account's
        identity and a runtime folder it may write."""
        clean = scrub_environment(env)
        home = self.home_of(account)
        entry = pwd.getpwuid(account.uid)
        clean.update(
            HOME=str(home),
            USER=account.name,
            LOGNAME=account.name,
            SHELL=entry.pw_shell or "/bin/sh",
            # Created by the kernel itself, as the account, if it needs one.
            JUPYTER_RUNTIME_DIR=str(home / ".local" / "share" / "jupyter" / "runtime"),
        )
        return clean


def _hand_over_tree(folder: Path, account: KernelAccount) -> None:
    for parent, dirs, files in os.walk(folder):  # followlinks=False: symlinks are listed, not entered
        for name in (*dirs, *files):
            os.lchown(os.path.join(parent, name), account.uid, account.gid)
    os.lchown(folder, account.uid, account.gid)


__all__ = ["AccountError", "KernelAccount", "KernelAccounts", "scrub_environment"]
