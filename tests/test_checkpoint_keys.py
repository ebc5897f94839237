"""Checkpoint keys reach a kernel only as a private, consumed file; a resume restores only the
checkpoint the server verified.

Unit tests for :mod:`kernelmgr.checkpoint.keys` and the reader's expected-checkpoint check,
then a real server: what a cell can find, and an older checkpoint put back in place.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelmgr.checkpoint import integrity
from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.keys import (
    ENV_KEY_FILE,
    KEY_BYTES,
    KeyFileError,
    decode_key,
    encode_key,
    key_file_path,
    owner_key,
    private_key_dir,
    read_key_file,
    remove_key_file,
    write_key_file,
)
from kernelmgr.checkpoint.layout import publish_current, read_current
from kernelmgr.checkpoint.reader import restore_checkpoint
from kernelmgr.checkpoint.writer import write_checkpoint
from kernelmgr.config import ElasticKernels
from kernelmgr.core.kernels import LaunchPlan, ManagedKernel
from kernelmgr.provisioners.local import agent_environment
from tests.conftest import INVENTORY, PROFILES
from tests.conftest import elastic_config as config
from tests.support.server import RunningServer, start_server, wait_for

pytestmark = pytest.mark.pure

SECRET = b"s" * 32
OWNER = "alice"
KERNEL = "0a1b2c3d-0000-4000-8000-00000000beef"
KEY = owner_key(SECRET, OWNER)


# -- the key module ----------------------------------------------------------------------------


def test_owner_keys_are_per_owner_and_per_secret() -> None:
    assert len(KEY) == KEY_BYTES
    assert owner_key(SECRET, "bob") != KEY and owner_key(b"t" * 32, OWNER) != KEY
    assert integrity.owner_key is owner_key  # one derivation, whoever imports it
    with pytest.raises(ValueError):
        owner_key(SECRET, "")


def test_encode_and_decode() -> None:
    assert decode_key(encode_key(KEY), "x") == KEY
    assert encode_key(KEY) == KEY.hex().encode() + b"\n"
    for bad in (b"zz", b"\xff\xfe", b"00" * 16, b""):
        with pytest.raises(KeyFileError, match="the source"):
            decode_key(bad, "the source")
    with pytest.raises(ValueError):
        encode_key(b"short")


def test_write_key_file_is_0600_whatever_the_umask_and_replaces_the_previous(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    old_umask = os.umask(0)
    try:
        write_key_file(path, KEY)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == encode_key(KEY)
    other = owner_key(SECRET, "bob")
    write_key_file(path, other)  # a restart or resume writes it again
    assert read_key_file(path, consume=False) == other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.key"]  # no temporary file left


def test_write_key_file_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    path = tmp_path / "k.key"
    path.symlink_to(victim)
    write_key_file(path, KEY)
    assert victim.read_text() == "untouched"
    assert not path.is_symlink() and read_key_file(path) == KEY


def test_read_key_file_consumes_it(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "k.key", KEY)
    assert read_key_file(path) == KEY
    assert not path.exists()
    with pytest.raises(KeyFileError, match="does not exist"):
        read_key_file(path)
    remove_key_file(path)  # already gone: fine


def test_read_key_file_refuses_what_others_could_have_read_or_planted(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "k.key", KEY)
    path.chmod(0o640)
    with pytest.raises(KeyFileError, match="mode 640"):
        read_key_file(path)
    assert path.exists()  # refused, not consumed
    path.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(KeyFileError, match="symlink"):
        read_key_file(link)
    directory = tmp_path / "dir.key"
    directory.mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(directory)


def test_a_read_only_mount_is_read_without_consuming_it(tmp_path: Path) -> None:
    """The Kubernetes shape: a Secret volume file (a symlink into ``..data``, group-readable)."""
    data = tmp_path / "..data"
    data.mkdir()
    target = write_key_file(data / "key", KEY)
    target.chmod(0o440)
    mounted = tmp_path / "key"
    mounted.symlink_to(target)
    assert read_key_file(mounted, consume=False) == KEY
    assert mounted.exists()
    target.chmod(0o444)
    with pytest.raises(KeyFileError, match="others could have read"):
        read_key_file(mounted, consume=False)


def test_private_key_dir(tmp_path: Path) -> None:
    directory = private_key_dir(tmp_path / "runtime")
    assert directory.is_dir() and stat.S_IMODE(directory.stat().st_mode) == 0o700
    directory.chmod(0o755)
    assert stat.S_IMODE(private_key_dir(tmp_path / "runtime").stat().st_mode) == 0o700
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "elastic-keys").write_text("")
    with pytest.raises(KeyFileError, match="not a directory"):
        private_key_dir(blocked)
    assert key_file_path(directory, KERNEL) == directory / f"kernel-{KERNEL}.key"
    for bad in ("", "../x", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            key_file_path(directory, bad)


def test_the_provisioner_writes_only_the_owners_key_to_a_private_file(tmp_path: Path) -> None:
    settings = ElasticKernels(
        profiles=PROFILES,
        gpu_inventory=INVENTORY,
        checkpoint_root=str(tmp_path / "checkpoints"),
        checkpoint_secret_file=str(tmp_path / "secret" / "checkpoint-secret"),
    )
    runtime = settings.build()
    record = ManagedKernel(kernel_id=KERNEL, kernelspec="python3-gpu-small", profile="small", owner=OWNER)
    plan = LaunchPlan(restore=True, checkpoint="ckpt-20240101T000000000000-00000000")
    key_file = key_file_path(private_key_dir(tmp_path / "runtime"), KERNEL)
    env = agent_environment(runtime, record, plan, key_file)
    assert env[ENV_KEY_FILE] == str(key_file)
    assert env["ELASTIC_RESTORE"] == "1" and env["ELASTIC_RESTORE_CHECKPOINT"] == plan.checkpoint
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    secret = (tmp_path / "secret" / "checkpoint-secret").read_bytes()
    assert read_key_file(key_file) == owner_key(secret, OWNER)
    everything = json.dumps(env)
    assert owner_key(secret, OWNER).hex() not in everything and secret.hex() not in everything
    assert "ELASTIC_CHECKPOINT_KEY" not in env


# -- the checkpoint the server verified is the one restored -------------------------------------


def _save(kernel_dir: Path, namespace: dict[str, object]) -> str:
    manifest = write_checkpoint(kernel_dir, namespace, key=KEY, owner=OWNER, kernel_id=KERNEL, prune=False)
    return manifest.checkpoint_id


def test_an_older_checkpoint_put_back_is_not_restored_in_place_of_the_expected(tmp_path: Path) -> None:
    """The restore reads the checkpoint the server recorded by its id: ``current`` pointing at an
    older one (put back, or a shared file system's stale view) changes nothing."""
    kernel_dir = tmp_path / OWNER / KERNEL
    old = _save(kernel_dir, {"x": 1})
    new = _save(kernel_dir, {"x": 2})
    assert read_current(kernel_dir) == new
    publish_current(kernel_dir, old)  # put back: authentic, this owner's, this kernel's, but old

    namespace: dict[str, object] = {}
    report = restore_checkpoint(
        kernel_dir, namespace, key=KEY, owner=OWNER, kernel_id=KERNEL, expected_checkpoint=new
    )
    assert report is not None and report["checkpoint"] == new and namespace == {"x": 2}
    assert (kernel_dir / old).is_dir()  # nothing moved


def test_an_older_checkpoint_renamed_as_the_expected_one_is_refused_and_kept(tmp_path: Path) -> None:
    kernel_dir = tmp_path / OWNER / KERNEL
    old = _save(kernel_dir, {"x": 1})
    new = _save(kernel_dir, {"x": 2})
    shutil.rmtree(kernel_dir / new)
    (kernel_dir / old).rename(kernel_dir / new)

    namespace: dict[str, object] = {}
    with pytest.raises(CheckpointRefused) as refused:
        restore_checkpoint(
            kernel_dir, namespace, key=KEY, owner=OWNER, kernel_id=KERNEL, expected_checkpoint=new
        )
    assert namespace == {}
    assert f"names checkpoint {old!r}, not {new!r}" in refused.value.reason
    assert refused.value.quarantined is not None and (refused.value.quarantined / "data.bin").exists()


def test_the_expected_checkpoint_is_restored(tmp_path: Path) -> None:
    kernel_dir = tmp_path / OWNER / KERNEL
    current = _save(kernel_dir, {"x": 2})
    namespace: dict[str, object] = {}
    report = restore_checkpoint(
        kernel_dir, namespace, key=KEY, owner=OWNER, kernel_id=KERNEL, expected_checkpoint=current
    )
    assert report is not None and report["checkpoint"] == current and namespace == {"x": 2}


def test_an_expected_checkpoint_with_nothing_committed_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointRefused, match=r"no committed checkpoint.*server expected ckpt-1"):
        restore_checkpoint(tmp_path, {}, key=KEY, owner=OWNER, kernel_id=KERNEL, expected_checkpoint="ckpt-1")


