"""Shared watches: list once, then watch from that list's resourceVersion; everything else reads a cache.

Enterprise Gateway polls the API once per kernel, which is what breaks it at a few hundred
kernels. Here one background thread per watched collection lists it once, then watches it from
that list's resourceVersion; everything else reads the in-memory cache. The thread resumes from
the last resourceVersion it saw after a dropped connection, and lists again only when the API
server answers 410 Gone (the version was compacted away). Asyncio code waits on the cache through
:meth:`Informer.wait_for`, woken with ``loop.call_soon_threadsafe``: no Kubernetes call ever runs
on an event loop.

:class:`Informer` works for any list function of the Kubernetes client (``list_node``,
``list_namespaced_pod``, ...): it keys objects with a function of the caller's and tells
listeners what changed, in batches (a whole re-list is one batch). :class:`PodInformer` is the
kernel pods' informer (keyed by the kernel id label); the node inventory
(:mod:`kernelmgr.kube.nodes`) uses a node informer.

Memory stays bounded through a re-list (a restart, or 410 Gone after a long disconnect): the
list comes in pages of :attr:`Informer.page_size` objects, each transformed (fields nobody reads
dropped) as it arrives, and an object whose resourceVersion the cache already holds keeps the
cached copy, so a re-list holds the cache plus one page, not two full copies of every pod.

A watch the server's Role does not allow (403 on list or watch) is not retried silently while a
kernel start waits out its whole launch timeout: the refusal (a
:class:`~kernelmgr.kube.access.KubeForbidden` naming the missing rule) is kept in
:attr:`Informer.failure` and raised by every :meth:`Informer.wait_for` until a watch runs again
(an admin fixed the Role; the thread keeps trying every few seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client, watch

from kernelmgr.kube.access import ExplainedCoreV1Api, KubeRefused
from kernelmgr.kube.labels import DEFAULT_INSTANCE, kernel_id_of
from kernelmgr.kube.pods import stop_began
from kernelmgr.kube.shapes import KERNEL_POD, Shape, ShapedWatch

log = logging.getLogger(__name__)

#: Objects per page of a list: bounds a re-list's peak memory (a page of full pods is a few MiB).
PAGE_SIZE = 500

Predicate = Callable[[Any], bool]
#: Called on the informer's thread after the cache changed: ``{key: object, or None if gone}``.
Listener = Callable[[Mapping[str, Any | None]], None]


class Informer:
    """A cache of the objects ``list_func(*list_args, **list_kwargs)`` returns, kept current by a watch.

    ``key`` names each object in the cache (``None``: not cached). Listeners added with
    :meth:`add_listener` run on the informer's thread after each change to the cache, with the
    keys that changed (after a re-list: every key that was or is in the cache) mapped to the new
    object, or ``None`` for one that is gone. They must be quick and must not raise (an exception
    is logged and swallowed, so one bad listener cannot stop the watch). ``transform`` (optional)
    is applied to every object before it is cached; ``shape`` (optional) reads the API's JSON
    itself and keeps only what its :class:`~kernelmgr.kube.shapes.Shape` names (cheaper than
    the client's whole models).
    """

    def __init__(
        self,
        list_func: Callable[..., Any],
        *,
        key: Callable[[Any], str | None],
        name: str,
        list_args: tuple[Any, ...] = (),
        list_kwargs: Mapping[str, Any] | None = None,
        watch_timeout: int = 300,
        retry_delay: float = 1.0,
        transform: Callable[[Any], Any] | None = None,
        page_size: int | None = PAGE_SIZE,
        shape: Shape | None = None,
    ) -> None:
        self.list_func = list_func
        self.page_size = page_size
        self.shape = shape
        self.key = key
        self.transform = transform
        self.name = name
        self.list_args = list_args
        self.list_kwargs = dict(list_kwargs or {})
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        #: How often the cache was rebuilt from a list (the first list included): tests read it.
        self.lists = 0
        #: How many pages those lists took (one per ``page_size`` objects).
        self.pages = 0
        #: ``time.monotonic()`` of the last list or event applied (bookmarks too): the watch's health.
        self.last_event_at: float | None = None
        #: The resourceVersion of the last event applied: where a broken watch resumes.
        self._seen: str | None = None
        #: Why the watch cannot run (the API server refused it), ``None`` while it can.
        self.failure: KubeRefused | None = None
        self._items: dict[str, Any] = {}
        #: The last object deleted under each key, until a new one appears there: what a reader
        #: that finds nothing can still learn of how it ended (its deletion time and grace).
        self._deleted: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._synced = threading.Event()
        self._stopped = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None

    # ---- the background thread

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` after every change (add it before :meth:`start` to see the first list)."""
        with self._lock:
            self._listeners.append(listener)

    def start(self) -> Informer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        version: str | None = None
        while not self._stopped.is_set():
            try:
                if version is None:
                    version = self.relist()
                    self._seen = version
                self._watch_from(version)
                version = self._seen
            except KubeRefused as exc:
                # Not retried silently while a kernel start waits out its launch timeout: every
                # waiter gets the refusal (naming the missing rule) until a watch runs again.
                log.error("%s watch refused: %s", self.name, exc)
                self.failure = exc
                self._wake_all()
                version = None  # list again once it is allowed
                self._stopped.wait(max(self.retry_delay, 5.0))
            except client.ApiException as exc:
                if exc.status == 410:
                    log.info("%s watch: resourceVersion expired, listing again", self.name)
                    version = None
                    continue
                log.warning("%s watch failed: %s %s; retrying", self.name, exc.status, exc.reason)
                version = self._seen or version
                self._stopped.wait(self.retry_delay)
            except Exception as exc:  # a dropped connection, an API server restart
                version = self._seen or version  # resume after the last event applied, not before it
                if self._stopped.is_set():
                    break
                log.warning("%s watch disconnected (%s); resuming", self.name, exc)
                self._stopped.wait(self.retry_delay)

    def relist(self) -> str:
        """List everything again, page by page; the new cache replaces the old one at the end
        (what the watch thread does at its start and after 410 Gone; benchmarks call it too).

        All pages are one snapshot (the first page's resourceVersion, which the watch resumes
        from). A continue token that expired mid-list is a 410: :meth:`_run` lists again.
        """
        with self._lock:
            cached = {obj.metadata.uid: (k, obj) for k, obj in self._items.items() if obj.metadata.uid}
        fresh: dict[str, Any] = {}
        version, token = "", None
        while True:
            kwargs = dict(self.list_kwargs)
            if self.page_size:
                kwargs["limit"] = self.page_size
            if token:
                kwargs["_continue"] = token
            items, page_version, token = self._list_page(kwargs)
            self.pages += 1
            version = version or page_version
            for item in items:
                uid, resource_version = _identity(item)
                known = cached.get(uid)
                if (
                    known is not None
                    and resource_version
                    and known[1].metadata.resource_version == resource_version
                ):
                    fresh[known[0]] = known[1]  # unchanged: the cached copy stays, nothing is built
                    continue
                obj = self.shape.build(item) if self.shape is not None else item
                k = self.key(obj)
                if k:
                    fresh[k] = obj if self.transform is None else self.transform(obj)
            del items  # one page alive at a time
            if not token:
                break
        del cached
        with self._lock:
            changed = set(self._items) | set(fresh)
            self._items = fresh
        self.lists += 1
        self.last_event_at = time.monotonic()
        self._synced.set()
        self._changed({k: fresh.get(k) for k in changed}, always=True)
        return version

    def _list_page(self, kwargs: dict[str, Any]) -> tuple[list[Any], str, str | None]:
        """One page: its objects (plain JSON with a shape), the list's resourceVersion, the token."""
        if self.shape is None:
            listed = self.list_func(*self.list_args, **kwargs)
            meta = listed.metadata
            return list(listed.items), str(meta.resource_version or ""), meta._continue or None
        response = self.list_func(*self.list_args, **kwargs, _preload_content=False)
        doc = json.loads(response.data)
        meta = doc.get("metadata") or {}
        return (
            list(doc.get("items") or []),
            str(meta.get("resourceVersion") or ""),
            meta.get("continue") or None,
        )

    def _watch_from(self, version: str) -> str:
        """Apply events until the watch ends; return the last resourceVersion seen."""
        self._watch = watch.Watch() if self.shape is None else ShapedWatch(self.shape)
        stream = self._watch.stream(
            self.list_func,
            *self.list_args,
            **self.list_kwargs,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout,
            _request_timeout=self.watch_timeout + 30,
        )
        for event in stream:
            self.failure = None  # the watch runs: it is allowed (again)
            self.last_event_at = time.monotonic()
            if self._stopped.is_set():
                break
            kind = event["type"]
            item = event["object"]
            if kind == "ERROR":
                raw = event.get("raw_object") or {}
                reason = raw.get("message", "watch error")
                raise client.ApiException(status=raw.get("code", 500), reason=reason)
            if kind == "BOOKMARK":  # the client leaves a bookmark's object a plain dict
                raw = event.get("raw_object") or {}
                version = (raw.get("metadata") or {}).get("resourceVersion") or version
                self._seen = version
                continue
            version = item.metadata.resource_version or version
            self._seen = version
            if self.transform is not None:
                item = self.transform(item)
            k = self.key(item)
            if not k:
                continue
            with self._lock:
                if kind == "DELETED":
                    current = self._items.get(k)
                    if current is None or current.metadata.uid != item.metadata.uid:
                        continue  # an older object under the same key: the cache already moved on
                    del self._items[k]
                    self._deleted[k] = item
                    now = None
                else:
                    self._items[k] = now = item
                    self._deleted.pop(k, None)
            self._changed({k: now})
        return version

    def _wake_all(self) -> None:
        with self._lock:
            waiters = [w for entries in self._waiters.values() for w in entries]
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    def _changed(self, changes: Mapping[str, Any | None], always: bool = False) -> None:
        with self._lock:
            listeners = list(self._listeners)
            waiters = [w for k in changes for w in self._waiters.get(k, ())]
        if changes or always:
            for listener in listeners:
                try:
                    listener(changes)
                except Exception:
                    log.exception("%s informer: a listener failed", self.name)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(event.set)

    # ---- what readers use

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout: float) -> bool:
        """Block (not on an event loop!) until the first list is in; ``False`` after ``timeout``."""
        return self._synced.wait(timeout)

    def get(self, key: str) -> Any | None:
        """The newest object under ``key`` the watch has seen (``None``: there is none)."""
        with self._lock:
            return self._items.get(key)

    def last_deleted(self, key: str) -> Any | None:
        """The object the watch last saw deleted under ``key`` (``None`` once a new one appeared)."""
        with self._lock:
            return self._deleted.get(key)

    def items(self) -> dict[str, Any]:
        """A snapshot of the cache."""
        with self._lock:
            return dict(self._items)

    async def wait_for(self, key: str, predicate: Predicate, timeout: float) -> Any | None:
        """Wait until ``predicate(object or None)`` holds for the cached object; return that object.

        Raises ``TimeoutError`` when ``timeout`` passes first. Never calls the API.
        """
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while not self._synced.is_set() and self.failure is None and time.monotonic() < deadline:
            await asyncio.to_thread(self._synced.wait, min(0.5, max(0.0, deadline - time.monotonic())))
        event = asyncio.Event()
        entry = (loop, event)
        with self._lock:
            self._waiters.setdefault(key, set()).add(entry)
        try:
            while True:
                event.clear()
                if self.failure is not None:
                    raise self.failure
                item = self.get(key)
                if self._synced.is_set() and predicate(item):
                    return item
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name} {key} did not reach the expected state")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            with self._lock:
                waiting = self._waiters.get(key)
                if waiting is not None:
                    waiting.discard(entry)
                    if not waiting:
                        del self._waiters[key]


