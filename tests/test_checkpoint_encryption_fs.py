"""Encryption at rest on the file-system store (issue 31): checkpoints on the shared volume are
ciphertext, each kernel's under its own key derived from its owner's envelope key, wrapped by a
master key the server holds off the volume; a rotation re-wraps the owners' keys only."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.reader import restore_checkpoint
from kernelmgr.checkpoint.writer import write_checkpoint
from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.cli import main as cli_main
from kernelmgr.objectstore.envelope import OWNER_KEYS_DIR, fingerprint, read_master_key
from tests.conftest import INVENTORY, PROFILES
from tests.support.server import RunningServer, start_server

SECRET = b"s" * 32
MARKER = b"PLAINTEXT-MARKER-"
SETTING = "ElasticKernels.checkpoint_encryption_key_files"


def master_key_file(path: Path) -> str:
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


def store(root: Path, *files: str) -> CheckpointStore:
    return CheckpointStore(root, SECRET, master_keys=[read_master_key(f) for f in files])


def every_byte(root: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in root.rglob("*") if path.is_file()}


def namespace() -> dict[str, Any]:
    return {
        "secret_words": MARKER * 4096,  # in the pickle stream
        "big": np.frombuffer(MARKER * 65536, dtype=np.uint8).copy(),  # out of band, 1 MiB
    }


def write(root: Path, checkpoints: CheckpointStore, owner: str, kernel_id: str) -> str:
    manifest = write_checkpoint(
        checkpoints.kernel_dir(owner, kernel_id),
        namespace(),
        key=checkpoints.key_for(owner),
        owner=owner,
        kernel_id=kernel_id,
        data_key=checkpoints.data_key_for(owner, kernel_id),
    )
    return manifest.checkpoint_id


def restore(
    checkpoints: CheckpointStore, owner: str, kernel_id: str, data_key: bytes | None
) -> dict[str, Any]:
    ns: dict[str, Any] = {}
    report = restore_checkpoint(
        checkpoints.kernel_dir(owner, kernel_id),
        ns,
        key=checkpoints.key_for(owner),
        owner=owner,
        kernel_id=kernel_id,
        map_buffers=True,  # an encrypted file is never mapped: read and decrypted instead
        data_key=data_key,
    )
    assert report is not None and not report["not_restored"], report
    return ns


@pytest.mark.pure
def test_checkpoints_on_disk_are_ciphertext_and_only_their_kernel_key_reads_them(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    checkpoints = store(root, master_key_file(tmp_path / "master"))
    committed = write(root, checkpoints, "ann", "k1")
    folder = root / "ann" / "k1" / committed
    assert sorted(p.name for p in folder.iterdir()) == ["data.bin.aes", "manifest.json.aes"]
    for path, body in every_byte(root).items():
        assert MARKER not in body and b"secret_words" not in body, path
    master = (tmp_path / "master").read_text().encode()
    assert all(
        master not in body and bytes.fromhex(master.decode()) not in body
        for body in every_byte(root).values()
    )

    # The server reads the manifest (it holds the keys); the kernel's key restores.
    latest = checkpoints.latest("ann", "k1")
    assert latest is not None and latest.checkpoint_id == committed
    ns = restore(checkpoints, "ann", "k1", checkpoints.data_key_for("ann", "k1"))
    assert ns["secret_words"] == MARKER * 4096
    assert bytes(ns["big"]) == MARKER * 65536

    # Another owner's key (same kernel id), another kernel's key of the same owner, no key: refused.
    for other in (checkpoints.data_key_for("bob", "k1"), checkpoints.data_key_for("ann", "k2")):
        assert other != checkpoints.data_key_for("ann", "k1")
        with pytest.raises(CheckpointRefused):
            restore(checkpoints, "ann", "k1", other)
    committed = write(root, checkpoints, "ann", "k1")  # the refusals quarantined the first one
    with pytest.raises(CheckpointRefused, match="encrypted at rest"):
        restore(checkpoints, "ann", "k1", None)
    plain = CheckpointStore(root, SECRET)  # a server without the master key
    with pytest.raises(CheckpointRefused, match="checkpoint_encryption_key_files"):
        plain.latest("ann", "k1")
    assert (root / "ann" / "k1" / committed).exists()  # refused for want of a key, not quarantined


@pytest.mark.pure
def test_a_checkpoint_written_before_encryption_stays_readable(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    committed = write(root, CheckpointStore(root, SECRET), "ann", "k1")
    assert (root / "ann" / "k1" / committed / "data.bin").exists()
    checkpoints = store(root, master_key_file(tmp_path / "master"))
    latest = checkpoints.latest("ann", "k1")
    assert latest is not None and latest.checkpoint_id == committed
    assert restore(checkpoints, "ann", "k1", checkpoints.data_key_for("ann", "k1"))["secret_words"]


@pytest.mark.pure
def test_rotate_keys_rewraps_the_owner_keys_and_rewrites_no_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "checkpoints"
    old, new = master_key_file(tmp_path / "old"), master_key_file(tmp_path / "new")
    first = store(root, old)
    committed = {owner: write(root, first, owner, "k") for owner in ("ann", "bob")}
    records = root / OWNER_KEYS_DIR

    def wrapped_by(owner: str) -> str:
        return str(json.loads((records / owner).read_bytes())["master"])

    def data_digests() -> dict[Path, str]:
        return {
            path: hashlib.sha256(body).hexdigest()
            for path, body in every_byte(root).items()
            if OWNER_KEYS_DIR not in path.parts
        }

    before = data_digests()
    assert {wrapped_by("ann"), wrapped_by("bob")} == {fingerprint(read_master_key(old))}
    args = ["rotate-keys", "--checkpoint-root", str(root), "--new-key", new]
    assert cli_main([*args, "--old-key", old]) == 0
    assert "re-wrapped 2 owner key(s)" in capsys.readouterr().out
    assert {wrapped_by("ann"), wrapped_by("bob")} == {fingerprint(read_master_key(new))}
    assert data_digests() == before  # no checkpoint rewritten
    assert cli_main([*args, "--old-key", old]) == 0  # again: nothing left to do
    assert "re-wrapped 0 owner key(s)" in capsys.readouterr().out

    rotated = store(root, new)  # the old key is gone
    for owner in ("ann", "bob"):
        latest = rotated.latest(owner, "k")
        assert latest is not None and latest.checkpoint_id == committed[owner]
        assert restore(rotated, owner, "k", rotated.data_key_for(owner, "k"))["secret_words"] == MARKER * 4096
    with pytest.raises(CheckpointRefused, match=SETTING):
        store(root, old).latest("ann", "k")  # a server still on the old key: a clear refusal
    # A rotation without the key the owners' keys are wrapped by: one line, exit 1.
    assert cli_main(["rotate-keys", "--checkpoint-root", str(root), "--new-key", old]) == 1
    assert "is not among --old-key" in capsys.readouterr().err


# -- through a real server with local kernels -----------------------------------------------------


def fs_server(home: Path, root: Path, key_files: list[str]) -> RunningServer:
    config: dict[str, Any] = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "checkpoint_root": str(root),
            "checkpoint_encryption_key_files": key_files,
        }
    }
    return start_server(home, config)


@pytest.mark.server
def test_hibernate_and_resume_through_encrypted_checkpoints_and_a_rotation(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    old, new = master_key_file(tmp_path / "old"), master_key_file(tmp_path / "new")
    server = fs_server(tmp_path / "home", root, [old])
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        server.execute(kernel_id, "secret_words = b'PLAINTEXT-MARKER-' * 4096\ncount = 0")
        for cycle in range(1, 4):
            server.execute(kernel_id, "count += 1")
            if cycle == 3:  # rotate between two runs of the server; the new one has the new key only
                server.stop()  # hibernate_on_shutdown
                args = ["rotate-keys", "--checkpoint-root", str(root), "--new-key", new, "--old-key", old]
                assert cli_main(args) == 0
                server = fs_server(tmp_path / "home", root, [new])
            else:
                reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
                assert reply.status == 200, reply
            model = server.get(f"/api/elastic/kernels/{kernel_id}")
            assert model["state"] == "hibernated", model
            owner = model["owner"]
            folder = root / owner / kernel_id / model["checkpoint"]["id"]
            assert sorted(p.name for p in folder.iterdir()) == ["data.bin.aes", "manifest.json.aes"]
            for path, body in every_byte(root).items():
                assert MARKER not in body, path
            out = server.execute(kernel_id, "print(secret_words[:17], len(secret_words), count)", timeout=120)
            assert out.strip() == f"b'PLAINTEXT-MARKER-' 69632 {cycle}"
    finally:
        server.shutdown_all_kernels()
        server.stop()


@pytest.mark.server
@pytest.mark.parametrize("where", ["missing", "on the data volume"])
def test_a_missing_or_misplaced_master_key_stops_the_start_with_one_line(tmp_path: Path, where: str) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    path = str(tmp_path / "absent") if where == "missing" else master_key_file(root / "master")
    with pytest.raises(RuntimeError, match=r"server exited with 2") as failed:
        fs_server(tmp_path / "home", root, [path])
    lines = [line for line in str(failed.value).splitlines() if SETTING in line]
    assert lines, str(failed.value)
    assert ("does not exist" if where == "missing" else "off the data volume") in lines[0]


@pytest.mark.pure
def test_the_key_file_carries_the_kernel_key_on_a_second_line(tmp_path: Path) -> None:
    from kernelmgr.checkpoint.keys import KeyFileError, decode_keys, read_keys, write_key_file
    from kernelmgr.kube.manifests import KEY_FILE, make_kernel_secret

    signing, sealing = os.urandom(32), os.urandom(32)
    path = write_key_file(tmp_path / "k.key", signing, data_key=sealing)
    assert read_keys(path) == (signing, sealing) and not path.exists()  # consumed
    assert read_keys(write_key_file(tmp_path / "k.key", signing)) == (signing, None)
    secret = make_kernel_secret(
        name="p", kernel_id="k", owner="ann", connection_info={}, checkpoint_key=signing, data_key=sealing
    )
    assert decode_keys(secret["stringData"][KEY_FILE].encode(), "the Secret") == (signing, sealing)
    with pytest.raises(KeyFileError, match="holds 3 keys"):
        decode_keys(((signing.hex() + "\n") * 3).encode(), "three")