# -- a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("keys")
    running = start_server(home, config(home / "checkpoints"))
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def no_kernels_left(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").shutdown_all_kernels()


#: Run in a kernel: everything a cell could look at without digging through memory.
LOOK_FOR_KEYS = """
import json, os
_found = {
    "names": sorted(n for n in os.environ if "ELASTIC" in n),
    "environ": dict(os.environ),
    "proc_environ": open("/proc/self/environ", "rb").read().decode("latin-1"),
    "pid": os.getpid(),
}
print(json.dumps(_found))
del _found
"""


def server_secret(server: RunningServer) -> bytes:
    """The server's checkpoint secret, at its default place (the server's data dir, not the volume)."""
    return (server.home / "data" / "elastic-secret" / "checkpoint-secret").read_bytes()


def owner_key_of(server: RunningServer) -> bytes:
    secret = server_secret(server)
    owner = server.get("/api/elastic/kernels")[0]["owner"]
    return owner_key(secret, owner)


def key_files(server: RunningServer) -> list[Path]:
    directory = server.home / "runtime" / "elastic-keys"
    return sorted(directory.iterdir()) if directory.exists() else []


def assert_no_key_in_reach(server: RunningServer, kernel_id: str, key: bytes) -> None:
    found = json.loads(server.execute(kernel_id, LOOK_FOR_KEYS, timeout=120).strip().splitlines()[-1])
    assert "ELASTIC_CHECKPOINT_KEY" not in found["environ"]
    assert ENV_KEY_FILE not in found["environ"], found["names"]
    for text in (json.dumps(found["environ"]), found["proc_environ"]):
        assert key.hex() not in text and key.hex().upper() not in text
        secret = server_secret(server)
        assert secret.hex() not in text
    # The file the key came in is gone (it was named in the process's initial environment).
    handed = [
        part.split("=", 1)[1] for part in found["proc_environ"].split("\0") if part.startswith(ENV_KEY_FILE)
    ]
    assert len(handed) == 1 and not Path(handed[0]).exists()
    assert key_files(server) == []


def test_a_cell_finds_no_key_in_the_environment_nor_on_disk(server: RunningServer) -> None:
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, "x = 41")
    key = owner_key_of(server)
    assert_no_key_in_reach(server, kernel_id, key)

    # A resume hands the key over again, the same way: gone once the agent has it.
    assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
    assert server.execute(kernel_id, "print(x + 1)", timeout=120).strip().endswith("42")
    assert_no_key_in_reach(server, kernel_id, key)

    # And the kernel still signs its checkpoints with it.
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply
    server.shutdown_kernel(kernel_id)
    assert key_files(server) == []


