"""HTTP errors whose JSON ``message`` is exactly the text we wrote.

jupyter_server's API handlers send ``HTTPError.log_message`` to the client as is. tornado 6.5+
hands it out with every ``%`` doubled when the error has no format arguments (a read-only
property over ``_log_message``); tornado 6.3 and 6.4 double it in ``__init__`` and store it in a
plain attribute. Either way "25% of a GPU" would reach users as "25%% of a GPU". This subclass
keeps the literal message and answers it on every tornado the package allows; the property has a
setter because tornado before 6.5 assigns ``log_message`` in ``HTTPError.__init__`` (without one,
every error became a 500 with a traceback).
"""

from __future__ import annotations

import json
from typing import Any

from tornado import web


class ClearHTTPError(web.HTTPError):
    """An ``HTTPError`` whose ``log_message`` is the literal message."""

    def __init__(self, status_code: int = 500, log_message: str | None = None, *args: Any, **kwargs: Any):
        self._clear_message = log_message % args if log_message and args else log_message
        super().__init__(status_code, log_message, *args, **kwargs)

    @property
    def log_message(self) -> str | None:
        return self._clear_message

    @log_message.setter
    def log_message(self, value: str | None) -> None:
        """tornado < 6.5 assigns its escaped copy here; the literal message stays."""

    def __str__(self) -> str:
        """tornado < 6.5 formats ``log_message % args``, which the literal message must not meet."""
        return f"HTTP {self.status_code}: {self._clear_message}"


def http_error(status: int, message: str) -> web.HTTPError:
    """An error that jupyter_server renders as ``{"message": message}`` with ``status``."""
    return ClearHTTPError(status, message)


def no_such_kernel(kernel_id: str) -> web.HTTPError:
    """404 for an unknown kernel id, and for another user's: both must read the same."""
    return http_error(404, f"no kernel with id {kernel_id!r}; list kernels at /api/elastic/kernels")


def gateway_refusal(err: BaseException) -> web.HTTPError | None:
    """The gateway's own 4xx answer, as an error whose JSON ``message`` is the gateway's message.

    jupyter_server's gateway client turns the gateway's ``{"message": ...}`` into an ``HTTPError``
    whose ``log_message`` keeps its ``%s`` placeholders ("Error from Gateway: [%s] %s. Ensure
    gateway url is valid..."), which ``APIHandler.write_error`` sends unformatted: the user never
    learns which quota, size or capacity limit they hit. The message is read from the gateway's
    response (the error's cause, tornado's ``HTTPClientError``), else from the error's arguments.
    ``None`` for anything but a 4xx from the gateway.
    """
    if not isinstance(err, web.HTTPError) or not 400 <= err.status_code < 500:
        return None
    cause = err.__cause__
    response = getattr(cause, "response", None)
    if cause is None or getattr(cause, "code", None) != err.status_code:
        return None  # not the gateway's answer relayed (jupyter_server's own 4xx keep theirs)
    message = ""
    body = getattr(response, "body", None)
    if body:
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if isinstance(payload, dict) and isinstance(payload.get("message"), str):
            message = payload["message"]
    if not message and err.args:
        message = str(err.args[0])
    return http_error(err.status_code, message or f"the gateway refused the request (HTTP {err.status_code})")
