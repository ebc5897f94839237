"""The Helm chart (helm/jupyter-elastic-kernels), with the real helm binary and the real API server.

- ``helm lint --strict``, and ``values.schema.json`` refuses a bad value with a message naming it;
- ``helm template`` over value sets (each slice backend, per-user namespaces, an existing claim, no node
  agent, monitoring and pre-puller on): every manifest is a valid object (kubernetes-validate, strict),
  the rendered ``jupyter_server_config.json`` is one the provisioner accepts for every GPU size, and the
  chart's kernel Role is exactly deploy/kubernetes/rbac.yaml's (the rules the code's calls need);
- ``helm install`` into the envtest API server; then the gateway's real command runs here with the
  chart's ServiceAccount identity (a TokenRequest token) and the ConfigMap as the server stored it, and
  starts, hibernates and resumes a kernel pod run by the node runner: a permission missing from the
  chart fails this test;
- per-user namespaces: the gateway, with only the chart's rights, creates the owner's namespace, binds
  itself the kernel role there and hibernates and resumes a kernel pod in it;
- ``helm upgrade`` with a changed configuration keeps three running kernels: the old gateway, stopped by
  SIGTERM, leaves their pods running and the new one adopts them (same processes: a generator and a
  held lock survive); the probes answer without a token; ``helm uninstall`` keeps the claim.

The helm binary comes from ``scripts/helm.sh build``; without it these tests skip, or fail when
``ELASTIC_REQUIRE_HELM`` is set (as in CI).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelmgr import __version__
from kernelmgr.backends.kubernetes import render_pod_fragment, validate_backend_options
from kernelmgr.core.profiles import parse_profiles
from kernelmgr.kube.labels import KERNEL_ID_LABEL
from kernelmgr.kube.namespaces import namespace_for

# helm_binary() below runs at import: without helm built, no test of this module runs.
pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "jupyter-elastic-kernels"
K8S_VERSION = "1.33"  # the newest schema version kubernetes-validate knows
CRD_KINDS = {
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
}  # prometheus-operator CRDs: not in kubernetes-validate


def helm_binary() -> Path:
    path = Path(
        subprocess.run([ROOT / "scripts" / "helm.sh", "path"], capture_output=True, text=True).stdout.strip()
    )
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if os.environ.get("ELASTIC_REQUIRE_HELM"):
        pytest.fail(
            f"ELASTIC_REQUIRE_HELM is set but {path} is missing: run scripts/helm.sh build", pytrace=False
        )
    pytest.skip("helm is not built: run scripts/helm.sh build", allow_module_level=True)
    raise AssertionError("unreachable")


HELM = helm_binary()


def helm(
    *args: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    home = {"HELM_CACHE_HOME": "/tmp/elastic-helm/cache", "HELM_CONFIG_HOME": "/tmp/elastic-helm/config"}
    result = subprocess.run(
        [str(HELM), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **home, **(env or {})},
        timeout=timeout,
    )
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stderr}"
    return result


def values_args(values: dict[str, Any], tmp_path: Path) -> list[str]:
    path = tmp_path / f"values-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def render(values: dict[str, Any], tmp_path: Path, namespace: str = "jupyter") -> list[dict[str, Any]]:
    # helm built by `go install` assumes Kubernetes v1.20 without a cluster: name the validated one.
    kube = ["--kube-version", f"{K8S_VERSION}.0"]
    out = helm(
        "template",
        "jupyter-elastic-kernels",
        str(CHART),
        "-n",
        namespace,
        *kube,
        *values_args(values, tmp_path),
    )
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def only(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}: {[d['metadata']['name'] for d in found]}"
    return found[0]


LIVE_CONFIG_DIR = "/etc/jupyter-elastic-live"
RBAC_GROUP = "rbac.authorization.k8s.io"


def server_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The configuration the gateway runs with: its ConfigMap's file, with the live file's sections
    (``ElasticKernels.live_config_file``, mounted from the live ConfigMap) merged over it."""
    config: dict[str, Any] = json.loads(
        only(docs, "ConfigMap", f"{RELEASE}-config")["data"]["jupyter_server_config.json"]
    )
    assert config["ElasticKernels"]["live_config_file"] == f"{LIVE_CONFIG_DIR}/live_config.json"
    live = json.loads(only(docs, "ConfigMap", f"{RELEASE}-live")["data"]["live_config.json"])
    sizes = live.pop("ElasticKernels", {})
    assert set(sizes) <= {"profiles"} and "profiles" not in config["ElasticKernels"], "sizes in both files"
    assert not set(live) & set(config), "a live section is also in the restart-requiring file"
    return {**config, **live, "ElasticKernels": {**config["ElasticKernels"], **sizes}}


# ---- helm lint and the values schema


def test_lint_strict() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"gpu": {"profiles": {"q": {"gpu_fraction": 0.25, "backend": "quarter"}}}}, "backend"),
        ({"gateway": {"auth": "none"}}, "auth"),
        ({"checkpoints": {"mountPath": "relative/path"}}, "mountPath"),
        ({"nodeAgent": {"enabled": "yes"}}, "enabled"),
        ({"gateway": {"replicas": 6}}, "replicas"),
        ({"kernels": {"namespce": "x"}}, "namespce"),
        ({"kernels": {"namespaceTemplate": "jupyter-{username}"}}, "namespaceTemplate"),
        ({"kernels": {"stopGraceSeconds": 0}}, "stopGraceSeconds"),
        ({"kernels": {"cpuResources": {"limits": {"nvidia.com/gpu": 1}}}}, "nvidia.com/gpu"),
        ({"kernels": {"resources": {"requests": {"memory": "lots"}}}}, "memory"),
        ({"networkPolicy": {"kernels": {"egressAllowRules": {"metadata": True}}}}, "metadata"),
        # A claim every kernel pod and the gateway mount from several nodes: ReadWriteMany or nothing.
        ({"checkpoints": {"accessModes": ["ReadWriteOnce"]}}, "accessModes"),
        # Label values are strings: an unquoted true is refused, not rendered into a broken pod.
        ({"gateway": {"podLabels": {"hub.jupyter.org/network-access-hub": True}}}, "podLabels"),
        ({"tests": {"gatewayUrl": "gateway:8888"}}, "gatewayUrl"),
        ({"kernels": {"sizePodSettings": {"whole": {"gpus": 2}}}}, "gpus"),
        ({"kernels": {"sizePodSettings": {"whole": {"shmSize": "lots"}}}}, "shmSize"),
        ({"kernels": {"cpuPodSettings": {"gpus": 1}}}, "gpus"),
        ({"kernels": {"shmSize": "lots"}}, "shmSize"),
        ({"kernels": {"podPatch": {"status": {}}}}, "status"),
        ({"kernels": {"userVolumes": [{"name": "home", "mountPath": "/home/jovyan"}]}}, "userVolumes"),
        ({"kernels": {"homeAccessMode": "ReadWriteSometimes"}}, "homeAccessMode"),
        ({"kernels": {"clientEnv": ["PATH"]}}, "clientEnv"),
        ({"kernels": {"userIds": {"alice": {"uid": 0}}}}, "uid"),
        ({"jupyterhub": {"userIdsFromAuthState": {"gid": "gidNumber"}}}, "userIdsFromAuthState"),
        ({"checkpoints": {"store": "gcs"}}, "store"),
        ({"checkpoints": {"accessModes": ["ReadWriteOnce"]}}, "accessModes"),
        ({"checkpoints": {"objectStore": {"partSizeMib": 1}}}, "partSizeMib"),
        # 0 would block every drain of the gateway's node.
        ({"gateway": {"podDisruptionBudget": {"maxUnavailable": 0}}}, "maxUnavailable"),
    ],
)
def test_schema_refuses_bad_values_naming_them(values: dict[str, Any], named: str, tmp_path: Path) -> None:
    result = helm(
        "template", "x", str(CHART), "--kube-version", "1.33.0", *values_args(values, tmp_path), check=False
    )
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert named in result.stderr


# ---- helm template over value sets

BACKEND_PROFILES: dict[str, dict[str, Any]] = {
    "whole": {"gpu_fraction": 1, "backend": "whole"},
    "mig": {
        "gpu_fraction": 0.5,
        "memory_mib": 20096,
        "backend": "mig",
        "options": {"mig_profile": "3g.20gb"},
    },
    "shared": {"gpu_fraction": 0.25, "memory_mib": 10240, "backend": "shared"},
    "hami": {"gpu_fraction": 0.25, "memory_mib": 10240, "compute_percent": 25, "backend": "hami"},
    "volcano": {"gpu_fraction": 0.25, "memory_mib": 10240, "backend": "volcano"},
    "dra": {"gpu_fraction": 0.5, "memory_mib": 20480, "backend": "dra", "options": {"sharing": "MPS"}},
    "gpushare": {
        "gpu_fraction": 0.25,
        "memory_mib": 4096,
        "backend": "gpushare",
        "options": {"device_memory_mib": 16384},
    },
    "vcuda": {
        "gpu_fraction": 0.5,
        "memory_mib": 8192,
        "backend": "vcuda",
        "options": {"scheduler_name": "gpu-admission"},
    },
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    **{f"backend-{b}": {"gpu": {"profiles": {f"{b}-size": p}}} for b, p in BACKEND_PROFILES.items()},
    "per-user-namespaces": {"kernels": {"namespaceTemplate": "jupyter-{owner}", "createNamespaces": True}},
    "extra-namespaces": {"kernels": {"namespace": "kernels", "extraNamespaces": ["kernels-b"]}},
    "existing-claim": {"checkpoints": {"existingClaim": "team-checkpoints"}},
    "no-agent": {"nodeAgent": {"enabled": False}, "networkPolicy": {"enabled": False}},
    "monitoring-prepuller-hub": {
        "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
        "prePuller": {"enabled": True, "hook": {"enabled": True}},
        "jupyterhub": {"apiTokenSecret": "hub-service-token"},
        "checkpoints": {"storageClassName": "nfs-rwx"},
        "gpu": {
            "inventorySource": "declared",
            "inventory": [{"uuid": "GPU-1", "name": "A100", "memory_mib": 40960}],
        },
    },
}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_template_renders_valid_objects_and_an_accepted_config(name: str, tmp_path: Path) -> None:
    import kubernetes_validate

    docs = render(VALUE_SETS[name], tmp_path)
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    config = server_config(docs)
    profiles = parse_profiles(config["ElasticKernels"]["profiles"])
    for profile in profiles.values():
        validate_backend_options(profile)
        render_pod_fragment(profile, "k-" + uuid.uuid4().hex[:8])
    deployment = only(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == [
        "jupyter-elastic-gateway",
        "--config=/etc/jupyter-elastic/jupyter_server_config.json",
    ]
    assert (
        pod["serviceAccountName"]
        == only(docs, "ServiceAccount", "jupyter-elastic-kernels")["metadata"]["name"]
    )
    claim = config["ElasticKubernetesProvisioner"]["checkpoint_claim"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}} in pod["volumes"]
    assert config["ElasticKernels"]["checkpoint_root"] in {
        m["mountPath"] for m in pod["containers"][0]["volumeMounts"]
    }


Z2JH_HUB_ACCESS = ("hub.jupyter.org/network-access-hub", "true")


def test_gateway_pods_carry_the_z2jh_hub_access_label(tmp_path: Path) -> None:
    """z2jh's hub NetworkPolicy admits only pods with this label: the gateway checks every token there."""
    docs = render({}, tmp_path)
    deployment = only(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[Z2JH_HUB_ACCESS[0]] == Z2JH_HUB_ACCESS[1]
    # The helm test pods have the same labels (the same policies admit them), but are not the Service's.
    selector = only(docs, "Service")["spec"]["selector"]
    for hook in (d for d in docs if d["kind"] == "Pod"):
        assert hook["metadata"]["labels"][Z2JH_HUB_ACCESS[0]] == Z2JH_HUB_ACCESS[1]
        assert not selector.items() <= hook["metadata"]["labels"].items()
    # More labels are added; the selector's own labels cannot be replaced through podLabels.
    own = {"team": "ml", "app.kubernetes.io/component": "other", "app.kubernetes.io/instance": "x"}
    changed = only(render({"gateway": {"podLabels": own}}, tmp_path), "Deployment")["spec"]
    assert changed["template"]["metadata"]["labels"]["team"] == "ml"
    assert Z2JH_HUB_ACCESS[0] in changed["template"]["metadata"]["labels"]  # merged with the default
    assert changed["selector"]["matchLabels"].items() <= changed["template"]["metadata"]["labels"].items()
    # Outside z2jh the label goes with a null (helm drops null keys).
    dropped = render({"gateway": {"podLabels": {Z2JH_HUB_ACCESS[0]: None}}}, tmp_path)
    assert Z2JH_HUB_ACCESS[0] not in only(dropped, "Deployment")["spec"]["template"]["metadata"]["labels"]


def test_checkpoint_claim_takes_the_default_storage_class_unless_named(tmp_path: Path) -> None:
    claim = only(render({}, tmp_path), "PersistentVolumeClaim")["spec"]
    assert "storageClassName" not in claim  # the cluster's default class provisions it
    assert claim["accessModes"] == ["ReadWriteMany"]
    named = render({"checkpoints": {"storageClassName": "nfs-rwx"}}, tmp_path)
    assert only(named, "PersistentVolumeClaim")["spec"]["storageClassName"] == "nfs-rwx"
    # "-": no class at all, so only a pre-provisioned volume of no class binds.
    none = render({"checkpoints": {"storageClassName": "-"}}, tmp_path)
    assert only(none, "PersistentVolumeClaim")["spec"]["storageClassName"] == ""
    # More modes are fine as long as ReadWriteMany is one of them.
    both = {"checkpoints": {"accessModes": ["ReadWriteOnce", "ReadWriteMany"]}}
    assert only(render(both, tmp_path), "PersistentVolumeClaim")["spec"]["accessModes"][1] == "ReadWriteMany"


def test_checkpoints_in_an_object_store_configure_the_gateway_only(tmp_path: Path) -> None:
    s3 = {
        "endpoint": "https://s3.eu-west-1.amazonaws.com",
        "bucket": "notebook-checkpoints",
        "region": "eu-west-1",
        "existingSecret": "checkpoint-bucket",
    }
    # Only the gateway mounts the claim: ReadWriteOnce will do, and kernel pods mount none.
    values = {"checkpoints": {"store": "s3", "objectStore": s3, "accessModes": ["ReadWriteOnce"]}}
    docs = render(values, tmp_path)
    config = server_config(docs)
    assert config["ElasticKernels"]["checkpoint_store"] == "s3"
    assert config["ElasticKubernetesProvisioner"]["checkpoint_claim"] == ""
    assert only(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert server_config(render({}, tmp_path))["ElasticKubernetesProvisioner"]["checkpoint_claim"]
    bucket = config["S3Checkpoints"]
    assert (bucket["endpoint"], bucket["bucket"], bucket["region"]) == (
        s3["endpoint"],
        s3["bucket"],
        "eu-west-1",
    )
    assert (bucket["presign_seconds"], bucket["part_size_mib"]) == (900, 32)
    (gateway,) = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in gateway["env"]}
    for name, key in (
        (bucket["access_key_id_env"], "AWS_ACCESS_KEY_ID"),
        (bucket["secret_access_key_env"], "AWS_SECRET_ACCESS_KEY"),
    ):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "checkpoint-bucket", "key": key}
    assert "encryption_key_files" not in bucket
    encrypted = {**s3, "encryptionSecret": "checkpoint-keys", "encryptionKeys": ["new", "old"]}
    docs = render({"checkpoints": {"store": "s3", "objectStore": encrypted}}, tmp_path)
    files = server_config(docs)["S3Checkpoints"]["encryption_key_files"]
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "checkpoint-keys"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert files == [f"{mount['mountPath']}/new", f"{mount['mountPath']}/old"] and mount["readOnly"]
    assert [item["key"] for item in volume["secret"]["items"]] == ["new", "old"]
    assert "S3Checkpoints" not in server_config(render({}, tmp_path))  # the file system by default
    missing = helm(
        "template", "x", str(CHART), "--kube-version", "1.33.0",
        *values_args({"checkpoints": {"store": "s3", "objectStore": {**s3, "existingSecret": ""}}}, tmp_path),
        check=False,
    )  # fmt: skip
    assert missing.returncode != 0 and "checkpoints.objectStore.existingSecret" in missing.stderr


