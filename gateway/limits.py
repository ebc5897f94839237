"""Request body limits for the gateway, answered before the body is read.

jupyter_server buffers a request's whole body (up to ``ServerApp.max_body_size``, 512 MiB by
default) before any handler runs, so before the token is checked: anyone who can reach the
gateway could make it hold that much per connection. The gateway serves kernels only, whose
requests are small JSON, so its default is a few MiB (:data:`DEFAULT_MAX_BODY_SIZE`).

Tornado refuses a larger ``Content-Length`` itself, but with a bare ``400 Bad Request``. The
delegate here answers first, from the headers alone: ``413`` with a JSON ``message`` naming the
setting, and the connection is closed without reading the body. (A chunked body has no length
up front: tornado's own limit stops it once it grows past ``max_body_size``.)
"""

from __future__ import annotations

import json
from typing import Any

from tornado import httputil

#: The gateway's ``ServerApp.max_body_size`` unless configured: kernel requests are small JSON.
DEFAULT_MAX_BODY_SIZE = 4 * 1024 * 1024
#: The gateway's ``ServerApp.max_buffer_size`` unless configured: above the body limit and above
#: tornado's websocket message limit (``websocket_max_message_size``, 10 MiB by default), which
#: a cell's message must fit in.
DEFAULT_MAX_BUFFER_SIZE = 16 * 1024 * 1024
#: Tornado's own cap on one websocket message, unless ``ServerApp.tornado_settings`` sets
#: ``websocket_max_message_size``: a larger message closes that connection (code 1009).
WEBSOCKET_MAX_MESSAGE_SIZE = 10 * 1024 * 1024


class BodyLimit(httputil.HTTPServerConnectionDelegate):
    """Wraps the web application: a request whose ``Content-Length`` is over ``limit`` gets 413."""

    def __init__(self, app: httputil.HTTPServerConnectionDelegate, limit: int) -> None:
        self.app = app
        self.limit = limit

    def start_request(
        self, server_conn: object, request_conn: httputil.HTTPConnection
    ) -> httputil.HTTPMessageDelegate:
        return _Limited(self.app.start_request(server_conn, request_conn), request_conn, self.limit)

    def on_close(self, server_conn: object) -> None:
        self.app.on_close(server_conn)


class _Limited(httputil.HTTPMessageDelegate):
    def __init__(
        self, delegate: httputil.HTTPMessageDelegate, conn: httputil.HTTPConnection, limit: int
    ) -> None:
        self.delegate = delegate
        self.conn = conn
        self.limit = limit
        self.refused = False

    def headers_received(
        self,
        start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
        headers: httputil.HTTPHeaders,
    ) -> Any:
        length = headers.get("Content-Length", "")
        if length.strip().isdigit() and int(length) > self.limit:
            self.refused = True
            self._refuse(int(length))
            return None
        return self.delegate.headers_received(start_line, headers)

    def _refuse(self, length: int) -> None:
        body = json.dumps(
            {
                "message": f"the request body is {length} bytes, more than this server accepts "
                f"({self.limit}; ServerApp.max_body_size)"
            }
        ).encode()
        head = (
            "HTTP/1.1 413 Payload Too Large\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        # Take the stream from the HTTP connection: it then reads no body, and we close it once
        # the answer is written.
        stream = self.conn.detach()  # type: ignore[attr-defined]
        written = stream.write(head + body)
        written.add_done_callback(lambda _future: stream.close())

    def data_received(self, chunk: bytes) -> Any:
        if not self.refused:
            return self.delegate.data_received(chunk)
        return None

    def finish(self) -> None:
        if not self.refused:
            self.delegate.finish()

    def on_connection_close(self) -> None:
        if not self.refused:
            self.delegate.on_connection_close()
