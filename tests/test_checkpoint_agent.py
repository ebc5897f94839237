"""The in-kernel agent, in real IPython shells (no jupyter server, no kernel process).

A "kernel" here is an ``InteractiveShell`` with the extension loaded and the environment
the server would set. Resuming is simulated with a *fresh* shell on the same kernel
directory; one test does it in a fresh Python process, as a resumed pod would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from kernelmgr.checkpoint import agent
from kernelmgr.checkpoint.agent import CHECKPOINT_CODE, AgentConfig, format_report, human_bytes
from kernelmgr.checkpoint.errors import CheckpointFailed
from kernelmgr.checkpoint.first_cell import RestoreIncomplete
from kernelmgr.checkpoint.keys import ENV_KEY_FILE, key_file_path, private_key_dir, write_key_file
from kernelmgr.checkpoint.layout import read_current
from kernelmgr.checkpoint_store import CheckpointStore

pytestmark = pytest.mark.pure

SECRET = b"k" * 32
OWNER = "alice"
KERNEL = "0a1b2c3d-0000-4000-8000-00000000beef"
ROOT = Path(__file__).resolve().parent.parent
EXTENSION = "kernelmgr.checkpoint.agent"


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "checkpoints", SECRET)


@pytest.fixture(autouse=True)
def isolate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Shells replace ``sys.modules['__main__']``; put pytest's back afterwards. The agent a test
    loaded is unloaded with it: its exit hook (``quick_exit``) belongs to a kernel's exit, not
    to pytest's."""
    main = sys.modules["__main__"]
    names = (agent.ENV_DIR, ENV_KEY_FILE, agent.ENV_KERNEL_ID, agent.ENV_OWNER, agent.ENV_RESTORE)
    for name in (*names, agent.ENV_RESTORE_CHECKPOINT, agent.ENV_KEY_REMOVED, agent.ENV_SERVER_PID):
        monkeypatch.delenv(name, raising=False)
    yield
    sys.modules["__main__"] = main
    if agent._AGENT is not None:
        agent.unload_ipython_extension(agent._AGENT.shell)
    agent._AGENT = None


def agent_env(
    store: CheckpointStore, *, restore: bool, key: bytes | None = None, expected: str | None = None
) -> dict[str, str]:
    """What the provisioner hands a kernel: a fresh key file (the agent removes it once read) and
    the environment naming it; when restoring, the committed checkpoint is the one expected."""
    key_file = key_file_path(private_key_dir(store.root.parent / "runtime"), KERNEL)
    write_key_file(key_file, key if key is not None else store.key_for(OWNER))
    if restore and expected is None:
        expected = read_current(store.kernel_dir(OWNER, KERNEL))
    return store.agent_env(OWNER, KERNEL, key_file=key_file, restore=restore, restore_checkpoint=expected)


def new_shell(monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None) -> InteractiveShell:
    """A fresh shell, like a new kernel process: env as the server sets it, extension loaded."""
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell(config=config)
    shell.display_pub = CapturingDisplayPublisher()
    assert shell.extension_manager is not None
    shell.extension_manager.load_extension(EXTENSION)
    return shell


def run(shell: InteractiveShell, code: str) -> Any:
    result = shell.run_cell(code, store_history=True)
    result.raise_error()
    return result.result


def displayed(shell: InteractiveShell) -> list[dict[str, str]]:
    assert isinstance(shell.display_pub, CapturingDisplayPublisher)
    outputs = shell.display_pub.outputs
    found = [dict(out["data"]) for out in outputs]
    outputs.clear()
    return found


def user_variables(shell: InteractiveShell) -> set[str]:
    hidden = shell.user_ns_hidden
    return {
        name
        for name, value in shell.user_ns.items()
        if not name.startswith("_") and not (name in hidden and hidden[name] is value)
    }


