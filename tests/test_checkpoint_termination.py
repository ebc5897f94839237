"""SIGTERM in a managed kernel: the running cell finishes, what changed is checkpointed, the kernel exits.

The guard's decisions are checked with recording callables; then real ipykernel processes (started
by jupyter_client with the environment a provisioner sets) get a real SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.checkpoint.agent import CHECKPOINT_CODE
from kernelmgr.checkpoint.keys import key_file_path, private_key_dir, write_key_file
from kernelmgr.checkpoint.layout import read_current
from kernelmgr.checkpoint.termination import (
    ENV_CHECKPOINT_ON_SIGTERM,
    EXIT_AFTER_SIGTERM,
    TerminationGuard,
    install,
)
from kernelmgr.checkpoint_store import CheckpointStore

pytestmark = pytest.mark.pure

SECRET = b"t" * 32
OWNER = "alice"
KERNEL = "0a1b2c3d-0000-4000-8000-00000000cafe"
ROOT = Path(__file__).resolve().parent.parent
EXTENSION = "kernelmgr.checkpoint.agent"


class Recorder:
    """The guard's surroundings, recorded: what it scheduled, checkpointed, flushed, exited with."""

    def __init__(
        self, *, busy: bool = False, shutdown: bool = False, fail: bool = False, replying: bool = False
    ) -> None:
        self.busy = busy
        #: Whether the cell that finishes is an execute request, its reply sent after it.
        self.replying = replying
        self.shutdown = shutdown
        self.fail = fail
        self.scheduled: list[Callable[[], None]] = []
        self.events: list[str] = []

    def guard(self) -> TerminationGuard:
        def checkpoint() -> None:
            self.events.append("checkpoint")
            if self.fail:
                raise OSError("No space left on device")

        return TerminationGuard(
            checkpoint=checkpoint,
            is_busy=lambda: self.busy,
            shutdown_requested=lambda: self.shutdown,
            schedule=self.scheduled.append,
            before_exit=lambda: self.events.append("flush"),
            exit_process=lambda code: self.events.append(f"exit {code}"),
            end_now=lambda: self.events.append("default end"),
            reply_follows=lambda: self.replying,
        )

    def run_scheduled(self) -> None:
        pending = list(self.scheduled)
        self.scheduled.clear()  # the guard holds this list's ``append``
        for callback in pending:
            callback()


def test_an_idle_kernel_checkpoints_on_its_loop_then_exits() -> None:
    recorder = Recorder()
    guard = recorder.guard()
    guard.on_sigterm()
    assert recorder.events == ["checkpoint", "flush", "exit 143"]


def test_a_running_cell_finishes_before_the_checkpoint() -> None:
    recorder = Recorder(busy=True)
    guard = recorder.guard()
    guard.on_sigterm()
    assert recorder.events == [] and recorder.scheduled == []  # waits for the cell
    recorder.busy = False
    guard.cell_finished()
    recorder.run_scheduled()
    assert recorder.events == ["checkpoint", "flush", "exit 143"]
    guard.cell_finished()
    assert recorder.scheduled == []  # handled once


def test_the_checkpoint_waits_for_the_finished_cells_reply_to_be_sent() -> None:
    """ipykernel sends a cell's ``execute_reply`` a loop turn after the cell's last hook: an exit
    in between leaves the notebook waiting for a reply that never comes."""
    recorder = Recorder(busy=True, replying=True)
    guard = recorder.guard()
    guard.on_sigterm()
    recorder.busy = False
    guard.cell_finished()
    recorder.run_scheduled()
    assert recorder.events == [] and recorder.scheduled == []  # the reply is not sent yet
    guard.reply_sent()
    recorder.run_scheduled()
    assert recorder.events == ["checkpoint", "flush", "exit 143"]
    # A SIGTERM that comes between the cell's end and its reply waits for the reply too.
    late = Recorder(replying=True)
    guard = late.guard()
    guard.cell_finished()
    guard.on_sigterm()
    assert late.events == [] and late.scheduled == []
    guard.reply_sent()
    late.run_scheduled()
    assert late.events == ["checkpoint", "flush", "exit 143"]


