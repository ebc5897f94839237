"""The kernel websocket that makes hibernation invisible to the notebook.

While a kernel is hibernated the notebook's websocket stays open and this connection class
stands in for the kernel:

* requests a frontend sends just by opening a notebook or typing — ``kernel_info``,
  ``complete``, ``inspect``, ``is_complete``, ``history``, ``comm_info`` — are answered here,
  from the kernel_info saved at hibernation, so they never wake a GPU;
* anything that needs the kernel — ``execute_request``, comm messages — is queued, in order,
  and starts a resume; when the kernel answers again the queue is delivered exactly as it
  would have been, so the user's cell simply runs (and the agent shows what was restored);
* while no GPU slice is free the cell shows that it is waiting, and interrupting stops the wait.

Everything else is jupyter_server's own ``ZMQChannelsWebsocketConnection``. The connection
also disables Nagle's algorithm on its socket, so small kernel messages are not held back
~40 ms waiting for an ACK.
"""

from __future__ import annotations

import asyncio
import codeop
import contextlib
import json
import socket
import warnings
from typing import Any

from jupyter_client.jsonutil import json_default
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from kernelmgr.core.lifecycle import KernelState
from kernelmgr.server.hibernation import HibernationError, Hibernator

V1 = "v1.kernel.websocket.jupyter.org"

#: Answered without waking the kernel: a frontend sends these on open and while typing.
ANSWERED_WHILE_HIBERNATED = frozenset(
    {
        "kernel_info_request",
        "complete_request",
        "inspect_request",
        "is_complete_request",
        "history_request",
        "comm_info_request",
    }
)


def is_complete(code: str) -> dict[str, Any]:
    """The ``is_complete_reply`` content for Python source, without a kernel."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = codeop.compile_command(code, symbol="exec")
    except (SyntaxError, ValueError, OverflowError):
        return {"status": "invalid"}
    if compiled is None:
        return {"status": "incomplete", "indent": ""}
    return {"status": "complete"}


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
    if msg_type == "is_complete_request":
        return is_complete(str(content.get("code", "")))
    if msg_type == "history_request":
        return {"status": "ok", "history": []}
    return {"status": "ok", "comms": {}}  # comm_info_request


class ElasticWebsocketConnection(ZMQChannelsWebsocketConnection):
    """jupyter_server's kernel websocket, plus standing in for hibernated kernels."""

    _queue: list[Any]
    _waking: asyncio.Task[None] | None = None
    _last_execute: dict[str, Any] | None = None

    @classmethod
    def notify_kernel(cls, kernel_id: str, text: str) -> int:
        """Show ``text`` in every open notebook of ``kernel_id``; returns how many were reached."""
        reached = 0
        for connection in list(cls._open_sockets):
            if isinstance(connection, ElasticWebsocketConnection) and connection.kernel_id == kernel_id:
                try:
                    connection.notice(text)
                    reached += 1
                except Exception:  # a closing socket must not stop the others
                    continue
        return reached

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

    def _status(self, state: str, parent: dict[str, Any]) -> None:
        self._send("iopub", self.session.msg("status", {"execution_state": state}, parent=parent))

    def _answer(self, channel: str, header: dict[str, Any], content: dict[str, Any]) -> None:
        msg_type = header.get("msg_type", "")
        info = self.hibernator.kernel_info(self.kernel_id) if self.hibernator else {}
        reply = local_reply(msg_type, content, info)
        self._status("busy", header)
        self._send(channel, self.session.msg(msg_type.replace("_request", "_reply"), reply, parent=header))
        self._status("idle", header)

    # -- connection life -------------------------------------------------------------------

    async def prepare(self) -> None:
        # Runs before the websocket handshake: too early for ``_no_delay`` (see ``connect``).
        if not self._asleep():
            await super().prepare()
            return
        await self._register_session()
        self.session.key = self.kernel_manager.session.key

    def connect(self) -> asyncio.Future[None] | None:  # type: ignore[override]
        # Called from the handler's ``open()``: the handshake is done and the stream detached.
        self._no_delay()
        if not self._asleep():
            return super().connect()
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
        queue = self._pending()
        hibernating = self.hibernator is not None and self.hibernator.is_going_to_sleep(self.kernel_id)
        if not queue and not hibernating and not self._asleep():
            self._note_execute(incoming_msg)
            super().handle_incoming_message(incoming_msg)
            return
        channel, header, content = self._parse(incoming_msg)
        if header.get("msg_type") == "execute_request":
            self._last_execute = header
        msg_type = header.get("msg_type", "")
        hibernator = self.hibernator
        state = hibernator.state_of(self.kernel_id) if hibernator else None
        if state is KernelState.HIBERNATED and not queue and msg_type in ANSWERED_WHILE_HIBERNATED:
            self._answer(channel, header, content)
            return
        if msg_type == "interrupt_request":
            cancelled = hibernator.cancel_resume(self.kernel_id) if hibernator else False
            self._send(
                channel,
                self.session.msg(
                    "interrupt_reply", {"status": "ok", "resume_cancelled": cancelled}, parent=header
                ),
            )
            return
        if channel == "stdin":
            return  # nothing is waiting for input in a kernel that is not running
        queue.append(incoming_msg)
        if msg_type == "execute_request":
            self._status("busy", header)
        if self._waking is None or self._waking.done():
            self._waking = asyncio.ensure_future(self._wake(header))

    async def _wake(self, first: dict[str, Any]) -> None:
        hibernator = self.hibernator
        assert hibernator is not None

        def notify(text: str) -> None:
            self._send(
                "iopub", self.session.msg("stream", {"name": "stderr", "text": text + "\n"}, parent=first)
            )

        try:
            await hibernator.resume(self.kernel_id, "execute", notify=notify)
        except (HibernationError, asyncio.CancelledError) as exc:
            self._fail_queue(getattr(exc, "message", "resume cancelled"))
            return
        try:
            if not self.channels:
                self.create_stream()
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
        queued, self._queue = self._pending(), []
        for raw in queued:
            super().handle_incoming_message(raw)

    def _fail_queue(self, reason: str) -> None:
        """Tell every queued execution why it will not run, so no cell hangs."""
        queued, self._queue = self._pending(), []
        for raw in queued:
            channel, header, _content = self._parse(raw)
            if header.get("msg_type") != "execute_request":
                continue
            error = {
                "ename": "KernelNotResumed",
                "evalue": reason,
                "traceback": [f"KernelNotResumed: {reason}"],
            }
            self._send("iopub", self.session.msg("error", error, parent=header))
            self._send(
                channel, self.session.msg("execute_reply", {"status": "error", **error}, parent=header)
            )
            self._status("idle", header)
