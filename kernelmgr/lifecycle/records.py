"""The on-disk registry of managed kernels, so hibernated kernels outlive the server.

A hibernated kernel has no process: everything that makes it resumable is its checkpoint
and this record (id, owner, kernelspec, size, working directory, last kernel_info reply).
The file is small JSON, rewritten atomically (write beside, fsync, rename, fsync dir) on
every lifecycle change, so a server killed at any moment leaves the previous or the new
version, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kernelmgr.core.kernels import KernelRegistry

FORMAT = 1

#: The working directory a kernel was started in, by id (``None``: unknown).
CwdOf = Callable[[str], "str | None"]
#: A GPU size's definition by name (``None``: not configured).
DefinitionOf = Callable[[str], "dict[str, Any] | None"]


@dataclass
class KernelRecord:
    """What the server must remember about a kernel across its own restarts."""

    kernel_id: str
    kernelspec: str
    profile: str | None
    owner: str
    state: str
    cwd: str | None = None
    pid: int | None = None
    hibernated_at: float | None = None
    checkpoint_id: str | None = None
    kernel_info: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    execution_count: int = 0
    #: The GPU size's definition when the kernel was recorded (``GpuProfile.to_dict``): a size
    #: the admin removed while the kernel was hibernated is rebuilt from it after a restart, so
    #: the kernel stays listed and resumes with what it had. ``None`` in records of older versions.
    profile_definition: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KernelRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


class KernelStateFile:
    """Atomic JSON file of :class:`KernelRecord` keyed by kernel id."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def load(self) -> dict[str, KernelRecord]:
        """Records from disk; a missing file is an empty registry, a corrupt one an error."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"kernel registry {self.path} is unreadable ({exc}); move it aside to start fresh"
            ) from exc
        kernels = raw.get("kernels", {}) if isinstance(raw, dict) else {}
        return {kid: KernelRecord.from_dict(rec) for kid, rec in kernels.items() if isinstance(rec, dict)}

    @staticmethod
    def serialize(records: dict[str, KernelRecord]) -> str:
        """The file's content for ``records`` (cheap; done where the records are owned)."""
        return json.dumps(
            {"format": FORMAT, "kernels": {kid: asdict(rec) for kid, rec in records.items()}},
            indent=1,
            sort_keys=True,
        )

    def save(self, records: dict[str, KernelRecord]) -> None:
        self.write(self.serialize(records))

    def write(self, payload: str) -> None:
        """Replace the file with ``payload`` atomically and durably (blocking: a worker thread's job)."""
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".kernels-", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as handle:
                    handle.write(payload)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


class RecordStore(Protocol):
    """Where the records live: :class:`KernelStateFile`, or the Kubernetes API
    (:class:`kernelmgr.kube.records.KubeRecordStore`, one ConfigMap per kernel)."""

    @property
    def path(self) -> Any: ...

    def load(self) -> dict[str, KernelRecord]: ...

    def save(self, records: dict[str, KernelRecord]) -> None: ...

    def write(self, payload: str) -> None: ...


class WriteBehind:
    """Saves the registry off the event loop, coalescing bursts, never raising into callers.

    A lifecycle change must not wait for an fsync on the event loop, and a full disk must not
    leave a kernel half-way through a transition (it used to: the ``hibernating`` marker's
    save raised, and the kernel stayed ``hibernating`` for good). Each :meth:`save` snapshots
    the records at once (in the caller's thread) and a single worker thread writes the newest
    snapshot; a failed write is logged and retried with the next save or :meth:`flush`.
    """

    def __init__(self, state_file: RecordStore, log: Any) -> None:
        self.state_file = state_file
        self.log = log
        self._lock = threading.Lock()
        self._pending: str | None = None
        self._writing = False
        self._idle = threading.Event()
        self._idle.set()
        self.failed = False

    def save(self, records: dict[str, KernelRecord]) -> None:
        payload = KernelStateFile.serialize(records)
        with self._lock:
            self._pending = payload
            if self._writing:
                return
            self._writing = True
            self._idle.clear()
        threading.Thread(target=self._drain, name="elastic-registry-writer", daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                payload, self._pending = self._pending, None
                if payload is None:
                    self._writing = False
                    self._idle.set()
                    return
            try:
                self.state_file.write(payload)
                self.failed = False
            except OSError as exc:
                self.failed = True
                self.log.warning("could not save the kernel registry %s: %s", self.state_file.path, exc)
                with self._lock:
                    if self._pending is None:
                        self._pending = payload  # keep it for the next attempt
                    self._writing = False
                    self._idle.set()
                return

    def flush(self, timeout: float = 30.0) -> bool:
        """Write what is pending now (server exit); True when the file is up to date."""
        self._idle.wait(timeout)
        with self._lock:
            payload, self._pending = self._pending, None
        if payload is not None:
            try:
                self.state_file.write(payload)
            except OSError as exc:
                self.log.warning("could not save the kernel registry %s: %s", self.state_file.path, exc)
                return False
        return True


class KernelRecords(dict[str, KernelRecord]):
    """Every kernel's :class:`KernelRecord` by id, written behind to the state file.

    The one writer of the file: :meth:`remember` copies the kernel's state from its
    :class:`~kernelmgr.core.kernels.ManagedKernel` (plus the given fields) and saves.
    """

    def __init__(
        self,
        state_file: RecordStore,
        kernels: KernelRegistry,
        log: Any,
        cwd_of: CwdOf,
        definition_of: DefinitionOf | None = None,
    ) -> None:
        super().__init__()
        self.state_file = state_file
        self.writer = WriteBehind(state_file, log)
        self.kernels = kernels
        self.cwd_of = cwd_of
        self.definition_of = definition_of

    def remember(self, kernel_id: str, **changes: Any) -> None:
        """Update the record of ``kernel_id`` from the registry (plus ``changes``) and save it.

        Written behind, off the event loop; a failure (a full disk) is logged and retried,
        never raised into a lifecycle transition.
        """
        managed = self.kernels.get(kernel_id)
        if managed is None:
            return
        record = self.get(kernel_id)
        if record is None:
            record = KernelRecord(
                kernel_id=kernel_id,
                kernelspec=managed.kernelspec,
                profile=managed.profile,
                owner=managed.owner,
                state=managed.state.value,
                cwd=self.cwd_of(kernel_id),
            )
            self[kernel_id] = record
        if (record.kernelspec, record.profile) != (managed.kernelspec, managed.profile):
            # A size change: the next server must bring the kernel back at the size picked last.
            record.kernelspec, record.profile = managed.kernelspec, managed.profile
            record.profile_definition = None  # that size's, below
        if record.profile_definition is None and record.profile and self.definition_of is not None:
            record.profile_definition = self.definition_of(record.profile)
        record.state = managed.state.value
        record.reason = managed.lifecycle.reason
        for key, value in changes.items():
            setattr(record, key, value)
        self.save()

    def save(self) -> None:
        self.writer.save(self)
