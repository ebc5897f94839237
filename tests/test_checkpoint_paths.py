"""Owner folders are their kernels' to write: the server follows no link there, and reads nothing large.

A kernel (or a kernel pod, in its owner's ``subPath``) can make a relative symlink in its own
folder that still resolves under the checkpoint root: ``alice/ka -> ../bob/kb``. With the real
``CheckpointStore``: such a link never makes the server return, verify, quarantine, prune, push
or delete another owner's checkpoint (each check compares the victim's files byte for byte). Files
the server reads there have a size cap, and a FIFO does not block it. The warm-pod client has
deadlines and size caps, against real local sockets that stall, trickle or send too much.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.writer import write_checkpoint
from kernelmgr.checkpoint_store import RESTORE_REPORT_CAP, CheckpointStore
from kernelmgr.kube.warm_client import WarmPodClient, WarmPodError
from tests.test_kube_warm_pod_protocol import OWNER, SECRET, LocalWarmPod

pytestmark = [pytest.mark.pure, pytest.mark.timeout(120)]

VICTIM, VICTIM_KERNEL = "bob", "kb"


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry under ``directory`` (links as their target, files as their bytes)."""
    found: dict[str, bytes | str] = {}
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(parent) / name
            relative = str(path.relative_to(directory))
            if path.is_symlink():
                found[relative] = f"-> {os.readlink(path)}"
            elif path.is_file():
                found[relative] = path.read_bytes()
            else:
                found[relative] = "dir"
    return found


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "root", SECRET)


def victim(store: CheckpointStore) -> tuple[Path, str, dict[str, bytes | str]]:
    """Bob's committed, authentic checkpoint and restore report; (folder, checkpoint id, snapshot)."""
    folder = store.root / VICTIM / VICTIM_KERNEL
    manifest = write_checkpoint(
        folder, {"work": list(range(100))}, key=store.key_for(VICTIM), owner=VICTIM, kernel_id=VICTIM_KERNEL
    )
    (folder / "restore-report.json").write_text(json.dumps({"checkpoint": manifest.checkpoint_id, "bob": 1}))
    return folder, manifest.checkpoint_id, snapshot(folder)


def test_a_kernel_folder_that_links_into_another_owners_is_refused_everywhere(store: CheckpointStore) -> None:
    folder, checkpoint_id, before = victim(store)
    (store.root / OWNER).mkdir()
    (store.root / OWNER / "ka").symlink_to(f"../{VICTIM}/{VICTIM_KERNEL}")  # resolves under the root

    report = store.restore_report(OWNER, "ka")
    assert report is not None and "bob" not in report and "symlink" in report["error"], report
    with pytest.raises(CheckpointRefused, match="symlink"):
        store.latest(OWNER, "ka")
    summary = store.read_summary(OWNER, "ka")
    assert summary is not None and "symlink" in summary["refused"] and summary["quarantined"] is None
    assert store.summary(OWNER, "ka") is None
    assert not store.has_checkpoint(OWNER, "ka")
    assert store.restore_progress(OWNER, "ka", 0) is None
    with pytest.raises(ValueError, match="symlink"):
        store.kernel_dir(OWNER, "ka")  # never handed to a kernel either
    with pytest.raises(CheckpointRefused, match="symlink"), store.verified_files(OWNER, "ka", checkpoint_id):
        pass
    store.prune(OWNER, "ka")
    store.remove(OWNER, "ka")  # the kernel is gone: its link goes, what it points at stays

    assert not os.path.lexists(store.root / OWNER / "ka")
    assert snapshot(folder) == before
    bobs = store.latest(VICTIM, VICTIM_KERNEL)
    assert bobs is not None and bobs.checkpoint_id == checkpoint_id


def test_links_inside_a_kernel_folder_reach_nothing_and_a_fifo_blocks_nothing(store: CheckpointStore) -> None:
    folder, checkpoint_id, before = victim(store)
    own = store.root / OWNER / "ka"
    own.mkdir(parents=True)
    up = f"../../{VICTIM}/{VICTIM_KERNEL}"
    (own / "current").symlink_to(f"{up}/current")
    (own / "restore-report.json").symlink_to(f"{up}/restore-report.json")
    os.mkfifo(own / "restore-progress.json")  # a plain read would wait for a writer for ever

    with pytest.raises(CheckpointRefused, match="symlink"):
        store.latest(OWNER, "ka")
    assert "symlink" in (store.restore_report(OWNER, "ka") or {}).get("error", "")
    assert store.restore_progress(OWNER, "ka", 0) is None

    # ``current`` a plain file now, naming bob's checkpoint, which is a link here; ``quarantine`` a
    # link into bob's folder (where a refused checkpoint would be moved) and a stale-looking link.
    (own / "current").unlink()
    (own / "current").write_text(checkpoint_id + "\n")
    (own / checkpoint_id).symlink_to(f"{up}/{checkpoint_id}")
    (own / "quarantine").symlink_to(up)
    (own / "ckpt-20200101T000000000000-deadbeef").symlink_to(f"{up}/{checkpoint_id}")

    with pytest.raises(CheckpointRefused) as refused:
        store.latest(OWNER, "ka")
    assert "symlink" in refused.value.reason and refused.value.quarantined is None
    with pytest.raises(CheckpointRefused, match="symlink"), store.verified_files(OWNER, "ka", checkpoint_id):
        pass
    store.prune(OWNER, "ka")  # removes the stale-looking link itself, nothing it points at
    assert not os.path.lexists(own / "ckpt-20200101T000000000000-deadbeef")
    store.remove(OWNER, "ka")
    assert not os.path.lexists(own)

    assert snapshot(folder) == before
    assert store.latest(VICTIM, VICTIM_KERNEL) is not None


