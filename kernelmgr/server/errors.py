"""HTTP errors whose JSON ``message`` is exactly the text we wrote.

tornado (6.5+) hands out ``HTTPError.log_message`` with every ``%`` doubled when the error
has no format arguments, and jupyter_server's API handlers send ``log_message`` to the client
as is, so "25% of a GPU" would reach users as "25%% of a GPU". This subclass returns the
message untouched.
"""

from __future__ import annotations

from tornado import web


class ClearHTTPError(web.HTTPError):
    """An ``HTTPError`` whose ``log_message`` is the literal message."""

    @property
    def log_message(self) -> str | None:
        return self.get_message()


def http_error(status: int, message: str) -> web.HTTPError:
    """An error that jupyter_server renders as ``{"message": message}`` with ``status``."""
    return ClearHTTPError(status, message)


def no_such_kernel(kernel_id: str) -> web.HTTPError:
    """404 for an unknown kernel id, and for another user's: both must read the same."""
    return http_error(404, f"no kernel with id {kernel_id!r}; list kernels at /api/elastic/kernels")
