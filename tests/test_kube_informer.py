"""The shared pod watch over a long run: bookmarks and watch renewals keep it connected.

The API server sends a BOOKMARK event about every minute and two seconds before a watch's
deadline (``allowWatchBookmarks``); the client hands its object over as a plain dict. A short
watch timeout brings that within a test's time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from kernelmgr.kube.informer import PodInformer  # noqa: E402
from kernelmgr.kube.labels import (  # noqa: E402
    DEFAULT_INSTANCE,
    KERNEL_ID_LABEL,
    KERNEL_WATCH_SELECTOR,
    kernel_labels,
)

pytestmark = pytest.mark.timeout(120)


def pending_pod(kernel_id: str) -> dict[str, Any]:
    return {
        "metadata": {"name": f"p-{kernel_id}", "labels": kernel_labels(DEFAULT_INSTANCE, kernel_id, "alice")},
        "spec": {
            "nodeSelector": {"elastic.test/nowhere": "true"},
            "containers": [{"name": "k", "image": "python:3.12", "command": ["true"]}],
        },
    }


def test_watch_survives_bookmarks_and_renewals(
    kube_plane: ControlPlane, kube_api: Any, kube_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    core: Any = client.CoreV1Api(kube_api)  # the stubs do not take plain dict manifests
    informer = PodInformer(
        client.ApiClient(kube_plane.configuration()), kube_namespace, KERNEL_WATCH_SELECTOR, watch_timeout=4
    )
    caplog.set_level(logging.INFO, logger="kernelmgr.kube.informer")
    informer.start()
    try:
        core.create_namespaced_pod(kube_namespace, pending_pod("a"))
        asyncio.run(informer.wait_for("a", lambda pod: pod is not None, 30))
        time.sleep(9)  # two watches end at their deadline, each after a bookmark 2 s before it
        core.create_namespaced_pod(kube_namespace, pending_pod("b"))
        asyncio.run(informer.wait_for("b", lambda pod: pod is not None, 30))
    finally:
        informer.stop()
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert problems == [], problems  # no disconnect, no re-list
    assert informer.lists == 1


def test_a_pods_stop_is_when_the_watch_first_saw_it(kube_api: Any, kube_namespace: str) -> None:
    """The kubelet ends a stopped pod with a second delete, with no grace period, once its
    containers ended: that moves ``deletionTimestamp`` to then. When the stop began (a kernel's
    SIGTERM checkpoint is newer than it: nothing was lost) is what the watch saw first."""
    from kernelmgr.kube.pods import stop_began

    core: Any = client.CoreV1Api(kube_api)
    informer = PodInformer(kube_api, kube_namespace, KERNEL_WATCH_SELECTOR).start()
    try:
        # Bound to a node with no kubelet: a graceful delete leaves it there, stopping.
        core.create_namespaced_pod(
            kube_namespace,
            {**pending_pod("a"), "spec": {**pending_pod("a")["spec"], "nodeName": "no-kubelet"}},
        )
        asyncio.run(informer.wait_for("a", lambda pod: pod is not None, 30))
        core.delete_namespaced_pod("p-a", kube_namespace, grace_period_seconds=60)
        stopping = asyncio.run(
            informer.wait_for("a", lambda pod: pod is not None and pod.metadata.deletion_timestamp, 30)
        )
        first = stop_began(stopping)
        assert first is not None
        # The kernel's work at SIGTERM takes seconds (timestamps have whole seconds).
        time.sleep(max(0.0, first + 2 - time.time()))
        core.delete_namespaced_pod("p-a", kube_namespace, grace_period_seconds=0)  # as the kubelet does
        asyncio.run(informer.wait_for("a", lambda pod: pod is None, 30))
        final = informer.last_deleted("a")
        assert final is not None and final.metadata.deletion_grace_period_seconds == 0
        assert stop_began(final) != first  # the final object says the stop began at its end
        assert informer.stop_began("a", final) == first
    finally:
        informer.stop()


def test_a_relist_comes_in_pages_keeps_unchanged_pods_and_only_their_node(
    kube_api: Any, kube_namespace: str
) -> None:
    """A re-list's memory is the cache plus one page: lists in pages, a pod whose resourceVersion
    the cache holds keeps the cached copy, and a cached pod keeps of its spec only the node."""
    core: Any = client.CoreV1Api(kube_api)
    for n in range(7):
        pod = pending_pod(str(n))
        core.create_namespaced_pod(kube_namespace, {**pod, "spec": {**pod["spec"], "nodeName": "no-kubelet"}})
    informer = PodInformer(kube_api, kube_namespace, KERNEL_WATCH_SELECTOR)  # not started: lists on demand
    informer.page_size = 3
    informer.relist()
    assert (informer.pages, sorted(informer.items())) == (3, [str(n) for n in range(7)])
    kept, changed = informer.get("0"), informer.get("1")
    assert kept.spec.node_name == "no-kubelet" and kept.spec.containers == [], kept.spec
    assert kept.metadata.labels[KERNEL_ID_LABEL] == "0" and kept.status.phase == "Pending"
    core.patch_namespaced_pod("p-1", kube_namespace, {"metadata": {"labels": {"seen": "again"}}})
    informer.relist()
    assert informer.pages == 6
    assert informer.get("0") is kept  # unchanged: not replaced by the listed copy
    assert informer.get("1") is not changed and informer.get("1").metadata.labels["seen"] == "again"
