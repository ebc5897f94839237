"""AES-CTR at a stream offset (``kernelmgr.checkpoint.cipher``): the chunked, in-place forms
agree with one plain pass of ``cryptography`` over the whole stream, at any offset."""

from __future__ import annotations

import os

import pytest

from kernelmgr.checkpoint import cipher

pytestmark = pytest.mark.pure
pytest.importorskip("cryptography")


def whole_stream(key: bytes, data: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    transform = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    return transform.update(data) + transform.finalize()


@pytest.mark.parametrize("offset", [0, 5, 16, 37, 1000])
def test_every_form_matches_the_whole_stream_at_its_offset(
    offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cipher, "_CHUNK", 64)  # many chunks, most of them off a block boundary
    key = os.urandom(32)
    stream = os.urandom(2000)
    expected = whole_stream(key, stream)[offset:]
    piece = stream[offset:]
    assert cipher.crypt(key, offset, piece) == expected
    assert bytes(cipher.encrypted(key, offset, memoryview(piece))) == expected
    buffer = bytearray(piece)
    cipher.crypt_in_place(key, offset, memoryview(buffer))
    assert bytes(buffer) == expected
    cipher.crypt_in_place(key, offset, memoryview(buffer))  # the same operation decrypts
    assert bytes(buffer) == piece
