"""Writing one checkpoint of a namespace, and committing it atomically.

Memory: nothing is assembled in memory. Each group's pickle stream goes straight to
``data.bin`` through :class:`_DataFile` (the pickler writes frames of at most 64 KiB, plus
large in-band bytes objects as they are), and each out-of-band buffer is written from
its own memory with ``os.write`` on a memoryview. The extra memory a checkpoint needs is
the pickler's working set, not the size of the state. (GPU tensors are the exception:
each group's storages are copied to host memory while that group is written.)

Speed: while ``data.bin`` is written, the digest of each 16 MiB chunk is computed on
worker threads (:class:`~kernelmgr.checkpoint.integrity.DataDigest`), and on Linux the
disk is told to start writing each 16 MiB behind the writer (``sync_file_range``, see
:class:`_Writeback`), so copying into the page cache, hashing and the disk's own writing
overlap and the final ``fsync`` only has the tail left. ``sync_file_range`` is only a
hint about *when* to write: durability still comes from the ``fsync`` of the file and the
directories in the commit protocol, exactly as without it.

Failure of one group (an unpicklable object somewhere in it) rewinds ``data.bin`` to where
the group started (truncate, and restore the running digest from a copy taken there), then
retries its variables one by one, so everything that can be saved is. An ``OSError`` from
the disk aborts the whole checkpoint instead: the partial directory is removed, ``current``
is untouched, and :class:`CheckpointFailed` says what happened and where.

Long because the streaming write, the rewind of a failed group and the commit protocol share one
open file and its running digest.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import pickle
import platform
import shutil
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelmgr.checkpoint import cipher
from kernelmgr.checkpoint.errors import CheckpointFailed
from kernelmgr.checkpoint.fidelity import fingerprint_unless_plain
from kernelmgr.checkpoint.grouping import DEFAULT_MAX_OBJECTS, VariableGroup, group_variables
from kernelmgr.checkpoint.integrity import (
    DIGEST_CHUNK,
    DataDigest,
    DigestMark,
    default_digest_algorithm,
    digest_workers,
    fsync_dir,
    sign,
)
from kernelmgr.checkpoint.layout import (
    ALIGN,
    PARTIAL_PREFIX,
    file_names,
    is_checkpoint_id,
    new_checkpoint_id,
    publish_current,
    read_current,
    remove_stale,
)
from kernelmgr.checkpoint.namespace import is_machinery
from kernelmgr.checkpoint.serialize import GroupPickler
from kernelmgr.checkpoint.sharing import make_kernel_dir
from kernelmgr.core.manifest import GroupRecord, Manifest, VariableRecord

log = logging.getLogger(__name__)

#: ``(fd, data) -> bytes written``, like :func:`os.write`. The seam for fault injection:
#: tests pass one that fails with ``ENOSPC`` part-way, or one that is slow.
WriteFn = Callable[[int, memoryview], int]

#: Libraries whose versions are worth recording when the notebook has imported them.
LIBRARIES = ("numpy", "pandas", "torch", "cloudpickle")

_REASON_LIMIT = 300
_MIB = 1 << 20

#: ``data.bin`` is handed to the disk in ranges of this size as it is written.
WRITEBACK_CHUNK = 16 << 20

#: The most bytes one ``write`` call is given. Bigger calls let Linux (6.x, ext4 and others
#: with large folios) fill the page cache with high-order folios, and a high-order allocation
#: is the one that meets compaction, or memory a VM has handed back to its host (virtio-balloon
#: free page reporting works on 2 MiB blocks): measured on the 2-core VM of
#: docs/benchmarks.md, 1 GiB from a NumPy array took 1.3-3.0 s to write and fsync in 4 or
#: 16 MiB calls and 0.5 s in 1 MiB calls (64 KiB: 0.6-0.7 s). The digest still takes 16 MiB
#: pieces; only the system calls are smaller.
WRITE_CALL = 1 << 20


def type_name(obj: Any) -> str:
    """``module.Qualname`` of ``obj``'s type (just ``Qualname`` for builtins)."""
    cls = type(obj)
    module = getattr(cls, "__module__", "") or ""
    qualname = getattr(cls, "__qualname__", cls.__name__)
    return qualname if module == "builtins" else f"{module}.{qualname}"


