"""A library reducer that fails, for the test that a failing reducer loses nothing.

``tests.test_checkpoint_fidelity`` registers this module as the reducer of the ``tests``
package; its classes then reach :func:`reduce`, which raises like a reducer meeting a
library version it does not know.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Gauge:
    """A value holder whose class lives in ``tests`` (so the registered reducer is asked)."""

    def __init__(self, reading: float) -> None:
        self.reading = reading


def reduce(obj: Any, generic: Callable[[Any], Any]) -> Any:
    if isinstance(obj, Gauge):
        raise AttributeError("this library version has no attribute '_internal'")
    return None
