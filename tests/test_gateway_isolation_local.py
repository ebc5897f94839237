"""A multi-user local gateway runs each user's kernels as that user's OS account.

A real JupyterHub runs the project's local example (tests/support/hub.py): alice and bob each
open a notebook at the shared gateway, and bob's cell tries, as an attacker would, everything
that worked when every kernel was a process of the gateway's own account: read alice's
connection file and run code in her kernel with jupyter_client, read the master checkpoint
secret, list or write alice's checkpoint folder (a forged checkpoint), read the gateway's
``/proc/<pid>/environ`` (its Hub token). Each is refused by the operating system now. alice's
kernel still hibernates and resumes with its variables.

Start-up: a multi-user gateway whose kernels would share its account refuses to start (exit 2,
one line) unless the admin says it is single-tenant; per-user kernels need a root gateway; a
checkpoint secret left on the checkpoint volume by an older version is moved off it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.config import ElasticKernels
from kernelmgr.core.errors import ConfigError
from kernelmgr.provisioners.accounts import AccountError, KernelAccounts, scrub_environment
from tests.conftest import elastic_config
from tests.support.hub import Hub, account_of, ensure_accounts, running_hub
from tests.test_gateway_jupyterhub import gateway, open_session, run, sized_spec

pytestmark = [pytest.mark.pure, pytest.mark.timeout(600)]

#: What a kernel tells about itself (the paths an attacker would go after).
WHO_AM_I = """
import json, os
from ipykernel import get_connection_file
print(json.dumps({
    "uid": os.getuid(),
    "gid": os.getgid(),
    "groups": os.getgroups(),
    "umask": os.umask(0o077),
    "connection_file": get_connection_file(),
    "checkpoint_dir": os.environ["ELASTIC_CHECKPOINT_DIR"],
    "server_pid": int(os.environ["ELASTIC_SERVER_PID"]),
    "tokens": sorted(k for k in os.environ if "TOKEN" in k),
}))
"""

#: bob's cell: every way into alice's kernel and state, each one's outcome.
ATTACK = """
import json, os, jupyter_client
target = json.loads({target!r})

def attempt(action):
    try:
        action()
    except PermissionError:
        return "denied"
    except FileNotFoundError:
        return "missing"
    except Exception as exc:
        return f"{{type(exc).__name__}}: {{exc}}"
    return "done"

def run_in_alices_kernel():
    client = jupyter_client.BlockingKernelClient(connection_file=target["connection_file"])
    client.load_connection_file()
    client.start_channels()
    try:
        client.execute("import os; os.getuid()", silent=True)
        client.get_shell_msg(timeout=30)
    finally:
        client.stop_channels()

def forge():
    with open(os.path.join(target["checkpoint_dir"], "current"), "w") as out:
        out.write("ckpt-20240101T000000000000-00000000\\n")

def plant_kernel_dir():
    os.mkdir(os.path.join(os.path.dirname(target["checkpoint_dir"]), "forged-kernel"))