def describe_error(exc: BaseException) -> str:
    """``TypeError: cannot pickle 'generator' object``: one line, bounded."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= _REASON_LIMIT else line[: _REASON_LIMIT - 1] + "…"


def library_versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        module = sys.modules.get(name)
        if module is not None:
            found[name] = str(getattr(module, "__version__", "unknown"))
    return found


#: ``sync_file_range`` flags (``<linux/fs.h>``).
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4

#: Errors that mean "this file system cannot take the hint", not "the disk failed".
_NO_HINT_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE})


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


class _Writeback:
    """Has the kernel write ``data.bin`` out in 16 MiB ranges behind the writer.

    Without it the kernel leaves a big checkpoint dirty in the page cache until the final
    ``fsync``, which then waits for the whole file (0.6 s per GiB here) while the CPU
    idles. With it, each range is queued for writeback as soon as it is written, and the
    writer waits for the range *before* the last one to be written, which keeps at most
    about 32 MiB in flight: the disk writes while the next ranges are copied and hashed,
    and a big checkpoint never fills memory with dirty pages. It only moves writing
    earlier; ``fsync`` remains what makes the file durable, and it still reports any
    write error. Where ``sync_file_range`` is missing or not supported it does nothing.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.func = _sync_file_range()
        self.queued = 0  # bytes before this offset have been queued for writeback
        self.pending: list[tuple[int, int]] = []

    def advance(self, end: int) -> None:
        """``data.bin`` now holds ``end`` bytes: queue the next range once it is big enough."""
        if self.func is None or end - self.queued < WRITEBACK_CHUNK:
            return
        self._call(self.queued, end - self.queued, _SFR_WRITE)
        self.pending.append((self.queued, end - self.queued))
        self.queued = end
        if len(self.pending) > 2:
            offset, length = self.pending.pop(0)
            self._call(offset, length, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)

    def rewind(self, offset: int) -> None:
        self.queued = min(self.queued, offset)
        self.pending = [(o, n) for o, n in self.pending if o + n <= offset]

    def _call(self, offset: int, length: int, flags: int) -> None:
        assert self.func is not None
        if self.func(self.fd, offset, length, flags) == 0:
            return
        code = ctypes.get_errno()
        if code in _NO_HINT_ERRNOS:
            self.func = None
            return
        raise _DiskError(OSError(code, os.strerror(code)))


class _DiskError(Exception):
    """Internal: an ``OSError`` from writing, kept apart from errors raised by ``__reduce__``."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _Mark:
    offset: int
    digest: DigestMark


#: ``(fd of data.bin, offset)``: every byte of ``data.bin`` before ``offset`` is written and final.
Settled = Callable[[int, int], None]


class _DataFile:
    """``data.bin`` being written: the pickler's file object, and the buffer writer.

    Counts bytes, feeds the data digest, and can rewind to a mark. With ``on_settled`` it also
    says how far the file is final: a failed group rewinds to where it started, so the bytes of
    a group are final once its pickle stream is whole (its buffers are final as they are written),
    and an object store's upload may send them while the rest is still being written.
    """

    def __init__(
        self,
        fd: int,
        write_fn: WriteFn,
        digest: DataDigest,
        on_written: Callable[[int], None] | None = None,
        data_key: bytes | None = None,
        on_settled: Settled | None = None,
        writeback: bool = True,
    ) -> None:
        self.fd = fd
        # Encrypted at rest: each write call's bytes go through one reused buffer, encrypted at
        # their offset (CTR), so a rewind or a short write needs nothing special.
        self.data_key = data_key
        self._sealed = bytearray(WRITE_CALL) if data_key is not None else None
        self.on_written = on_written  # told the bytes written after each piece (a progress file)
        self.on_settled = on_settled
        self.settled = 0  # bytes before this offset can no longer be rewound
        self.stable = True  # false while a group's pickle stream is written (it may be rewound)
        self.write_fn = write_fn
        self.writeback = _Writeback(fd)
        if not writeback:
            self.writeback.func = None
        self.offset = 0
        self.written = 0  # handed to the OS, including rewound groups and a failed last write
        self.digest = digest
        self.write_seconds = 0.0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        total = view.nbytes
        # Piece by piece, so the digest of one piece (on a worker thread) overlaps the
        # write of the next.
        for start in range(0, total, DIGEST_CHUNK):
            piece = view[start : start + DIGEST_CHUNK]
            started = time.perf_counter()
            try:
                rest = piece
                while rest:
                    call = rest[:WRITE_CALL]
                    if self.data_key is not None and self._sealed is not None:
                        at = self.offset + start + len(piece) - len(rest)
                        sealed = memoryview(self._sealed)[: len(call)]
                        cipher.crypt_into(self.data_key, at, call, sealed)
                        call = sealed
                    count = self.write_fn(self.fd, call)
                    self.written += count
                    rest = rest[count:]
                self.writeback.advance(self.offset + start + len(piece))
            except OSError as exc:
                raise _DiskError(exc) from exc
            finally:
                self.write_seconds += time.perf_counter() - started
            self.digest.update(piece)
            if self.on_written is not None:
                self.on_written(self.written)
            if self.stable:
                self._settle(self.offset + start + len(piece))
        self.offset += total
        return total

    def _settle(self, end: int) -> None:
        if self.on_settled is not None and end > self.settled:
            self.settled = end
            self.on_settled(self.fd, end)

    def unstable(self) -> None:
        """A group's pickle stream starts: what follows may be rewound until :meth:`settle`."""
        self.stable = False

    def settle(self) -> None:
        """Everything written so far is final."""
        self.stable = True
        self._settle(self.offset)

    def pad(self) -> None:
        gap = -self.offset % ALIGN
        if gap:
            self.write(bytes(gap))

    def mark(self) -> _Mark:
        return _Mark(self.offset, self.digest.mark())

    def rollback(self, mark: _Mark) -> None:
        assert mark.offset >= self.settled, "a rewind past bytes already settled"
        try:
            os.ftruncate(self.fd, mark.offset)
            os.lseek(self.fd, mark.offset, os.SEEK_SET)
        except OSError as exc:
            raise _DiskError(exc) from exc
        self.offset = mark.offset
        self.writeback.rewind(mark.offset)
        self.digest.rollback(mark.digest)


