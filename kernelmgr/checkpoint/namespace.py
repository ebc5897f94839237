"""Which names in a kernel's namespace are the user's variables.

This is the checkpoint's one definition of "user state", and it must not depend on how a
variable came to be in the namespace: assigned by a cell, imported, or put back by an
earlier restore. The trap it exists to avoid: IPython hides every name present when the
kernel finishes starting (``InteractiveShellApp.init_code`` copies ``user_ns`` into
``user_ns_hidden``), and a resumed kernel's variables are restored *before* that moment. A
rule of "skip what IPython hid" therefore silently dropped every restored variable from the
next checkpoint — a user lost their state on the second hibernation.

A name is *not* the user's when

* it is IPython's machinery by name: ``In``, ``Out``, ``get_ipython``, ``exit``, ``quit``,
  dunders (``__name__``, ``__builtins__`` …) and the output/input history caches (``_``,
  ``__``, ``___``, ``_7``, ``_i``, ``_ii``, ``_iii``, ``_i7``, ``_ih``, ``_oh``, ``_dh``); or
* the kernel's own start-up put it there (IPython's hidden names: start-up files,
  ``exec_lines``, ipykernel's helpers) and it still holds that same object — unless the
  checkpoint agent restored it, in which case it is the user's by construction.

Everything else is the user's, including names that start with one underscore (``_cache``)
that the user assigned: they used to be dropped as "private".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

#: Names IPython and ipykernel put in every user namespace.
MACHINERY_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})

#: IPython's output and input history caches.
_HISTORY_NAME = re.compile(r"_{1,3}|_\d+|_i{1,3}|_i\d+|_ih|_oh|_dh")


def is_machinery(name: str) -> bool:
    """Whether ``name`` is IPython's machinery by its name alone (never a user variable)."""
    if name in MACHINERY_NAMES:
        return True
    if len(name) > 4 and name.startswith("__") and name.endswith("__"):
        return True
    return _HISTORY_NAME.fullmatch(name) is not None


class UserNamespace:
    """The user's variables in one shell's namespace.

    ``shell`` needs ``user_ns`` and, optionally, ``user_ns_hidden`` (IPython's
    ``InteractiveShell`` has both).
    """

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        #: Names the agent restored: the user's, whatever IPython records about them later.
        self.restored: set[str] = set()

    def adopt_restored(self, names: Iterable[str]) -> None:
        """Remember that the agent put ``names`` back (they are user variables)."""
        self.restored.update(names)

    def startup_names(self) -> set[str]:
        """Names the kernel's start-up put in the namespace and that still hold its objects."""
        ns: Mapping[str, Any] = self.shell.user_ns
        hidden: Mapping[str, Any] = getattr(self.shell, "user_ns_hidden", None) or {}
        return {
            name
            for name, value in hidden.items()
            if name not in self.restored and name in ns and ns[name] is value
        }

    def user_names(self) -> list[str]:
        """The names a checkpoint saves, in namespace order."""
        startup = self.startup_names()
        return [
            name
            for name in list(self.shell.user_ns)
            if isinstance(name, str) and not is_machinery(name) and name not in startup
        ]

    def unhide_restored(self) -> None:
        """Take restored variables out of IPython's hidden set, so ``%who`` lists them.

        IPython hides what is in the namespace when start-up ends, which includes what the
        agent restored; a user who runs ``%who`` after a resume expects to see their variables.
        """
        hidden = getattr(self.shell, "user_ns_hidden", None)
        if not hidden:
            return
        ns = self.shell.user_ns
        for name in self.restored:
            if name in hidden and name in ns and ns[name] is hidden[name]:
                del hidden[name]
