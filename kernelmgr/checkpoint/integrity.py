"""Integrity of checkpoints: a server secret, per-owner keys, and the manifest HMAC.

Why an HMAC at all: unpickling runs code chosen by whoever wrote the bytes. Checkpoints
sit on shared storage (a PVC, a node disk) that other tenants or a compromised pod might
write to, so the reader must know the bytes were written by *this owner's* kernel before
it unpickles anything. A keyed MAC proves that; a plain checksum would not.

Why per-owner keys: the server holds one secret and gives each kernel only
``owner_key(secret, owner)`` (:mod:`kernelmgr.checkpoint.keys`: handed over in a file the
agent removes once read, never in the environment). Code in a notebook can still find its
own key in memory (it runs in the same process as the agent), so a user can forge
checkpoints for themselves, which gains them nothing: they can already run any code in
their own kernel. Without the secret they cannot produce a checkpoint that verifies under
another user's key. The secret is a file only the server's account can read, never on the
checkpoint volume (kernels write there); a kernel running as the server's own OS user (a
single-user server) could still read it, which is why a multi-user gateway runs each kernel
as its owner's account (:mod:`kernelmgr.provisioners.accounts`) or in its own pod.

What is covered: the HMAC is computed over the canonical JSON of the manifest without its
``hmac`` field. The manifest carries the digest and the size of ``data.bin``, so the MAC
covers the data file's contents too, while the server can check a manifest without
reading the data. The reader recomputes the data digest (:class:`DataDigest`) while it
reads ``data.bin`` and compares it before the first ``pickle.loads``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Re-exported for existing callers; the derivation lives with the key handover in keys.py.
from kernelmgr.checkpoint.keys import owner_key as owner_key
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.manifest import LEGACY_DIGEST, Manifest

log = logging.getLogger(__name__)

SECRET_BYTES = 32
_MANIFEST_LABEL = b"jupyter-elastic-kernels/manifest/v1\x00"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable.

    A rename changes the *directory*, not the file: fsyncing the file alone leaves the
    new name in the page cache, and after a power loss the directory may still show the
    old state. Fsyncing the directory's own descriptor writes the entry out.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def migrate_secret(old: str | os.PathLike[str], new: str | os.PathLike[str]) -> bool:
    """Move a secret from where older versions kept it (``<checkpoint_root>/.secret``, on the
    data volume kernels write to) to ``new``, keeping its bytes so existing checkpoints still
    verify; ``True`` if it moved. Nothing happens when ``new`` exists already or ``old`` does not.

    ``new`` is written like :func:`load_or_create_secret` writes (0600, fsynced, linked into
    place, so a concurrent start cannot end with two secrets); ``old`` is removed after.
    """
    source, target = Path(old), Path(new)
    if target.exists() or not source.exists():
        return False
    data = _read_secret(source)
    _make_private_dir(target.parent)
    _link_new_secret(target, data)
    source.unlink(missing_ok=True)
    fsync_dir(source.parent)
    log.warning(
        "moved the checkpoint secret from %s (on the checkpoint volume, where kernels write) to %s",
        source,
        target,
    )
    return True


def _make_private_dir(directory: Path) -> None:
    """``directory`` and its missing parents; a directory made here is 0700 (the secret's)."""
    if directory.is_dir():
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)


def _link_new_secret(target: Path, data: bytes) -> None:
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)


def load_or_create_secret(path: str | os.PathLike[str]) -> bytes:
    """The server's checkpoint secret: read from ``path``, or created there (mode 0600).

    Creation is atomic and race-free: the bytes go to a private temporary file, fsynced,
    which is then hard-linked to ``path``. ``link`` fails if another process created the
    secret first, and then both use the winner's, so two servers starting at once never end
    up with different secrets (which would make each refuse the other's checkpoints).
    """
    target = Path(path)
    try:
        return _read_secret(target)
    except FileNotFoundError:
        pass
    _make_private_dir(target.parent)
    _link_new_secret(target, secrets.token_bytes(SECRET_BYTES))
    return _read_secret(target)


