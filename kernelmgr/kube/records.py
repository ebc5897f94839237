"""The kernel registry in the Kubernetes API: one ConfigMap per kernel, not a file on a shared claim.

In Kubernetes mode the gateway's registry of kernels (id, owner, GPU size, state, checkpoint id,
last kernel_info reply: :class:`~kernelmgr.lifecycle.records.KernelRecord`) is kept as one small
ConfigMap per kernel in the kernel namespace, labelled so one paginated list finds them all. Any
gateway (a restarted one, a standby taking over) rebuilds its model from that list plus the pod
watch; nothing depends on a file that two gateways could both write (last writer wins) or on NFS
rename semantics. A hibernated kernel has no pod: its ConfigMap is its only trace besides its
checkpoint.

Why ConfigMaps and not a CRD: a CRD is cluster-scoped (installing or upgrading it needs cluster
admin, and Helm never upgrades CRDs), while ConfigMaps need only namespaced rights next to the pods'
and Secrets'. Why one per kernel and not one for all: a ConfigMap holds at most 1 MiB (a few
thousand records) and every change would rewrite all of them.

Same interface as :class:`~kernelmgr.lifecycle.records.KernelStateFile` (``load``, ``write``,
``save``), so the write-behind and the recovery do not change: :meth:`write` compares the new
registry with what it last wrote and creates, replaces or deletes only the kernels that changed.
Every write goes through the cluster's fenced client: a gateway without the Lease writes nothing.

Upgrading from a version that kept the registry in a file (``kernels-<identity>.json`` beside the
checkpoints): the first load that finds that file imports it (records already in ConfigMaps win),
writes the ConfigMaps, and renames the file ``….imported`` once every record is written, so the
hibernated kernels are listed after the upgrade and the file is never read again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kubernetes import client

from kernelmgr.lifecycle.records import KernelRecord, KernelStateFile

RECORD_KEY = "record.json"
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "elastic.jupyter.org/component"
REGISTRY_LABEL = "elastic.jupyter.org/registry"
KERNEL_ID_LABEL = "elastic.jupyter.org/kernel-id"
STATE_LABEL = "elastic.jupyter.org/state"
OWNER_ANNOTATION = "elastic.jupyter.org/owner"
COMPONENT = "kernel-record"
PAGE = 500
#: What an imported registry file is renamed to (its name plus this).
IMPORTED_SUFFIX = ".imported"


def record_name(kernel_id: str) -> str:
    return f"elastic-kernel-{kernel_id}"


class KubeRecordStore:
    """:class:`KernelRecord` by kernel id, one ConfigMap each, in ``namespace``."""

    def __init__(
        self,
        core: Any,
        namespace: str,
        registry: str,
        log: logging.Logger | None = None,
        legacy_file: str | Path | None = None,
    ) -> None:
        #: A callable giving the (fenced) CoreV1Api: ``KubeCluster.core``.
        self.core = core
        #: The registry file of a version before the ConfigMaps: imported once, then renamed.
        self.legacy_file = Path(legacy_file) if legacy_file is not None else None
        self.namespace = namespace
        self.registry = registry
        self.log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        #: kernel id -> the JSON last read or written: only differences are written.
        self._known: dict[str, str] = {}
        self._prefetched: dict[str, KernelRecord] | None = None

    @property
    def path(self) -> str:
        """How log lines name this store (the file's path, for the file store)."""
        return f"ConfigMaps {self.selector} in namespace {self.namespace}"

    @property
    def selector(self) -> str:
        return f"{COMPONENT_LABEL}={COMPONENT},{REGISTRY_LABEL}={self.registry}"

    def prefetch(self) -> None:
        """List the records now (in a worker thread): the next :meth:`load` returns them at once."""
        self._prefetched = self.load()

    def load(self, attempts: int = 5) -> dict[str, KernelRecord]:
        """Every record, from one paginated list; raises ValueError (the recovery logs it) when the
        API server does not answer after ``attempts`` tries."""
        if self._prefetched is not None:
            prefetched, self._prefetched = self._prefetched, None
            return prefetched
        for attempt in range(attempts):
            try:
                items = self._list()
                break
            except client.ApiException as exc:
                if attempt + 1 == attempts or exc.status in (401, 403):
                    raise ValueError(f"could not list the kernel records ({self.path}): {exc}") from exc
            except OSError as exc:
                if attempt + 1 == attempts:
                    raise ValueError(f"could not list the kernel records ({self.path}): {exc}") from exc
            time.sleep(min(2.0**attempt, 10.0))
        records: dict[str, KernelRecord] = {}
        known: dict[str, str] = {}
        for item in items:
            raw = (item.data or {}).get(RECORD_KEY)
            try:
                parsed = json.loads(raw) if raw else None
                record = KernelRecord.from_dict(parsed) if isinstance(parsed, dict) else None
            except (TypeError, ValueError) as exc:
                self.log.error("Kernel record %s is unreadable (%s); it is ignored", item.metadata.name, exc)
                continue
            if record is None:
                continue
            records[record.kernel_id] = record
            known[record.kernel_id] = _dump(asdict(record))
        with self._lock:
            self._known = known
        return self._import_legacy(records)

    def _import_legacy(self, records: dict[str, KernelRecord]) -> dict[str, KernelRecord]:
        """``records`` plus the old registry file's, written as ConfigMaps; the file renamed once all
        are (a failure leaves it for the next load to finish). Raises ValueError as :meth:`load`."""
        legacy = self.legacy_file
        if legacy is None or not legacy.exists():
            return records
        old = KernelStateFile(legacy).load()  # unreadable: ValueError, the recovery logs it
        merged = {**old, **records}
        try:
            self.write(self.serialize(merged))
        except OSError as exc:
            raise ValueError(f"kernel registry {legacy} not imported into {self.path}: {exc}") from exc
        done = legacy.with_name(legacy.name + IMPORTED_SUFFIX)
        try:
            os.replace(legacy, done)
        except OSError as exc:
            self.log.error(
                "Kernel registry %s imported but not renamed (%s): rename it %s", legacy, exc, done
            )
            return merged
        self.log.warning(
            "Imported %d kernel record(s) from the registry file of an earlier version (%s) into %s; "
            "the file is renamed %s and no longer read",
            len(set(old) - set(records)),
            legacy,
            self.path,
            done.name,
        )
        return merged

    def _list(self) -> list[Any]:
        items: list[Any] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"label_selector": self.selector, "limit": PAGE}
            if token:
                kwargs["_continue"] = token
            core = self.core()
            page = core.list_namespaced_config_map(self.namespace, **kwargs)
            items.extend(page.items)
            token = page.metadata._continue if page.metadata is not None else None
            if not token:
                return items

    serialize = staticmethod(KernelStateFile.serialize)

    def save(self, records: dict[str, KernelRecord]) -> None:
        self.write(self.serialize(records))

    def write(self, payload: str) -> None:
        """Make the ConfigMaps match ``payload`` (a serialized registry): blocking, a worker's job.

        Raises OSError when a call fails (the write-behind logs it and tries again with the next
        save); the calls that succeeded are remembered, so the retry does only the rest.
        """
        wanted = {kid: _dump(rec) for kid, rec in json.loads(payload).get("kernels", {}).items()}
        with self._lock:
            known = dict(self._known)
            failures: list[str] = []
            for kernel_id, body in wanted.items():
                if known.get(kernel_id) == body:
                    continue
                try:
                    self._put(kernel_id, body)
                    self._known[kernel_id] = body
                except Exception as exc:
                    failures.append(f"{kernel_id}: {exc}")
            for kernel_id in set(known) - set(wanted):
                try:
                    core = self.core()
                    core.delete_namespaced_config_map(record_name(kernel_id), self.namespace)
                except client.ApiException as exc:
                    if exc.status != 404:
                        failures.append(f"{kernel_id}: {exc}")
                        continue
                except Exception as exc:
                    failures.append(f"{kernel_id}: {exc}")
                    continue
                self._known.pop(kernel_id, None)
        if failures:
            raise OSError(f"{len(failures)} kernel record(s) not written: {'; '.join(failures)[:500]}")

    def _put(self, kernel_id: str, body: str) -> None:
        record = json.loads(body)
        manifest = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": record_name(kernel_id),
                "namespace": self.namespace,
                "labels": {
                    NAME_LABEL: "jupyter-elastic-kernels",
                    COMPONENT_LABEL: COMPONENT,
                    REGISTRY_LABEL: self.registry,
                    KERNEL_ID_LABEL: kernel_id,
                    STATE_LABEL: str(record.get("state", "")),
                },
                "annotations": {OWNER_ANNOTATION: str(record.get("owner", ""))},
            },
            "data": {RECORD_KEY: body},
        }
        core = self.core()
        try:
            core.replace_namespaced_config_map(record_name(kernel_id), self.namespace, manifest)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            core.create_namespaced_config_map(self.namespace, manifest)


def _dump(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True)