@dataclass
class _GroupResult:
    record: GroupRecord | None
    error: BaseException | None
    carried: bool = False  # a library reducer or the generic rule was used (see _save_all's last try)


def _save_group(
    data: _DataFile, namespace: dict[str, Any], names: list[str], group_id: int, *, carry_dropped: bool = True
) -> _GroupResult:
    """Pickle ``names`` as one stream plus buffers at the end of ``data``; rewind on failure."""
    mark = data.mark()
    buffers: list[memoryview] = []

    def take(buffer: pickle.PickleBuffer) -> bool:
        try:
            buffers.append(buffer.raw())
        except BufferError:  # not contiguous: let the pickler copy it in-band
            return True
        return False

    # The pickler lives until the buffers are written: it owns host copies of GPU storages.
    pickler = GroupPickler(data, namespace, take, carry_dropped=carry_dropped)
    data.unstable()
    try:
        pickler.dump({name: namespace[name] for name in names})
    except _DiskError:
        raise
    except Exception as exc:
        data.rollback(mark)
        data.settle()
        return _GroupResult(None, exc, pickler.carried)
    data.settle()
    pickle_length = data.offset - mark.offset
    placed = []
    for view in buffers:
        data.pad()
        placed.append((data.offset, view.nbytes))
        data.write(view)
    del pickler
    return _GroupResult(GroupRecord(group_id, list(names), mark.offset, pickle_length, placed), None)


def _failure_message(exc: OSError, written: int, expected: int, kernel_dir: Path) -> str:
    progress = f"wrote {written / _MIB:.1f} of {max(expected, written) / _MIB:.1f} MiB"
    if exc.errno == errno.ENOSPC:
        return (
            f"no space left on device while writing the checkpoint ({progress}) — free space in {kernel_dir}"
        )
    if exc.errno == errno.EDQUOT:
        return f"disk quota exceeded while writing the checkpoint ({progress}) — free space in {kernel_dir}"
    detail = exc.strerror or str(exc)
    where = f" ({progress})" if written else ""
    return f"could not write the checkpoint in {kernel_dir}: {detail}{where}"


def _create(path: Path, mode: int = 0o600) -> int:
    # Read and write: an upload streamed while the file is written reads it through this fd.
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)


@dataclass
class _DataResult:
    records: dict[str, VariableRecord]
    groups: list[GroupRecord]
    size: int
    digest: str
    digest_algorithm: str
    timings: dict[str, float]


def _write_data(
    ns: dict[str, Any], groups: list[VariableGroup], data: _DataFile, durable: bool = True
) -> _DataResult:
    """Fill ``data.bin`` group by group, then fsync it (unless not ``durable``)."""
    started = time.perf_counter()
    records, group_records = _save_all(data, ns, groups)
    serialize = time.perf_counter() - started - data.write_seconds
    started = time.perf_counter()
    if durable:
        os.fsync(data.fd)
    fsync = time.perf_counter() - started
    started = time.perf_counter()
    digest = data.digest.hexdigest()  # the workers' tail, hashed while fsync waited
    return _DataResult(
        records,
        group_records,
        data.offset,
        digest,
        data.digest.algorithm,
        {
            "serialize": serialize,
            "write": data.write_seconds,
            "fsync": fsync,
            "digest": time.perf_counter() - started,
        },
    )