print("RESULT", json.dumps({{
    "uid": os.getuid(),
    "connection_file": attempt(lambda: open(target["connection_file"]).read()),
    "kernel_client": attempt(run_in_alices_kernel),
    "runtime_dir": attempt(lambda: os.listdir(os.path.dirname(target["connection_file"]))),
    "secret": attempt(lambda: open(target["secret"], "rb").read()),
    "secret_dir": attempt(lambda: os.listdir(os.path.dirname(target["secret"]))),
    "old_secret": attempt(lambda: open(target["old_secret"], "rb").read()),
    "owner_dir": attempt(lambda: os.listdir(os.path.dirname(target["checkpoint_dir"]))),
    "checkpoint_dir": attempt(lambda: os.listdir(target["checkpoint_dir"])),
    "forge_current": attempt(forge),
    "plant_kernel_dir": attempt(plant_kernel_dir),
    "gateway_environ": attempt(lambda: open(f"/proc/{{target['server_pid']}}/environ", "rb").read()),
}}))
"""


def who_am_i(hub: Hub, user: str, token: str, kernel_id: str) -> dict[str, Any]:
    return dict(json.loads(run(hub, user, token, kernel_id, WHO_AM_I).strip().splitlines()[-1]))


def test_a_users_cell_cannot_reach_another_users_kernel_state_secret_or_the_gateway(tmp_path: Path) -> None:
    accounts = ensure_accounts(["alice", "bob"])
    with running_hub(tmp_path, users="alice,bob") as hub:
        alice, bob = hub.login_token("alice"), hub.login_token("bob")
        hub.start_server("alice", alice)
        hub.start_server("bob", bob)
        mine = open_session(hub, "alice", alice, "mine.ipynb", sized_spec(hub, "alice", alice, "small"))
        kernel_id = mine["kernel"]["id"]
        assert run(hub, "alice", alice, kernel_id, "x = 41; x") == "41"
        # A full cycle first (her checkpoint folder then holds a committed checkpoint).
        hibernate(hub, alice, kernel_id)
        assert run(hub, "alice", alice, kernel_id, "x + 1") == "42"
        seen = who_am_i(hub, "alice", alice, kernel_id)
        assert seen["uid"] == accounts["alice"].pw_uid, seen
        assert seen["gid"] == accounts["alice"].pw_gid and 0 not in seen["groups"], seen  # no root group
        assert seen["umask"] == 0o077 and seen["tokens"] == [], seen
        assert Path(seen["checkpoint_dir"]).parent == hub.state / "checkpoints" / "alice"
        owner_dir = os.lstat(Path(seen["checkpoint_dir"]).parent)
        assert owner_dir.st_uid == accounts["alice"].pw_uid and stat.S_IMODE(owner_dir.st_mode) == 0o700
        secret = hub.state / "gateway-secret" / "checkpoint-secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_uid == 0
        assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700

        # Their own servers (terminals, files) run as their accounts too, not as the Hub's root.
        assert server_uids() == {"alice": accounts["alice"].pw_uid, "bob": accounts["bob"].pw_uid}

        # A kernelspec without a GPU size (python3) runs as its owner too, never as the gateway.
        cpu = open_session(hub, "bob", bob, "cpu.ipynb", "python3")
        assert who_am_i(hub, "bob", bob, cpu["kernel"]["id"])["uid"] == accounts["bob"].pw_uid

        theirs = open_session(hub, "bob", bob, "theirs.ipynb", sized_spec(hub, "bob", bob, "small"))
        target = {
            **seen,
            "secret": str(secret),
            "old_secret": str(hub.state / "checkpoints" / ".secret"),
        }
        output = run(hub, "bob", bob, theirs["kernel"]["id"], ATTACK.format(target=json.dumps(target)))
        (line,) = [line for line in output.splitlines() if line.startswith("RESULT ")]
        found = json.loads(line.removeprefix("RESULT "))
        assert found["uid"] == accounts["bob"].pw_uid, found
        expected = {
            "connection_file": "denied",
            "kernel_client": "denied",
            "runtime_dir": "denied",
            "secret": "denied",
            "secret_dir": "denied",
            "old_secret": "missing",  # never on the checkpoint volume
            "owner_dir": "denied",
            "checkpoint_dir": "denied",
            "forge_current": "denied",
            "plant_kernel_dir": "denied",
            "gateway_environ": "denied",
        }
        assert {name: found[name] for name in expected} == expected

        # alice's kernel is untouched: another full cycle, her variables back.
        hibernate(hub, alice, kernel_id)
        assert run(hub, "alice", alice, kernel_id, "x + 2") == "43"
        assert who_am_i(hub, "alice", alice, kernel_id)["uid"] == accounts["alice"].pw_uid
        assert gateway(hub, "GET", f"/api/elastic/kernels/{kernel_id}", alice).json()["state"] == "running"


def server_uids() -> dict[str, int]:
    """Hub user -> the uid their single-user server process runs as (read from /proc, as root)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if b"jupyterhub-singleuser" not in (entry / "cmdline").read_bytes():
                continue
            environ = dict(
                item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item
            )
            user = environ.get(b"JUPYTERHUB_USER")
            if user is not None:
                found[user.decode()] = entry.stat().st_uid
        except OSError:
            continue  # gone meanwhile, or not a process
    return found


