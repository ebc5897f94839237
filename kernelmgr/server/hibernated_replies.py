"""What a hibernated kernel answers without waking: the replies to the requests a frontend sends
on opening a notebook and while typing, and the ``is_complete`` checker process.

Kept apart from the websocket connection (:mod:`kernelmgr.server.websocket`), which decides when
to answer here and when to hold a message for the resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

#: Answered without waking the kernel: a frontend sends these on open and while typing.
ANSWERED_WHILE_HIBERNATED = frozenset(
    {
        "kernel_info_request",
        "complete_request",
        "inspect_request",
        "is_complete_request",
        "history_request",
        "comm_info_request",
        # JupyterLab's debugger asks ``debugInfo`` of every ipykernel a notebook connects to, and
        # its widget manager opens a ``jupyter.widget.control`` comm: a page reload would wake every
        # hibernated kernel whose notebook is open.
        "debug_request",
        "comm_open",
        # A comm does not outlive its kernel's process (none is in a checkpoint), so a message to
        # one finds nothing after a resume either: ipykernel drops it, and so does a hibernated kernel.
        "comm_msg",
        "comm_close",
        # Subshells (protocol 5.5), which JupyterLab asks ipykernel 7 for on connect: none lives in a
        # hibernated kernel; making one waits for a cell to resume it.
        "create_subshell_request",
        "list_subshell_request",
        "delete_subshell_request",
    }
)

#: ipykernel's seed for the cell file names its debugger hashes (``ipykernel.compiler``).
IPYKERNEL_HASH_SEED = 0xC70F6907


#: The checker process (``is_complete`` for Python source, without a kernel): reads one JSON
#: string (the code) per line, writes one JSON status per line.
_CHECKER = """
import codeop, json, sys, warnings
warnings.simplefilter("ignore")
for line in sys.stdin:
    try:
        compiled = codeop.compile_command(json.loads(line), symbol="exec")
        status = "incomplete" if compiled is None else "complete"
    except (SyntaxError, ValueError, OverflowError):
        status = "invalid"
    sys.stdout.write(json.dumps(status) + "\\n")
    sys.stdout.flush()
"""


class CompileChecker:
    """:func:`is_complete`, in a child process the event loop waits for without blocking.

    Compiling user code holds the GIL for as long as it takes (2 MiB: seconds), so neither the
    loop nor a thread may do it. One process per server, started on first use, one check at a
    time; a check that takes longer than ``timeout`` kills it (the next check starts another).
    """

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._lock: asyncio.Lock | None = None
        #: Checks waiting for the process; past :data:`MAX_WAITING` the answer is ``unknown``.
        self.waiting = 0

    async def _started(self) -> asyncio.subprocess.Process:
        process = self._process
        if process is None or process.returncode is not None:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-c",
                _CHECKER,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            self._process = process
        return process

    async def check(self, code: str, timeout: float) -> str:
        """``complete``, ``incomplete``, ``invalid``, or ``unknown`` (too busy, too slow, failed)."""
        if self.waiting >= MAX_WAITING:
            return "unknown"
        if self._lock is None:
            self._lock = asyncio.Lock()
        self.waiting += 1
        try:
            async with self._lock:
                process = await self._started()
                assert process.stdin is not None and process.stdout is not None
                try:
                    process.stdin.write(json.dumps(code).encode() + b"\n")
                    await asyncio.wait_for(process.stdin.drain(), timeout)
                    line = await asyncio.wait_for(process.stdout.readline(), timeout)
                    status = json.loads(line)
                except (OSError, ValueError, asyncio.TimeoutError):
                    status = None
                if status not in ("complete", "incomplete", "invalid"):
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
                    self._process = None
                    return "unknown"
                return str(status)
        finally:
            self.waiting -= 1


#: How many ``is_complete`` checks may wait for the checker process, server-wide.
MAX_WAITING = 16
#: Seconds one check may take before the checker is killed and the answer is ``unknown``.
CHECK_TIMEOUT = 10.0
checker = CompileChecker()


def local_reply(msg_type: str, content: dict[str, Any], kernel_info: dict[str, Any]) -> dict[str, Any]:
    """Reply content for a request answered on behalf of a hibernated kernel."""
    if msg_type == "kernel_info_request":
        return kernel_info or {
            "status": "ok",
            "protocol_version": "5.3",
            "implementation": "ipython",
            "language_info": {"name": "python", "file_extension": ".py", "mimetype": "text/x-python"},
            "banner": "Hibernated kernel (the next cell resumes it)",
        }
    if msg_type == "complete_request":
        cursor = int(content.get("cursor_pos", 0) or 0)
        return {"status": "ok", "matches": [], "cursor_start": cursor, "cursor_end": cursor, "metadata": {}}
    if msg_type == "inspect_request":
        return {"status": "ok", "found": False, "data": {}, "metadata": {}}
    if msg_type == "is_complete_request":  # compiled off the loop: ``_answer_is_complete``
        return {"status": "unknown"}
    if msg_type == "history_request":
        return {"status": "ok", "history": []}
    if msg_type == "debug_request":
        return debug_reply(content)
    if msg_type == "list_subshell_request":
        return {"status": "ok", "subshell_id": []}
    if msg_type in ("create_subshell_request", "delete_subshell_request"):
        why = "the kernel is hibernated: it has no subshells until a cell resumes it"
        return {"status": "error", "ename": "KernelHibernated", "evalue": why, "traceback": []}
    return {"status": "ok", "comms": {}}  # comm_info_request


def debug_reply(request: dict[str, Any]) -> dict[str, Any]:
    """A Debug Adapter Protocol response for a hibernated ipykernel.

    ``debugInfo`` (what a frontend asks on connect) says the debugger is not started, which is
    true: a hibernated kernel has no debugger, and its breakpoints went with the process. Every
    other command is refused the protocol's way (``success: false`` and why), without waking it.
    """
    command = str(request.get("command", ""))
    response: dict[str, Any] = {"type": "response", "request_seq": request.get("seq", 0), "command": command}
    if command == "debugInfo":
        body = {
            "isStarted": False,
            "hashMethod": "Murmur2",
            "hashSeed": IPYKERNEL_HASH_SEED,
            "tmpFilePrefix": "",
            "tmpFileSuffix": ".py",
            "breakpoints": [],
            "stoppedThreads": [],
            "richRendering": True,
            "exceptionPaths": [],
            "copyToGlobals": True,
        }
        return {**response, "success": True, "body": body}
    message = f"the kernel is hibernated: run a cell to resume it, then {command or 'debug'} again"
    return {**response, "success": False, "message": message, "body": {}}
