"""How objects become bytes: a cloudpickle pickler with a few additions, and their inverses.

cloudpickle is the base because notebook code defines functions and classes in
``__main__``, which plain pickle saves by reference to a module that will not exist in the
resumed kernel. cloudpickle saves them by value, and tracks classes so that every group
that contains an instance of ``MyClass`` gets back the *same* class object (so
``isinstance`` holds across variables).

The additions, all in :meth:`GroupPickler.reducer_override`:

* **Notebook functions are rebound to the restored namespace.** A function defined in a
  cell has the user namespace as its ``__globals__``. cloudpickle would give it a private
  copy of the globals it uses, so after a restore ``f()`` would read stale copies and never
  see variables defined later. Here such functions are rebuilt from their code with the
  namespace being restored as globals, as if the cell had been run again.
* **Modules are saved by name** and imported again on restore (a module that no longer
  imports fails its group, with the ``ModuleNotFoundError`` in the restore report).
* **Torch tensors go out of band.** ``torch``'s own pickling copies storage bytes into the
  pickle stream and reloads CUDA tensors onto their original device index (failing if it
  is gone). Here a tensor's storage is handed to the pickler's ``buffer_callback`` as raw
  bytes (copied to host memory first when it lives on a GPU), once per storage, so views
  keep sharing it; on restore the storage is rebuilt with ``torch.frombuffer`` over the read
  buffer (no copy) and moved to its device if that device exists, else to another GPU or the
  CPU, recording the move for the restore report. A leaf tensor's ``.grad`` goes with it
  (a model in the middle of gradient accumulation keeps what it accumulated). torch is
  never imported here: tensors can only exist if the notebook already imported it.
* **Library reducers** (:mod:`kernelmgr.checkpoint.reducers`): objects of a library with a
  reducer there (looked up by the class's top-level package, and only once that library
  is imported) are reduced by it.
* **The generic rule** (:mod:`kernelmgr.checkpoint.reducers.generic`): an object whose own
  pickling drops or blanks attributes gets those that pickle carried along and put back
  where the restored object lacks them. ``carry_dropped=False`` turns this and the
  library reducers off: plain cloudpickle, the writer's last try for a variable that
  failed with them.

numpy arrays and pandas blocks need nothing: with protocol 5 they hand their memory to
``buffer_callback`` themselves.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import functools
import importlib
import logging
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from kernelmgr.checkpoint import reducers
from kernelmgr.checkpoint.reducers import generic

PROTOCOL = 5
log = logging.getLogger(__name__)
_LRU_WRAPPER = type(functools.lru_cache()(lambda: None))


def remap_device(saved: str, cuda_count: int) -> tuple[str, str | None]:
    """Where a tensor saved on ``saved`` goes when ``cuda_count`` GPUs are visible.

    Returns the target device and, when it differs from ``saved``, a note such as
    ``"cuda:1 -> cuda:0"``. Same index if it exists, else the first GPU, else the CPU.
    Device types other than CPU and CUDA (mps, xpu, ...) come back on the CPU.
    """
    kind, _, index_text = saved.partition(":")
    if kind == "cpu":
        return "cpu", None
    if kind == "cuda":
        index = int(index_text) if index_text.isdigit() else 0
        wanted = f"cuda:{index}"
        if index < cuda_count:
            return wanted, None
        target = "cuda:0" if cuda_count > 0 else "cpu"
        return target, f"{wanted} -> {target}"
    return "cpu", f"{saved} -> cpu"


@dataclass
class RestoreContext:
    """What the reconstructors need to know while one checkpoint is being unpickled."""

    namespace: dict[str, Any]
    cuda_count: int | None = None
    remapped: list[str] = field(default_factory=list)

    def visible_gpus(self) -> int:
        if self.cuda_count is None:
            torch = sys.modules.get("torch")
            try:
                available = torch is not None and torch.cuda.is_available()
                self.cuda_count = int(torch.cuda.device_count()) if available and torch is not None else 0
            except Exception:
                self.cuda_count = 0
        return self.cuda_count


_CONTEXT: ContextVar[RestoreContext | None] = ContextVar("elastic_restore_context", default=None)


@contextlib.contextmanager
def restoring(context: RestoreContext) -> Iterator[RestoreContext]:
    """Make ``context`` the target of notebook functions and device moves while unpickling."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


# --- notebook functions -------------------------------------------------------------------


def _function_skeleton(code: types.CodeType, name: str) -> types.FunctionType:
    """A function with ``code``, the restored namespace as globals and empty closure cells."""
    context = _CONTEXT.get()
    namespace = context.namespace if context is not None else {"__builtins__": builtins}
    closure = tuple(types.CellType() for _ in code.co_freevars) or None
    return types.FunctionType(code, namespace, name, None, closure)