def hibernate(hub: Hub, token: str, kernel_id: str) -> None:
    done = gateway(hub, "POST", f"/api/elastic/kernels/{kernel_id}/hibernate", token)
    assert done.status_code == 200 and done.json()["state"] == "hibernated", done.text
    checkpoint = done.json()["checkpoint"]
    assert checkpoint["refused"] is None and "x" in json.dumps(checkpoint["saved"]), checkpoint


def run_gateway(home: Path, args: list[str], **popen: Any) -> subprocess.CompletedProcess[str]:
    """The gateway's start-up as the example starts it, until it exits (a refusal is immediate)."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        **{name: os.environ[name] for name in ("PYTHONPATH", "LANG") if name in os.environ},
    }
    command = [sys.executable, "-m", "gateway.app", "--allow-root", "--port=0", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=home, **popen)


def refusal_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if "elastic-gateway:" in line]


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (["--ElasticGateway.kernel_accounts=shared"], ["kernel_accounts is 'shared'", "single_tenant"]),
        # Per-user kernels (the default) and a warm pool: a warm process has no owner.
        (['--ElasticKernels.warm_pool={"python3": {"size": 1}}'], ["warm_pool cannot be used"]),
    ],
    ids=["shared-accounts", "warm-pool"],
)
def test_a_multi_user_gateway_whose_kernels_would_share_its_account_refuses_to_start(
    tmp_path: Path, settings: list[str], says: list[str]
) -> None:
    done = run_gateway(
        tmp_path,
        [
            "--ElasticGateway.auth=jupyterhub",
            f"--ElasticKernels.checkpoint_root={tmp_path / 'checkpoints'}",
            *settings,
        ],
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = refusal_lines(done)
    assert all(fragment in line for fragment in says), line


def test_per_user_kernels_need_a_root_gateway(tmp_path: Path) -> None:
    account = ensure_accounts(["carol"])["carol"]
    home = Path(tempfile.mkdtemp(prefix="ekt-nonroot-"))
    try:
        os.chown(home, account.pw_uid, account.pw_gid)
        done = run_gateway(
            home,
            ["--ElasticGateway.auth=jupyterhub", f"--ElasticKernels.checkpoint_root={home / 'checkpoints'}"],
            user=account.pw_uid,
            group=account.pw_gid,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = refusal_lines(done)
    assert "needs root" in line and f"uid {account.pw_uid}" in line, line
    assert account_of("carol") == account.pw_name


def test_the_checkpoint_secret_moves_off_the_checkpoint_volume(tmp_path: Path) -> None:
    """An older version kept the secret at <checkpoint_root>/.secret, where kernels write."""
    from tests.support.server import start_server

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    old = checkpoints / ".secret"
    old.write_bytes(os.urandom(32))
    old.chmod(0o600)
    before = old.read_bytes()
    running = start_server(tmp_path, elastic_config(checkpoints))
    try:
        moved = tmp_path / "data" / "elastic-secret" / "checkpoint-secret"
        assert moved.read_bytes() == before  # the same secret: existing checkpoints stay valid
        assert stat.S_IMODE(moved.stat().st_mode) == 0o600
        assert stat.S_IMODE(moved.parent.stat().st_mode) == 0o700
        assert not old.exists()
        assert f"moved the checkpoint secret from {old}" in running.log()
    finally:
        running.stop()


def test_a_checkpoint_secret_inside_the_checkpoint_root_is_refused(tmp_path: Path) -> None:
    settings = ElasticKernels(
        gpu_inventory=[{"uuid": "GPU-0", "name": "T", "memory_mib": 40960}],
        checkpoint_root=str(tmp_path / "checkpoints"),
        checkpoint_secret_file=str(tmp_path / "checkpoints" / "keep" / "secret"),
    )
    with pytest.raises(ConfigError, match=r"is inside ElasticKernels\.checkpoint_root"):
        settings.build()


@pytest.mark.parametrize("same", [True, False])
def test_an_old_secret_beside_the_configured_one_is_deleted_only_when_the_same(
    tmp_path: Path, same: bool
) -> None:
    """An upgrade whose configured secret (a mounted Secret) differs from the old ``.secret``
    would leave every older checkpoint unverifiable: the server refuses to start instead."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    configured = tmp_path / "mounted" / "checkpoint-secret"
    configured.parent.mkdir()
    configured.write_bytes(os.urandom(32))
    old = checkpoints / ".secret"
    old.write_bytes(configured.read_bytes() if same else os.urandom(32))
    settings = ElasticKernels(
        gpu_inventory=[{"uuid": "GPU-0", "name": "T", "memory_mib": 40960}],
        checkpoint_root=str(checkpoints),
        checkpoint_secret_file=str(configured),
    )
    if same:
        settings.build()
        assert not old.exists()
    else:
        with pytest.raises(ConfigError, match=r"differs from ElasticKernels\.checkpoint_secret_file"):
            settings.build()
        assert old.exists()


