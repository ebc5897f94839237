"""Which kernel a user means on the command line: an id, its first characters, or its notebook.

JupyterLab and ``jupyter elastic list`` show the first eight characters of an id, and users
think of a kernel by its notebook, so both are accepted wherever they name one kernel only. A
reference that names none, or several, is the user's to fix: :class:`KernelRefError` says which
and how (the CLI prints it as one line with exit code 2).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: What ``list`` shows of an id, and the fewest characters a prefix must have.
SHORT_ID = 8
MIN_PREFIX = 4
FULL_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class KernelRefError(ValueError):
    """The reference names no kernel, or more than one."""


def notebooks_of(sessions: Iterable[Mapping[str, Any]] | None) -> dict[str, str]:
    """``{kernel id: notebook path}`` from ``/api/sessions`` (empty where there is none)."""
    paths: dict[str, str] = {}
    for session in sessions or ():
        kernel = session.get("kernel") or {}
        if kernel.get("id") and session.get("path"):
            paths[str(kernel["id"])] = str(session["path"])
    return paths


def resolve(ref: str, kernel_ids: Iterable[str], notebooks: Mapping[str, str]) -> str:
    """The one kernel id that ``ref`` names: the id, a prefix of it, a notebook path or file name."""
    ids = list(kernel_ids)
    if ref in ids:
        return ref
    by_notebook = [k for k in ids if ref in (notebooks.get(k), posixpath.basename(notebooks.get(k) or ""))]
    by_prefix = [k for k in ids if len(ref) >= MIN_PREFIX and k.startswith(ref.lower())]
    matches = list(dict.fromkeys(by_notebook + by_prefix))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        if 0 < len(ref) < MIN_PREFIX and any(k.startswith(ref.lower()) for k in ids):
            raise KernelRefError(f"{ref!r} is too short: give at least {MIN_PREFIX} characters of the id")
        raise KernelRefError(f"no kernel is {ref!r}: `jupyter elastic list` shows their ids and notebooks")
    named = ", ".join(f"{k[:SHORT_ID]} ({notebooks.get(k, 'no notebook')})" for k in matches)
    raise KernelRefError(f"{ref!r} names {len(matches)} kernels: {named}; give more of the id")


def shorten_path(path: str | None, width: int) -> str:
    """A notebook path in ``width`` characters: its end kept (the file name), ``...`` before it."""
    if not path:
        return "-"
    return path if len(path) <= width else "..." + path[-(width - 3) :]
