"""A server that is not root, and kernels running as two users' own uids, on one checkpoint root.

Every step runs as its own OS identity, as in a cluster: the server (uid 5701, group 5700) makes the
owner folders (``give_owner_folder``, what the Kubernetes provisioner calls), each kernel (alice 5711,
bob 5721) writes and restores its checkpoints with the real writer and reader, and the server then
reads, verifies, prunes and removes them through its group. Neither kernel can list, read or write
the other's. Processes are started with ``subprocess``'s ``user``/``group`` (the test runs as root).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.hub import make_enterable

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[1]
SERVER = (5701, 5700)
IDS = {"alice": (5711, 5712), "bob": (5721, 5722)}
KERNELS = {"alice": "k-alice", "bob": "k-bob"}

SERVER_PREPARES = """
import json, os, sys
from pathlib import Path
from kernelmgr.checkpoint.sharing import give_owner_folder
root = Path(sys.argv[1])
for owner, (uid, gid) in json.loads(sys.argv[2]).items():
    folder = root / owner
    folder.mkdir(mode=0o700, exist_ok=True)
    give_owner_folder(folder, uid, gid)
"""

KERNEL_WRITES = """
import json, os, sys
from pathlib import Path
from kernelmgr.checkpoint.reader import restore_checkpoint
from kernelmgr.checkpoint.writer import write_checkpoint
root, owner, kernel_id, key, other, other_kernel = sys.argv[1:7]
key = bytes.fromhex(key)
folder = root + "/" + owner + "/" + kernel_id
first = write_checkpoint(folder, {"x": 41}, key=key, owner=owner, kernel_id=kernel_id, prune=False)
state = {"x": 42, "who": owner}
second = write_checkpoint(folder, state, key=key, owner=owner, kernel_id=kernel_id, prune=False)
namespace = {}
restore_checkpoint(folder, namespace, key=key, owner=owner, kernel_id=kernel_id)
info = os.stat(folder)
print(json.dumps({
    "first": first.checkpoint_id, "second": second.checkpoint_id,
    "restored": {"x": namespace["x"], "who": namespace["who"]},
    "folder": [info.st_uid, info.st_gid, info.st_mode & 0o7777],
}))
"""

KERNEL_PROBES = """
import json, os, sys
root, other, other_kernel = sys.argv[1:4]
theirs = root + "/" + other + "/" + other_kernel
attempts = {
    "list their owner folder": lambda: os.listdir(root + "/" + other),
    "list their kernel folder": lambda: os.listdir(theirs),
    "read their current": lambda: open(theirs + "/current").read(),
    "write into their kernel folder": lambda: open(theirs + "/planted", "w").close(),
    "remove their kernel folder": lambda: os.rename(theirs, root + "/" + other + "/gone"),
}
allowed = []
for what, attempt in attempts.items():
    try:
        attempt()
    except PermissionError:
        continue
    allowed.append(what)
print(json.dumps(allowed))
"""

SERVER_READS = """
import json, os, sys
from pathlib import Path
from kernelmgr.checkpoint_store import CheckpointStore
root, secret, kernels = sys.argv[1], bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3])
store = CheckpointStore(root, secret)
found = {}
for owner, kernel_id in kernels.items():
    manifest = store.latest(owner, kernel_id)
    store.prune(owner, kernel_id)
    left = sorted(n for n in os.listdir(Path(root) / owner / kernel_id) if not n.startswith(("current", ".")))
    found[owner] = {"latest": manifest.checkpoint_id, "after_prune": left}
store.remove("bob", kernels["bob"])
found["bob_removed"] = not (Path(root) / "bob" / kernels["bob"]).exists()
print(json.dumps(found))
"""


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("runs processes as other uids (setuid): run the tests as root, as CI does")


def run_as(ids: tuple[int, int], code: str, *args: str) -> Any:
    """``code`` run by this interpreter as ``ids`` (uid, gid, no other groups, umask 022); its JSON."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "HOME": "/tmp"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        user=ids[0],
        group=ids[1],
        extra_groups=[],
        umask=0o022,
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"as uid {ids[0]}: {done.stderr[-3000:]}"
    return json.loads(done.stdout) if done.stdout.strip() else None


@pytest.fixture
def root() -> Iterator[Path]:
    require_root()
    for tool in (Path(sys.executable).parent, Path(sys.executable).resolve().parent, REPO):
        make_enterable(tool)
    made = Path(tempfile.mkdtemp(prefix="ekt-shared-"))
    make_enterable(made)
    folder = made / "checkpoints"
    folder.mkdir(mode=0o711)
    os.chown(folder, *SERVER)
    try:
        yield folder
    finally:
        shutil.rmtree(made, ignore_errors=True)


def test_a_non_root_server_and_kernels_of_two_uids_each_keep_to_their_own_checkpoints(root: Path) -> None:
    from kernelmgr.checkpoint.keys import owner_key

    secret = secrets.token_bytes(32)
    run_as(SERVER, SERVER_PREPARES, str(root), json.dumps(IDS))
    for owner in IDS:
        info = (root / owner).stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (*SERVER, 0o3773)

    written = {}
    for owner, other in (("alice", "bob"), ("bob", "alice")):
        key = owner_key(secret, owner).hex()
        args = (str(root), owner, KERNELS[owner], key, other, KERNELS[other])
        written[owner] = run_as(IDS[owner], KERNEL_WRITES, *args)
        assert written[owner]["restored"] == {"x": 42, "who": owner}
        # The kernel's own folder, in the server's group, closed to every other uid.
        assert written[owner]["folder"] == [IDS[owner][0], SERVER[1], 0o2770]

    for owner, other in (("alice", "bob"), ("bob", "alice")):
        allowed = run_as(IDS[owner], KERNEL_PROBES, str(root), other, KERNELS[other])
        assert allowed == [], f"{owner}'s kernel could {allowed} in {other}'s checkpoints"

    found = run_as(SERVER, SERVER_READS, str(root), secret.hex(), json.dumps(KERNELS))
    for owner in IDS:
        assert found[owner]["latest"] == written[owner]["second"]  # read and verified by the server
        assert found[owner]["after_prune"] == [written[owner]["second"]]  # the first one pruned
    assert found["bob_removed"]


def test_a_user_ids_gid_that_is_the_servers_own_group_is_refused_at_start(root: Path) -> None:
    """The server shares the owner folders through its group: a kernel in that group could not keep
    its folders from the others in it."""
    check = (
        "import sys\n"
        "from kernelmgr.core.errors import ConfigError\n"
        "from kernelmgr.kube.settings import KubeSettings\n"
        "for gid in (5700, 5712):\n"
        "    try:\n"
        "        ids = {'alice': {'uid': 5711, 'gid': gid}}\n"
        "        KubeSettings(checkpoint_claim='ck', user_ids=ids).check_user_files()\n"
        "    except ConfigError as exc:\n"
        "        print(gid, exc.message)\n"
    )
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "HOME": "/tmp"}
    done = subprocess.run(
        [sys.executable, "-c", check], user=SERVER[0], group=SERVER[1], extra_groups=[], env=env, cwd="/",
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("5700 "), done.stdout
    assert "'alice' would run with gid 5700, the server's own group" in lines[0]
