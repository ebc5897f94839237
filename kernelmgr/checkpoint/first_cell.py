"""After a restore that lost what the checkpoint held, the first cell waits for the user's word.

Why: a kernel that came back without some of its variables (one failed to load, or the whole
checkpoint was refused) would run the cell that woke it at once, and that cell then fails half-way
(``NameError``) or, worse, works on a fresh default where the user's data was. So that first
user cell is not run: it ends with an error that says, in plain words, what is missing and what
to do; running it again runs it as the kernel is. Variables the checkpoint never held (they could
not be saved at hibernation, the report says why) do not count: resuming could not have brought
them back, and the user was told when they were lost.

IPython's own way to refuse a cell is used: an AST transformer that raises ``InputRejected``
(after ``pre_run_cell``, so silent requests, the server's own, pass untouched).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from IPython.core.error import InputRejected


class RestoreIncomplete(InputRejected):
    """The cell was not run: the restore before it lost variables the checkpoint held."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a traceback (the stack says nothing to the user)."""
        return [f"{type(self).__name__}: {self}"]


def lost_names(report: Mapping[str, Any]) -> list[str]:
    """The variables the checkpoint held that did not come back (not recomputed either)."""
    return [str(item.get("name")) for item in report.get("not_restored", []) if item.get("stage") != "save"]


def refusal(report: Mapping[str, Any]) -> str:
    """What the first cell says after the restore ``report``, or '' when nothing it held was lost."""
    run_again = "This cell was not run, so that it does not run without them: run it again to run it anyway"
    if report.get("refused"):
        return (
            "Your variables could not be restored: the kernel's checkpoint could not be loaded, so the "
            f"kernel is empty. {run_again}, or run the notebook from the top to rebuild them. "
            "Show Restore Report (Kernel menu) or `jupyter elastic report` says why."
        )
    names = lost_names(report)
    if not names:
        return ""
    return (
        f"Not all of your variables could be restored: {', '.join(names)} did not come back. "
        f"{run_again}, or first run the cells that make them. "
        "Show Restore Report (Kernel menu) or `jupyter elastic report` says why."
    )


class FirstCellGuard(ast.NodeTransformer):
    """Refuses the first user cell with :func:`refusal`'s text, once; then takes itself out."""

    def __init__(self, shell: Any, text: str) -> None:
        self.shell = shell
        self.text = text
        self._user_cell = False

    def install(self) -> None:
        self.shell.events.register("pre_run_cell", self._cell_starting)
        self.shell.ast_transformers.append(self)

    def remove(self) -> None:
        if self in self.shell.ast_transformers:
            self.shell.ast_transformers.remove(self)
        if self._cell_starting in self.shell.events.callbacks.get("pre_run_cell", []):
            self.shell.events.unregister("pre_run_cell", self._cell_starting)

    def _cell_starting(self, info: Any = None) -> None:
        """Only a cell the user ran (stored in history, not silent: ``pre_run_cell`` skips those)."""
        self._user_cell = bool(getattr(info, "store_history", True))

    def visit(self, node: ast.AST) -> ast.AST:
        if not self._user_cell:
            return node
        self.remove()
        raise RestoreIncomplete(self.text)


def guard_first_cell(shell: Any, report: Mapping[str, Any]) -> FirstCellGuard | None:
    """Install the guard when ``report`` lost what the checkpoint held; ``None`` otherwise."""
    text = refusal(report)
    if not text:
        return None
    guard = FirstCellGuard(shell, text)
    guard.install()
    return guard


__all__ = ["FirstCellGuard", "RestoreIncomplete", "guard_first_cell", "lost_names", "refusal"]