@pytest.fixture
def reachable_tmp() -> Iterator[Path]:
    """A temporary folder other users can enter (pytest's own are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="ekt-accounts-"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_kernel_folders_are_never_made_through_a_symlink(reachable_tmp: Path) -> None:
    """What root prepares for a kernel: a planted symlink is refused, never followed."""
    tmp_path = reachable_tmp
    account_entry = ensure_accounts(["alice"])["alice"]
    accounts = KernelAccounts("ekt-{username}", tmp_path / "runtime", str(tmp_path / "checkpoints"))
    accounts.prepare()
    account = accounts.account_for("alice")
    assert (account.uid, account.gid) == (account_entry.pw_uid, account_entry.pw_gid)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (tmp_path / "runtime" / account.name).symlink_to(elsewhere)
    (tmp_path / "checkpoints" / "alice").symlink_to(elsewhere)
    with pytest.raises(AccountError, match="not a directory"):
        accounts.runtime_dir(account)
    with pytest.raises(AccountError, match="not a directory"):
        accounts.owner_checkpoints(account, "alice")
    assert elsewhere.stat().st_uid == 0 and stat.S_IMODE(elsewhere.stat().st_mode) == 0o755

    # A folder a shared-account gateway left (root's) is handed over with its checkpoints.
    (tmp_path / "checkpoints" / "alice").unlink()
    old = tmp_path / "checkpoints" / "alice" / "k1"
    old.mkdir(parents=True)
    (old / "current").write_text("x")
    folder = accounts.owner_checkpoints(account, "alice")
    assert {os.lstat(p).st_uid for p in (folder, old, old / "current")} == {account.uid}
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "checkpoints").st_mode) == 0o711


def test_a_kernel_inherits_none_of_the_gateways_secrets() -> None:
    gateway_env = {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "JUPYTERHUB_API_TOKEN": "t",
        "JUPYTERHUB_API_URL": "http://hub",
        "JPY_API_TOKEN": "t",
        "ELASTIC_METRICS_TOKEN": "t",
        "AWS_SECRET_ACCESS_KEY": "t",
        "DB_PASSWORD": "t",
        "HOME": "/root",
        "JUPYTER_DATA_DIR": "/root/.local/share/jupyter",
    }
    assert scrub_environment(gateway_env) == {"PATH": "/usr/bin", "LANG": "C.UTF-8"}
