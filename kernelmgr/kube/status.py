"""What the API server said when it refused a call: the ``message`` of the Status body an
``ApiException`` carries. One parser for every caller (RBAC and admission refusals, the image
awaiter's and the uninstall hook's one-line reports)."""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.rest import ApiException


def _parsed(exc: ApiException) -> tuple[bool, Any]:
    """(whether the body is JSON, or empty; what it parses to)."""
    if not exc.body:
        return True, None
    try:
        return True, json.loads(exc.body)
    except (TypeError, ValueError):
        return False, None


def _message(body: Any) -> str | None:
    return str(body["message"]) if isinstance(body, dict) and "message" in body else None


def status_message(exc: ApiException) -> str | None:
    """The Status body's ``message``; ``None`` when there is none (no body, not JSON, no message)."""
    return _message(_parsed(exc)[1])


def message_or_body(exc: ApiException) -> str:
    """The Status body's ``message``, else the body as sent when it is not JSON (a proxy's error
    page says more than nothing), else ``""``."""
    is_json, body = _parsed(exc)
    message = _message(body)
    if message is not None:
        return message
    return "" if is_json else str(exc.body)


def api_message(exc: ApiException) -> str:
    """The HTTP status and the Status body's message (else the HTTP reason), on one line."""
    message = status_message(exc)
    text = str(exc.reason) if message is None else message
    return f"{exc.status} {' '.join(text.split())}"