#: How many kernels' first stop times a pod watch remembers (the oldest are forgotten first).
STOPS_REMEMBERED = 10_000


class PodInformer(Informer):
    """A cache of the kernel pods of release ``instance`` among those matching ``label_selector`` in
    ``namespace``, keyed by kernel id (:func:`~kernelmgr.kube.labels.kernel_id_of`)."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        label_selector: str,
        *,
        watch_timeout: int = 300,
        retry_delay: float = 1.0,
        instance: str = DEFAULT_INSTANCE,
    ) -> None:
        self.api = api
        self.instance = instance
        self.namespace = namespace
        self.label_selector = label_selector
        #: Per kernel id: (pod uid, when Kubernetes began stopping that pod, as first seen).
        self._first_stops: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._stops_lock = threading.Lock()
        super().__init__(
            ExplainedCoreV1Api(api).list_namespaced_pod,
            transform=self._seen_pod,
            shape=KERNEL_POD,
            key=self._kernel_id,
            name=f"pod-{namespace}",
            list_args=(namespace,),
            list_kwargs={"label_selector": label_selector},
            watch_timeout=watch_timeout,
            retry_delay=retry_delay,
        )

    def _kernel_id(self, pod: Any) -> str | None:
        return kernel_id_of(pod.metadata.labels, self.instance)

    def start(self) -> PodInformer:
        super().start()
        return self

    def _seen_pod(self, pod: Any) -> Any:
        """Every pod the watch brings: remember when its stop began, the first time it is seen."""
        began, kernel_id = stop_began(pod), self._kernel_id(pod)
        if began is not None and kernel_id is not None:
            with self._stops_lock:
                known = self._first_stops.get(kernel_id)
                if known is None or known[0] != pod.metadata.uid:
                    self._first_stops[kernel_id] = (pod.metadata.uid, began)
                    self._first_stops.move_to_end(kernel_id)
                    while len(self._first_stops) > STOPS_REMEMBERED:
                        self._first_stops.popitem(last=False)
        return pod

    def stop_began(self, kernel_id: str, pod: Any) -> float | None:
        """When Kubernetes began stopping ``pod`` (epoch seconds), as the watch first saw it.

        A pod's own fields stop saying so once its containers ended: the kubelet then deletes it
        with no grace period, which moves ``deletionTimestamp`` to that moment. A kernel that
        checkpointed at SIGTERM did so before it, so only the first stop tells that the checkpoint
        was written at the stop (:func:`kernelmgr.lifecycle.loss.saved_at_stop`).
        """
        if pod is None:
            return None
        with self._stops_lock:
            known = self._first_stops.get(kernel_id)
        if known is not None and known[0] == pod.metadata.uid:
            return known[1]
        return stop_began(pod)

    async def wait_for(self, kernel_id: str, predicate: Predicate, timeout: float) -> Any | None:
        """Wait until ``predicate(pod or None)`` holds for the kernel's cached pod; return that pod.

        Raises ``TimeoutError`` when ``timeout`` passes first, and the watch's
        :attr:`failure` when the API server refuses it. Never calls the API.
        """
        try:
            return await super().wait_for(kernel_id, predicate, timeout)
        except TimeoutError:
            raise TimeoutError(f"pod of kernel {kernel_id} did not reach the expected state") from None


def _identity(item: Any) -> tuple[str | None, str | None]:
    """(uid, resourceVersion) of a listed object, a model or plain JSON."""
    if isinstance(item, dict):
        meta = item.get("metadata") or {}
        return meta.get("uid"), meta.get("resourceVersion")
    return item.metadata.uid, item.metadata.resource_version


def without_managed_fields(obj: Any) -> Any:
    """Drop ``metadata.managedFields`` (a quarter of a cached pod's memory; nothing reads it)."""
    metadata = getattr(obj, "metadata", None)
    if metadata is not None:
        metadata.managed_fields = None
    return obj
