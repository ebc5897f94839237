"""The warm pools of one server: processes started ahead, taken by launches, refilled after.

A warm process (:mod:`kernelmgr.warm.worker`) holds no slice and is no kernel: it is not in the
kernel manager, not in ``/api/kernels``, and the allocator never hears of it. A launch (a
resume, or a new kernel when the pool's ``starts`` says so) takes a ready one and hands it the
launch exactly as a cold start would have got it (:meth:`WarmPools.take`); the pool then refills
in the background, within its memory cap. Whatever cannot be used warm starts cold, with the
reason counted (:attr:`WarmPools.misses`) and logged:

``empty``          no ready process (the pool is filling, or capped by memory)
``preload_failed`` a preload module failed to import: the pool stops refilling
``gpu_touched``    a preload module touched the GPU at import: the pool stops refilling
``not_poolable``   the kernel's command or environment differs from what a warm process can become
``handoff_failed`` the warm process died before or during the hand-off

Processes are ended when the server stops (:meth:`WarmPools.close`); if the server dies, their
stdin pipe closes and they exit on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kernelmgr.warm.settings import WarmPoolSettings

MISS_REASONS = ("empty", "preload_failed", "gpu_touched", "not_poolable", "handoff_failed")
#: How long a warm process may take to import its modules before it is given up.
READY_TIMEOUT = 600.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class WarmProcess:
    popen: subprocess.Popen[bytes]
    status_file: Path
    started: float = field(default_factory=time.monotonic)
    ready: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid


def base_environment(environ: Mapping[str, str], scrubbed: tuple[str, ...]) -> dict[str, str]:
    """The environment warm processes start with: the server's, without any slice or agent
    variable, and with no GPU visible (a framework touching the GPU at import sees none)."""
    env = {k: v for k, v in environ.items() if k not in scrubbed and not k.startswith("ELASTIC_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class WarmPools:
    """One pool of warm processes per configured base kernelspec."""

    def __init__(
        self,
        settings: dict[str, WarmPoolSettings],
        scrubbed: tuple[str, ...] = (),
        log: logging.Logger | None = None,
        python: str = sys.executable,
    ) -> None:
        self.settings = settings
        self.log = log or logging.getLogger(__name__)
        self.python = python
        self.env = base_environment(os.environ, scrubbed)
        self.status_dir = Path(tempfile.mkdtemp(prefix="elastic-warm-"))
        self.processes: dict[str, list[WarmProcess]] = {base: [] for base in settings}
        #: Kernels whose launch took a process and holds its pool's refill back: their pool.
        self._held: dict[str, str] = {}
        #: Why a pool stopped refilling (a preload that fails or touches the GPU would again).
        self.broken: dict[str, tuple[str, str]] = {}
        self.hits: dict[tuple[str, str], int] = {}
        self.misses: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._capped_logged: set[str] = set()
        #: Resident MiB of a ready process, per pool (the largest seen): what a new one will cost.
        self._typical_mib: dict[str, float] = {}

    # -- what the server asks -----------------------------------------------------------

    def settings_for(self, base: str | None) -> WarmPoolSettings | None:
        return self.settings.get(base) if base else None

    def counts(self) -> dict[str, dict[str, int]]:
        """``{base: {"ready": n, "starting": m}}`` (for the metrics)."""
        out: dict[str, dict[str, int]] = {}
        for base, procs in self.processes.items():
            alive = [p for p in procs if p.popen.poll() is None]
            out[base] = {
                "ready": sum(1 for p in alive if p.ready),
                "starting": sum(1 for p in alive if not p.ready),
            }
        return out

    def pids(self) -> list[int]:
        return [p.pid for procs in self.processes.values() for p in procs if p.popen.poll() is None]

    # -- taking ----------------------------------------------------------------------------

    def take(
        self,
        base: str,
        use: str,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        refill_after: str | None = None,
    ) -> tuple[subprocess.Popen[bytes] | None, str]:
        """A warm process now running ``argv`` with ``env`` in ``cwd``, or ``None`` and why not.

        ``use`` is ``resume`` or ``start`` (a label for the counters). Refills in the background
        (needs a running event loop); when a process was handed over for ``refill_after`` (a
        kernel id), only once :meth:`launch_settled` says that kernel's launch is over. Why: a new
        warm process spends a few tenths of a CPU second importing, and a resume's user waits
        for the process just taken, which is downloading and restoring at that moment. On the
        2-core VM of docs/benchmarks.md the refill was 0.26-0.31 of the 2.0 CPU seconds a warm
        resume of 1 GiB took the machine.
        """
        popen: subprocess.Popen[bytes] | None = None
        try:
            popen, reason = self._take(base, argv, env, cwd)
        finally:
            if refill_after is not None and popen is not None:
                self._held[refill_after] = base
            else:
                self.schedule_fill(base)
        if popen is None:
            self.misses[(base, reason)] = self.misses.get((base, reason), 0) + 1
        else:
            self.hits[(base, use)] = self.hits.get((base, use), 0) + 1
        return popen, reason

    def launch_settled(self, kernel_id: str) -> None:
        """``kernel_id``'s launch is over (it answers, or it failed): the pool it took from refills."""
        base = self._held.pop(kernel_id, None)
        if base is not None:
            self.schedule_fill(base)

    def _take(
        self, base: str, argv: list[str], env: Mapping[str, str], cwd: str
    ) -> tuple[subprocess.Popen[bytes] | None, str]:
        if base in self.broken:
            return None, self.broken[base][0]
        if len(argv) < 3 or argv[0] != self.python or argv[1] != "-m":
            self.log.info("warm pool %s: kernel command %s is not `%s -m ...`", base, argv, self.python)
            return None, "not_poolable"
        if env.get("PYTHONPATH", "") != self.env.get("PYTHONPATH", ""):
            self.log.info("warm pool %s: the kernel's PYTHONPATH differs from the pool's: cold start", base)
            return None, "not_poolable"
        line = json.dumps({"argv": argv, "env": dict(env), "cwd": cwd}) + "\n"
        while True:
            warm = self._pop_ready(base)
            if warm is None:
                return None, "empty"
            assert warm.popen.stdin is not None
            try:
                warm.popen.stdin.write(line.encode("utf-8"))
                warm.popen.stdin.close()
            except OSError as exc:
                self.log.warning("warm process %d died before its hand-off (%s)", warm.pid, exc)
                self._kill(warm)
                continue
            with contextlib.suppress(OSError):
                warm.status_file.unlink()
            self.log.info("warm pool %s: handed process %d a kernel", base, warm.pid)
            return warm.popen, ""

    def _pop_ready(self, base: str) -> WarmProcess | None:
        procs = self.processes.get(base, [])
        for warm in list(procs):
            if not warm.ready:
                continue
            procs.remove(warm)
            if warm.popen.poll() is None:
                return warm
            self.log.warning("warm process %d had exited (%s); dropped", warm.pid, warm.popen.returncode)
        return None

    # -- filling ---------------------------------------------------------------------------

    def schedule_fill(self, base: str | None = None) -> None:
        """Refill one pool (or all) in the background, on the server's event loop.

        The first call (the extension's, on the server loop) records that loop. A launch may run
        on another thread's loop (a resume can be driven from a synchronous wrapper): a task
        created there would die with that loop, so the refill is handed to the server's loop.
        """
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if self._loop is None:
            self._loop = current
        if self._loop is None or self._loop.is_closed():
            return
        if current is self._loop:
            self._start_fill_tasks(base)
        else:
            self._loop.call_soon_threadsafe(self._start_fill_tasks, base)

    def _start_fill_tasks(self, base: str | None) -> None:
        assert self._loop is not None
        for name in [base] if base else list(self.settings):
            task = self._loop.create_task(self.fill(name))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def fill(self, base: str) -> None:
        """Start processes until the pool has ``size`` (ready or starting), within the memory cap.

        A starting process's resident memory says nothing yet (it is still importing), so each
        one is counted at what a ready process of this pool used (measured when the first became
        ready); until one has, processes are started one at a time.
        """
        settings = self.settings[base]
        procs = self.processes[base]
        new: list[WarmProcess] = []
        while not self._closed and base not in self.broken:
            procs[:] = [p for p in procs if p.popen.poll() is None]
            if len(procs) >= settings.size:
                break
            each = self._typical_mib.get(base)
            if procs and each is None:
                starting = [p for p in procs if not p.ready]
                await asyncio.gather(*(self._wait_ready(base, warm) for warm in starting))
                if base not in self._typical_mib:
                    break  # none became ready: nothing to measure, do not start more blindly
                continue
            used = sum(resident_mib(p.pid) if p.ready else (each or 0.0) for p in procs)
            if procs and used + (each or 0.0) > settings.memory_mib:
                if base not in self._capped_logged:
                    self._capped_logged.add(base)
                    self.log.warning(
                        "warm pool %s: %d processes use %.0f MiB; another would pass memory_mib=%d",
                        base,
                        len(procs),
                        used,
                        settings.memory_mib,
                    )
                break
            warm = self._spawn(settings)
            procs.append(warm)
            new.append(warm)
        await asyncio.gather(*(self._wait_ready(base, warm) for warm in new if not warm.ready))

    def _spawn(self, settings: WarmPoolSettings) -> WarmProcess:
        status = self.status_dir / f"{settings.base_kernel}-{time.monotonic_ns()}.json"
        popen = subprocess.Popen(
            [self.python, "-m", "kernelmgr.warm.worker", str(status), *settings.preload],
            stdin=subprocess.PIPE,
            env=self.env,
            cwd=self.status_dir,
            start_new_session=True,  # a kernel is launched independent of the server too
        )
        self.log.info(
            "warm pool %s: started process %d (preload: %s)",
            settings.base_kernel,
            popen.pid,
            ", ".join(settings.preload) or "nothing",
        )
        return WarmProcess(popen, status)

    async def _wait_ready(self, base: str, warm: WarmProcess) -> None:
        while not self._closed and not warm.ready:
            if warm.status_file.exists():
                status = json.loads(warm.status_file.read_text(encoding="utf-8"))
                if status.get("ok"):
                    warm.ready = True
                    measured = resident_mib(warm.pid)
                    self._typical_mib[base] = max(self._typical_mib.get(base, 0.0), measured)
                    self.log.info(
                        "warm pool %s: process %d ready (preloaded in %.2f s)",
                        base,
                        warm.pid,
                        status["seconds"],
                    )
                    return
                reason = str(status.get("reason", "unknown"))
                kind = "gpu_touched" if reason.startswith("a GPU was touched") else "preload_failed"
                self.broken[base] = (kind, reason)
                self.log.error("warm pool %s disabled, kernels start cold: %s", base, reason)
                self._kill(warm)
                return
            if warm.popen.poll() is not None:
                code = warm.popen.returncode
                self.log.warning("warm process %d exited with %s before it was ready", warm.pid, code)
                return
            if time.monotonic() - warm.started > READY_TIMEOUT:
                self.log.warning("warm process %d not ready after %.0f s; killed", warm.pid, READY_TIMEOUT)
                self._kill(warm)
                return
            await asyncio.sleep(0.05)

    # -- ending ----------------------------------------------------------------------------

    def _kill(self, warm: WarmProcess) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(warm.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            warm.popen.wait(timeout=5)
        with contextlib.suppress(OSError):
            warm.status_file.unlink()
        for procs in self.processes.values():
            if warm in procs:
                procs.remove(warm)

    def close(self) -> None:
        """Server stop: end every warm process (none was ever handed a kernel) and stop refilling."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for procs in self.processes.values():
            for warm in list(procs):
                self._kill(warm)
        with contextlib.suppress(OSError):
            for leftover in self.status_dir.iterdir():
                leftover.unlink()
            self.status_dir.rmdir()


__all__ = ["MISS_REASONS", "WarmPools", "base_environment", "resident_mib"]
