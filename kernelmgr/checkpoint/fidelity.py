"""Saying when a restored variable is known to differ from the one that was saved.

Pickling can succeed and still bring back something else: a library's ``__getstate__`` drops
an attribute, a ``__reduce__`` rebuilds the object from a summary, a callback is reset to
``None``. Nothing fails, so the restore report would call the variable restored. To notice,
the writer records a small *structural fingerprint* of every saved variable in the manifest,
and the reader computes the same fingerprint of the restored value and compares.

A fingerprint is a flat ``{path: description}`` map over the first levels of the object
graph, breadth first and bounded (:data:`MAX_ENTRIES` entries, :data:`MAX_DEPTH` levels):

* ``""`` describes the variable itself, ``".attr"`` an instance attribute, ``"[key]"`` a
  string dict key, ``"[0]"`` one of the first items of a sequence;
* a description is the type, plus what is cheap and meaningful: lengths of containers,
  shape and dtype of arrays and tensors (and whether a tensor has a ``.grad``), the value of
  small atoms (``bool``, ``int``, ``float``, ``None``, short ``str``) and whether a callable
  attribute is set at all.

It reads array contents only for small NumPy arrays (:data:`SMALL_ARRAY_BYTES` or less, no
Python objects inside): their bytes are digested into a separate ``"<path>#values"`` entry,
so a matrix a library's reducer rebuilt with other numbers (a WCS transform, a colour map's
table) is reported, not only one whose shape changed. Bigger arrays and every tensor are
described by metadata alone (a GPU tensor is never touched), so a fingerprint costs about the
same for a kilobyte and a gigabyte. The ``#values`` entry is separate so that a checkpoint
written before it existed compares as before (paths only the restored value has are not
differences). What it deliberately ignores, because it changes on every restore
without anything being lost: attributes whose name says *cache*, *lock*, *stale* (a
"needs redrawing" flag) or *in_process* (waiting for a frontend), private attributes
below the variable's own, the identity of objects (``id``, addresses in ``repr``) and a
tensor's device (device moves are reported separately). More volatile paths per type are
declared in ``_VOLATILE_PATHS`` or with :func:`register_volatile`.

The comparison (:func:`compare`) names at most three differences, e.g.
``.stale_callback: function -> None; .grad missing``. Paths only the restored value has are
not differences (a library may add lazily computed state); paths the saved value had that
are gone, or whose description changed, are.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

#: Fingerprint entries per variable (bounds the manifest: ~40 bytes each).
MAX_ENTRIES = 64
#: Levels below the variable itself that are looked at.
MAX_DEPTH = 2
#: Dict keys / sequence items / attributes looked at per object.
MAX_CHILDREN = 12
#: Dicts (and instance dicts) bigger than this are described by length only, never sorted.
_SORT_LIMIT = 1000
#: Strings up to this length are described by value.
SHORT_STR = 24
_DESCRIPTION_LIMIT = 80
#: Differences named in one reason.
MAX_REASONS = 3
#: NumPy arrays up to this size get their values digested (``"<path>#values"``).
SMALL_ARRAY_BYTES = 4096
VALUES_SUFFIX = "#values"

#: Attribute names that hold derived or process-local state (ignored).
_VOLATILE_NAME = re.compile(r"cache|lock|_id$|^_?id_|mutex|thread|(^|_)stale$|in_process", re.IGNORECASE)
_ATOMS = (bool, int, float, type(None))
#: ``(type name prefix, path regex)`` pairs registered by library reducers.
_VOLATILE_PATHS: list[tuple[str, re.Pattern[str]]] = [
    # pyplot's figure number: a restored figure is numbered anew when the number is taken.
    ("matplotlib.figure.Figure", re.compile(r"^\._number$")),
    # bokeh keeps which property values were set explicitly; its deserialiser sets more of them
    # (same values). The tests compare every property's value instead.
    ("bokeh.", re.compile(r"^\._(property_values|unstable_default_values)\b")),
]


def register_volatile(type_prefix: str, path_pattern: str) -> None:
    """Paths under variables of a type named ``type_prefix...`` that change on every restore.

    For a library whose restored objects legitimately differ in some places (a widget gets a
    new comm id): those paths are left out of its fingerprints.
    """
    entry = (type_prefix, re.compile(path_pattern))
    if entry not in _VOLATILE_PATHS:
        _VOLATILE_PATHS.append(entry)


def type_name(obj: Any) -> str:
    cls = type(obj)
    module = getattr(cls, "__module__", "") or ""
    qualname = getattr(cls, "__qualname__", cls.__name__)
    return qualname if module == "builtins" else f"{module}.{qualname}"


def _short(text: str) -> str:
    return text if len(text) <= _DESCRIPTION_LIMIT else text[: _DESCRIPTION_LIMIT - 1] + "…"


def _tensor_like(obj: Any) -> str | None:
    """``shape=(2, 3) dtype=float32`` for numpy arrays and torch tensors (metadata only)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        try:
            text = f"shape={tuple(obj.shape)} dtype={str(obj.dtype).removeprefix('torch.')}"
            if obj.requires_grad:
                text += " requires_grad"
            if obj.is_leaf and obj.grad is not None:
                text += f" grad={tuple(obj.grad.shape)}"
            return text
        except Exception:  # a tensor subclass whose properties fail: describe by type only
            return None
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return f"shape={obj.shape} dtype={obj.dtype}"
    return None