def _set_function_state(func: types.FunctionType, state: dict[str, Any]) -> types.FunctionType:
    """Fill in what the skeleton lacks; runs after the state was unpickled (cycles are fine)."""
    func.__defaults__ = state["defaults"]
    func.__kwdefaults__ = state["kwdefaults"]
    func.__qualname__ = state["qualname"]
    func.__module__ = state["module"]
    func.__doc__ = state["doc"]
    if state.get("annotations") is not None:
        func.__annotations__ = state["annotations"]
    if "type_params" in state:
        setattr(func, "__type_params__", state["type_params"])  # noqa: B010 - Python >= 3.12 only
    func.__dict__.update(state["dict"])
    empty = set(state["empty_cells"])
    for index, (cell, value) in enumerate(zip(func.__closure__ or (), state["cells"], strict=True)):
        if index not in empty:
            cell.cell_contents = value
    return func


def _reduce_namespace_function(func: types.FunctionType) -> tuple[Any, ...]:
    cells: list[Any] = []
    empty_cells: list[int] = []
    for index, cell in enumerate(func.__closure__ or ()):
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # a closure variable not assigned yet
            cells.append(None)
            empty_cells.append(index)
    try:
        annotations = dict(func.__annotations__)
    except Exception:
        annotations = None
    state: dict[str, Any] = {
        "defaults": func.__defaults__,
        "kwdefaults": func.__kwdefaults__,
        "qualname": func.__qualname__,
        "module": func.__module__,
        "doc": func.__doc__,
        "annotations": annotations,
        "dict": dict(func.__dict__),
        "cells": cells,
        "empty_cells": empty_cells,
    }
    type_params = getattr(func, "__type_params__", None)
    if type_params:
        state["type_params"] = type_params
    return (_function_skeleton, (func.__code__, func.__name__), state, None, None, _set_function_state)


def _rebuild_lru_cache(func: Callable[..., Any], maxsize: int | None, typed: bool) -> Any:
    return functools.lru_cache(maxsize=maxsize, typed=typed)(func)


def _reduce_lru_cache(wrapper: Any) -> tuple[Any, ...]:
    """``@functools.cache``/``lru_cache`` on a notebook function: pickle reduces the wrapper to
    a lookup of its name in ``__main__``, which fails for the variable being restored itself.
    Rebuild it around the (rebound) function instead; the cached results are not kept."""
    parameters = wrapper.cache_parameters()
    return (_rebuild_lru_cache, (wrapper.__wrapped__, parameters["maxsize"], parameters["typed"]))


# --- torch tensors ------------------------------------------------------------------------


class _StorageRef:
    """One tensor storage, seen once per group so every tensor on it pickles a reference.

    ``host`` keeps the host copy (for GPU storages) alive until the group is written.
    """

    __slots__ = ("device", "host", "nbytes")

    def __init__(self, storage: Any) -> None:
        self.device = str(storage.device)
        self.host = storage if self.device == "cpu" else storage.cpu()
        self.nbytes = int(storage.nbytes())

    def buffer(self) -> pickle.PickleBuffer | bytes:
        if self.nbytes == 0:
            return b""
        raw = (ctypes.c_char * self.nbytes).from_address(self.host.data_ptr())
        raw.owner = self.host  # type: ignore[attr-defined]  # the view must keep the memory alive
        return pickle.PickleBuffer(raw)


