"""Reading the committed checkpoint back into a namespace, and the restore report.

Order matters for safety: the manifest is verified (HMAC, owner, kernel, layout), then
*all* of ``data.bin`` is read and its digest compared with the manifest's, and only then
does the first ``pickle.loads`` run. Reading everything first costs no extra memory: the
bytes read are the very buffers the restored objects will use.

Memory: every region of ``data.bin`` is read with ``readinto`` straight into its own
buffer, and the out-of-band buffers are handed to ``pickle.loads(buffers=...)`` as
writable memoryviews, so numpy arrays, pandas blocks and CPU tensors are restored *on*
those buffers, writable, with no second copy. One buffer per region (not one for the
whole file) lets a variable the user deletes later free its memory alone. Regions under
1 MiB are ``bytearray``s; bigger ones are private anonymous mappings (:func:`_allocate`):
``bytearray(n)`` zero-fills its memory in one pass before the read can start (0.7 s per
GiB here, longer than reading the file from the page cache), while a fresh mapping is
zeroed by the kernel page by page as ``readinto`` first touches it.

Speed: the digest of each 16 MiB chunk runs on worker threads as soon as the chunk has
been read, while the next one is read, so on a machine with two cores or more the
restore costs about reading plus half of hashing, not their sum.

Each group is unpickled on its own: a group that fails (a module that no longer imports,
a class that changed) is reported and the others are still restored. Each restored value
is compared with the fingerprint the writer recorded (:mod:`~kernelmgr.checkpoint.fidelity`);
one known to differ is listed in the report's ``differs`` (``{name: why}``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import mmap
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kernelmgr.checkpoint import cipher
from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.fidelity import compare, fingerprint
from kernelmgr.checkpoint.integrity import (
    DIGEST_CHUNK,
    DataDigest,
    DigestUnavailable,
    KnownDigest,
    digest_workers,
    digests_match,
)
from kernelmgr.checkpoint.layout import DATA_FILE, file_names
from kernelmgr.checkpoint.serialize import RestoreContext, restoring
from kernelmgr.checkpoint.verify import (
    Untrusted,
    check_layout,
    load_verified_checkpoint,
    load_verified_manifest,
    refuse,
)
from kernelmgr.checkpoint.writer import describe_error, library_versions
from kernelmgr.core.manifest import GroupRecord, Manifest, VariableRecord, iso_utc

#: Memory one region of ``data.bin`` is read into (see :func:`_allocate`), or a view of the
#: region mapped from the file (:func:`_map_region`).
Buffer = bytearray | mmap.mmap | memoryview

#: One group's bytes: its pickle stream and its out-of-band buffers, in order.
Payload = dict[int, tuple[Buffer, list[Buffer]]]

#: Regions at least this big are read into an anonymous mapping instead of a bytearray.
MAPPED_MIN = 1 << 20


def _allocate(length: int) -> Buffer:
    """Writable memory for ``length`` bytes that are about to be overwritten by a read.

    Big regions get a *private* anonymous mapping (never ``MAP_SHARED``: a forked child's
    writes would show up in the parent): the kernel hands out zeroed pages on first touch,
    so nothing is written twice. The mapping is unmapped when the last object using it
    (the memoryview under a restored array) goes away, like a bytearray is freed.

    Transparent huge pages are left to the system's policy (``always`` gives them, the
    common default ``madvise`` does not), not asked for: a huge page is a 2 MiB allocation,
    cheap where such blocks were just freed, slow where memory is fragmented or a VM has
    handed its free memory back to the host in 2 MiB blocks (virtio-balloon free page
    reporting), which is the state a kernel resumed after a long idle meets. Measured on the
    2-core VM of docs/benchmarks.md, resuming 1 GiB with ``MADV_HUGEPAGE``: 0.79 s right
    after the hibernation freed the memory (1.05 s without), 3.1 s with the page cache
    dropped (1.36 s without): the loss was much larger than the gain.
    """
    private = getattr(mmap, "MAP_PRIVATE", None)
    if length < MAPPED_MIN or private is None:
        return bytearray(length)
    return mmap.mmap(-1, length, flags=private | getattr(mmap, "MAP_ANONYMOUS", 0))


def _map_region(file: io.RawIOBase, offset: int, length: int) -> memoryview | None:
    """``length`` bytes of ``file`` from ``offset``, mapped copy-on-write; ``None`` if it cannot be.

    Why: reading 1 GiB into new anonymous memory costs a page allocation per 4 KiB; on the
    2-core VM of docs/benchmarks.md read + digest took 0.70-0.95 s from a warm page cache and
    1.4-1.5 s cold, where mapping the file and digesting the mapping took 0.14 s and 0.5 s.
    A private (``MAP_PRIVATE``) writable mapping reads through the page cache and copies a page
    only when the notebook first writes to it; the file itself is never written.

    Trade-offs, which is why the server asks for it (``ELASTIC_RESTORE_MAPPED=1``) only where
    they hold: a page not yet written comes from the file, so whoever can rewrite ``data.bin``
    after the digest was checked changes the restored array (local kernels: only the server's
    own OS user can); and a checkpoint pruned while a kernel still maps it keeps its disk space
    until the kernel lets go of the arrays or exits (one checkpoint per running kernel at most).
    Regions start on 64-byte boundaries: the mapping starts at the page below and the view
    skips the difference.
    """
    page = mmap.ALLOCATIONGRANULARITY
    start = offset - offset % page
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None:
        return None
    try:
        mapping = mmap.mmap(
            file.fileno(),
            offset - start + length,
            flags=flags,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=start,
        )
    except (OSError, ValueError):  # a filesystem that cannot map: read as usual
        return None
    return memoryview(mapping)[offset - start : offset - start + length]


def _digest_pieces(
    target: memoryview,
    digest: DataDigest,
    on_piece: Callable[[int], None] | None = None,
    fill: Callable[[memoryview], None] | None = None,
) -> None:
    """Feed ``target`` to the digest piece by piece, filling each piece first with ``fill``
    (a read) unless its bytes are there already (a mapped region, read as it is hashed), so
    hashing overlaps reading.

    ``on_piece(bytes of target done)`` after each piece: progress within one large buffer.
    """
    for start in range(0, len(target), DIGEST_CHUNK):
        piece = target[start : start + DIGEST_CHUNK]
        if fill is not None:
            fill(piece)
        digest.update(piece)
        if on_piece is not None:
            on_piece(start + len(piece))


def _readinto_fully(
    file: io.RawIOBase,
    target: memoryview,
    what: str,
    digest: DataDigest,
    on_piece: Callable[[int], None] | None = None,
    data_key: bytes | None = None,
) -> None:
    """Fill ``target`` from ``file``, digesting it as it arrives (:func:`_digest_pieces`);
    with ``data_key`` each piece is decrypted in place at its offset before it is digested."""

    def fill(piece: memoryview) -> None:
        at = file.tell() if data_key is not None else 0
        rest = piece
        while rest:
            count = file.readinto(rest)
            if not count:
                raise Untrusted(f"{DATA_FILE} ended early while reading {what}")
            rest = rest[count:]
        if data_key is not None:
            cipher.crypt_in_place(data_key, at, piece)

    _digest_pieces(target, digest, on_piece, fill)


def _report_read(on_read: Callable[[int, int], None], base: int, total: int, done: int) -> None:
    on_read(base + done, total)


def read_payload(
    path: Path,
    manifest: Manifest,
    on_read: Callable[[int, int], None] | None = None,
    map_buffers: bool = False,
    data_key: bytes | None = None,
    data_digest: str | None = None,
) -> Payload:
    """All group regions of ``data.bin``, read once and checked against the manifest digest.

    ``data_key``: the file is encrypted at rest (AES-CTR); every region is read into private
    memory and decrypted there (nothing is mapped: the file holds ciphertext).

    ``on_read(bytes read, bytes in all)`` is called after each region (the resume's progress).
    With ``map_buffers``, raw buffers of 1 MiB or more are mapped from the file instead of read
    (:func:`_map_region`); pickle streams are always read into private memory. ``data_digest``:
    the digest of this very file computed as it was downloaded (:class:`ChunkDigests`), compared
    instead of hashing the file again.
    Raises :class:`Untrusted` on a short file, a size mismatch or a digest mismatch.
    """
    slots: list[tuple[int, int, int, int]] = []  # offset, length, group id, slot (-1 = pickle)
    for group in manifest.groups:
        slots.append((group.pickle_offset, group.pickle_length, group.id, -1))
        slots.extend((offset, length, group.id, i) for i, (offset, length) in enumerate(group.buffers))
    slots.sort()
    payload: Payload = {
        group.id: (bytearray(), [bytearray()] * len(group.buffers)) for group in manifest.groups
    }
    try:
        file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below, readinto on the raw file
    except FileNotFoundError:
        raise Untrusted(f"{DATA_FILE} is missing") from None
    with file, digest_workers() as workers:
        digest = (
            DataDigest(workers, manifest.digest_algorithm)
            if data_digest is None
            else KnownDigest(manifest.digest_algorithm, data_digest)
        )
        check_layout(manifest, os.fstat(file.fileno()).st_size)
        position = 0
        for offset, length, group_id, slot in [*slots, (manifest.data_bytes, 0, -1, -2)]:
            if position < offset:  # padding, under ALIGN bytes (check_layout made sure)
                _readinto_fully(
                    file, memoryview(bytearray(offset - position)), "padding", digest, data_key=data_key
                )
                position = offset
            if slot == -2:
                break
            piece_read = None
            if on_read is not None:
                piece_read = functools.partial(_report_read, on_read, position, manifest.data_bytes)
            mapped = None
            if map_buffers and data_key is None and slot >= 0 and length >= MAPPED_MIN:
                mapped = _map_region(file, offset, length)
            if mapped is not None:
                buffer: Buffer = mapped
                _digest_pieces(mapped, digest, piece_read)
                file.seek(offset + length)
            else:
                buffer = _allocate(length)
                _readinto_fully(file, memoryview(buffer), f"group {group_id}", digest, piece_read, data_key)
            position += length
            if slot == -1:
                payload[group_id] = (buffer, payload[group_id][1])
            else:
                payload[group_id][1][slot] = buffer
        if file.read(1):
            raise Untrusted(f"{DATA_FILE} is longer than the manifest says")
        actual = digest.hexdigest()
    if not digests_match(manifest.data_digest, actual):
        raise Untrusted(f"{DATA_FILE} does not match the manifest's digest: it was modified or corrupted")
    return payload


#: Libraries whose import is slow enough to be worth starting while ``data.bin`` is read.
PREWARM_LIBRARIES = ("torch",)


def _prewarm(manifest: Manifest) -> threading.Thread | None:
    return prewarm_imports(manifest.libraries, PREWARM_LIBRARIES)


def prewarm_imports(saved_with: Iterable[str], libraries: tuple[str, ...]) -> threading.Thread | None:
    """Import, on a thread, the slow libraries the checkpoint was saved with.

    Why: a resumed kernel is a new process; importing torch takes seconds, as long as reading
    gigabytes from the page cache. The read (``readinto``) and the digest (hashlib) release the
    GIL, so the import overlaps them. Only *importing* is done early, never unpickling: the
    data is still verified before any object is built. The caller joins the thread before it
    unpickles, so the two threads never import at once. A failed import is ignored here; the
    group that needs the module reports it when it is unpickled. A download from an object store
    (the agent) imports every library in :data:`~kernelmgr.checkpoint.writer.LIBRARIES` this way
    while the ranges arrive (the network wait is long enough for numpy and pandas too).
    """
    wanted = _not_imported(saved_with, libraries)
    if not wanted:
        return None
    thread = threading.Thread(
        target=import_saved, args=(wanted, libraries), name="checkpoint-prewarm", daemon=True
    )
    thread.start()
    return thread


def import_saved(saved_with: Iterable[str], libraries: tuple[str, ...]) -> None:
    """Import, here and now, those of ``libraries`` the checkpoint was saved with (only names on
    that list, whatever the manifest says); a failed import is left for the unpickling to report."""
    for name in _not_imported(saved_with, libraries):
        with contextlib.suppress(Exception):
            __import__(name)


def _not_imported(saved_with: Iterable[str], libraries: tuple[str, ...]) -> list[str]:
    saved = set(saved_with)  # the manifest's libraries
    return [name for name in libraries if name in saved and name not in sys.modules]


def _version_warnings(manifest: Manifest) -> list[str]:
    warnings = []
    written = manifest.python.split(".")[:2]
    running = platform.python_version_tuple()[:2]
    if written != list(running):
        warnings.append(
            f"checkpoint written by Python {manifest.python}, this kernel runs {platform.python_version()}: "
            "functions and classes defined in the notebook may not load"
        )
    now = library_versions()
    for name, version in sorted(manifest.libraries.items()):
        if name in now and now[name] != version:
            warnings.append(f"{name} {version} wrote this checkpoint, {now[name]} reads it")
    return warnings


def _load_group(group: GroupRecord, pickled: Buffer, buffers: list[Buffer]) -> dict[str, Any]:
    import pickle

    values = pickle.loads(pickled, buffers=[memoryview(b) for b in buffers])
    if not isinstance(values, dict) or list(values) != group.names:
        raise ValueError(f"group {group.id} holds {sorted(values) if isinstance(values, dict) else values!r}")
    return values


def _differences(values: dict[str, Any], records: dict[str, VariableRecord]) -> dict[str, str]:
    """``{name: why}`` for restored values whose fingerprint differs from the saved one."""
    found = {}
    for name, value in values.items():
        record = records.get(name)
        if record is None or record.fingerprint is None:
            continue  # written before fingerprints existed: nothing to compare with
        why = compare(record.fingerprint, fingerprint(value))
        if why is not None:
            found[name] = why
    return found


def restore_checkpoint(
    kernel_dir: str | os.PathLike[str],
    namespace: dict[str, Any],
    *,
    key: bytes,
    owner: str,
    kernel_id: str,
    expected_checkpoint: str | None = None,
    cuda_count: int | None = None,
    on_read: Callable[[str, int, int], None] | None = None,
    map_buffers: bool = False,
    data_key: bytes | None = None,
    data_digest: str | None = None,
    data_file: Path | None = None,
) -> dict[str, Any] | None:
    """Restore the committed checkpoint's variables into ``namespace``; return the report.

    ``None`` when nothing was ever committed. Raises :class:`CheckpointRefused` (after
    quarantining the checkpoint) when it cannot be trusted; nothing has been unpickled
    then. ``expected_checkpoint`` is the id the server recorded when the kernel hibernated (the
    one the kernel reported): that checkpoint is read by its id, so neither a stale ``current``
    nor an older checkpoint put back in place (which the HMAC alone would accept: same owner,
    same kernel) is restored instead. ``cuda_count`` overrides the
    number of visible GPUs (for tests). ``on_read(checkpoint id, bytes read, bytes in all)``
    follows the read of ``data.bin`` (the resume's progress). ``map_buffers``: map big raw
    buffers from the file instead of reading them (:func:`_map_region` says when that is safe).
    ``data_key``: the kernel's key, for checkpoints encrypted at rest (``.aes`` files); one
    written before encryption was switched on is read as it is.
    ``data_digest``: the digest of ``data.bin`` computed while it was downloaded into this
    kernel's own scratch folder (only it can rewrite it), compared with the manifest's before
    anything is unpickled, as a digest computed here would be. ``data_file``: where that
    download put ``data.bin`` when not in the checkpoint's folder (a memory file).
    """
    started = time.perf_counter()
    directory = Path(kernel_dir)
    if data_file is not None and expected_checkpoint is None:
        raise ValueError("a data_file is read for the checkpoint it was downloaded for: name it")
    if expected_checkpoint is None:
        manifest = load_verified_manifest(directory, key, owner, kernel_id, data_key)
        if manifest is None:
            return None
    else:
        # By its id, never through ``current``: that may lag (a shared file system's cache) or
        # have been put back to an older checkpoint; the id is the one the server recorded.
        manifest = load_verified_checkpoint(
            directory, key, owner, kernel_id, expected_checkpoint, data_key, data_file
        )
        if manifest is None:
            raise CheckpointRefused(
                f"no committed checkpoint was found in {directory}, "
                f"but the server expected {expected_checkpoint}"
            )
    verified = time.perf_counter()
    prewarm = _prewarm(manifest)
    try:
        checkpoint_id = manifest.checkpoint_id
        sealed = directory / checkpoint_id / file_names(True)[0]
        encrypted = data_key is not None and sealed.exists()
        plain = data_file if data_file is not None else directory / checkpoint_id / DATA_FILE
        payload = read_payload(
            sealed if encrypted else plain,
            manifest,
            None if on_read is None else lambda done, total: on_read(checkpoint_id, done, total),
            map_buffers=map_buffers,
            data_key=cipher.data_key(cipher.checkpoint_key(data_key, checkpoint_id))
            if encrypted and data_key is not None
            else None,
            data_digest=data_digest,
        )
    except Untrusted as exc:
        raise refuse(directory, manifest.checkpoint_id, str(exc)) from None
    except DigestUnavailable as exc:
        raise CheckpointRefused(str(exc)) from None  # kept in place: the checkpoint is not at fault
    finally:
        read_done = time.perf_counter()
        if prewarm is not None:
            prewarm.join()
    imported = time.perf_counter()

    context = RestoreContext(namespace, cuda_count=cuda_count)
    restored: list[str] = []
    not_restored = [
        {
            "name": v.name,
            "type": v.type,
            "reason": f"{v.type.rsplit('.', 1)[-1]}: {v.reason}",
            "stage": "save",
        }
        for v in manifest.skipped()
    ]
    remapped: list[str] = []
    differs: dict[str, str] = {}
    records = {v.name: v for v in manifest.variables}
    for group in manifest.groups:
        pickled, buffers = payload.pop(group.id)
        seen = len(context.remapped)
        try:
            with restoring(context):
                values = _load_group(group, pickled, buffers)
        except Exception as exc:
            reason = f"could not be loaded: {describe_error(exc)}"
            types = {v.name: v.type for v in manifest.variables}
            not_restored.extend(
                {"name": n, "type": types.get(n, ""), "reason": reason, "stage": "load"} for n in group.names
            )
            continue
        finally:
            del pickled, buffers
        namespace.update(values)
        restored.extend(group.names)
        differs.update(_differences(values, records))
        for note in dict.fromkeys(context.remapped[seen:]):
            remapped.append(f"{', '.join(group.names)}: {note}")

    loaded = time.perf_counter()
    order = {v.name: i for i, v in enumerate(manifest.variables)}
    restored.sort(key=lambda name: order.get(name, sys.maxsize))
    not_restored.sort(key=lambda item: order.get(item["name"], sys.maxsize))
    return {
        "checkpoint": manifest.checkpoint_id,
        "created": iso_utc(manifest.created),
        "restored": restored,
        "not_restored": not_restored,
        "bytes": manifest.data_bytes,
        "seconds": round(time.perf_counter() - started, 3),
        # Where the time went (logged and benchmarked, never asserted): manifest checks, the
        # read + digest of data.bin, the wait for the prewarmed imports after it, unpickling
        # (device copies included).
        "timings": {
            "verify_manifest": round(verified - started, 3),
            "read_and_digest": round(read_done - verified, 3),
            "import_wait": round(imported - read_done, 3),
            "unpickle": round(loaded - imported, 3),
        },
        "remapped": remapped,
        "differs": {name: differs[name] for name in restored if name in differs},
        "recomputed": [],  # filled by the agent (re-running recorded cells)
        "warnings": _version_warnings(manifest),
        "refused": None,
        "quarantined": None,
    }


def refused_report(exc: CheckpointRefused, seconds: float = 0.0) -> dict[str, Any]:
    """The report for a restore that loaded nothing because the checkpoint was refused."""
    return {
        "checkpoint": None,
        "created": None,
        "restored": [],
        "not_restored": [],
        "bytes": 0,
        "seconds": round(seconds, 3),
        "remapped": [],
        "differs": {},
        "recomputed": [],
        "warnings": [],
        "refused": exc.reason,
        "quarantined": str(exc.quarantined) if exc.quarantined is not None else None,
    }
