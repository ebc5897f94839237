"""Every private name of jupyter_server / jupyter_client / JupyterHub the project uses still exists in
the installed releases (.ci/pins.sh runs this with the lowest and the newest pins)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from kernelmgr.compat import PRIVATE_NAMES

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent


def defined(module_name: str, class_name: str, name: str) -> bool:
    """``name`` is an attribute of the class (or module), or its source reads or sets it."""
    module = importlib.import_module(module_name)
    if not class_name:
        return hasattr(module, name)
    owner = getattr(module, class_name)
    if any(name in vars(klass) for klass in owner.__mro__):
        return True
    return any(
        f".{name}" in inspect.getsource(klass) or f'"{name}"' in inspect.getsource(klass)
        for klass in owner.__mro__
        if klass.__module__.split(".")[0] in ("jupyter_server", "jupyter_client", "jupyterhub")
    )


@pytest.mark.parametrize(("module", "owner", "name"), PRIVATE_NAMES, ids=lambda part: str(part))
def test_each_private_name_exists_in_the_installed_release(module: str, owner: str, name: str) -> None:
    assert defined(module, owner, name), f"{module}.{owner}.{name} is gone: update kernelmgr/compat.py"


def test_the_check_catches_a_missing_name() -> None:
    assert not defined("jupyter_client.manager", "KernelManager", "_no_such_private_name")


def test_only_the_compat_module_reads_jupyter_internals_of_other_objects() -> None:
    """Outside kernelmgr/compat.py, a private Jupyter name appears only inside a subclass (on ``self``,
    ``cls``, ``super()`` or the Jupyter class it belongs to)."""
    names = {name for _, _, name in PRIVATE_NAMES}
    owners = {"self", "cls", *(owner for _, owner, _ in PRIVATE_NAMES if owner)}
    offenders = []
    for path in sorted([*(ROOT / "kernelmgr").rglob("*.py"), *(ROOT / "gateway").rglob("*.py")]):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                target = node.value
                on_self = isinstance(target, ast.Name) and target.id in owners
                on_super = isinstance(target, ast.Call) and getattr(target.func, "id", "") == "super"
                if not (on_self or on_super):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert offenders == [], offenders
    assert "jupyter_server._tz" not in "".join(p.read_text() for p in (ROOT / "kernelmgr").rglob("*.py"))
