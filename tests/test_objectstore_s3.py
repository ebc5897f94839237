"""The object store's client and transfers against a real S3-compatible server (SeaweedFS).

What the checkpoint store will rely on: objects written whole or not at all, a conditional write
that only one writer wins, multipart uploads invisible until completed, parallel ranged reads, and
presigned URLs that allow exactly one request on one key for a bounded time and nothing else.
"""

from __future__ import annotations

import datetime as dt
import os
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelmgr.objectstore import transfer
from kernelmgr.objectstore.client import Bucket, ObjectStoreError
from kernelmgr.objectstore.sigv4 import presign
from tests.support.s3 import S3Server, running_s3

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with running_s3(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server, request: pytest.FixtureRequest) -> Bucket:
    name = "t-" + request.node.name.replace("_", "-")[:50].strip("-").lower()
    b = s3.bucket(name)
    b.create()
    return b


def test_objects_round_trip_and_list_across_pages(bucket: Bucket) -> None:
    for i in range(7):
        bucket.put(f"owner/k{i}", bytes([i]) * (i + 1))
    bucket.put("other/k", b"x")
    listed = bucket.listing("owner/", page_size=3)
    assert [o.key for o in listed] == [f"owner/k{i}" for i in range(7)]
    assert [o.size for o in listed] == list(range(1, 8))
    assert bucket.get("owner/k3") == b"\x03" * 4
    assert bucket.get("owner/k6", start=2, end=4) == b"\x06" * 3
    assert bucket.head("owner/k2") is not None and bucket.head("owner/missing") is None
    assert bucket.delete_prefix("owner/") == 7
    assert bucket.listing("owner/") == [] and bucket.get("other/k") == b"x"


def test_only_one_writer_wins_a_conditional_write(bucket: Bucket) -> None:
    bucket.put("owner/kernel/current", b"first", only_if_new=True)
    with pytest.raises(ObjectStoreError) as refused:
        bucket.put("owner/kernel/current", b"second", only_if_new=True)
    assert refused.value.status == 412
    assert bucket.get("owner/kernel/current") == b"first"


def test_a_multipart_upload_through_presigned_parts_is_invisible_until_completed(bucket: Bucket) -> None:
    data = memoryview(os.urandom(12 * MiB + 123))
    key = "owner/kernel/ckpt/data.bin"
    upload = bucket.start_upload(key)
    urls = bucket.part_urls(key, upload, transfer.part_count(len(data), 5 * MiB), expires=600)
    sent: list[int] = []
    etags = transfer.upload_parts(urls, data, part_size=5 * MiB, workers=3, on_progress=sent.append)
    assert sum(sent) == len(data) and len(etags) == 3
    assert bucket.head(key) is None  # nothing visible before the upload completes
    bucket.complete_upload(key, upload, etags)
    assert bucket.head(key) is not None

    into = bytearray(len(data))
    got: list[int] = []
    transfer.download(
        bucket.presign("GET", key, 600), memoryview(into), part_size=4 * MiB, on_progress=got.append
    )
    assert into == data and sum(got) == len(data)

    # Piece by piece: aligned pieces from each range's start, the last shorter, all of it once.
    pieces: dict[int, bytes] = {}
    counted: list[int] = []

    def sink(offset: int, piece: memoryview) -> None:
        assert offset not in pieces and (offset % (4 * MiB)) % MiB == 0
        pieces[offset] = bytes(piece)

    transfer.download_pieces(
        bucket.presign("GET", key, 600),
        len(data),
        sink,
        part_size=4 * MiB,
        piece_size=MiB,
        on_progress=counted.append,
    )
    assert b"".join(pieces[o] for o in sorted(pieces)) == data and sum(counted) == len(data)
    assert len(pieces) == 13 and len(pieces[max(pieces)]) == 123


def test_an_aborted_upload_leaves_nothing(bucket: Bucket) -> None:
    key = "owner/kernel/ckpt/data.bin"
    upload = bucket.start_upload(key)
    transfer.upload_parts(bucket.part_urls(key, upload, 1, 600), memoryview(b"half"))
    bucket.abort_upload(key, upload)
    assert bucket.head(key) is None and bucket.listing("owner/") == []


def test_a_presigned_url_allows_its_one_request_and_nothing_else(bucket: Bucket) -> None:
    put_url = bucket.presign("PUT", "alice/k1/manifest.json", 600)
    transfer.put(put_url, b"{}")
    assert bucket.get("alice/k1/manifest.json") == b"{}"
    # The same signature on another key, another method or a longer validity is refused.
    other_key = put_url.replace("/alice/k1/", "/bob/k1/")
    with pytest.raises(transfer.TransferError, match="403"):
        transfer.put(other_key, b"forged")
    with pytest.raises(transfer.TransferError, match="403"):
        transfer.get(put_url)
    longer = put_url.replace("X-Amz-Expires=600", "X-Amz-Expires=6000")
    with pytest.raises(transfer.TransferError, match="403"):
        transfer.put(longer, b"forged")
    assert bucket.listing("bob/") == []


def test_an_expired_url_is_refused(bucket: Bucket) -> None:
    bucket.put("alice/k1/data.bin", b"secret")
    two_hours_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
    url = presign(bucket.credentials, "GET", bucket.url("alice/k1/data.bin"), 60, now=two_hours_ago)
    with pytest.raises(transfer.TransferError, match="403"):
        transfer.get(url)


def test_a_credential_without_write_rights_writes_nothing(s3: S3Server, bucket: Bucket) -> None:
    as_reader = s3.bucket(bucket.name, s3.reader)
    with pytest.raises(ObjectStoreError) as refused:
        as_reader.put("alice/k1/current", b"forged")
    assert refused.value.status == 403
    assert bucket.get("alice/k1/current") is None


def test_urls_name_only_the_bucket_and_key_never_the_secret(bucket: Bucket) -> None:
    url = bucket.presign("GET", "alice/k1/data.bin", 60)
    parts = urllib.parse.urlsplit(url)
    assert parts.path == f"/{bucket.name}/alice/k1/data.bin"
    assert bucket.credentials.secret_key not in url
    assert Path(parts.path).name == "data.bin"
