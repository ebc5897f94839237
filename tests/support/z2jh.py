"""JupyterHub in the test cluster, shaped like zero-to-jupyterhub (issue 46).

No registry serves z2jh's chart or images here, so this lays out what its chart makes, with the
project's own images (``scripts/images.sh export-hub``): the ``hub`` Deployment (KubeSpawner, its
ServiceAccount and Role, its Service), the ``proxy`` Deployment (configurable-http-proxy) with the
``proxy-api`` and ``proxy-public`` Services, the hub/proxy/singleuser NetworkPolicies with z2jh's
``hub.jupyter.org/network-access-*`` labels and default egress rules, and the singleuser pods'
``claim-{username}`` homes. The Hub reads the **example's own values**
(``examples/jupyterhub/z2jh/values.yaml``: its services, roles, KubeSpawner config, the singleuser
image, env, files, egress rule, profiles) from a ConfigMap, as z2jh's hub reads its values; the test
overrides only what this cluster forces (images, the real node's placement). What z2jh does and this
does not: a PVC for the Hub's database (an emptyDir here), its own culler service, the image
pullers, user scheduler and autohttps.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import yaml

from kernelmgr.kube.pod_settings import strategic_merge

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_VALUES = REPO / "examples" / "jupyterhub" / "z2jh" / "values.yaml"
#: The example's values name the gateway's Service in this namespace.
NAMESPACE = "jupyter"
PASSWORD = "elastic-z2jh-password"
ACCESS_HUB = "hub.jupyter.org/network-access-hub"
ACCESS_PROXY_API = "hub.jupyter.org/network-access-proxy-api"
ACCESS_SINGLEUSER = "hub.jupyter.org/network-access-singleuser"
PRIVATE = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
DNS_PORTS = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]

#: The Hub's configuration: z2jh's hub reads its chart values the same way (``z2jh.get_config``).
HUB_CONFIG = '''
"""The Hub of the test cluster: the chart values in values.yaml, read as z2jh's hub reads them."""
import os

import yaml

c = get_config()  # noqa: F821
values = yaml.safe_load(open("/usr/local/etc/jupyterhub/values.yaml"))
hub, single = values.get("hub", {}), values.get("singleuser", {})

c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
c.JupyterHub.hub_bind_url = "http://:8081"
c.JupyterHub.hub_connect_url = "http://hub:8081"
c.JupyterHub.cleanup_servers = False
c.JupyterHub.db_url = "sqlite:////srv/jupyterhub/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "/srv/jupyterhub/jupyterhub_cookie_secret"
c.ConfigurableHTTPProxy.should_start = False
c.ConfigurableHTTPProxy.api_url = "http://proxy-api:8001"
c.ConfigurableHTTPProxy.auth_token = os.environ["CONFIGPROXY_AUTH_TOKEN"]
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = os.environ["HUB_PASSWORD"]
c.Authenticator.allow_all = True
c.Authenticator.admin_users = {"admin"}

c.JupyterHub.services = [
    {"name": name, **{k: v for k, v in service.items() if k != "apiToken"},
     "api_token": os.environ["HUB_SERVICE_" + name.upper().replace("-", "_") + "_TOKEN"]}
    for name, service in hub.get("services", {}).items()
]
c.JupyterHub.load_roles = [{"name": name, **role} for name, role in hub.get("loadRoles", {}).items()]
for section, traits in hub.get("config", {}).items():
    for trait, value in traits.items():
        setattr(getattr(c, section), trait, value)

image = single["image"]
c.KubeSpawner.namespace = os.environ["POD_NAMESPACE"]
c.KubeSpawner.image = f"{image['name']}:{image['tag']}"
c.KubeSpawner.image_pull_policy = image.get("pullPolicy", "IfNotPresent")
c.KubeSpawner.cmd = ["jupyterhub-singleuser"]
c.KubeSpawner.default_url = "/lab"
c.KubeSpawner.uid = 1000
c.KubeSpawner.fs_gid = 100
c.KubeSpawner.start_timeout = 600
c.KubeSpawner.http_timeout = 300
c.KubeSpawner.environment = single.get("extraEnv", {})
c.KubeSpawner.node_selector = single.get("nodeSelector", {})
c.KubeSpawner.tolerations = single.get("extraTolerations", [])
c.KubeSpawner.extra_labels = {"hub.jupyter.org/network-access-hub": "true"}
c.KubeSpawner.profile_list = single.get("profileList", [])
volumes, mounts = [], []
if single.get("storage", {}).get("type") == "dynamic":
    c.KubeSpawner.storage_pvc_ensure = True
    c.KubeSpawner.pvc_name_template = "claim-{username}{servername}"
    c.KubeSpawner.storage_capacity = single["storage"].get("capacity", "10Gi")
    c.KubeSpawner.storage_access_modes = ["ReadWriteOnce"]
    volumes.append({"name": "home", "persistentVolumeClaim": {"claimName": "claim-{username}{servername}"}})
    mounts.append({"name": "home", "mountPath": "/home/jovyan"})
