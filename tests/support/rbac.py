"""Apply the repository's RBAC manifests (deploy/kubernetes/) to a test cluster, as shipped.

Two things change, and only these: the placeholder namespace ``jupyter`` becomes the test's, and the
name prefix ``jupyter-elastic-kernels`` becomes a unique one, so that cluster-scoped objects
(ClusterRoles, ClusterRoleBindings) of concurrent tests never meet. ``without`` removes one verb from
one resource, for tests that prove a missing permission fails clearly.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, utils

from tests.support.kube import ControlPlane, write_kubeconfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
RBAC = DEPLOY / "rbac.yaml"
RBAC_NAMESPACES = DEPLOY / "rbac-namespaces.yaml"
NODE_AGENT = DEPLOY / "node-agent.yaml"
PLACEHOLDER_NAMESPACE = "jupyter"
PREFIX = "jupyter-elastic-kernels"


def read(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _rename(name: str, prefix: str) -> str:
    return prefix + name[len(PREFIX) :] if name.startswith(PREFIX) else name


def load(path: Path, namespace: str, prefix: str) -> list[dict[str, Any]]:
    """The manifests of ``path`` for ``namespace``, names starting with ``prefix``."""
    docs = copy.deepcopy(read(path))
    for doc in docs:
        meta = doc["metadata"]
        meta["name"] = _rename(meta["name"], prefix)
        if meta.get("namespace") == PLACEHOLDER_NAMESPACE:
            meta["namespace"] = namespace
        if "roleRef" in doc:
            doc["roleRef"]["name"] = _rename(doc["roleRef"]["name"], prefix)
        for subject in doc.get("subjects") or []:
            subject["name"] = _rename(subject["name"], prefix)
            if subject.get("namespace") == PLACEHOLDER_NAMESPACE:
                subject["namespace"] = namespace
        for rule in doc.get("rules") or []:
            if "resourceNames" in rule:
                rule["resourceNames"] = [_rename(n, prefix) for n in rule["resourceNames"]]
    return docs


def without(docs: list[dict[str, Any]], resource: str, verb: str) -> list[dict[str, Any]]:
    """``docs`` with ``verb`` taken away from every rule on ``resource`` (the rule must have had it)."""
    docs = copy.deepcopy(docs)
    removed = False
    for doc in docs:
        for rule in doc.get("rules") or []:
            if resource in rule["resources"] and verb in rule["verbs"]:
                rule["verbs"] = [v for v in rule["verbs"] if v != verb]
                removed = True
    assert removed, f"no rule grants {verb} on {resource}"
    return docs


def apply(api: Any, docs: Iterable[dict[str, Any]]) -> None:
    for doc in docs:
        utils.create_from_dict(api, doc)


def delete(api: Any, docs: Iterable[dict[str, Any]]) -> None:
    """Delete the cluster-scoped objects (namespaced ones go with their namespace)."""
    rbac = client.RbacAuthorizationV1Api(api)
    for doc in docs:
        name = doc["metadata"]["name"]
        try:
            if doc["kind"] == "ClusterRole":
                rbac.delete_cluster_role(name)
            elif doc["kind"] == "ClusterRoleBinding":
                rbac.delete_cluster_role_binding(name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


def service_account_kubeconfig(
    plane: ControlPlane, api: Any, namespace: str, name: str, path: Path
) -> tuple[Path, str]:
    """A kubeconfig holding a token for ServiceAccount ``namespace/name`` (TokenRequest API)."""
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600},
    }
    token = (
        client.CoreV1Api(api).create_namespaced_service_account_token(name, namespace, request).status.token
    )
    return write_kubeconfig(path, plane.server, plane.pki.ca_cert, token=token), token


def wait_allowed(
    plane: ControlPlane, token: str, verb: str, resource: str, namespace: str, allowed: bool = True
) -> None:
    """Wait until the authorizer has seen the bindings (it reads them from a cache): ``verb`` on
    ``resource`` allowed (or, with ``allowed=False``, refused)."""
    with plane.api_client(token=token) as api:
        authorization: Any = client.AuthorizationV1Api(api)
        deadline = time.monotonic() + 30
        while True:
            review = authorization.create_self_subject_access_review(
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SelfSubjectAccessReview",
                    "spec": {
                        "resourceAttributes": {"verb": verb, "resource": resource, "namespace": namespace}
                    },
                }
            )
            if bool(review.status.allowed) is allowed:
                return
            assert time.monotonic() < deadline, f"{verb} {resource} in {namespace!r}: allowed never {allowed}"
            time.sleep(0.1)
