"""Hibernation through an S3-compatible object store (a real one: SeaweedFS, ``tests/support/s3.py``).

Kernels are local processes here; they reach the store only through presigned URLs the server
hands them (no credential), and the local checkpoint folder is scratch space pruned after each
commit, so every resume below reads its checkpoint back from the bucket by ranged GETs.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.checkpoint import cipher
from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.layout import is_checkpoint_id
from kernelmgr.checkpoint.writer import write_checkpoint
from kernelmgr.objectstore import transfer
from kernelmgr.objectstore.client import Bucket
from kernelmgr.objectstore.store import ENV_RESTORE_DATA_URL, ObjectCheckpointStore
from tests.conftest import INVENTORY, PROFILES
from tests.support.oracle import SETUP, Reference, check_same, cycle_cell, run_both
from tests.support.s3 import S3Server, running_s3
from tests.support.server import RunningServer, start_server, wait_for

SECRET = b"s" * 32
REPORT = "restore-report.json"
ID_ENV, KEY_ENV = "ELASTIC_TEST_S3_ACCESS_KEY", "ELASTIC_TEST_S3_SECRET_KEY"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with running_s3(tmp_path_factory.mktemp("s3")) as server:
        yield server


def bucket_name(request: pytest.FixtureRequest) -> str:
    return "ck-" + request.node.name.replace("_", "-")[:50].strip("-").lower()


def s3_server(
    home: Path,
    s3: S3Server,
    bucket: str,
    key_files: list[str] | None = None,
    policy: dict[str, Any] | None = None,
    part_size_mib: int = 32,
) -> RunningServer:
    config: dict[str, Any] = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "checkpoint_root": str(home / "scratch"),
            "checkpoint_store": "s3",
        },
        "S3Checkpoints": {
            "endpoint": s3.endpoint,
            "bucket": bucket,
            "create_bucket": True,
            "access_key_id_env": ID_ENV,
            "secret_access_key_env": KEY_ENV,
            "encryption_key_files": key_files or [],
            "part_size_mib": part_size_mib,
        },
    }
    if policy:
        config["CullPolicy"] = policy
    env = {ID_ENV: s3.admin.access_key, KEY_ENV: s3.admin.secret_key}
    return start_server(home, config, env_extra=env)


def committed_ids(bucket: Bucket, owner: str, kernel_id: str) -> set[str]:
    """The checkpoints that have a manifest (committed) in the bucket."""
    base = f"{owner}/{kernel_id}/"
    return {
        item.key[len(base) :].split("/")[0]
        for item in bucket.listing(base)
        if item.key.endswith(("/manifest.json", "/manifest.json.aes"))
    }


def checkpoint_folders(bucket: Bucket, owner: str, kernel_id: str) -> set[str]:
    base = f"{owner}/{kernel_id}/"
    names = {item.key[len(base) :].split("/")[0] for item in bucket.listing(base)}
    return {name for name in names if is_checkpoint_id(name)}


def current(bucket: Bucket, owner: str, kernel_id: str) -> str | None:
    raw = bucket.get(f"{owner}/{kernel_id}/current")
    return None if raw is None else raw.decode().strip()


def local_checkpoints(home: Path, owner: str, kernel_id: str) -> list[str]:
    folder = home / "scratch" / owner / kernel_id
    return sorted(p.name for p in folder.iterdir() if is_checkpoint_id(p.name)) if folder.exists() else []


def test_five_cycles_through_the_object_store_keep_the_namespace(
    tmp_path: Path, s3: S3Server, reference: Reference, request: pytest.FixtureRequest
) -> None:
    name = bucket_name(request)
    bucket = s3.bucket(name)
    server = s3_server(tmp_path, s3, name)
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        run_both(server, kernel_id, reference, SETUP)
        check_same(server, kernel_id, reference)
        owner = server.get(f"/api/elastic/kernels/{kernel_id}")["owner"]
        for n in range(1, 6):
            run_both(server, kernel_id, reference, cycle_cell(n))
            if n == 3:  # the server restarts in between: it finds the commit in the bucket
                server.stop()  # hibernate_on_shutdown
                server = s3_server(tmp_path, s3, name)
            else:
                reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
                assert reply.status == 200, reply
            committed = current(bucket, owner, kernel_id)
            assert committed is not None
            pruned = {committed}
            # Pruned: one checkpoint left in the bucket, no local copy (the resume must download it).
            wait_for(
                lambda pruned=pruned: (
                    checkpoint_folders(bucket, owner, kernel_id) == pruned
                    and not local_checkpoints(tmp_path, owner, kernel_id)
                ),
                timeout=60,
                what="the superseded checkpoints and the local copy to be pruned",
            )
            assert committed_ids(bucket, owner, kernel_id) == {committed}
            model = server.get(f"/api/elastic/kernels/{kernel_id}")
            assert model["state"] == "hibernated", model
            check_same(server, kernel_id, reference)  # wakes it: restored from the bucket
            report = json.loads(
                (tmp_path / "scratch" / owner / kernel_id / "restore-report.json").read_text()
            )
            assert report["refused"] is None and report["checkpoint"] == committed, report
            assert report["not_restored"] == [], report
    finally:
        server.shutdown_all_kernels()
        server.stop()
    assert bucket.listing(f"{owner}/{kernel_id}/") == []  # shut down for good: every object deleted


def test_hibernated_ttl_deletes_the_kernels_objects(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    name = bucket_name(request)
    bucket = s3.bucket(name)
    policy = {"idle_timeout": 3600, "hibernated_ttl": 2, "interval": 1, "warn_before": 0}
    server = s3_server(tmp_path, s3, name, policy=policy)
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        server.execute(kernel_id, "x = 1")
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        owner = reply.body["owner"]
        assert committed_ids(bucket, owner, kernel_id)
        wait_for(
            lambda: bucket.listing(f"{owner}/{kernel_id}/") == [],
            timeout=120,
            what="hibernated_ttl to remove the kernel and delete its objects",
        )
        assert server.request("GET", f"/api/elastic/kernels/{kernel_id}").status == 404
    finally:
        server.shutdown_all_kernels()
        server.stop()


#: Run in the kernel: the next upload's first part announces itself, then hangs until the kernel dies.
HANG_UPLOAD = """
import kernelmgr.objectstore.transfer as _t
def _hang(url, data, timeout=300.0, _marker={marker!r}):
    import pathlib, threading
    pathlib.Path(_marker).write_text("uploading")
    threading.Event().wait()
