"""What a kernel kept while no notebook was connected to it, fetched for the notebook that connects.

The kernel side is :mod:`kernelmgr.checkpoint.outbox`: a gateway replaced while a cell ran (an
upgrade, a lost gateway pod) left the kernel publishing to no one, and it kept that cell's messages
and reply per notebook session. A connection asks for its session's on the control channel (a busy
kernel answers there at once) with a session of its own, so the kernel's busy/idle status for the
request is not read as the notebook's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_client.session import Session

from kernelmgr.checkpoint.outbox import DELIM, REPLY, REQUEST

#: Seconds a connection waits for the answer (a kernel of an older version never answers).
FETCH_TIMEOUT = 3.0
#: What a cell is told when some of its output could not be kept.
LOST_NOTE = (
    "Some output of this cell is lost: the kernel sent it while no notebook was connected (the "
    "gateway changed), and it was more than the kernel keeps (or binary, as a widget's)."
)


async def fetch(
    km: Any, key: bytes, session_id: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """The messages the kernel of ``km`` kept for ``session_id``, in order, and the execute requests
    (headers) of the cells it could not keep everything of; ``None`` if it did not answer in time."""
    asking = Session(key=key)
    control = km.connect_control()
    got: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()

    def on_reply(raw: list[Any]) -> None:
        if not got.done():
            got.set_result(raw)

    control.on_recv(on_reply)
    try:
        asking.send(control, REQUEST, {"session": session_id})
        raw = await asyncio.wait_for(got, FETCH_TIMEOUT)
    except asyncio.TimeoutError:
        return None
    finally:
        control.close()
    _idents, parts = asking.feed_identities(raw)
    msg = asking.deserialize(parts)
    if msg.get("msg_type") != REPLY:
        return None
    content = msg.get("content") or {}
    return list(content.get("messages") or []), list(content.get("lost") or [])


_REQUEST_BYTES = REQUEST.encode()


def caused_by_fetch(frames: list[Any]) -> bool:
    """Whether an IOPub message (ZMQ frames) answers a :func:`fetch` (the kernel's busy and idle
    for it), by a substring test of its small parent header: no parsing on the message path."""
    try:
        return _REQUEST_BYTES in bytes(frames[frames.index(DELIM) + 3])
    except (ValueError, IndexError, TypeError):
        return False


def msg_id_of(frames: list[Any]) -> str | None:
    """The ``msg_id`` of a message's header (ZMQ frames), ``None`` when it has none to read.

    Parsed only for the few messages that arrive while kept ones are delivered: one sent in the
    instant between a notebook's subscription and the kernel seeing it is both kept and
    delivered live, and must reach the notebook once.
    """
    try:
        at = next(i for i, frame in enumerate(frames) if bytes(frame) == DELIM)
        header = json.loads(bytes(frames[at + 2]))
    except (StopIteration, IndexError, TypeError, ValueError):
        return None
    msg_id = header.get("msg_id") if isinstance(header, dict) else None
    return str(msg_id) if msg_id is not None else None
