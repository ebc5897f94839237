"""The download of a checkpoint to restore from an object store, started as the kernel process starts.

Why: a resume is a new process. Python, ipykernel and the agent take about a second to import and
start, and the agent (an IPython extension) loads last; a download it began itself would follow
all of that. The launchers (the warm process, :mod:`kernelmgr.warm.worker`, which warm pods use
too, and a kernel pod's entry point, :mod:`kernelmgr.kube.pod_kernel`) call :func:`start` as soon
as the kernel's environment is in place, before ipykernel runs; the agent's restore then takes
that download (:func:`take`) instead of starting its own, so exactly one download runs per
process. Without a launcher that started one (a cold local start, a kernelspec's own argv) the
agent runs :func:`download` itself, the same code, synchronously.

Trust is what it is without the prefetch: the owner's key file is read (with the agent's checks,
not removed: the agent reads and removes it when it loads) and the manifest is verified with it
before ``data.bin`` is read, so an unsigned manifest cannot make the process download anything
(its size and digest algorithm come from the verified manifest). Nothing is unpickled here; the
agent verifies the manifest again when it restores from the scratch folder and compares the
digest computed here before it unpickles anything. A refused or failed download is raised to the
agent as it would have been raised in the agent (its refused report), and its scratch folder is
removed.

Light imports only (no IPython, ipykernel, web or Kubernetes module): this runs before ipykernel
is imported, and a warm process must not import anything a cold kernel would not.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import kernelmgr.objectstore.transfer as transfer
from kernelmgr.checkpoint import child, cipher
from kernelmgr.checkpoint.errors import CheckpointRefused
from kernelmgr.checkpoint.integrity import ChunkDigests, DigestUnavailable
from kernelmgr.checkpoint.keys import ENV_KEY_FILE, read_keys
from kernelmgr.checkpoint.layout import DATA_FILE, MANIFEST_FILE
from kernelmgr.checkpoint.progress import ProgressFile
from kernelmgr.checkpoint.reader import import_saved, prewarm_imports
from kernelmgr.checkpoint.sharing import make_kernel_dir
from kernelmgr.checkpoint.verify import MANIFEST_CAP, Untrusted, check_manifest
from kernelmgr.checkpoint.writer import LIBRARIES
from kernelmgr.core.manifest import Manifest, ManifestError

ENV_DIR = "ELASTIC_CHECKPOINT_DIR"
ENV_KERNEL_ID = "ELASTIC_KERNEL_ID"
ENV_OWNER = "ELASTIC_OWNER"
ENV_RESTORE = "ELASTIC_RESTORE"
ENV_RESTORE_CHECKPOINT = "ELASTIC_RESTORE_CHECKPOINT"
ENV_RESTORE_MANIFEST_URL = "ELASTIC_RESTORE_MANIFEST_URL"
ENV_RESTORE_DATA_URL = "ELASTIC_RESTORE_DATA_URL"
ENV_RESTORE_KEY = "ELASTIC_RESTORE_KEY"
#: A pod's key file is on a read-only Secret volume (read, never removed).
ENV_KEY_MOUNTED = "ELASTIC_CHECKPOINT_KEY_MOUNTED"
#: ``0`` starts no download before the agent loads (the agent downloads itself, as before);
#: ``thread`` runs it on a thread of the kernel process instead of a child process: both for
#: comparing in tests and benchmarks.
ENV_PREFETCH = "ELASTIC_RESTORE_PREFETCH"

#: The GIL switch interval while a download runs (seconds; Python's default is 0.005).
SWITCH_INTERVAL = 0.0002

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreSource:
    """One checkpoint in the object store to download, and the key that verifies its manifest."""

    kernel_dir: Path
    checkpoint_id: str
    manifest_url: str
    data_url: str
    #: The checkpoint's encryption key (hex) when it is encrypted at rest.
    restore_key: str | None
    key: bytes
    owner: str
    kernel_id: str


@dataclass(frozen=True)
class Downloaded:
    """A verified manifest in ``scratch/<checkpoint id>/``, laid out as a kernel folder, and its
    ``data.bin`` (:attr:`data_file`), with the digest of ``data.bin`` computed as its ranges
    arrived."""

    scratch: Path
    checkpoint_id: str
    digest: str
    #: How long the download took, from its start (its own time, wherever it ran).
    seconds: float
    #: The process that downloaded (a child of the kernel's, or the kernel's own).
    pid: int
    #: The memory file holding ``data.bin`` (:func:`memory_file`; this process's descriptor),
    #: or ``None`` when it is a file in the scratch folder. :meth:`close` closes it.
    memory: int | None = None

    @property
    def data_file(self) -> Path:
        """Where ``data.bin`` is read from: the memory file through ``/proc``, or the file."""
        if self.memory is not None:
            return Path(f"/proc/self/fd/{self.memory}")
        return self.scratch / self.checkpoint_id / DATA_FILE

    def close(self) -> None:
        """Let go of the memory file (mappings of it stay valid) and remove the scratch folder."""
        close_memory(self.memory)
        shutil.rmtree(self.scratch, ignore_errors=True)


def memory_file() -> int | None:
    """A file in memory (Linux ``memfd_create``) for a downloaded ``data.bin``; ``None`` where
    there is none (another system, or a sandbox that refuses it): the download then goes to a
    file in the scratch folder.

    Why: the copy lives only until the restore has mapped its arrays, and a file in the kernel
    folder costs a write-back of every byte to the node's disk (and, in a pod, counts against its
    ephemeral storage) for a copy removed right after. Made before the download's child is
    forked, so both processes share it; the restore maps it copy-on-write, as it mapped the file.
    """
    if not hasattr(os, "memfd_create") or not Path("/proc/self/fd").is_dir():
        return None
    try:
        return os.memfd_create("elastic-checkpoint-data", os.MFD_CLOEXEC)
    except OSError:
        return None


def close_memory(memory: int | None) -> None:
    if memory is not None:
        with contextlib.suppress(OSError):
            os.close(memory)


def download(
    source: RestoreSource,
    scratch: Path | None = None,
    verified: Callable[[Manifest], None] | None = None,
    memory: int | None = None,
) -> Downloaded:
    """Read ``source`` into a scratch folder under the kernel folder (``scratch``, else a new one)
    and ``data.bin`` into ``memory`` (a :func:`memory_file`; without one, a new one, else a file
    in the scratch folder); both are let go of again if anything fails. The manifest is verified
    before ``data.bin`` is read (its size comes from the manifest); ``data.bin`` arrives by
    parallel ranged GETs, with progress. ``verified`` is told the verified manifest (in a child
    process: the parent imports its libraries); without it, they are imported here while the
    ranges arrive."""
    started = time.perf_counter()
    checkpoint_id = source.checkpoint_id
    if scratch is None:
        scratch = new_scratch(source.kernel_dir)
    own_memory = memory is None
    if memory is None:
        memory = memory_file()
    try:
        text = transfer.get(source.manifest_url)
        if text is None:
            raise CheckpointRefused(f"checkpoint {checkpoint_id} is not in the object store")
        if len(text) > MANIFEST_CAP:
            raise CheckpointRefused(f"the manifest of {checkpoint_id} is larger than {MANIFEST_CAP} bytes")
        data_key = None
        if source.restore_key:  # encrypted at rest: decrypted here, verified below
            checkpoint_key = bytes.fromhex(source.restore_key)
            text = cipher.crypt(cipher.manifest_key(checkpoint_key), 0, text)
            data_key = cipher.data_key(checkpoint_key)
        try:
            manifest = Manifest.from_json(text)
            declared = manifest.data_bytes
            check_manifest(text, declared, source.key, source.owner, source.kernel_id, checkpoint_id)
        except (ManifestError, Untrusted) as exc:
            raise CheckpointRefused(f"checkpoint {checkpoint_id} in the object store: {exc}") from None
        try:
            digests = ChunkDigests(manifest.digest_algorithm, declared)
        except DigestUnavailable as exc:
            raise CheckpointRefused(str(exc)) from None
        # The libraries the checkpoint was saved with are imported while the ranges arrive
        # (only imported: nothing is unpickled before the digest matched).
        prewarm = None
        if verified is None:
            prewarm = prewarm_imports(manifest.libraries, LIBRARIES)
        else:
            verified(manifest)

        folder = scratch / checkpoint_id
        folder.mkdir(mode=0o700)
        (folder / MANIFEST_FILE).write_bytes(text)
        progress = ProgressFile(source.kernel_dir)
        done = 0

        def advance(count: int) -> None:
            nonlocal done
            done += count
            progress(checkpoint_id, done, declared)

        with _data_target(folder, memory) as fd, quick_switches():
            receive(source.data_url, declared, fd, digests, data_key, advance)
        progress(checkpoint_id, declared, declared)
        digest = digests.hexdigest()
        if prewarm is not None:
            prewarm.join()  # the caller may import next
    except BaseException:
        if own_memory:
            close_memory(memory)
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return Downloaded(scratch, checkpoint_id, digest, time.perf_counter() - started, os.getpid(), memory)


def receive(
    url: str,
    size: int,
    fd: int,
    digests: ChunkDigests,
    data_key: bytes | None = None,
    on_progress: transfer.Progress | None = None,
) -> None:
    """``data.bin`` (``size`` bytes) from ``url`` into the file ``fd``: each piece decrypted with
    ``data_key`` (encrypted at rest), digested into ``digests`` and written on the thread its
    range came in on, while the other ranges still arrive and the piece is in the CPU's cache."""
    os.ftruncate(fd, size)

    def arrived(offset: int, piece: memoryview) -> None:
        if data_key is not None:
            cipher.crypt_in_place(data_key, offset, piece)
        digests.add_piece(offset, piece)
        _write_at(fd, piece, offset)

    # Ranges of whole digest chunks: a chunk's pieces come in order, on one thread.
    transfer.download_pieces(
        url, size, arrived, part_size=transfer.DEFAULT_PART_SIZE, on_progress=on_progress
    )