def test_after_a_shutdown_request_sigterm_ends_the_kernel_without_a_checkpoint() -> None:
    recorder = Recorder(shutdown=True)
    recorder.guard().on_sigterm()
    assert recorder.events == ["default end"] and recorder.scheduled == []
    # The Python-level handler (it runs mid-cell too) ends the kernel only after a shutdown request.
    asked = Recorder(shutdown=True)
    asked.guard().on_signal(signal.SIGTERM, None)
    assert asked.events == ["default end"]
    not_asked = Recorder()
    not_asked.guard().on_signal(signal.SIGTERM, None)
    assert not_asked.events == [] and not_asked.scheduled == []
    # Asked while the SIGTERM waited for the loop: still no checkpoint.
    late = Recorder(busy=True)
    guard = late.guard()
    guard.on_sigterm()
    late.shutdown, late.busy = True, False
    guard.cell_finished()
    late.run_scheduled()
    assert late.events == ["default end"]


def test_a_failed_checkpoint_still_flushes_and_exits_with_status_1() -> None:
    recorder = Recorder(fail=True)
    guard = recorder.guard()
    guard.on_sigterm()
    guard.on_sigterm()  # a second SIGTERM changes nothing
    assert recorder.events == ["checkpoint", "flush", "exit 1"]


def test_a_real_sigterm_wakes_an_idle_loop_and_runs_the_guard_there() -> None:
    """The wiring: SIGTERM, sent from another thread while the loop sleeps, runs on the loop."""
    from tornado.ioloop import IOLoop

    recorder = Recorder()
    guard = recorder.guard()
    loop = IOLoop(make_current=False)
    on_loop: list[bool] = []

    def exit_process(code: int) -> None:
        on_loop.append(threading.current_thread() is threading.main_thread())
        loop.stop()

    guard.exit_process = exit_process
    uninstall = install(guard, loop)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        loop.call_later(10, loop.stop)  # a guard that never ran fails below, not hangs
        loop.start()
    finally:
        uninstall()
        loop.close()
    assert recorder.events == ["checkpoint", "flush"] and on_loop == [True]
    with pytest.raises((ValueError, RuntimeError)):  # asyncio takes signals on the main thread only
        other = IOLoop(make_current=False)
        errors: list[BaseException] = []

        def off_main() -> None:
            try:
                install(guard, other)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=off_main)
        worker.start()
        worker.join()
        other.close()
        raise errors[0]


# -- real kernels --------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "checkpoints", SECRET)


@pytest.fixture
def start_kernel(store: CheckpointStore, tmp_path: Path) -> Iterator[Callable[[bool], tuple[Any, Any]]]:
    """Start a real ipykernel with the agent, as the local provisioner would (guard on or off)."""
    manager = pytest.importorskip("jupyter_client.manager")
    started: list[tuple[Any, Any]] = []

    def start(guarded: bool = True) -> tuple[Any, Any]:
        key_file = key_file_path(private_key_dir(tmp_path / "runtime"), KERNEL)
        write_key_file(key_file, store.key_for(OWNER))
        env = {
            **os.environ,
            **store.agent_env(OWNER, KERNEL, key_file=key_file, restore=False),
            "PYTHONPATH": str(ROOT),
        }
        if guarded:
            env[ENV_CHECKPOINT_ON_SIGTERM] = "1"
        extension = f"--IPKernelApp.extensions=['{EXTENSION}']"
        km, kc = manager.start_new_kernel(extra_arguments=[extension], env=env)
        started.append((km, kc))
        return km, kc

    yield start
    for km, kc in started:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def terminate(km: Any, timeout: float = 30) -> int:
    """SIGTERM the kernel process, as a kubelet or systemd does; its exit status."""
    process = km.provisioner.process
    os.kill(process.pid, signal.SIGTERM)
    return int(process.wait(timeout))


def run(kc: Any, code: str) -> dict[str, Any]:
    reply = kc.execute_interactive(code, timeout=30)
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply


def wait_for_output(kc: Any, marker: str, timeout: float = 60) -> None:
    """Wait until the running cell prints ``marker``: it has got that far (a sleep would only guess,
    and lose on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["msg_type"] == "stream" and marker in msg["content"]["text"]:
            return


def wait_for_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_sigterm_checkpoints_an_idle_kernel_and_flushes_its_files(
    store: CheckpointStore, start_kernel: Callable[[bool], tuple[Any, Any]], tmp_path: Path
) -> None:
    notes = tmp_path / "notes.txt"
    km, kc = start_kernel(True)
    run(kc, f"x = 41\nnotes = open({str(notes)!r}, 'w'); notes.write('unsaved work')")
    assert terminate(km) == EXIT_AFTER_SIGTERM
    summary = store.summary(OWNER, KERNEL)
    assert summary is not None and "x" in summary["saved"], summary
    assert notes.read_text() == "unsaved work"


def test_without_the_guard_sigterm_loses_what_changed(
    store: CheckpointStore, start_kernel: Callable[[bool], tuple[Any, Any]]
) -> None:
    """What the guard is for: ipykernel's own SIGTERM ends the process with nothing written."""
    km, kc = start_kernel(False)
    run(kc, "x = 41")
    assert terminate(km) == -signal.SIGTERM
    assert store.summary(OWNER, KERNEL) is None


def test_sigterm_during_an_awaiting_cell_waits_for_it_and_its_reply(
    store: CheckpointStore, start_kernel: Callable[[bool], tuple[Any, Any]]
) -> None:
    km, kc = start_kernel(True)
    run(kc, "x = 1")
    # The guard knows a reply follows a cell (the kernel's session is watched).
    run(kc, "from kernelmgr.checkpoint import agent\nassert agent._GUARD.reply_follows()")
    # A cell that awaits leaves the loop running: the SIGTERM callback comes during the cell.
    msg_id = kc.execute("import asyncio\nprint('in the cell', flush=True)\nawait asyncio.sleep(2)\ny = 2")
    wait_for_output(kc, "in the cell")
    process = km.provisioner.process
    os.kill(process.pid, signal.SIGTERM)
    reply = kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
    assert process.wait(30) == EXIT_AFTER_SIGTERM
    summary = store.summary(OWNER, KERNEL)
    assert summary is not None and {"x", "y"} <= set(summary["saved"]), summary


def test_sigterm_after_a_committed_checkpoint_writes_nothing_new(
    store: CheckpointStore, start_kernel: Callable[[bool], tuple[Any, Any]]
) -> None:
    km, kc = start_kernel(True)
    run(kc, "x = 1")
    reply = kc.execute_interactive(CHECKPOINT_CODE, silent=True, timeout=30)
    assert reply["content"]["status"] == "ok"
    committed = read_current(store.kernel_dir(OWNER, KERNEL))
    assert terminate(km) == EXIT_AFTER_SIGTERM
    assert read_current(store.kernel_dir(OWNER, KERNEL)) == committed
    assert len([p for p in store.kernel_dir(OWNER, KERNEL).iterdir() if p.is_dir()]) == 1


def test_a_kernel_shut_down_by_its_server_leaves_no_checkpoint(
    store: CheckpointStore, start_kernel: Callable[[bool], tuple[Any, Any]], tmp_path: Path
) -> None:
    """A user deleting a kernel: shutdown_request, then (as jupyter_client does for a kernel slow to
    go) SIGTERM. Neither may write a checkpoint of a kernel its user deleted."""
    km, kc = start_kernel(True)
    # The kernel's exit takes a while (an atexit handler of the user's): SIGTERM lands in it.
    exiting = tmp_path / "exiting"
    run(
        kc,
        "x = 1\nimport atexit, pathlib, time\n"
        f"atexit.register(lambda: (pathlib.Path({str(exiting)!r}).touch(), time.sleep(600)))",
    )
    kc.shutdown()
    reply = kc.get_control_msg(timeout=10)
    assert reply["msg_type"] == "shutdown_reply"
    wait_for_file(exiting)
    assert terminate(km) == -signal.SIGTERM
    assert store.summary(OWNER, KERNEL) is None


def test_a_busy_kernel_its_server_shuts_down_ends_at_sigterm_without_waiting_for_the_cell(
    store: CheckpointStore, start_kernel: Callable[[bool], tuple[Any, Any]]
) -> None:
    """A user deleting a kernel busy in a long cell: the shutdown request cannot stop the cell, so
    jupyter_client sends SIGTERM, which must end the kernel then, not after the cell."""
    km, kc = start_kernel(True)
    run(kc, "x = 1")
    kc.execute("import time\nprint('in the cell', flush=True)\ntime.sleep(600)")
    wait_for_output(kc, "in the cell")
    kc.shutdown()
    assert kc.get_control_msg(timeout=10)["msg_type"] == "shutdown_reply"
    process = km.provisioner.process
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(10) == -signal.SIGTERM
    assert store.summary(OWNER, KERNEL) is None