def test_helm_test_pod_asks_the_gateways_service_and_the_hub(tmp_path: Path) -> None:
    docs = render({}, tmp_path)
    hook = only(docs, "Pod", "jupyter-elastic-kernels-test-gateway")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = hook["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    service = only(docs, "Service")
    base_url = server_config(docs)["ServerApp"]["base_url"]
    port = service["spec"]["ports"][0]["port"]
    assert env["GATEWAY_URL"] == f"http://{service['metadata']['name']}.jupyter.svc:{port}{base_url}api"
    assert env["JUPYTERHUB_API_URL"] == "http://hub:8081/hub/api"
    assert (
        container["image"] == only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    token = render({"gateway": {"auth": "token"}, "tests": {"gatewayUrl": "http://10.1.2.3:8888/"}}, tmp_path)
    hook = only(token, "Pod", "jupyter-elastic-kernels-test-gateway")
    env = {e["name"]: e["value"] for e in hook["spec"]["containers"][0]["env"]}
    assert env == {"GATEWAY_URL": "http://10.1.2.3:8888/api"}  # no Hub to check in token mode


def test_helm_test_checks_the_kernel_image_against_the_running_gateways_version(tmp_path: Path) -> None:
    """The second test pod runs the kernel image where kernels run, and the image check there asks
    the gateway its version (GET /api/elastic/version): a stale kernel image fails ``helm test``."""
    placed = {"nodeSelector": {"gpu": "yes"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}
    docs = render({"kernels": {"image": "registry.example/mine:1", **placed}}, tmp_path)
    hook = only(docs, "Pod", "jupyter-elastic-kernels-test-kernel-image")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = hook["spec"]["containers"]
    assert container["image"] == server_config(docs)["ElasticKubernetesProvisioner"]["image"]
    assert container["image"] == "registry.example/mine:1"
    service = only(docs, "Service")
    base_url = server_config(docs)["ServerApp"]["base_url"].rstrip("/")
    port = service["spec"]["ports"][0]["port"]
    gateway = f"http://{service['metadata']['name']}.jupyter.svc:{port}{base_url}"
    assert container["command"] == [
        "python",
        "-m",
        "kernelmgr.image_check",
        "check",
        "--gateway",
        gateway,
        "--same-version",
    ]
    assert {k: hook["spec"][k] for k in placed} == placed
    assert hook["spec"]["securityContext"]["runAsUser"] == 1000


def test_default_images_are_the_projects_at_the_charts_version(tmp_path: Path) -> None:
    """Unset, the gateway and kernel images are the two scripts/images.sh builds, at the package version."""
    docs = render({}, tmp_path)
    gateway = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    kernel = server_config(docs)["ElasticKubernetesProvisioner"]["image"]
    assert (gateway, kernel) == (
        f"jupyter-elastic-kernels:{__version__}",
        f"jupyter-elastic-kernels-kernel:{__version__}",
    )
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "images.sh"), "names"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted(name.removeprefix("localhost/") for name in built) == sorted([gateway, kernel])
    # Outside the chart (a jupyter_server_config.py), the provisioner's default is the same image.
    from kernelmgr.kube.settings import KubeSettings

    assert KubeSettings().image == kernel
    # A registry and tag move both; kernels.image still names any other kernel image.
    moved = render({"image": {"repository": "registry.example/jek", "tag": "7"}}, tmp_path)
    assert server_config(moved)["ElasticKubernetesProvisioner"]["image"] == "registry.example/jek-kernel:7"
    own = render({"kernels": {"image": "registry.example/mine:1"}}, tmp_path)
    assert server_config(own)["ElasticKubernetesProvisioner"]["image"] == "registry.example/mine:1"


def test_gateway_has_a_disruption_budget_and_probes_on_its_heartbeat_and_readiness(tmp_path: Path) -> None:
    """The probes' paths are under the gateway's base URL (a Hub service's in Hub mode); the budget
    selects exactly the gateway's pods and lets a drain evict one at a time."""
    for values, base in (({}, "/services/elastic-gateway/"), ({"gateway": {"auth": "token"}}, "/")):
        docs = render(values, tmp_path)
        deployment = only(docs, "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["livenessProbe"]["httpGet"] == {"path": f"{base}api/elastic/healthz", "port": "http"}
        assert container["startupProbe"]["httpGet"] == container["livenessProbe"]["httpGet"]
        assert container["readinessProbe"]["httpGet"] == {"path": f"{base}api/elastic/readyz", "port": "http"}
        budget = only(docs, "PodDisruptionBudget")
        assert budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert not [
        d for d in render({"gateway": {"replicas": 0}}, tmp_path) if d["kind"] == "PodDisruptionBudget"
    ]
    off = {"gateway": {"podDisruptionBudget": {"enabled": False}}}
    assert not [d for d in render(off, tmp_path) if d["kind"] == "PodDisruptionBudget"]


def test_kernel_pods_get_the_grace_period_to_checkpoint_at_sigterm(tmp_path: Path) -> None:
    provisioner = server_config(render({}, tmp_path))["ElasticKubernetesProvisioner"]
    assert provisioner["stop_grace_seconds"] == 60
    longer = render({"kernels": {"stopGraceSeconds": 300}}, tmp_path)
    assert server_config(longer)["ElasticKubernetesProvisioner"]["stop_grace_seconds"] == 300


def test_existing_claim_is_used_and_no_claim_is_made(tmp_path: Path) -> None:
    docs = render(VALUE_SETS["existing-claim"], tmp_path)
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert server_config(docs)["ElasticKubernetesProvisioner"]["checkpoint_claim"] == "team-checkpoints"
    made = render({}, tmp_path)
    claim = only(made, "PersistentVolumeClaim")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert (
        server_config(made)["ElasticKubernetesProvisioner"]["checkpoint_claim"] == claim["metadata"]["name"]
    )


def test_node_agent_runs_on_gpu_nodes_only_without_api_rights(tmp_path: Path) -> None:
    docs = render({}, tmp_path)
    agent = only(docs, "DaemonSet", "jupyter-elastic-kernels-node-agent")["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert agent["hostPID"] is True
    assert agent["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in agent
    container = agent["containers"][0]
    assert all(m["readOnly"] for m in container["volumeMounts"] if m["name"] == "host-proc")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "resources" in container and "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert not [d for d in render(VALUE_SETS["no-agent"], tmp_path) if d["kind"] == "DaemonSet"]


#: The pre-puller hook on, pulling two images on the nodes labelled so, with a 900 s budget.
HOOK_VALUES: dict[str, Any] = {
    "prePuller": {
        "hook": {"enabled": True, "timeout": 900},
        "images": ["kernel.example/a:1", "kernel.example/b:2"],
        "nodeSelector": {"nvidia.com/gpu.present": None, "pool": "gpu"},  # null drops the default's key
    }
}
HOOK_PULLER = "jupyter-elastic-kernels-hook-image-puller"
HOOK_AWAITER = "jupyter-elastic-kernels-hook-image-awaiter"


def _hooks(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> manifest of every pre-install/pre-upgrade hook."""
    return {
        (d["kind"], d["metadata"]["name"]): d
        for d in docs
        if "pre-upgrade" in d["metadata"].get("annotations", {}).get("helm.sh/hook", "")
    }


def test_prepuller_hook_makes_helm_upgrade_wait_for_the_images(tmp_path: Path) -> None:
    """z2jh's hook-image-puller/awaiter design: a hook DaemonSet pulls on the kernels' nodes, then a hook
    Job (a later weight, so helm creates it after and waits for it) awaits the DaemonSet with its own
    read-only rights; all are removed once they succeed, and replaced at the next upgrade."""
    import importlib.util

    assert _hooks(render({}, tmp_path)) == {}  # off by default
    hooks = _hooks(render(HOOK_VALUES, tmp_path))
    assert set(hooks) == {
        ("ServiceAccount", HOOK_AWAITER),
        ("Role", HOOK_AWAITER),
        ("RoleBinding", HOOK_AWAITER),
        ("DaemonSet", HOOK_PULLER),
        ("Job", HOOK_AWAITER),
    }
    weights = {}
    for key, doc in hooks.items():
        notes = doc["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-install,pre-upgrade", key
        assert notes["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded", key
        weights[key[0]] = int(notes["helm.sh/hook-weight"])
    assert max(w for kind, w in weights.items() if kind != "Job") < weights["Job"]

    puller = hooks[("DaemonSet", HOOK_PULLER)]["spec"]["template"]["spec"]
    assert puller["nodeSelector"] == {"pool": "gpu"}
    assert puller["tolerations"] == [{"operator": "Exists"}]
    assert [c["image"] for c in puller["initContainers"]] == HOOK_VALUES["prePuller"]["images"]
    assert puller["automountServiceAccountToken"] is False

    assert hooks[("Role", HOOK_AWAITER)]["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get", "list", "watch"]}
    ]
    binding = hooks[("RoleBinding", HOOK_AWAITER)]
    assert binding["roleRef"]["name"] == HOOK_AWAITER
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": HOOK_AWAITER, "namespace": "jupyter"}]

    job = hooks[("Job", HOOK_AWAITER)]["spec"]
    assert job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["serviceAccountName"] == HOOK_AWAITER
    (awaiter,) = pod["containers"]
    assert awaiter["image"] == f"jupyter-elastic-kernels:{__version__}"  # the gateway's image
    assert awaiter["command"] == [
        "python",
        "-m",
        "kernelmgr.kube.image_awaiter",
        "--namespace=jupyter",
        f"--daemonset={HOOK_PULLER}",
        "--timeout=900",
    ]
    assert importlib.util.find_spec(awaiter["command"][2]) is not None


def _pre_delete(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(kind, namespace, name) -> manifest of every pre-delete hook."""
    return {
        (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
        for d in docs
        if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "pre-delete"
    }


def test_uninstall_hook_has_its_own_narrow_rights_a_deadline_and_the_gateways_identity(
    tmp_path: Path,
) -> None:
    """On by default; its Roles only list/delete the kernel objects (in every kernel namespace) and scale
    the gateway; the Job never outlives its deadline; it looks for the records under the identity the
    gateway labels them with (its root_dir: the claim's mount path); a token only where one exists."""
    import importlib.util

    from kernelmgr.server.sessions import server_identity

    name = f"{RELEASE}-uninstall"
    docs = render(VALUE_SETS["extra-namespaces"], tmp_path)
    hooks = _pre_delete(docs)
    roles = {ns: d["rules"] for (kind, ns, _), d in hooks.items() if kind == "Role"}
    core_rules = {
        "apiGroups": [""],
        "resources": ["pods", "secrets", "configmaps"],
        "verbs": ["list", "delete"],
    }
    scale = {
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "resourceNames": [RELEASE],
        "verbs": ["patch"],
    }
    assert roles == {"jupyter": [core_rules, scale], "kernels": [core_rules], "kernels-b": [core_rules]}
    for (kind, _ns, _), d in hooks.items():
        if kind == "RoleBinding":
            assert d["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "jupyter"}]
        if kind != "Job":  # its rights go once it succeeded; the Job stays for its log
            assert (
                d["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
                == "before-hook-creation,hook-succeeded"
            )
    job = hooks[("Job", "jupyter", name)]
    assert job["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == "before-hook-creation"
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 240 + 60
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "kernelmgr.kube.uninstall"]
    assert importlib.util.find_spec(command[2]) is not None
    args = dict(a[2:].split("=", 1) for a in command[3:] if "=" in a)
    mount_path = server_config(render({}, tmp_path))["ServerApp"]["root_dir"]
    assert args["records-registry"] == server_identity(mount_path)
    assert [a for a in command if a.startswith("--kernel-namespace=")] == [
        "--kernel-namespace=kernels",
        "--kernel-namespace=kernels-b",
    ]
    # The records are where the gateway keeps them: its own namespace, not the kernels'.
    state_namespace = server_config(docs)["ElasticKubernetesProvisioner"]["state_namespace"]
    assert args["records-namespace"] == state_namespace == "jupyter" and args["deadline"] == "240"
    assert "--keep-hibernated" in command
    assert args["gateway-url"] == "http://jupyter-elastic-kernels.jupyter.svc:8888/services/elastic-gateway/"
    # Hub mode without a token Secret: no token, the kernels are stopped; auth: token uses the gateway's.
    assert "gateway-token-file" not in args and "volumes" not in pod
    token_mode = _pre_delete(render({"gateway": {"auth": "token", "tokenSecret": "gw"}}, tmp_path))
    token_pod = token_mode[("Job", "jupyter", name)]["spec"]["template"]["spec"]
    assert token_pod["volumes"][0]["secret"]["secretName"] == "gw"
    assert any(a.startswith("--gateway-token-file=") for a in token_pod["containers"][0]["command"])
    assert (
        "--gateway-url=http://jupyter-elastic-kernels.jupyter.svc:8888/"
        in token_pod["containers"][0]["command"]
    )
    # Per-user namespaces: pods and Secrets anywhere, by label (a ClusterRole of its own).
    per_user = _pre_delete(render(VALUE_SETS["per-user-namespaces"], tmp_path))
    cluster_role = per_user[("ClusterRole", "", f"{RELEASE}:uninstall")]
    assert cluster_role["rules"] == [
        {"apiGroups": [""], "resources": ["pods", "secrets"], "verbs": ["list", "delete"]}
    ]
    assert (
        "--namespace-template=jupyter-{owner}"
        in per_user[("Job", "jupyter", name)]["spec"]["template"]["spec"]["containers"][0]["command"]
    )
    assert not _pre_delete(render({"uninstallHook": {"enabled": False}}, tmp_path))


@pytest.mark.timeout(300)
def test_uninstall_hook_stops_waiting_at_its_deadline_and_says_what_is_left(
    kube_plane: Any, kube_api: Any, kube_namespace: str, tmp_path: Path
) -> None:
    """A kernel pod that does not end (a finalizer holds it) does not hold the uninstall: past the
    deadline the hook names it as left and exits 0. Without its Roles it says so in one line and
    exits 0 too (the uninstall goes on). Its real command, as its own ServiceAccount."""
    from kubernetes import client
    from kubernetes.utils import create_from_dict

    from tests.support import rbac
    from tests.support.kube import write_kubeconfig

    namespace = kube_namespace
    core = client.CoreV1Api(kube_api)
    hooks = _pre_delete(render({}, tmp_path, namespace=namespace))
    name = f"{RELEASE}-uninstall"
    for (kind, _ns, _), doc in hooks.items():
        if kind in ("ServiceAccount", "Role", "RoleBinding"):
            create_from_dict(kube_api, doc, namespace=namespace)
    command = hooks[("Job", namespace, name)]["spec"]["template"]["spec"]["containers"][0]["command"]
    hook = [sys.executable, *command[1:], "--deadline=3"]
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}

    def run_as(account: str) -> subprocess.CompletedProcess[str]:
        token = core.create_namespaced_service_account_token(
            account, namespace, {"spec": {"expirationSeconds": 600}}
        )
        identity = write_kubeconfig(
            tmp_path / f"{account}.kubeconfig",
            kube_plane.server,
            kube_plane.pki.ca_cert,
            token=token.status.token,
        )
        # The authorizer reads the bindings from a cache: allowed, or refused, as they now say.
        rbac.wait_allowed(
            kube_plane, token.status.token, "delete", "pods", namespace, allowed=account == name
        )
        return subprocess.run(
            hook, env={**env, "KUBECONFIG": str(identity)}, capture_output=True, text=True, timeout=120
        )

    labels = {
        "app.kubernetes.io/name": "jupyter-elastic-kernels",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "kernel",
        KERNEL_ID_LABEL: "k-stuck",
    }
    core.create_namespaced_secret(namespace, {"metadata": {"name": "kernel-k-stuck", "labels": labels}})
    core.create_namespaced_pod(namespace, _pod("kernel-k-stuck", labels, finalizers=[GATEWAY_FINALIZER]))
    try:
        refused = run_as("default")
        assert refused.returncode == 0, (refused.stdout, refused.stderr)
        assert "uninstall: stopped early: 403 " in refused.stdout, refused.stdout
        said = run_as(name)
        assert said.returncode == 0, (said.stdout, said.stderr)
        out = said.stdout
        assert f"uninstall: no gateway Deployment {namespace}/{RELEASE}" in out, out
        assert "no gateway token (uninstallHook.gatewayTokenSecret)" in out, out
        assert "uninstall: stopping kernel k-stuck: not hibernated, its variables are lost" in out, out
        assert f"uninstall: deleted secret {namespace}/kernel-k-stuck" in out, out
        assert f"left: pod {namespace}/kernel-k-stuck (still ending at the deadline)" in out, out
        assert f"left: PersistentVolumeClaim {namespace}/{RELEASE}-checkpoints" in out, out
    finally:
        core.patch_namespaced_pod("kernel-k-stuck", namespace, {"metadata": {"finalizers": None}})


@pytest.mark.timeout(300)
def test_uninstall_hook_reaches_per_user_namespaces_with_its_cluster_role(
    kube_plane: Any, kube_api: Any, kube_namespace: str, tmp_path: Path
) -> None:
    """With kernels.namespaceTemplate the hook finds the release's kernel pods and Secrets in any
    namespace by label (its ClusterRole), deletes them, and names each per-user namespace it leaves:
    where it found them and where a kept record's owner has one. Its real command and rights."""
    from kubernetes import client
    from kubernetes.utils import create_from_dict

    from kernelmgr.kube.records import COMPONENT_LABEL, OWNER_ANNOTATION, REGISTRY_LABEL, STATE_LABEL
    from kernelmgr.server.sessions import server_identity
    from tests.support import rbac
    from tests.support.kube import write_kubeconfig

    namespace = kube_namespace
    core = client.CoreV1Api(kube_api)
    template = f"{namespace}-{{owner}}"
    values = {"kernels": {"namespaceTemplate": template, "createNamespaces": True}}
    hooks = _pre_delete(render(values, tmp_path, namespace=namespace))
    name = f"{RELEASE}-uninstall"
    cluster_wide = [d for (kind, _ns, _), d in hooks.items() if kind.startswith("Cluster")]
    alice = namespace_for(template, "alice")
    try:
        for (kind, _ns, _), doc in hooks.items():
            if kind != "Job":
                create_from_dict(kube_api, doc, namespace=namespace)
        core.create_namespace({"metadata": {"name": alice}})
        labels = {
            "app.kubernetes.io/name": "jupyter-elastic-kernels",
            "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": "kernel",
            KERNEL_ID_LABEL: "k-alice",
        }
        core.create_namespaced_secret(alice, {"metadata": {"name": "kernel-k-alice", "labels": labels}})
        core.create_namespaced_pod(alice, _pod("kernel-k-alice", labels))
        # bob's kernel is hibernated: no pod, only its record (kept), in the release's namespace.
        mount_path = server_config(render(values, tmp_path, namespace=namespace))["ServerApp"]["root_dir"]
        record = {
            "metadata": {
                "name": "elastic-kernel-k-bob",
                "labels": {
                    COMPONENT_LABEL: "kernel-record",
                    REGISTRY_LABEL: server_identity(mount_path),
                    KERNEL_ID_LABEL: "k-bob",
                    STATE_LABEL: "hibernated",
                },
                "annotations": {OWNER_ANNOTATION: "bob"},
            },
            "data": {"record.json": "{}"},
        }
        core.create_namespaced_config_map(namespace, record)
        command = hooks[("Job", namespace, name)]["spec"]["template"]["spec"]["containers"][0]["command"]
        token = core.create_namespaced_service_account_token(
            name, namespace, {"spec": {"expirationSeconds": 600}}
        )
        identity = write_kubeconfig(
            tmp_path / "hook.kubeconfig", kube_plane.server, kube_plane.pki.ca_cert, token=token.status.token
        )
        rbac.wait_allowed(kube_plane, token.status.token, "delete", "pods", alice)
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        said = subprocess.run(
            [sys.executable, *command[1:], "--deadline=60"],
            env={**env, "KUBECONFIG": str(identity)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = said.stdout
        assert said.returncode == 0, (out, said.stderr)
        assert f"uninstall: deleted pod {alice}/kernel-k-alice" in out, out
        assert f"uninstall: deleted secret {alice}/kernel-k-alice" in out, out
        assert (
            f"left: kernel record ConfigMap {namespace}/elastic-kernel-k-bob (hibernated kernel k-bob" in out
        )
        for owner in ("alice", "bob"):
            assert f"left: namespace {namespace_for(template, owner)} (kernels.namespaceTemplate" in out, out
        selector = f"{KERNEL_ID_LABEL}=k-alice"
        assert not core.list_namespaced_secret(alice, label_selector=selector).items
        pods = core.list_namespaced_pod(alice, label_selector=selector).items
        assert all(p.metadata.deletion_timestamp for p in pods), pods  # none left running
    finally:
        rbac.delete(kube_api, cluster_wide)
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(alice)


@pytest.mark.timeout(600)
def test_image_awaiter_waits_for_every_puller_pod_with_the_charts_rights(
    kube_plane: Any, kube_api: Any, kube_namespace: str, tmp_path: Path
) -> None:
    """The chart's hook DaemonSet, ServiceAccount, Role and RoleBinding in the real API server; the
    awaiter's real command, as that ServiceAccount. A kwok node runs its puller pod; a node nobody runs
    keeps the other pending: the awaiter fails with one line naming the count and the value to raise,
    then returns once that node is gone and every desired pod is ready."""
    from kubernetes import client
    from kubernetes.utils import create_from_dict

    from tests.support.kube import create_fake_gpu_nodes, fake_gpu_node, wait_for, write_kubeconfig

    namespace = kube_namespace
    label = f"elastic.test/pull-{namespace}"
    values = {
        "prePuller": {
            **HOOK_VALUES["prePuller"],
            "nodeSelector": {"nvidia.com/gpu.present": None, label: "true"},
        }
    }
    hooks = _hooks(render(values, tmp_path, namespace=namespace))
    for kind in ("ServiceAccount", "Role", "RoleBinding", "DaemonSet"):
        (doc,) = [d for (k, _), d in hooks.items() if k == kind]
        create_from_dict(kube_api, doc, namespace=namespace)
    command = hooks[("Job", HOOK_AWAITER)]["spec"]["template"]["spec"]["containers"][0]["command"]
    # The ServiceAccount's own token (TokenRequest), as the Job's pod would have it.
    token = client.CoreV1Api(kube_api).create_namespaced_service_account_token(
        HOOK_AWAITER, namespace, {"spec": {"expirationSeconds": 3600}}
    )
    identity = write_kubeconfig(
        tmp_path / "awaiter.kubeconfig", kube_plane.server, kube_plane.pki.ca_cert, token=token.status.token
    )
    env = {**os.environ, "KUBECONFIG": str(identity)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    awaiter = [sys.executable, *command[1:]]

    # Without the chart's Role (the namespace's default ServiceAccount): one line with the API's reason.
    nobody = client.CoreV1Api(kube_api).create_namespaced_service_account_token(
        "default", namespace, {"spec": {"expirationSeconds": 3600}}
    )
    write_kubeconfig(
        tmp_path / "nobody.kubeconfig", kube_plane.server, kube_plane.pki.ca_cert, token=nobody.status.token
    )
    refused = subprocess.run(
        awaiter,
        env={**env, "KUBECONFIG": str(tmp_path / "nobody.kubeconfig")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"image-awaiter: cannot read DaemonSet {namespace}/{HOOK_PULLER}: 403 ")

    core = client.CoreV1Api(kube_api)
    apps = client.AppsV1Api(kube_api)
    kwok_node, idle_node = f"pull-kwok-{namespace}", f"pull-idle-{namespace}"
    idle = fake_gpu_node(idle_node, gpus=0, labels={label: "true"})
    del idle["metadata"]["annotations"]  # kwok leaves it alone: its puller pod never runs
    try:
        create_fake_gpu_nodes(kube_api, [kwok_node], gpus=0, labels={label: "true"})
        core.create_node(idle)

        def one_of_two() -> bool:
            status = apps.read_namespaced_daemon_set(HOOK_PULLER, namespace).status
            return status.desired_number_scheduled == 2 and status.number_ready == 1

        try:  # the DaemonSet controller and kwok on a loaded machine: a failure budget, not a timing
            wait_for(one_of_two, 180, "one of the two puller pods ready")
        except TimeoutError as exc:
            pods = core.list_namespaced_pod(namespace).items
            seen = [(p.metadata.name, p.spec.node_name, p.status.phase) for p in pods]
            status = apps.read_namespaced_daemon_set(HOOK_PULLER, namespace).status
            raise AssertionError(f"{exc}: {status}, pods {seen}") from None
        late = subprocess.run(
            [*awaiter[:-1], "--timeout=2"], env=env, capture_output=True, text=True, timeout=60
        )
        assert late.returncode == 1, (late.stdout, late.stderr)
        assert late.stderr.count("\n") == 1, late.stderr
        line = late.stderr.strip()
        assert f"DaemonSet {namespace}/{HOOK_PULLER} has 1 of 2 pods ready after 2 s" in line
        assert "prePuller.hook.timeout" in line

        waiting = subprocess.Popen(
            awaiter, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            core.delete_node(idle_node)
            out, err = waiting.communicate(timeout=120)
        finally:
            waiting.kill()
        assert waiting.returncode == 0, (out, err)
        assert f"{HOOK_PULLER}: 1 of 1 pods ready" in out
    finally:
        for node in (kwok_node, idle_node):
            try:
                core.delete_node(node)
            except client.ApiException as err:
                assert err.status == 404


def test_kernel_role_is_exactly_the_shipped_rbac(tmp_path: Path) -> None:
    shipped = [d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/rbac.yaml").read_text()) if d]
    shipped_namespaces = [
        d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/rbac-namespaces.yaml").read_text()) if d
    ]

    def rules(docs: list[dict[str, Any]], suffix: str) -> Any:
        return only(docs, "ClusterRole", f"jupyter-elastic-kernels:{suffix}")["rules"]

    per_user = render(VALUE_SETS["per-user-namespaces"], tmp_path)
    assert rules(per_user, "kernel-pods") == rules(shipped, "kernel-pods")
    # The records and the Lease: a Role in the release namespace only, bound to the gateway there.
    role = only(per_user, "Role", "jupyter-elastic-kernels:gateway")
    assert role["rules"] == only(shipped, "Role", "jupyter-elastic-kernels:gateway")["rules"]
    assert role["metadata"]["namespace"] == "jupyter"
    binding = only(per_user, "RoleBinding", "jupyter-elastic-kernels:gateway")
    assert binding["roleRef"] == {"apiGroup": RBAC_GROUP, "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["metadata"]["namespace"] == "jupyter"
    assert {r for rule in rules(per_user, "kernel-pods") for r in rule["resources"]}.isdisjoint(
        {"configmaps", "leases"}
    )
    assert server_config(per_user)["ElasticKubernetesProvisioner"]["state_namespace"] == "jupyter"
    assert rules(per_user, "nodes") == rules(shipped, "nodes")
    assert rules(per_user, "namespaces") == rules(shipped_namespaces, "namespaces")
    config = server_config(per_user)["ElasticKubernetesProvisioner"]
    assert config["namespace_template"] == "jupyter-{owner}" and config["create_namespace"] is True
    assert namespace_for(config["namespace_template"], "Bob.Smith") == namespace_for(
        "jupyter-{owner}", "Bob.Smith"
    )
    assert config["namespace_cluster_role"] == "jupyter-elastic-kernels:kernel-pods"
    # Without per-user namespaces the gateway gets no right to make namespaces or bindings.
    plain = render({}, tmp_path)
    assert not [d for d in plain if d["metadata"]["name"].endswith(":namespaces")]
    # A RoleBinding and a NetworkPolicy in every kernel namespace, none elsewhere.
    spread = render(VALUE_SETS["extra-namespaces"], tmp_path)
    kernel_bindings = [
        d
        for d in spread
        if d["kind"] == "RoleBinding"
        and d["roleRef"]["kind"] == "ClusterRole"
        and "helm.sh/hook" not in d["metadata"].get("annotations", {})
    ]
    assert sorted(d["metadata"]["namespace"] for d in kernel_bindings) == ["kernels", "kernels-b"]
    # The gateway's own Role stays in its namespace, away from the kernels'.
    assert (
        only(spread, "RoleBinding", "jupyter-elastic-kernels:gateway")["metadata"]["namespace"] == "jupyter"
    )
    policies = [
        d for d in spread if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-kernel-pods")
    ]
    assert sorted(d["metadata"]["namespace"] for d in policies) == ["kernels", "kernels-b"]
    # Declared inventory: no right to read nodes either.
    declared = render(VALUE_SETS["monitoring-prepuller-hub"], tmp_path)
    assert not [d for d in declared if d["metadata"]["name"].endswith(":nodes")]


def test_network_policy_admits_only_the_gateway(tmp_path: Path) -> None:
    docs = render({}, tmp_path)
    gateway_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    policy = only(docs, "NetworkPolicy", "jupyter-elastic-kernels-kernel-pods")["spec"]
    # This release's kernel and warm pods by the project's labels, never EG's bare component=kernel.
    assert policy["podSelector"] == {
        "matchLabels": {
            "app.kubernetes.io/name": "jupyter-elastic-kernels",
            "app.kubernetes.io/instance": "jupyter-elastic-kernels",
        },
        "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": ["kernel", "warm-kernel"]}
        ],
    }
    # Pods an earlier version started (bare labels) keep the same policies until they end, under the
    # names that version used, narrowed to the project's pods.
    for name in ("kernels", "kernels-egress"):
        legacy = only(docs, "NetworkPolicy", f"jupyter-elastic-kernels-{name}")["spec"]
        twin = only(
            docs, "NetworkPolicy", f"jupyter-elastic-kernels-{name.replace('kernels', 'kernel-pods')}"
        )
        assert legacy["podSelector"] == {
            "matchLabels": {"app.kubernetes.io/name": "jupyter-elastic-kernels"},
            "matchExpressions": [{"key": "component", "operator": "In", "values": ["kernel", "warm-kernel"]}],
        }
        assert {**legacy, "podSelector": None} == {**twin["spec"], "podSelector": None}
    (source,) = policy["ingress"][0]["from"]
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "jupyter"}
    assert source["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    assert source["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"


def _egress_allows(policy: dict[str, Any], ip: str, port: int, protocol: str = "TCP") -> bool:
    """Does one of ``policy``'s egress rules let its pods reach ``ip``:``port`` (by an ipBlock; the
    pod and namespace peers are pods, never the metadata service or a private host)?"""
    import ipaddress

    address = ipaddress.ip_address(ip)
    for rule in policy["spec"].get("egress") or []:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports):
            continue
        peers = rule.get("to")
        if not peers:
            return True
        for peer in peers:
            block = peer.get("ipBlock")
            if block is None or address.version != ipaddress.ip_network(block["cidr"]).version:
                continue
            inside = address in ipaddress.ip_network(block["cidr"])
            excepted = any(
                address in ipaddress.ip_network(e)
                for e in block.get("except", [])
                if ipaddress.ip_network(e).version == address.version
            )
            if inside and not excepted:
                return True
    return False


def _kernel_egress(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return only(docs, "NetworkPolicy", "jupyter-elastic-kernels-kernel-pods-egress")


def test_kernel_egress_is_denied_but_for_dns_the_gateway_and_the_allow_list(tmp_path: Path) -> None:
    """As z2jh's singleuser egressAllowRules: no cloud metadata, no private ranges unless allowed."""
    docs = render({}, tmp_path)
    policy = _kernel_egress(docs)
    ingress = only(docs, "NetworkPolicy", "jupyter-elastic-kernels-kernel-pods")
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert policy["spec"]["podSelector"] == ingress["spec"]["podSelector"]  # every kernel and warm pod
    metadata, private, public = "169.254.169.254", "10.20.30.40", "151.101.0.223"
    for port in (80, 443, 53):
        for protocol in ("TCP", "UDP"):
            assert not _egress_allows(policy, metadata, port, protocol)
    assert not _egress_allows(policy, private, 5432) and not _egress_allows(policy, "192.168.1.10", 2049)
    assert not _egress_allows(policy, "172.16.0.1", 10250)  # a kubelet
    assert _egress_allows(policy, private, 53, "UDP") and _egress_allows(policy, "169.254.20.10", 53, "UDP")
    assert _egress_allows(policy, public, 443) and _egress_allows(policy, "2606:4700::1111", 443)
    assert not _egress_allows(policy, "fd00:ec2::254", 80)  # AWS's IPv6 metadata address
    gateway_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    peers = [peer for rule in policy["spec"]["egress"] for peer in rule.get("to", [])]
    dns = next(p for p in peers if "namespaceSelector" in p and "podSelector" not in p)
    assert dns["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kube-system"}
    gateway = next(p for p in peers if "podSelector" in p)
    assert gateway["podSelector"]["matchLabels"].items() <= gateway_labels.items()

    # The allow-list opens what the admin names, nothing else.
    extra = {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"port": 9000, "protocol": "TCP"}]}
    opened = _kernel_egress(render({"networkPolicy": {"kernels": {"egress": [extra]}}}, tmp_path))
    assert _egress_allows(opened, "10.1.2.3", 9000) and not _egress_allows(opened, "10.1.2.4", 9000)
    allow = {"privateIPs": True, "cloudMetadataServer": True, "nonPrivateIPs": False}
    loose = _kernel_egress(render({"networkPolicy": {"kernels": {"egressAllowRules": allow}}}, tmp_path))
    assert _egress_allows(loose, private, 5432) and _egress_allows(loose, metadata, 80)
    assert not _egress_allows(loose, public, 443)
    # The gateway gets the same kernel policies for the namespaces it creates.
    config = server_config(docs)["ElasticKubernetesProvisioner"]
    rendered = [d for d in docs if d["kind"] == "NetworkPolicy" and "kernel-pods" in d["metadata"]["name"]]
    assert [(p["metadata"]["name"], p["spec"]) for p in config["namespace_network_policies"]] == [
        (d["metadata"]["name"], d["spec"]) for d in rendered
    ]


def test_master_secret_is_a_secret_mounted_only_into_the_gateway(tmp_path: Path) -> None:
    docs = render(VALUE_SETS["monitoring-prepuller-hub"], tmp_path)
    secret = only(docs, "Secret", "jupyter-elastic-kernels-checkpoint-secret")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    import base64

    assert len(base64.b64decode(secret["data"]["secret"])) >= 32
    config = server_config(docs)
    gateway = only(docs, "Deployment")["spec"]["template"]["spec"]
    volume = next(
        v for v in gateway["volumes"] if v.get("secret", {}).get("secretName") == secret["metadata"]["name"]
    )
    assert volume["secret"]["defaultMode"] == 0o400
    (mount,) = [m for m in gateway["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    secret_file = config["ElasticKernels"]["checkpoint_secret_file"]
    assert secret_file == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    # Not on the checkpoint claim (which kernel pods mount, each at its owner's sub-path).
    assert not secret_file.startswith(config["ElasticKernels"]["checkpoint_root"].rstrip("/") + "/")
    # No other pod (node agents, pre-pullers, the image awaiter, the uninstall hook, which only names it
    # in what it says it leaves) mounts it or has it in its environment; kernel pods are made from the
    # provisioner's settings, which do not name it.
    for doc in docs:
        if doc["kind"] in ("DaemonSet", "Job"):
            pod = doc["spec"]["template"]["spec"]
            containers = pod["containers"] + pod.get("initContainers", [])
            reachable = [pod.get("volumes"), [(c.get("env"), c.get("envFrom")) for c in containers]]
            assert secret["metadata"]["name"] not in json.dumps(reachable), doc["metadata"]["name"]
    provisioner = json.dumps(config["ElasticKubernetesProvisioner"])
    assert secret["metadata"]["name"] not in provisioner and mount["mountPath"] not in provisioner
    # An admin's own Secret instead: mounted the same way, none made.
    own = render({"checkpointSecret": {"existingSecret": "my-master", "key": "master"}}, tmp_path)
    assert not [d for d in own if d["kind"] == "Secret" and "checkpoint" in d["metadata"]["name"]]
    own_gateway = only(own, "Deployment")["spec"]["template"]["spec"]
    (own_volume,) = [
        v for v in own_gateway["volumes"] if v.get("secret", {}).get("secretName") == "my-master"
    ]
    assert server_config(own)["ElasticKernels"]["checkpoint_secret_file"].endswith("/master")
    assert own_volume["secret"]["items"] == [{"key": "master", "path": "master"}]


def _metrics_scrape(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ServiceMonitor's one endpoint, and the gateway container's scrape-token env entry."""
    from gateway.config import METRICS_TOKEN_VARIABLE

    (endpoint,) = only(docs, "ServiceMonitor")["spec"]["endpoints"]
    (container,) = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == METRICS_TOKEN_VARIABLE]
    return endpoint, env


def test_service_monitor_scrapes_the_gateways_metrics_with_its_token(tmp_path: Path) -> None:
    """Prometheus asks the gateway's port, at /metrics under its base_url, with the token it reads."""
    docs = render(VALUE_SETS["monitoring-prepuller-hub"], tmp_path)
    monitor = only(docs, "ServiceMonitor")
    endpoint, env = _metrics_scrape(docs)
    # The token: the Secret and key the gateway's ELASTIC_METRICS_TOKEN reads.
    assert endpoint["bearerTokenSecret"] == env["valueFrom"]["secretKeyRef"]
    assert endpoint["bearerTokenSecret"] == {"name": "jupyter-elastic-kernels-metrics-token", "key": "token"}
    secret = only(docs, "Secret", "jupyter-elastic-kernels-metrics-token")
    assert secret["metadata"]["namespace"] == monitor["metadata"]["namespace"]
    token = base64.b64decode(secret["data"]["token"])
    assert len(token) >= 32
    assert token.decode() not in json.dumps(server_config(docs))  # never in the ConfigMap
    # The path: the gateway's /metrics under the base_url it is served at as a Hub service.
    base_url = server_config(docs)["ServerApp"]["base_url"]
    assert base_url == "/services/elastic-gateway/"
    assert endpoint["path"] == base_url + "metrics"
    # The port: the Service's that the ServiceMonitor selects, forwarding to the container's.
    service = only(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    (container,) = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    # Token mode serves at the root; a base_url of extraConfig moves the path with it.
    token_mode = {"gateway": {"auth": "token"}, "metrics": {"serviceMonitor": {"enabled": True}}}
    assert _metrics_scrape(render(token_mode, tmp_path))[0]["path"] == "/metrics"
    moved = {**token_mode, "extraConfig": {"ServerApp": {"base_url": "/gw/"}}}
    assert _metrics_scrape(render(moved, tmp_path))[0]["path"] == "/gw/metrics"
    # An admin's own Secret: named by both, none made.
    own = render({"metrics": {"tokenSecret": "my-scrape", "serviceMonitor": {"enabled": True}}}, tmp_path)
    endpoint, env = _metrics_scrape(own)
    assert endpoint["bearerTokenSecret"] == env["valueFrom"]["secretKeyRef"]
    assert endpoint["bearerTokenSecret"] == {"name": "my-scrape", "key": "token"}
    assert not [d for d in own if d["kind"] == "Secret" and "metrics" in d["metadata"]["name"]]


def test_pod_monitor_scrapes_every_node_agent_with_their_token(tmp_path: Path) -> None:
    """The agents' /metrics: every agent pod (no Service), its named port, the agents' token."""
    values = {"metrics": {"serviceMonitor": {"enabled": True}}, "kernels": {"namespace": "kernels"}}
    docs = render(values, tmp_path)
    monitor = only(docs, "PodMonitor")
    agents = only(docs, "DaemonSet", "jupyter-elastic-kernels-node-agent")
    template = agents["spec"]["template"]
    assert monitor["metadata"]["namespace"] == agents["metadata"]["namespace"] == "kernels"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = template["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]} and endpoint["path"] == "/metrics"
    tokens = [v["secret"]["secretName"] for v in template["spec"]["volumes"] if "secret" in v]
    assert endpoint["bearerTokenSecret"] == {
        "name": "jupyter-elastic-kernels-node-agent-token",
        "key": "token",
    }
    assert endpoint["bearerTokenSecret"]["name"] in tokens
    assert not [
        d for d in render({**values, "nodeAgent": {"enabled": False}}, tmp_path) if d["kind"] == "PodMonitor"
    ]


def test_alerts_cover_gateway_down_failing_resumes_capacity_and_a_filling_volume(tmp_path: Path) -> None:
    rule = only(render({"metrics": {"prometheusRule": {"enabled": True}}}, tmp_path), "PrometheusRule")
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r}
    assert {
        "ElasticGatewayDown",
        "ElasticResumesFailing",
        "ElasticGpuCapacityExhausted",
        "ElasticCheckpointVolumeFilling",
    } <= set(alerts)
    down = alerts["ElasticGatewayDown"]["expr"]
    assert 'up{job="jupyter-elastic-kernels",namespace="jupyter"}' in down and "absent(" in down
    assert "< 0.1" in alerts["ElasticCheckpointVolumeFilling"]["expr"]
    assert "elastic_capacity_refusals_total" in alerts["ElasticGpuCapacityExhausted"]["expr"]


def test_node_agents_are_found_by_the_charts_labels_and_answer_only_its_token(tmp_path: Path) -> None:
    from kernelmgr.kube.node_agents import agent_labels

    docs = render(VALUE_SETS["extra-namespaces"], tmp_path)
    config = server_config(docs)["ElasticKubernetesProvisioner"]
    assert config["node_agent_instance"] == "jupyter-elastic-kernels"
    agent = only(docs, "DaemonSet", "jupyter-elastic-kernels-node-agent")
    assert (
        agent_labels(config["node_agent_instance"]).items()
        <= agent["spec"]["template"]["metadata"]["labels"].items()
    )
    spec = agent["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    token_volume = next(v for v in spec["volumes"] if "secret" in v)
    mount = next(m for m in container["volumeMounts"] if m["name"] == token_volume["name"])
    assert f"--token-file={mount['mountPath']}/token" in container["args"] and mount["readOnly"]
    gateway = only(docs, "Deployment")["spec"]["template"]["spec"]
    gateway_volume = next(
        v
        for v in gateway["volumes"]
        if v.get("secret", {}).get("secretName") == token_volume["secret"]["secretName"]
    )
    gateway_mount = next(
        m for m in gateway["containers"][0]["volumeMounts"] if m["name"] == gateway_volume["name"]
    )
    assert config["node_agent_token_file"] == f"{gateway_mount['mountPath']}/token"
    # The token's Secret is in the agents' namespace and the gateway's, with one value.
    tokens = [
        d
        for d in docs
        if d["kind"] == "Secret" and d["metadata"]["name"] == token_volume["secret"]["secretName"]
    ]
    assert sorted(d["metadata"]["namespace"] for d in tokens) == ["jupyter", "kernels"]
    assert len({d["data"]["token"] for d in tokens}) == 1
    # The agents' NetworkPolicy selects the chart's agents by the same labels.
    policy = only(
        [d for d in docs if d["metadata"].get("namespace") == "kernels"],
        "NetworkPolicy",
        "jupyter-elastic-kernels-node-agent",
    )
    assert policy["spec"]["podSelector"]["matchLabels"] == agent["spec"]["selector"]["matchLabels"]


def test_kernel_pod_resources_reach_the_provisioner(tmp_path: Path) -> None:
    from kernelmgr.kube.settings import pod_resources_refusal

    config = server_config(render({}, tmp_path))["ElasticKubernetesProvisioner"]
    assert config["cpu_kernel_resources"] == {
        "requests": {"cpu": "250m", "memory": "1Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    sized = {"whole": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "64Gi"}}}
    config = server_config(render({"kernels": {"sizeResources": sized}}, tmp_path))[
        "ElasticKubernetesProvisioner"
    ]
    assert config["size_resources"] == sized
    # The provisioner accepts what the chart renders.
    assert pod_resources_refusal(config["cpu_kernel_resources"], "cpu") is None
    assert pod_resources_refusal(config["resources"], "gpu") is None
    assert pod_resources_refusal(config["size_resources"]["whole"], "whole") is None


def test_size_pod_settings_and_the_pod_patch_reach_the_provisioner(tmp_path: Path) -> None:
    from kernelmgr.kube.settings import KubeSettings

    sized = {
        "whole": {
            "image": "registry.example/torch:2",
            "nodeSelector": {"gpu": "a100"},
            "priorityClassName": "kernels",
            "imagePullSecrets": ["pull"],
            "shmSize": "8Gi",
            "resources": {
                "requests": {"cpu": "8", "memory": "64Gi"},
                "limits": {"cpu": "8", "memory": "64Gi"},
            },
        }
    }
    patch = {"spec": {"dnsPolicy": "ClusterFirst"}}
    values = {"kernels": {"sizePodSettings": sized, "podPatch": patch, "validatePodsAtStart": False}}
    config = server_config(render(values, tmp_path))["ElasticKubernetesProvisioner"]
    assert config["size_pod_settings"] == sized and config["pod_patch"] == patch
    assert config["validate_pods_at_start"] is False
    # The provisioner accepts what the chart renders.
    settings = KubeSettings(size_pod_settings=config["size_pod_settings"], pod_patch=config["pod_patch"])
    settings.check_sizes(["whole"])
    assert config["shm_size"] == "1Gi" and config["cpu_pod_settings"] == {}
    cpu = {"nodeSelector": {"pool": "cpu"}, "shmSize": "256Mi"}
    values = {"kernels": {"cpuPodSettings": cpu, "shmSize": "2Gi", "kernelspecArgv": ["jax"]}}
    config = server_config(render(values, tmp_path))["ElasticKubernetesProvisioner"]
    assert config["cpu_pod_settings"] == cpu and config["shm_size"] == "2Gi"
    assert config["kernelspec_argv"] == ["jax"]
    KubeSettings(
        cpu_pod_settings=cpu, shm_size=config["shm_size"], kernelspec_argv=config["kernelspec_argv"]
    ).check_sizes(["whole"])


def test_user_volumes_reach_the_provisioner(tmp_path: Path) -> None:
    from kernelmgr.kube.settings import KubeSettings

    home = {"name": "home", "claimName": "claim-{owner}", "mountPath": "/home/jovyan"}
    values = {"kernels": {"userVolumes": [home], "homeVolume": "home", "homeAccessMode": "ReadWriteOnce"}}
    config = server_config(render(values, tmp_path))["ElasticKubernetesProvisioner"]
    assert config["user_volumes"] == [home] and config["home_volume"] == "home"
    assert config["notebook_root"] == "/home/jovyan" and config["home_access_mode"] == "ReadWriteOnce"
    assert config["user_pod_selector"] == {
        "component": "singleuser-server",
        "hub.jupyter.org/username": "{owner}",
    }
    settings = KubeSettings(**{k: config[k] for k in ("user_volumes", "home_volume", "home_access_mode")})
    settings.check_sizes(["whole"])
    values = {"kernels": {"clientEnv": ["KERNEL_PROJECT"], "kernelspecImages": {"python3": "reg/torch:2"}}}
    config = server_config(render(values, tmp_path))["ElasticKubernetesProvisioner"]
    assert config["client_env"] == ["KERNEL_PROJECT"] and config["kernelspec_images"] == {
        "python3": "reg/torch:2"
    }


def test_user_ids_and_the_auth_state_keys_reach_the_gateway(tmp_path: Path) -> None:
    from gateway.hub_ids import parse_setting
    from kernelmgr.kube.settings import KubeSettings

    keys = {"uid": "user_attributes.uidNumber", "gid": "user_attributes.gidNumber"}
    values = {
        "kernels": {"userIds": {"alice": {"uid": 1001, "gid": 1001}}},
        "jupyterhub": {"userIdsFromAuthState": keys, "userIdsRefreshSeconds": 60},
    }
    config = server_config(render(values, tmp_path))
    assert config["ElasticKubernetesProvisioner"]["user_ids"] == {"alice": {"uid": 1001, "gid": 1001}}
    assert config["ElasticGateway"]["user_ids_from_auth_state"] == keys
    assert config["ElasticGateway"]["user_ids_refresh_seconds"] == 60
    assert parse_setting(config["ElasticGateway"]["user_ids_from_auth_state"]) == keys
    ids = config["ElasticKubernetesProvisioner"]["user_ids"]
    KubeSettings(user_ids=ids, checkpoint_claim="c").check_sizes([])
    assert "user_ids_from_auth_state" not in server_config(render({}, tmp_path))["ElasticGateway"]


def test_gateway_replicas_are_active_and_standby_behind_a_lease(tmp_path: Path) -> None:
    """Every gateway pod takes part in the Lease (one replica too: a pod stuck Terminating and its
    replacement never both write). The Service selects the serving label the holder puts on its own
    pod, so standbys may be Ready and an update starts the new pod before it stops the old leader
    (a surge), where the claim lets two pods mount it; else the old pods stop first."""
    docs = render({"gateway": {"replicas": 2}}, tmp_path)
    deployment = only(docs, "Deployment", "jupyter-elastic-kernels")["spec"]
    assert deployment["replicas"] == 2
    assert deployment["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    gateway = deployment["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/services/elastic-gateway/api/elastic/readyz"
    fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in gateway["env"]
        if "fieldRef" in e.get("valueFrom", {})
    }
    assert fields == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    election = server_config(docs)["ElasticLeaderElection"]
    assert election == {
        "enabled": True,
        "lease_name": "jupyter-elastic-kernels-gateway",
        "serving_label": "elastic.jupyter.org/serving",
    }
    service = only(docs, "Service", "jupyter-elastic-kernels")["spec"]
    assert service["selector"]["elastic.jupyter.org/serving"] == "true"
    # New pods start without it: only the Lease holder's pod ever carries it.
    assert "elastic.jupyter.org/serving" not in deployment["template"]["metadata"]["labels"]
    # The Lease and its own pods' label are the gateway namespace's Role's, not the kernels'.
    role = only(docs, "Role", "jupyter-elastic-kernels:gateway")
    assert (
        role["metadata"]["namespace"]
        == server_config(docs)["ElasticKubernetesProvisioner"]["state_namespace"]
    )
    assert {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update", "patch"],
    } in role["rules"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]} in role["rules"]
    single = render({}, tmp_path)
    assert only(single, "Deployment", "jupyter-elastic-kernels")["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    assert server_config(single)["ElasticLeaderElection"]["enabled"] is True
    # A ReadWriteOnce claim (a bucket's registry) cannot be mounted by a second pod on another node.
    s3 = {"endpoint": "http://minio:9000", "bucket": "ckpt", "existingSecret": "s3"}
    once = {"checkpoints": {"store": "s3", "objectStore": s3, "accessModes": ["ReadWriteOnce"]}}
    assert only(render(once, tmp_path), "Deployment", "jupyter-elastic-kernels")["spec"]["strategy"] == {
        "type": "Recreate"
    }
    twice = {**once, "gateway": {"replicas": 2}}
    assert only(render(twice, tmp_path), "Deployment", "jupyter-elastic-kernels")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "100%"},
    }
    chosen = {"gateway": {"updateStrategy": {"type": "Recreate"}}}
    assert only(render(chosen, tmp_path), "Deployment", "jupyter-elastic-kernels")["spec"]["strategy"] == {
        "type": "Recreate"
    }


def test_values_reach_the_server_config(tmp_path: Path) -> None:
    values = {
        "cull": {
            "idleTimeout": 900,
            "warnBefore": 60,
            "hibernatedTtl": 86400,
            "rules": [{"profiles": ["*"], "idle_timeout": 600}],
        },
        "quota": {"default": {"max_kernels": 2, "max_gpu": 1}},
        "gateway": {"auth": "token", "adminUsers": ["ops"]},
        "extraConfig": {"ElasticKernels": {"reap_interval": 2}},
    }
    config = server_config(render(values, tmp_path))
    assert config["CullPolicy"] == {
        "idle_timeout": 900,
        "interval": 60,
        "warn_before": 60,
        "hibernated_ttl": 86400,
        "rules": [{"profiles": ["*"], "idle_timeout": 600}],
    }
    assert config["ElasticQuota"]["default"] == {"max_kernels": 2, "max_gpu": 1}
    assert config["ElasticGateway"] == {"auth": "token", "admin_users": ["ops"], "admin_groups": []}
    assert config["ElasticKernels"]["reap_interval"] == 2
    assert config["ElasticKernels"]["kernel_provisioner"] == "elastic-kubernetes-provisioner"
    assert "base_url" not in config["ServerApp"]  # a token gateway is not a Hub service
    hub = server_config(render({"jupyterhub": {"serviceName": "gpu-gateway"}}, tmp_path))
    assert hub["ServerApp"]["base_url"] == "/services/gpu-gateway/"
    assert hub["ElasticGateway"]["auth"] == "jupyterhub"


def test_quotas_the_cull_policy_and_gpu_sizes_change_without_restarting_the_gateway(tmp_path: Path) -> None:
    """They are the live ConfigMap's, mounted as a folder (the kubelet updates it) and out of the
    checksum that restarts the gateway; any other setting, or extraConfig, restarts it."""

    def checksum(values: dict[str, Any]) -> str:
        annotations = only(render(values, tmp_path), "Deployment")["spec"]["template"]["metadata"][
            "annotations"
        ]
        return str(annotations["checksum/config"])

    docs = render({}, tmp_path)
    live = json.loads(only(docs, "ConfigMap", f"{RELEASE}-live")["data"]["live_config.json"])
    assert set(live) == {"CullPolicy", "ElasticQuota", "ElasticKernels"}
    assert set(live["ElasticKernels"]) == {"profiles"}
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "live-config", "configMap": {"name": f"{RELEASE}-live"}} in pod["volumes"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "live-config"]
    assert mount == {"name": "live-config", "mountPath": LIVE_CONFIG_DIR, "readOnly": True}  # no subPath
    base = checksum({})
    assert checksum({"quota": {"users": {"alice": {"max_kernels": 1}}}}) == base
    assert checksum({"cull": {"idleTimeout": 600, "rules": [{"profiles": ["*"], "warn_before": 30}]}}) == base
    assert checksum({"extraConfig": {"CullPolicy": {"busy_gpu_idle_warning": 60}}}) == base
    assert checksum({"gpu": {"profiles": {"half": {"gpu_fraction": 0.5, "memory_mib": 20480}}}}) == base
    assert checksum({"kernels": {"launchTimeout": 61}}) != base
    assert checksum({"extraConfig": {"ElasticKernels": {"reap_interval": 2}}}) != base


def test_the_admins_gpu_sizes_replace_the_default_size(tmp_path: Path) -> None:
    """Helm merges a values file's maps into the chart's: a default size in values.yaml was offered
    beside every admin's own (found following docs/deploy-kubernetes.md: "whole" next to "gpu-1")."""
    mine = {"gpu-1": {"display_name": "1 GPU", "gpu_fraction": 1, "backend": "whole"}}
    config = server_config(render({"gpu": {"profiles": mine}}, tmp_path))
    assert config["ElasticKernels"]["profiles"] == mine
    default = server_config(render({}, tmp_path))["ElasticKernels"]["profiles"]
    assert default == {"whole": {"display_name": "1 GPU", "gpu_fraction": 1, "backend": "whole"}}


# ---- helm install into the real API server; the gateway with the chart's identity


RELEASE = "jupyter-elastic-kernels"
SIZE = "python3-gpu-whole"
NOWHERE = {"elastic.test/no-such-node": "true"}  # the gateway and agent pods stay Pending: they run here


@pytest.fixture
def release(
    request: pytest.FixtureRequest, kube_plane: Any, kube_api: Any, kube_runner: Any, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    """The chart installed by helm into a fresh namespace of the envtest API server.

    Parametrized indirectly with "per-user": kernels in one namespace per owner, made by the gateway.
    """
    from kubernetes import client

    from tests.support.kube import wait_for

    require_envtest()
    core = client.CoreV1Api(kube_api)
    namespace = f"helm-{uuid.uuid4().hex[:6]}"
    claim = f"{RELEASE}-checkpoints"
    volume = f"{namespace}-checkpoints"
    # A static volume for the chart's claim (envtest has no storage provisioner).
    core.create_persistent_volume(
        {
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "100Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": "/srv/elastic-checkpoints"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
    )
    checkpoints = kube_runner.volumes_root / "pvc" / namespace / claim
    checkpoints.mkdir(parents=True)
    values = {
        "gateway": {"auth": "token", "nodeSelector": NOWHERE},
        "nodeAgent": {"nodeSelector": NOWHERE},
        "kernels": {
            "image": "python:3.12",
            "nodeSelector": {"elastic.test/node-runner": "true"},
            "runAsUser": os.getuid() or 1000,
            "launchTimeout": 60,
            "firstPort": 30000 + 5 * (uuid.uuid4().int % 5000),
        },
        # The chart's default inventory source, "kubernetes": the GPUs of the nodes (the runner's one
        # nvidia.com/gpu), read with the chart's nodes ClusterRole.
        "gpu": {"profiles": {"whole": {"gpu_fraction": 1, "backend": "whole"}}},
        # The gateway process runs on this machine: the claim's folder is where the runner maps it.
        "checkpoints": {"mountPath": str(checkpoints)},
        "extraConfig": {"ElasticKernels": {"reap_interval": 1}},
        # Off here: its Job would run at the fixture's uninstall; on in its own test.
        "uninstallHook": {"enabled": False},
    }
    if getattr(request, "param", None) == "per-user":
        values["kernels"].update({"namespaceTemplate": f"{namespace}-{{owner}}", "createNamespaces": True})
    kubeconfig = ["--kubeconfig", str(kube_plane.admin_kubeconfig)]
    install = ["install", RELEASE, str(CHART), "-n", namespace, "--create-namespace", *kubeconfig]
    helm(*install, *values_args(values, tmp_path))
    wait_for(
        lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound",
        60,
        "the chart's checkpoint claim to be bound",
    )
    try:
        yield {
            "namespace": namespace,
            "values": values,
            "kubeconfig": kubeconfig,
            "checkpoints": checkpoints,
            "claim": claim,
            "core": core,
        }
    finally:
        helm("uninstall", RELEASE, "-n", namespace, *kubeconfig, check=False)
        from tests.support import rbac

        rbac.delete(
            kube_api,
            [
                {"kind": kind, "metadata": {"name": f"{RELEASE}:{name}"}}
                for kind in ("ClusterRole", "ClusterRoleBinding")
                for name in ("kernel-pods", "nodes", "namespaces")
            ],
        )
        core.delete_namespace(namespace)
        core.delete_persistent_volume(volume)


def require_envtest() -> None:
    from tests.support.kube import require_envtest as require

    require()


def live_file(home: Path) -> Path:
    return home / "live_config.json"


def read_live(api: Any, namespace: str) -> str:
    """The live ConfigMap's file as the API server holds it (what the kubelet copies into the pod)."""
    from kubernetes import client

    return str(
        client.CoreV1Api(api)
        .read_namespaced_config_map(f"{RELEASE}-live", namespace)
        .data["live_config.json"]
    )


def start_gateway(tmp_path: Path, plane: Any, api: Any, release: dict[str, Any], name: str) -> Any:
    """The chart's command with the ConfigMap as the API server holds it, as the chart's ServiceAccount."""
    from kubernetes import client

    from tests.support import rbac
    from tests.support.server import TOKEN, RunningServer, free_port, isolated_env, wait_for

    namespace = release["namespace"]
    home = tmp_path / name
    home.mkdir()
    stored = client.CoreV1Api(api).read_namespaced_config_map(f"{RELEASE}-config", namespace)
    config_file = home / "jupyter_server_config.json"
    config_file.write_text(stored.data["jupyter_server_config.json"])
    # The live ConfigMap's file, where the pod would have it mounted (the kubelet's copy: live_file()).
    live_file(home).write_text(read_live(api, namespace))
    # In the pod the ServiceAccount token is mounted; here: a TokenRequest token in a kubeconfig.
    kubeconfig, token = rbac.service_account_kubeconfig(
        plane, api, namespace, RELEASE, home / "sa.kubeconfig"
    )
    rbac.wait_allowed(plane, token, "create", "pods", namespace)
    # In the pod the chart's Secrets are mounted (the master checkpoint secret, the agents' token):
    # here, files with their values as the API server holds them.
    import base64

    core = client.CoreV1Api(api)
    config = json.loads(stored.data["jupyter_server_config.json"])
    mounted = []
    for setting, secret, key in (
        ("ElasticKernels.checkpoint_secret_file", f"{RELEASE}-checkpoint-secret", "secret"),
        ("ElasticKubernetesProvisioner.node_agent_token_file", f"{RELEASE}-node-agent-token", "token"),
    ):
        section, _, name = setting.partition(".")
        if name in config[section]:
            path = home / f"{secret}-{key}"
            path.write_bytes(base64.b64decode(core.read_namespaced_secret(secret, namespace).data[key]))
            path.chmod(0o400)
            mounted.append(f"--{setting}={path}")
    log_path = home / "gateway.log"
    env = isolated_env(home)
    # The environment the Deployment gives the gateway container (the metrics token from its Secret).
    deployment = client.AppsV1Api(api).read_namespaced_deployment(RELEASE, namespace)
    for entry in deployment.spec.template.spec.containers[0].env or []:
        if entry.value_from is None:
            env[entry.name] = entry.value or ""
        elif entry.value_from.secret_key_ref is not None:
            ref = entry.value_from.secret_key_ref
            env[entry.name] = base64.b64decode(
                core.read_namespaced_secret(ref.name, namespace).data[ref.key]
            ).decode()
    for _attempt in range(5):  # again on a new port when another process took this one first
        port = free_port()
        command = [
            str(Path(sys.executable).parent / "jupyter-elastic-gateway"),
            f"--config={config_file}",
            # Only what differs from a pod: where it listens, its token, root in a test container.
            f"--ElasticKubernetesProvisioner.kubeconfig={kubeconfig}",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            "--ip=127.0.0.1",
            "--allow-root",
            f"--IdentityProvider.token={TOKEN}",
            f"--ElasticKernels.live_config_file={live_file(home)}",
            "--ElasticKernels.live_config_interval=0.5",
            *mounted,
        ]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=home)
        gateway = RunningServer(
            url=f"http://127.0.0.1:{port}", process=process, home=home, log_path=log_path, env=env
        )

        def answers(process: Any = process, gateway: Any = gateway) -> bool:
            if process.poll() is not None:
                if "is not available" in gateway.log():
                    return True  # its port was taken: launched again below
                raise AssertionError(f"the gateway exited with {process.returncode}:\n{gateway.log()}")
            try:
                # The chart's readiness probe: it holds the Lease and has taken the kernels over.
                return gateway.request("GET", "/api/elastic/leader", token=None).status == 200
            except (OSError, http.client.HTTPException):
                # Not up yet, or another process's socket on the port (the gateway then exits).
                return False

        wait_for(answers, 60, what="the gateway to answer")
        if process.poll() is None:
            return gateway
    raise AssertionError(f"the gateway found no free port in 5 tries:\n{gateway.log()}")


def _get(url: str, authorization: str) -> tuple[int, str]:
    """GET with only this Authorization header (no Jupyter token): status and body."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Authorization": authorization})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def kernel_pods(release: dict[str, Any], kernel_id: str) -> list[Any]:
    pods = (
        release["core"]
        .list_namespaced_pod(release["namespace"], label_selector=f"{KERNEL_ID_LABEL}={kernel_id}")
        .items
    )
    return list(pods)


#: What no checkpoint can keep: a half-used generator and a held lock (neither pickles).
UNPICKLABLE = "import os, threading; g = iter(range(10)); next(g); lock = threading.Lock(); lock.acquire()"


def hibernate(gateway: Any, release: dict[str, Any], kernel_id: str) -> None:
    reply = gateway.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, (reply, gateway.log()[-3000:])
    assert kernel_pods(release, kernel_id) == []
    assert gateway.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "hibernated"


@pytest.mark.timeout(600)
def test_install_then_gateway_with_chart_identity_hibernates_resumes_and_survives_upgrade(
    kube_plane: Any, kube_api: Any, release: dict[str, Any], tmp_path: Path
) -> None:
    from kubernetes import client

    from tests.support.kube import wait_for

    namespace = release["namespace"]
    apps = client.AppsV1Api(kube_api)
    # The API server accepted every object of the chart.
    assert (
        apps.read_namespaced_deployment(RELEASE, namespace).spec.template.spec.service_account_name == RELEASE
    )
    assert apps.read_namespaced_daemon_set(f"{RELEASE}-node-agent", namespace).spec.template.spec.host_pid
    client.RbacAuthorizationV1Api(kube_api).read_namespaced_role_binding(RELEASE, namespace)
    client.NetworkingV1Api(kube_api).read_namespaced_network_policy(f"{RELEASE}-kernel-pods", namespace)
    claim_uid = (
        release["core"].read_namespaced_persistent_volume_claim(release["claim"], namespace).metadata.uid
    )

    gateway = start_gateway(tmp_path, kube_plane, kube_api, release, "first")
    try:
        # The PrometheusRule's expressions name metrics the gateway really exports.
        import re

        rule = only(render({"metrics": {"prometheusRule": {"enabled": True}}}, tmp_path), "PrometheusRule")
        exprs = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
        names = {name for expr in exprs for name in re.findall(r"\belastic_[a-z_]+(?=[\[{])", expr)}
        # What a query can name: a counter's samples end in _total (the TYPE line may omit it).
        types = re.findall(r"^# TYPE (\S+) (\S+)$", gateway.text("/metrics"), re.MULTILINE)
        exported = {
            name if kind != "counter" or name.endswith("_total") else f"{name}_total" for name, kind in types
        }
        assert names and names <= exported, (names, sorted(n for n in exported if n.startswith("elastic")))
        # Prometheus, as the chart's ServiceMonitor has it scrape: its path, the token of its Secret.
        scrape = {**release["values"], "metrics": {"serviceMonitor": {"enabled": True}}}
        (endpoint,) = only(render(scrape, tmp_path, namespace), "ServiceMonitor")["spec"]["endpoints"]
        ref = endpoint["bearerTokenSecret"]
        metrics_token = release["core"].read_namespaced_secret(ref["name"], namespace).data[ref["key"]]
        bearer = base64.b64decode(metrics_token).decode()
        status, body = _get(gateway.url + endpoint["path"], f"Bearer {bearer}")
        assert status == 200 and "# TYPE elastic_" in body, (status, body[:500])
        status, body = _get(gateway.url + endpoint["path"], "Bearer not-the-token")
        assert status == 403 and "metrics_token" in json.loads(body)["message"], body
        # The gateway runs no kernel in its own pod: python3 is not offered, python3-cpu (a pod) is.
        specs = gateway.get("/api/kernelspecs")
        assert "python3" not in specs["kernelspecs"] and specs["default"] == "python3-cpu"
        refused = gateway.request("POST", "/api/kernels", {"name": "python3"})
        assert refused.status == 404 and "python3-cpu" in refused.body["message"], refused
        kernel_id = gateway.start_kernel(SIZE)
        with gateway.channel(kernel_id, timeout=120) as tab:
            assert tab.execute("x = 41; print('ok')", timeout=120).stdout.strip() == "ok"
            for n in range(2):
                hibernate(gateway, release, kernel_id)
                # The next cell on the open websocket resumes the kernel in a new pod.
                result = tab.execute("x += 1; print(x)", timeout=120)
                assert result.error == "", result.error
                assert result.stdout.strip() == str(42 + n)
                (pod,) = kernel_pods(release, kernel_id)
                assert pod.metadata.labels["app.kubernetes.io/component"] == "kernel"
                assert pod.metadata.labels["app.kubernetes.io/instance"] == RELEASE
        # The Deployment's probes, as the kubelet sends them (no token), answer on the real gateway.
        (container,) = apps.read_namespaced_deployment(RELEASE, namespace).spec.template.spec.containers
        for probe in (container.startup_probe, container.liveness_probe, container.readiness_probe):
            assert _get(gateway.url + probe.http_get.path, "")[0] == 200, probe.http_get.path
        # Three running kernels (the GPU size and two CPU kernels: the runner has one GPU), each with
        # what no checkpoint keeps: a half-used generator and a held lock.
        kernels = [kernel_id, gateway.start_kernel("python3-cpu"), gateway.start_kernel("python3-cpu")]
        pids = {
            k: gateway.execute(k, f"{UNPICKLABLE}; print(os.getpid())", timeout=120).strip() for k in kernels
        }
        pods = {k: kernel_pods(release, k)[0].metadata.uid for k in kernels}
    finally:
        # SIGTERM, as Kubernetes stops the old gateway pod on an upgrade: the kernel pods are left
        # running for the next gateway (ElasticKernels.hibernate_on_shutdown: false with pods).
        gateway.stop()
    assert gateway.process.returncode == 0, gateway.log()[-3000:]
    assert {k: [p.metadata.uid for p in kernel_pods(release, k)] for k in kernels} == {
        k: [uid] for k, uid in pods.items()
    }

    # helm upgrade with a changed setting that needs a restart: the Deployment's pod template changes
    # (the gateway restarts); the new gateway adopts the three pods, same processes.
    values = json.loads(json.dumps(release["values"]))
    values["kernels"]["launchTimeout"] = 61
    before = apps.read_namespaced_deployment(RELEASE, namespace).spec.template.metadata.annotations
    helm(
        "upgrade",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        *release["kubeconfig"],
        *values_args(values, tmp_path),
    )
    after = apps.read_namespaced_deployment(RELEASE, namespace).spec.template.metadata.annotations
    assert after["checksum/config"] != before["checksum/config"]
    # The scrape token (random at install, made by the template) is the same after the upgrade.
    assert release["core"].read_namespaced_secret(ref["name"], namespace).data[ref["key"]] == metrics_token
    assert (
        release["core"].read_namespaced_persistent_volume_claim(release["claim"], namespace).metadata.uid
        == claim_uid
    )

    gateway = start_gateway(tmp_path, kube_plane, kube_api, release, "after-upgrade")
    try:
        stored = json.loads((gateway.home / "jupyter_server_config.json").read_text())
        assert stored["ElasticKubernetesProvisioner"]["launch_timeout"] == 61
        wait_for(
            lambda: _get(gateway.url + "/api/elastic/readyz", "")[0] == 200, 120, "the gateway to be ready"
        )
        for k in kernels:
            assert gateway.get(f"/api/elastic/kernels/{k}")["state"] == "running"
            said = gateway.execute(k, "print(os.getpid(), next(g), lock.locked())", timeout=120).split()
            assert said == [pids[k], "1", "True"], said
            assert [p.metadata.uid for p in kernel_pods(release, k)] == [pods[k]]
        assert gateway.execute(kernel_id, "print(x)", timeout=120).strip() == "43"
        # helm upgrade with a live change (the idle timeout): the pod template is the same (no restart);
        # the live ConfigMap changes, and the running gateway applies its file once the kubelet has
        # copied it (here: the test does).
        generation = apps.read_namespaced_deployment(RELEASE, namespace).metadata.generation
        values["cull"] = {"idleTimeout": 1234}
        # And the GPU sizes: "whole" replaced by "solo"; whole's running kernel keeps working.
        values["gpu"] = {"profiles": {"solo": {"gpu_fraction": 1, "backend": "whole"}}}
        helm(
            "upgrade",
            RELEASE,
            str(CHART),
            "-n",
            namespace,
            *release["kubeconfig"],
            *values_args(values, tmp_path),
        )
        assert apps.read_namespaced_deployment(RELEASE, namespace).metadata.generation == generation
        live_file(gateway.home).write_text(read_live(kube_api, namespace))
        wait_for(lambda: gateway.get("/api/elastic/policy")["idle_timeout"] == 1234, 60, "the live change")
        offered = set(gateway.get("/api/kernelspecs")["kernelspecs"])
        assert "python3-gpu-solo" in offered and SIZE not in offered, offered
        assert gateway.request("POST", "/api/kernels", {"name": SIZE}).status == 404
        said = gateway.execute(kernel_id, "print(os.getpid(), next(g))", timeout=120).split()
        assert said == [pids[kernel_id], "2"], said
        for k in kernels:
            gateway.shutdown_kernel(k)
    finally:
        gateway.stop()

    # Uninstalling keeps the checkpoint claim (helm.sh/resource-policy: keep).
    helm("uninstall", RELEASE, "-n", namespace, *release["kubeconfig"])
    assert (
        release["core"].read_namespaced_persistent_volume_claim(release["claim"], namespace).metadata.uid
        == claim_uid
    )


@pytest.mark.timeout(600)
def test_uninstall_leaves_exactly_what_the_docs_say_and_their_command_removes_it(
    kube_plane: Any, kube_api: Any, kube_runner: Any, release: dict[str, Any], tmp_path: Path
) -> None:
    """Without the uninstall hook (the fixture's values), a kernel still running when the gateway goes
    outlives ``helm uninstall`` (its GPU held): the Uninstall section of docs/deploy-kubernetes.md
    names it, and its command removes it and its Secret, but not the Secrets and the claim kept on
    purpose."""
    from tests.support.kube import wait_for

    namespace, core = release["namespace"], release["core"]
    gateway = start_gateway(tmp_path, kube_plane, kube_api, release, "uninstall")
    try:
        kernel_id = gateway.start_kernel(SIZE)
        assert gateway.execute(kernel_id, "print('up')", timeout=120).strip() == "up"
    finally:
        gateway.process.kill()  # gone without hibernating anything (a crash, a forced delete)
        gateway.process.wait()
    helm("uninstall", RELEASE, "-n", namespace, *release["kubeconfig"])
    docs = (ROOT / "docs" / "deploy-kubernetes.md").read_text()
    section = docs[docs.index("## Uninstall") :]
    (selector,) = [
        line.split(" -l ")[1].strip("'")
        for line in section.splitlines()
        if line.startswith("kubectl") and "app.kubernetes.io/instance=jupyter-elastic-kernels" in line
    ]
    left = core.list_namespaced_pod(namespace, label_selector=selector).items
    assert [(p.metadata.name, p.status.phase) for p in left] == [(f"kernel-{kernel_id}", "Running")]
    secrets = core.list_namespaced_secret(namespace, label_selector=selector).items
    assert [s.metadata.name for s in secrets] == [f"kernel-{kernel_id}"]
    # kubectl delete pods,secrets -l <selector>, as the docs say.
    core.delete_collection_namespaced_pod(namespace, label_selector=selector, grace_period_seconds=0)
    core.delete_collection_namespaced_secret(namespace, label_selector=selector)
    wait_for(
        lambda: not core.list_namespaced_pod(namespace, label_selector=selector).items, 60, "no kernel pod"
    )
    assert not core.list_namespaced_secret(namespace, label_selector=selector).items
    # Kept on purpose: the claim and the master secret the checkpoints need.
    assert (
        core.read_namespaced_persistent_volume_claim(release["claim"], namespace).metadata.deletion_timestamp
        is None
    )
    core.read_namespaced_secret(f"{RELEASE}-checkpoint-secret", namespace)


UNINSTALL_JOB = f"{RELEASE}-uninstall"
GATEWAY_FINALIZER = "elastic.test/gateway-process"


def _pod(name: str, labels: dict[str, str], **metadata: Any) -> dict[str, Any]:
    """A pod nobody runs (no node matches), allowed by the restricted Pod Security profile."""
    return {
        "metadata": {"name": name, "labels": labels, **metadata},
        "spec": {
            "nodeSelector": NOWHERE,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "c",
                    "image": "python:3.12",
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("hibernating", [True, False], ids=["hibernate-keep-records", "stop-delete-all"])
def test_uninstall_hook_hibernates_or_stops_every_kernel_and_removes_what_the_gateway_made(
    kube_plane: Any,
    kube_api: Any,
    kube_runner: Any,
    release: dict[str, Any],
    tmp_path: Path,
    hibernating: bool,
) -> None:
    """``helm uninstall`` runs the chart's pre-delete hook Job (its own ServiceAccount and Roles) while
    the gateway serves. With the gateway's token it hibernates the running kernels through the gateway
    and keeps their records (the default uninstallHook.keepHibernated); without one it stops them.
    It stops the gateway, deletes every kernel pod and Secret of the release (a kept failed pod's
    too) and the other records, and its log says what it did and exactly what it leaves (the kept
    claim and master secret, the kept records). The API server then holds nothing else of them."""
    from urllib.parse import urlsplit

    from kubernetes import client

    from kernelmgr.kube.records import COMPONENT_LABEL, REGISTRY_LABEL, STATE_LABEL
    from kernelmgr.server.sessions import server_identity
    from tests.support.server import TOKEN

    namespace, core = release["namespace"], release["core"]
    apps = client.AppsV1Api(kube_api)
    selector = (
        f"app.kubernetes.io/name=jupyter-elastic-kernels,app.kubernetes.io/instance={RELEASE},"
        "app.kubernetes.io/component in (kernel,warm-kernel,kernel-failed)"
    )
    records = (
        f"{COMPONENT_LABEL}=kernel-record,{REGISTRY_LABEL}={server_identity(str(release['checkpoints']))}"
    )
    common = {"app.kubernetes.io/name": "jupyter-elastic-kernels", "app.kubernetes.io/instance": RELEASE}
    # The gateway's static token (auth: token), which the hook takes as an admin's to hibernate.
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "gateway-token"}, "stringData": {"token": TOKEN}}
    )
    gateway = start_gateway(tmp_path, kube_plane, kube_api, release, "uninstall")
    # The gateway runs here, not in its (pending) pod: a pod with its labels stands for its process,
    # ending (its finalizer removed) only once the process has ended, as the real pod would.
    standin = f"gateway-process-{uuid.uuid4().hex[:6]}"
    core.create_namespaced_pod(
        namespace,
        _pod(
            standin,
            {**common, "app.kubernetes.io/component": "gateway", "elastic.test/standin": "true"},
            finalizers=[GATEWAY_FINALIZER],
        ),
    )
    stopped, done = threading.Event(), threading.Event()

    def kubelet() -> None:
        """As the kubelet would: scaled to 0, the gateway gets SIGTERM; its pod ends when it has."""
        while not done.wait(0.5):
            if apps.read_namespaced_deployment(RELEASE, namespace).spec.replicas == 0:
                gateway.stop()
                stopped.set()
                return

    def release_standin() -> None:
        with contextlib.suppress(client.ApiException):
            core.patch_namespaced_pod(standin, namespace, {"metadata": {"finalizers": None}})
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_pod(standin, namespace, grace_period_seconds=0)

    try:
        kernels = [
            gateway.start_kernel(SIZE),
            gateway.start_kernel("python3-cpu"),
            gateway.start_kernel("python3-cpu"),
        ]
        for n, k in enumerate(kernels):
            assert gateway.execute(k, f"x = {n}; print('up')", timeout=120).strip() == "up"
        hibernate(gateway, release, kernels[2])  # one hibernated before the uninstall
        # A kept failed pod of the release (no kernel of the gateway's any more) and its Secret.
        failed = f"kernel-failed-{uuid.uuid4().hex[:6]}"
        labels = {**common, "app.kubernetes.io/component": "kernel-failed"}
        core.create_namespaced_secret(namespace, {"metadata": {"name": failed, "labels": labels}})
        core.create_namespaced_pod(namespace, _pod(failed, labels))
        assert len(core.list_namespaced_pod(namespace, label_selector=selector).items) == 3
        assert len(core.list_namespaced_config_map(namespace, label_selector=records).items) == 3

        # The hook's pod runs on the runner (a local process): it reaches the API server as a pod
        # does (KUBERNETES_SERVICE_HOST, its ServiceAccount's token) and the gateway at its address.
        api = urlsplit(kube_plane.server)
        values = json.loads(json.dumps(release["values"]))
        if hibernating:
            values["gateway"]["tokenSecret"] = "gateway-token"
        values["uninstallHook"] = {
            "enabled": True,
            "nodeSelector": {"elastic.test/node-runner": "true"},
            "gatewayUrl": gateway.url,
            "deadline": 200,
            "extraEnv": [
                {"name": "KUBERNETES_SERVICE_HOST", "value": api.hostname},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(api.port)},
            ],
        }
        if not hibernating:
            values["uninstallHook"]["keepHibernated"] = False
        helm(
            "upgrade",
            RELEASE,
            str(CHART),
            "-n",
            namespace,
            *release["kubeconfig"],
            *values_args(values, tmp_path),
        )

        def kubelet_then_standin() -> None:
            kubelet()
            if stopped.is_set():
                release_standin()

        threading.Thread(target=kubelet_then_standin, daemon=True).start()
        uninstalled = helm(
            "uninstall", RELEASE, "-n", namespace, *release["kubeconfig"], check=False, timeout=400
        )
        assert uninstalled.returncode == 0, (uninstalled.stdout, uninstalled.stderr)
    finally:
        done.set()
        if not stopped.is_set():
            gateway.stop()
        release_standin()

    # What the API server still holds of the gateway's objects.
    left = [
        f"{kind} {item.metadata.name}"
        for kind, items in (
            ("pod", core.list_namespaced_pod(namespace, label_selector=selector).items),
            ("secret", core.list_namespaced_secret(namespace, label_selector=selector).items),
            ("record", core.list_namespaced_config_map(namespace, label_selector=records).items),
        )
        for item in items
    ]
    (pod,) = core.list_namespaced_pod(namespace, label_selector=f"job-name={UNINSTALL_JOB}").items
    said = kube_runner.pod(namespace, pod.metadata.name).log_path.read_text()
    print(said)  # the hook's report, as `kubectl logs job/<release>-uninstall` shows it
    assert stopped.is_set(), said
    assert f"stopped the gateway: Deployment {namespace}/{RELEASE} scaled to 0" in said, said
    assert f"uninstall: deleted pod {namespace}/{failed}" in said, said
    assert f"uninstall: deleted secret {namespace}/{failed}" in said, said
    if hibernating:
        # Every kernel hibernated; their records kept (the checkpoints' index) and said to be left.
        assert sorted(left) == sorted(f"record elastic-kernel-{k}" for k in kernels), said
        for item in core.list_namespaced_config_map(namespace, label_selector=records).items:
            assert item.metadata.labels[STATE_LABEL] == "hibernated", item.metadata
        for k in kernels[:2]:
            assert f"uninstall: hibernated kernel {k} (owner " in said, said
        assert f"uninstall: kernel {kernels[2]} (owner " in said and "was already hibernated" in said, said
        for k in kernels:
            assert (
                f"left: kernel record ConfigMap {namespace}/elastic-kernel-{k} (hibernated kernel {k}" in said
            )
        assert "not hibernated" not in said, said
    else:
        # No token: the running kernels stopped (named), every record deleted; nothing left.
        assert left == [], said
        assert "no gateway token (uninstallHook.gatewayTokenSecret)" in said, said
        for k in kernels[:2]:
            assert f"uninstall: stopping kernel {k}: not hibernated, its variables are lost" in said, said
            assert f"uninstall: deleted pod {namespace}/kernel-{k}" in said, said
        for k in kernels:
            assert f"uninstall: deleted kernel record ConfigMap {namespace}/elastic-kernel-{k}" in said, said
    assert f"left: PersistentVolumeClaim {namespace}/{release['claim']} (the checkpoints; kept" in said, said
    assert f"left: Secret {namespace}/{RELEASE}-checkpoint-secret" in said, said
    # Its own rights went with it (hook-succeeded); the Job stays for its log.
    with pytest.raises(client.ApiException) as gone:
        core.read_namespaced_service_account(UNINSTALL_JOB, namespace)
    assert gone.value.status == 404
    assert client.BatchV1Api(kube_api).read_namespaced_job(UNINSTALL_JOB, namespace).status.succeeded == 1
    # Kept on purpose: the claim and the master secret the checkpoints need.
    assert (
        core.read_namespaced_persistent_volume_claim(release["claim"], namespace).metadata.deletion_timestamp
        is None
    )
    core.read_namespaced_secret(f"{RELEASE}-checkpoint-secret", namespace)


@pytest.mark.timeout(600)
def test_helm_test_hook_passes_when_the_gateway_answers_and_names_what_does_not(
    kube_plane: Any, kube_api: Any, kube_runner: Any, release: dict[str, Any], tmp_path: Path
) -> None:
    """``helm test`` runs the chart's hook pod (on the node runner, from the gateway's command line)."""
    namespace = release["namespace"]
    gateway = start_gateway(tmp_path, kube_plane, kube_api, release, "hook")
    hook = f"{RELEASE}-test-gateway"

    def upgrade_then_test(changes: dict[str, Any]) -> tuple[subprocess.CompletedProcess[str], str]:
        values = json.loads(json.dumps(release["values"]))
        # The gateway runs here, not as a pod; its test pod runs on the runner and reaches it on
        # 127.0.0.1 (the runner's pods are local processes with no cluster DNS).
        values["gateway"].update({"replicas": 0, "nodeSelector": {"elastic.test/node-runner": "true"}})
        values["tests"] = {"gatewayUrl": gateway.url}
        for key, value in changes.items():
            values.setdefault(key, {}).update(value)
        upgrade = ["upgrade", RELEASE, str(CHART), "-n", namespace, *release["kubeconfig"]]
        helm(*upgrade, *values_args(values, tmp_path))
        tested = helm(
            "test",
            RELEASE,
            "-n",
            namespace,
            "--timeout",
            "300s",
            *release["kubeconfig"],
            check=False,
            timeout=360,
        )
        running = kube_runner.pod(namespace, hook)
        assert running is not None, (tested.stdout, tested.stderr)
        image = kube_runner.pod(namespace, f"{RELEASE}-test-kernel-image")
        said = running.log_path.read_text()
        return tested, said + ("" if image is None else image.log_path.read_text())

    try:
        tested, said = upgrade_then_test({})
        assert tested.returncode == 0, said + tested.stderr
        assert f"the gateway answers at {gateway.url}/api version" in said, said
        # The kernel image's check (the runner runs this checkout) asked the gateway its version.
        assert f"gateway handshake: gateway {__version__} accepts this agent" in said, said
        # The pod stays for `kubectl logs` until the next test run replaces it.
        assert release["core"].read_namespaced_pod(hook, namespace).status.phase == "Succeeded"
        # A Hub the gateway cannot reach (z2jh's policy without the label, a wrong apiUrl) fails the test
        # with its URL; so does a gateway URL that answers 404 (here: the Hub service's base_url).
        from tests.support.server import free_port

        hub = f"http://127.0.0.1:{free_port()}/hub/api"
        tested, said = upgrade_then_test({"gateway": {"auth": "jupyterhub"}, "jupyterhub": {"apiUrl": hub}})
        assert tested.returncode != 0, (tested.stdout, said)
        assert f"the Hub API (jupyterhub.apiUrl) at {hub} does not answer" in said, said
        assert f"the gateway at {gateway.url}/services/elastic-gateway/api answered HTTP 404" in said, said
    finally:
        gateway.stop()


def test_z2jh_example_points_at_the_charts_gateway(tmp_path: Path) -> None:
    """examples/jupyterhub/z2jh/values.yaml names the chart's Service, port, Hub service and real classes."""
    import importlib
    import re

    z2jh = yaml.safe_load((ROOT / "examples/jupyterhub/z2jh/values.yaml").read_text())
    docs = render({}, tmp_path)  # release "jupyter-elastic-kernels" in namespace "jupyter"
    service = only(docs, "Service")
    name, port = service["metadata"]["name"], service["spec"]["ports"][0]["port"]
    gateway_url = f"http://{name}.jupyter.svc.cluster.local:{port}"
    config = server_config(docs)
    (hub_service,) = z2jh["hub"]["services"]
    assert z2jh["hub"]["services"][hub_service]["url"] == gateway_url
    assert config["ServerApp"]["base_url"] == f"/services/{hub_service}/"
    assert z2jh["singleuser"]["extraEnv"]["JUPYTER_GATEWAY_URL"] == f"{gateway_url}/services/{hub_service}/"
    scope = f"access:services!service={hub_service}"
    # the user role as JupyterHub 5 reads it (extra_user_scopes is 6.0+), "self" kept
    assert z2jh["hub"]["loadRoles"]["user"]["scopes"][:2] == ["self", scope]
    assert scope in z2jh["hub"]["config"]["KubeSpawner"]["server_token_scopes"]
    client_config = z2jh["singleuser"]["extraFiles"]["elastic-gateway-client"]["stringData"]
    classes = re.findall(r'_class = "([\w.]+)"', client_config)
    assert {c.rpartition(".")[2] for c in classes} == {
        "ElasticGatewayMappingKernelManager",
        "ElasticGatewaySessionManager",
        "ElasticGatewayWebSocketConnection",
    }
    for dotted in classes:
        module, _, cls = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), cls), dotted
    # The example's single-user servers may reach the gateway pods the chart labels.
    gateway_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    (rule,) = z2jh["singleuser"]["networkPolicy"]["egress"]
    assert rule["to"][0]["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    assert rule["ports"][0]["port"] == port
    # Idle servers are stopped, never their users removed (kernels stay at the gateway).
    assert z2jh["cull"]["users"] is False


def test_the_z2jh_gateway_values_give_kernel_pods_the_users_home(tmp_path: Path) -> None:
    """examples/jupyterhub/z2jh/gateway-values.yaml passes the chart's schema and gives each owner's
    kernel pods their z2jh home (claim-{owner}, HOME there, pinned beside their server's pod)."""
    values = yaml.safe_load((ROOT / "examples/jupyterhub/z2jh/gateway-values.yaml").read_text())
    provisioner = server_config(render(values, tmp_path))["ElasticKubernetesProvisioner"]
    (home,) = provisioner["user_volumes"]
    assert (home["claimName"], home["mountPath"]) == ("claim-{owner}", "/home/jovyan")
    assert provisioner["home_volume"] == "home" and provisioner["home_access_mode"] == "ReadWriteOnce"
    assert provisioner["user_pod_selector"] == {
        "component": "singleuser-server",
        "hub.jupyter.org/username": "{owner}",
    }


def _leaves(values: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(values, dict) and values:
        for key, value in values.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip(".")


def test_chart_readme_lists_every_value_and_nothing_else() -> None:
    import re

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = set(re.findall(r"^\| `([A-Za-z.]+)` \|", (CHART / "README.md").read_text(), re.MULTILINE))
    leaves = set(_leaves(values))
    undocumented = {
        leaf for leaf in leaves if not any(leaf == d or leaf.startswith(d + ".") for d in documented)
    }
    assert not undocumented, f"values missing from the chart README: {sorted(undocumented)}"
    stale = {d for d in documented if not any(leaf == d or leaf.startswith(d + ".") for leaf in leaves)}
    assert not stale, f"the chart README documents values that do not exist: {sorted(stale)}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("release", ["per-user"], indirect=True)
def test_per_user_namespace_made_by_the_gateway_with_the_charts_rights(
    kube_plane: Any, kube_api: Any, kube_runner: Any, release: dict[str, Any], tmp_path: Path
) -> None:
    """The gateway, as the chart's ServiceAccount, creates the owner's namespace and binds itself there."""
    import getpass
    import threading

    from kubernetes import client

    from tests.support.kube import wait_for

    core = release["core"]
    template = f"{release['namespace']}-{{owner}}"
    user_namespace = namespace_for(template, getpass.getuser())
    claim = release["claim"]
    # The owner's namespace needs a checkpoint claim of the same name on the same storage (see the
    # chart README); on the runner that is the release claim's folder.
    user_folder = kube_runner.volumes_root / "pvc" / user_namespace / claim
    user_folder.parent.mkdir(parents=True)
    user_folder.symlink_to(release["checkpoints"])
    volume = f"{user_namespace}-checkpoints"
    gateway = start_gateway(tmp_path, kube_plane, kube_api, release, "per-user")
    started: dict[str, Any] = {}
    starter = threading.Thread(
        target=lambda: started.update(reply=gateway.request("POST", "/api/kernels", {"name": SIZE}))
    )
    try:
        starter.start()
        # The gateway made the namespace (Pod Security restricted) and its RoleBinding to itself.
        wait_for(
            lambda: user_namespace in [n.metadata.name for n in core.list_namespace().items],
            60,
            "the namespace",
        )
        labels = core.read_namespace(user_namespace).metadata.labels
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
        core.create_persistent_volume(
            {
                "metadata": {"name": volume},
                "spec": {
                    "capacity": {"storage": "100Gi"},
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "",
                    "hostPath": {"path": "/srv/elastic-checkpoints"},
                    "claimRef": {"namespace": user_namespace, "name": claim},
                },
            }
        )
        core.create_namespaced_persistent_volume_claim(
            user_namespace,
            {
                "metadata": {"name": claim},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "",
                    "volumeName": volume,
                    "resources": {"requests": {"storage": "100Gi"}},
                },
            },
        )
        starter.join(120)
        reply = started["reply"]
        assert reply.status == 201, (reply, gateway.log()[-3000:])
        kernel_id = reply.body["id"]
        (binding,) = (
            client.RbacAuthorizationV1Api(kube_api).list_namespaced_role_binding(user_namespace).items
        )
        assert binding.role_ref.name == f"{RELEASE}:kernel-pods"
        assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
            ("ServiceAccount", RELEASE, release["namespace"])
        ]
        # What the user's namespace grants the gateway holds no ConfigMaps and no Lease: those rights
        # (the kernel records, the Lease) are a Role in the release namespace only.
        from tests.support import rbac

        _kubeconfig, token = rbac.service_account_kubeconfig(
            kube_plane, kube_api, release["namespace"], RELEASE, tmp_path / "sa-check.kubeconfig"
        )
        for namespace, allowed in ((user_namespace, False), (release["namespace"], True)):
            for verb, group, resource in (
                ("list", "", "configmaps"),
                ("update", "coordination.k8s.io", "leases"),
            ):
                assert gateway_may(kube_plane, token, verb, group, resource, namespace) is allowed, (
                    verb,
                    resource,
                    namespace,
                )
        pods = core.list_namespaced_pod(user_namespace, label_selector=f"{KERNEL_ID_LABEL}={kernel_id}").items
        assert len(pods) == 1
        # The namespace the gateway made holds the chart's kernel NetworkPolicies (ingress from the
        # gateway only, default-deny egress with the allow-list), made before the kernel's pod.
        networking = client.NetworkingV1Api(kube_api)
        made = {
            p.metadata.name: kube_api.sanitize_for_serialization(p)
            for p in networking.list_namespaced_network_policy(user_namespace).items
        }
        assert set(made) == {f"{RELEASE}-kernel-pods", f"{RELEASE}-kernel-pods-egress"}
        for name, policy in made.items():
            assert (
                policy["metadata"]["creationTimestamp"]
                <= kube_api.sanitize_for_serialization(pods[0])["metadata"]["creationTimestamp"]
            ), name
        egress = made[f"{RELEASE}-kernel-pods-egress"]
        assert egress["spec"]["policyTypes"] == ["Egress"]
        assert not _egress_allows(egress, "169.254.169.254", 80)
        assert not _egress_allows(egress, "10.20.30.40", 5432)
        assert _egress_allows(egress, "151.101.0.223", 443)
        ingress_from = made[f"{RELEASE}-kernel-pods"]["spec"]["ingress"][0]["from"]
        assert ingress_from[0]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": release["namespace"]
        }
        assert gateway.execute(kernel_id, "y = 'kept'; print(y)", timeout=120).strip() == "kept"
        reply = gateway.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, (reply, gateway.log()[-3000:])
        assert (
            core.list_namespaced_pod(user_namespace, label_selector=f"{KERNEL_ID_LABEL}={kernel_id}").items
            == []
        )
        assert gateway.execute(kernel_id, "print(y)", timeout=120).strip() == "kept"
        gateway.shutdown_kernel(kernel_id)
    finally:
        gateway.stop()
        starter.join(1)
        for delete in (
            lambda: core.delete_namespace(user_namespace),
            lambda: core.delete_persistent_volume(volume),
        ):
            try:
                delete()
            except client.ApiException as exc:
                if exc.status != 404:
                    raise


def gateway_may(plane: Any, token: str, verb: str, group: str, resource: str, namespace: str) -> bool:
    """The authorizer's answer for the holder of ``token`` (a SelfSubjectAccessReview)."""
    from kubernetes import client

    with plane.api_client(token=token) as api:
        authorization: Any = client.AuthorizationV1Api(api)
        review = authorization.create_self_subject_access_review(
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {
                    "resourceAttributes": {
                        "verb": verb,
                        "group": group,
                        "resource": resource,
                        "namespace": namespace,
                    }
                },
            }
        )
        return bool(review.status.allowed)


def test_warm_pods_reach_the_provisioner_and_the_schema_checks_them(tmp_path: Path) -> None:
    from kernelmgr.kube.warm_pods import parse_warm_pods

    warm = {"whole": {"count": 2, "preload": ["torch"], "starts": True}}
    config = server_config(render({"kernels": {"warmPods": warm}}, tmp_path))
    assert config["ElasticKubernetesProvisioner"]["warm_pods"] == warm
    settings = parse_warm_pods(warm, list(config["ElasticKernels"]["profiles"]))
    assert settings["whole"].count == 2 and settings["whole"].preload == ("torch",)
    assert server_config(render({}, tmp_path))["ElasticKubernetesProvisioner"]["warm_pods"] == {}
    bad = values_args({"kernels": {"warmPods": {"whole": {"size": 1}}}}, tmp_path)
    refused = helm("template", "jupyter-elastic-kernels", str(CHART), *bad, check=False)
    assert refused.returncode != 0 and "size" in refused.stderr, refused.stderr


def test_failed_kernel_pods_are_kept_for_kubectl_logs_by_default(tmp_path: Path) -> None:
    from kernelmgr.kube.settings import KubeSettings

    config = server_config(render({}, tmp_path))["ElasticKubernetesProvisioner"]
    assert config["failed_pod_retention"] == KubeSettings().failed_pod_retention == 300
    off = server_config(render({"kernels": {"failedPodRetention": 0}}, tmp_path))[
        "ElasticKubernetesProvisioner"
    ]
    assert off["failed_pod_retention"] == 0


def test_the_file_system_store_is_encrypted_at_rest_under_a_secret_of_master_keys(tmp_path: Path) -> None:
    docs = render(
        {"checkpoints": {"encryptionSecret": "fs-keys", "encryptionKeys": ["new", "old"]}}, tmp_path
    )
    files = server_config(docs)["ElasticKernels"]["checkpoint_encryption_key_files"]
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "fs-keys"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert files == [f"{mount['mountPath']}/new", f"{mount['mountPath']}/old"] and mount["readOnly"]
    assert [item["key"] for item in volume["secret"]["items"]] == ["new", "old"]
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert all(
        not mount["mountPath"].startswith(m["mountPath"])
        for c in claims
        for m in pod["containers"][0]["volumeMounts"]
        if m["name"] == c["name"]
    )
    assert "checkpoint_encryption_key_files" not in server_config(render({}, tmp_path))["ElasticKernels"]