def _rebuild_storage(buffer: Any, nbytes: int, device: str) -> Any:
    """A storage over the read buffer itself (no copy), moved to its device if it has one."""
    import torch

    # frombuffer refuses an empty buffer; a zero-byte storage needs no bytes anyway.
    flat = torch.frombuffer(buffer, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    context = _CONTEXT.get()
    gpus = context.visible_gpus() if context is not None else RestoreContext({}).visible_gpus()
    target, note = remap_device(device, gpus)
    if note is not None and context is not None:
        context.remapped.append(note)
    if target != "cpu":
        flat = flat.to(target)
    return flat.untyped_storage()


def _rebuild_tensor(
    storage: Any,
    dtype: str,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    requires_grad: bool,
    parameter: bool,
    attributes: dict[str, Any],
    grad: Any = None,
) -> Any:
    import torch

    tensor = torch.empty(0, dtype=getattr(torch, dtype), device=storage.device)
    tensor.set_(storage, offset, size, stride)
    if parameter:
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    elif requires_grad:
        tensor.requires_grad_(True)
    if attributes:
        tensor.__dict__.update(attributes)
    if grad is not None:
        # After the move to a device: a gradient must live where its tensor does.
        tensor.grad = grad if grad.device == tensor.device else grad.to(tensor.device)
    return tensor


def _is_plain_tensor(obj: Any, torch: Any) -> bool:
    if type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return bool(obj.layout == torch.strided and not obj.is_quantized and obj.device.type != "meta")


# --- the pickler --------------------------------------------------------------------------

#: Types pickle handles natively: no reducer is looked up for them (the common case, fast).
_PLAIN_TYPES = frozenset(
    {str, bytes, bytearray, int, float, complex, bool, type(None), list, tuple, dict, set, frozenset}
)


def _discard_buffer(buffer: pickle.PickleBuffer) -> bool:
    return False  # taken out of band and dropped: a probe's sink never holds big buffers


def _no_tensor() -> None:
    return None


class GroupPickler(cloudpickle.Pickler):
    """Pickles one group of variables (see the module docstring for what it adds)."""

    def __init__(
        self,
        file: Any,
        namespace: dict[str, Any],
        buffer_callback: Callable[[pickle.PickleBuffer], bool],
        *,
        carry_dropped: bool = True,
        probing: bool = False,
    ) -> None:
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffer_callback)
        self._namespace = namespace
        self._storages: dict[tuple[str, int], _StorageRef] = {}
        self._probing = probing
        self._carry = carry_dropped and not probing
        #: Whether the generic rule or a library reducer changed how something pickles here.
        self.carried = False
        self._reducers: dict[type, reducers.Reduce | None] = {}
        #: Classes that leave their pickling to ``object``: the generic rule never applies.
        self._plain_classes: set[type] = set()
        self._probe = generic.probe_with(
            lambda sink: GroupPickler(sink, namespace, _discard_buffer, probing=True)
        )

    def dump(self, obj: Any) -> None:
        with reducers.one_stream() as state:  # reducers' per-stream state (e.g. bokeh graphs)
            # What the stream saves in any case: the group's variables.
            state["top"] = list(obj.values()) if isinstance(obj, dict) else []
            super().dump(obj)

    def reducer_override(self, obj: Any) -> Any:
        if self._is_namespace_function(obj):
            return _reduce_namespace_function(obj)
        if isinstance(obj, _LRU_WRAPPER) and self._is_namespace_function(getattr(obj, "__wrapped__", None)):
            return _reduce_lru_cache(obj)
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            return (importlib.import_module, (obj.__name__,))
        if isinstance(obj, _StorageRef):
            return (_rebuild_storage, (obj.buffer(), obj.nbytes, obj.device))
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and _is_plain_tensor(obj, torch):
            if self._probing:  # a probe only asks "does it pickle": never copy a GPU storage for it
                return (_no_tensor, ())
            return self._reduce_tensor(obj, torch)
        if isinstance(obj, type) or type(obj) in _PLAIN_TYPES:
            return super().reducer_override(obj)
        reduce = reducers.reducer_for_type(type(obj), self._reducers) if self._carry else None
        if reduce is not None:
            try:
                rv = reduce(obj, self.reduce_keeping_dropped)
            except Exception as exc:
                # A library version the reducer does not know: that object pickles as it would
                # without the reducer (and may fail there, with its own reason).
                module = getattr(reduce, "__module__", "?")
                log.warning("the %s reducer failed on a %s (%s): pickled as is", module, type(obj), exc)
                rv = None
            if rv is not None:
                self.carried = True
                return rv
        if self._carry:
            rv = self.reduce_keeping_dropped(obj)
            if rv is not None:
                return rv
        return super().reducer_override(obj)

    def reduce_keeping_dropped(self, obj: Any) -> tuple[Any, ...] | None:
        """The generic rule (:mod:`~kernelmgr.checkpoint.reducers.generic`) for ``obj``."""
        if not self._carry:
            return None
        cls = type(obj)
        if cls in self._plain_classes:
            return None
        if not generic.customises_pickling(cls):
            self._plain_classes.add(cls)
            return None
        rv = generic.reduce_keeping_dropped(obj, self.dispatch_table, self._probe, PROTOCOL)
        if rv is not None and rv[-1] is generic.apply_carried:
            self.carried = True
        return rv

    def _is_namespace_function(self, obj: Any) -> bool:
        return isinstance(obj, types.FunctionType) and obj.__globals__ is self._namespace

    def _reduce_tensor(self, tensor: Any, torch: Any) -> tuple[Any, ...]:
        parameter = isinstance(tensor, torch.nn.Parameter)
        requires_grad = bool(tensor.requires_grad)
        data = tensor.detach()
        if data.is_conj() or data.is_neg():
            data = data.resolve_conj().resolve_neg()
        storage = data.untyped_storage()
        key = (str(storage.device), int(storage.data_ptr()))
        ref = self._storages.get(key)
        if ref is None:
            ref = self._storages[key] = _StorageRef(storage)
        attributes = dict(getattr(tensor, "__dict__", {}))
        # A leaf's accumulated gradient (gradient accumulation over several cells must survive);
        # a non-leaf has none to keep (reading it only warns).
        grad = tensor.grad if tensor.is_leaf and requires_grad else None
        return (
            _rebuild_tensor,
            (
                ref,
                str(data.dtype).removeprefix("torch."),
                tuple(data.size()),
                tuple(data.stride()),
                int(data.storage_offset()),
                requires_grad,
                parameter,
                attributes,
                grad,
            ),
        )