def small_array_digest(obj: Any) -> str | None:
    """A digest of a small NumPy array's values (dtype and shape included), else ``None``.

    Arrays holding Python objects are left out: their bytes are addresses.
    """
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(obj, numpy.ndarray):
        return None
    if obj.nbytes > SMALL_ARRAY_BYTES or obj.dtype.hasobject:
        return None
    digest = hashlib.blake2b(f"{obj.dtype.str}{obj.shape}".encode(), digest_size=8)
    digest.update(obj.tobytes())
    return f"values {digest.hexdigest()}"


def describe(obj: Any) -> str:
    """One line that changes when the object's kind or cheap structure changes."""
    if isinstance(obj, _ATOMS):
        return f"{type(obj).__name__} {obj!r}"
    name = type_name(obj)
    if isinstance(obj, str):
        return f"str {obj!r}" if len(obj) <= SHORT_STR else f"str len={len(obj)}"
    if isinstance(obj, bytes | bytearray):
        return f"{name} len={len(obj)}"
    tensor = _tensor_like(obj)
    if tensor is not None:
        return _short(f"{name} {tensor}")
    if isinstance(obj, dict) and len(obj) <= _SORT_LIMIT:
        # Keys that name process-local state (a lock an object creates lazily) are not counted.
        kept = sum(1 for key in obj if not (isinstance(key, str) and _VOLATILE_NAME.search(key)))
        return f"{name} len={kept}"
    if isinstance(obj, dict | list | tuple | set | frozenset | deque):
        return f"{name} len={len(obj)}"
    return _short(name)


def _children(obj: Any, attribute_limit: int) -> Iterator[tuple[str, Any]]:
    """What a fingerprint looks at below ``obj`` (at most ``attribute_limit`` attributes)."""
    if isinstance(obj, (str, bytes, bytearray, type, *_ATOMS)):
        return
    if _tensor_like(obj) is not None:
        return
    if isinstance(obj, dict):
        if len(obj) > _SORT_LIMIT:
            return  # its length says enough; sorting its keys would cost more than the checkpoint
        keys = sorted((k for k in obj if isinstance(k, str)), key=str)[:MAX_CHILDREN]
        for key in keys:
            if not _VOLATILE_NAME.search(key):
                yield f"[{key}]", obj[key]
        return
    if isinstance(obj, list | tuple | deque):
        for index, item in enumerate(obj):
            if index >= 4:
                break
            yield f"[{index}]", item
        return
    if callable(obj) and not hasattr(obj, "__dict__"):
        return
    attributes = getattr(obj, "__dict__", None)
    if not isinstance(attributes, dict) or isinstance(obj, type(sys)) or len(attributes) > _SORT_LIMIT:
        return
    count = 0
    # Public attributes first: within the entry budget they are what users (and callbacks
    # such as ``stale_callback``) rely on; private ones fill what is left.
    for key in sorted((k for k in attributes if isinstance(k, str)), key=lambda k: (k.startswith("_"), k)):
        if _VOLATILE_NAME.search(key) or (key.startswith("_") and attribute_limit < MAX_ENTRIES):
            continue  # below the variable itself, private attributes are the library's business
        value = attributes[key]
        if callable(value) and not isinstance(value, type):
            # Callbacks: only whether one is set (a function's identity changes on restore).
            yield f".{key}", _Set()
        else:
            yield f".{key}", value
        count += 1
        if count >= attribute_limit:
            break


class _Set:
    """Stands for "some callable is set here"."""


