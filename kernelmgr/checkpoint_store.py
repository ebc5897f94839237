"""The server's view of checkpoints: the checkpoint store interface, and its file-system
implementation (one directory per kernel under a root, per owner, on a local disk or a shared
claim). The object-store implementation (:class:`kernelmgr.objectstore.store.ObjectCheckpointStore`)
keeps this class's local folders as the kernels' scratch space and the bucket as the truth.

What every store does for the lifecycle: :meth:`CheckpointStore.commit` records the checkpoint a
kernel *reports* (its signed manifest, verified), :meth:`~CheckpointStore.latest` finds the newest
committed one after a restart, :meth:`~CheckpointStore.agent_env` tells a kernel where to write and
what to restore, :meth:`~CheckpointStore.prune` and :meth:`~CheckpointStore.remove` delete. A store
whose :attr:`~CheckpointStore.uploads` is true also takes the data through
:meth:`~CheckpointStore.begin_upload` / :meth:`~CheckpointStore.finish_upload`.

Runs in the server only, outside :mod:`kernelmgr.checkpoint` (whose modules run in kernels too).

The server never unpickles: it locates kernel directories, derives each owner's key for
the agent, reads verified manifests for the REST API, reads the agent's restore report,
and deletes a kernel's checkpoints when the kernel is shut down for good. Everything here
is cheap (manifests only; ``data.bin`` is checked by size, its digest by the agent before
it unpickles).

Paths are built from an owner name and a kernel id that come from requests, so both are
validated to be one plain path component. Owner folders are writable by their owner's kernels,
so the server opens them name by name and follows no link (:mod:`kernelmgr.checkpoint.safedir`):
a link in one owner's folder cannot reach another's checkpoints, and every file it reads there
has a size cap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kernelmgr.checkpoint import cipher
from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.keys import ENV_KEY_FILE, owner_key
from kernelmgr.checkpoint.layout import (
    CURRENT,
    DATA_FILE,
    MANIFEST_FILE,
    QUARANTINE,
    RESTORE_REPORT,
    file_names,
    read_current,
    remove_stale,
)
from kernelmgr.checkpoint.progress import CHECKPOINT_PROGRESS, read_progress
from kernelmgr.checkpoint.safedir import SafeDir, TooLarge, UnsafePath, check_component
from kernelmgr.checkpoint.termination import ENV_CHECKPOINT_ON_SIGTERM
from kernelmgr.checkpoint.verify import (
    MANIFEST_CAP,
    NO_KEY,
    Untrusted,
    check_manifest,
    load_verified_manifest,
)
from kernelmgr.core.manifest import Manifest, ManifestError
from kernelmgr.objectstore.envelope import EnvelopeError, FileKeyRecords, OwnerKeys

log = logging.getLogger(__name__)

#: The agent's restore report lists each variable with a reason; the server reads no more than this.
RESTORE_REPORT_CAP = 8 * 1024 * 1024


@dataclass(frozen=True)
class Upload:
    """A multipart upload the server started for a kernel's ``data.bin`` (object stores only)."""

    owner: str
    kernel_id: str
    checkpoint_id: str
    key: str
    upload_id: str
    urls: list[str]
    part_size: int
    #: The checkpoint's encryption key for the kernel (hex), or "" (not encrypted).
    checkpoint_key: str = ""


