"""Optional libraries the fidelity tests need (torch, matplotlib, plotly, ...).

They install from PyPI through the ``test`` extra (torch through ``.ci/run``). Where one is
missing the test skips, naming the install; CI sets ``ELASTIC_REQUIRE_LIBRARIES=1`` so a
missing library fails the run instead of skipping silently.
"""

from __future__ import annotations

import builtins
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

REQUIRE_ENV = "ELASTIC_REQUIRE_LIBRARIES"


@contextmanager
def _no_stale_ipython_marker() -> Iterator[None]:
    """Import as outside IPython when an earlier test's shell is gone but left ``__IPYTHON__``.

    Libraries such as astropy read ``builtins.__IPYTHON__`` at import and then call
    ``get_ipython()``, which returns ``None`` once that shell was cleared: the import would fail
    only because of the order the tests ran in.
    """
    stale = hasattr(builtins, "__IPYTHON__")
    if stale:
        from IPython import get_ipython

        stale = get_ipython() is None
    marker = builtins.__dict__.pop("__IPYTHON__") if stale else None
    try:
        yield
    finally:
        if stale:
            builtins.__IPYTHON__ = marker  # type: ignore[attr-defined]


def require(name: str) -> ModuleType:
    """Import ``name``; skip without it, or fail when ``ELASTIC_REQUIRE_LIBRARIES`` is set."""
    import pytest

    try:
        with _no_stale_ipython_marker():
            return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but {name} does not import ({exc})", pytrace=False)
        pytest.skip(f"{name} is not installed (pip install -e '.[test]'; torch: see .ci/run)")
    raise AssertionError("unreachable")
