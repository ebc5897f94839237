"""numpy: views come back as views of their base, not as copies.

numpy pickles a view (``x[:800]``, ``x.T``, a column of a 2-D array) as an array of its
own: after a plain restore ``view`` and ``base`` no longer share memory, so writing into
one no longer shows in the other, and the bytes are saved twice. Here a view is saved as
"this window of that array" (byte offset, shape, strides, dtype) when the array that owns
the memory is saved in the same pickle stream anyway (it owns the memory of one of the
group's variables;
the grouping links arrays that share memory, see
:func:`kernelmgr.checkpoint.grouping._extra_keys`), or is at most twice the view's size. A
small view of a huge array nobody else holds is still saved as a copy of its own bytes.
Object arrays, subclasses and views of memory numpy does not own are left to numpy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kernelmgr.checkpoint.reducers import stream_state


def memory_root(array: Any, numpy: Any) -> Any:
    """The last exact ``ndarray`` in ``array``'s chain of bases (the one holding the memory)."""
    root = array
    while type(root.base) is numpy.ndarray:
        root = root.base
    return root


def _largest_window(numpy: Any) -> dict[int, int]:
    """Per memory owner (by id), the most bytes of it one of the stream's variables views."""
    state = stream_state()
    largest: dict[int, int] | None = state.get("numpy_windows")
    if largest is None:
        largest = state["numpy_windows"] = {}
        for value in state.get("top", ()):
            if type(value) is numpy.ndarray:
                key = id(memory_root(value, numpy))
                largest[key] = max(largest.get(key, 0), value.nbytes)
    return largest


def reduce(obj: Any, generic: Callable[[Any], tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    numpy = sys.modules.get("numpy")
    if numpy is None or type(obj) is not numpy.ndarray or type(obj.base) is not numpy.ndarray:
        return None
    if obj.dtype.hasobject:
        return None
    root = memory_root(obj, numpy)
    if root.dtype.hasobject or not (root.flags.c_contiguous or root.flags.f_contiguous):
        return None
    # Share only where the owner's bytes are worth saving: a variable (this one or another in
    # the stream) spans at least half of them.
    window = max(obj.nbytes, _largest_window(numpy).get(id(root), 0))
    if root.nbytes > 2 * window:
        return None
    offset = obj.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    if not 0 <= offset <= root.nbytes:
        return None
    return (view_of, (root, obj.dtype, obj.shape, obj.strides, offset, bool(obj.flags.writeable)))


def view_of(
    root: Any, dtype: Any, shape: tuple[int, ...], strides: tuple[int, ...], offset: int, writeable: bool
) -> Any:
    import numpy

    view = numpy.ndarray(shape, dtype=dtype, buffer=root, offset=offset, strides=strides)
    if not writeable:
        view.flags.writeable = False
    return view