def _committed_id(directory: Path) -> str | None:
    try:
        return read_current(directory)
    except (ValueError, OSError):
        return None


def write_checkpoint(
    kernel_dir: str | os.PathLike[str],
    namespace: Mapping[str, Any],
    *,
    key: bytes,
    owner: str,
    kernel_id: str,
    skip: Collection[str] = (),
    names: Sequence[str] | None = None,
    write_fn: WriteFn = os.write,
    max_objects: int = DEFAULT_MAX_OBJECTS,
    prune: bool = True,
    cells: Sequence[Mapping[str, Any]] | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    data_key: bytes | None = None,
    checkpoint_id: str | None = None,
    on_settled: Settled | None = None,
    durable: bool = True,
) -> Manifest:
    """Checkpoint the user variables of ``namespace`` into ``kernel_dir`` and commit it.

    ``data_key``: the kernel's key (a file system with encryption at rest): ``data.bin.aes`` and
    ``manifest.json.aes`` are written encrypted under this checkpoint's key
    (:func:`kernelmgr.checkpoint.cipher.checkpoint_key`); the digest and the HMAC cover the plaintext.
    ``checkpoint_id``: the id to write (one the server chose, when it started the checkpoint's
    upload to an object store before the checkpoint); a new one otherwise. ``on_settled(fd,
    offset)`` hears how far ``data.bin`` is final while it is written (:class:`_DataFile`): the
    agent streams the parts of an upload from there. ``durable=False`` skips the fsync of
    ``data.bin`` and the writeback hints: for a local copy that is only scratch space on the way
    to an object store, where the commit that counts is the store's.

    ``on_progress(checkpoint_id, written, expected)`` hears how far the data file has got (the
    agent's progress file, shown while a kernel hibernates); ``expected`` is the estimate made
    before pickling, so ``written`` may pass it.

    ``cells`` is the agent's cell record; it goes into the signed manifest, so it commits
    (or not) with the variables.

    ``prune=False`` leaves the superseded checkpoint on disk after the commit (it is no longer
    ``current``, so it is never read): deleting a 1 GiB file takes ~0.4 s, which the hibernate
    path defers until the kernel has stopped (:meth:`CheckpointStore.prune`); the next write
    removes it anyway.

    ``names`` are the variables to save (the agent passes
    :meth:`~kernelmgr.checkpoint.namespace.UserNamespace.user_names`); without it every name
    except machinery (:func:`~kernelmgr.checkpoint.namespace.is_machinery`) and ``skip`` is.
    Returns the committed manifest. Raises :class:`CheckpointFailed` when the disk fails;
    the previously committed checkpoint then stays committed.

    ``timings["total"]`` runs until the manifest is complete; the commit that follows
    (a rename, ``current`` replaced, a few small fsyncs) is logged, not recorded.
    """
    started = time.perf_counter()
    directory = Path(kernel_dir)
    ns = dict(namespace) if not isinstance(namespace, dict) else namespace
    if names is None:
        names = [
            name for name in list(ns) if isinstance(name, str) and not is_machinery(name) and name not in skip
        ]
    else:
        names = [name for name in names if name in ns and name not in skip]
    groups = group_variables(ns, names, max_objects=max_objects)
    grouping = time.perf_counter() - started
    expected = sum(group.approx_bytes for group in groups)

    created = time.time()
    if checkpoint_id is None:
        checkpoint_id = new_checkpoint_id(created)
    elif not is_checkpoint_id(checkpoint_id):
        raise ValueError(f"{checkpoint_id[:80]!r} is not a checkpoint id")
    sealing = cipher.checkpoint_key(data_key, checkpoint_id) if data_key is not None else None
    data_name, manifest_name = file_names(sealing is not None)
    partial = directory / f"{PARTIAL_PREFIX}{checkpoint_id}"
    final = directory / checkpoint_id
    data: _DataFile | None = None
    publishing = False
    try:
        make_kernel_dir(directory, 0o777, exist_ok=True)  # shared with a non-root server: 2770
        remove_stale(directory, keep=_committed_id(directory))
        make_kernel_dir(partial, 0o777)
        fd = _create(partial / data_name)
        try:
            with digest_workers() as workers:
                told = None
                if on_progress is not None:
                    progress = on_progress

                    def told(written: int) -> None:
                        progress(checkpoint_id, written, expected)

                digest = DataDigest(workers, default_digest_algorithm())
                data = _DataFile(
                    fd,
                    write_fn,
                    digest,
                    told,
                    None if sealing is None else cipher.data_key(sealing),
                    on_settled,
                    writeback=durable,
                )
                result = _write_data(ns, groups, data, durable)
        finally:
            os.close(fd)
        manifest = Manifest(
            checkpoint_id=checkpoint_id,
            kernel_id=kernel_id,
            owner=owner,
            created=created,
            python=platform.python_version(),
            libraries=library_versions(),
            variables=[result.records[name] for name in names],
            groups=result.groups,
            totals={
                "variables": len(names),
                "saved": sum(1 for r in result.records.values() if r.status == "saved"),
                "skipped": sum(1 for r in result.records.values() if r.status == "skipped"),
                "groups": len(result.groups),
                "buffers": sum(len(g.buffers) for g in result.groups),
                "bytes": result.size,
            },
            data_digest=result.digest,
            digest_algorithm=result.digest_algorithm,
            cells=[dict(cell) for cell in cells or ()],
        )
        timings = {"grouping": grouping, **result.timings, "total": time.perf_counter() - started}
        manifest.timings = {name: round(seconds, 6) for name, seconds in timings.items()}
        sign(key, manifest)
        _write_manifest(
            partial / manifest_name, manifest, None if sealing is None else cipher.manifest_key(sealing)
        )
        fsync_dir(partial)
        os.rename(partial, final)
        fsync_dir(directory)
        publishing = True
        publish_current(directory, checkpoint_id)
    except BaseException as exc:
        # Once `current` names the new checkpoint it is the committed one: keep it.
        committed = publishing and _committed_id(directory) == checkpoint_id
        if not committed:
            _discard(partial, final)
        written = data.written if data is not None else 0
        if isinstance(exc, _DiskError):
            raise CheckpointFailed(_failure_message(exc.error, written, expected, directory)) from exc.error
        if isinstance(exc, OSError) and committed:
            raise CheckpointFailed(
                f"the checkpoint {checkpoint_id} was committed but could not be confirmed on disk: {exc}"
            ) from exc
        if isinstance(exc, OSError):
            raise CheckpointFailed(_failure_message(exc, written, expected, directory)) from exc
        raise

    if prune:
        remove_stale(directory, keep=checkpoint_id)
    log.info(
        "checkpoint %s: %d saved, %d skipped, %.1f MiB in %.2f s (%.2f s with the commit)",
        checkpoint_id,
        manifest.totals["saved"],
        manifest.totals["skipped"],
        manifest.data_bytes / _MIB,
        manifest.timings["total"],
        time.perf_counter() - started,
    )
    return manifest


