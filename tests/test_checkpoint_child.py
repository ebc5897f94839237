"""Work in a forked child that reports on a pipe (kernelmgr.checkpoint.child): what a restore's
download runs in, beside the kernel starting in its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.checkpoint.child import Child, ChildFailed

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parent.parent


def no_messages(message: dict[str, Any]) -> None:
    raise AssertionError(f"unexpected message {message}")


def gone(pid: int) -> bool:
    """No such process, or only its zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_messages_arrive_in_the_parent_before_the_result_from_another_process() -> None:
    seen: list[dict[str, Any]] = []

    def work(send: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        send({"libraries": ["numpy"]})
        send({"step": 2})
        return {"pid": os.getpid(), "answer": 42}

    result = Child(work, seen.append).result()
    assert result["answer"] == 42
    assert result["pid"] != os.getpid()
    assert seen == [{"libraries": ["numpy"]}, {"step": 2}]


def test_an_exception_in_the_child_is_raised_in_the_parent_with_its_kind_and_message() -> None:
    def work(send: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        raise PermissionError("the bucket said 403")

    with pytest.raises(ChildFailed, match="the bucket said 403") as failed:
        Child(work, no_messages).result()
    assert failed.value.kind == "PermissionError"


def test_a_child_that_dies_without_a_result_is_a_failure_not_a_hang() -> None:
    def work(send: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        os._exit(7)

    with pytest.raises(ChildFailed, match="exit status 7") as failed:
        Child(work, no_messages).result()
    assert failed.value.kind == "ChildExited"


def test_kill_ends_a_child_that_would_run_forever() -> None:
    def work(send: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        send({"started": True})
        threading.Event().wait()
        return {}

    started = threading.Event()
    child = Child(work, lambda message: started.set())
    assert started.wait(60)
    child.kill()
    with pytest.raises(ChildFailed, match="signal 9"):
        child.result()
    assert gone(child.pid)


def test_an_interrupt_for_the_kernels_cell_does_not_stop_the_child(tmp_path: Path) -> None:
    """jupyter_client interrupts a kernel with SIGINT to its whole process group."""
    sent = tmp_path / "interrupt-sent"
    started = threading.Event()

    def work(send: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        send({"started": True})
        while not sent.exists():  # still working when the interrupt arrives
            time.sleep(0.01)
        return {"finished": True}

    child = Child(work, lambda message: started.set())
    assert started.wait(60)
    os.kill(child.pid, signal.SIGINT)
    sent.touch()
    assert child.result() == {"finished": True}


def test_the_child_leaves_without_running_the_parents_exit_handlers(tmp_path: Path) -> None:
    """A child that returned into the parent's code, or ran its atexit handlers, would do the
    parent's cleanup (remove its files, flush its buffers) twice."""
    marker = tmp_path / "exit-handler-ran"
    script = textwrap.dedent(
        f"""
        import atexit, pathlib
        from kernelmgr.checkpoint.child import Child
        atexit.register(lambda: pathlib.Path({str(marker)!r}).open("a").write("ran\\n"))
        print(Child(lambda send: {{"ok": True}}, lambda m: None).result())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'ok': True}"
    assert marker.read_text() == "ran\n"  # the parent's, once


def test_the_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A kernel killed while it downloads leaves no download running."""
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(
        f"""
        import os, pathlib, threading
        from kernelmgr.checkpoint.child import Child
        def work(send):
            pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
            threading.Event().wait()
        Child(work, lambda m: None).result()
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", "the child to start")
        child_pid = int(pid_file.read_text())
        assert not gone(child_pid)
        parent.kill()
        parent.wait(timeout=60)
        wait_until(lambda: gone(child_pid), "the child to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_kill_after_the_child_was_reaped_signals_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once reaped, the pid may belong to another process: a late discard must not signal it."""
    child = Child(lambda send: {"done": True}, no_messages)
    assert child.result() == {"done": True}
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    child.kill()
    assert signalled == []
