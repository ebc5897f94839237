"""The kernel websocket that makes hibernation invisible to the notebook.

While a kernel is hibernated the notebook's websocket stays open and this connection class
stands in for the kernel:

* what a frontend sends just by opening a notebook or typing — ``kernel_info``, ``complete``,
  ``inspect``, ``is_complete``, ``history``, ``comm_info``, the debugger's ``debug_request``,
  subshell requests, the widget manager's comms — is answered here
  (:mod:`kernelmgr.server.hibernated_replies`), from the kernel_info saved at hibernation, so a
  page reload never wakes a GPU; a comm opened here is closed at once (no comm outlives its
  kernel's process, so none is waiting after a resume either);
* anything that needs the kernel — ``execute_request`` above all — is queued, in order,
  and starts a resume; when the kernel answers again the queue is delivered exactly as it
  would have been, so the user's cell simply runs (and the agent shows what was restored);
* while no GPU slice is free the cell shows that it is waiting, and interrupting stops the wait.

What a user sees when messages arrive while the kernel is hibernating, hibernated or resuming
(the connection is *holding* messages for it):

* **The queue is bounded** (``max_queued_messages``, ``max_queued_bytes``): a message that does
  not fit is refused at once, never dropped silently — a cell gets an ``error`` and an
  ``execute_reply`` with ``status: error`` (``KernelQueueFull``) saying why and what to do,
  another request its ``*_reply`` with that error, and a comm message (which has no reply) a
  one-line notice under the notebook's last cell. A client that keeps sending while a resume
  waits for a GPU slice can then not grow the server's memory without limit.
* **An interrupt** (``interrupt_request`` on the control channel) is answered with an
  ``interrupt_reply`` and does what interrupting does in a running kernel: the cells waiting
  for the kernel do not run — each gets an error saying it was cancelled by the interrupt
  (``KeyboardInterrupt``) — on every connection of the kernel; a wait for a GPU slice stops,
  and a resume not started yet (the kernel was still being hibernated) is not started. A
  resume already starting the kernel finishes (stopping it halfway would be slower than
  letting it come back); the kernel then simply runs nothing. Comm messages stay queued.
  (A REST interrupt, ``POST /api/kernels/{id}/interrupt``, reaches the kernel manager; it can
  do the same through :meth:`ElasticWebsocketConnection.interrupt_waiting`.)
* **A stdin reply** (``input_reply``) cannot be delivered: a kernel hibernates only when no
  cell runs, so no cell can be waiting for input, and the process that asked is gone. It is
  not forwarded (it would wake the kernel only to be ignored); the notebook is told, under its
  last cell, that the input was not delivered and why, and the server log says so too.

Bounds, so one user cannot stall or fill the server for everyone:

* what all of one user's connections hold, and what the whole server holds, is bounded too
  (``max_queued_*_per_user``, ``max_queued_*_total``), refused with the same clear error;
* a user opens at most ``max_connections_per_user`` kernel websockets, the server at most
  ``max_connections`` (HTTP 429 at the handshake, saying which setting);
* ``is_complete_request`` for a hibernated kernel is compiled in a separate process (compiling
  holds the GIL, so a thread would not help), one at a time per connection, and not at all for
  code over ``max_is_complete_bytes``: the reply is then ``unknown``, which the protocol allows.

Everything else is jupyter_server's own ``ZMQChannelsWebsocketConnection``. The connection
also disables Nagle's algorithm on its socket, so small kernel messages are not held back
~40 ms waiting for an ACK.

Long because one connection class holds, refuses, answers and delivers a kernel's messages around
a resume, all on its one queue; the replies a hibernated kernel gives are in
:mod:`kernelmgr.server.hibernated_replies`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any, ClassVar

import zmq
from jupyter_client.jsonutil import json_default
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from tornado import web
from traitlets import Enum, Integer, default

from kernelmgr.checkpoint import notes
from kernelmgr.checkpoint.outbox import CLIENT_TOPIC, DELIM
from kernelmgr.cli_render import human_mib, queue_place
from kernelmgr.core.controller import LifecycleError
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.lifecycle.metrics import HELD_MESSAGE_BYTES, HELD_MESSAGE_REFUSALS
from kernelmgr.lifecycle.service import Hibernator
from kernelmgr.server import execution_state, undelivered
from kernelmgr.server.hibernated_replies import ANSWERED_WHILE_HIBERNATED, CHECK_TIMEOUT, checker, local_reply
from kernelmgr.server.memory_budget import (
    connections_per_user,
    held_bytes_per_user,
    server_connections_total,
    server_held_bytes_total,
)
from kernelmgr.server.ownership import SETTINGS_KEY

V1 = "v1.kernel.websocket.jupyter.org"

#: How the state of a kernel that a connection holds messages for reads in a message.
_WAITING_FOR = {
    KernelState.HIBERNATING: "still being hibernated",
    KernelState.HIBERNATED: "hibernated",
    KernelState.RESUMING: "resuming",
}


#: Strong references to answers being computed (a task nobody holds may be collected).
_background: set[asyncio.Future[None]] = set()


#: Cells one connection remembers as sent and not answered (a kernel that dies answers them). A reply
#: missed (the kernel restarted by the user) would otherwise leave its cell here for ever.
MAX_UNANSWERED = 1000


#: Seconds between two updates of a resume's progress in the cell (the first after as long).
RESUME_PROGRESS_INTERVAL = 1.0


#: How the server's waiting note begins (:meth:`Controller._wait_for_slice`): the cell shows it in
#: the resume's display, updated in place with the queue place, not as a new stderr block.
WAITING_NOTE = "Waiting for a GPU slice"


def resume_progress_text(phase: dict[str, Any] | None, profile: str | None = None) -> str:
    """The cell's line for a resume's phase (``/api/elastic/kernels/{id}``'s ``resume``), '' when
    it is over: waiting for a slice (with the place in the queue), starting, reading, loading."""
    if not phase:
        return ""
    if phase.get("phase") == "waiting_for_node":
        return "Resuming the kernel: waiting for the cluster to add a node with a free GPU…"
    if phase.get("phase") == "waiting_for_slice":
        size = f" of size {profile}" if profile else ""
        return (
            f"{WAITING_NOTE}{size} to resume this kernel{queue_place(phase)}. "
            "Interrupt the kernel to stop waiting."
        )
    if phase.get("phase") == "restoring":
        done, total = phase.get("restored_mib") or 0, phase.get("total_mib") or 0
        if total and done >= total:
            return f"Resuming the kernel: loading its variables ({human_mib(total)} read)…"
        return f"Resuming the kernel: reading its variables, {human_mib(done)} of {human_mib(total)}…"
    return "Resuming the kernel: starting it…"


class ElasticWebsocketConnection(ZMQChannelsWebsocketConnection):
    """jupyter_server's kernel websocket, plus standing in for hibernated kernels."""

    max_queued_messages = Integer(
        1000,
        config=True,
        help="""Messages one connection holds for a kernel that is hibernating, hibernated or
        resuming (delivered, in order, once it is back). One more is refused with an error saying
        why, instead of growing the server's memory while a resume waits for a GPU slice.""",
    )
    max_queued_bytes = Integer(
        64 * 1024 * 1024,
        config=True,
        help="""Bytes of messages one connection holds for a kernel that is hibernating, hibernated
        or resuming; a message that would go over is refused with an error saying why.""",
    )

    max_queued_messages_per_user = Integer(
        4000,
        config=True,
        help="""Messages all of one user's connections hold for kernels that are hibernating,
        hibernated or resuming; one more is refused with an error saying why. Users are told
        apart by their login (one user on a single-user server).""",
    )
    max_queued_bytes_per_user = Integer(
        config=True,
        help="""Bytes of messages all of one user's connections hold for kernels that are
        hibernating, hibernated or resuming; a message that would go over is refused. Default:
        128 MiB, and at most half of ``max_queued_bytes_total``.""",
    )
    max_queued_messages_total = Integer(
        40000,
        config=True,
        help="Messages the whole server holds for kernels that are not running (all users).",
    )
    max_queued_bytes_total = Integer(
        config=True,
        help="""Bytes of messages the whole server holds for kernels that are not running (all
        users); a message that would go over is refused with an error saying why. Default: a
        quarter of the server's cgroup memory limit (a pod's), at most 1 GiB, so no mix of users
        can get the server killed for running out of memory.""",
    )

    @default("max_queued_bytes_total")
    def _default_bytes_total(self) -> int:
        return server_held_bytes_total()

    @default("max_queued_bytes_per_user")
    def _default_bytes_per_user(self) -> int:
        return held_bytes_per_user(self.max_queued_bytes_total)

    max_connections_per_user = Integer(
        config=True,
        help="""Kernel websockets one user may have open at once (every notebook tab holds one
        per kernel); one more is refused at the handshake (HTTP 429). Default: 128, and at most a
        quarter of ``max_connections``. 0: no limit.""",
    )
    max_connections = Integer(
        config=True,
        help="""Kernel websockets the server keeps open at once, all users; 0: no limit. Default:
        as many as a quarter of the server's cgroup memory limit pays for (512 KiB each: a 1 GiB pod
        takes 512), at most 10,000.""",
    )

    @default("max_connections")
    def _default_connections(self) -> int:
        return server_connections_total()

    @default("max_connections_per_user")
    def _default_connections_per_user(self) -> int:
        return connections_per_user(self.max_connections)

    max_is_complete_bytes = Integer(
        64 * 1024,
        config=True,
        help="""Largest code an is_complete_request for a hibernated kernel is compiled for (in a
        separate process); larger code is answered 'unknown' without compiling.""",
    )
    notes_in_notebook = Enum(
        ["auto", "always"],
        "auto",
        config=True,
        help="""Where the platform's notes (idle warnings, the restore report after a resume) go.
        'auto': into the notebook (as cell output, which is saved with it) only for front ends that
        do not show them themselves; JupyterLab with this project's extension shows them as
        notifications and gets none in the notebook. 'always': into every notebook too.""",
    )

    #: Held by every connection, per user and in all: ``[messages, bytes]``.
    _held_by_user: ClassVar[dict[str, list[int]]] = {}
    _held_total: ClassVar[list[int]] = [0, 0]
    #: Handshakes that passed the connection limits and are not open yet, per user.
    _opening: ClassVar[dict[str, int]] = {}

    _queue: list[Any]
    _queued_bytes = 0
    _user = ""
    _checking = False
    #: The debugger's first request while hibernated is logged; it asks a dozen times a reload.
    _debugger_logged = False
    _overflow_told = False
    _comm_refused = False
    #: The front end said it shows the platform's notes itself (:mod:`kernelmgr.checkpoint.notes`).
    _notes_shown_by_frontend = False
    _waking: asyncio.Task[None] | None = None
    _last_execute: dict[str, Any] | None = None
    #: While a new connection delivers what the kernel kept for it: the kernel's messages since.
    _holding: list[tuple[Any, list[Any]]] | None = None
    #: Cells sent to the kernel and not answered yet, by msg_id: what a kernel that dies answers.
    _unanswered: dict[str, dict[str, Any]]

    @classmethod
    def notify_kernel(cls, kernel_id: str, text: str, *, idle_warning: bool = False) -> int:
        """Show ``text`` in every open notebook of ``kernel_id``; returns how many were reached
        (an ``idle_warning`` reaches a front end that shows those itself without a cell output)."""
        reached = 0
        for connection in list(cls._open_sockets):
            if isinstance(connection, ElasticWebsocketConnection) and connection.kernel_id == kernel_id:
                try:
                    if not (idle_warning and connection._notes_elsewhere()):
                        connection.notice(text)
                    reached += 1
                except Exception:  # a closing socket must not stop the others
                    continue
        return reached

    @classmethod
    def interrupt_waiting(cls, kernel_id: str, what: str = "waiting to resume") -> int:
        """Cancel the cells every connection of ``kernel_id`` holds for it; returns how many.

        What an interrupt means for cells that have not reached the kernel yet: they do not run.
        """
        cancelled = 0
        for connection in list(cls._open_sockets):
            if isinstance(connection, ElasticWebsocketConnection) and connection.kernel_id == kernel_id:
                try:
                    cancelled += connection._cancel_executes(
                        f"the cell was cancelled by an interrupt before it ran (the kernel was {what}); "
                        "the kernel keeps its variables, run the cell again"
                    )
                except Exception:  # a closing socket must not stop the others
                    continue
        return cancelled

    @classmethod
    def answer_running_cells(cls, kernel_id: str, text: str) -> int:
        """The kernel died: each cell it was running (sent, not answered) gets its error now,
        as a kernel's own (error output, an error reply, idle), saying ``text``. Returns how many."""
        answered = 0
        for connection in list(cls._open_sockets):
            if isinstance(connection, ElasticWebsocketConnection) and connection.kernel_id == kernel_id:
                try:
                    answered += connection._answer_unanswered(text)
                except Exception:  # a closing socket must not stop the others
                    continue
        return answered

    def _answer_unanswered(self, text: str) -> int:
        cells = list(self._running_cells().values())
        self._running_cells().clear()
        for header in cells:
            self._error_reply("shell", header, "KernelDied", text)
        return len(cells)

    def _running_cells(self) -> dict[str, dict[str, Any]]:
        if not hasattr(self, "_unanswered"):
            self._unanswered = {}
        return self._unanswered

    def _notes_elsewhere(self) -> bool:
        """Whether this notebook's front end shows the platform's notes itself, and they are left
        out of its cells' output (``notes_in_notebook``)."""
        return self._notes_shown_by_frontend and self.notes_in_notebook == "auto"

    def notice(self, text: str) -> None:
        """A message from the server, shown under the cell this notebook ran last.

        Sent as stderr output parented to that cell's execute request, which is where
        frontends put late output of a cell; with no cell run yet it goes unparented.
        """
        parent = self._last_execute or {}
        self._send(
            "iopub", self.session.msg("stream", {"name": "stderr", "text": text + "\n"}, parent=parent)
        )

    # -- helpers ---------------------------------------------------------------------------

    @property
    def hibernator(self) -> Hibernator | None:
        return getattr(self.multi_kernel_manager, "hibernator", None)

    def _asleep(self) -> bool:
        hibernator = self.hibernator
        return hibernator is not None and hibernator.is_hibernated(self.kernel_id)

    def _kernel_address(self) -> tuple[Any, ...]:
        km = self.kernel_manager
        return (km.ip, km.shell_port, km.iopub_port, km.stdin_port, km.control_port)

    def create_stream(self) -> None:
        super().create_stream()
        self._attached_to = self._kernel_address()
        # Marks this subscription as a notebook's (no message has the topic): while none is
        # subscribed, the kernel keeps what its cells send (:mod:`kernelmgr.checkpoint.outbox`).
        self.channels["iopub"].socket.setsockopt(zmq.SUBSCRIBE, CLIENT_TOPIC)

    def _stale(self) -> bool:
        """The channels point where the kernel no longer is: a kernel pod resumed elsewhere (new IP).

        A local kernel resumes on its old ports and ZMQ reconnects by itself; a pod gets a new
        address, and channels opened before the hibernation must be opened again.
        """
        attached = getattr(self, "_attached_to", None)
        return bool(self.channels) and attached is not None and attached != self._kernel_address()

    def _close_streams(self) -> None:
        for stream in self.channels.values():
            if not stream.closed():
                stream.on_recv(None)
                stream.close()
        self.channels = {}

    def _pending(self) -> list[Any]:
        if not hasattr(self, "_queue"):
            self._queue = []
        return self._queue

    def _no_delay(self) -> None:
        """Turn Nagle's algorithm off on the websocket's TCP socket.

        A cell's reply is several small frames (status, reply, status); with Nagle on, each
        one after the first waits for the client's delayed ACK (~40 ms on Linux). Tornado
        does not do this for websockets: its HTTP layer turns Nagle back *on* when it
        finishes the 101 handshake response. So this must run after the handshake, on the
        stream the websocket detached; before it (``prepare()``) there is no such stream.
        """
        stream = getattr(getattr(self.websocket_handler, "ws_connection", None), "stream", None)
        sock = getattr(stream, "socket", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _parse(self, ws_msg: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """(channel, header, content) of an incoming websocket message, either protocol."""
        if self.subprotocol == V1:
            channel, msg_list = deserialize_msg_from_ws_v1(ws_msg)
            header = self.session.unpack(msg_list[0])
            content = self.session.unpack(msg_list[3]) if len(msg_list) > 3 else {}
            return channel or "shell", header, content
        msg = json.loads(ws_msg) if isinstance(ws_msg, str | bytes) else ws_msg
        return msg.get("channel") or "shell", msg.get("header") or {}, msg.get("content") or {}

    def _send(self, channel: str, msg: dict[str, Any]) -> None:
        if self.subprotocol == V1:
            self.write_message(serialize_msg_to_ws_v1(msg, channel, self.session.pack), binary=True)
        else:
            msg["channel"] = channel
            self.write_message(json.dumps(msg, default=json_default))

    def _note_execute(self, incoming_msg: Any) -> None:
        """Remember this notebook's latest execute request (where warnings are shown).

        A substring test first, so the common case costs no parsing on the message path.
        """
        marker: str | bytes = '"execute_request"' if isinstance(incoming_msg, str) else b'"execute_request"'
        if marker in incoming_msg:
            header = self._parse(incoming_msg)[1]
            if header.get("msg_type") == "execute_request":
                self._last_execute = header
                running = self._running_cells()
                if len(running) >= MAX_UNANSWERED:  # answered cells whose reply this one missed
                    running.pop(next(iter(running)))
                running[str(header.get("msg_id"))] = header

    async def _deliver_undelivered(self, connected: asyncio.Future[None]) -> None:
        """Once subscribed: what the kernel sent for this notebook while none was connected (a
        gateway replaced while a cell ran), in order, then what it sends from now on."""
        delivered: set[str] = set()
        try:
            await connected
            kept = await undelivered.fetch(self.kernel_manager, self.session.key, self.session.session)
            if kept is None:
                self.log.info("Kernel %s kept no undelivered messages (it did not answer)", self.kernel_id)
            else:
                messages, lost = kept
                delivered = self._deliver_kept(messages, {str(p.get("msg_id")): p for p in lost})
        finally:
            held, self._holding = self._holding or [], None
            for stream, frames in held:
                # Kept in the instant before the kernel saw this notebook subscribe, yet delivered
                # live too: once is enough.
                if not (delivered and undelivered.msg_id_of(frames) in delivered):
                    self.handle_outgoing_message(stream, frames)

    def _deliver_kept(self, messages: list[dict[str, Any]], lost: dict[str, dict[str, Any]]) -> set[str]:
        """Send what the kernel kept, in order; a cell some of whose output could not be kept is
        told so under its output, before its idle status (where a notebook still shows it).
        Returns the ids of the messages sent."""
        sent: set[str] = set()
        for item in messages:
            msg = dict(item.get("msg") or {})
            header = msg.get("header") or {}
            sent.add(str(header.get("msg_id")))
            parent_id = str((msg.get("parent_header") or {}).get("msg_id"))
            if header.get("msg_type") == "status" and parent_id in lost:
                self._tell_lost(lost.pop(parent_id))
            msg.update(msg_id=header.get("msg_id"), msg_type=header.get("msg_type"), buffers=[])
            self._send(str(item.get("channel", "iopub")), msg)
        for parent in lost.values():
            self._tell_lost(parent)
        if messages:
            self.log.info("Kernel %s: %d undelivered message(s) delivered", self.kernel_id, len(messages))
        return sent

    def _tell_lost(self, parent: dict[str, Any]) -> None:
        stderr = {"name": "stderr", "text": undelivered.LOST_NOTE + "\n"}
        self._send("iopub", self.session.msg("stream", stderr, parent=parent))

    def handle_outgoing_message(self, stream: Any, outgoing_msg: list[Any]) -> None:
        if self._holding is not None:
            self._holding.append((stream, outgoing_msg))
            return
        channel = getattr(stream, "channel", None)
        running = getattr(self, "_unanswered", None)
        if running and channel == "shell":
            # A shell reply: its parent's msg_id (a few bytes of JSON) ends that cell's wait.
            with contextlib.suppress(ValueError, IndexError, TypeError):
                parent = json.loads(bytes(outgoing_msg[outgoing_msg.index(DELIM) + 3]))
                running.pop(str(parent.get("msg_id")), None)
        elif channel == "iopub" and undelivered.caused_by_fetch(outgoing_msg):
            return  # the busy/idle of a connection's own request: not the notebook's kernel status
        elif channel == "iopub" and self._notes_elsewhere() and notes.is_note(outgoing_msg):
            return  # shown as a notification by this front end, not saved into the notebook
        super().handle_outgoing_message(stream, outgoing_msg)

    def _status(self, state: str, parent: dict[str, Any]) -> None:
        self._send("iopub", self.session.msg("status", {"execution_state": state}, parent=parent))

    def _hold(self, raw: Any) -> None:
        size = len(raw) if isinstance(raw, str | bytes) else 0
        self._pending().append(raw)
        self._queued_bytes += size
        self._count_held(1, size)

    def _count_held(self, messages: int, size: int) -> None:
        """Add to (or, negative, take from) what this user's connections and the server hold."""
        mine = self._held_by_user.setdefault(self._user, [0, 0])
        for counts in (mine, self._held_total):
            counts[0] += messages
            counts[1] += size
        if mine == [0, 0]:
            del self._held_by_user[self._user]

    def _take_queue(self) -> list[Any]:
        """Empty the queue (to deliver or fail it); returns what it held."""
        queued, self._queue = self._pending(), []
        if queued:
            self._count_held(-len(queued), -self._queued_bytes)
        self._queued_bytes = 0
        self._overflow_told = self._comm_refused = False
        return queued

    def _overflows(self, raw: Any) -> str:
        """Why ``raw`` does not fit in the queue, or "" if it does (counted by the cap it hits)."""
        why, limit = self._cap_hit(len(raw) if isinstance(raw, str | bytes) else 0)
        if why:
            HELD_MESSAGE_REFUSALS.labels(limit).inc()
        return why

    def _cap_hit(self, size: int) -> tuple[str, str]:
        """Why a message of ``size`` bytes would go over a cap, and whose cap; ("", "") if none."""
        why = self._connection_cap(size)
        if why:
            return why, "connection"
        why = self._user_cap(size)
        if why:
            return why, "user"
        return self._server_cap(size), "server"

    def _connection_cap(self, size: int) -> str:
        if len(self._pending()) >= self.max_queued_messages:
            return (
                f"{len(self._pending())} messages already wait for it "
                f"(ElasticWebsocketConnection.max_queued_messages is {self.max_queued_messages})"
            )
        if self._queued_bytes + size > self.max_queued_bytes:
            return (
                f"the messages waiting for it would take {self._queued_bytes + size} bytes "
                f"(ElasticWebsocketConnection.max_queued_bytes is {self.max_queued_bytes})"
            )
        return ""

    def _user_cap(self, size: int) -> str:
        messages, held = self._held_by_user.get(self._user, [0, 0])
        if messages >= self.max_queued_messages_per_user:
            return (
                f"your connections already hold {messages} messages for kernels that are not running "
                f"(ElasticWebsocketConnection.max_queued_messages_per_user is "
                f"{self.max_queued_messages_per_user})"
            )
        if held + size > self.max_queued_bytes_per_user:
            return (
                f"your connections would hold {held + size} bytes for kernels that are not running "
                f"(ElasticWebsocketConnection.max_queued_bytes_per_user is {self.max_queued_bytes_per_user})"
            )
        return ""

    def _server_cap(self, size: int) -> str:
        messages, held = self._held_total
        if messages >= self.max_queued_messages_total:
            return (
                f"the server already holds {messages} messages for kernels that are not running "
                f"(ElasticWebsocketConnection.max_queued_messages_total is {self.max_queued_messages_total})"
            )
        if held + size > self.max_queued_bytes_total:
            return (
                f"the server would hold {held + size} bytes for kernels that are not running "
                f"(ElasticWebsocketConnection.max_queued_bytes_total is {self.max_queued_bytes_total})"
            )
        return ""

    def _error_reply(self, channel: str, header: dict[str, Any], ename: str, evalue: str) -> None:
        """Answer a request with an error, as the kernel would: error, reply, idle."""
        msg_type = header.get("msg_type", "")
        error = {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}
        if msg_type == "execute_request":
            self._send("iopub", self.session.msg("error", error, parent=header))
        reply_type = msg_type[: -len("_request")] + "_reply"
        self._send(channel, self.session.msg(reply_type, {"status": "error", **error}, parent=header))
        self._status("idle", header)

    def _refuse(self, channel: str, header: dict[str, Any], why: str, state: KernelState | None) -> None:
        """A message the full queue cannot take: tell the client, never drop it silently."""
        msg_type = header.get("msg_type", "")
        what = _WAITING_FOR.get(state, "resuming") if state is not None else "resuming"
        text = (
            f"not sent to the kernel: it is {what} and {why}. Wait until it is back (the cells "
            "already sent run first), then run this again"
        )
        if not self._overflow_told:
            self._overflow_told = True
            self.log.warning("Kernel %s: %s refused: %s", self.kernel_id, msg_type, text)
        if msg_type.endswith("_request"):
            self._status("busy", header)
            self._error_reply(channel, header, "KernelQueueFull", text)
        elif not self._comm_refused:  # comm messages have no reply: one notice per full queue
            self._comm_refused = True
            self.notice(f"A {msg_type} message (e.g. from a widget) was {text}.")

    def _interrupt(self, channel: str, header: dict[str, Any], state: KernelState | None) -> None:
        """An interrupt while messages are held: stop waiting, cancel the held cells, reply."""
        hibernator = self.hibernator
        resume_cancelled = hibernator.cancel_resume(self.kernel_id) if hibernator else False
        what = _WAITING_FOR.get(state, "resuming") if state is not None else "resuming"
        cancelled = self.interrupt_waiting(self.kernel_id, what)
        waking = self._waking
        if state is KernelState.HIBERNATING and not self._pending() and waking is not None:
            # The wake only waits for the hibernation to finish: nothing needs the kernel now.
            waking.cancel()
        self._send(
            channel,
            self.session.msg(
                "interrupt_reply",
                {"status": "ok", "resume_cancelled": resume_cancelled, "cells_cancelled": cancelled},
                parent=header,
            ),
        )

    def _notes_request(self, raw: Any) -> bool:
        """Whether ``raw`` is the front end's :data:`notes.SHOWN_BY_FRONTEND` (parsed only when its
        name is in it: every other message costs a substring search)."""
        name = notes.SHOWN_BY_FRONTEND
        if isinstance(raw, bytes):
            raw_name: str | bytes = name.encode()
        elif isinstance(raw, str):
            raw_name = name
        else:
            return False
        if raw_name not in raw:
            return False
        try:
            return self._parse(raw)[1].get("msg_type") == name
        except Exception:  # not a message: jupyter_server's own handling says what is wrong with it
            return False

    def _stale_stdin(self, msg_type: str, state: KernelState | None) -> None:
        """A stdin reply for a kernel that cannot be waiting for input: say so, do not forward it."""
        what = _WAITING_FOR.get(state, "resuming") if state is not None else "resuming"
        text = (
            f"Your input ({msg_type}) was not delivered: the kernel is {what}, and a kernel hibernates "
            "only when no cell is running, so no cell is waiting for input any more. Run the cell again."
        )
        self.log.warning("Kernel %s: %s", self.kernel_id, text)
        self.notice(text)

    def _answer(self, channel: str, header: dict[str, Any], content: dict[str, Any]) -> None:
        msg_type = header.get("msg_type", "")
        if msg_type == "is_complete_request":
            self._status("busy", header)
            task = asyncio.ensure_future(self._answer_is_complete(channel, header, content.get("code")))
            _background.add(task)
            task.add_done_callback(_background.discard)
            return
        if msg_type in ("comm_open", "comm_msg", "comm_close"):  # no reply to these in the protocol
            self._status("busy", header)
            if msg_type == "comm_open":
                # No comm target lives in a hibernated kernel: closed at once, as ipykernel closes a
                # comm whose target it does not know (the widget manager then asks comm_info instead).
                closed = {"comm_id": content.get("comm_id", ""), "data": {}}
                self._send("iopub", self.session.msg("comm_close", closed, parent=header))
            self._status("idle", header)
            return
        info = self.hibernator.kernel_info(self.kernel_id) if self.hibernator else {}
        reply = local_reply(msg_type, content, info)
        if msg_type == "debug_request" and not self._debugger_logged:  # a frontend's own: stays asleep
            self._debugger_logged = True
            command = content.get("command")
            self.log.info("Hibernated kernel %s answered %s without waking", self.kernel_id, command)
        self._status("busy", header)
        self._send(channel, self.session.msg(msg_type.replace("_request", "_reply"), reply, parent=header))
        self._status("idle", header)

    async def _answer_is_complete(self, channel: str, header: dict[str, Any], code: Any) -> None:
        """Off the event loop: compiled in the checker process (one at a time per connection),
        or ``unknown`` without compiling (too large, one already running here, checker busy)."""
        status = "unknown"
        if isinstance(code, str) and not self._checking and len(code) <= self.max_is_complete_bytes:
            self._checking = True
            try:
                status = await checker.check(code, CHECK_TIMEOUT)
            finally:
                self._checking = False
        reply: dict[str, Any] = {"status": status}
        if status == "incomplete":
            reply["indent"] = ""
        with contextlib.suppress(Exception):  # the socket may have closed meanwhile
            self._send(channel, self.session.msg("is_complete_reply", reply, parent=header))
            self._status("idle", header)

    # -- connection life -------------------------------------------------------------------

    def _user_name(self) -> str:
        """Whose connection this is, for the per-user limits: the login on a multi-user gateway
        (an access rule is installed), else one user (token logins are anonymous per request)."""
        if (getattr(self.websocket_handler, "settings", None) or {}).get(SETTINGS_KEY) is None:
            return ""
        user = getattr(self.websocket_handler, "current_user", None)
        name = getattr(user, "username", None) or getattr(user, "name", None)
        return str(name if name is not None else user or "")

    def _check_connection_limits(self) -> None:
        """HTTP 429 at the handshake when this user, or the server, has as many open as allowed."""
        mine = self._opening.get(self._user, 0)
        everyone = sum(self._opening.values())
        for connection in self._open_sockets:
            if isinstance(connection, ElasticWebsocketConnection):
                everyone += 1
                mine += connection._user == self._user
        if self.max_connections_per_user and mine >= self.max_connections_per_user:
            raise web.HTTPError(
                429,
                reason=f"too many kernel connections open for {self._user or 'this server'} ({mine}; "
                f"ElasticWebsocketConnection.max_connections_per_user is {self.max_connections_per_user}): "
                "close some notebooks",
            )
        if self.max_connections and everyone >= self.max_connections:
            raise web.HTTPError(
                429,
                reason=f"the server has {everyone} kernel connections open "
                f"(ElasticWebsocketConnection.max_connections is {self.max_connections}): try again later",
            )

    async def prepare(self) -> None:
        # Runs before the websocket handshake: too early for ``_no_delay`` (see ``connect``).
        self._user = self._user_name()
        self._check_connection_limits()
        self._opening[self._user] = self._opening.get(self._user, 0) + 1
        try:
            if not self._asleep():
                await super().prepare()
                return
            await self._register_session()
            self.session.key = self.kernel_manager.session.key
        finally:
            # Counted from here on by ``_open_sockets`` (or never opened).
            left = self._opening.get(self._user, 1) - 1
            if left > 0:
                self._opening[self._user] = left
            else:
                self._opening.pop(self._user, None)

    def connect(self) -> asyncio.Future[None] | None:  # type: ignore[override]
        # Called from the handler's ``open()``: the handshake is done and the stream detached.
        self._no_delay()
        if not self._asleep():
            self._holding = []  # what the kernel sends now waits behind what it kept for this notebook
            connected = super().connect()
            if connected is None:
                self._holding = None
                return None
            return asyncio.ensure_future(self._deliver_undelivered(connected))
        # No process to talk to: streams are created when the kernel is back.
        self.multi_kernel_manager.notify_connect(self.kernel_id)
        ZMQChannelsWebsocketConnection._open_sockets.add(self)
        done: asyncio.Future[None] = asyncio.get_event_loop().create_future()
        done.set_result(None)
        return done

    def disconnect(self) -> None:  # type: ignore[override]
        if not self.channels:
            self.multi_kernel_manager.notify_disconnect(self.kernel_id)
            if self._open_sessions.get(self.session_key) is self.websocket_handler:
                self._open_sessions.pop(self.session_key)
            ZMQChannelsWebsocketConnection._open_sockets.discard(self)
            if not self._close_future.done():
                self._close_future.set_result(None)
            return
        super().disconnect()

    # -- messages --------------------------------------------------------------------------

    def handle_incoming_message(self, incoming_msg: Any) -> None:
        if self._notes_request(incoming_msg):
            self._notes_shown_by_frontend = True
            self.log.debug("Kernel %s: this notebook's front end shows the platform's notes", self.kernel_id)
            return
        runtime = getattr(self.multi_kernel_manager, "elastic_runtime", None)
        leader = runtime.leader if runtime is not None else None
        if leader is not None and not leader.holds():
            # A fenced gateway (lost its Lease) sends nothing to a kernel the new leader serves:
            # the notebook reconnects through the Service, to the leader. 1012: service restart.
            self.websocket_handler.close(1012, "this gateway lost its Lease; reconnect")
            return
        queue = self._pending()
        hibernating = self.hibernator is not None and self.hibernator.is_going_to_sleep(self.kernel_id)
        waking = self._waking is not None and not self._waking.done()
        if not queue and not hibernating and not self._asleep():
            if self.channels and not self._stale() and not waking:
                self._note_execute(incoming_msg)
                super().handle_incoming_message(incoming_msg)
                return
            # Awake, but this connection is not attached to the process: it was opened while the
            # kernel was hibernated (resumed since by the API, the GPUs panel or another tab), or
            # the kernel resumed into a new pod elsewhere. Attach, then deliver.
            self._hold(incoming_msg)
            if self._waking is None or self._waking.done():
                self._waking = asyncio.ensure_future(self._wake(self._parse(incoming_msg)[1]))
            return
        channel, header, content = self._parse(incoming_msg)
        if header.get("msg_type") == "execute_request":
            self._last_execute = header
        msg_type = header.get("msg_type", "")
        hibernator = self.hibernator
        state = hibernator.state_of(self.kernel_id) if hibernator else None
        # Also the requests that come while it is being hibernated: held, the debugger's debugInfo
        # (sent on its own when a notebook connects) woke the kernel as soon as it was asleep.
        # Comm messages then wait: if the hibernation fails, the kernel and its comms live on.
        asleep = state is KernelState.HIBERNATED or (
            state is KernelState.HIBERNATING and msg_type.endswith("_request")
        )
        if asleep and not queue and msg_type in ANSWERED_WHILE_HIBERNATED:
            self._answer(channel, header, content)
            return
        if msg_type == "interrupt_request":
            self._interrupt(channel, header, state)
            return
        if channel == "stdin":
            self._stale_stdin(msg_type, state)
            return
        why = self._overflows(incoming_msg)
        if why:
            self._refuse(channel, header, why, state)
            return
        self._hold(incoming_msg)
        if msg_type == "execute_request":
            self._status("busy", header)
        if self._waking is None or self._waking.done():
            if state is not None:  # what woke it, for an admin's "why did it resume?"
                what = (self.kernel_id, state.value, msg_type, channel)
                self.log.info("Kernel %s (%s) woken by a %s on %s", *what)
            self._waking = asyncio.ensure_future(self._wake(header))

    async def _wake(self, first: dict[str, Any]) -> None:
        hibernator = self.hibernator
        assert hibernator is not None
        shown: list[str] = []  # what the cell was told while it waited (the display's texts too)

        def notify(text: str) -> None:
            if text.startswith(WAITING_NOTE):  # the first word of the resume's display in the cell
                self._show_in_place(first, shown, text)
                return
            shown.append(text)
            self._send(
                "iopub", self.session.msg("stream", {"name": "stderr", "text": text + "\n"}, parent=first)
            )

        progress = asyncio.ensure_future(self._show_resume_progress(first, shown))
        try:
            await hibernator.resume(self.kernel_id, "execute", notify=notify)
        except (LifecycleError, asyncio.CancelledError) as exc:
            self._fail_queue(getattr(exc, "message", "resume cancelled"))
            return
        finally:
            progress.cancel()
        if shown:
            # The waiting note and the progress were for the wait: the cell keeps only its own
            # output (and the restore report), also in the saved notebook.
            self._send("iopub", self.session.msg("clear_output", {"wait": False}, parent=first))
        await self._attach_and_deliver()

    async def _show_resume_progress(self, first: dict[str, Any], shown: list[str]) -> None:
        """In the cell that woke the kernel: where the resume is (waiting for a slice with its
        place in the queue, starting, N of M MiB read, loading the variables), one display
        updated in place every second, from the first second on (a quick resume shows nothing).
        Cleared when the resume is over."""
        while True:
            await asyncio.sleep(RESUME_PROGRESS_INTERVAL)
            try:
                model = self.multi_kernel_manager.elastic_model(self.kernel_id)
            except Exception:  # the kernel went away; the resume's own error says why
                return
            text = resume_progress_text(model.get("resume"), model.get("profile"))
            if text:
                self._show_in_place(first, shown, text)

    def _show_in_place(self, first: dict[str, Any], shown: list[str], text: str) -> None:
        """The resume's one display in the cell: shown once, then updated (``shown`` holds its texts)."""
        if shown and shown[-1] == text:
            return
        kind = "update_display_data" if self._display_shown(shown) else "display_data"
        display_id = f"elastic-resume-{self.kernel_id}"
        content = {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": display_id}}
        self._send("iopub", self.session.msg(kind, content, parent=first))
        shown.append(text)

    @staticmethod
    def _display_shown(shown: list[str]) -> bool:
        return any(t.startswith((WAITING_NOTE, "Resuming the kernel")) for t in shown)

    @classmethod
    def attach_all(cls, kernel_id: str) -> int:
        """After a resume: attach every open notebook of ``kernel_id`` that is not attached to
        the new process (opened while the kernel slept, or attached to the pod it left), so it
        sees the kernel's status and output now, not only after its next message. Returns how
        many were started. A notebook already waking (its cell started the resume) does its own.
        """
        started = 0
        for connection in list(cls._open_sockets):
            if not isinstance(connection, ElasticWebsocketConnection) or connection.kernel_id != kernel_id:
                continue
            if connection.channels and not connection._stale():
                continue
            if connection._waking is not None and not connection._waking.done():
                continue
            connection._waking = asyncio.ensure_future(connection._attach_if_awake())
            started += 1
        return started

    async def _attach_if_awake(self) -> None:
        """:meth:`attach_all`'s task: nothing if the kernel went back to sleep meanwhile (a
        message held since then starts a resume, as a first message would)."""
        hibernator = self.hibernator
        if hibernator is not None and (self._asleep() or hibernator.is_going_to_sleep(self.kernel_id)):
            held = self._pending()
            if held:
                self._waking = asyncio.ensure_future(self._wake(self._parse(held[0])[1]))
            return
        await self._attach_and_deliver()

    async def _attach_and_deliver(self) -> None:
        """Attach this connection's channels to the running kernel, then send what it held."""
        try:
            attached = bool(self.channels)
            if self._stale():
                self._close_streams()
            if not self.channels:
                self.create_stream()
            if not attached:
                self.multi_kernel_manager.add_restart_callback(self.kernel_id, self.on_kernel_restarted)
                self.multi_kernel_manager.add_restart_callback(self.kernel_id, self.on_restart_failed, "dead")
            await self.nudge()
            for stream in self.channels.values():
                stream.on_recv_stream(self.handle_outgoing_message)
        except Exception as exc:
            self.log.error("Could not reattach websocket to resumed kernel %s: %s", self.kernel_id, exc)
            self._fail_queue(
                f"the kernel resumed but this connection could not reattach ({exc}); reload the page"
            )
            return
        for raw in self._take_queue():
            self._note_execute(raw)
            super().handle_incoming_message(raw)

    def nudge(self) -> asyncio.Future[None]:
        """jupyter_server's nudge, which also runs for a kernel the server calls busy.

        The nudge is what proves that this connection's IOPub subscription reaches the process
        (ZMQ drops what a kernel publishes before a subscriber is connected). Stock jupyter_server
        skips it for a busy kernel, and a busy kernel is exactly what a notebook reconnects to
        after a gateway change (an upgrade, a lost pod) with its cell running: what the cell
        printed next went to no one. Right after a resume the kernel often reads busy too (the
        server's own wake-up request has been answered, its idle status is on the way). The nudge
        asks on the control channel as well, which a busy ipykernel answers at once.
        """
        km = self.kernel_manager
        if getattr(km, "execution_state", None) != "busy":
            return super().nudge()
        with execution_state.reading_idle(km):  # only for the check at the top of nudge(): no await
            return super().nudge()

    def request_kernel_info(self) -> Any:
        """The handshake's kernel_info, asked on the control channel.

        jupyter_server asks on shell, which a busy kernel answers only after its running cell: a
        notebook reconnecting to a gateway that has just adopted the kernel (no kernel_info cached
        yet) waited for the whole cell, an hour for an hour's training, and its output went to
        no one meanwhile. ipykernel answers kernel_info on control at once, busy or not.
        """
        if self.kernel_info_channel is None and not hasattr(self.kernel_manager, "_kernel_info_future"):
            self.kernel_info_channel = self.multi_kernel_manager.connect_control(self.kernel_id)
        return super().request_kernel_info()

    def _fail_queue(self, reason: str) -> None:
        """Tell every queued execution why it will not run, so no cell hangs."""
        for raw in self._take_queue():
            channel, header, _content = self._parse(raw)
            if header.get("msg_type") == "execute_request":
                self._error_reply(channel, header, "KernelNotResumed", reason)

    def _cancel_executes(self, reason: str) -> int:
        """Fail the queued cells (an interrupt), keeping other queued messages; returns how many."""
        kept: list[Any] = []
        cancelled = 0
        for raw in self._take_queue():
            channel, header, _content = self._parse(raw)
            if header.get("msg_type") == "execute_request":
                self._error_reply(channel, header, "KeyboardInterrupt", reason)
                cancelled += 1
            else:
                kept.append(raw)
        for raw in kept:
            self._hold(raw)
        return cancelled


HELD_MESSAGE_BYTES.set_function(lambda: ElasticWebsocketConnection._held_total[1])
