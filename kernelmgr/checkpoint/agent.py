"""The in-kernel agent: an IPython extension that checkpoints and restores ``user_ns``.

It runs inside every managed kernel because that is where the variables are: the server
cannot pickle objects that live in another process. The server configures it with
environment variables when it starts the kernel:

``ELASTIC_CHECKPOINT_DIR``  the kernel directory, ``<root>/<owner>/<kernel_id>``
``ELASTIC_CHECKPOINT_KEY_FILE``  a file holding this owner's checkpoint key (never the server
                            secret), readable by its owner only; the agent reads it once, at
                            load, and removes it (:mod:`kernelmgr.checkpoint.keys`). The key is
                            never in the environment, where every cell and child process
                            would see it
``ELASTIC_KERNEL_ID``       the kernel id (checkpoints name it; another kernel's is refused)
``ELASTIC_OWNER``           the owner (likewise)
``ELASTIC_RESTORE``         ``1``: restore the committed checkpoint while the extension loads
``ELASTIC_RESTORE_CHECKPOINT``  with ``ELASTIC_RESTORE=1``: the id of the checkpoint the server
                            verified; any other committed checkpoint is refused (an older one
                            put back in place verifies under the same key)
``ELASTIC_RESTORE_MANIFEST_URL``, ``ELASTIC_RESTORE_DATA_URL``  with an object store: presigned
                            GET URLs of that checkpoint's manifest and ``data.bin`` (the kernel holds
                            no credential); the agent reads ``data.bin`` by parallel ranged GETs into
                            a scratch folder and restores from there
``ELASTIC_RESTORE_MAPPED``  optional: ``1`` maps big arrays from the checkpoint file instead of
                            reading them (copy-on-write; set by the local provisioner, where only
                            the server's own user can rewrite that file)
``ELASTIC_RECOMPUTE_SECONDS``  optional: the time limit (seconds) for re-running cells on
                            resume to rebuild unsaved variables (default 30; ``0`` disables it)
``ELASTIC_SERVER_PID``      optional: the server's pid. Kernels are launched independent of the
                            server (ipykernel's parent poller would kill them mid-checkpoint);
                            a :class:`~kernelmgr.checkpoint.watchdog.ServerWatchdog` then
                            checkpoints the kernel and exits it once the server is gone and no
                            cell is running, so a crashed server loses no variables
``ELASTIC_CHECKPOINT_ON_SIGTERM``  optional: ``1`` makes SIGTERM (a pod evicted, a node drained,
                            systemd stopping the kernels) checkpoint what changed once no cell
                            is running, then exit (:mod:`kernelmgr.checkpoint.termination`)

Restoring at load time means it happens before the kernel serves its first request, so
the user's first cell (the one that woke the kernel) already sees the variables.

To checkpoint, the server sends a *silent* ``execute_request`` with :data:`CHECKPOINT_CODE` and the
user expression :data:`COMMIT_EXPRESSION`, whose value is the signed manifest just committed: the
server records that checkpoint (verified with the owner's key), never one it infers from the shared
folder, whose ``current`` it may see late (NFS attribute caching). With an object store, a second
silent execute (:func:`upload_code`) sends ``data.bin`` as the parts of a multipart upload through
presigned URLs, and :data:`UPLOAD_EXPRESSION` gives the server the parts' ETags.
Silent executions do not bump the execution count, store no history and display nothing,
and the expression binds no name, so the user's session looks untouched. A failure raises
:class:`CheckpointFailed`, whose one-line message reaches the server as the reply's
``evalue``; the server then keeps the kernel running.

The agent records every user cell (:mod:`kernelmgr.checkpoint.cells`) and commits the record
inside each checkpoint's signed manifest; a restore takes the record back, so the history
continues across hibernations. A variable that was not saved or failed to load is then rebuilt
by re-running the fewest recorded cells that produced it, when they are safe to re-run
(:mod:`kernelmgr.checkpoint.recompute`); the report says what was recomputed and why the rest
was not.

After a restore, the first user cell shows a short report (what came back, what did not
and why); the full report is also written to ``restore-report.json`` for the server. The
agent prints nothing else: everything else goes to the kernel's log.

Long because it is everything the kernel does around a checkpoint (load, checkpoint, restore,
report, IPython hooks) on one ``_Agent``'s state; the format itself is in the modules it imports.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kernelmgr.objectstore.transfer as transfer
from kernelmgr.checkpoint import cipher, notes, outbox, prefetch
from kernelmgr.checkpoint.cells import MAX_CELLS, CellRecord, plan_recompute, record_cell
from kernelmgr.checkpoint.errors import CheckpointFailed, CheckpointRefused
from kernelmgr.checkpoint.keys import ENV_KEY_FILE, read_keys
from kernelmgr.checkpoint.layout import DATA_FILE, RESTORE_REPORT, write_file_atomic
from kernelmgr.checkpoint.namespace import UserNamespace
from kernelmgr.checkpoint.prefetch import (
    ENV_DIR,
    ENV_KERNEL_ID,
    ENV_OWNER,
    ENV_RESTORE,
    ENV_RESTORE_CHECKPOINT,
    ENV_RESTORE_DATA_URL,
    ENV_RESTORE_KEY,
    ENV_RESTORE_MANIFEST_URL,
)
from kernelmgr.checkpoint.progress import CHECKPOINT_PROGRESS, ProgressFile
from kernelmgr.checkpoint.quick_exit import flush, open_files
from kernelmgr.checkpoint.quick_exit import install as install_quick_exit

if TYPE_CHECKING:
    from kernelmgr.checkpoint.first_cell import FirstCellGuard
from kernelmgr.checkpoint.reader import refused_report, restore_checkpoint
from kernelmgr.checkpoint.recompute import DEFAULT_LIMIT, replay
from kernelmgr.checkpoint.termination import ENV_CHECKPOINT_ON_SIGTERM
from kernelmgr.checkpoint.verify import load_verified_checkpoint
from kernelmgr.checkpoint.version import advertise
from kernelmgr.checkpoint.writer import describe_error, write_checkpoint

#: No longer read: a key in the environment is visible to every cell. Named only to say so.
ENV_KEY_REMOVED = "ELASTIC_CHECKPOINT_KEY"
ENV_RESTORE_MAPPED = "ELASTIC_RESTORE_MAPPED"
ENV_SERVER_PID = "ELASTIC_SERVER_PID"
ENV_RECOMPUTE_SECONDS = "ELASTIC_RECOMPUTE_SECONDS"

#: What the server sends (silently) to checkpoint a kernel.
CHECKPOINT_CODE = '__import__("kernelmgr.checkpoint.agent").checkpoint.agent.checkpoint()'
#: The user expression sent with it: the JSON of the manifest the checkpoint committed (a string).
COMMIT_EXPRESSION = '__import__("kernelmgr.checkpoint.agent").checkpoint.agent.last_commit()'
#: The user expression sent with :func:`upload_code`: the JSON list of the parts' ETags.
UPLOAD_EXPRESSION = '__import__("kernelmgr.checkpoint.agent").checkpoint.agent.last_upload()'
#: The restore report (JSON), for a server that cannot read the kernel's folder (a pod's emptyDir).
REPORT_EXPRESSION = '__import__("kernelmgr.checkpoint.agent").checkpoint.agent.last_report_json()'


#: The user expression that asks how big a checkpoint would be (bytes, an estimate made before
#: pickling), so the server can start the upload and presign its parts before the checkpoint.
ESTIMATE_EXPRESSION = '__import__("kernelmgr.checkpoint.agent").checkpoint.agent.estimate()'


def upload_code(
    checkpoint_id: str, urls: list[str], part_size: int, key: str = "", first_part: int = 0
) -> str:
    """The silent cell that sends ``checkpoint_id``'s ``data.bin`` through presigned part URLs
    (encrypted with the checkpoint's ``key``, hex, when given: :mod:`kernelmgr.checkpoint.cipher`),
    from part ``first_part`` on (those before it were streamed with the checkpoint)."""
    plan = json.dumps(
        {"checkpoint": checkpoint_id, "urls": urls, "part_size": part_size, "key": key}
        | {"first_part": first_part}
    )
    return f'__import__("kernelmgr.checkpoint.agent").checkpoint.agent.upload({plan!r})'


def streaming_checkpoint_code(checkpoint_id: str, urls: list[str], part_size: int, key: str = "") -> str:
    """The silent cell that writes checkpoint ``checkpoint_id`` and sends ``data.bin``'s parts
    through the presigned part URLs *while* it is written (:class:`~kernelmgr.objectstore.transfer.
    PartStreamer`); :data:`COMMIT_EXPRESSION` and :data:`UPLOAD_EXPRESSION` then give the manifest
    and the ETags of the parts sent (fewer than the file's parts when it outgrew the URLs)."""
    plan = json.dumps({"checkpoint": checkpoint_id, "urls": urls, "part_size": part_size, "key": key})
    return f'__import__("kernelmgr.checkpoint.agent").checkpoint.agent.checkpoint({plan!r})'


def _part_crypt(key: str) -> Any:
    """The transform that encrypts an upload's parts with the checkpoint ``key`` (hex); ``None``
    without one. One buffer per sending thread, reused part after part (a thread sends a part
    before it encrypts the next): no new memory to fault in per part."""
    if not key:
        return None
    data_key = cipher.data_key(bytes.fromhex(key))
    buffers = threading.local()

    def crypt(offset: int, piece: memoryview) -> memoryview:
        buffer = getattr(buffers, "buffer", None)
        if buffer is None or len(buffer) < len(piece):
            buffer = buffers.buffer = bytearray(len(piece))
        out = memoryview(buffer)[: len(piece)]
        cipher.crypt_into(data_key, offset, piece, out)
        return out

    return crypt


_fallback_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentConfig:
    """Where and as whom this kernel checkpoints."""

    kernel_dir: Path
    key: bytes
    kernel_id: str
    owner: str
    restore: bool = False
    #: The checkpoint the server verified and expects to be restored (with ``restore``).
    restore_checkpoint: str | None = None
    #: Map big arrays from ``data.bin`` instead of reading them (``reader._map_region``).
    restore_mapped: bool = False
    #: With an object store: presigned GET URLs of the checkpoint to restore.
    restore_manifest_url: str | None = None
    restore_data_url: str | None = None
    #: The checkpoint's encryption key (hex) when it is encrypted at rest.
    restore_key: str | None = None
    #: The kernel's key for checkpoints encrypted at rest on a file system (the key file's
    #: second line): each checkpoint's key is derived from it (``cipher.checkpoint_key``).
    data_key: bytes | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AgentConfig | None:
        """``None`` when the kernel is not managed (no ``ELASTIC_CHECKPOINT_DIR``).

        Reads the key file named by ``ELASTIC_CHECKPOINT_KEY_FILE`` and *removes* it (call it
        once per process). Raises ``ValueError`` naming the variable or the file when the
        configuration is incomplete or the key file cannot be trusted.
        """
        directory = env.get(ENV_DIR, "")
        if not directory:
            return None
        missing = [name for name in (ENV_KEY_FILE, ENV_KERNEL_ID, ENV_OWNER) if not env.get(name)]
        if missing:
            hint = ""
            if ENV_KEY_FILE in missing and env.get(ENV_KEY_REMOVED):
                hint = (
                    f" ({ENV_KEY_REMOVED} is no longer read: a key in the environment is visible to every "
                    f"cell; the server hands the key over in the file named by {ENV_KEY_FILE})"
                )
            raise ValueError(f"{ENV_DIR} is set but {', '.join(missing)} is not{hint}")
        # A pod's key sits on a read-only Secret volume it cannot remove (the Secret dies with the pod).
        mounted = env.get("ELASTIC_CHECKPOINT_KEY_MOUNTED", "") == "1"
        key, data_key = read_keys(env[ENV_KEY_FILE], consume=not mounted)  # KeyFileError is a ValueError
        return cls(
            kernel_dir=Path(directory),
            key=key,
            kernel_id=env[ENV_KERNEL_ID],
            owner=env[ENV_OWNER],
            restore=env.get(ENV_RESTORE, "") == "1",
            restore_checkpoint=env.get(ENV_RESTORE_CHECKPOINT) or None,
            restore_mapped=env.get(ENV_RESTORE_MAPPED, "") == "1",
            restore_manifest_url=env.get(ENV_RESTORE_MANIFEST_URL) or None,
            restore_data_url=env.get(ENV_RESTORE_DATA_URL) or None,
            restore_key=env.get(ENV_RESTORE_KEY) or None,
            data_key=data_key,
        )


def human_bytes(count: int) -> str:
    """``512 B``, ``3.0 MiB``, ``1.0 GiB``."""
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def format_report(report: Mapping[str, Any]) -> tuple[str, str]:
    """The restore report as ``(text/plain, text/markdown)`` for the first cell's output."""
    if report.get("refused"):
        kept = report.get("quarantined")
        body = f"the checkpoint was not loaded ({report['refused']}). The kernel started empty."
        plain = f"Kernel resumed without its variables: {body}"
        markdown = f"**Kernel resumed without its variables**: {body}"
        if kept:
            plain += f" The checkpoint was kept in {kept} for inspection."
            markdown += f" The checkpoint was kept in `{kept}` for inspection."
        return plain, markdown
    restored = list(report.get("restored", []))
    count = len(restored)
    noun = "variable" if count == 1 else "variables"
    size = human_bytes(int(report.get("bytes", 0)))
    head = f"restored {count} {noun} ({size}) in {float(report.get('seconds', 0)):.1f} s."
    missing = [f"{item['name']} ({_why_missing(item)})" for item in report.get("not_restored", [])]
    plain = f"Kernel resumed: {head}"
    markdown = f"**Kernel resumed**: {head}"
    if missing:
        plain += " Not restored: " + ", ".join(missing) + "."
        markdown += "\n\nNot restored:\n" + "\n".join(
            f"- `{item['name']}` ({_why_missing(item)})" for item in report.get("not_restored", [])
        )
    recomputed = [item["name"] for item in report.get("recomputed", [])]
    if recomputed:
        cells = sorted({cell for item in report.get("recomputed", []) for cell in item.get("cells", [])})
        ran = f"re-ran {len(cells)} cell{'s' if len(cells) != 1 else ''}"
        plain += f" Recomputed ({ran}): " + ", ".join(recomputed) + "."
        markdown += f"\n\nRecomputed ({ran}): " + ", ".join(f"`{name}`" for name in recomputed)
    differs = report.get("differs") or {}
    if differs:
        listed = "; ".join(f"{name} ({why})" for name, why in differs.items())
        plain += f" Restored with known differences: {listed}."
        markdown += "\n\nRestored with known differences:\n" + "\n".join(
            f"- `{name}` ({why})" for name, why in differs.items()
        )
    for title, items in (("Moved", report.get("remapped", [])), ("Note", report.get("warnings", []))):
        if items:
            plain += f" {title}: " + "; ".join(items) + "."
            markdown += f"\n\n{title}:\n" + "\n".join(f"- {item}" for item in items)
    return plain, markdown


def _why_missing(item: Mapping[str, Any]) -> str:
    why = str(item.get("reason", ""))
    if item.get("not_recomputed"):
        why += f"; not recomputed: {item['not_recomputed']}"
    return why


def recompute_limit(env: Mapping[str, str]) -> float:
    """``ELASTIC_RECOMPUTE_SECONDS`` as a number (the default when unset or not a number)."""
    try:
        return max(0.0, float(env.get(ENV_RECOMPUTE_SECONDS, DEFAULT_LIMIT)))
    except ValueError:
        return DEFAULT_LIMIT


def _close_mapping(region: mmap.mmap | None) -> None:
    """Unmap ``region``; after a failed upload a part's slice may still hold it, and the
    BufferError of closing it then must not hide the upload's own error (it is unmapped when
    that slice goes)."""
    if region is None:
        return
    with contextlib.suppress(BufferError):
        region.close()


class _Agent:
    """The extension's state inside one shell."""

    def __init__(self, shell: Any, config: AgentConfig | None) -> None:
        self.shell = shell
        self.config = config
        self.report: dict[str, Any] | None = None
        self.log: logging.Logger = getattr(shell, "log", None) or _fallback_log
        #: Why ``config`` is ``None`` although the server configured this kernel (for the errors).
        self.config_error: str | None = None
        self._hook_registered = False
        self._first_cell: FirstCellGuard | None = None
        self.busy = False  # a cell is running (the watchdog waits for it to finish)
        # One checkpoint at a time: the server's (a silent execute on the main thread) and the
        # watchdog's (its own thread, when the server died mid-checkpoint) must never write
        # into the kernel directory together.
        self._writing = threading.Lock()
        self.cells_run = 0  # user cells finished so far
        self.saved_at_cell: int | None = None  # ``cells_run`` when the namespace last committed
        self.namespace = UserNamespace(shell)
        #: The cell record, oldest first; committed with every checkpoint, taken back on restore.
        self.cells: list[CellRecord] = []
        self._before: dict[str, int] | None = None
        self._started_at = 0.0
        #: The manifest (JSON) of the last checkpoint this agent committed, for the server.
        self.committed: str | None = None
        #: The ETags of the last upload's parts (JSON), for the server.
        self.uploaded: str | None = None
        #: How the last streamed upload went (parts, how many went while the data was written,
        #: the most parts in flight at once): logged, and read by the tests.
        self.last_stream: dict[str, Any] | None = None
        #: Where the last restore read its checkpoint (a scratch folder with an object store).
        self._restore_dir: Path | None = None
        #: Where the last restore's ``data.bin`` was, when not in :attr:`_restore_dir` (memory).
        self._restore_data: Path | None = None
        #: When the agent loaded (``time.monotonic()``), and, after a restore that took the
        #: download its launcher started, how long before that it started (``lead``) and its
        #: own time (``seconds``): in the restore report as ``prefetch``.
        self._loaded_at = time.monotonic()
        self.prefetched: dict[str, float | bool] | None = None
        shell.events.register("pre_run_cell", self._cell_started)
        shell.events.register("post_run_cell", self._cell_finished)
        # The exit after a hibernation's checkpoint skips the interpreter's final collections.
        self._exit_hook = install_quick_exit(shell, self._saved_and_idle, self.log)

    def namespace_is_saved(self) -> bool:
        """True when a checkpoint committed and no user cell has finished since."""
        return self.saved_at_cell is not None and self.saved_at_cell == self.cells_run

    def _saved_and_idle(self) -> bool:
        return self.namespace_is_saved() and not self.busy

    def _ids(self) -> dict[str, int]:
        """``id()`` of every value in the namespace: one dict pass, twice per cell; which names
        are the user's is decided only for the few that changed (``record_cell``)."""
        return {name: id(value) for name, value in list(self.shell.user_ns.items())}

    def _cell_started(self, info: Any = None) -> None:
        self.busy = True
        self._before = None
        if getattr(info, "silent", False) or not getattr(info, "store_history", True):
            return  # the server's checkpoint request, or a frontend's internal execution
        try:
            self._before = self._ids()
        except Exception:
            self.log.exception("could not snapshot the namespace before a cell")
        self._started_at = time.perf_counter()

    def _cell_finished(self, result: Any = None) -> None:
        self.cells_run += 1
        self.busy = False
        if _GUARD is not None:
            _GUARD.cell_finished()  # a SIGTERM that came during the cell is handled now
        before, self._before = self._before, None
        info = getattr(result, "info", None)
        if before is None or info is None:
            return
        try:
            self._record(info, before, bool(getattr(result, "success", True)))
        except Exception:
            self.log.exception("could not record a cell")

    def _record(self, info: Any, before: dict[str, int], ok: bool) -> None:
        source = str(getattr(info, "raw_cell", "") or "")
        if not source.strip():
            return
        try:
            transformed = self.shell.transform_cell(source)
        except Exception:
            transformed = source
        index = self.cells[-1].index + 1 if self.cells else 1
        self.cells.append(
            record_cell(
                index,
                source,
                transformed,
                before,
                self._ids(),
                ok=ok,
                seconds=time.perf_counter() - self._started_at,
            )
        )
        del self.cells[:-MAX_CELLS]

    # -- checkpoint -----------------------------------------------------------------------

    def _unhide_restored(self) -> None:
        """``pre_execute`` hook, once: restored variables become visible to ``%who``.

        IPython hides what the namespace holds when start-up ends, after the restore.
        """
        self.namespace.unhide_restored()
        with contextlib.suppress(ValueError):
            self.shell.events.unregister("pre_execute", self._unhide_restored)

    def checkpoint(self, plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write a checkpoint; with an upload ``plan`` (:func:`streaming_checkpoint_code`), send its
        parts to the object store as they are written."""
        with self._writing:
            return self._checkpoint_locked(plan)

    def estimate(self) -> int:
        """The bytes a checkpoint of the namespace would take, estimated before pickling."""
        from kernelmgr.checkpoint.grouping import group_variables

        ns = self.shell.user_ns
        names = [name for name in self.namespace.user_names() if name in ns]
        return sum(group.approx_bytes for group in group_variables(ns, names))

    def checkpoint_if_changed(self) -> dict[str, Any] | None:
        """The watchdog's checkpoint: none if no cell ran since the last committed one.

        Waits for a checkpoint in progress (the one the dead server asked for) to finish
        first; if that one committed, the state is saved and nothing more is written.
        """
        with self._writing:
            if self.namespace_is_saved():
                self.log.info("the namespace is unchanged since the last checkpoint; nothing to write")
                return None
            return self._checkpoint_locked()

    def _checkpoint_locked(self, plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
        if self.config is None:
            raise CheckpointFailed(
                self.config_error or f"this kernel has no checkpoint directory ({ENV_DIR} is not set)"
            )
        cells_run = self.cells_run
        self.uploaded = None
        streamer = None
        if plan is not None:
            streamer = transfer.PartStreamer(
                [str(url) for url in plan["urls"]],
                int(plan["part_size"]),
                transform=_part_crypt(str(plan.get("key") or "")),
            )
        try:
            started = time.perf_counter()
            manifest = write_checkpoint(
                self.config.kernel_dir,
                self.shell.user_ns,
                key=self.config.key,
                owner=self.config.owner,
                kernel_id=self.config.kernel_id,
                names=self.namespace.user_names(),
                prune=False,  # the server prunes once the kernel has stopped (off the hibernate path)
                cells=[cell.to_dict() for cell in self.cells],
                on_progress=ProgressFile(self.config.kernel_dir, name=CHECKPOINT_PROGRESS),
                data_key=self.config.data_key,
                checkpoint_id=str(plan["checkpoint"]) if plan is not None else None,
                on_settled=streamer.settled if streamer is not None else None,
                # With an object store the local copy is scratch: the store's commit is the one.
                durable=streamer is None,
            )
            if streamer is not None:
                written = time.perf_counter()
                path = self.config.kernel_dir / manifest.checkpoint_id / DATA_FILE
                fd = os.open(path, os.O_RDONLY)
                try:
                    etags = streamer.finish(manifest.data_bytes, fd)
                finally:
                    os.close(fd)
                self.uploaded = json.dumps(etags)
                self.log.info(
                    "checkpoint %s: %d of %d parts sent, %d of them while it was written; %.2f s "
                    "after the write; at most %d parts in flight",
                    manifest.checkpoint_id,
                    len(etags),
                    transfer.part_count(manifest.data_bytes, streamer.part_size),
                    streamer.streamed_early,
                    time.perf_counter() - written,
                    streamer.peak_in_flight,
                )
                self.last_stream = {
                    "parts": len(etags),
                    "streamed_early": streamer.streamed_early,
                    "peak_in_flight": streamer.peak_in_flight,
                    "seconds": round(time.perf_counter() - started, 3),
                }
        except CheckpointFailed as exc:
            self.log.error("checkpoint failed: %s", exc)
            raise
        except transfer.TransferError as exc:
            self.log.error("upload of the checkpoint failed: %s", exc)
            raise CheckpointFailed(f"the checkpoint could not be uploaded: {describe_error(exc)}") from exc
        except Exception as exc:
            self.log.exception("checkpoint failed")
            raise CheckpointFailed(f"checkpoint failed: {describe_error(exc)}") from exc
        finally:
            if streamer is not None:
                streamer.close()
        self.saved_at_cell = cells_run
        self.committed = manifest.to_json()
        summary = manifest.summary()
        self.log.info("checkpoint %s written: %d variables saved", summary["id"], len(summary["saved"]))
        return summary

    def upload(self, plan: Mapping[str, Any]) -> None:
        """Send a committed checkpoint's ``data.bin`` as the parts of a multipart upload.

        Only presigned URLs arrive here: the kernel holds no credential for the store, and each
        URL is good for one part of one object under its owner's prefix, for minutes.
        """
        if self.config is None:
            raise CheckpointFailed(
                self.config_error or f"this kernel has no checkpoint directory ({ENV_DIR} is not set)"
            )
        self.uploaded = None
        checkpoint_id = str(plan["checkpoint"])
        with self._writing:
            path = self.config.kernel_dir / checkpoint_id / DATA_FILE
            try:
                with open(path, "rb") as handle:
                    size = os.fstat(handle.fileno()).st_size
                    region = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None
                try:
                    with memoryview(region) if region is not None else memoryview(b"") as view:
                        etags = transfer.upload_parts(
                            list(plan["urls"]),
                            view,
                            int(plan["part_size"]),
                            transform=_part_crypt(str(plan.get("key") or "")),
                            first=int(plan.get("first_part") or 0),
                        )
                finally:
                    _close_mapping(region)
            except (OSError, ValueError, transfer.TransferError) as exc:
                self.log.error("upload of checkpoint %s failed: %s", checkpoint_id, exc)
                raise CheckpointFailed(
                    f"the checkpoint could not be uploaded: {describe_error(exc)}"
                ) from exc
        self.uploaded = json.dumps(etags)
        self.log.info("checkpoint %s uploaded: %d bytes in %d parts", checkpoint_id, size, len(etags))

    def download(self) -> prefetch.Downloaded:
        """The checkpoint to restore, read from the object store: its manifest in a scratch folder
        laid out as a kernel folder, its ``data.bin`` beside it or in memory. The download the
        launcher started before the agent loaded (:mod:`kernelmgr.checkpoint.prefetch`) when
        there is one for this checkpoint, else the same download run here; its errors are raised
        here either way."""
        config = self.config
        assert config is not None and config.restore_checkpoint and config.restore_data_url
        source = prefetch.RestoreSource(
            kernel_dir=config.kernel_dir,
            checkpoint_id=config.restore_checkpoint,
            manifest_url=config.restore_manifest_url or "",
            data_url=config.restore_data_url,
            restore_key=config.restore_key,
            key=config.key,
            owner=config.owner,
            kernel_id=config.kernel_id,
        )
        started = prefetch.take(source)
        if started is None:
            self.prefetched = None
            got = prefetch.download(source)
        else:
            self.prefetched = {"lead": round(self._loaded_at - started.started_at, 3)}
            got = started.join()
            self.prefetched["seconds"] = round(got.seconds, 3)
            # In a child process of its own (its own GIL), or on a thread of this one.
            self.prefetched["in_child"] = got.pid != os.getpid()
            # Into a memory file, or (where there is none) a file in the kernel's folder.
            self.prefetched["in_memory"] = got.memory is not None
        return got

    # -- restore --------------------------------------------------------------------------

    def restore(self) -> dict[str, Any]:
        assert self.config is not None
        started = time.perf_counter()
        directory = self.config.kernel_dir
        source = directory
        downloaded = None
        got: prefetch.Downloaded | None = None
        try:
            if self.config.restore_data_url and self.config.restore_checkpoint:
                got = self.download()  # a CheckpointRefused or a TransferError is reported below
                source = got.scratch
                downloaded = time.perf_counter() - started
            self._restore_dir = source
            self._restore_data = got.data_file if got is not None else None
            report = restore_checkpoint(
                source,
                self.shell.user_ns,
                key=self.config.key,
                owner=self.config.owner,
                kernel_id=self.config.kernel_id,
                expected_checkpoint=self.expected_checkpoint(),
                on_read=ProgressFile(Path(directory)) if source == directory else None,
                # A copy downloaded from an object store is mapped, not read again into new
                # memory: only this kernel (and the server) can rewrite its scratch folder.
                map_buffers=self.config.restore_mapped or source != directory,
                data_key=self.config.data_key if source == directory else None,
                data_digest=got.digest if got is not None else None,
                data_file=got.data_file if got is not None else None,
            )
            if report is None:
                report = refused_report(
                    CheckpointRefused(f"no committed checkpoint was found in {directory}"),
                    time.perf_counter() - started,
                )
        except CheckpointRefused as exc:
            self.log.error("restore refused: %s", exc)
            report = refused_report(exc, time.perf_counter() - started)
        except Exception as exc:
            self.log.exception("restore failed")
            report = refused_report(
                CheckpointRefused(f"restore failed: {describe_error(exc)}"), time.perf_counter() - started
            )
        if downloaded is not None and isinstance(report.get("timings"), dict):
            # The wait for the download with its decryption and digest (logged and benchmarked,
            # never asserted); with a prefetch, only what was left of it when the agent asked.
            report["timings"]["download"] = round(downloaded, 3)
        # Whether the download began before the agent loaded (the launcher's), even when refused.
        report["prefetch"] = self.prefetched
        if not report["refused"]:
            self._resume_history(report)
        if got is not None:  # the downloaded copy (mapped arrays stay valid: their mappings hold it)
            got.close()
        self.report = report
        if not report["refused"] and not report["not_restored"]:
            self.saved_at_cell = self.cells_run  # the namespace is exactly the committed checkpoint
        self.namespace.adopt_restored(report.get("restored", []))
        self.shell.events.register("pre_execute", self._unhide_restored)
        try:
            write_file_atomic(
                directory / RESTORE_REPORT, json.dumps(report, indent=1).encode("utf-8"), mode=0o640
            )
        except OSError as exc:
            self.log.warning("could not write %s: %s", directory / RESTORE_REPORT, exc)
        self.log.info(
            "restore: %d restored, %d not restored, refused=%s, timings=%s",
            len(report["restored"]),
            len(report["not_restored"]),
            report["refused"],
            report.get("timings"),
        )
        self.shell.events.register("pre_run_cell", self.show_report)
        self._hook_registered = True
        self._guard_first_cell()
        return report

    def _resume_history(self, report: dict[str, Any]) -> None:
        """Take back the committed cell record; rebuild what was not restored by re-running cells.

        The record comes from the same verified manifest as the variables (re-read: it is
        small, and the restore already checked it), so the history continues across
        hibernations. Fills ``report["recomputed"]`` and, on each item still missing,
        ``not_recomputed`` (why).
        """
        assert self.config is not None
        report.setdefault("recomputed", [])
        try:
            manifest = load_verified_checkpoint(
                self._restore_dir or self.config.kernel_dir,
                self.config.key,
                self.config.owner,
                self.config.kernel_id,
                str(report.get("checkpoint")),
                self.config.data_key if self._restore_dir in (None, self.config.kernel_dir) else None,
                self._restore_data,
            )
            if manifest is None:
                return
            self.cells = [CellRecord.from_dict(raw) for raw in manifest.cells][-MAX_CELLS:]
        except Exception as exc:
            self.log.warning("the cell record could not be read back: %s", describe_error(exc))
            self.cells = []
            return
        missing = [item["name"] for item in report.get("not_restored", [])]
        if not missing:
            return
        limit = recompute_limit(os.environ)
        if limit <= 0:
            for item in report["not_restored"]:
                item["not_recomputed"] = f"recompute is off ({ENV_RECOMPUTE_SECONDS}=0)"
            return
        plan = plan_recompute(self.cells, missing, report.get("restored", []))
        outcome = replay(plan, self.shell.user_ns, transform=self.shell.transform_cell, limit=limit)
        done = set(outcome.recomputed)
        missing_items = {item["name"]: item for item in report["not_restored"]}
        report["recomputed"] = [
            {
                "name": name,
                "cells": outcome.cells,
                "stage": missing_items[name].get("stage", ""),  # why it was missing: save or load
                "reason": missing_items[name].get("reason", ""),
            }
            for name in outcome.recomputed
        ]
        report["not_restored"] = [item for item in report["not_restored"] if item["name"] not in done]
        for item in report["not_restored"]:
            item["not_recomputed"] = outcome.not_recomputed.get(item["name"], "not planned")
        self.namespace.adopt_restored(outcome.recomputed)
        self.log.info(
            "recompute: %d rebuilt by re-running cells %s in %.2f s; %d not",
            len(done),
            outcome.cells,
            outcome.seconds,
            len(report["not_restored"]),
        )

    def expected_checkpoint(self) -> str:
        """The checkpoint id the server expects restored; refused without one.

        Without it the agent could only restore whatever ``current`` names, and an older
        checkpoint put back in place would be restored silently.
        """
        assert self.config is not None
        if not self.config.restore_checkpoint:
            raise CheckpointRefused(
                f"{ENV_RESTORE}=1 but {ENV_RESTORE_CHECKPOINT} is not set: the server did not say which "
                "checkpoint it verified, so none was loaded"
            )
        return self.config.restore_checkpoint

    def refuse_restore(self, reason: str) -> None:
        """A restore was asked for but cannot be attempted: say so in the first cell."""
        self.report = refused_report(CheckpointRefused(reason))
        self.shell.events.register("pre_run_cell", self.show_report)
        self._hook_registered = True
        self._guard_first_cell()

    def _guard_first_cell(self) -> None:
        """The first user cell is not run when the restore lost what the checkpoint held
        (:mod:`kernelmgr.checkpoint.first_cell`); running it again runs it."""
        from kernelmgr.checkpoint.first_cell import guard_first_cell  # IPython's: only in a kernel

        if self.report is not None:
            self._first_cell = guard_first_cell(self.shell, self.report)

    def show_report(self, info: Any = None) -> None:
        """``pre_run_cell`` hook: show the report in the first user cell, then unregister."""
        if getattr(info, "silent", False):
            return
        self.unregister()
        if self.report is None:
            return
        plain, markdown = format_report(self.report)
        try:
            # This shell's publisher (ipykernel's sends display_data to the running cell).
            self.shell.display_pub.publish(
                data={"text/plain": plain, "text/markdown": markdown},
                metadata=notes.metadata("restore_report"),
            )
        except Exception:
            self.log.exception("could not display the restore report")

    def unregister(self) -> None:
        if self._hook_registered:
            self._hook_registered = False
            with contextlib.suppress(ValueError):
                self.shell.events.unregister("pre_run_cell", self.show_report)

    def unload(self) -> None:
        self.unregister()
        if self._first_cell is not None:
            self._first_cell.remove()
        atexit.unregister(self._exit_hook)
        for event, hook in (
            ("pre_run_cell", self._cell_started),
            ("post_run_cell", self._cell_finished),
            ("pre_execute", self._unhide_restored),
        ):
            with contextlib.suppress(ValueError):
                self.shell.events.unregister(event, hook)

    def watch_server(self, server_pid: str) -> None:
        """Start the server watchdog (once per process)."""
        global _WATCHDOG
        if _WATCHDOG is not None or self.config is None:
            return
        try:
            pid = int(server_pid)
        except ValueError:
            self.log.error("%s is not a pid: %r; not watching the server", ENV_SERVER_PID, server_pid)
            return
        from kernelmgr.checkpoint.watchdog import ServerWatchdog

        def checkpoint_and_report() -> None:
            agent = _AGENT if _AGENT is not None else self
            agent.checkpoint_if_changed()

        def busy() -> bool:
            agent = _AGENT if _AGENT is not None else self
            return agent.busy

        _WATCHDOG = ServerWatchdog(
            pid, on_server_gone=checkpoint_and_report, is_busy=busy, before_exit=lambda: flush(open_files())
        )
        _WATCHDOG.start()
        self.log.info("watching the server (pid %d): checkpoint and exit when it is gone", pid)

    def guard_termination(self) -> None:
        """Answer SIGTERM with a checkpoint and an exit (once per process; see
        :mod:`kernelmgr.checkpoint.termination`)."""
        global _GUARD
        if _GUARD is not None or self.config is None:
            return
        from kernelmgr.checkpoint.quick_exit import finish_saved_exit
        from kernelmgr.checkpoint.termination import (
            TerminationGuard,
            install,
            kernel_loop,
            watch_replies,
            watch_shutdown,
        )

        loop = kernel_loop(self.shell)
        if loop is None:
            self.log.info("no kernel event loop: SIGTERM keeps its default")
            return

        def current() -> _Agent:
            return _AGENT if _AGENT is not None else self

        def checkpoint() -> None:
            current().checkpoint_if_changed()

        def before_exit() -> None:
            agent = current()
            if agent.namespace_is_saved():
                finish_saved_exit(agent.shell, agent.log)  # IPython's exit work too, files flushed
            else:
                flush(open_files())

        guard = TerminationGuard(
            checkpoint=checkpoint,
            is_busy=lambda: current().busy,
            shutdown_requested=watch_shutdown(self.shell),
            schedule=loop.add_callback,
            before_exit=before_exit,
            reply_follows=watch_replies(self.shell, _reply_sent),
            log=self.log,
        )
        try:
            install(guard, loop)
        except (ValueError, RuntimeError) as exc:
            self.log.error("SIGTERM cannot be handled here (%s); a stopped kernel loses what changed", exc)
            return
        _GUARD = guard
        self.log.info("SIGTERM checkpoints what changed, then exits")


def _reply_sent() -> None:
    if _GUARD is not None:
        _GUARD.reply_sent()  # a SIGTERM that came during the cell is handled now


_AGENT: _Agent | None = None
# ``%reload_ext`` re-runs this module in the same namespace (``importlib.reload``): what must
# outlive that is taken over from the previous run.
_WATCHDOG: Any = globals().get("_WATCHDOG")
_GUARD: Any = globals().get("_GUARD")
#: The configuration read at the first load, per shell: the key file is gone after that, so a
#: reload (``%reload_ext``, which unloads first) reuses it.
_CONFIGS: weakref.WeakKeyDictionary[Any, AgentConfig] = (
    globals().get("_CONFIGS") or weakref.WeakKeyDictionary()
)


def _kept_config(shell: Any) -> AgentConfig | None:
    try:
        return _CONFIGS.get(shell)
    except TypeError:  # a shell that cannot be weakly referenced: nothing was kept
        return None


def _keep_config(shell: Any, config: AgentConfig) -> None:
    with contextlib.suppress(TypeError):
        _CONFIGS[shell] = config


def load_ipython_extension(ipython: Any) -> None:
    """Set up the agent in ``ipython``; restore now if ``ELASTIC_RESTORE=1``.

    The key file is read (and removed) on the first load only; a reload in the same shell
    (``%reload_ext``) keeps the configuration it had, and does not restore a second time.
    """
    global _AGENT
    if _AGENT is not None:
        _AGENT.unload()
    log: logging.Logger = getattr(ipython, "log", None) or _fallback_log
    config_error: str | None = None
    kept = _kept_config(ipython)
    if kept is not None:
        config: AgentConfig | None = dataclasses.replace(kept, restore=False)
    else:
        try:
            config = AgentConfig.from_env(os.environ)
        except ValueError as exc:
            config_error = f"the checkpoint agent is not configured: {exc}"
            log.error("%s", config_error)
            config = None
        finally:
            # Where the key was handed over is of no use to a cell or a child process.
            for name in (ENV_KEY_FILE, ENV_KEY_REMOVED, ENV_RESTORE_KEY):
                os.environ.pop(name, None)
    _AGENT = _Agent(ipython, config)
    _AGENT.config_error = config_error
    # The server checks the agent's version and checkpoint format in kernel_info (issue 27).
    advertise(getattr(ipython, "kernel", None))
    _keep_undelivered(getattr(ipython, "kernel", None))
    if config is not None:
        _keep_config(ipython, config)
    if config is None:
        prefetch.discard()
        if config_error is not None and os.environ.get(ENV_RESTORE, "") == "1":
            _AGENT.refuse_restore(config_error)
        log.info("checkpoint agent loaded without a usable configuration: checkpoints are disabled")
        return
    if config.restore:
        _AGENT.restore()
    # A download the launcher started that this restore did not take (none asked for, another
    # checkpoint, no configuration) is of no use: its scratch copy goes.
    prefetch.discard()
    server_pid = os.environ.get(ENV_SERVER_PID, "")
    if server_pid:
        _AGENT.watch_server(server_pid)
    if os.environ.get(ENV_CHECKPOINT_ON_SIGTERM, "") == "1":
        _AGENT.guard_termination()


#: The kernel's undelivered messages (:mod:`kernelmgr.checkpoint.outbox`): installed once a process.
_OUTBOX: outbox.Outbox | None = None


def _keep_undelivered(kernel: Any) -> None:
    global _OUTBOX
    if _OUTBOX is None and kernel is not None:
        try:
            _OUTBOX = outbox.install(kernel)
        except Exception:  # never a reason for the kernel not to start
            _fallback_log.exception("undelivered messages are not kept")


def unload_ipython_extension(ipython: Any) -> None:
    global _AGENT
    if _AGENT is not None and _AGENT.shell is ipython:
        _AGENT.unload()
        _AGENT = None


def checkpoint(plan: str | None = None) -> dict[str, Any]:
    """Checkpoint the user namespace now; return the manifest summary. ``plan`` (JSON, from
    :func:`streaming_checkpoint_code`): stream ``data.bin``'s parts to the object store meanwhile.

    Raises :class:`CheckpointFailed` with a one-line message when it could not be written
    (the previous checkpoint, if any, is still the committed one).
    """
    if _AGENT is None:
        raise CheckpointFailed("the checkpoint agent is not loaded in this kernel")
    return _AGENT.checkpoint(json.loads(plan) if plan is not None else None)


def estimate() -> str:
    """The estimated size of a checkpoint, in bytes, as a string (:data:`ESTIMATE_EXPRESSION`)."""
    if _AGENT is None:
        raise CheckpointFailed("the checkpoint agent is not loaded in this kernel")
    return str(_AGENT.estimate())


def last_commit() -> str:
    """The manifest (JSON) of the checkpoint this kernel committed last (:data:`COMMIT_EXPRESSION`)."""
    if _AGENT is None or _AGENT.committed is None:
        raise CheckpointFailed("this kernel has committed no checkpoint")
    return _AGENT.committed


def upload(plan: str) -> None:
    """Send a committed checkpoint's data through presigned part URLs (:func:`upload_code`)."""
    if _AGENT is None:
        raise CheckpointFailed("the checkpoint agent is not loaded in this kernel")
    _AGENT.upload(json.loads(plan))


def last_upload() -> str:
    """The JSON list of the last upload's part ETags (:data:`UPLOAD_EXPRESSION`)."""
    if _AGENT is None or _AGENT.uploaded is None:
        raise CheckpointFailed("this kernel has uploaded no checkpoint")
    return _AGENT.uploaded


def last_report_json() -> str:
    """The last restore's report as JSON (:data:`REPORT_EXPRESSION`)."""
    if _AGENT is None or _AGENT.report is None:
        raise CheckpointFailed("this kernel restored no checkpoint")
    return json.dumps(_AGENT.report, indent=1)


def last_restore_report() -> dict[str, Any] | None:
    """The report of the restore done when the extension loaded (``None`` if none)."""
    return _AGENT.report if _AGENT is not None else None


__all__ = [
    "CHECKPOINT_CODE",
    "COMMIT_EXPRESSION",
    "ESTIMATE_EXPRESSION",
    "REPORT_EXPRESSION",
    "UPLOAD_EXPRESSION",
    "AgentConfig",
    "checkpoint",
    "estimate",
    "format_report",
    "last_commit",
    "last_restore_report",
    "last_upload",
    "load_ipython_extension",
    "streaming_checkpoint_code",
    "unload_ipython_extension",
    "upload",
    "upload_code",
]