def test_checkpoint_then_resume_in_a_fresh_shell(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "import json as js\nb = [1]\nc = [b, b]\narr = bytearray(b'abc')")
    run(shell, "def f(x):\n    return x + len(c)\nclass P:\n    def __init__(self, v):\n        self.v = v")
    run(shell, "p = P(3)\ngen = (i for i in range(3))\nc")
    count = shell.execution_count
    assert shell.history_manager is not None
    history = list(shell.history_manager.get_range(output=False))
    last_value = shell.user_ns.get("_")

    # What the server sends: a silent execute of CHECKPOINT_CODE.
    result = shell.run_cell(CHECKPOINT_CODE, silent=True)
    assert result.success and result.error_in_exec is None
    assert shell.execution_count == count and shell.user_ns.get("_") is last_value
    assert list(shell.history_manager.get_range(output=False)) == history
    assert displayed(shell) == []
    assert "agent" not in shell.user_ns and "kernelmgr" not in shell.user_ns

    summary = store.summary(OWNER, KERNEL)
    assert summary is not None
    assert summary["saved"] == ["js", "b", "c", "arr", "f", "P", "p"]
    assert summary["not_saved"] == [
        {"name": "gen", "type": "generator", "reason": "TypeError: cannot pickle 'generator' object"}
    ]

    resumed = new_shell(monkeypatch, agent_env(store, restore=True))
    # gen cannot be saved; its cell is safe to re-run, so it was recomputed (test_checkpoint_recompute)
    assert user_variables(resumed) == {"js", "b", "c", "arr", "f", "P", "p", "gen"}
    assert displayed(resumed) == []  # nothing shown until the user runs a cell
    ns = resumed.user_ns
    assert ns["c"][0] is ns["c"][1] is ns["b"]
    assert isinstance(ns["p"], ns["P"]) and ns["f"](1) == 3
    assert ns["arr"] == bytearray(b"abc") and ns["js"] is sys.modules["json"]

    resumed.run_cell("1 + 1", silent=True)  # e.g. a frontend's own silent request
    assert displayed(resumed) == []
    assert run(resumed, "f(10)") == 12
    [report] = displayed(resumed)
    assert report["text/plain"].startswith("Kernel resumed: restored 7 variables (")
    assert "Recomputed (re-ran 1 cell): gen." in report["text/plain"]
    assert "Not restored" not in report["text/plain"]
    assert "**Kernel resumed**" in report["text/markdown"] and "`gen`" in report["text/markdown"]
    assert list(resumed.user_ns["gen"]) == [0, 1, 2]
    run(resumed, "c.append(1)")
    assert displayed(resumed) == []  # once only

    written = store.restore_report(OWNER, KERNEL)
    assert written is not None and written == agent.last_restore_report()
    assert written["restored"] == ["js", "b", "c", "arr", "f", "P", "p"]
    assert written["refused"] is None


def test_checkpoint_returns_the_summary_and_skips_shell_names(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "x = 1\n_private = 2\nx")  # the trailing ``x`` fills IPython's ``_``, ``_1`` caches
    summary = agent.checkpoint()
    # A user's own underscore name is state; IPython's history caches and start-up names are not.
    assert summary["saved"] == ["x", "_private"] and summary["not_saved"] == []
    assert summary["id"].startswith("ckpt-") and summary["bytes"] > 0


def test_a_refused_checkpoint_starts_the_kernel_empty_and_says_why(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "secret_work = [1, 2, 3]")
    summary = agent.checkpoint()
    data = store.kernel_dir(OWNER, KERNEL) / summary["id"] / "data.bin"
    content = bytearray(data.read_bytes())
    content[-1] ^= 1
    data.write_bytes(content)

    resumed = new_shell(monkeypatch, agent_env(store, restore=True))
    assert user_variables(resumed) == set()
    # The first cell is not run on the empty kernel: it says so, and running it again runs it.
    first = resumed.run_cell("y = 1", store_history=True)
    assert isinstance(first.error_before_exec, RestoreIncomplete) and "y" not in resumed.user_ns
    assert "Your variables could not be restored" in str(first.error_before_exec)
    assert run(resumed, "y = 1; y") == 1
    [report] = displayed(resumed)
    kept = store.kernel_dir(OWNER, KERNEL) / "quarantine" / summary["id"]
    text = report["text/plain"]
    assert text.startswith("Kernel resumed without its variables")
    assert "does not match the manifest's digest" in text and "The kernel started empty." in text
    assert str(kept) in text and (kept / "reason.txt").exists()
    written = store.restore_report(OWNER, KERNEL)
    assert written is not None and "digest" in written["refused"] and written["quarantined"] == str(kept)


