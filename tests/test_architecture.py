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


def string_literals(path: Path, wanted: set[str]) -> list[str]:
    """``path:line`` of each string constant in ``wanted`` that is code, not a docstring."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.name}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in wanted and id(node) not in docstrings
    ]


def test_each_provisioner_name_is_defined_once_and_is_its_entry_point() -> None:
    """Code asks ``runtime.mode``; the names live in core/modes.py alone, as pyproject's entry points."""
    import tomllib

    from kernelmgr.core.modes import KernelMode

    names = {mode.provisioner for mode in KernelMode}
    found = [
        hit
        for root in (PACKAGE, PACKAGE.parent / "gateway")
        for path in sorted(root.rglob("*.py"))
        if path != PACKAGE / "core" / "modes.py"
        for hit in string_literals(path, names)
    ]
    assert found == []
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    assert set(pyproject["project"]["entry-points"]["jupyter_client.kernel_provisioners"]) == names


def test_the_literal_rule_catches_a_comparison(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""Mentions elastic-local-provisioner."""\nlocal = name == "elastic-local-provisioner"\n')
    assert string_literals(bad, {"elastic-local-provisioner"}) == ["bad.py:2"]


def test_the_lifecycle_imports_no_web_or_kubernetes_framework_and_not_the_server() -> None:
    """``server/`` depends on ``lifecycle/``, never the reverse (jupyter_server is reached via KernelHost)."""
    assert violations(PACKAGE / "lifecycle", ("jupyter_server", "tornado", "kubernetes")) == []
    upward = [
        f"{path.name} imports {module}"
        for path in sorted((PACKAGE / "lifecycle").rglob("*.py"))
        for module in imported_modules(path)
        if module.startswith(("kernelmgr.server", "gateway"))
    ]
    assert upward == []


def test_only_the_controller_module_moves_a_lifecycle() -> None:
    """Every state write goes through core/controller.py (``KernelStates`` and the controller)."""
    moves = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "core" / "controller.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "move"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "lifecycle"
    ]
    assert moves == []