def _read_secret(path: Path) -> bytes:
    data = path.read_bytes()
    if len(data) < SECRET_BYTES:
        raise ConfigError(
            f"checkpoint secret {path} holds {len(data)} bytes, needs at least {SECRET_BYTES}: "
            "delete it to have a new one created (existing checkpoints will then be refused)"
        )
    mode = path.stat().st_mode
    # Group read is allowed: a Kubernetes Secret mounted with the pod's fsGroup reads 0440.
    if mode & (stat.S_IWGRP | stat.S_IRWXO):
        log.warning("checkpoint secret %s is open to others (mode %o): chmod 600 it", path, mode)
    return data


def canonical_json(value: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace, ASCII only."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def manifest_hmac(key: bytes, manifest: Manifest) -> str:
    """Hex HMAC-SHA256 over the canonical manifest without its ``hmac`` field."""
    body = canonical_json(manifest.to_dict(with_hmac=False))
    return hmac.new(key, _MANIFEST_LABEL + body, hashlib.sha256).hexdigest()


def sign(key: bytes, manifest: Manifest) -> None:
    """Set ``manifest.hmac``. Call it last: any later change to the manifest invalidates it."""
    manifest.hmac = manifest_hmac(key, manifest)


def manifest_is_authentic(key: bytes, manifest: Manifest) -> bool:
    """Whether ``manifest.hmac`` was made with ``key`` over exactly these fields."""
    return hmac.compare_digest(manifest.hmac, manifest_hmac(key, manifest))


#: ``data.bin`` is digested in chunks of this size, each on a worker thread.
DIGEST_CHUNK = 16 << 20


def _hasher(algorithm: str) -> Any:
    if algorithm == "blake3":
        try:
            from blake3 import blake3
        except ImportError:
            raise DigestUnavailable(
                "this checkpoint's data digest is BLAKE3, and the blake3 package is not installed in "
                "the kernel's environment: install jupyter-elastic-kernels with its dependencies there"
            ) from None
        return blake3()
    if algorithm == LEGACY_DIGEST:
        return hashlib.sha256()
    raise DigestUnavailable(f"unknown data digest algorithm {algorithm!r}")


def default_digest_algorithm() -> str:
    """What new checkpoints are digested with: BLAKE3 where installed (a dependency), else SHA-256."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        return LEGACY_DIGEST
    return "blake3"


def _hash_parts(algorithm: str, parts: list[memoryview]) -> bytes:
    digest = _hasher(algorithm)
    for part in parts:
        digest.update(part)
    return bytes(digest.digest())


class DigestUnavailable(Exception):
    """The digest algorithm a manifest names cannot be computed here."""


@dataclass
class DigestMark:
    """Where a :class:`DataDigest` was, so a failed group's bytes can be taken back out."""

    chunks: int
    fill: int
    parts: list[memoryview]


class DataDigest:
    """The digest of ``data.bin``: the hash of the hashes of each 16 MiB chunk, BLAKE3
    (``algorithm="blake3"``, what new checkpoints use) or SHA-256 (older ones).

    Why not one hash over the file: SHA-256 runs at about 1-2 GB/s per core, as slow as
    the disk, and would double the time to hibernate or resume a big kernel. Each chunk
    (at a fixed offset, so writer and reader agree) is hashed on a worker thread as soon
    as it is complete (hashlib releases the GIL), in parallel with other chunks and with
    the next ``write``/``readinto``. The size is in the manifest, so the result binds the
    file as tightly as a flat hash.

    Why BLAKE3: what the HMAC-signed manifest carries must be a collision- and
    second-preimage-resistant digest of *every* byte (raw buffers included: a tampered array
    is silent corruption), and even in parallel chunks SHA-256 was most of what a restore or a
    checkpoint of a big array cost (1 GiB on a 2-core VM: 0.47 s read + digest, of which
    the read into fresh memory is ~0.1 s). BLAKE3 (the ``blake3`` package, a dependency)
    hashes 7.9 GiB/s per core there against SHA-256's 1.9. The standard library has nothing
    as fast that qualifies (SHA-1 is broken for collisions; BLAKE2b, SHA-512 and MD5 were
    slower than SHA-256 there). SHA-256 stays for checkpoints written before, and for kernels
    whose environment lacks ``blake3``. Chunk size and construction are part of the format:
    changing them makes every existing checkpoint fail verification.

    Chunks are collected as memoryviews of the data, not copies, so the data must not
    change until :meth:`hexdigest`: the writer writes bytes that stay put (pickle frames,
    the objects' own buffers) and the reader unpickles only after the digest matched.
    An object mutated by a *background thread* while a checkpoint is written can make
    that checkpoint fail verification later (it would be torn anyway).
    """

    def __init__(self, executor: Executor | None = None, algorithm: str = LEGACY_DIGEST) -> None:
        _hasher(algorithm)  # unknown or not installed: fail before any byte is read or written
        self.algorithm = algorithm
        self._executor = executor
        self._chunks: list[Future[bytes] | bytes] = []
        self._parts: list[memoryview] = []
        self._fill = 0

    def update(self, data: Any) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        while view:
            part = view[: DIGEST_CHUNK - self._fill]
            self._parts.append(part)
            self._fill += len(part)
            view = view[len(part) :]
            if self._fill == DIGEST_CHUNK:
                parts, self._parts, self._fill = self._parts, [], 0
                pool = self._executor
                self._chunks.append(
                    pool.submit(_hash_parts, self.algorithm, parts)
                    if pool is not None
                    else _hash_parts(self.algorithm, parts)
                )

    def mark(self) -> DigestMark:
        return DigestMark(len(self._chunks), self._fill, list(self._parts))

    def rollback(self, mark: DigestMark) -> None:
        del self._chunks[mark.chunks :]
        self._fill, self._parts = mark.fill, list(mark.parts)

    def hexdigest(self) -> str:
        top = _hasher(self.algorithm)
        for chunk in self._chunks:
            top.update(chunk if isinstance(chunk, bytes) else chunk.result())
        if self._fill:
            top.update(_hash_parts(self.algorithm, self._parts))
        return str(top.hexdigest())


class ChunkDigests:
    """The :class:`DataDigest` of ``size`` bytes that arrive in pieces, chunks in any order, each
    chunk's pieces in order (a download's parallel ranged reads of whole chunks): each chunk is
    hashed by the thread its range came in on, as its pieces arrive, so hashing overlaps the
    download instead of following it. Same construction, same result as :class:`DataDigest`."""

    def __init__(self, algorithm: str, size: int) -> None:
        _hasher(algorithm)  # unknown or not installed: fail before any byte is read
        self.algorithm = algorithm
        self.size = size
        self._chunks: dict[int, bytes] = {}
        #: Chunks begun and not finished: their hasher and how far into the chunk it is.
        self._open: dict[int, tuple[Any, int]] = {}

    def add_piece(self, offset: int, data: memoryview) -> None:
        """``data`` is the next bytes of one chunk, at ``offset``: a chunk's pieces come in
        order (one range's thread reads them), never across its end."""
        index, within = divmod(offset, DIGEST_CHUNK)
        if within + len(data) > DIGEST_CHUNK:
            raise ValueError(f"a piece at {offset} of {len(data)} bytes crosses the end of its chunk")
        hasher, expected = self._open.pop(index, (None, 0))
        if within != expected:
            raise ValueError(f"the piece at {offset} is out of order: chunk {index} is at {expected}")
        if hasher is None:
            hasher = _hasher(self.algorithm)
        hasher.update(data)
        if within + len(data) == DIGEST_CHUNK or offset + len(data) == self.size:
            self._chunks[index] = bytes(hasher.digest())
        else:
            self._open[index] = (hasher, within + len(data))

    def hexdigest(self) -> str:
        top = _hasher(self.algorithm)
        for index in range(-(-self.size // DIGEST_CHUNK)):
            top.update(self._chunks[index])  # a KeyError: a range never arrived (a bug)
        return str(top.hexdigest())


class KnownDigest(DataDigest):
    """A digest already computed over the same bytes (:class:`ChunkDigests`, as they arrived):
    what a reader compares instead of hashing them a second time."""

    def __init__(self, algorithm: str, hexdigest: str) -> None:
        super().__init__(None, algorithm)
        self._known = hexdigest

    def update(self, data: Any) -> None:
        return None

    def hexdigest(self) -> str:
        return self._known


@contextlib.contextmanager
def digest_workers() -> Iterator[Executor]:
    """Threads for :class:`DataDigest` (a few: the disk is the other limit)."""
    with ThreadPoolExecutor(
        max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="ckpt-digest"
    ) as pool:
        yield pool


def digests_match(expected_hex: str, actual_hex: str) -> bool:
    return hmac.compare_digest(expected_hex.encode("ascii", "replace"), actual_hex.encode("ascii", "replace"))
