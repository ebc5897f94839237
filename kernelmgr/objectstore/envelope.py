"""Per-owner envelope keys for checkpoints at rest in the bucket.

Each owner has a random 32-byte key, stored in the bucket only wrapped (AES key wrap, RFC 3394,
``cryptography``) by a master key the server reads from a file (a Kubernetes Secret), never from
the bucket or the data volume. A checkpoint's key is derived from its owner's key and its id, and
is all a kernel ever gets (:mod:`kernelmgr.checkpoint.cipher`).

Rotation: put the new master key first in ``S3Checkpoints.encryption_key_files`` and keep the old
ones after it; each owner's key is unwrapped with the master key that wrapped it (named by its
fingerprint) and wrapped again with the first one the next time it is used. Once every owner's
key names the new master (or after ``hibernated_ttl``), the old master can go. Checkpoints are
never re-encrypted: only the small wrapped owner keys change.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

from kernelmgr.checkpoint.cipher import KEY_BYTES, derive
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


class OwnerKeys:
    """The owners' envelope keys in ``bucket`` under ``prefix``, wrapped by ``masters[0]``."""

    def __init__(self, bucket: Bucket, prefix: str, masters: list[bytes]) -> None:
        if not masters:
            raise ValueError("at least one master key is needed")
        self.bucket = bucket
        self.prefix = prefix
        self.masters = {fingerprint(m): m for m in masters}
        self.current = fingerprint(masters[0])
        self._cache: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _key(self, owner: str) -> str:
        return "/".join(p for p in (self.prefix, owner, WRAPPED_KEY) if p)

    def owner_key(self, owner: str) -> bytes:
        with self._lock:
            if owner in self._cache:
                return self._cache[owner]
        from cryptography.hazmat.primitives.keywrap import aes_key_unwrap

        key = self._key(owner)
        raw = self.bucket.get(key)
        if raw is None:
            fresh = os.urandom(KEY_BYTES)
            record = self._wrapped(fresh)
            try:
                self.bucket.put(key, json.dumps(record).encode(), only_if_new=True)
                value = fresh
            except ObjectStoreError as exc:
                if exc.status != 412:
                    raise
                return self.owner_key(owner)  # another server made it first
        else:
            record = json.loads(raw)
            master = self.masters.get(str(record.get("master")))
            if master is None:
                raise EnvelopeError(
                    f"the key of owner {owner!r} is wrapped by master key {record.get('master')!r}, which "
                    "is not among S3Checkpoints.encryption_key_files: add it (after the current one)"
                )
            value = aes_key_unwrap(master, bytes.fromhex(record["wrapped"]))
            if record["master"] != self.current:  # rotation: wrap it with the current master
                record = self._wrapped(value)
                self.bucket.put(key, json.dumps(record).encode())
        with self._lock:
            self._cache[owner] = value
        return value

    def _wrapped(self, value: bytes) -> dict[str, str]:
        from cryptography.hazmat.primitives.keywrap import aes_key_wrap

        return {"master": self.current, "wrapped": aes_key_wrap(self.masters[self.current], value).hex()}

    def checkpoint_key(self, owner: str, checkpoint_id: str) -> bytes:
        """The key of one checkpoint (all its kernel gets)."""
        return derive(self.owner_key(owner), f"jupyter-elastic-kernels checkpoint {checkpoint_id}")
