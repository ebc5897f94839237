"""The layering rule: the core model imports no web, Jupyter, Kubernetes or config framework."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kernelmgr

pytestmark = pytest.mark.pure

PACKAGE = Path(kernelmgr.__file__).parent
FORBIDDEN_IN_CORE = ("tornado", "jupyter_server", "jupyter_client", "kubernetes", "traitlets", "pynvml")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def violations(directory: Path, forbidden: tuple[str, ...]) -> list[str]:
    """Every import under ``directory`` (or in that one file) of a top-level package in ``forbidden``."""
    bad = []
    for path in [directory] if directory.is_file() else sorted(directory.rglob("*.py")):
        for module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(directory.parent)} imports {module}")
    return bad


def test_core_imports_no_framework() -> None:
    assert violations(PACKAGE / "core", FORBIDDEN_IN_CORE) == []


def test_core_does_not_import_adapters() -> None:
    adapters = tuple(
        f"kernelmgr.{name}" for name in ("backends", "provisioners", "activity", "server", "cli", "config")
    )
    bad = [
        f"{path.name} imports {module}"
        for path in (PACKAGE / "core").rglob("*.py")
        for module in imported_modules(path)
        if module.startswith(adapters)
    ]
    assert bad == []


def test_backends_import_no_web_framework() -> None:
    assert (
        violations(PACKAGE / "backends", ("tornado", "jupyter_server", "jupyter_client", "kubernetes")) == []
    )


def test_node_agent_imports_no_kubernetes_or_jupyter() -> None:
    """The node agent holds no API rights and needs no Jupyter server: it does not even import them."""
    forbidden = ("kubernetes", "jupyter_server", "jupyter_client", "traitlets")
    assert violations(PACKAGE / "nodeagent", forbidden) == []
    assert violations(PACKAGE / "kube" / "node_agents.py", forbidden) == []


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    fake = tmp_path / "core"
    fake.mkdir()
    (fake / "bad.py").write_text("from tornado import web\n")
    assert violations(fake, FORBIDDEN_IN_CORE) == ["core/bad.py imports tornado"]


def test_core_public_names_resolve_lazily_and_agree() -> None:
    # kernelmgr.core lists its public names three times (type-checking imports, _HOMES,
    # __all__) so static tools see them; they must agree and each must resolve to its home.
    import importlib
    import subprocess
    import sys

    import kernelmgr.core as core

    assert sorted(core.__all__) == sorted(core._HOMES)
    for name, home in core._HOMES.items():
        assert getattr(core, name) is getattr(importlib.import_module(f"kernelmgr.core.{home}"), name)
    # What the in-kernel agent imports must not pull in the allocator and the rest.
    probe = "import sys, kernelmgr.core.errors; print('kernelmgr.core.allocator' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
