"""What a pod's status says: running, ended, being stopped, lost, and why, in a user's words.

Read from the objects the pod watch caches (:mod:`kernelmgr.kube.informer`); no API call.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any


def pod_failure(pod: Any, events: list[Any] | None = None) -> str:
    """Why a pod is not running, in the words of the scheduler, the kubelet and the events."""
    if pod is None:
        return "the pod is gone"
    reasons: list[str] = []
    status = pod.status
    for condition in (status.conditions if status else None) or []:
        if condition.status != "True" and condition.reason:
            reasons.append(f"{condition.type}: {condition.reason}: {condition.message or ''}".strip())
    for container in (status.container_statuses if status else None) or []:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason and waiting.reason != "ContainerCreating":
            reasons.append(f"container {container.name}: {waiting.reason}: {waiting.message or ''}".strip())
        terminated = container.state.terminated if container.state else None
        if terminated is not None:
            reasons.append(_terminated(container.name, terminated))
    for event in events or []:
        said = any(str(event.message) in known for known in reasons)  # the scheduler says it twice
        if event.type == "Warning" and not said:
            reasons.append(f"{event.reason}: {event.message}")
    phase = status.phase if status else "Unknown"
    return f"phase {phase}; " + ("; ".join(reasons) if reasons else "no condition or event says why")


#: At most this much of a failed container's termination message (its last log lines) is quoted.
MESSAGE_TAIL_LINES = 20
MESSAGE_TAIL_CHARS = 2000


def _terminated(name: str, terminated: Any) -> str:
    """ "container X exited with code N (reason)", and what it said last: the termination message,
    its last log lines with ``terminationMessagePolicy: FallbackToLogsOnError``."""
    said = f"container {name} exited with code {terminated.exit_code}"
    if terminated.reason and terminated.reason not in ("Error", "Completed"):
        said += f" ({terminated.reason})"  # OOMKilled, ContainerCannotRun, StartError ...
    tail = _last_output(terminated)
    return said + (f"; its last output:\n{tail}\n" if tail else "")


def _last_output(terminated: Any) -> str:
    message = (terminated.message or "").strip()
    return "\n".join(message.splitlines()[-MESSAGE_TAIL_LINES:])[-MESSAGE_TAIL_CHARS:]


def running(pod: Any) -> bool:
    status = pod.status if pod is not None else None
    return status is not None and status.phase == "Running" and bool(status.pod_ip)


def finished(pod: Any) -> bool:
    return pod is None or (pod.status is not None and pod.status.phase in ("Succeeded", "Failed"))


def failed_on_its_own(pod: Any) -> bool:
    """Ended with an error (phase ``Failed``) and not being deleted: what a kept pod shows."""
    return (
        pod is not None
        and pod.status is not None
        and pod.status.phase == "Failed"
        and (pod.metadata.deletion_timestamp is None)
    )


def evicted(pod: Any) -> bool:
    """Being deleted without us asking (an eviction, a node drained or lost): the kernel is going."""
    return pod is not None and pod.metadata.deletion_timestamp is not None


#: How long past a stopping pod's deadline (``deletionTimestamp``: the end of its grace period) the
#: server still waits for it to end before it takes the kernel over from its newest checkpoint.
STOP_DEADLINE_MARGIN = dt.timedelta(seconds=5)


def not_ready(pod: Any) -> bool:
    """The pod's ``Ready`` condition is ``False``: the node controller says so of every pod on a node
    that stopped answering (nothing there will end the pod or write a checkpoint)."""
    conditions = (pod.status.conditions if pod.status is not None else None) or []
    return any(c.type == "Ready" and c.status == "False" for c in conditions)


def stopping_gracefully(pod: Any, now: dt.datetime) -> bool:
    """Deleted or evicted by someone else, its grace period not over, on a node that answers.

    Its kernel got SIGTERM and may be checkpointing what changed
    (:mod:`kernelmgr.checkpoint.termination`): the server waits for the pod to end before it
    reads the newest checkpoint, rather than killing it (``grace=0``) and losing that work.
    """
    deadline = pod.metadata.deletion_timestamp if pod is not None else None
    if deadline is None or finished(pod) or not_ready(pod):
        return False
    return now < deadline + STOP_DEADLINE_MARGIN


def stop_began(pod: Any) -> float | None:
    """When Kubernetes started stopping ``pod`` (its deadline less its grace period), epoch seconds."""
    deadline = pod.metadata.deletion_timestamp if pod is not None else None
    if deadline is None:
        return None
    return float(deadline.timestamp() - (pod.metadata.deletion_grace_period_seconds or 0))


def loss(pod: Any) -> str:
    """Why a running kernel's pod vanished, in a user's words."""
    if pod is None:
        return "its pod was deleted"
    status = pod.status
    if status is not None and status.reason:
        return f"its pod was {status.reason.lower()}: {status.message or ''}".rstrip(": ")
    if pod.metadata.deletion_timestamp is not None:
        return f"its pod was deleted on node {pod.spec.node_name}"
    return f"{ended_in_words(pod)} (pod {pod.metadata.name} on node {pod.spec.node_name})"


def ended_in_words(pod: Any) -> str:
    """Why the kernel's container ended, cause first: out of memory with the limit, a signal, an
    exit code (then its last output, which for a crash may hold the traceback)."""
    for container in (pod.status.container_statuses if pod.status else None) or []:
        terminated = container.state.terminated if container.state else None
        if terminated is None:
            continue
        if terminated.reason == "OOMKilled":
            limit = _memory_limit(pod, container.name)
            said = f"it ran out of memory: its pod's limit is {limit}" if limit else "it ran out of memory"
            return said + " (ask for a larger size, or keep less in memory)"
        code = int(terminated.exit_code)
        if code > 128:
            return f"its process was killed by signal {code - 128}"
        tail = _last_output(terminated)
        return f"its process exited with code {code}" + (f"; its last output:\n{tail}" if tail else "")
    return f"its pod ended: {pod_failure(pod)}"


def _memory_limit(pod: Any, container_name: str) -> str:
    for container in pod.spec.containers or []:
        if container.name == container_name and container.resources is not None:
            return str((container.resources.limits or {}).get("memory") or "")
    return ""


def exit_code(pod: Any) -> int:
    """The kernel container's exit code; a pod gone without one counts as killed (-9)."""
    statuses = (pod.status.container_statuses if pod is not None and pod.status else None) or []
    for container in statuses:
        terminated = container.state.terminated if container.state else None
        if terminated is not None:
            return int(terminated.exit_code)
    return -9 if pod is None else 1


@dataclass
class FoundKernel:
    """A kernel pod found in the cluster (a previous server's), read from its labels and Secret."""

    kernel_id: str
    namespace: str
    kernelspec: str
    owner: str
    size: str | None
    running: bool
    #: The Secret's connection file with the pod's IP; ``None`` when the Secret is gone.
    connection_info: dict[str, Any] | None
    pod_name: str = ""
    #: The pod was a warm pod (:mod:`kernelmgr.kube.warm_pods`): its checkpoints must be collected.
    warm: bool = False
