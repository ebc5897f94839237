"""A shorter interpreter exit for a kernel whose namespace is already in a committed checkpoint.

Why: a hibernation ends with the kernel process exiting, and the slice is released only once it
has. Measured in an elastic kernel (2 cores, numpy and IPython loaded), that exit took 75-95 ms
of the ~100 ms a hibernation spends besides its checkpoint; a plain ipykernel takes 0.1-0.2 s for
the same step. Almost all of it is the garbage collector walking every object: once in
IPython's exit work (its display hook's flush collects) and again, several times, while the
interpreter tears its modules down. ``gc.freeze()`` takes the objects that exist from the
collector's view, and this exit then costs ~45 ms (``docs/benchmarks.md``).

What the exit keeps: every atexit handler (IPython's runs here, so the namespace is cleared the
way it always is and objects only the namespace held are finalized), and every open Python file's
buffer reaches the operating system, including files held by objects in reference cycles: they
are flushed before the freeze and again after IPython's exit work.

What it gives up: ``__del__`` of objects in reference cycles (and weakref callbacks on them)
does not run at this exit. Python never promised that it would; and this exit only happens when
no cell ran since the checkpoint, so whatever those objects held is in the checkpoint and comes
back on resume. Any other exit (a cell ran after the checkpoint, no checkpoint at all) is the
ordinary one.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import logging
from collections.abc import Callable
from typing import Any

#: Buffered file types whose pending bytes an exit must not drop. Concrete C types (``io.IOBase``
#: is an ABC: an ``isinstance`` against it costs 3x more over every live object). Text first:
#: its flush writes into the binary buffer under it.
BUFFERED_FILES: tuple[type, ...] = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)

_log = logging.getLogger(__name__)


def open_files() -> list[Any]:
    """Every open buffered file object alive in this process, text files first.

    Found through the garbage collector's list of tracked objects, which holds every file
    object (they are containers), reachable or not, except those already frozen.
    """
    # ``type()``, not ``isinstance``: the latter reads ``__class__``, which proxies and
    # deprecated module attributes answer with warnings (or work).
    files: list[Any] = [obj for obj in gc.get_objects() if issubclass(type(obj), BUFFERED_FILES)]
    files.sort(key=lambda obj: not isinstance(obj, io.TextIOWrapper))
    return files


def flush(files: list[Any]) -> int:
    """Flush ``files`` (see :func:`open_files`); return how many were open."""
    flushed = 0
    for handle in files:
        with contextlib.suppress(Exception):  # closed, detached, a broken pipe: nothing to keep
            if not handle.closed:
                handle.flush()
                flushed += 1
    return flushed


def finish_saved_exit(shell: Any, log: logging.Logger = _log) -> None:
    """Flush open files, freeze the collector, run IPython's exit work, flush again.

    Called from an atexit handler. IPython's ``atexit_operations`` was registered before the
    agent loaded, so it would run after this handler (atexit is last in, first out): it is
    taken off the list and run here, after the freeze, which spares it a full collection. The
    files found first are held until the end, so what that work writes through them (a
    ``__del__`` run as the namespace is cleared) is flushed too.
    """
    files = open_files()
    flush(files)  # already on disk should the work below hang and the kernel be killed
    gc.freeze()
    operations = getattr(shell, "atexit_operations", None)
    if callable(operations):
        atexit.unregister(operations)
        try:
            operations()
        except Exception:
            log.exception("IPython's exit operations failed")
    flushed = flush(files)
    log.info("exit after a committed checkpoint: %d open files flushed, last collections skipped", flushed)


def checkpoint_and_exit(
    checkpoint: Callable[[], object],
    before_exit: Callable[[], object] | None,
    exit_process: Callable[[int], None],
    log: logging.Logger,
    when: str,
    committed_status: int = 0,
) -> None:
    """Checkpoint, run ``before_exit`` (the flush) whatever happened, exit: ``committed_status``
    when the checkpoint committed (or none was needed), 1 when it failed (the previous checkpoint
    stays committed).

    The end of the kernel's own exits: its server gone (``watchdog``), SIGTERM (``termination``).
    """
    try:
        checkpoint()
        code = committed_status
    except Exception:
        log.exception("the checkpoint %s failed; the previous checkpoint is kept", when)
        code = 1
    if before_exit is not None:
        try:
            before_exit()
        except Exception:
            log.exception("could not flush before exiting")
    exit_process(code)


def install(
    shell: Any, namespace_is_saved: Callable[[], bool], log: logging.Logger = _log
) -> Callable[[], None]:
    """Register the exit hook for ``shell``; return it (to unregister on unload).

    ``namespace_is_saved`` is asked at exit: the short exit is taken only when it says the
    namespace is unchanged since a committed checkpoint.
    """

    def at_exit() -> None:
        try:
            saved = namespace_is_saved()
        except Exception:
            saved = False
        if saved:
            finish_saved_exit(shell, log)

    atexit.register(at_exit)
    return at_exit


__all__ = ["BUFFERED_FILES", "checkpoint_and_exit", "finish_saved_exit", "flush", "install", "open_files"]
