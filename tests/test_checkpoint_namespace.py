"""The checkpoint's definition of user variables (kernelmgr.checkpoint.namespace)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kernelmgr.checkpoint.namespace import UserNamespace, is_machinery

pytestmark = pytest.mark.pure

MACHINERY = ["In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_7", "_i", "_ii", "_iii"]
MACHINERY += ["_i12", "_ih", "_oh", "_dh", "__name__", "__builtins__"]


@pytest.mark.parametrize("name", MACHINERY)
def test_ipython_machinery_by_name(name: str) -> None:
    assert is_machinery(name)


@pytest.mark.parametrize("name", ["_private", "_cache", "_x1", "__init", "In_", "_iv", "out"])
def test_underscore_names_a_user_chose_are_user_variables(name: str) -> None:
    assert not is_machinery(name)


def shell(ns: dict[str, object], hidden: dict[str, object]) -> SimpleNamespace:
    return SimpleNamespace(user_ns=ns, user_ns_hidden=hidden)


def test_startup_names_are_skipped_while_they_hold_the_startup_object() -> None:
    startup_open = object()
    ns: dict[str, object] = {"open": startup_open, "x": 1}
    names = UserNamespace(shell(ns, {"open": startup_open}))
    assert names.user_names() == ["x"]
    ns["open"] = "the user's own open"
    assert names.user_names() == ["open", "x"]


def test_restored_variables_stay_user_variables_after_ipython_hides_them() -> None:
    """The second-hibernation bug: IPython hides what start-up left, restored variables included."""
    value = [1, 2]
    ns: dict[str, object] = {"kept": value}
    hidden: dict[str, object] = {}
    names = UserNamespace(shell(ns, hidden))
    names.adopt_restored(["kept"])
    hidden.update(ns)  # what InteractiveShellApp.init_code does after the extensions load
    assert names.user_names() == ["kept"]
    names.unhide_restored()
    assert "kept" not in hidden


def test_a_deleted_restored_variable_is_gone() -> None:
    ns: dict[str, object] = {"kept": 1}
    names = UserNamespace(shell(ns, dict(ns)))
    names.adopt_restored(["kept"])
    del ns["kept"]
    assert names.user_names() == []