def put_back(kernel_dir: Path, saved: Path) -> None:
    """What an attacker (or a careless restore from backup) does: an older checkpoint as ``current``."""
    shutil.copytree(saved, kernel_dir / saved.name)
    publish_current(kernel_dir, saved.name)


def test_an_older_checkpoint_put_back_in_place_is_not_restored_on_resume(
    server: RunningServer, tmp_path: Path
) -> None:
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, "balance = 100")
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply
    owner = reply.body["owner"]
    kernel_dir = server.home / "checkpoints" / owner / kernel_id
    old_id = read_current(kernel_dir)
    assert old_id is not None
    saved = tmp_path / old_id
    shutil.copytree(kernel_dir / old_id, saved)

    assert server.execute(kernel_id, "balance = 0; print(balance)", timeout=120).strip().endswith("0")
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply
    new_id = reply.body["checkpoint"]["id"]
    assert new_id != old_id
    wait_for(lambda: not (kernel_dir / old_id).exists(), what="the superseded checkpoint to be pruned")
    put_back(kernel_dir, saved)

    with server.channel(kernel_id, timeout=120) as chan:
        result = chan.execute("print(balance)", timeout=120)
    assert result.stdout.strip() == "0", "not the checkpoint the server recorded"
    report = json.loads((kernel_dir / "restore-report.json").read_text())
    assert report["refused"] is None and report["checkpoint"] == new_id
    assert (kernel_dir / new_id / "data.bin").exists()  # nothing deleted


def test_an_older_checkpoint_put_back_while_the_server_was_down_is_not_restored(tmp_path: Path) -> None:
    first = start_server(tmp_path, config(tmp_path / "checkpoints"))
    try:
        kernel_id = first.start_kernel("python3-gpu-small")
        first.execute(kernel_id, "balance = 100")
        reply = first.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        kernel_dir = tmp_path / "checkpoints" / reply.body["owner"] / kernel_id
        old_id = reply.body["checkpoint"]["id"]
        saved = tmp_path / "saved" / old_id
        shutil.copytree(kernel_dir / old_id, saved)
        first.execute(kernel_id, "balance = 0", timeout=120)
        reply = first.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply
        new_id = reply.body["checkpoint"]["id"]
        wait_for(lambda: not (kernel_dir / old_id).exists(), what="the superseded checkpoint to be pruned")
    finally:
        first.stop()
    put_back(kernel_dir, saved)
    second = start_server(tmp_path, config(tmp_path / "checkpoints"))
    try:
        assert second.execute(kernel_id, "print(balance)", timeout=120).strip() == "0"
        report = json.loads((kernel_dir / "restore-report.json").read_text())
        assert report["refused"] is None and report["checkpoint"] == new_id
    finally:
        second.stop()