class CheckpointStore:
    """Checkpoints under ``root``: ``<root>/<owner>/<kernel_id>/`` per kernel.

    The interface every store implements (the file-system one here); see the module docstring.
    ``master_keys`` (the first is current): checkpoints are encrypted at rest, each kernel with its
    own key derived from its owner's envelope key (:class:`~kernelmgr.objectstore.envelope.OwnerKeys`,
    wrapped keys in :class:`FileKeyRecords`).
    """

    #: Whether the kernel's data goes through :meth:`begin_upload` (an object store) or is
    #: committed where the kernel wrote it (a file system the server shares).
    uploads = False

    def __init__(
        self, root: str | os.PathLike[str], secret: bytes, *, master_keys: list[bytes] | None = None
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the checkpoint secret must be at least 16 bytes")
        self.root = Path(root)
        self._secret = secret
        #: Encryption at rest of the file system's checkpoints (``None``: plaintext).
        self.file_keys = None
        if master_keys:
            setting = "ElasticKernels.checkpoint_encryption_key_files"
            self.file_keys = OwnerKeys(FileKeyRecords(root), "", master_keys, setting=setting)
        # Summaries by (owner, kernel id), valid while ``current`` is the same file:
        # ``/api/elastic/kernels`` must not read and verify every manifest per request; one
        # ``stat`` tells whether a new checkpoint was committed since (commits replace it).
        self._summaries: dict[tuple[str, str], tuple[tuple[int, ...], dict[str, Any] | None]] = {}

    def kernel_dir(self, owner: str, kernel_id: str) -> Path:
        """The kernel directory's path, for a kernel's agent (not created). Raises ``ValueError`` for
        unsafe names, and for an owner or kernel folder that is a symlink.

        The server itself never opens this path: it opens folders with :meth:`open_kernel_dir`.
        """
        owner_dir = self.root / check_component("owner", owner)
        path = owner_dir / check_component("kernel id", kernel_id)
        for folder in (owner_dir, path):
            try:
                if stat.S_ISLNK(os.lstat(folder).st_mode):
                    raise UnsafePath(
                        f"{folder} is a symlink: refused (checkpoint folders must be real folders)"
                    )
            except FileNotFoundError:
                break
        return path

    def open_kernel_dir(self, owner: str, kernel_id: str, *, create: bool = False) -> SafeDir:
        """The kernel directory, opened name by name under the root without following any link.

        ``FileNotFoundError`` when it does not exist (unless ``create``); :class:`UnsafePath` (a
        ``ValueError``) when the owner or kernel folder is a symlink or not a folder.
        """
        owner = check_component("owner", owner)
        kernel_id = check_component("kernel id", kernel_id)
        if create:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with SafeDir.open(self.root) as root, root.subdir(owner, create=create) as owner_dir:
            return owner_dir.subdir(kernel_id, create=create)

    def prepare(self, owner: str) -> None:
        """Read what a kernel of ``owner``'s environment will need (blocking: call it off the event
        loop): the owner's encryption key, when checkpoints are encrypted at rest."""
        if self.file_keys is not None:
            try:
                self.file_keys.owner_key(check_component("owner", owner))
            except EnvelopeError as exc:
                raise CheckpointRefused(str(exc)) from None

    def data_key_for(self, owner: str, kernel_id: str) -> bytes | None:
        """The kernel's encryption key (the second line of its key file), or ``None`` when
        checkpoints are not encrypted at rest. :class:`CheckpointRefused` when the owner's key
        needs a master key that is not configured. Blocking the first time per owner."""
        if self.file_keys is None:
            return None
        try:
            return self.file_keys.kernel_key(
                check_component("owner", owner), check_component("kernel id", kernel_id)
            )
        except EnvelopeError as exc:
            raise CheckpointRefused(str(exc)) from None

    def key_for(self, owner: str) -> bytes:
        """The key ``owner``'s kernels sign and verify with.

        Hand it to a kernel only through :mod:`kernelmgr.checkpoint.keys` (a key file), never
        in its environment, and never hand a kernel the secret or another owner's key.
        """
        return owner_key(self._secret, check_component("owner", owner))

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
        verification, and (quarantining nothing) when a folder on the way is a link.
        Blocking: callers on the event loop run it in a thread.
        """
        try:
            with self.open_kernel_dir(owner, kernel_id) as directory:
                signature = _signature(directory)
                manifest = load_verified_manifest(
                    directory, self.key_for(owner), owner, kernel_id, self.data_key_for(owner, kernel_id)
                )
        except FileNotFoundError:
            return None
        except UnsafePath as exc:
            raise CheckpointRefused(str(exc)) from None
        if signature is not None:  # the REST summary needs no second read of this manifest
            value = None if manifest is None else {**manifest.summary(), "refused": None, "quarantined": None}
            self._summaries[(owner, kernel_id)] = (signature, value)
        return manifest

    def commit(self, owner: str, kernel_id: str, reported: str) -> Manifest:
        """The checkpoint a kernel reports it committed (its manifest's JSON), verified with the
        owner's key: the id the server records, never inferred from ``current`` on its own mount,
        which a shared file system's attribute cache may show late. ``ValueError`` saying why
        when it is not this owner's and this kernel's, or does not verify. Blocking (HMAC)."""
        try:
            manifest = Manifest.from_json(reported)
            return check_manifest(
                reported.encode("utf-8"),
                manifest.data_bytes,  # the restore checks data.bin's digest before unpickling
                self.key_for(owner),
                owner,
                kernel_id,
                manifest.checkpoint_id,
            )
        except (ValueError, ManifestError, Untrusted) as exc:
            raise ValueError(str(exc)) from None

    def begin_upload(self, owner: str, kernel_id: str, manifest: Manifest) -> Upload:
        """Start the upload of a reported checkpoint's data (stores with :attr:`uploads` only)."""
        raise NotImplementedError(f"{type(self).__name__} takes no uploads")

    def begin_stream(self, owner: str, kernel_id: str, estimate: int) -> Upload:
        """Start the upload of a checkpoint before it is written (stores with :attr:`uploads` only)."""
        raise NotImplementedError(f"{type(self).__name__} takes no uploads")

    def stream_urls(self, upload: Upload, size: int) -> Upload:
        """``upload`` with the part URLs ``size`` bytes need (stores with :attr:`uploads` only)."""
        raise NotImplementedError(f"{type(self).__name__} takes no uploads")

    def finish_upload(self, upload: Upload, etags: list[str], reported: str) -> None:
        """Complete the upload and commit its manifest last (stores with :attr:`uploads` only)."""
        raise NotImplementedError(f"{type(self).__name__} takes no uploads")

    def abort_upload(self, upload: Upload) -> None:
        """Drop an upload that will not be committed (stores with :attr:`uploads` only)."""
        raise NotImplementedError(f"{type(self).__name__} takes no uploads")

    def has_checkpoint(self, owner: str, kernel_id: str) -> bool:
        """Whether ``current`` names a checkpoint (without verifying it)."""
        try:
            with self.open_kernel_dir(owner, kernel_id) as directory:
                return read_current(directory) is not None
        except (OSError, ValueError):
            return False

    def summary(self, owner: str, kernel_id: str) -> dict[str, Any] | None:
        """The REST shape of the committed checkpoint, or ``None`` (cached until :meth:`forget_cached`).

        From the cache while ``current`` is the same file (:meth:`latest`, which hibernation runs
        in a thread, and :meth:`refresh_summaries` fill it); a read otherwise (capped).
        """
        key = (owner, kernel_id)
        try:
            with self.open_kernel_dir(owner, kernel_id) as directory:
                signature = _signature(directory)
        except (OSError, ValueError):
            signature = None
        if signature is None:
            self._summaries.pop(key, None)
            return None  # nothing committed (or the kernel is gone)
        cached = self._summaries.get(key)
        if cached is not None and cached[0] == signature:
            return cached[1]
        value = self.read_summary(owner, kernel_id)
        self._summaries[key] = (signature, value)
        return value

    def refresh_summaries(self, keys: list[tuple[str, str]]) -> None:
        """Read the summaries of ``(owner, kernel id)`` pairs whose checkpoint changed (blocking:
        run it in a thread before building REST models on the event loop)."""
        for owner, kernel_id in keys:
            try:
                self.summary(owner, kernel_id)
            except Exception:  # the model says why (models._checkpoint)
                continue

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
        """The report the agent wrote after its last restore, or ``None``.

        ``{"error": ...}`` when it is not read: larger than :data:`RESTORE_REPORT_CAP` (the
        kernel writes it, so it could be any size), or a link. Blocking: callers on the event
        loop run it in a thread.
        """
        try:
            with self.open_kernel_dir(owner, kernel_id) as directory:
                raw = directory.read(RESTORE_REPORT, RESTORE_REPORT_CAP)
        except FileNotFoundError:
            return None
        except (TooLarge, UnsafePath) as exc:
            log.warning("kernel %s: restore report not read: %s", kernel_id, exc)
            return {"error": f"the restore report was not read: {exc}"}
        except (OSError, ValueError):
            return None
        try:
            report = json.loads(raw)
        except ValueError:  # half-written by hand
            return None
        return report if isinstance(report, dict) else None

    def keep_restore_report(self, owner: str, kernel_id: str, text: str) -> None:
        """Keep a report the agent sent (from a pod whose folder the server cannot read) where
        :meth:`restore_report` reads it. ``ValueError`` when it is too large or not an object."""
        body = text.encode("utf-8")
        if len(body) > RESTORE_REPORT_CAP or not isinstance(json.loads(body), dict):
            raise ValueError(f"the restore report is not a JSON object of at most {RESTORE_REPORT_CAP} bytes")
        with self.open_kernel_dir(owner, kernel_id, create=True) as directory:
            directory.write_atomic(RESTORE_REPORT, body)

    def restore_progress(self, owner: str, kernel_id: str, since: float) -> dict[str, Any] | None:
        """How far the kernel's agent has read its checkpoint in a restore begun after ``since``
        (a file of at most ``progress.PROGRESS_CAP`` bytes, opened without following links)."""
        try:
            with self.open_kernel_dir(owner, kernel_id) as directory:
                return read_progress(directory, since)
        except (OSError, ValueError):
            return None

    def checkpoint_progress(self, owner: str, kernel_id: str, since: float) -> dict[str, Any] | None:
        """How far the kernel's agent has written a checkpoint begun after ``since`` (a hibernation)."""
        try:
            with self.open_kernel_dir(owner, kernel_id) as directory:
                return read_progress(directory, since, CHECKPOINT_PROGRESS)
        except (OSError, ValueError):
            return None

    @contextlib.contextmanager
    def verified_files(
        self, owner: str, kernel_id: str, checkpoint_id: str
    ) -> Iterator[list[tuple[str, BinaryIO, int]]]:
        """The files of ``checkpoint_id`` as ``(name, open file, size)``, its manifest verified
        again now with ``owner``'s key, from the very descriptors the caller then reads.

        For sending a checkpoint anywhere (a warm pod): what is sent is what was verified, and
        nothing is read through a link (a link in the checkpoint refuses it whole).
        Raises :class:`CheckpointRefused` (nothing moved) when it does not verify.
        """
        handles: dict[str, BinaryIO] = {}
        try:
            try:
                with (
                    self.open_kernel_dir(owner, kernel_id) as directory,
                    directory.subdir(checkpoint_id) as folder,
                ):
                    for name in sorted(folder.names()):
                        mode = folder.lstat(name).st_mode
                        if stat.S_ISLNK(mode):
                            raise UnsafePath(f"{folder.path / name} is a symlink")
                        if stat.S_ISREG(mode):
                            handles[name] = os.fdopen(folder.open_file(name), "rb")
                data_name, manifest_name = file_names(file_names(True)[1] in handles)
                if manifest_name not in handles or data_name not in handles:
                    raise Untrusted(f"{MANIFEST_FILE} or {DATA_FILE} is missing")
                text = handles[manifest_name].read(MANIFEST_CAP + 1)
                if len(text) > MANIFEST_CAP:
                    raise Untrusted(f"{MANIFEST_FILE} is larger than {MANIFEST_CAP} bytes")
                if manifest_name != MANIFEST_FILE:  # encrypted at rest: sent as it is, checked here
                    data_key = self.data_key_for(owner, kernel_id)
                    if data_key is None:
                        raise Untrusted(NO_KEY.format(id=checkpoint_id))
                    sealing = cipher.checkpoint_key(data_key, checkpoint_id)
                    text = cipher.crypt(cipher.manifest_key(sealing), 0, text)
                data_size = os.fstat(handles[data_name].fileno()).st_size
                check_manifest(text, data_size, self.key_for(owner), owner, kernel_id, checkpoint_id)
            except (OSError, ValueError, Untrusted) as exc:
                raise CheckpointRefused(f"checkpoint {checkpoint_id} of kernel {kernel_id}: {exc}") from None
            handles[manifest_name].seek(0)
            yield [(name, handle, os.fstat(handle.fileno()).st_size) for name, handle in handles.items()]
        finally:
            for handle in handles.values():
                handle.close()

    def usage(self, owner: str) -> dict[str, int]:
        """Bytes on the volume per kernel folder of ``owner`` (blocking), for the storage quota."""
        try:
            with SafeDir.open(self.root) as root, root.subdir(check_component("owner", owner)) as folder:
                return {name: folder.disk_bytes(name) for name in folder.names() if folder.is_dir(name)}
        except FileNotFoundError:
            return {}

    def volume_space(self) -> tuple[int, int] | None:
        """The checkpoint volume's free and total bytes (``None`` before its root exists)."""
        try:
            usage = shutil.disk_usage(self.root)
        except FileNotFoundError:
            return None
        return usage.free, usage.total

    def prune(self, owner: str, kernel_id: str) -> None:
        """Delete superseded checkpoints and leftovers, keeping the committed one.

        Only while the kernel's process is stopped (hibernated): its agent is then not writing.
        Nothing is followed: a link in the kernel folder is removed as a link.
        """
        try:
            with self.open_kernel_dir(owner, kernel_id) as directory:
                try:
                    committed = read_current(directory)
                except ValueError:
                    return  # unknown which one is committed: keep everything
                remove_stale(directory, keep=committed)
        except FileNotFoundError:
            return
        except UnsafePath as exc:
            log.warning("kernel %s: checkpoints not pruned: %s", kernel_id, exc)

    def remove(self, owner: str, kernel_id: str) -> None:
        """Delete the kernel directory, quarantine included (the kernel is gone for good).

        A kernel folder that is a link is removed as a link: what it points at stays. The owner's
        directory stays, even empty: a kernel pod of the same owner may be mounting it as a
        sub-path right now, and a kubelet that finds it gone creates it as root, which the kernel
        (and the server) then cannot write to.
        """
        self.forget_cached(owner, kernel_id)
        owner = check_component("owner", owner)
        kernel_id = check_component("kernel id", kernel_id)
        try:
            with (
                SafeDir.open(self.root) as root,
                root.subdir(owner) as owner_dir,
                contextlib.suppress(FileNotFoundError),
            ):
                owner_dir.remove(kernel_id)
        except FileNotFoundError:
            return


def _signature(directory: SafeDir) -> tuple[int, ...] | None:
    """What changes when a commit replaces ``current`` or a restore quarantines what it names."""
    try:
        info = directory.lstat(CURRENT)
        kept = directory.lstat(QUARANTINE).st_mtime_ns if directory.exists(QUARANTINE) else 0
    except FileNotFoundError:
        return None
    return (info.st_ino, info.st_mtime_ns, info.st_size, kept)