files = single.get("extraFiles", {})
if files:
    volumes.append({"name": "files", "secret": {"secretName": "singleuser"}})
    mounts += [{"name": "files", "mountPath": f["mountPath"], "subPath": key} for key, f in files.items()]
c.KubeSpawner.volumes = volumes
c.KubeSpawner.volume_mounts = mounts

# hub.extraConfig last, each snippet in the order of its name, with this file's names in scope.
for _, snippet in sorted(hub.get("extraConfig", {}).items()):
    exec(snippet)
'''


def example_values() -> dict[str, Any]:
    return dict(yaml.safe_load(EXAMPLE_VALUES.read_text()))


def manifests(
    values: dict[str, Any], images: dict[str, str], placement: dict[str, Any], gateway_token: str
) -> list[dict[str, Any]]:
    """What z2jh's chart makes for ``values`` (the example's, with the test's overrides merged in).

    ``images``: ``hub``, ``proxy``, ``singleuser`` references; ``placement``: ``nodeSelector`` and
    ``tolerations`` for every pod (the real node); ``gateway_token``: the gateway's Hub service token.
    """
    name, tag = images["singleuser"].rsplit(":", 1)
    values = strategic_merge(
        values,
        {
            "singleuser": {
                "image": {"name": name, "tag": tag},
                "nodeSelector": placement["nodeSelector"],
                "extraTolerations": placement["tolerations"],
            }
        },
    )
    proxy_token = secrets.token_hex(32)
    env_tokens = {
        f"HUB_SERVICE_{service.upper().replace('-', '_')}_TOKEN": gateway_token
        for service in values.get("hub", {}).get("services", {})
    }
    return [
        *_hub(values, images["hub"], placement, proxy_token, env_tokens),
        *_proxy(images["proxy"], placement),
        *_network_policies(values),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "singleuser"},
            "stringData": {
                key: f["stringData"] for key, f in values["singleuser"].get("extraFiles", {}).items()
            },
        },
    ]


def _labels(component: str, **more: str) -> dict[str, str]:
    return {"app": "jupyterhub", "component": component, **more}


def _deployment(
    name: str, labels: dict[str, str], spec: dict[str, Any], placement: dict[str, Any]
) -> dict[str, Any]:
    selector = {"app": "jupyterhub", "component": labels["component"]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": {**placement, **spec}},
        },
    }


def _service(name: str, component: str, port: int, target: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "selector": {"app": "jupyterhub", "component": component},
            "ports": [{"port": port, "targetPort": target}],
        },
    }


def _hub(
    values: dict[str, Any],
    image: str,
    placement: dict[str, Any],
    proxy_token: str,
    env_tokens: dict[str, str],
) -> list[dict[str, Any]]:
    secret_env = {"CONFIGPROXY_AUTH_TOKEN": proxy_token, "HUB_PASSWORD": PASSWORD, **env_tokens}
    rules = [
        {"apiGroups": [""], "resources": ["pods", "persistentvolumeclaims", "secrets", "services"],
         "verbs": ["get", "watch", "list", "create", "delete", "patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "watch", "list"]},
    ]  # fmt: skip
    container = {
        "name": "hub",
        "image": image,
        "args": ["jupyterhub", "--config", "/usr/local/etc/jupyterhub/jupyterhub_config.py"],
        "env": [
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *({"name": k, "valueFrom": {"secretKeyRef": {"name": "hub", "key": k}}} for k in secret_env),
        ],
        "ports": [{"name": "http", "containerPort": 8081}],
        "readinessProbe": {"httpGet": {"path": "/hub/health", "port": "http"}, "periodSeconds": 2},
        "volumeMounts": [
            {"name": "config", "mountPath": "/usr/local/etc/jupyterhub"},
            {"name": "state", "mountPath": "/srv/jupyterhub"},
        ],
    }
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hub"}, "stringData": secret_env},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "hub"},
            "data": {"values.yaml": yaml.safe_dump(values), "jupyterhub_config.py": HUB_CONFIG},
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "hub"}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "hub"},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "hub"},
            "subjects": [{"kind": "ServiceAccount", "name": "hub"}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "hub"},
        },
        _deployment(
            "hub",
            _labels("hub", **{ACCESS_PROXY_API: "true", ACCESS_SINGLEUSER: "true"}),
            {
                "serviceAccountName": "hub",
                "securityContext": {"runAsUser": 1000, "fsGroup": 1000},
                "containers": [container],
                "volumes": [
                    {"name": "config", "configMap": {"name": "hub"}},
                    {"name": "state", "emptyDir": {}},
                ],
            },
            placement,
        ),
        _service("hub", "hub", 8081, 8081),
    ]


def _proxy(image: str, placement: dict[str, Any]) -> list[dict[str, Any]]:
    """configurable-http-proxy, its token from the hub's Secret (the hub talks to its API)."""
    container = {
        "name": "chp",
        "image": image,
        "args": [
            "configurable-http-proxy",
            "--ip=",
            "--port=8000",
            "--api-ip=",
            "--api-port=8001",
            "--default-target=http://hub:8081",
            "--error-target=http://hub:8081/hub/error",
        ],
        "env": [
            {
                "name": "CONFIGPROXY_AUTH_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hub", "key": "CONFIGPROXY_AUTH_TOKEN"}},
            }
        ],
        "ports": [{"name": "http", "containerPort": 8000}, {"name": "api", "containerPort": 8001}],
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 2},
    }
    return [
        _deployment(
            "proxy",
            _labels("proxy", **{ACCESS_HUB: "true", ACCESS_SINGLEUSER: "true"}),
            {"securityContext": {"runAsUser": 65534}, "containers": [container]},
            placement,
        ),
        _service("proxy-api", "proxy", 8001, 8001),
        _service("proxy-public", "proxy", 80, 8000),
    ]


def _egress_defaults() -> list[dict[str, Any]]:
    """z2jh's default ``egressAllowRules`` for singleuser pods: DNS, and everything not private."""
    return [
        {
            "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}],
            "ports": DNS_PORTS,
        },
        {"to": [{"ipBlock": {"cidr": cidr}} for cidr in [*PRIVATE, "169.254.0.0/16"]], "ports": DNS_PORTS},
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": [*PRIVATE, "169.254.0.0/16"]}}]},
    ]


def _policy(name: str, component: str, ingress: list[Any], egress: list[Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "podSelector": {"matchLabels": {"app": "jupyterhub", "component": component}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": ingress,
        "egress": egress if egress is not None else [{}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def _network_policies(values: dict[str, Any]) -> list[dict[str, Any]]:
    """z2jh's three policies: who may reach the hub, the proxy's API and the users' servers."""

    def peers(label: str) -> list[dict[str, Any]]:
        return [{"podSelector": {"matchLabels": {label: "true"}}}]

    to_hub = {
        "to": [{"podSelector": {"matchLabels": {"app": "jupyterhub", "component": "hub"}}}],
        "ports": [{"port": 8081}],
    }
    single = values.get("singleuser", {}).get("networkPolicy", {}).get("egress", [])
    singleuser = _policy(
        "singleuser",
        "singleuser-server",
        [{"from": peers(ACCESS_SINGLEUSER), "ports": [{"port": 8888}]}],
        [to_hub, *_egress_defaults(), *single],
    )
    return [
        # The hub: its API from pods that carry the access label; it reaches everything (the API
        # server, the proxy's API, the users' servers), as z2jh's defaults allow.
        _policy("hub", "hub", [{"from": peers(ACCESS_HUB), "ports": [{"port": 8081}]}], None),
        # The proxy: its public port from anywhere, its API from pods with the label (the hub).
        _policy(
            "proxy",
            "proxy",
            [{"ports": [{"port": 8000}]}, {"from": peers(ACCESS_PROXY_API), "ports": [{"port": 8001}]}],
            None,
        ),
        singleuser,
    ]