def fingerprint(obj: Any) -> dict[str, str]:
    """The structural fingerprint of ``obj`` (see the module docstring). Never raises."""
    out: dict[str, str] = {}
    volatile = [pattern for prefix, pattern in _VOLATILE_PATHS if type_name(obj).startswith(prefix)]
    queue: deque[tuple[str, Any, int]] = deque([("", obj, 0)])
    seen: set[int] = set()
    while queue and len(out) < MAX_ENTRIES:
        path, value, depth = queue.popleft()
        if any(pattern.search(path) for pattern in volatile):
            continue
        if isinstance(value, _Set):
            out[path] = "callable"
            continue
        try:
            out[path] = describe(value)
            values = small_array_digest(value)
        except Exception:
            out[path] = "?"
            continue
        if values is not None and len(out) < MAX_ENTRIES:
            out[path + VALUES_SUFFIX] = values
        if depth >= MAX_DEPTH or id(value) in seen:
            continue
        seen.add(id(value))
        try:
            # The variable's own attributes first and all of them (within MAX_ENTRIES): that is
            # where a library's pickling drops or blanks things.
            for label, child in _children(value, MAX_ENTRIES if depth == 0 else MAX_CHILDREN):
                queue.append((path + label, child, depth + 1))
        except Exception:  # an object whose __dict__ or items misbehave: stop below it
            continue
    return out


_PLAIN_ATOMS = (str, bytes, int, float, complex, bool, type(None))
_PLAIN_CONTAINERS = (list, tuple, dict, set, frozenset)
#: Strings and bytes up to this size count as plain data.
PLAIN_TEXT_LIMIT = 64 << 10


def plain_data(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` is atoms, or small builtin containers of them (two levels, 64 items).

    Pickle round-trips such values exactly, so they need no fingerprint, and the generic
    rule carries them without probing.
    """
    if isinstance(value, _PLAIN_ATOMS):
        return not isinstance(value, str | bytes) or len(value) <= PLAIN_TEXT_LIMIT
    if depth == 0 or type(value) not in _PLAIN_CONTAINERS or len(value) > 64:
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(plain_data(item, depth - 1) for item in items)


def fingerprint_unless_plain(obj: Any) -> dict[str, str] | None:
    """What the writer records: ``None`` for plain data (nothing to compare), else the fingerprint."""
    return None if plain_data(obj) else fingerprint(obj)


_SEGMENT = re.compile(r"\.[^.\[]+|\[[^\]]*\]")


def _depth(path: str) -> int:
    """How many levels below the variable ``path`` is (``""`` 0, ``".a"`` 1, ``".a[k]"`` 2)."""
    return len(_SEGMENT.findall(path))


def compare(saved: Mapping[str, str], restored: Mapping[str, str]) -> str | None:
    """Why ``restored`` differs from ``saved`` (at most :data:`MAX_REASONS` paths), or ``None``.

    A path missing from ``restored`` counts unless the restored fingerprint was cut short by
    :data:`MAX_ENTRIES` before reaching that path's level.
    """
    reasons = []
    reported: list[str] = []
    # Entries are made breadth first: once the restored fingerprint holds a path of depth d,
    # every path above d was looked at, so one missing there is really gone; below the
    # deepest level it may just not have been reached within MAX_ENTRIES.
    reached = MAX_DEPTH if len(restored) < MAX_ENTRIES else max(map(_depth, restored), default=0) - 1
    for path, before in saved.items():
        after = restored.get(path)
        if after == before or (after is None and _depth(path) > reached):
            continue
        if any(path.startswith(parent) and path[len(parent)] in ".[#" for parent in reported):
            continue  # below a path already named: its own difference says it
        if path.endswith(VALUES_SUFFIX):
            if after is None:
                continue  # nothing to compare with: what changed about the array says it
            reported.append(path)
            reasons.append(f"{path.removesuffix(VALUES_SUFFIX) or 'the value'}: values differ")
            continue
        reported.append(path)
        where = path or "the value"
        if after is None:
            reasons.append(f"{where} missing")
        else:
            reasons.append(f"{where}: {before} -> {after}")
    if not reasons:
        return None
    more = f" (+{len(reasons) - MAX_REASONS} more)" if len(reasons) > MAX_REASONS else ""
    return "; ".join(reasons[:MAX_REASONS]) + more


#: What a reducer may call, at restore time, to state a loss it knows about.
NoteFn = Callable[[str], None]