_t.put = _hang
del _t, _hang
"""


def killed_mid_upload(
    server: RunningServer, bucket: Any, kernel_id: str, state: str, hang: str, marker: Path
) -> str:
    """Hibernate once (``state`` in the kernel), then again with ``hang`` holding the upload
    until ``marker`` appears, and SIGKILL the kernel there: the hibernation fails, and the first
    checkpoint is still the bucket's only commit. Returns that checkpoint's id."""
    server.execute(kernel_id, state)
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply
    owner = reply.body["owner"]
    first = current(bucket, owner, kernel_id)
    assert first is not None
    pid = int(server.execute(kernel_id, "balance = 0\nimport os; print(os.getpid())", timeout=120))
    server.execute(kernel_id, hang.format(marker=str(marker)), timeout=60)
    replies: list[Any] = []
    hibernating = threading.Thread(
        target=lambda: replies.append(server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate"))
    )
    hibernating.start()
    wait_for(marker.exists, timeout=120, what="the kernel to be uploading")
    os.kill(pid, signal.SIGKILL)
    hibernating.join(timeout=180)
    assert replies and replies[0].status >= 500, replies
    assert current(bucket, owner, kernel_id) == first
    assert committed_ids(bucket, owner, kernel_id) == {first}
    return first


def test_a_kernel_killed_mid_upload_leaves_the_previous_checkpoint(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    name = bucket_name(request)
    bucket = s3.bucket(name)
    server = s3_server(tmp_path, s3, name)
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        first = killed_mid_upload(
            server, bucket, kernel_id, "balance = 100", HANG_UPLOAD, tmp_path / "uploading"
        )
        # The previous checkpoint stands (as with a file system: test_hibernation_local.py).
        model = server.get(f"/api/elastic/kernels/{kernel_id}")
        assert model["state"] in ("running", "starting", "dead"), model
        assert model["checkpoint"]["id"] == first, model["checkpoint"]
    finally:
        server.shutdown_all_kernels()
        server.stop()


# -- the store against the bucket (no server process) ------------------------------------------


def write_and_upload(store: ObjectCheckpointStore, owner: str, kernel_id: str, value: Any) -> str:
    """What a kernel and the server do for one hibernation, up to (not including) the commit."""
    manifest = write_checkpoint(
        store.kernel_dir(owner, kernel_id),
        {"value": value},
        key=store.key_for(owner),
        owner=owner,
        kernel_id=kernel_id,
        prune=False,
    )
    return manifest.to_json()


def upload_parts(store: ObjectCheckpointStore, owner: str, kernel_id: str, reported: str) -> Any:
    """The kernel's part (as the agent does it, encryption included), given the server's plan."""
    manifest = store.commit(owner, kernel_id, reported)
    upload = store.begin_upload(owner, kernel_id, manifest)
    data = (store.kernel_dir(owner, kernel_id) / manifest.checkpoint_id / "data.bin").read_bytes()
    crypt = None
    if upload.checkpoint_key:
        data_key = cipher.data_key(bytes.fromhex(upload.checkpoint_key))

        def crypt(offset: int, piece: memoryview) -> bytes:
            return cipher.crypt(data_key, offset, piece)

    etags = transfer.upload_parts(upload.urls, memoryview(data), upload.part_size, transform=crypt)
    return upload, etags


def make_store(tmp_path: Path, bucket: Bucket) -> ObjectCheckpointStore:
    bucket.create()
    return ObjectCheckpointStore(tmp_path / "scratch", SECRET, bucket, presign_seconds=300)


def test_a_server_killed_between_upload_and_commit_leaves_the_previous_checkpoint(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    bucket = s3.bucket(bucket_name(request))
    store = make_store(tmp_path, bucket)
    owner, kernel_id = "alice", "k1"
    reported = write_and_upload(store, owner, kernel_id, 1)
    upload, etags = upload_parts(store, owner, kernel_id, reported)
    store.finish_upload(upload, etags, reported)
    first = store.commit(owner, kernel_id, reported).checkpoint_id

    # The server dies after the kernel sent its parts (the upload never completed) ...
    reported = write_and_upload(store, owner, kernel_id, 2)
    upload_parts(store, owner, kernel_id, reported)
    # ... and, another time, after completing the upload but before writing the manifest.
    reported = write_and_upload(store, owner, kernel_id, 3)
    upload, etags = upload_parts(store, owner, kernel_id, reported)
    bucket.complete_upload(upload.key, upload.upload_id, etags)

    restarted = ObjectCheckpointStore(tmp_path / "scratch", SECRET, bucket)
    latest = restarted.latest(owner, kernel_id)
    assert latest is not None and latest.checkpoint_id == first
    assert committed_ids(bucket, owner, kernel_id) == {first}
    restarted.prune(owner, kernel_id)  # the data.bin without a manifest goes
    assert checkpoint_folders(bucket, owner, kernel_id) == {first}


def test_an_owner_cannot_read_another_owners_checkpoints(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    bucket = s3.bucket(bucket_name(request))
    store = make_store(tmp_path, bucket)
    reported = write_and_upload(store, "alice", "k-alice", "alice's secret")
    upload, etags = upload_parts(store, "alice", "k-alice", reported)
    store.finish_upload(upload, etags, reported)
    alice_ckpt = store.commit("alice", "k-alice", reported).checkpoint_id
    reported = write_and_upload(store, "bob", "k-bob", "bob's")
    upload, etags = upload_parts(store, "bob", "k-bob", reported)
    store.finish_upload(upload, etags, reported)
    bob_ckpt = store.commit("bob", "k-bob", reported).checkpoint_id

    env = store.agent_env(
        "bob", "k-bob", key_file=tmp_path / "key", restore=True, restore_checkpoint=bob_ckpt
    )
    url = env[ENV_RESTORE_DATA_URL]
    assert transfer.get(url) is not None  # bob's own checkpoint: readable
    parts = urllib.parse.urlsplit(url)
    for path in (
        parts.path.replace(f"/bob/k-bob/{bob_ckpt}/", f"/alice/k-alice/{alice_ckpt}/"),
        parts.path.replace("/bob/k-bob/", "/alice/k-bob/"),
    ):
        with pytest.raises(transfer.TransferError, match="403"):
            transfer.get(urllib.parse.urlunsplit(parts._replace(path=path)))
    # Bob's kernel id under Alice's name, or Alice's manifest copied under Bob's prefix: refused.
    assert store.latest("bob", "k-alice") is None
    bucket.put(
        f"bob/k-bob/{alice_ckpt}/manifest.json",
        bucket.get(f"alice/k-alice/{alice_ckpt}/manifest.json") or b"",
    )
    bucket.put(f"bob/k-bob/{alice_ckpt}/data.bin", bucket.get(f"alice/k-alice/{alice_ckpt}/data.bin") or b"")
    bucket.put("bob/k-bob/current", f"{alice_ckpt}\n".encode())
    with pytest.raises(CheckpointRefused, match="another owner's key"):
        ObjectCheckpointStore(tmp_path / "scratch", SECRET, bucket).latest("bob", "k-bob")


def test_pruning_and_removal_delete_objects(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    bucket = s3.bucket(bucket_name(request))
    store = make_store(tmp_path, bucket)
    ids = []
    for value in (1, 2):
        reported = write_and_upload(store, "carol", "k", value)
        upload, etags = upload_parts(store, "carol", "k", reported)
        store.finish_upload(upload, etags, reported)
        ids.append(store.commit("carol", "k", reported).checkpoint_id)
    assert committed_ids(bucket, "carol", "k") == set(ids)
    store.prune("carol", "k")
    assert checkpoint_folders(bucket, "carol", "k") == {ids[1]}
    assert not local_checkpoints(tmp_path, "carol", "k")
    store.remove("carol", "k")  # hibernated_ttl, or shut down for good
    assert bucket.listing("carol/") == []


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize(
    ("settings", "env", "says"),
    [
        ({"bucket": "b"}, {ID_ENV: "a", KEY_ENV: "s"}, "S3Checkpoints.endpoint '' must be an http"),
        ({"endpoint": "http://127.0.0.1:9"}, {ID_ENV: "a", KEY_ENV: "s"}, "S3Checkpoints.bucket is empty"),
        ({"endpoint": "http://127.0.0.1:9", "bucket": "b"}, {}, f"set {ID_ENV} and {KEY_ENV}"),
        (
            {"endpoint": "http://127.0.0.1:9", "bucket": "b", "part_size_mib": 1},
            {ID_ENV: "a", KEY_ENV: "s"},
            "part_size_mib must be at least 5",
        ),
        (
            {"endpoint": "http://127.0.0.1:9", "bucket": "b", "presign_seconds": 10},
            {ID_ENV: "a", KEY_ENV: "s"},
            "presign_seconds must be between 60 and 604800",
        ),
        ({"endpoint": "http://127.0.0.1:9", "bucket": "b"}, {ID_ENV: "a", KEY_ENV: "s"}, "is not usable"),
    ],
)
def test_a_bad_object_store_setting_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], env: dict[str, str], says: str
) -> None:
    from traitlets.config import Config

    from kernelmgr.config import S3Checkpoints
    from kernelmgr.core.errors import ConfigError

    for name in (ID_ENV, KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = Config(
        {"S3Checkpoints": {**settings, "access_key_id_env": ID_ENV, "secret_access_key_env": KEY_ENV}}
    )
    with pytest.raises(ConfigError) as refused:
        S3Checkpoints(config=config).build(str(tmp_path), SECRET)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_credential_the_store_refuses_stops_the_start(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    server = s3_server(tmp_path, s3, bucket_name(request))  # creates the bucket
    server.stop()
    config = {
        "ElasticKernels": {"checkpoint_root": str(tmp_path / "scratch"), "checkpoint_store": "s3"},
        "S3Checkpoints": {
            "endpoint": s3.endpoint,
            "bucket": bucket_name(request),
            "access_key_id_env": ID_ENV,
            "secret_access_key_env": KEY_ENV,
        },
    }
    with pytest.raises(RuntimeError, match=r"server exited with 2"):
        start_server(tmp_path / "wrong", config, env_extra={ID_ENV: s3.admin.access_key, KEY_ENV: "wrong"})


# -- encryption at rest ------------------------------------------------------------------------


def master_key_file(path: Path) -> str:
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


def test_checkpoints_are_encrypted_at_rest_and_restored(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    name = bucket_name(request)
    bucket = s3.bucket(name)
    server = s3_server(tmp_path, s3, name, [master_key_file(tmp_path / "master")])
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        server.execute(kernel_id, "secret_words = b'PLAINTEXT-MARKER-' * 4096")
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        owner = reply.body["owner"]
        committed = current(bucket, owner, kernel_id)
        stored = {item.key: bucket.get(item.key) or b"" for item in bucket.listing(f"{owner}/")}
        base = f"{owner}/{kernel_id}/{committed}/"
        assert {f"{base}data.bin.aes", f"{base}manifest.json.aes"} <= set(stored), sorted(stored)
        assert not any(key.endswith(("/data.bin", "/manifest.json")) for key in stored)
        for key, body in stored.items():
            assert b"PLAINTEXT-MARKER-" not in body and b"secret_words" not in body, key
        master = (tmp_path / "master").read_text()
        assert all(master.encode() not in body for body in stored.values())
        out = server.execute(kernel_id, "print(secret_words[:17], len(secret_words))", timeout=120)
        assert out.strip() == "b'PLAINTEXT-MARKER-' 69632"
    finally:
        server.shutdown_all_kernels()
        server.stop()


def test_a_master_key_rotation_keeps_every_checkpoint_readable(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    from kernelmgr.objectstore.envelope import OwnerKeys, fingerprint, read_master_key

    bucket = s3.bucket(bucket_name(request))
    bucket.create()
    old, new = master_key_file(tmp_path / "old"), master_key_file(tmp_path / "new")

    def store(*files: str) -> ObjectCheckpointStore:
        keys = OwnerKeys(bucket, "", [read_master_key(f) for f in files])
        return ObjectCheckpointStore(tmp_path / "scratch", SECRET, bucket, envelope=keys)

    first = store(old)
    reported = write_and_upload(first, "dana", "k", {"v": 1})
    upload, etags = upload_parts(first, "dana", "k", reported)
    first.finish_upload(upload, etags, reported)
    committed = first.commit("dana", "k", reported).checkpoint_id

    def wrapped_by() -> str:
        return str(json.loads(bucket.get("dana/.data-key") or b"{}")["master"])

    assert wrapped_by() == fingerprint(read_master_key(old))
    rotating = store(new, old)  # the new key first, the old one kept to unwrap
    latest = rotating.latest("dana", "k")
    assert latest is not None and latest.checkpoint_id == committed
    assert wrapped_by() == fingerprint(read_master_key(new))  # re-wrapped on use
    latest = store(new).latest("dana", "k")  # the old key can go
    assert latest is not None and latest.checkpoint_id == committed
    with pytest.raises(CheckpointRefused, match="encryption_key_files"):
        store(master_key_file(tmp_path / "other")).latest("dana", "k")


def test_a_prune_leaves_an_upload_in_flight_alone(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    """A prune after a background checkpoint may run while the next hibernation commits."""
    bucket = s3.bucket(bucket_name(request))
    store = make_store(tmp_path, bucket)
    reported = write_and_upload(store, "erin", "k", 1)
    upload, etags = upload_parts(store, "erin", "k", reported)
    store.finish_upload(upload, etags, reported)
    first = store.commit("erin", "k", reported).checkpoint_id

    reported = write_and_upload(store, "erin", "k", 2)
    upload, etags = upload_parts(store, "erin", "k", reported)
    # The server completed the upload and is about to write the manifest when the prune runs.
    bucket.complete_upload(upload.key, upload.upload_id, etags)
    store.prune("erin", "k")
    assert checkpoint_folders(bucket, "erin", "k") == {first, upload.checkpoint_id}
    assert (store.kernel_dir("erin", "k") / upload.checkpoint_id / "data.bin").exists()
    store.abort_upload(upload)  # given up: the next prune takes the leftover
    store.prune("erin", "k")
    assert checkpoint_folders(bucket, "erin", "k") == {first}


# -- parts streamed while the checkpoint is written; ranges digested as they arrive ------------

MiB = 1 << 20
#: 24 MiB of float64 in one array: five parts of 5 MiB (S3's smallest).
STATE_24_MIB = "import numpy as np\nbig = np.arange(3 * (1 << 20), dtype=np.float64)\nbalance = 100"
#: In the kernel: each part sent sets an event; the local manifest (written once data.bin is whole)
#: waits for it and writes down whether a part reached the store before the data was whole.
PART_BEFORE_MANIFEST = """
def _watch(marker={marker!r}):
    import pathlib, threading
    import kernelmgr.checkpoint.writer as w
    import kernelmgr.objectstore.transfer as t
    sent, put, write_manifest = threading.Event(), t.put, w._write_manifest
    def counted_put(url, data, timeout=300.0):
        etag = put(url, data, timeout)
        sent.set()
        return etag
    def waiting_write_manifest(path, manifest, *rest):
        pathlib.Path(marker).write_text("before" if sent.wait(120) else "after")
        write_manifest(path, manifest, *rest)
    t.put, w._write_manifest = counted_put, waiting_write_manifest
