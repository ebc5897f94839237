"""PyTorch: optimizers and LR schedulers restored with everything that makes them work.

Tensors themselves (storages out of band, ``.grad``, device moves) are handled in
:mod:`kernelmgr.checkpoint.serialize`. Modules pickle their whole ``__dict__`` (parameters,
buffers, ``training``, hooks), so they need nothing beyond that.

Optimizers pickle only ``defaults``, ``state`` and ``param_groups``: the per-parameter
state (Adam's moments, step counts) survives, keyed by the very parameter objects, which
the grouping saves in the same stream as the model, so ``opt.param_groups[0]["params"][0]
is model.weight`` still holds. What ``Optimizer.__getstate__`` leaves out is carried by the
generic rule (step and state-dict hooks, warning flags). One thing it cannot carry: an LR
scheduler wraps ``optimizer.step`` in a closure over a weak reference, to notice
``scheduler.step()`` called before ``optimizer.step()``. That wrapper is rebuilt here
around the restored optimizer (same marker attribute and same ``_opt_called`` flag), so a
restored pair steps without torch warning that the optimizer was overridden.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from kernelmgr.checkpoint.reducers.generic import then

_MARKER = "_wrapped_by_lr_sched"


def reduce(obj: Any, generic: Callable[[Any], tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.optim.Optimizer):
        return None
    rv = generic(obj) or obj.__reduce_ex__(5)
    step = obj.__dict__.get("step")
    if step is not None and getattr(step, _MARKER, False):
        rv = then(rv, track_step_calls, bool(obj.__dict__.get("_opt_called", False)))
    return rv


def track_step_calls(optimizer: Any, called: bool) -> None:
    """Wrap ``optimizer.step`` as an LR scheduler does: mark the wrapper, record calls."""
    if getattr(optimizer.__dict__.get("step"), _MARKER, False):
        return
    step = type(optimizer).step
    reference = weakref.ref(optimizer)

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        target: Any = reference()
        target._opt_called = True
        return step(target, *args, **kwargs)

    setattr(wrapper, _MARKER, True)
    optimizer.step = wrapper
    if called:
        optimizer._opt_called = True
