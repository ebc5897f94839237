"""Encryption of checkpoints at rest, in an object store or on a file system (``cryptography``'s AES).

The server derives one key per checkpoint from its owner's envelope key
(:mod:`kernelmgr.objectstore.envelope`) and hands only that key to the kernel, with its upload
plan or its restore. ``data.bin`` and the manifest are encrypted with AES-256 in counter mode at
their byte offsets, so every part of an upload and every range of a download is encrypted or
decrypted on its own, in place, with no change in size. Integrity is not the cipher's job here:
the manifest is HMAC-signed and carries ``data.bin``'s digest, both checked after decryption and
before anything is unpickled.

On a file system the kernel writes its checkpoints itself, with ids only it knows beforehand, so it
gets its *kernel's* key (:meth:`kernelmgr.objectstore.envelope.OwnerKeys.kernel_key`) and derives
each checkpoint's key from it (:func:`checkpoint_key`): one keystream never serves two checkpoints.
"""

from __future__ import annotations

from typing import Any

KEY_BYTES = 32
_BLOCK = 16


def _primitives() -> Any:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as exc:  # pragma: no cover - the extra is installed where encryption is on
        raise RuntimeError(
            "checkpoint encryption needs the 'cryptography' package (pip install cryptography)"
        ) from exc
    return hashes, Cipher, algorithms, modes, HKDF


def derive(key: bytes, purpose: str) -> bytes:
    """A 32-byte key for ``purpose`` from ``key`` (HKDF-SHA256): one key never serves two uses."""
    hashes, _, _, _, hkdf = _primitives()
    return bytes(
        hkdf(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=purpose.encode()).derive(key)
    )


def data_key(checkpoint_key: bytes) -> bytes:
    return derive(checkpoint_key, "jupyter-elastic-kernels data.bin")


def manifest_key(checkpoint_key: bytes) -> bytes:
    return derive(checkpoint_key, "jupyter-elastic-kernels manifest.json")


def checkpoint_key(kernel_key: bytes, checkpoint_id: str) -> bytes:
    """The key of one checkpoint a kernel writes on a file system, from its kernel's key."""
    return derive(kernel_key, f"jupyter-elastic-kernels file checkpoint {checkpoint_id}")


#: Encrypted through one buffer of this size: cryptography's ``update`` allocates its output and
#: a copy of the input per call (1 GiB took 12 s on a loaded 2-core VM, against under 1 s here).
_CHUNK = 4 * 1024 * 1024


def _transform(key: bytes, offset: int) -> Any:
    _, cipher, algorithms, modes, _ = _primitives()
    counter = (offset // _BLOCK).to_bytes(_BLOCK, "big")
    transform = cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
    skip = offset % _BLOCK
    if skip:
        transform.update(bytes(skip))
    return transform


def crypt_into(key: bytes, offset: int, data: bytes | memoryview, out: memoryview) -> None:
    """``data`` (the bytes at ``offset`` of a stream) encrypted, or decrypted, into ``out`` (its
    length; it may be ``data`` itself)."""
    source = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    target = out if out.format == "B" else out.cast("B")
    transform = _transform(key, offset)
    buffer = bytearray(min(len(source), _CHUNK) + _BLOCK)
    for start in range(0, len(source), _CHUNK):
        count = transform.update_into(source[start : start + _CHUNK], buffer)
        target[start : start + count] = memoryview(buffer)[:count]


def encrypted(key: bytes, offset: int, data: bytes | memoryview) -> bytearray:
    """``data`` encrypted (or decrypted) into a new buffer: an upload's part."""
    out = bytearray(len(data) if isinstance(data, bytes) else memoryview(data).nbytes)
    crypt_into(key, offset, data, memoryview(out))
    return out


def crypt(key: bytes, offset: int, data: bytes | memoryview) -> bytes:
    """``data`` encrypted (or decrypted: the same operation) as the bytes at ``offset`` of a stream."""
    return bytes(encrypted(key, offset, data))


def crypt_in_place(key: bytes, offset: int, view: memoryview) -> None:
    crypt_into(key, offset, view, view)