def _save_all(
    data: _DataFile, ns: dict[str, Any], groups: list[VariableGroup]
) -> tuple[dict[str, VariableRecord], list[GroupRecord]]:
    records: dict[str, VariableRecord] = {}
    group_records: list[GroupRecord] = []

    def saved(record: GroupRecord) -> None:
        group_records.append(record)
        for name in record.names:
            records[name] = VariableRecord(
                name,
                type_name(ns[name]),
                "saved",
                "",
                group=record.id,
                bytes=record.nbytes,
                fingerprint=fingerprint_unless_plain(ns[name]),
            )

    for group in groups:
        result = _save_group(data, ns, group.names, len(group_records))
        if result.record is not None:
            saved(result.record)
            continue
        if len(group.names) > 1:
            log.info("group %s failed (%s); saving its variables one by one", group.names, result.error)
        for name in group.names:
            single = result if len(group.names) == 1 else _save_group(data, ns, [name], len(group_records))
            if single.record is None and single.carried:
                # Last try as plain cloudpickle, without library reducers and carried attributes
                # (one that fails in the stream, or a reducer gone wrong, must not lose the variable).
                single = _save_group(data, ns, [name], len(group_records), carry_dropped=False)
            if single.record is not None:
                saved(single.record)
            else:
                error = single.error or RuntimeError("not saved")
                records[name] = VariableRecord(name, type_name(ns[name]), "skipped", describe_error(error))
    return records, group_records


def _write_manifest(path: Path, manifest: Manifest, key: bytes | None = None) -> None:
    fd = _create(path, 0o640)  # the server reads manifests; data.bin stays 0600
    try:
        body = manifest.to_json().encode("utf-8")
        view = memoryview(body if key is None else cipher.crypt(key, 0, body))
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(path)
