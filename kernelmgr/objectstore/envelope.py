"""Per-owner envelope keys for checkpoints at rest, in the bucket or on the shared file system.

Each owner has a random 32-byte key, stored only wrapped (AES key wrap, RFC 3394, ``cryptography``)
by a master key the server reads from a file (a Kubernetes Secret), never from the bucket or the
data volume. Where the wrapped keys live is a :class:`KeyRecords` (the bucket: :class:`BucketKeyRecords`;
the file system: ``checkpoint_store.FileKeyRecords``), so both stores share this code. A
checkpoint's key (object store) or a kernel's key (file system) is derived from its owner's key,
and is all a kernel ever gets (:mod:`kernelmgr.checkpoint.cipher`).

Rotation: put the new master key first in ``S3Checkpoints.encryption_key_files`` and keep the old
ones after it; each owner's key is unwrapped with the master key that wrapped it (named by its
fingerprint) and wrapped again with the first one the next time it is used. Once every owner's
key names the new master (or after ``hibernated_ttl``), the old master can go. Checkpoints are
never re-encrypted: only the small wrapped owner keys change. :meth:`OwnerKeys.rewrap_all` does
it for every owner at once (``jupyter elastic rotate-keys``), so the old master can go at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from pathlib import Path
from typing import Protocol

from kernelmgr.checkpoint.cipher import KEY_BYTES, derive
from kernelmgr.checkpoint.safedir import SafeDir
from kernelmgr.objectstore.client import Bucket, ObjectStoreError

#: Beside the owner's kernel folders (a kernel id never starts with a dot).
WRAPPED_KEY = ".data-key"


class EnvelopeError(Exception):
    """An owner's key cannot be unwrapped: which master key it needs, and that it is missing."""


def fingerprint(master: bytes) -> str:
    return hashlib.sha256(b"jupyter-elastic-kernels master key\0" + master).hexdigest()[:16]


def read_master_key(path: str) -> bytes:
    """A master key file: 32 raw bytes or 64 hex digits. ``ValueError`` saying which otherwise."""
    with open(path, "rb") as handle:
        raw = handle.read(4096)
    text = raw.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    if len(raw) == KEY_BYTES:
        return raw
    raise ValueError(f"{path} holds {len(raw)} bytes: a master key is 32 bytes or 64 hex digits")


class KeyRecords(Protocol):
    """Where the wrapped owner keys are kept (small JSON records, one per owner)."""

    def read(self, owner: str) -> bytes | None: ...

    def create(self, owner: str, body: bytes) -> bool:
        """Write ``body`` unless a record exists; ``False`` when one did (another server won)."""

    def replace(self, owner: str, body: bytes) -> None: ...

    def owners(self) -> list[str]: ...


class BucketKeyRecords:
    """``<prefix>/<owner>/.data-key`` in the bucket."""

    def __init__(self, bucket: Bucket, prefix: str) -> None:
        self.bucket = bucket
        self.prefix = prefix

    def _key(self, owner: str) -> str:
        return "/".join(p for p in (self.prefix, owner, WRAPPED_KEY) if p)

    def read(self, owner: str) -> bytes | None:
        return self.bucket.get(self._key(owner))

    def create(self, owner: str, body: bytes) -> bool:
        try:
            self.bucket.put(self._key(owner), body, only_if_new=True)
        except ObjectStoreError as exc:
            if exc.status != 412:
                raise
            return False
        return True

    def replace(self, owner: str, body: bytes) -> None:
        self.bucket.put(self._key(owner), body)

    def owners(self) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        found = []
        for item in self.bucket.listing(base):
            rest = item.key[len(base) :].split("/")
            if len(rest) == 2 and rest[1] == WRAPPED_KEY:
                found.append(rest[0])
        return found


#: Under a file-system store's checkpoint root: the owners' wrapped keys, one file per owner.
#: Beside the owner folders, never inside one: a kernel pod mounts only its owner's folder.
OWNER_KEYS_DIR = ".owner-keys"
_KEY_RECORD_CAP = 4096


def _record_name(owner: str) -> str:
    if not owner or owner.startswith(".") or "/" in owner or "\\" in owner or "\0" in owner:
        raise ValueError(f"owner {owner!r} cannot name a key record")
    return owner