_watch()
del _watch
"""
#: In the kernel: the first part goes through; the second writes the marker and never returns.
HANG_SECOND_PART = """
def _hang_second(marker={marker!r}):
    import pathlib, threading
    import kernelmgr.objectstore.transfer as t
    put, calls, lock = t.put, [], threading.Lock()
    def second_hangs(url, data, timeout=300.0):
        with lock:
            calls.append(url)
            first = len(calls) == 1
        if first:
            return put(url, data, timeout)
        pathlib.Path(marker).write_text("streaming")
        threading.Event().wait()
    t.put = second_hangs
_hang_second()
del _hang_second
"""


def open_uploads(bucket: Bucket, prefix: str) -> list[str]:
    """The keys of the multipart uploads under ``prefix`` that were neither completed nor aborted."""
    import xml.etree.ElementTree as ET

    _, _, body = bucket.request("GET", query={"uploads": "", "prefix": prefix})
    return [el.text or "" for el in ET.fromstring(body).iter() if el.tag.endswith("}Key") or el.tag == "Key"]


def test_parts_reach_the_store_while_the_checkpoint_is_written(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    name = bucket_name(request)
    bucket = s3.bucket(name)
    server = s3_server(tmp_path, s3, name, part_size_mib=5)
    marker = tmp_path / "first-part"
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        server.execute(kernel_id, STATE_24_MIB)
        server.execute(kernel_id, PART_BEFORE_MANIFEST.format(marker=str(marker)), timeout=60)
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        # The first part was in the store before data.bin was whole (before its manifest).
        assert marker.read_text() == "before"
        owner = reply.body["owner"]
        committed = current(bucket, owner, kernel_id)
        assert committed is not None and committed_ids(bucket, owner, kernel_id) == {committed}
        assert open_uploads(bucket, f"{owner}/{kernel_id}/") == []
        wait_for(
            lambda: not local_checkpoints(tmp_path, owner, kernel_id), timeout=60, what="the local copy to go"
        )
        out = server.execute(kernel_id, "print(int(big.sum()), big.nbytes, balance)", timeout=120)
        assert out.split() == [str(sum(range(3 * MiB))), str(24 * MiB), "100"], out
    finally:
        server.shutdown_all_kernels()
        server.stop()


def test_a_kernel_killed_mid_stream_leaves_the_previous_checkpoint(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    name = bucket_name(request)
    bucket = s3.bucket(name)
    server = s3_server(tmp_path, s3, name, part_size_mib=5)
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        first = killed_mid_upload(
            server, bucket, kernel_id, STATE_24_MIB, HANG_SECOND_PART, tmp_path / "streaming"
        )
        owner = server.get(f"/api/elastic/kernels/{kernel_id}")["owner"]
        # The upload the kernel was streaming into was aborted: its first part is gone too.
        assert open_uploads(bucket, f"{owner}/{kernel_id}/") == []
        model = server.get(f"/api/elastic/kernels/{kernel_id}")
        assert model["checkpoint"]["id"] == first, model["checkpoint"]
    finally:
        server.shutdown_all_kernels()
        server.stop()


def test_a_streamed_upload_holds_at_most_its_workers_parts_and_never_stalls_the_writer(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer queues parts as offsets: however far it runs ahead of a slow store, only
    ``workers`` parts are mapped and in flight at once."""
    bucket = s3.bucket(bucket_name(request))
    bucket.create()
    part, parts, workers = 5 * MiB, 8, 2
    data = os.urandom(parts * part - 12345)
    key = "streamed/data.bin"
    upload_id = bucket.start_upload(key)
    urls = bucket.part_urls(key, upload_id, parts, 300)
    gate, started = threading.Event(), threading.Semaphore(0)
    put = transfer.put

    def gated_put(url: str, body: Any, timeout: float = 300.0) -> str:
        started.release()
        assert gate.wait(120), "the test never opened the gate"
        return put(url, body, timeout)

    monkeypatch.setattr(transfer, "put", gated_put)
    streamer = transfer.PartStreamer(urls, part, workers=workers)
    path = tmp_path / "data.bin"
    with open(path, "w+b") as handle:
        fd = handle.fileno()
        for offset in range(0, len(data), MiB):  # the writer, a MiB at a time, never waiting
            os.pwrite(fd, data[offset : offset + MiB], offset)
            streamer.settled(fd, min(offset + MiB, len(data)))
        for _ in range(workers):
            assert started.acquire(timeout=120)
        assert not started.acquire(timeout=0.5)  # no third part was taken while two are held
        assert streamer.in_flight == workers
        gate.set()
        etags = streamer.finish(len(data))
    assert len(etags) == parts and streamer.peak_in_flight == workers
    bucket.complete_upload(key, upload_id, etags)
    assert bucket.get(key) == data


