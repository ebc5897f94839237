"""Wait until a DaemonSet has every pod it wants ready: the chart's pre-install/pre-upgrade hook Job.

``helm upgrade`` waits for a hook Job to complete but treats a hook DaemonSet as done once created. The
chart's hook DaemonSet pulls the kernel image(s) on the kernels' nodes; this Job runs
``python -m kernelmgr.kube.image_awaiter`` from the gateway's image until that DaemonSet reports every
desired pod ready and up to date, so the new gateway starts no kernel on a node still pulling (the pull
is not spent inside a resume's budget). On timeout it exits 1 with one line saying how many pods are
ready and what to do, and the upgrade fails there. It needs only get/list/watch on DaemonSets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from kernelmgr.kube.status import api_message


class NotReady(RuntimeError):
    """The DaemonSet did not have every pod ready in time (the message is one line for the hook's log)."""


def counts(daemonset: Any) -> tuple[int, int, bool]:
    """(pods ready and up to date, pods desired, whether the controller has seen the current spec)."""
    status = daemonset.status
    if status is None:
        return 0, 0, False
    observed = (status.observed_generation or 0) >= (daemonset.metadata.generation or 0)
    ready = min(status.number_ready or 0, status.updated_number_scheduled or 0)
    return ready, status.desired_number_scheduled or 0, observed


def is_ready(daemonset: Any) -> bool:
    """Every desired pod ready with the current template (none desired counts: nothing to pull)."""
    ready, desired, observed = counts(daemonset)
    return observed and ready >= desired


def describe(namespace: str, name: str, last: Any, timeout: float) -> str:
    where = f"DaemonSet {namespace}/{name}"
    if last is None:
        return f"image-awaiter: {where} does not exist after {timeout:g} s; is prePuller.hook installed?"
    ready, desired, observed = counts(last)
    state = f"{ready} of {desired} pods ready" if observed else "not yet seen by its controller"
    return (
        f"image-awaiter: {where} has {state} after {timeout:g} s: the images are still pulling or cannot be"
        f" pulled (kubectl -n {namespace} describe daemonset {name}); fix the pull or raise"
        " prePuller.hook.timeout (and helm's --timeout above it)"
    )


def wait_ready(
    apps: Any, namespace: str, name: str, timeout: float, clock: Callable[[], float] = time.monotonic
) -> Any:
    """Return the DaemonSet once :func:`is_ready`; raise :class:`NotReady` after ``timeout`` seconds.

    A list, then a watch from its resourceVersion (re-listed when the watch ends or expires): each change
    of the DaemonSet's status is seen when it happens, with no polling interval.
    """
    deadline = clock() + timeout
    selector = f"metadata.name={name}"
    last: Any = None
    while (remaining := deadline - clock()) > 0:
        listing = apps.list_namespaced_daemon_set(namespace, field_selector=selector)
        last = listing.items[0] if listing.items else None
        if last is not None and is_ready(last):
            return last
        stream = watch.Watch().stream(
            apps.list_namespaced_daemon_set,
            namespace,
            field_selector=selector,
            resource_version=listing.metadata.resource_version,
            timeout_seconds=max(1, int(remaining)),
        )
        try:
            for event in stream:
                last = None if event["type"] == "DELETED" else event["object"]
                if last is not None and is_ready(last):
                    return last
                if clock() >= deadline:
                    break
        except ApiException as err:
            if err.status != 410:  # 410 Gone: the resourceVersion expired; list again
                raise
    raise NotReady(describe(namespace, name, last, timeout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernelmgr.kube.image_awaiter", description=__doc__)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--daemonset", required=True, help="the hook DaemonSet that pulls the images")
    parser.add_argument("--timeout", type=float, required=True, help="seconds before the hook fails")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config()
    with client.ApiClient() as api:
        try:
            daemonset = wait_ready(client.AppsV1Api(api), args.namespace, args.daemonset, args.timeout)
        except NotReady as err:
            print(err, file=sys.stderr)
            return 1
        except ApiException as err:  # e.g. 403: the Role lacks a verb; one line, not a traceback
            reason = api_message(err)
            print(
                f"image-awaiter: cannot read DaemonSet {args.namespace}/{args.daemonset}: {reason}",
                file=sys.stderr,
            )
            return 1
    ready, desired, _ = counts(daemonset)
    print(f"image-awaiter: DaemonSet {args.namespace}/{args.daemonset}: {ready} of {desired} pods ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
