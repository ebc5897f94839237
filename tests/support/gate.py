"""Cells that block on the test's say-so instead of for a guessed number of seconds.

A test that needs "a checkpoint still in progress" or "a cell still running" used to make the
kernel sleep N seconds and hope the interesting moment fell inside them; on a loaded machine it
sometimes did not, and the test then passed without testing anything (or failed). A gate makes
the moment explicit: the kernel touches ``started`` when it reaches the gate and waits until the
test creates ``release``. ``limit`` only keeps a forgotten gate from hanging a kernel forever.
"""

from __future__ import annotations

import shlex
from pathlib import Path


class Gate:
    """Two files in a test's directory: one the kernel writes, one the test writes."""

    def __init__(self, directory: Path, name: str = "gate") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.started = directory / f"{name}.started"
        self.release_file = directory / f"{name}.release"
        for path in (self.started, self.release_file):
            path.unlink(missing_ok=True)

    def is_reached(self) -> bool:
        """Whether the kernel got to the gate (a predicate for ``wait_for``)."""
        return self.started.exists()

    def open(self) -> None:
        self.release_file.touch()

    def _wait_source(self, limit: float) -> str:
        return (
            f"    __import__('pathlib').Path({str(self.started)!r}).touch()\n"
            f"    gate_deadline = __import__('time').monotonic() + {limit}\n"
            f"    while not __import__('os').path.exists({str(self.release_file)!r}):\n"
            "        if __import__('time').monotonic() > gate_deadline:\n"
            "            break\n"
            "        __import__('time').sleep(0.02)\n"
        )

    def pickled_object(self, class_name: str = "Gated", limit: float = 120) -> str:
        """Source of a class whose pickling waits at the gate: a checkpoint the test controls."""
        body = self._wait_source(limit).replace("\n    ", "\n        ")
        return (
            f"class {class_name}:\n    def __reduce__(self):\n    {body}        return ({class_name}, ())\n"
        )

    def restored_object(self, class_name: str = "HeldAtRestore", limit: float = 120) -> str:
        """Source of a class whose *unpickling* waits at the gate: a resume the test controls
        (the restoring process is a new one, so the wait runs in a shell it starts)."""
        script = (
            f"touch {shlex.quote(str(self.started))}; end=$(( $(date +%s) + {int(limit)} )); "
            f"while [ ! -e {shlex.quote(str(self.release_file))} ] && [ $(date +%s) -lt $end ]; "
            "do sleep 0.02; done"
        )
        return (
            f"class {class_name}:\n"
            "    def __reduce__(self):\n"
            "        import subprocess\n"
            f'        return (subprocess.run, (["sh", "-c", {script!r}],))\n'
        )

    def cell(self, limit: float = 120) -> str:
        """Source of a cell that runs until the test opens the gate."""
        return "def __gated_cell():\n" + self._wait_source(limit) + "__gated_cell()\n"


def slow_to_load_cell(seconds: float) -> str:
    """A cell binding ``slow``, a variable whose loading takes ``seconds`` (unpickling calls
    ``time.sleep``): a resume a test can cut into (delete the kernel while it restores, let it run
    past a timeout) without a gate, since the restoring process is a new one the test cannot reach.
    Make it long enough that a loaded CI machine still cuts in before the restore ends."""
    return (
        "class SlowToLoad:\n"
        "    def __reduce__(self):\n"
        "        import time\n"
        f"        return (time.sleep, ({seconds},))\n"
        "slow = SlowToLoad()\n"
    )
