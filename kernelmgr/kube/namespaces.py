"""Which namespace a kernel pod goes to, and (optionally) making that namespace.

Two layouts: every kernel in one namespace (``ElasticKubernetesProvisioner.namespace``), or one
namespace per user from a template such as ``"jupyter-{owner}"``. An owner name is not always a
DNS-1123 label (``Alice.Smith``, ``bob@example.org``), so it is lower-cased and every run of other
characters becomes ``-``; when that changed anything, 8 hex digits of the name's SHA-256 are added, so
two owners do not share a namespace because their names differ only in characters a label cannot
hold (``alice_smith`` and ``alice.smith``). That guards against accidents, not against someone who
may choose their own user name and searches for a colliding one: owners come from the
authenticator (JupyterHub), whose admins pick the naming rules.

Creating missing namespaces is off by default: the admin makes each user's namespace and binds the
kernel ClusterRole there (``deploy/kubernetes/rbac.yaml``). With it on, the server creates the
namespace (with the configured labels: Pod Security Admission ``restricted`` by default), binds the
kernel ClusterRole to its own identity in it (RBAC lets it only because it holds ``bind`` on that
one ClusterRole, ``deploy/kubernetes/rbac-namespaces.yaml``), and waits until the API server's
authorizer lets it create pods there. Then it creates the configured NetworkPolicies there (the Helm
chart passes the same ingress and default-deny egress policies it renders in its own kernel
namespaces), before any kernel pod exists in the namespace. These calls block: run them in a worker
thread. With several gateways each of these writes asks the Lease's fence first, as pod writes do: a
gateway that does not hold the Lease creates no namespace, RoleBinding or NetworkPolicy.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

from kubernetes import client

from kernelmgr.core.errors import ConfigError
from kernelmgr.kube.access import RBAC_FILE, RBAC_NAMESPACES_FILE, ExplainedCoreV1Api, Fence, forbidden

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_HASHED = re.compile(r"-[0-9a-f]{8}$")
MAX_LABEL = 63
RBAC_GROUP = "rbac.authorization.k8s.io"


def dns_label(owner: str, room: int = MAX_LABEL) -> str:
    """``owner`` as a DNS-1123 label of at most ``room`` characters, unique per owner name."""
    if room < 12:
        raise ConfigError(f"a namespace template must leave at least 12 characters for the owner, not {room}")
    cleaned = re.sub(r"[^a-z0-9]+", "-", owner.lower()).strip("-")
    # A name that looks like a changed name (ends in "-" and 8 hex digits) gets a hash too.
    if cleaned == owner and len(cleaned) <= room and not _HASHED.search(cleaned):
        return cleaned
    digest = hashlib.sha256(owner.encode()).hexdigest()[:8]
    head = cleaned[: room - len(digest) - 1].strip("-")
    return f"{head}-{digest}" if head else f"u-{digest}"


def namespace_for(template: str, owner: str) -> str:
    """The namespace ``template`` (``{owner}`` its only field) names for ``owner``; checked."""
    if "{owner}" not in template:
        raise ConfigError(f"namespace_template must contain {{owner}}, got {template!r}")
    try:
        fixed = len(template.format(owner=""))
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"namespace_template may only use the field {{owner}}: {template!r} ({exc})"
        ) from None
    name = template.format(owner=dns_label(owner, MAX_LABEL - fixed))
    if not _LABEL.match(name) or len(name) > MAX_LABEL:
        raise ConfigError(
            f"namespace_template {template!r} gives {name!r} for owner {owner!r}, which is not a "
            "DNS-1123 label (lower-case letters, digits and '-', at most 63 characters)"
        )
    return name


def own_subject(api: client.ApiClient) -> dict[str, Any]:
    """The RBAC subject of the identity ``api`` authenticates as (SelfSubjectReview)."""
    authentication: Any = client.AuthenticationV1Api(api)  # the stubs do not take plain dicts
    review = authentication.create_self_subject_review(
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    )
    username = str(review.status.user_info.username)
    parts = username.split(":")
    if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
        return {"kind": "ServiceAccount", "name": parts[3], "namespace": parts[2]}
    return {"kind": "User", "name": username, "apiGroup": RBAC_GROUP}


def may(api: client.ApiClient, verb: str, resource: str, namespace: str) -> bool:
    """Does the authorizer let ``api``'s identity ``verb`` ``resource`` in ``namespace`` now?"""
    authorization: Any = client.AuthorizationV1Api(api)
    review = authorization.create_self_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "namespace": namespace}},
        }
    )
    return bool(review.status.allowed)


def ensure_namespace(
    api: client.ApiClient,
    name: str,
    *,
    labels: dict[str, str],
    cluster_role: str,
    binding_name: str = "jupyter-elastic-kernels",
    timeout: float = 30.0,
    network_policies: list[dict[str, Any]] | None = None,
    fence: Fence | None = None,
) -> bool:
    """Create ``name`` (if missing) and bind ``cluster_role`` to the caller there; ``True`` if created.

    An existing namespace is left as it is (labels included): its admin decides. Raises
    :class:`~kernelmgr.kube.access.KubeForbidden` naming the missing rule, or ``TimeoutError`` if the
    binding does not take effect within ``timeout`` seconds; ``fence`` (the Lease's check) raises
    before each write when this gateway may not write.
    """
    core: Any = ExplainedCoreV1Api(api, fence)
    created = False
    try:
        core.create_namespace(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
        )
        created = True
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    binding = {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "RoleBinding",
        "metadata": {"name": binding_name, "namespace": name},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": cluster_role},
        "subjects": [own_subject(api)],
    }
    try:
        if fence is not None:
            fence("create rolebindings")
        rbac: Any = client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role_binding(name, binding)
    except client.ApiException as exc:
        if exc.status == 403:
            escalation = "attempting to grant" in str(exc.body)
            raise forbidden(
                exc,
                "bind" if escalation else "create",
                "clusterroles" if escalation else "rolebindings",
                name,
                RBAC_NAMESPACES_FILE,
                api_group=RBAC_GROUP,
            ) from None
        if exc.status != 409:
            raise
    # The authorizer reads bindings from a cache: wait until it has seen this one.
    deadline = time.monotonic() + timeout
    while not may(api, "create", "pods", name):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"RoleBinding {name}/{binding_name} to ClusterRole {cluster_role} does not let the server "
                f"create pods in {name} after {timeout:g} s: does that ClusterRole exist "
                f"({RBAC_NAMESPACES_FILE})?"
            )
        time.sleep(0.2)
    for policy in network_policies or []:
        create_network_policy(api, name, policy, fence)
    return created


def create_network_policy(
    api: client.ApiClient, namespace: str, policy: dict[str, Any], fence: Fence | None = None
) -> None:
    """Create ``policy`` in ``namespace`` (one already there under its name is left as it is)."""
    manifest = {
        **policy,
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {**(policy.get("metadata") or {}), "namespace": namespace},
    }
    if fence is not None:
        fence("create networkpolicies")
    networking: Any = client.NetworkingV1Api(api)
    try:
        networking.create_namespaced_network_policy(namespace, manifest)
    except client.ApiException as exc:
        if exc.status == 403:
            raise forbidden(
                exc, "create", "networkpolicies", namespace, RBAC_FILE, api_group="networking.k8s.io"
            ) from None
        if exc.status != 409:
            raise
