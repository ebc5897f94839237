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

pytestmark = pytest.mark.timeout(120)


def pending_pod(kernel_id: str) -> dict[str, Any]:
    return {
        "metadata": {"name": f"p-{kernel_id}", "labels": {"component": "kernel", "kernel_id": kernel_id}},
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
        client.ApiClient(kube_plane.configuration()), kube_namespace, "component=kernel", watch_timeout=4
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
