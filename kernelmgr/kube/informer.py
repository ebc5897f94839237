"""One shared watch of all kernel pods: the only way the server learns what its pods do.

Enterprise Gateway polls the API once per kernel, which is what breaks it at a few hundred
kernels. Here one background thread lists the kernel pods once, then watches them from that
list's resourceVersion; everything else reads the in-memory cache. The thread resumes from the
last resourceVersion it saw after a dropped connection, and lists again only when the API server
answers 410 Gone (the version was compacted away). Asyncio code waits on the cache through
:meth:`PodInformer.wait_for`, woken with ``loop.call_soon_threadsafe``: no Kubernetes call ever
runs on an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch

log = logging.getLogger(__name__)

KERNEL_ID_LABEL = "kernel_id"

Predicate = Callable[[Any], bool]


class PodInformer:
    """A cache of the pods matching ``label_selector`` in ``namespace``, keyed by kernel id."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        label_selector: str,
        *,
        watch_timeout: int = 300,
        retry_delay: float = 1.0,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.label_selector = label_selector
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        #: How often the cache was rebuilt from a list (the first list included): tests read it.
        self.lists = 0
        self._pods: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._synced = threading.Event()
        self._stopped = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None

    # ---- the background thread

    def start(self) -> PodInformer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"pod-informer-{self.namespace}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        core = client.CoreV1Api(self.api)
        version: str | None = None
        while not self._stopped.is_set():
            try:
                if version is None:
                    version = self._relist(core)
                version = self._watch_from(core, version)
            except client.ApiException as exc:
                if exc.status == 410:
                    log.info("pod watch in %s: resourceVersion expired, listing again", self.namespace)
                    version = None
                    continue
                log.warning("pod watch in %s failed: %s %s; retrying", self.namespace, exc.status, exc.reason)
                self._stopped.wait(self.retry_delay)
            except Exception as exc:  # a dropped connection, an API server restart
                if self._stopped.is_set():
                    break
                log.warning("pod watch in %s disconnected (%s); resuming", self.namespace, exc)
                self._stopped.wait(self.retry_delay)

    def _relist(self, core: client.CoreV1Api) -> str:
        listed = core.list_namespaced_pod(self.namespace, label_selector=self.label_selector)
        fresh = {kid: pod for pod in listed.items if (kid := _kernel_id(pod))}
        with self._lock:
            changed = set(self._pods) | set(fresh)
            self._pods = fresh
        self.lists += 1
        self._synced.set()
        for kernel_id in changed:
            self._notify(kernel_id)
        return str(getattr(listed.metadata, "resource_version", "") or "")

    def _watch_from(self, core: client.CoreV1Api, version: str) -> str:
        """Apply events until the watch ends; return the last resourceVersion seen."""
        self._watch = watch.Watch()
        stream = self._watch.stream(
            core.list_namespaced_pod,
            self.namespace,
            label_selector=self.label_selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout,
            _request_timeout=self.watch_timeout + 30,
        )
        for event in stream:
            if self._stopped.is_set():
                break
            kind = event["type"]
            pod = event["object"]
            if kind == "ERROR":
                raw = event.get("raw_object") or {}
                reason = raw.get("message", "watch error")
                raise client.ApiException(status=raw.get("code", 500), reason=reason)
            if kind == "BOOKMARK":  # the client leaves a bookmark's object a plain dict
                raw = event.get("raw_object") or {}
                version = (raw.get("metadata") or {}).get("resourceVersion") or version
                continue
            version = pod.metadata.resource_version or version
            kernel_id = _kernel_id(pod)
            if not kernel_id:
                continue
            with self._lock:
                if kind == "DELETED":
                    current = self._pods.get(kernel_id)
                    if current is not None and current.metadata.uid == pod.metadata.uid:
                        del self._pods[kernel_id]
                else:
                    self._pods[kernel_id] = pod
            self._notify(kernel_id)
        return version

    def _notify(self, kernel_id: str) -> None:
        with self._lock:
            waiters = list(self._waiters.get(kernel_id, ()))
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(event.set)

    # ---- what the provisioner reads

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def get(self, kernel_id: str) -> Any | None:
        """The newest pod of the kernel the watch has seen (``None``: there is none)."""
        with self._lock:
            return self._pods.get(kernel_id)

    async def wait_for(self, kernel_id: str, predicate: Predicate, timeout: float) -> Any | None:
        """Wait until ``predicate(pod or None)`` holds for the cached pod; return that pod.

        Raises ``TimeoutError`` when ``timeout`` passes first. Never calls the API.
        """
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        if not self._synced.is_set():
            await asyncio.to_thread(self._synced.wait, timeout)
        event = asyncio.Event()
        entry = (loop, event)
        with self._lock:
            self._waiters.setdefault(kernel_id, set()).add(entry)
        try:
            while True:
                event.clear()
                pod = self.get(kernel_id)
                if self._synced.is_set() and predicate(pod):
                    return pod
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"pod of kernel {kernel_id} did not reach the expected state")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            with self._lock:
                waiting = self._waiters.get(kernel_id)
                if waiting is not None:
                    waiting.discard(entry)
                    if not waiting:
                        del self._waiters[kernel_id]


def _kernel_id(pod: Any) -> str | None:
    labels = pod.metadata.labels or {}
    return labels.get(KERNEL_ID_LABEL)
