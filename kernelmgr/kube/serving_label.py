"""The label that routes notebooks to the gateway that serves the kernels, set on its own pod.

With several gateways (or one being replaced) only the Lease holder serves kernels. If readiness
said so, a standby would never be Ready, and a rolling update, which waits for a Ready new pod
before it stops an old one, could never hand over: the chart had to stop every gateway first and
leave notebooks with nothing to reach until a new pod started. Instead the gateway Service selects
this label, which the holder puts on its own pod once it has taken the kernels over, so standbys
can be Ready (a surge rollout starts the new pod first and stops the old leader only then; the
standby takes the Lease within one retry). A gateway clears the label from its pod as it starts:
a restarted container keeps its pod's labels, and must not be routed to as a standby.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from kernelmgr.core.errors import ConfigError


class ServingLabel:
    """Puts ``key: "true"`` on (or takes it off) this gateway's own pod, ``namespace/pod``."""

    def __init__(self, api: Any, namespace: str, pod: str, key: str, log: logging.Logger) -> None:
        from kubernetes import client  # the Kubernetes extra: imported where used

        self.core: Any = client.CoreV1Api(api)
        self._api_exception = client.ApiException
        self.namespace = namespace
        self.pod = pod
        self.key = key
        self.log = log

    @classmethod
    def of_this_pod(cls, api: Any, key: str, log: logging.Logger) -> ServingLabel | None:
        """The label for the pod this process runs in (``POD_NAME``, ``POD_NAMESPACE`` from the
        downward API), or None: no key configured, or not in a pod that says its name."""
        pod, namespace = os.environ.get("POD_NAME", ""), os.environ.get("POD_NAMESPACE", "")
        if not key or not pod or not namespace:
            return None
        return cls(api, namespace, pod, key, log)

    def clear(self) -> None:
        """Off this pod, as the gateway starts (a standby); ConfigError when it may not (RBAC)."""
        try:
            self._patch(None)
        except self._api_exception as exc:
            raise ConfigError(
                f"could not take the label {self.key} off this gateway's pod {self.namespace}/{self.pod} "
                f"({exc.status} {exc.reason}): the gateway needs patch on pods in its namespace"
            ) from None

    async def mark_while(self, leading: Callable[[], bool], retry: float) -> None:
        """:meth:`mark`, tried again every ``retry`` s while ``leading()``: until it works nothing
        reaches this gateway (an API server restarting, say)."""
        while leading():
            try:
                await asyncio.to_thread(self.mark)
                return
            except Exception as exc:
                self.log.error(
                    "jupyter-elastic-kernels: could not label this pod %s (the Service routes by it): %s",
                    self.key,
                    exc,
                )
            await asyncio.sleep(retry)

    def mark(self) -> None:
        """On this pod: the Service routes notebooks here from now on."""
        self._patch("true")
        self.log.info("jupyter-elastic-kernels: labelled this pod %s=true: the Service routes here", self.key)

    def _patch(self, value: str | None) -> None:
        self.core.patch_namespaced_pod(self.pod, self.namespace, {"metadata": {"labels": {self.key: value}}})
