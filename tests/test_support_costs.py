"""The cost markers (tests/support/costs.py): one per test, derived from what it uses, none missing.

The collections run in this process through ``pytester``, on small test files written for each case,
with a conftest that assigns the markers as ``tests/conftest.py`` does.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.support.costs import COSTS, Walk, source_cost

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.pure

CONFTEST = """
from pathlib import Path

import pytest

from tests.support.costs import assign


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    assign(items, Path(__file__).parent)
"""

MARKERS = "[pytest]\nmarkers =\n" + "".join(f"    {cost}: the {cost} cost\n" for cost in COSTS)


def collect(pytester: pytest.Pytester, *args: str, **files: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makeini(MARKERS + "addopts = --strict-markers -p no:cacheprovider\n")
    pytester.makepyfile(**files)
    return pytester.runpytest_inprocess("--collect-only", "-q", *args)


def test_a_test_file_without_a_cost_marker_stops_the_collection(pytester: pytest.Pytester) -> None:
    result = collect(pytester, test_bare="def test_nothing():\n    assert True\n")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*1 test(s) have no cost marker*test_bare.py*pytest.mark.pure*"])


MIXED = """
import pytest

from tests.support.server import start_server

pytestmark = pytest.mark.pure


@pytest.fixture
def server(tmp_path):
    return start_server(tmp_path, {})


def test_unit():
    assert True


def test_end_to_end(server):
    assert server


@pytest.mark.cluster
def test_written_by_hand():
    assert True
"""


def test_each_test_gets_only_the_most_expensive_marker(pytester: pytest.Pytester) -> None:
    """The module says pure; a fixture that starts a server makes its test ``server`` and nothing else."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini(MARKERS)
    pytester.makepyfile(test_mixed=MIXED)
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    marked = {item.name: [mark.name for mark in item.iter_markers() if mark.name in COSTS] for item in items}
    assert marked == {
        "test_unit": ["pure"],
        "test_end_to_end": ["server"],
        "test_written_by_hand": ["cluster"],
    }


def test_minus_m_selects_by_that_marker(pytester: pytest.Pytester) -> None:
    result = collect(pytester, "-m", "not pure", test_mixed=MIXED)
    assert result.ret == pytest.ExitCode.OK
    assert sorted(line.split("::")[1] for line in result.outlines if "::" in line) == [
        "test_end_to_end",
        "test_written_by_hand",
    ]


# ---- what the walk finds in code: sample helpers in a module of their own, so that this test
# module's own tests do not use them (the walk would give them the helpers' costs)

SAMPLES = """
import pytest


def local_import():
    from tests.support.node_runner import NodeRunner

    return NodeRunner


def skipped_import():
    manager = pytest.importorskip("jupyter_client.manager")

    def start():
        return manager.start_new_kernel()

    return start


@pytest.mark.browser
def marked_helper():
    pass


def calls_a_marked_helper():
    marked_helper()


def waits_only():
    from tests.support.server import wait_for

    return wait_for(lambda: True)
"""


def test_the_walk_sees_local_imports_importorskip_and_marked_helpers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cost_samples.py").write_text(SAMPLES)
    monkeypatch.syspath_prepend(tmp_path)
    samples = importlib.import_module("cost_samples")

    def found(name: str) -> str | None:
        walk = Walk(tmp_path)
        walk.follow(getattr(samples, name))
        return walk.cost()

    try:
        assert found("local_import") == "cluster"
        assert found("skipped_import") == "server"  # through the closure's ``manager.start_new_kernel``
        assert found("calls_a_marked_helper") == "browser"
        assert found("waits_only") is None  # a support helper that starts nothing costs nothing
    finally:
        del sys.modules["cost_samples"]


def test_sources_match_exact_names_and_prefixes() -> None:
    assert source_cost("tests.support.server.start_server") == "server"
    assert source_cost("tests.support.server.start_server_later") is None
    assert source_cost("playwright.sync_api.sync_playwright") == "browser"
    assert source_cost("tests.support.pod_cluster.PodCluster") == "cluster"