def _write_at(fd: int, piece: memoryview, offset: int) -> None:
    while piece:
        written = os.pwrite(fd, piece, offset)
        piece, offset = piece[written:], offset + written


@contextlib.contextmanager
def _data_target(folder: Path, memory: int | None) -> Iterator[int]:
    """The descriptor ``data.bin`` is written through: ``memory``'s, else a new file's (closed after)."""
    if memory is not None:
        yield memory
        return
    with open(folder / DATA_FILE, "w+b") as handle:
        yield handle.fileno()


@contextlib.contextmanager
def quick_switches() -> Iterator[None]:
    """The GIL switch interval at most :data:`SWITCH_INTERVAL` meanwhile.

    Why: each range's thread needs the GIL back after every read from its socket; with Python's
    5 ms interval it waits that long behind any thread running Python (the kernel starting beside
    the download, the other ranges' bookkeeping). Beside a busy main thread a 1 GiB download took
    about 1.5x as long here (2.3 s against 1.0-1.7 s at 0.5 ms and below).
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def new_scratch(kernel_dir: Path) -> Path:
    """A private scratch folder under the kernel folder (made, 0700, when missing)."""
    make_kernel_dir(kernel_dir, 0o700, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".download-", dir=kernel_dir))


def source_from_env(env: Mapping[str, str]) -> RestoreSource | None:
    """The checkpoint ``env`` asks to restore from an object store; ``None`` when it asks for none,
    or when its key file cannot be read (the agent then refuses the restore and says why)."""
    names = (ENV_DIR, ENV_KERNEL_ID, ENV_OWNER, ENV_KEY_FILE, ENV_RESTORE_CHECKPOINT)
    if env.get(ENV_RESTORE, "") != "1" or not env.get(ENV_RESTORE_DATA_URL):
        return None
    if not all(env.get(name) for name in names):
        return None
    try:
        key, _ = read_keys(env[ENV_KEY_FILE], consume=env.get(ENV_KEY_MOUNTED, "") != "1", remove=False)
    except ValueError as exc:
        log.warning("no restore download before the agent loads: %s", exc)
        return None
    return RestoreSource(
        kernel_dir=Path(env[ENV_DIR]),
        checkpoint_id=env[ENV_RESTORE_CHECKPOINT],
        manifest_url=env.get(ENV_RESTORE_MANIFEST_URL, ""),
        data_url=env[ENV_RESTORE_DATA_URL],
        restore_key=env.get(ENV_RESTORE_KEY) or None,
        key=key,
        owner=env[ENV_OWNER],
        kernel_id=env[ENV_KERNEL_ID],
    )


class Prefetch:
    """A :func:`download` running in a child process (:mod:`kernelmgr.checkpoint.child`: its own
    GIL, beside the kernel starting here), or on a thread where the platform cannot fork;
    :meth:`join` gives its result or raises its error."""

    def __init__(self, source: RestoreSource, in_child: bool = True) -> None:
        self.source = source
        #: ``time.monotonic()`` when it started (the restore report says how long before the agent).
        self.started_at = time.monotonic()
        self.scratch = new_scratch(source.kernel_dir)
        #: Made here, before the fork: the child writes into it, this process maps it.
        self.memory = memory_file()
        self._result: Downloaded | None = None
        self._error: BaseException | None = None
        self._child: child.Child | None = None
        self._thread: threading.Thread | None = None
        if in_child and child.can_fork():
            self._child = child.Child(self._download_in_child, self._import_libraries)
        else:
            self._thread = threading.Thread(target=self._run, name="checkpoint-prefetch", daemon=True)
            self._thread.start()

    @property
    def child_pid(self) -> int | None:
        """The process downloading, when it is a child of this one."""
        return self._child.pid if self._child is not None else None

    def _download_in_child(self, send: Callable[[child.Message], None]) -> child.Message:
        got = download(
            self.source,
            self.scratch,
            verified=lambda m: send({"libraries": list(m.libraries)}),
            memory=self.memory,
        )
        return {"digest": got.digest, "seconds": got.seconds, "pid": got.pid}

    @staticmethod
    def _import_libraries(message: child.Message) -> None:
        # Here (on the child's reader thread), not in the child: the kernel is this process.
        import_saved(list(message.get("libraries", [])), LIBRARIES)

    def _run(self) -> None:
        try:
            self._result = download(self.source, self.scratch, memory=self.memory)
        except BaseException as exc:  # handed to the agent by join()
            self._error = exc

    def join(self) -> Downloaded:
        if self._child is not None:
            try:
                result = self._child.result()
            except child.ChildFailed as exc:
                raise _as_raised(exc) from None
            return Downloaded(
                self.scratch,
                self.source.checkpoint_id,
                str(result["digest"]),
                float(result["seconds"]),
                int(result["pid"]),
                self.memory,
            )
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def discard(self) -> None:
        """Stop the download and remove its scratch folder."""
        if self._child is not None:
            self._child.kill()
        close_memory(self.memory)
        shutil.rmtree(self.scratch, ignore_errors=True)


def _as_raised(failed: child.ChildFailed) -> Exception:
    """The child's error as the agent would have seen it raised here."""
    if failed.kind == CheckpointRefused.__name__:
        return CheckpointRefused(str(failed))
    if failed.kind == transfer.TransferError.__name__:
        return transfer.TransferError(str(failed))
    return failed


