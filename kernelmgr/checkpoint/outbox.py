"""In the kernel: what a cell sends while no notebook is attached anywhere, kept for the notebook
that comes back.

A gateway replaced while a cell runs (an upgrade, a lost gateway pod) leaves the kernel with no
subscriber for a while: ZeroMQ drops what the kernel publishes then, and its ``execute_reply`` to a
DEALER that is gone. The gateway's notebook connections subscribe their IOPub sockets to
:data:`CLIENT_TOPIC` as well, a topic no message has, so the kernel's XPUB socket reports the first
notebook to connect and the last one to go (the gateway's own watchers do not subscribe to it).
While none is connected, the IOPub thread keeps each message of an execute request, and the
agent each ``execute_reply``, per notebook session, at most :data:`MAX_BYTES` in all (beyond
that the oldest go, and their cells are named). A notebook that connects again asks for its session's messages
on the control channel (:data:`REQUEST`), which a busy kernel answers at once; they are handed
over once. Messages with binary buffers (widgets) are not kept either (their cells are named).

Not covered: a gateway whose node vanished without closing its connections (the XPUB socket
sees no unsubscription until TCP gives up), and a reply sent in the moment between a notebook's
IOPub subscription and its shell connection.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from typing import Any

#: The topic notebook connections subscribe to besides everything (b""): it marks them.
CLIENT_TOPIC = b"\x00elastic-notebook"
#: The control request a reconnecting notebook's connection sends, and the reply's type.
REQUEST = "elastic_undelivered_request"
REPLY = "elastic_undelivered_reply"
#: What the kernel keeps for absent notebooks, all sessions together.
MAX_BYTES = 16 * 1024 * 1024
#: Where a ZMQ message's routing identities end (jupyter_client's ``Session.DELIM``).
DELIM = b"<IDS|MSG>"

log = logging.getLogger(__name__)


class Outbox:
    """Messages of execute requests sent while no notebook is connected, by session."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._attached = False
        self._kept: deque[tuple[str, dict[str, Any], int]] = deque()  # (session, {channel, msg}, size)
        self._bytes = 0
        #: Per session, the cells (their execute requests' headers, by msg_id) whose messages were not kept.
        self._dropped: dict[str, dict[str, dict[str, Any]]] = {}
        #: The kernel session's own send, before :func:`install` wrapped it.
        self.session_send: Any = None

    @property
    def attached(self) -> bool:
        with self._lock:
            return self._attached

    def subscription(self, frame: bytes) -> None:
        """One XPUB subscription event: ``\\x01`` or ``\\x00``, then the topic."""
        if frame[1:] == CLIENT_TOPIC:
            with self._lock:
                self._attached = frame[:1] == b"\x01"

    def keep_frames(self, frames: list[Any]) -> None:
        """A serialized IOPub message about to be published (on the IOPub thread)."""
        if self.attached:
            return
        parts = [bytes(f) for f in frames]
        try:
            at = parts.index(DELIM)
            header, parent, metadata, content = (json.loads(p) for p in parts[at + 2 : at + 6])
        except (ValueError, IndexError):
            return
        if parent.get("msg_type") != "execute_request":
            return
        msg = {"header": header, "parent_header": parent, "metadata": metadata, "content": content}
        self._keep(str(parent.get("session", "")), "iopub", msg, sum(map(len, parts)), len(parts) > at + 6)

    def keep_reply(self, msg: dict[str, Any]) -> None:
        """An ``execute_reply`` the kernel just sent on shell."""
        if self.attached:
            return
        parent = msg.get("parent_header") or {}
        kept = {k: msg.get(k) for k in ("header", "parent_header", "metadata", "content")}
        size = len(json.dumps(kept, default=str))
        self._keep(str(parent.get("session", "")), "shell", kept, size, bool(msg.get("buffers")))

    def _keep(self, session: str, channel: str, msg: dict[str, Any], size: int, binary: bool) -> None:
        with self._lock:
            if binary or size > self.max_bytes:
                self._lost(session, msg)
                return
            self._kept.append((session, {"channel": channel, "msg": msg}, size))
            self._bytes += size
            while self._bytes > self.max_bytes:
                gone, entry, gone_size = self._kept.popleft()
                self._bytes -= gone_size
                self._lost(gone, entry["msg"])

    def _lost(self, session: str, msg: dict[str, Any]) -> None:
        parent = msg.get("parent_header") or {}
        self._dropped.setdefault(session, {})[str(parent.get("msg_id"))] = parent

    def take(self, session: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The messages kept for ``session``, in order, and the execute requests (headers) of the
        cells some of whose messages were not kept; once."""
        with self._lock:
            mine = [entry for s, entry, _ in self._kept if s == session]
            rest = deque(item for item in self._kept if item[0] != session)
            self._bytes = sum(size for _, _, size in rest)
            self._kept = rest
            return mine, list(self._dropped.pop(session, {}).values())


def install(kernel: Any, outbox: Outbox | None = None) -> Outbox | None:
    """Keep ``kernel``'s (an ipykernel ``Kernel``) undelivered messages and answer :data:`REQUEST`.

    Hooks ipykernel's IOPub thread (its subscription listener and the send it runs every message
    through) and the session's send for replies. Where this ipykernel has no XPUB listener (before
    7) nothing is kept (``None``), and the request is still answered, with nothing, so that a
    connecting notebook does not wait for it.
    """
    handlers = getattr(kernel, "control_handlers", None)
    if not isinstance(handlers, dict):
        return None
    box = _hook(kernel, outbox or Outbox())
    session_send = kernel.session.send if box is None else box.session_send

    def request(stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        asked = str((parent.get("content") or {}).get("session", ""))
        messages, lost = box.take(asked) if box is not None else ([], [])
        session_send(stream, REPLY, {"messages": messages, "lost": lost}, parent, ident)

    handlers[REQUEST] = request
    return box


def _hook(kernel: Any, box: Outbox) -> Outbox | None:
    thread: Any = getattr(kernel, "iopub_thread", None)
    stream = getattr(thread, "_xpub_stream", None)
    if thread is None or stream is None or not hasattr(thread, "_really_send"):
        log.info("undelivered messages are not kept: this ipykernel has no IOPub subscription events")
        return None
    listener = thread._handle_subscription

    def on_subscription(frames: list[Any]) -> None:
        for frame in frames:
            box.subscription(bytes(frame))
        listener(frames)

    # On the IOPub thread, where the listener runs: no event is missed or handled twice.
    thread.schedule(lambda: stream.on_recv(on_subscription))
    really_send = thread._really_send

    def send_kept(msg: list[Any], *args: Any, **kwargs: Any) -> Any:
        box.keep_frames(msg)
        return really_send(msg, *args, **kwargs)

    thread._really_send = send_kept
    session = kernel.session
    box.session_send = session_send = session.send

    def send(stream: Any, msg_or_type: Any, *args: Any, **kwargs: Any) -> Any:
        msg = session_send(stream, msg_or_type, *args, **kwargs)
        if isinstance(msg, dict) and msg.get("msg_type") == "execute_reply":
            box.keep_reply(msg)
        return msg

    session.send = send
    return box
