"""``python -m kernelmgr.checkpoint.launch MODULE [ARG ...]``: start the restore download, then run
``MODULE`` as ``python -m MODULE [ARG ...]`` would.

Why: a kernel started cold to resume from an object store spends about a second importing Python,
ipykernel and the agent before the agent could begin the download. The local provisioner starts
such a kernel through this module instead (:func:`wrap`), so the download
(:mod:`kernelmgr.checkpoint.prefetch`) runs while ipykernel imports and starts; the agent takes it.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Mapping

from kernelmgr.checkpoint.prefetch import ENV_PREFETCH, ENV_RESTORE, ENV_RESTORE_DATA_URL

LAUNCHER = "ipykernel_launcher"


def wrap(cmd: list[str], env: Mapping[str, str]) -> list[str]:
    """``cmd`` through this module when it is this interpreter's ``[flags] -m ipykernel_launcher``
    and ``env`` asks for a restore from an object store; otherwise ``cmd`` unchanged (another
    Python may not have this module: its agent downloads once it has loaded)."""
    if env.get(ENV_RESTORE) != "1" or not env.get(ENV_RESTORE_DATA_URL) or env.get(ENV_PREFETCH) == "0":
        return cmd
    if not cmd or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return cmd
    try:
        at = cmd.index("-m")
    except ValueError:
        return cmd
    if at + 1 >= len(cmd) or cmd[at + 1] != LAUNCHER or not all(flag.startswith("-") for flag in cmd[1:at]):
        return cmd
    return [*cmd[: at + 1], "kernelmgr.checkpoint.launch", *cmd[at + 1 :]]


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m kernelmgr.checkpoint.launch MODULE [ARG ...]")
    from kernelmgr.checkpoint import prefetch

    prefetch.start()
    module = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