def test_an_oversized_restore_report_or_current_is_refused_without_being_read(store: CheckpointStore) -> None:
    own = store.root / OWNER / "ka"
    own.mkdir(parents=True)
    with open(own / "restore-report.json", "wb") as handle:
        handle.truncate(300 * 1024 * 1024)  # sparse: costs no disk, and would cost 300 MiB to read
    report = store.restore_report(OWNER, "ka")
    assert report is not None and f"more than the {RESTORE_REPORT_CAP}" in report["error"], report
    with open(own / "current", "wb") as handle:
        handle.truncate(1 << 30)
    with pytest.raises(CheckpointRefused, match="more than the 256"):
        store.latest(OWNER, "ka")


def test_a_checkpoint_is_verified_again_right_before_it_is_pushed_to_a_warm_pod(
    store: CheckpointStore, tmp_path: Path
) -> None:
    folder, bobs_id, before = victim(store)
    own = store.root / OWNER
    mine = write_checkpoint(own / "ka", {"x": 1}, key=store.key_for(OWNER), owner=OWNER, kernel_id="ka")
    (own / "kb").symlink_to(f"../{VICTIM}/{VICTIM_KERNEL}")
    pod = LocalWarmPod(tmp_path, "pod")
    try:
        with pytest.raises(WarmPodError, match="symlink"):
            pod.client.push_checkpoint("kb", store, OWNER, bobs_id)  # bob's, through alice's link
        data = own / "ka" / mine.checkpoint_id / "data.bin"
        data.unlink()
        data.symlink_to(folder / bobs_id / "data.bin")
        with pytest.raises(WarmPodError, match="symlink"):
            pod.client.push_checkpoint("ka", store, OWNER, mine.checkpoint_id)
        data.unlink()
        data.write_bytes(b"\0" * 10)  # changed since it was committed: the manifest no longer fits
        with pytest.raises(WarmPodError, match=r"data\.bin has 10 bytes"):
            pod.client.push_checkpoint("ka", store, OWNER, mine.checkpoint_id)
        assert snapshot(pod.checkpoints) == {}, "nothing reached the pod"
    finally:
        pod.stop()
    assert snapshot(folder) == before


# -- the warm-pod client's deadlines and caps, against real sockets ------------------------------


class FakePod:
    """A local TCP server whose every connection gets ``serve(connection)`` in a thread."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.serve = serve
        self.sent = 0
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _address = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(connection,), daemon=True).start()

    def _one(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.recv(65536)  # the request
                self.serve(connection)
            except OSError:
                pass  # the client hung up: what the tests want
            finally:
                self.closed.set()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def fake_pods() -> Iterator[list[FakePod]]:
    made: list[FakePod] = []
    yield made
    for pod in made:
        pod.close()


def test_a_pod_that_stalls_or_trickles_fails_the_request_within_its_deadline(
    fake_pods: list[FakePod],
) -> None:
    never = threading.Event()
    stalls = FakePod(lambda connection: never.wait(60))  # accepts, reads, never answers

    def trickle(connection: socket.socket) -> None:
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        )
        while True:  # one byte at a time, each well within the socket timeout
            connection.sendall(b" ")
            time.sleep(0.05)

    trickles = FakePod(trickle)
    fake_pods += [stalls, trickles]
    for pod in (stalls, trickles):
        client = WarmPodClient("127.0.0.1", pod.port, "token", timeout=1.0)
        started = time.monotonic()
        with pytest.raises(WarmPodError):
            client.status()
        # The deadline is 1 s; the bound leaves room for a loaded machine, and is far below what a
        # trickle of 100,000 bytes at 20 a second would take (today's client waited it out).
        assert time.monotonic() - started < 15


def test_a_pod_that_sends_too_much_is_refused_without_reading_it(fake_pods: list[FakePod]) -> None:
    size = 200 * 1024 * 1024

    def flood(connection: socket.socket) -> None:
        connection.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode())
        chunk = b"\0" * (1 << 20)
        for _ in range(size // len(chunk)):
            connection.sendall(chunk)
            pod.sent += len(chunk)

    pod = FakePod(flood)
    fake_pods.append(pod)
    client = WarmPodClient("127.0.0.1", pod.port, "token", timeout=5.0)
    with pytest.raises(WarmPodError, match="more than"):
        client.status()
    with pytest.raises(WarmPodError, match="more than"):
        client.pull_checkpoint("k1", CheckpointStore(Path("/nonexistent"), SECRET), OWNER)  # 'current'
    assert pod.closed.wait(30)
    assert pod.sent < size // 2, "the client hung up instead of reading it all"
