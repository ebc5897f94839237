"""What a user is told when a kernel's pod ended on its own, read from the pod as the watch keeps it.

The pod watch keeps little of a pod's spec (``kernelmgr/kube/shapes.py``); the cause must survive
that cut: a pod OOM-killed names its memory limit, a signal its number, an exit its code and the
container's last output.
"""

from __future__ import annotations

from typing import Any

import pytest

from kernelmgr.kube.pods import loss
from kernelmgr.kube.shapes import KERNEL_POD

pytestmark = pytest.mark.pure


def ended_pod(terminated: dict[str, Any], limits: dict[str, str]) -> Any:
    """A kernel pod that ended, as the API server sends it, built as the watch builds it."""
    raw = {
        "metadata": {"name": "kernel-abc", "uid": "u1", "labels": {}},
        "spec": {
            "nodeName": "node-1",
            "containers": [
                {
                    "name": "kernel",
                    "image": "kernel:1",
                    "env": [{"name": "A", "value": "b"}],
                    "resources": {"requests": {"cpu": "250m"}, "limits": limits},
                }
            ],
        },
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "kernel",
                    "image": "kernel:1",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        },
    }
    return KERNEL_POD.build(raw)


def test_an_oom_killed_pod_names_its_memory_limit() -> None:
    pod = ended_pod({"exitCode": 137, "reason": "OOMKilled"}, {"cpu": "2", "memory": "4Gi"})
    said = loss(pod)
    assert said.startswith("it ran out of memory: its pod's limit is 4Gi"), said
    assert "pod kernel-abc on node node-1" in said
    assert pod.spec.containers[0].env is None  # the rest of the spec is still cut


def test_a_killed_or_failed_pod_says_the_signal_or_the_code_and_its_last_output() -> None:
    killed = ended_pod({"exitCode": 137, "reason": "Error"}, {})
    assert loss(killed).startswith("its process was killed by signal 9"), loss(killed)
    failed = ended_pod({"exitCode": 1, "reason": "Error", "message": "Traceback\nValueError: bad"}, {})
    said = loss(failed)
    assert said.startswith("its process exited with code 1; its last output:\nTraceback\nValueError: bad")
