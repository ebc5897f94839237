"""What the server may do in the cluster, and what it says when the API server refuses.

The server's rights are the RBAC objects in ``deploy/kubernetes/`` (the single source: the Helm chart
and the tests apply those files). When one is missing the API server answers 403, and a raw
``ApiException`` (status line, headers, a JSON body) leaves an admin guessing. Every Kubernetes call
the server makes goes through :class:`ExplainedCoreV1Api`, which turns a 403 from RBAC into
:class:`KubeForbidden`: who was refused, which verb on which resource in which namespace, and the
rule to add. A 403 from admission (Pod Security, a quota) becomes :class:`KubeRefused` with the API
server's own explanation, without the advice to edit a Role. Both are still ``ApiException`` with
status 403, so code that inspects ``exc.status`` keeps working.

:func:`permission_of` maps a ``CoreV1Api`` method name to the RBAC verb and resource it needs; the
tests use it to check that the shipped Role grants every call the code makes.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from kubernetes import client

from kernelmgr.kube.status import message_or_body


def _shipped(name: str) -> str:
    """An RBAC manifest as error messages name it: its place in the repository and the copy every
    install has (the wheel puts deploy/kubernetes/ under ``<prefix>/share/jupyter-elastic-kernels``)."""
    installed = os.path.join(sys.prefix, "share", "jupyter-elastic-kernels", "kubernetes", name)
    return f"deploy/kubernetes/{name}, installed as {installed}"


#: Where the RBAC manifests are (named in error messages); the chart's templates/rbac.yaml holds the same.
RBAC_FILE = _shipped("rbac.yaml")
RBAC_NAMESPACES_FILE = _shipped("rbac-namespaces.yaml")

_VERBS = {
    "create": "create",
    "delete_collection": "deletecollection",
    "delete": "delete",
    "patch": "patch",
    "replace": "update",
    "read": "get",
    "list": "list",
}
# CoreV1Api resource names as the client spells them (snake case, singular) → RBAC's plural.
_RESOURCES = {
    "pod": "pods",
    "secret": "secrets",
    "event": "events",
    "config_map": "configmaps",
    "persistent_volume_claim": "persistentvolumeclaims",
    "persistent_volume": "persistentvolumes",
    "service_account": "serviceaccounts",
    "service": "services",
    "namespace": "namespaces",
    "node": "nodes",
    "resource_quota": "resourcequotas",
    "limit_range": "limitranges",
    "endpoints": "endpoints",
}
# Subresources that a method name may end with, RBAC spelling.
_SUBRESOURCES = {
    "status": "status",
    "log": "log",
    "token": "token",
    "eviction": "eviction",
    "binding": "binding",
}


def permission_of(method: str) -> tuple[str, str, bool] | None:
    """``("create", "pods", True)`` for ``create_namespaced_pod``: RBAC verb, resource, namespaced.

    ``None`` for a name that is not an API call (``api_client``, ...). A subresource is written as
    RBAC writes it (``pods/status``). ``list_*`` calls made with ``watch=True`` need ``watch``
    instead: :class:`ExplainedCoreV1Api` says so in its messages.
    """
    found = next(((p, v) for p, v in _VERBS.items() if method.startswith(p + "_")), None)
    if found is None:
        return None
    prefix, verb = found
    rest = method[len(prefix) + 1 :]
    namespaced = rest.startswith("namespaced_")
    if namespaced:
        rest = rest[len("namespaced_") :]
    rest = rest.removesuffix("_for_all_namespaces").removesuffix("_with_http_info")
    for name in sorted(_RESOURCES, key=len, reverse=True):
        if rest == name or rest.startswith(name + "_"):
            resource = _RESOURCES[name]
            sub = rest[len(name) + 1 :]
            if sub:
                if sub not in _SUBRESOURCES:
                    return None
                resource = f"{resource}/{sub}"
            return verb, resource, namespaced
    return None


class KubeRefused(client.ApiException):
    """The API server refused a call (403) for a reason other than RBAC: an admission plugin
    (Pod Security, a ResourceQuota, a policy webhook). Its own words say what to change."""

    def __init__(self, exc: client.ApiException, verb: str, resource: str, namespace: str | None) -> None:
        super().__init__(status=exc.status, reason=exc.reason)
        self.body = exc.body
        self.headers = exc.headers
        said = message_or_body(exc)
        where = re.search(r'in the namespace "([^"]+)"', said)
        self.verb = verb
        self.resource = resource
        self.namespace = where.group(1) if where else namespace
        self.api_message = said
        scope = f"in namespace {self.namespace}" if self.namespace else "at cluster scope"
        self.message = f"the API server refused to {verb} {resource} {scope}: {said or exc.reason}"

    def __str__(self) -> str:
        return self.message


class KubeForbidden(KubeRefused):
    """RBAC refused a call: says who, what, where, and which rule to add."""

    def __init__(
        self,
        exc: client.ApiException,
        verb: str,
        resource: str,
        namespace: str | None,
        rbac_file: str,
        api_group: str = "",
    ) -> None:
        super().__init__(exc, verb, resource, namespace)
        user = re.search(r'User "([^"]+)"', self.api_message, re.IGNORECASE)
        self.user = user.group(1) if user else None
        if self.namespace:
            scope = f"in namespace {self.namespace}"
            role = f"the Role (or ClusterRole) bound to it in {self.namespace}"
        else:
            scope = "at cluster scope"
            role = "a ClusterRole bound to it"
        who = "the server's Kubernetes identity" + (f" ({self.user})" if self.user else "")
        self.message = (
            f"{who} may not {verb} {resource} {scope}: add "
            f'{{apiGroups: ["{api_group}"], resources: ["{resource}"], verbs: ["{verb}"]}} to {role} '
            f"(the shipped rules are in {rbac_file}). The API server said: {self.api_message or exc.reason}"
        )


def is_rbac_denial(exc: client.ApiException) -> bool:
    """A 403 from the authorizer (RBAC: 'User "x" cannot create resource ...'), not from admission."""
    said = message_or_body(exc)
    return exc.status == 403 and (" cannot " in said or "attempting to grant" in said or not said)


def forbidden(
    exc: client.ApiException,
    verb: str,
    resource: str,
    namespace: str | None,
    rbac_file: str = RBAC_FILE,
    api_group: str = "",
) -> KubeRefused:
    """The clear form of a 403 from ``verb`` on ``resource`` (``api_group`` ``""``: the core group):
    :class:`KubeForbidden` when RBAC refused, :class:`KubeRefused` when admission did."""
    if is_rbac_denial(exc):
        return KubeForbidden(exc, verb, resource, namespace, rbac_file, api_group)
    return KubeRefused(exc, verb, resource, namespace)


#: The verbs that change the cluster: refused by a fence (a gateway without the Lease).
WRITE_VERBS = frozenset({"create", "delete", "deletecollection", "patch", "update"})

#: Raises unless this gateway may write (``kernelmgr.kube.leader.LeaderLease.check``); gets what it would do.
Fence = Callable[[str], None]


class ExplainedCoreV1Api:
    """``CoreV1Api`` whose calls raise :class:`KubeForbidden` / :class:`KubeRefused` instead of a bare 403.

    With a ``fence``, every write (create, delete, patch, update; a dry run excepted) asks it first:
    a gateway that does not hold the Lease creates and deletes nothing.
    """

    _fence: Fence | None = None

    def __init__(self, api: client.ApiClient, fence: Fence | None = None) -> None:
        self._core = client.CoreV1Api(api)
        self._fence = fence

    @property
    def api_client(self) -> client.ApiClient:
        return self._core.api_client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        permission = permission_of(name)
        if permission is None or not callable(attr):
            return attr
        verb, resource, namespaced = permission
        rbac_file = RBAC_NAMESPACES_FILE if resource == "namespaces" else RBAC_FILE
        fence = self._fence if verb in WRITE_VERBS else None
        return _explained(attr, verb, resource, namespaced, rbac_file, fence)


def _explained(
    method: Callable[..., Any],
    verb: str,
    resource: str,
    namespaced: bool,
    rbac_file: str,
    fence: Fence | None = None,
) -> Callable[..., Any]:
    @functools.wraps(method)  # keeps the signature: kubernetes.watch reads the return type from it
    def call(*args: Any, **kwargs: Any) -> Any:
        if fence is not None and kwargs.get("dry_run") != "All":
            fence(f"{verb} {resource}")
        try:
            return method(*args, **kwargs)
        except client.ApiException as exc:
            if exc.status != 403:
                raise
            used = "watch" if verb == "list" and kwargs.get("watch") else verb
            namespace = kwargs.get("namespace")
            if namespace is None and namespaced:
                # create/list/deletecollection(namespace, ...); get/patch/delete(name, namespace, ...)
                index = 0 if verb in ("create", "list", "deletecollection") else 1
                namespace = args[index] if len(args) > index else None
            ns = namespace if isinstance(namespace, str) else None
            raise forbidden(exc, used, resource, ns, rbac_file) from None

    return call