def test_a_checkpoint_that_outgrows_its_estimate_sends_the_rest_after(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    import numpy as np

    bucket = s3.bucket(bucket_name(request))
    bucket.create()
    store = ObjectCheckpointStore(tmp_path / "scratch", SECRET, bucket, part_size=5 * MiB)
    owner, kernel_id = "dana", "k"
    upload = store.begin_stream(owner, kernel_id, estimate=0)  # URLs for one part only
    assert len(upload.urls) == 1
    streamer = transfer.PartStreamer(upload.urls, upload.part_size)
    manifest = write_checkpoint(
        store.kernel_dir(owner, kernel_id),
        {"value": np.arange(12 * MiB // 8, dtype=np.float64)},
        key=store.key_for(owner),
        owner=owner,
        kernel_id=kernel_id,
        prune=False,
        checkpoint_id=upload.checkpoint_id,
        on_settled=streamer.settled,
        durable=False,
    )
    data = (store.kernel_dir(owner, kernel_id) / upload.checkpoint_id / "data.bin").read_bytes()
    etags = streamer.finish(len(data))
    assert len(etags) == 1
    upload = store.stream_urls(upload, manifest.data_bytes)
    assert len(upload.urls) == transfer.part_count(len(data), upload.part_size) == 3
    etags += transfer.upload_parts(upload.urls[1:], memoryview(data), upload.part_size, first=1)
    store.finish_upload(upload, etags, manifest.to_json())
    restarted = ObjectCheckpointStore(tmp_path / "scratch", SECRET, bucket)
    latest = restarted.latest(owner, kernel_id)
    assert latest is not None and latest.checkpoint_id == upload.checkpoint_id
    assert bucket.get(upload.key) == data


def test_a_kernel_that_underestimates_its_checkpoint_still_commits_it_whole(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    """The server presigns parts for the kernel's estimate; the parts past it go after the write."""
    name = bucket_name(request)
    bucket = s3.bucket(name)
    server = s3_server(tmp_path, s3, name, part_size_mib=5)
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        server.execute(kernel_id, STATE_24_MIB)
        # The estimate says 0 bytes: URLs for one part of the five this checkpoint needs.
        server.execute(
            kernel_id,
            "__import__('kernelmgr.checkpoint.agent').checkpoint.agent._AGENT.estimate = lambda: 0",
        )
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        owner = reply.body["owner"]
        committed = current(bucket, owner, kernel_id)
        info = bucket.head(f"{owner}/{kernel_id}/{committed}/data.bin")
        assert info is not None and info.size == reply.body["checkpoint"]["bytes"] > 20 * MiB
        wait_for(
            lambda: not local_checkpoints(tmp_path, owner, kernel_id), timeout=60, what="the local copy to go"
        )
        out = server.execute(kernel_id, "print(int(big.sum()), balance)", timeout=120)
        assert out.split() == [str(sum(range(3 * MiB))), "100"], out
    finally:
        server.shutdown_all_kernels()
        server.stop()


@pytest.mark.pure
def test_ranges_digested_as_they_arrive_give_the_writers_digest() -> None:
    from kernelmgr.checkpoint.integrity import DIGEST_CHUNK, ChunkDigests, DataDigest

    data = memoryview(os.urandom(3 * DIGEST_CHUNK + 777))
    for algorithm in ("blake3", "sha256"):
        whole = DataDigest(None, algorithm)
        whole.update(data)
        # Piece by piece, as a download hands them over: chunks out of order (ranges of two
        # chunks, the later first), each chunk's pieces in order.
        pieces = ChunkDigests(algorithm, len(data))
        for start in (2 * DIGEST_CHUNK, 0):
            for offset in range(start, min(len(data), start + 2 * DIGEST_CHUNK), 1 << 20):
                pieces.add_piece(offset, data[offset : min(len(data), offset + (1 << 20))])
        assert pieces.hexdigest() == whole.hexdigest()
        with pytest.raises(ValueError, match="out of order"):
            ChunkDigests(algorithm, len(data)).add_piece(1 << 20, data[1 << 20 : 2 << 20])
        with pytest.raises(ValueError, match="crosses the end"):
            ChunkDigests(algorithm, len(data)).add_piece(
                DIGEST_CHUNK - 1, data[DIGEST_CHUNK - 1 : DIGEST_CHUNK + 1]
            )


def test_a_checkpoint_tampered_with_in_the_bucket_is_refused_on_resume(
    tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest
) -> None:
    name = bucket_name(request)
    bucket = s3.bucket(name)
    server = s3_server(tmp_path, s3, name, part_size_mib=5)
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        server.execute(kernel_id, STATE_24_MIB)
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        owner = reply.body["owner"]
        committed = current(bucket, owner, kernel_id)
        key = f"{owner}/{kernel_id}/{committed}/data.bin"
        data = bytearray(bucket.get(key) or b"")
        data[len(data) // 2] ^= 0xFF  # one byte in the middle of the array, same size
        bucket.put(key, bytes(data))
        server.wake_to_a_refused_restore(kernel_id)
        report = json.loads((tmp_path / "scratch" / owner / kernel_id / REPORT).read_text())
        assert "does not match the manifest's digest" in (report["refused"] or ""), report
        assert report["restored"] == [], report
    finally:
        server.shutdown_all_kernels()
        server.stop()
