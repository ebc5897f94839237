"""What runs in a warm process: import the preload modules, then wait to become a kernel.

Started by :class:`kernelmgr.warm.pool.WarmPool` as
``python -m kernelmgr.warm.worker STATUS_FILE [MODULE ...]`` with no slice in its environment
(``CUDA_VISIBLE_DEVICES=""``: a framework that touched the GPU at import would see none). It

1. imports the modules (and what every kernel imports: :data:`KERNEL_MODULES`), touching no GPU;
2. checks that no GPU was touched (:func:`kernelmgr.warm.detect.gpu_touched`) and writes
   ``STATUS_FILE`` (``{"ok": true, ...}``, or ``{"ok": false, "reason": ...}`` and exits 3);
3. waits for one line on stdin: the hand-off, ``{"argv", "env", "cwd"}``, exactly what a cold
   start would have given a new process (the kernel command with the manager's connection file,
   the environment with the slice's variables and the agent's, the notebook's directory).
   End of input (the pool closed, or the server died) exits quietly;
4. checks again, then makes itself what a fresh ``python -m ipykernel_launcher`` would be:
   the environment replaced (``os.environ`` calls ``putenv``, so CUDA reads the new
   ``CUDA_VISIBLE_DEVICES`` when it initialises later), the working directory, ``sys.path[0]``
   and ``sys.argv``; then runs the launcher module as ``__main__``. ipykernel creates its shell
   only now, so the user namespace, history and cell numbering are a fresh kernel's; the
   preloaded modules are only in ``sys.modules``, as after an ``import`` nobody made.

The checkpoint agent loads as an extension of that kernel and reads its owner's key file and
the restore instruction from the environment, as on a cold start. A restore from an object store
starts downloading before ipykernel runs (:mod:`kernelmgr.checkpoint.prefetch`); the agent takes
that download.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time
from typing import Any

from kernelmgr.warm.detect import gpu_touched

#: Exit status of a warm process that cannot be used (preload failed, GPU touched).
UNUSABLE = 3

#: What every elastic kernel imports as it starts, whatever the user preloads: ipykernel's app
#: and kernel, the checkpoint agent (its extension) and the restore's download. Imported while
#: the process waits, they are not imported after the hand-off, where the resume waits for them.
#: Not ipykernel's debugger, though a kernel imports it too (a tenth of a second here): debugpy
#: sets ``PYDEVD_USE_FRAME_EVAL`` in the environment as it is imported, and the hand-off replaces
#: the environment, so the kernel's children would not see it.
KERNEL_MODULES = (
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "kernelmgr.checkpoint.prefetch",
    "kernelmgr.checkpoint.agent",
)


def write_status(path: str, status: dict[str, Any]) -> None:
    """Atomically: the pool polls for the file and must never read half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(status, handle)
    os.replace(tmp, path)


def preload(modules: list[str]) -> str | None:
    """Import ``modules``; the reason it failed, or ``None``."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # SystemExit from a module is a failed preload too
            return f"preload of {name!r} failed: {type(exc).__name__}: {exc}"
    return None


def become_kernel(handoff: dict[str, Any]) -> None:
    """Turn this process into the kernel a cold start would have launched (does not return
    until the kernel exits)."""
    argv = [str(part) for part in handoff["argv"]]
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"not a `python -m MODULE` kernel command: {argv}")
    cwd = str(handoff["cwd"])
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in handoff["env"].items()})
    # ``python -m`` puts the working directory first on sys.path; the rest (site, PYTHONPATH)
    # is the same for both because the pool only hands over kernels with this interpreter and
    # this PYTHONPATH.
    sys.path[0] = os.getcwd()
    # The hand-off pipe is done; a cold kernel's stdin is a pipe nobody writes either.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = [argv[0], *argv[3:]]
    # A resume from an object store starts downloading now, while ipykernel starts; the agent
    # takes that download when it loads (kernelmgr.checkpoint.prefetch).
    from kernelmgr.checkpoint import prefetch

    prefetch.start()
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


def main(args: list[str]) -> int:
    status_file, modules = args[0], args[1:]
    started = time.perf_counter()
    failure = preload([*modules, *KERNEL_MODULES])
    if failure is None:
        touched = gpu_touched()
        if touched:
            failure = f"a GPU was touched while preloading {', '.join(modules) or 'nothing'}: {touched}"
    if failure is not None:
        write_status(status_file, {"ok": False, "reason": failure, "pid": os.getpid()})
        return UNUSABLE
    write_status(
        status_file,
        {"ok": True, "pid": os.getpid(), "seconds": round(time.perf_counter() - started, 3)},
    )
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the pool let us go
    handoff = json.loads(line)
    touched = gpu_touched()
    if touched:  # e.g. a preloaded module's thread initialised CUDA while we waited
        print(f"warm process {os.getpid()}: refusing the hand-off, {touched}", file=sys.stderr, flush=True)
        return UNUSABLE
    become_kernel(handoff)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
