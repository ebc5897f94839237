"""Encryption of a checkpoint's objects at rest in an object store (``cryptography``'s AES).

The server derives one key per checkpoint from its owner's envelope key
(:mod:`kernelmgr.objectstore.envelope`) and hands only that key to the kernel, with its upload
plan or its restore. ``data.bin`` and the manifest are encrypted with AES-256 in counter mode at
their byte offsets, so every part of an upload and every range of a download is encrypted or
decrypted on its own, in place, with no change in size. Integrity is not the cipher's job here:
the manifest is HMAC-signed and carries ``data.bin``'s digest, both checked after decryption and
before anything is unpickled.
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


def crypt(key: bytes, offset: int, data: bytes | memoryview) -> bytes:
    """``data`` encrypted (or decrypted: the same operation) as the bytes at ``offset`` of a stream."""
    _, cipher, algorithms, modes, _ = _primitives()
    counter = (offset // _BLOCK).to_bytes(_BLOCK, "big")
    transform = cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
    skip = offset % _BLOCK
    if skip:
        transform.update(bytes(skip))
    return bytes(transform.update(bytes(data)) + transform.finalize())


def crypt_in_place(key: bytes, offset: int, view: memoryview) -> None:
    view[:] = crypt(key, offset, view)
