"""The kernel's keeping of what its cells send while no notebook is connected (``checkpoint/outbox.py``).

The end-to-end case (a gateway replaced while a cell runs) is in ``tests/test_kube_server.py``;
here the rules: kept only while no notebook's subscription is there, per session, in order, handed
over once, bounded (the oldest dropped, their cells named), binary messages not kept (their cells named).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kernelmgr.checkpoint.outbox import CLIENT_TOPIC, DELIM, Outbox

pytestmark = pytest.mark.pure


def frames(session: str, text: str, parent_type: str = "execute_request", buffers: int = 0) -> list[Any]:
    """An IOPub stream message as ipykernel's IOPub thread sends it."""
    header = {"msg_id": text, "msg_type": "stream", "session": "kernel"}
    parent = {"msg_id": "cell", "msg_type": parent_type, "session": session}
    content = {"name": "stdout", "text": text}
    parts = [json.dumps(p).encode() for p in (header, parent, {}, content)]
    return [b"kernel.x.stream", DELIM, b"signature", *parts, *([b"\0" * 8] * buffers)]


def texts(kept: list[dict[str, Any]]) -> list[str]:
    return [item["msg"]["content"].get("text", item["msg"]["header"]["msg_type"]) for item in kept]


def test_kept_only_while_no_notebook_is_subscribed_per_session_in_order_once() -> None:
    box = Outbox()
    box.subscription(b"\x01" + CLIENT_TOPIC)
    box.keep_frames(frames("a", "seen live"))
    box.subscription(b"\x01")  # the gateway's own watcher: not a notebook
    box.subscription(b"\x00" + CLIENT_TOPIC)
    box.keep_frames(frames("a", "one"))
    box.keep_frames(frames("b", "other notebook"))
    box.keep_frames(frames("a", "not a cell's", parent_type="kernel_info_request"))
    box.keep_reply(
        {
            "msg_type": "execute_reply",
            "header": {"msg_id": "r", "msg_type": "execute_reply"},
            "parent_header": {"session": "a"},
            "metadata": {},
            "content": {"status": "ok"},
        }
    )
    box.keep_frames(frames("a", "two"))
    box.subscription(b"\x01" + CLIENT_TOPIC)
    box.keep_frames(frames("a", "live again"))
    kept, lost = box.take("a")
    assert texts(kept) == ["one", "execute_reply", "two"] and lost == []
    assert [item["channel"] for item in kept] == ["iopub", "shell", "iopub"]
    assert box.take("a") == ([], [])
    assert texts(box.take("b")[0]) == ["other notebook"]


def test_bounded_the_oldest_go_and_binary_messages_are_not_kept_their_cells_named() -> None:
    one = sum(len(f) for f in frames("a", "x" * 100))
    box = Outbox(max_bytes=3 * one)
    for n in range(5):
        box.keep_frames(frames("a", f"{n}" * 100))
    box.keep_frames(frames("a", "with a buffer", buffers=1))
    kept, lost = box.take("a")
    assert texts(kept) == ["2" * 100, "3" * 100, "4" * 100]
    assert lost == [{"msg_id": "cell", "msg_type": "execute_request", "session": "a"}]


def test_a_message_kept_and_delivered_live_is_known_by_its_id() -> None:
    """The server delivers a kept message once: one also received live (sent in the instant
    before the kernel saw the notebook subscribe) is recognised by its header's msg_id."""
    from jupyter_client.session import Session

    from kernelmgr.server.undelivered import msg_id_of

    session = Session(key=b"k")
    msg = session.msg("stream", {"name": "stdout", "text": "after 42\n"})
    frames = session.serialize(msg, ident=[b"stream.stdout"])
    assert msg_id_of(frames) == msg["header"]["msg_id"]
    assert msg_id_of([b"no delimiter"]) is None
    assert msg_id_of([DELIM, b"sig", b"not json"]) is None
