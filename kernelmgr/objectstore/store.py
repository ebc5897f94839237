"""Checkpoints in an S3-compatible bucket: the object-store implementation of the checkpoint store.

The bucket is the truth; the local folders of :class:`~kernelmgr.checkpoint_store.CheckpointStore`
(under ``checkpoint_root``, on the server's own disk, never shared) are the kernels' scratch space:
the server starts the multipart upload before the checkpoint (:meth:`ObjectCheckpointStore.
begin_stream`: it names the checkpoint, and presigns part URLs for the kernel's estimate of its
size), the kernel writes its checkpoint there as it always does and sends each part of
``data.bin`` straight to the bucket as soon as that part is written (the upload overlaps the
write), and reads it back on resume by parallel ranged GETs. The
kernel holds no credential: every URL is good for one request on one key under its owner's and
kernel's prefix, for ``presign_seconds``.

Keys (``prefix`` optional)::

    <prefix>/<owner>/<kernel id>/<checkpoint id>/data.bin       the multipart upload, completed
    <prefix>/<owner>/<kernel id>/<checkpoint id>/manifest.json  written last, only if new: the commit
    <prefix>/<owner>/<kernel id>/current                        the committed id (for restarts)

A kernel killed mid-upload leaves an uncompleted upload, which the server aborts (and a bucket
lifecycle rule ``AbortIncompleteMultipartUpload`` reaps if the server died too); a server killed
between the upload and the commit leaves a ``data.bin`` with no manifest, which nothing reads and
the next prune deletes. The checkpoint the server records is the one the kernel reported, verified
with the owner's key; ``current`` is read only after a restart, when nothing else is known.

Blocking (standard library HTTP): the lifecycle calls it in a worker thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any

from kernelmgr.checkpoint import cipher
from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.layout import CURRENT, DATA_FILE, MANIFEST_FILE, is_checkpoint_id, new_checkpoint_id
from kernelmgr.checkpoint.safedir import UnsafePath, check_component
from kernelmgr.checkpoint.verify import MANIFEST_CAP, Untrusted, check_manifest
from kernelmgr.checkpoint_store import CheckpointStore, Upload, log
from kernelmgr.core.manifest import Manifest
from kernelmgr.objectstore.client import Bucket
from kernelmgr.objectstore.envelope import EnvelopeError, OwnerKeys
from kernelmgr.objectstore.transfer import DEFAULT_PART_SIZE, part_count

#: What the agent's restore reads from the environment (kept in step with ``checkpoint.agent``).
ENV_RESTORE_MANIFEST_URL = "ELASTIC_RESTORE_MANIFEST_URL"
ENV_RESTORE_DATA_URL = "ELASTIC_RESTORE_DATA_URL"
ENV_RESTORE_KEY = "ELASTIC_RESTORE_KEY"
#: An encrypted checkpoint's objects carry this suffix (``data.bin.aes``, ``manifest.json.aes``).
ENCRYPTED = ".aes"
#: S3 allows at most this many parts in one upload.
MAX_PARTS = 10_000
MIN_PART_SIZE = 5 * 1024 * 1024


class ObjectCheckpointStore(CheckpointStore):
    """Checkpoints in ``bucket``; ``root`` is the local scratch space of the kernels."""

    uploads = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        secret: bytes,
        bucket: Bucket,
        *,
        prefix: str = "",
        presign_seconds: int = 900,
        part_size: int = DEFAULT_PART_SIZE,
        envelope: OwnerKeys | None = None,
    ) -> None:
        super().__init__(root, secret)
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"the part size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.presign_seconds = presign_seconds
        self.part_size = part_size
        #: The committed manifest of each (owner, kernel id) this server knows (``None``: none).
        self._known: dict[tuple[str, str], Manifest | None] = {}
        #: Whether each known committed checkpoint is encrypted (its objects' names say so).
        self._encrypted: dict[tuple[str, str, str], bool] = {}
        self._lock = threading.Lock()
        #: Per-owner envelope keys: new checkpoints are encrypted at rest when set.
        self.envelope = envelope
        #: Checkpoints being uploaded now: a prune (after a background checkpoint) leaves them be.
        self._uploading: set[tuple[str, str, str]] = set()

    def _names(self, encrypted: bool) -> tuple[str, str]:
        suffix = ENCRYPTED if encrypted else ""
        return DATA_FILE + suffix, MANIFEST_FILE + suffix

    def prepare(self, owner: str) -> None:
        """The owner's key is in the bucket (one GET, then cached): read it before
        :meth:`agent_env`, which runs on the event loop."""
        if self.envelope is not None:
            try:
                self.envelope.owner_key(owner)
            except EnvelopeError as exc:
                raise CheckpointRefused(str(exc)) from None

    def _checkpoint_key(self, owner: str, checkpoint_id: str) -> bytes:
        assert self.envelope is not None
        try:
            return self.envelope.checkpoint_key(owner, checkpoint_id)
        except EnvelopeError as exc:
            raise CheckpointRefused(str(exc)) from None

    def key(self, owner: str, kernel_id: str, *rest: str) -> str:
        parts = [check_component("owner", owner), check_component("kernel id", kernel_id), *rest]
        return "/".join([self.prefix, *parts] if self.prefix else parts)

    # -- commit -----------------------------------------------------------------------------

    def begin_upload(self, owner: str, kernel_id: str, manifest: Manifest) -> Upload:
        size = manifest.data_bytes
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        part_size += -part_size % 16  # whole cipher blocks, so each part encrypts on its own
        return self._start(owner, kernel_id, manifest.checkpoint_id, part_size, part_count(size, part_size))

    def begin_stream(self, owner: str, kernel_id: str, estimate: int) -> Upload:
        """Start the upload of a checkpoint not written yet (its id chosen here, the kernel writes
        under it), with part URLs for ``estimate`` bytes and an eighth more: the kernel sends the
        parts while it writes the checkpoint. :meth:`stream_urls` adds any it outgrows."""
        budget = max(0, estimate) + max(0, estimate) // 8
        part_size = max(self.part_size, -(-budget // MAX_PARTS))
        part_size += -part_size % (1 << 20)  # whole MiB: whole cipher blocks and pages
        count = min(MAX_PARTS, part_count(budget + part_size, part_size))
        return self._start(owner, kernel_id, new_checkpoint_id(), part_size, count)

    def stream_urls(self, upload: Upload, size: int) -> Upload:
        """The upload with exactly the part URLs ``size`` bytes need (more presigned when the
        checkpoint outgrew the estimate; ``ValueError`` past S3's limit of parts)."""
        needed = part_count(size, upload.part_size)
        if needed > MAX_PARTS:
            raise ValueError(
                f"the checkpoint ({size} bytes) needs {needed} parts of {upload.part_size} bytes, "
                f"more than the {MAX_PARTS} an upload may have"
            )
        urls = upload.urls[:needed]
        if needed > len(urls):
            urls += self.bucket.part_urls(
                upload.key, upload.upload_id, needed - len(urls), self.presign_seconds, first=len(urls) + 1
            )
        return dataclasses.replace(upload, urls=urls)

    def _start(self, owner: str, kernel_id: str, checkpoint_id: str, part_size: int, count: int) -> Upload:
        encrypted = self.envelope is not None
        key = self.key(owner, kernel_id, checkpoint_id, self._names(encrypted)[0])
        secret = self._checkpoint_key(owner, checkpoint_id).hex() if encrypted else ""
        with self._lock:
            self._uploading.add((owner, kernel_id, checkpoint_id))
        try:
            upload_id = self.bucket.start_upload(key)
        except BaseException:
            with self._lock:
                self._uploading.discard((owner, kernel_id, checkpoint_id))
            raise
        urls = self.bucket.part_urls(key, upload_id, count, self.presign_seconds)
        return Upload(owner, kernel_id, checkpoint_id, key, upload_id, urls, part_size, secret)

    def finish_upload(self, upload: Upload, etags: list[str], reported: str) -> None:
        """Complete ``data.bin``, check its size, then write the manifest (only if new): the commit."""
        try:
            self._finish(upload, etags, reported)
        finally:
            with self._lock:
                self._uploading.discard((upload.owner, upload.kernel_id, upload.checkpoint_id))

    def _finish(self, upload: Upload, etags: list[str], reported: str) -> None:
        manifest = self.commit(upload.owner, upload.kernel_id, reported)
        if manifest.checkpoint_id != upload.checkpoint_id:
            raise ValueError(f"the manifest is {manifest.checkpoint_id}'s, not {upload.checkpoint_id}'s")
        if len(etags) != len(upload.urls):
            raise ValueError(f"the kernel reported {len(etags)} parts of {len(upload.urls)}")
        self.bucket.complete_upload(upload.key, upload.upload_id, etags)
        info = self.bucket.head(upload.key)
        if info is None or info.size != manifest.data_bytes:
            self.bucket.delete(upload.key)
            raise ValueError(
                f"{DATA_FILE} has {info.size if info else 0} bytes in the store, "
                f"the manifest says {manifest.data_bytes}"
            )
        base = self.key(upload.owner, upload.kernel_id)
        encrypted = bool(upload.checkpoint_key)
        body = reported.encode()
        if encrypted:
            body = cipher.crypt(cipher.manifest_key(bytes.fromhex(upload.checkpoint_key)), 0, body)
        manifest_name = self._names(encrypted)[1]
        self.bucket.put(f"{base}/{upload.checkpoint_id}/{manifest_name}", body, only_if_new=True)
        self.bucket.put(f"{base}/{CURRENT}", f"{upload.checkpoint_id}\n".encode())
        with self._lock:
            self._known[(upload.owner, upload.kernel_id)] = manifest
            self._encrypted[(upload.owner, upload.kernel_id, upload.checkpoint_id)] = encrypted
        self.forget_cached(upload.owner, upload.kernel_id)

    def abort_upload(self, upload: Upload) -> None:
        with self._lock:
            self._uploading.discard((upload.owner, upload.kernel_id, upload.checkpoint_id))
        self.bucket.abort_upload(upload.key, upload.upload_id)

    # -- reading ----------------------------------------------------------------------------

    def latest(self, owner: str, kernel_id: str) -> Manifest | None:
        """The committed checkpoint named by the bucket's ``current``, verified (after a restart;
        otherwise the one the server recorded at its commit)."""
        base = self.key(owner, kernel_id)
        raw = self.bucket.get(f"{base}/{CURRENT}")
        if raw is None:
            with self._lock:
                self._known[(owner, kernel_id)] = None
            return None
        checkpoint_id = raw[:256].decode("ascii", "replace").strip()
        if not is_checkpoint_id(checkpoint_id):
            raise CheckpointRefused(f"{base}/{CURRENT} names {checkpoint_id[:80]!r}, not a checkpoint")
        manifest = self._verified(owner, kernel_id, checkpoint_id)
        with self._lock:
            self._known[(owner, kernel_id)] = manifest
        return manifest

    def _verified(self, owner: str, kernel_id: str, checkpoint_id: str) -> Manifest:
        base = self.key(owner, kernel_id, checkpoint_id)
        encrypted = False
        text = self.bucket.get(f"{base}/{MANIFEST_FILE}")
        if text is None:
            text = self.bucket.get(f"{base}/{MANIFEST_FILE}{ENCRYPTED}")
            encrypted = text is not None
        data = self.bucket.head(f"{base}/{self._names(encrypted)[0]}")
        if encrypted and text is not None:
            if self.envelope is None:
                raise CheckpointRefused(
                    f"checkpoint {checkpoint_id} is encrypted at rest: set S3Checkpoints.encryption_key_files"
                )
            text = cipher.crypt(cipher.manifest_key(self._checkpoint_key(owner, checkpoint_id)), 0, text)
        with self._lock:
            self._encrypted[(owner, kernel_id, checkpoint_id)] = encrypted
        if text is None or data is None:
            raise CheckpointRefused(f"checkpoint {checkpoint_id} is incomplete in the object store ({base}/)")
        if len(text) > MANIFEST_CAP:
            raise CheckpointRefused(f"{base}/{MANIFEST_FILE} is larger than {MANIFEST_CAP} bytes")
        try:
            return check_manifest(text, data.size, self.key_for(owner), owner, kernel_id, checkpoint_id)
        except Untrusted as exc:
            raise CheckpointRefused(f"checkpoint {checkpoint_id} in the object store: {exc}") from None

    def _committed(self, owner: str, kernel_id: str) -> Manifest | None:
        with self._lock:
            if (owner, kernel_id) in self._known:
                return self._known[(owner, kernel_id)]
        return self.latest(owner, kernel_id)

    def has_checkpoint(self, owner: str, kernel_id: str) -> bool:
        with self._lock:
            if (owner, kernel_id) in self._known:
                return self._known[(owner, kernel_id)] is not None
        try:
            return self.bucket.head(f"{self.key(owner, kernel_id)}/{CURRENT}") is not None
        except Exception:
            return False

    def summary(self, owner: str, kernel_id: str) -> dict[str, Any] | None:
        """From what this server knows (no request on the event loop); ``refresh_summaries`` reads
        the bucket for kernels it does not know yet."""
        with self._lock:
            manifest = self._known.get((owner, kernel_id))
        if manifest is None:
            return None
        return {**manifest.summary(), "refused": None, "quarantined": None}

    def refresh_summaries(self, keys: list[tuple[str, str]]) -> None:
        for owner, kernel_id in keys:
            with self._lock:
                known = (owner, kernel_id) in self._known
            if not known:
                with contextlib.suppress(Exception):
                    self.latest(owner, kernel_id)

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
        """As the file system's, plus presigned GET URLs of the checkpoint to restore (and only
        that one: the kernel can read nothing else, its owner's other checkpoints included)."""
        env = super().agent_env(
            owner,
            kernel_id,
            key_file=key_file,
            restore=restore,
            restore_checkpoint=restore_checkpoint,
            restore_mapped=restore_mapped,
            checkpoint_on_sigterm=checkpoint_on_sigterm,
        )
        if restore and restore_checkpoint:
            base = self.key(owner, kernel_id, restore_checkpoint)
            with self._lock:
                encrypted = self._encrypted.get(
                    (owner, kernel_id, restore_checkpoint), self.envelope is not None
                )
            data_name, manifest_name = self._names(encrypted)
            env[ENV_RESTORE_MANIFEST_URL] = self.bucket.presign(
                "GET", f"{base}/{manifest_name}", self.presign_seconds
            )
            env[ENV_RESTORE_DATA_URL] = self.bucket.presign(
                "GET", f"{base}/{data_name}", self.presign_seconds
            )
            if encrypted:
                # Only this checkpoint's key (the owner's key and the master stay in the server).
                env[ENV_RESTORE_KEY] = self._checkpoint_key(owner, restore_checkpoint).hex()
        return env

    # -- usage ------------------------------------------------------------------------------

    def usage(self, owner: str) -> dict[str, int]:
        """Bytes in the bucket per kernel of ``owner`` (blocking: one listing), for the quota. The
        local scratch copies are not counted: the node's disk is not the store users share."""
        base = self.key(owner, "x")[: -len("x")]
        held: dict[str, int] = {}
        for item in self.bucket.listing(base):
            kernel_id = item.key[len(base) :].split("/", 1)[0]
            held[kernel_id] = held.get(kernel_id, 0) + item.size
        return held

    def volume_space(self) -> tuple[int, int] | None:
        """Unknown: a bucket does not say how much room it has left (its quota is the provider's)."""
        return None

    # -- deleting ---------------------------------------------------------------------------

    def prune(self, owner: str, kernel_id: str) -> None:
        """Delete the bucket's superseded checkpoints and uncommitted leftovers (but uploads in
        flight), and the local scratch copies up to the committed one (the bucket holds it)."""
        committed = self._committed(owner, kernel_id)
        keep = committed.checkpoint_id if committed is not None else None
        base = self.key(owner, kernel_id) + "/"
        with self._lock:
            uploading = {c for o, k, c in self._uploading if (o, k) == (owner, kernel_id)}
        for item in self.bucket.listing(base):
            name = item.key[len(base) :].split("/", 1)[0]
            if is_checkpoint_id(name) and name != keep and keep is not None and name not in uploading:
                self.bucket.delete(item.key)
        if keep is None:
            return
        try:
            with self.open_kernel_dir(owner, kernel_id) as directory:
                # Local copies up to the committed one (ids sort by time); a newer one may be in
                # the making (a hibernation right after a background checkpoint).
                for name in directory.names():
                    if is_checkpoint_id(name) and name <= keep:
                        try:
                            directory.remove(name)
                        except OSError as exc:
                            log.warning("could not remove %s: %s", directory.path / name, exc)
        except FileNotFoundError:
            return
        except UnsafePath as exc:
            log.warning("kernel %s: local checkpoints not pruned: %s", kernel_id, exc)

    def remove(self, owner: str, kernel_id: str) -> None:
        """Delete every object of the kernel (``hibernated_ttl``, or shut down for good)."""
        self.bucket.delete_prefix(self.key(owner, kernel_id) + "/")
        with self._lock:
            self._known.pop((owner, kernel_id), None)
        super().remove(owner, kernel_id)