_lock = threading.Lock()
_pending: Prefetch | None = None


def start(env: Mapping[str, str] | None = None) -> Prefetch | None:
    """Start downloading the checkpoint the environment (``os.environ`` by default) asks to
    restore from an object store, unless ``ELASTIC_RESTORE_PREFETCH=0``; ``None`` when there is
    nothing to download. Never raises: a download that cannot start is the agent's to report."""
    global _pending
    env = os.environ if env is None else env
    if env.get(ENV_PREFETCH, "") == "0":
        return None
    try:
        source = source_from_env(env)
        if source is None:
            return None
        fetch = Prefetch(source, in_child=env.get(ENV_PREFETCH, "") != "thread")
    except Exception as exc:
        log.warning("no restore download before the agent loads: %s", exc)
        return None
    with _lock:
        previous, _pending = _pending, fetch
    if previous is not None:
        previous.discard()
    return fetch


def take(source: RestoreSource) -> Prefetch | None:
    """The download started for exactly ``source``, handed over once; ``None`` when there is
    none (a download for anything else is discarded)."""
    global _pending
    with _lock:
        fetch, _pending = _pending, None
    if fetch is None:
        return None
    if fetch.source != source:
        fetch.discard()
        return None
    return fetch


def discard() -> None:
    """Drop a download nobody will take (the agent loaded without restoring, or not at all)."""
    global _pending
    with _lock:
        fetch, _pending = _pending, None
    if fetch is not None:
        fetch.discard()


atexit.register(discard)
