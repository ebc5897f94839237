"""astropy: a WCS comes back with its linear transformation in the form it was given.

``astropy.wcs.WCS`` pickles through its own FITS header, which always writes the linear
part as ``PCi_j`` + ``CDELTi``. A WCS built with a ``CDi_j`` matrix therefore comes back as
an equivalent PC matrix: the same transformation, but ``w.wcs.has_cd()`` turns false and
reading ``w.wcs.cd`` fails, and a header written from it says PC. The reducer keeps
astropy's own pickling and, for a WCS that had a CD matrix, puts that matrix back (and
removes the PC matrix the header produced), so the restored WCS is the one saved.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kernelmgr.checkpoint.reducers.generic import then


def reduce(obj: Any, generic: Callable[[Any], tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    wcs_module = sys.modules.get("astropy.wcs")
    if wcs_module is None or not isinstance(obj, wcs_module.WCS):
        return None
    rv = generic(obj) or obj.__reduce__()
    prm = getattr(obj, "wcs", None)
    if prm is not None and prm.has_cd():
        rv = then(rv, restore_cd, prm.cd.copy())
    return rv


def restore_cd(wcs: Any, cd: Any) -> None:
    """Make the restored WCS a CD-matrix WCS again (what its header turned into PC)."""
    prm = wcs.wcs
    if prm.has_pc():
        del prm.pc
    prm.cd = cd
