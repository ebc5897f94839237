"""Optional libraries the fidelity tests need (torch, matplotlib, plotly, ...).

They install from PyPI through the ``test`` extra (torch through ``.ci/run``). Where one is
missing the test skips, naming the install; CI sets ``ELASTIC_REQUIRE_LIBRARIES=1`` so a
missing library fails the run instead of skipping silently.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

REQUIRE_ENV = "ELASTIC_REQUIRE_LIBRARIES"


def require(name: str) -> ModuleType:
    """Import ``name``; skip without it, or fail when ``ELASTIC_REQUIRE_LIBRARIES`` is set."""
    import pytest

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but {name} does not import ({exc})", pytrace=False)
        pytest.skip(f"{name} is not installed (pip install -e '.[test]'; torch: see .ci/run)")
    raise AssertionError("unreachable")
