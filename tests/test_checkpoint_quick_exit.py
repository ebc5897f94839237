"""The short exit after a committed checkpoint: files still reach the disk, and it is taken only then.

Each case is a real Python process with a real IPython shell that exits for real: what an exit
does or skips can only be seen from outside the process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

pytest.importorskip("IPython")

PROGRAM = textwrap.dedent(
    """
    import atexit
    import sys
    import textwrap
    from pathlib import Path
    from IPython.core.interactiveshell import InteractiveShell
    from kernelmgr.checkpoint.quick_exit import install

    out = Path(sys.argv[1])
    saved = sys.argv[2] == "saved"
    shell = InteractiveShell.instance()
    # IPython registered its exit work when the shell was made, before any extension loads:
    # counted here, to see that it still runs exactly once.
    operations = shell.atexit_operations
    def counted():
        with open(out / "calls", "a") as calls:
            calls.write("x")
        operations()
    atexit.unregister(operations)
    shell.atexit_operations = counted
    atexit.register(counted)
    install(shell, lambda: saved)  # as the agent does when it loads
    shell.run_cell(textwrap.dedent(f'''
        class Holder:
            def __init__(self, path, marker):
                self.me = self  # a reference cycle: only the garbage collector frees it
                self.marker = marker
                self.file = open(path, "w")  # buffered: nothing written reaches the disk yet
                self.file.write("kept " * 100)
            def __del__(self):
                open(self.marker, "w").write("finalized")
        held = Holder({str(out / "data.txt")!r}, {str(out / "finalized")!r})
        plain = open({str(out / "plain.txt")!r}, "w")
        plain.write("plain " * 10)
        class SaysBye:  # no cycle: freed when IPython clears the namespace at exit
            def __init__(self, target):
                self.target = target
            def __del__(self):
                self.target.write("bye")
        bye = SaysBye(held.file)
    '''))
    """
)


def exit_with(tmp_path: Path, state: str) -> Path:
    out = tmp_path / state
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(out), state], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return out


def test_saved_exit_flushes_files_held_in_cycles_and_skips_their_finalizers(tmp_path: Path) -> None:
    out = exit_with(tmp_path, "saved")
    # Flushed although never collected, with what a finalizer wrote as the namespace was cleared.
    assert (out / "data.txt").read_text() == "kept " * 100 + "bye"
    assert (out / "plain.txt").read_text() == "plain " * 10
    assert not (out / "finalized").exists()  # the final collections were skipped
    assert (out / "calls").read_text() == "x"  # IPython's exit work ran once


def test_exit_with_unsaved_changes_is_the_ordinary_one(tmp_path: Path) -> None:
    out = exit_with(tmp_path, "changed")
    assert (out / "data.txt").read_text() == "kept " * 100 + "bye"
    assert (out / "finalized").read_text() == "finalized"  # the collector finalized the cycle
    assert (out / "calls").read_text() == "x"
