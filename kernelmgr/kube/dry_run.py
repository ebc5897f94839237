"""The kernel pods, checked by the API server itself at start-up (a dry-run create of each).

The settings' own checks see shapes; only the API server knows whether a PriorityClass or a
RuntimeClass exists, whether an affinity or a pod_patch field is valid, and whether the namespace's
Pod Security level admits the pod. A value it refuses would otherwise fail each kernel of that size at
its start; here it stops the server with one line naming the size and the field. Blocking calls: this
runs once, while the server initialises, before its event loop serves anything.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes import client

from kernelmgr.core.errors import ConfigError
from kernelmgr.core.profiles import GpuProfile
from kernelmgr.kube.access import KubeForbidden
from kernelmgr.kube.manifests import make_kernel_pod

#: The seconds one dry-run may take: an API server that does not answer does not hold the start.
REQUEST_TIMEOUT = 15.0
DRY_RUN_ID = "dry-run"


def refusal_detail(exc: client.ApiException) -> str:
    """The API server's reason in one line: each refused field with its message, else its message."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    causes = (body.get("details") or {}).get("causes") or []
    parts = [
        f"{c['field']}: {c.get('message', '')}" if c.get("field") else c.get("message", "") for c in causes
    ]
    detail = "; ".join(p for p in parts if p) or body.get("message") or exc.reason or str(exc.status)
    return " ".join(str(detail).split())


def client_refusal(exc: ValueError) -> str:
    """The Kubernetes client's own check of a body (pydantic): each field with its problem."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return " ".join(str(exc).split())
    parts = []
    for error in errors():
        loc = [str(part) for part in error.get("loc", ())]
        field = ".".join(loc[1:] if loc and loc[0].isdigit() else loc)  # loc[0]: the argument's index
        parts.append(f"{field}: {error.get('msg', '')}")
    return "; ".join(parts)


def check_kernel_pods(
    cluster: Any, profiles: Mapping[str, GpuProfile], log: logging.Logger, cpu: bool = True
) -> int:
    """Dry-run a CPU kernel's pod (``cpu``) and each size's pod in the kernel namespace; raise
    :class:`ConfigError` for the first one refused. Returns how many the API server accepted."""
    settings = cluster.settings
    if not settings.validate_pods_at_start:
        return 0
    namespace = settings.namespace
    template = settings.pod_template()
    checked = 0
    for profile in ((None,) if cpu else ()) + tuple(profiles.values()):
        size = profile.name if profile is not None else None
        where = (
            f"ElasticKubernetesProvisioner.size_pod_settings[{size!r}] (GPU size {size!r})"
            if size is not None
            else "ElasticKubernetesProvisioner.cpu_pod_settings (CPU kernels; and what every kernel pod "
            "shares, pod_patch)"
        )
        pod = make_kernel_pod(
            template,
            name=f"elastic-{DRY_RUN_ID}-{size or 'cpu'}",
            kernel_id=DRY_RUN_ID,
            cmd=list(settings.command),
            agent_env={},
            owner=DRY_RUN_ID,
            kernelspec=DRY_RUN_ID,
            profile=profile,
            checkpoint_sub_path=DRY_RUN_ID if settings.checkpoint_claim else None,
        )
        try:
            cluster.core().create_namespaced_pod(
                namespace, pod, dry_run="All", field_validation="Strict", _request_timeout=REQUEST_TIMEOUT
            )
        except KubeForbidden as exc:  # RBAC: the start of a kernel says which rule to add
            log.warning("Kernel pods not checked at start-up (dry-run refused by RBAC): %s", exc)
            return checked
        except client.ApiException as exc:
            detail = refusal_detail(exc)
            if exc.status == 404 or exc.status >= 500 or "exceeded quota" in detail:
                # A namespace made later (namespace_template), an API server in trouble, a quota
                # full of running kernels: nothing the configuration can fix.
                log.warning("Kernel pods not checked at start-up in namespace %s: %s", namespace, detail)
                return checked
            raise ConfigError(f"{where}: the API server refuses its kernel pod: {detail}") from None
        except ValueError as exc:  # the client checks the body's fields itself before sending it
            raise ConfigError(f"{where}: its kernel pod is not a valid Pod: {client_refusal(exc)}") from None
        except Exception as exc:  # unreachable, no kubeconfig: a kernel start will say
            log.warning("Kernel pods not checked at start-up (API server not reached): %s", exc)
            return checked
        checked += 1
    return checked
