"""Errors raised by the core model.

Each error carries a message meant for the person who can fix the problem (an admin for a
configuration error, a notebook user for a capacity error), so adapters can show it as is:
the server turns them into 4xx JSON responses, the CLI into one line on stderr.
"""

from __future__ import annotations


class ElasticError(Exception):
    """Base class for every error the core raises on purpose."""

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class ConfigError(ElasticError):
    """The admin's configuration (GPU sizes, inventory, policy) is invalid."""


class UnknownProfileError(ElasticError):
    """A kernel asked for a GPU size that is not configured."""


class CapacityError(ElasticError):
    """A GPU size does not fit on any device right now."""


class InvalidTransitionError(ElasticError):
    """A kernel lifecycle transition that the state machine does not allow."""
