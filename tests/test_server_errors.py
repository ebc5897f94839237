"""The project's HTTP errors on the tornado that is installed (each tornado the package allows runs
this file through .ci/pins.sh: tornado < 6.5 made every ClearHTTPError a 500 with a traceback)."""

from __future__ import annotations

import pytest
from tornado import web

from kernelmgr.server.errors import ClearHTTPError, http_error, no_such_kernel

pytestmark = pytest.mark.pure


def test_the_message_is_the_literal_text_with_its_status() -> None:
    error = http_error(409, "25% of a GPU does not fit right now")
    assert isinstance(error, web.HTTPError)
    assert (error.status_code, error.log_message) == (409, "25% of a GPU does not fit right now")
    assert "25% of a GPU" in str(error)


def test_format_arguments_are_applied_once() -> None:
    error = ClearHTTPError(400, "size %r at %d%%", "small", 25)
    assert error.log_message == "size 'small' at 25%"


def test_no_such_kernel_names_the_list_to_look_at() -> None:
    error = no_such_kernel("abc")
    assert error.status_code == 404 and "/api/elastic/kernels" in (error.log_message or "")