class FileKeyRecords:
    """The owners' wrapped keys in ``<root>/.owner-keys/<owner>`` (a folder only the server
    writes; what is in it is useless without the master key, which is never on this volume)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.folder = Path(root) / OWNER_KEYS_DIR

    def _open(self) -> SafeDir:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return SafeDir.open(self.folder)

    def read(self, owner: str) -> bytes | None:
        try:
            with self._open() as folder:
                return folder.read(_record_name(owner), _KEY_RECORD_CAP)
        except FileNotFoundError:
            return None

    def create(self, owner: str, body: bytes) -> bool:
        """Staged whole and fsynced, then linked to its name (which fails if another server made it
        first): losing this record would lose every checkpoint of the owner."""
        name = _record_name(owner)
        with self._open() as folder:
            staged = f".{name}.{secrets.token_hex(4)}.new"
            folder.write_atomic(staged, body)
            try:
                os.link(staged, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd, follow_symlinks=False)
            except FileExistsError:
                return False
            finally:
                os.unlink(staged, dir_fd=folder.fd)
            folder.fsync()
            return True

    def replace(self, owner: str, body: bytes) -> None:
        with self._open() as folder:
            folder.write_atomic(_record_name(owner), body)

    def owners(self) -> list[str]:
        try:
            with self._open() as folder:
                return sorted(name for name in folder.names() if not name.startswith("."))
        except FileNotFoundError:
            return []


class OwnerKeys:
    """The owners' envelope keys in ``records`` (or a bucket under ``prefix``), wrapped by
    ``masters[0]``; ``setting`` names the configuration that lists the master keys (errors say it)."""

    def __init__(
        self,
        records: KeyRecords | Bucket,
        prefix: str,
        masters: list[bytes],
        *,
        setting: str = "S3Checkpoints.encryption_key_files",
    ) -> None:
        if not masters:
            raise ValueError("at least one master key is needed")
        self.records: KeyRecords = (
            BucketKeyRecords(records, prefix) if isinstance(records, Bucket) else records
        )
        self.masters = {fingerprint(m): m for m in masters}
        self.current = fingerprint(masters[0])
        self.setting = setting
        self._cache: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def owner_key(self, owner: str) -> bytes:
        with self._lock:
            if owner in self._cache:
                return self._cache[owner]
        raw = self.records.read(owner)
        if raw is None:
            fresh = os.urandom(KEY_BYTES)
            if not self.records.create(owner, json.dumps(self._wrapped(fresh)).encode()):
                return self.owner_key(owner)  # another server made it first
            value = fresh
        else:
            value, rewrap = self._unwrap(owner, raw)
            if rewrap:  # rotation: wrap it with the current master
                self.records.replace(owner, json.dumps(self._wrapped(value)).encode())
        with self._lock:
            self._cache[owner] = value
        return value

    def _unwrap(self, owner: str, raw: bytes) -> tuple[bytes, bool]:
        """The owner's key in its record, and whether it needs wrapping with the current master."""
        from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap

        try:
            record = json.loads(raw)
            named = str(record.get("master"))
            wrapped = bytes.fromhex(record["wrapped"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise EnvelopeError(f"the wrapped key of owner {owner!r} is not a key record (damaged)") from None
        master = self.masters.get(named)
        if master is None:
            raise EnvelopeError(
                f"the key of owner {owner!r} is wrapped by master key {named!r}, which "
                f"is not among {self.setting}: add it (after the current one)"
            )
        try:
            value = aes_key_unwrap(master, wrapped)
        except InvalidUnwrap:
            raise EnvelopeError(f"the wrapped key of owner {owner!r} does not unwrap (damaged)") from None
        return value, named != self.current

    def rewrap_all(self) -> tuple[int, int]:
        """Wrap every owner's key with the current master (a rotation, done now rather than on each
        key's next use); ``(re-wrapped, already current)``. The data is never touched."""
        done = kept = 0
        for owner in self.records.owners():
            raw = self.records.read(owner)
            if raw is None:
                continue
            value, rewrap = self._unwrap(owner, raw)
            if rewrap:
                self.records.replace(owner, json.dumps(self._wrapped(value)).encode())
                done += 1
            else:
                kept += 1
            with self._lock:
                self._cache[owner] = value
        return done, kept

    def _wrapped(self, value: bytes) -> dict[str, str]:
        from cryptography.hazmat.primitives.keywrap import aes_key_wrap

        return {"master": self.current, "wrapped": aes_key_wrap(self.masters[self.current], value).hex()}

    def checkpoint_key(self, owner: str, checkpoint_id: str) -> bytes:
        """The key of one checkpoint (all its kernel gets)."""
        return derive(self.owner_key(owner), f"jupyter-elastic-kernels checkpoint {checkpoint_id}")

    def kernel_key(self, owner: str, kernel_id: str) -> bytes:
        """The key of one kernel's checkpoints on a file system (all that kernel gets): the kernel
        derives each checkpoint's key from it (:func:`kernelmgr.checkpoint.cipher.checkpoint_key`).
        Owner and kernel are both in the derivation: a key record copied into another owner's
        place yields keys of nothing that owner wrote."""
        return derive(self.owner_key(owner), f"jupyter-elastic-kernels files of {owner}/{kernel_id}")