def test_another_owners_kernel_cannot_load_the_checkpoint(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    new_shell(monkeypatch, agent_env(store, restore=False))
    run(agent._AGENT.shell, "x = 1")  # type: ignore[union-attr]
    agent.checkpoint()
    env = agent_env(store, restore=True, key=store.key_for("mallory"))
    resumed = new_shell(monkeypatch, env)
    assert user_variables(resumed) == set()
    report = agent.last_restore_report()
    assert report is not None and "HMAC does not verify" in report["refused"]


def test_a_failed_checkpoint_reaches_the_server_as_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    env = agent_env(CheckpointStore(tmp_path / "checkpoints", SECRET), restore=False)
    env[agent.ENV_DIR] = str(blocker / "kernel")
    shell = new_shell(monkeypatch, env)
    run(shell, "x = 1")
    result = shell.run_cell(CHECKPOINT_CODE, silent=True)
    error = result.error_in_exec
    assert isinstance(error, CheckpointFailed)
    assert type(error).__name__ == "CheckpointFailed" and "\n" not in str(error)
    assert "could not write the checkpoint" in str(error) and str(blocker) in str(error)


def test_an_unconfigured_kernel_refuses_to_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    new_shell(monkeypatch, None)
    with pytest.raises(CheckpointFailed, match="ELASTIC_CHECKPOINT_DIR is not set"):
        agent.checkpoint()


def test_nothing_to_restore_is_reported(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = "ckpt-20240101T000000000000-00000000"
    resumed = new_shell(monkeypatch, agent_env(store, restore=True, expected=expected))
    assert isinstance(resumed.run_cell("1", store_history=True).error_before_exec, RestoreIncomplete)
    [report] = displayed(resumed)
    assert "no committed checkpoint was found" in report["text/plain"] and expected in report["text/plain"]


def test_a_restore_without_the_expected_checkpoint_id_is_refused(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    new_shell(monkeypatch, agent_env(store, restore=False))
    run(agent._AGENT.shell, "x = 1")  # type: ignore[union-attr]
    summary = agent.checkpoint()
    env = agent_env(store, restore=True)
    del env[agent.ENV_RESTORE_CHECKPOINT]
    resumed = new_shell(monkeypatch, env)
    assert user_variables(resumed) == set()
    report = agent.last_restore_report()
    assert report is not None and "ELASTIC_RESTORE_CHECKPOINT is not set" in report["refused"]
    assert report["quarantined"] is None and store.latest(OWNER, KERNEL) is not None  # kept in place
    assert store.latest(OWNER, KERNEL).checkpoint_id == summary["id"]  # type: ignore[union-attr]


def test_config_from_env(tmp_path: Path) -> None:
    assert AgentConfig.from_env({}) is None
    key_file = tmp_path / "k.key"
    base = {"ELASTIC_CHECKPOINT_DIR": "/x", "ELASTIC_KERNEL_ID": "k"}
    with pytest.raises(ValueError, match="ELASTIC_OWNER"):
        AgentConfig.from_env({**base, ENV_KEY_FILE: str(key_file)})
    with pytest.raises(ValueError, match=r"ELASTIC_CHECKPOINT_KEY_FILE is not.*no longer read"):
        AgentConfig.from_env({**base, "ELASTIC_OWNER": "o", "ELASTIC_CHECKPOINT_KEY": "00" * 32})
    with pytest.raises(ValueError, match="does not exist"):
        AgentConfig.from_env({**base, "ELASTIC_OWNER": "o", ENV_KEY_FILE: str(key_file)})
    key_file.write_text("zz\n")
    key_file.chmod(0o600)
    with pytest.raises(ValueError, match="not hold a hex checkpoint key"):
        AgentConfig.from_env({**base, "ELASTIC_OWNER": "o", ENV_KEY_FILE: str(key_file)})
    write_key_file(key_file, b"\x01" * 32)
    config = AgentConfig.from_env(
        {
            **base,
            "ELASTIC_OWNER": "o",
            ENV_KEY_FILE: str(key_file),
            "ELASTIC_RESTORE": "1",
            "ELASTIC_RESTORE_CHECKPOINT": "ckpt-x",
        }
    )
    assert config is not None and config.key == b"\x01" * 32 and config.restore
    assert config.restore_checkpoint == "ckpt-x"
    assert not key_file.exists()  # consumed


def test_the_key_file_is_read_once_and_never_left_in_the_environment(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = agent_env(store, restore=False)
    key_file = Path(env[ENV_KEY_FILE])
    assert key_file.stat().st_mode & 0o777 == 0o600
    shell = new_shell(monkeypatch, env)
    assert not key_file.exists(), "the agent must remove the key file once it has read it"
    assert ENV_KEY_FILE not in os.environ and "ELASTIC_CHECKPOINT_KEY" not in os.environ
    key_hex = store.key_for(OWNER).hex()
    assert not [name for name, value in os.environ.items() if key_hex in value]
    # %reload_ext keeps the key it read (the file is gone) and can still checkpoint.
    assert shell.extension_manager is not None
    shell.extension_manager.reload_extension(EXTENSION)
    run(shell, "x = 1")
    assert agent.checkpoint()["saved"] == ["x"]


def test_a_missing_key_file_on_resume_says_why_in_the_first_cell(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = agent_env(store, restore=True, expected="ckpt-20240101T000000000000-00000000")
    Path(env[ENV_KEY_FILE]).unlink()
    resumed = new_shell(monkeypatch, env)
    assert isinstance(resumed.run_cell("1", store_history=True).error_before_exec, RestoreIncomplete)
    [report] = displayed(resumed)
    assert report["text/plain"].startswith("Kernel resumed without its variables")
    assert "key file" in report["text/plain"] and "does not exist" in report["text/plain"]
    with pytest.raises(CheckpointFailed, match=r"not configured.*does not exist"):
        agent.checkpoint()


def test_report_text() -> None:
    plain, markdown = format_report(
        {
            "restored": [f"v{i}" for i in range(12)],
            "not_restored": [
                {"name": "gen", "reason": "generator: TypeError: cannot pickle 'generator' object"}
            ],
            "bytes": 1 << 30,
            "seconds": 0.8,
            "remapped": ["model: cuda:1 -> cpu"],
            "warnings": [],
            "refused": None,
        }
    )
    assert plain == (
        "Kernel resumed: restored 12 variables (1.0 GiB) in 0.8 s. "
        "Not restored: gen (generator: TypeError: cannot pickle 'generator' object). "
        "Moved: model: cuda:1 -> cpu."
    )
    assert "- model: cuda:1 -> cpu" in markdown
    assert human_bytes(512) == "512 B" and human_bytes(3 << 20) == "3.0 MiB"


RESUME_IN_A_NEW_PROCESS = """
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
config = Config()
config.HistoryManager.hist_file = ":memory:"
shell = InteractiveShell(config=config)
shell.extension_manager.load_extension("kernelmgr.checkpoint.agent")
for cell in [
    "assert isinstance(p, Point) and isinstance(points[1], Point)",
    "assert p.norm() == 7 and double(4) == 8",
    "scale = 3",
    "assert double(4) == 12, 'notebook functions read the live namespace'",
    "assert add3(1) == 4 and total() == 7",
]:
    shell.run_cell(cell, store_history=True).raise_error()
print("ok")
"""


def test_notebook_classes_and_functions_resume_in_a_new_process(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(
        shell,
        textwrap.dedent(
            """
            scale = 2
            def double(x):
                return x * scale
            class Point:
                def __init__(self, x, y):
                    self.x, self.y = x, y
                def norm(self):
                    return abs(self.x) + abs(self.y)
            def make_adder(n):
                return lambda x: x + n
            p = Point(3, -4)
            points = [p, Point(1, 1)]
            add3 = make_adder(3)
            total = lambda: p.norm()
            """
        ),
    )
    agent.checkpoint()
    env = {**os.environ, **agent_env(store, restore=True), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", RESUME_IN_A_NEW_PROCESS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
    report = json.loads((store.kernel_dir(OWNER, KERNEL) / "restore-report.json").read_text())
    assert report["not_restored"] == [] and "Point" in report["restored"]


def test_a_real_ipykernel_checkpoints_silently_and_resumes(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claims about silent executes, checked against ipykernel itself."""
    manager = pytest.importorskip("jupyter_client.manager")

    def start(restore: bool) -> Any:
        env = {**os.environ, **agent_env(store, restore=restore), "PYTHONPATH": str(ROOT)}
        return manager.start_new_kernel(
            extra_arguments=[f"--IPKernelApp.extensions=['{EXTENSION}']"], env=env
        )

    km, kc = start(False)
    try:
        reply = kc.execute_interactive("data = {'a': [1, 2]}\ngen = (i for i in ())", timeout=30)
        assert reply["content"]["execution_count"] == 1
        seen: list[dict[str, Any]] = []
        reply = kc.execute_interactive(CHECKPOINT_CODE, silent=True, timeout=30, output_hook=seen.append)
        assert reply["content"]["status"] == "ok"
        assert {m["msg_type"] for m in seen} == {"status"}  # no output, no execute_input
        assert kc.execute_interactive("1", timeout=30)["content"]["execution_count"] == 2
    finally:
        km.shutdown_kernel(now=True)

    km, kc = start(True)
    try:
        outputs: list[dict[str, Any]] = []
        reply = kc.execute_interactive("data['a']", timeout=30, output_hook=outputs.append)
        assert reply["content"]["status"] == "ok" and reply["content"]["execution_count"] == 1
        kinds = [(m["msg_type"], m["content"].get("data", {}).get("text/plain", "")) for m in outputs]
        assert [k for k, _ in kinds if k in ("display_data", "execute_result")] == [
            "display_data",
            "execute_result",
        ]
        assert kinds[[k for k, _ in kinds].index("display_data")][1].startswith(
            "Kernel resumed: restored 1 variable"
        )
        assert ("execute_result", "[1, 2]") in kinds

        # A failing checkpoint (the kernel directory is now a file): the reply carries the
        # error for the server to read.
        directory = store.kernel_dir(OWNER, KERNEL)
        shutil.rmtree(directory)
        directory.write_text("")
        reply = kc.execute_interactive(CHECKPOINT_CODE, silent=True, timeout=30)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "CheckpointFailed"
        assert reply["content"]["evalue"] == f"could not write the checkpoint in {directory}: File exists"
    finally:
        km.shutdown_kernel(now=True)


KERNEL_THAT_OUTLIVES_ITS_SERVER = """
import sys, time
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
config = Config()
config.HistoryManager.hist_file = ":memory:"
shell = InteractiveShell(config=config)
shell.extension_manager.load_extension("kernelmgr.checkpoint.agent")
shell.run_cell("x = 1", store_history=True).raise_error()
# Left open, its bytes still in the buffer: the exit must not drop them.
cell = f"notes = open({sys.argv[1]!r}, 'w'); notes.write('unsaved work');"
shell.run_cell(cell, store_history=True).raise_error()
print("ready", flush=True)
shell.run_cell("import time; time.sleep(1.5); y = 2", store_history=True).raise_error()
time.sleep(30)
print("the watchdog did not fire", flush=True)
"""


def test_a_kernel_checkpoints_itself_and_exits_when_its_server_dies(
    store: CheckpointStore, tmp_path: Path
) -> None:
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    env = {
        **os.environ,
        **agent_env(store, restore=False),
        agent.ENV_SERVER_PID: str(server.pid),
        "PYTHONPATH": str(ROOT),
    }
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL_THAT_OUTLIVES_ITS_SERVER, str(tmp_path / "notes.txt")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert kernel.stdout is not None and kernel.stdout.readline().strip() == "ready"
        server.kill()  # while the second cell is still running
        server.wait(10)
        out, err = kernel.communicate(timeout=30)
    finally:
        for process in (server, kernel):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert kernel.returncode == 0, err
    assert "did not fire" not in out
    summary = store.summary(OWNER, KERNEL)
    assert summary is not None and summary["saved"] == ["x", "time", "y"]  # waited for the running cell
    assert (tmp_path / "notes.txt").read_text() == "unsaved work"  # flushed before the exit


def test_an_upload_the_store_refuses_reports_its_own_error(
    monkeypatch: pytest.MonkeyPatch, store: CheckpointStore
) -> None:
    """A store that cannot be reached mid-upload: the error says so. Before, a part's slice
    still held the file's mapping and closing it raised BufferError, which hid the cause."""
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "x = 1")
    assert agent._AGENT is not None and agent._AGENT.config is not None
    folder = agent._AGENT.config.kernel_dir / "c1"
    folder.mkdir(parents=True)
    (folder / "data.bin").write_bytes(os.urandom(3 * 2**20))
    unreachable = [f"http://127.0.0.1:9/part-{n}" for n in (1, 2, 3)]  # the discard port: refused
    with pytest.raises(CheckpointFailed, match="could not be uploaded: ConnectionRefusedError"):
        agent._AGENT.upload({"checkpoint": "c1", "urls": unreachable, "part_size": 2**20})


def test_the_restore_report_is_marked_as_the_platforms_note() -> None:
    """The server leaves marked displays out of a front end that shows them itself (JupyterLab's
    extension, as a notification); nothing else is taken for one."""
    from jupyter_client.session import Session

    from kernelmgr.checkpoint import notes

    session = Session(key=b"k")

    def frames(msg_type: str, content: dict) -> list[bytes]:
        return session.serialize(session.msg(msg_type, content), ident=[b"topic"])

    marked = {"data": {"text/plain": "Kernel resumed"}, "metadata": notes.metadata("restore_report")}
    assert notes.is_note(frames("display_data", marked))
    assert not notes.is_note(
        frames("display_data", {"data": {"text/plain": notes.METADATA_KEY}, "metadata": {}})
    )
    assert not notes.is_note(frames("stream", {"name": "stdout", "text": json.dumps(marked)}))
    assert not notes.is_note([b"no delimiter"])


def test_a_variable_that_fails_to_load_holds_the_first_cell_back(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A variable the checkpoint held and the restore could not load: the first cell is not run
    (it says which); one that could never be saved (a socket) does not count."""
    import importlib

    (tmp_path / "gone_module.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "import socket, gone_module\nthing = gone_module.Thing()\nkept = 41\nsock = socket.socket()")
    agent.checkpoint()
    (tmp_path / "gone_module.py").unlink()  # the library is gone when the kernel comes back
    sys.modules.pop("gone_module", None)
    importlib.invalidate_caches()

    resumed = new_shell(monkeypatch, agent_env(store, restore=True))
    first = resumed.run_cell("kept + 1", store_history=True)
    assert isinstance(first.error_before_exec, RestoreIncomplete)
    text = str(first.error_before_exec)
    assert text.startswith("Not all of your variables could be restored: ") and "thing" in text, text
    assert "sock" not in text and "kept" not in text
    assert run(resumed, "kept + 1") == 42  # run again: it runs
    resumed.user_ns["sock"] = None
    shell.user_ns["sock"].close()


def test_a_restore_that_lost_only_what_was_never_saved_runs_the_first_cell(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "import socket\nkept = 41\nsock = socket.socket()")
    agent.checkpoint()
    shell.user_ns["sock"].close()
    resumed = new_shell(monkeypatch, agent_env(store, restore=True))
    assert run(resumed, "kept + 1") == 42
