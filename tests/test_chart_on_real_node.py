"""The Helm chart installed with its defaults on the real node: the gateway and its kernels in containers.

The images come from the local registry the node pulls from (``scripts/images.sh push``); the gateway pod
runs the gateway image with the chart's ServiceAccount and talks to the API server in-cluster; the kernel
pods run the kernel image; the checkpoint claim binds a hostPath volume on the node. Through the
gateway's REST API: a GPU-size kernel runs a cell, is hibernated (its pod gone) and resumed (the variable
back); ``helm upgrade`` restarts the gateway pod, and the kernel is still there after it.

The values override only what an admin must set (images) and what this test cluster forces, each with
its reason beside it. Needs root, the node and the images (as ``tests/test_real_node.py``): skipped
without them, failed with ``ELASTIC_REQUIRE_NODE=1``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelmgr import __version__
from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from tests.support.forward import Forwarder  # noqa: E402
from tests.support.node import LABEL, TAINT, Node  # noqa: E402
from tests.support.server import TOKEN, KernelChannel  # noqa: E402
from tests.test_helm_chart import CHART, helm  # noqa: E402
from tests.test_images import images_script  # noqa: E402
from tests.test_real_node import node, registry  # noqa: E402, F401

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]
RELEASE = "jupyter-elastic-kernels"
ON_THE_NODE = {
    "nodeSelector": {LABEL[0]: LABEL[1]},
    "tolerations": [{**TAINT, "operator": "Equal"}],
}


class Gateway:
    """The gateway pod's REST API at its pod IP (reachable from the host over the node's bridge)."""

    def __init__(self, ip: str) -> None:
        self.url = f"http://{ip}:8888"

    def request(self, method: str, path: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"token {TOKEN}")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as reply:
                raw = reply.read()
                return reply.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw) if raw else None
            except ValueError:
                return err.code, raw.decode(errors="replace")

    def execute(self, kernel_id: str, code: str) -> str:
        with KernelChannel(self.url, kernel_id, 300) as chan:
            result = chan.execute(code, timeout=300)
        assert not result.error, result.error
        return result.stdout


def gateway_pod(core: Any, namespace: str, not_uid: str | None = None) -> Any:
    """The gateway's pod once Running and Ready (a new one when ``not_uid`` names the old one)."""

    def ready() -> Any:
        pods = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=gateway").items
        for pod in pods:
            if pod.metadata.uid == not_uid or pod.metadata.deletion_timestamp is not None:
                continue
            conditions = {c.type: c.status for c in pod.status.conditions or []}
            if pod.status.phase == "Running" and conditions.get("Ready") == "True":
                return pod
        return None

    try:
        return wait_for(ready, 600, "the gateway pod to be Ready")
    except TimeoutError as exc:
        events = core.list_namespaced_event(namespace).items
        said = "\n".join(f"{e.involved_object.name} {e.reason}: {e.message}" for e in events[-30:])
        raise AssertionError(f"{exc}\nevents:\n{said}") from None


def gateway_log(core: Any, namespace: str, pod: Any) -> str:
    try:
        return str(core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=60))
    except client.ApiException as exc:
        return f"(no log: {exc.reason})"


@pytest.fixture
def pushed(registry: str) -> dict[str, str]:  # noqa: F811
    """The two images in the local registry, as an admin pushes them: {"kernel": ref, "gateway": ref}."""
    kernel, gateway = images_script("push", registry).split()
    return {"kernel": kernel, "gateway": gateway}


@pytest.fixture
def api_forward(node: Node, kube_plane: ControlPlane) -> Iterator[tuple[str, int]]:  # noqa: F811
    """The API server as pods reach it: the node's bridge address, the API server's port."""
    port = int(kube_plane.server.rsplit(":", 1)[1])
    forwarder = Forwarder((node.gateway_ip, port), ("127.0.0.1", port)).start()
    yield node.gateway_ip, port
    forwarder.stop()


def test_chart_defaults_on_the_real_node_start_hibernate_resume_and_upgrade(
    node: Node,  # noqa: F811
    kube_api: Any,
    pushed: dict[str, str],
    api_forward: tuple[str, int],
    kube_plane: ControlPlane,
    tmp_path: Path,
) -> None:
    core = client.CoreV1Api(kube_api)
    namespace = f"chart-{uuid.uuid4().hex[:6]}"
    claim = f"{RELEASE}-checkpoints"
    # The claim's storage: a folder on the node (uid 1000, group 100: the gateway's and kernels' user).
    storage = Path(f"/tmp/ekc-{os.getpid()}")
    storage.mkdir(mode=0o770)
    os.chown(storage, 1000, 100)
    volume = f"{namespace}-checkpoints"
    core.create_persistent_volume(
        {
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "100Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": str(storage), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
    )
    # The node has no GPU: it advertises one (what a device plugin would do) so a GPU size is placed.
    core.patch_node_status(node.name, {"status": {"capacity": {"nvidia.com/gpu": "1"}}})
    repository, _, tag = pushed["gateway"].rpartition(":")
    api_host, api_port = api_forward
    values: dict[str, Any] = {
        # What every admin sets: where the images are.
        "image": {"repository": repository, "tag": tag},
        # (The kernel image is the one beside it, <repository>-kernel:<tag>: the chart's default.)
        # Forced here: the real node is tainted so that only the pods that ask run there.
        "kernels": ON_THE_NODE,
        "gateway": {
            # Forced here: no JupyterHub in this cluster, so one static token (a Secret).
            "auth": "token",
            "tokenSecret": "gateway-token",
            **ON_THE_NODE,
            # Forced here: no kube-proxy routes the kubernetes Service's ClusterIP; the API server is
            # at the node's bridge address (tests/support/forward.py), which its certificate names.
            "extraEnv": [
                {"name": "KUBERNETES_SERVICE_HOST", "value": api_host},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
            ],
        },
    }
    kubeconfig = ["--kubeconfig", str(kube_plane.admin_kubeconfig)]
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "gateway-token"}, "data": {"token": base64.b64encode(TOKEN.encode()).decode()}},
    )
    kernel_id = None
    try:
        helm(
            "install", RELEASE, str(CHART), "-n", namespace, *kubeconfig, "-f", str(values_file), timeout=300
        )
        wait_for(
            lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound",
            120,
            "the checkpoint claim to bind",
        )
        pod = gateway_pod(core, namespace)
        assert pod.spec.node_name == node.name
        assert pod.spec.containers[0].image == pushed["gateway"]
        gateway = Gateway(pod.status.pod_ip)

        def answers() -> bool:
            try:
                return gateway.request("GET", "/api/status", timeout=10)[0] == 200
            except OSError:
                return False

        wait_for(answers, 300, "the gateway to answer")
        specs = gateway.request("GET", "/api/kernelspecs")[1]["kernelspecs"]
        size = next(name for name in specs if name.endswith("gpu-whole"))
        status, body = gateway.request("POST", "/api/kernels", {"name": size}, timeout=600)
        assert status == 201, (status, body, gateway_log(core, namespace, pod))
        kernel_id = body["id"]
        (kernel_pod,) = core.list_namespaced_pod(namespace, label_selector=f"kernel_id={kernel_id}").items
        assert kernel_pod.spec.node_name == node.name
        assert kernel_pod.spec.containers[0].image == pushed["kernel"]
        said = gateway.execute(
            kernel_id, "import kernelmgr, os; x = 41; print(kernelmgr.__version__, os.getuid())"
        )
        assert said.split() == [__version__, "1000"]

        # Hibernate: the checkpoint on the claim, the pod gone; the next cell resumes it in a new pod.
        status, body = gateway.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate", timeout=600)
        assert status == 200, (status, body, gateway_log(core, namespace, pod))
        assert core.list_namespaced_pod(namespace, label_selector=f"kernel_id={kernel_id}").items == []
        assert gateway.execute(kernel_id, "x += 1; print(x)").strip() == "42"

        # helm upgrade with a changed setting: the gateway pod is replaced (Recreate); the old one
        # hibernates the kernel at SIGTERM, the new one resumes it at the next cell.
        values["cull"] = {"idleTimeout": 1800}
        values_file.write_text(yaml.safe_dump(values))
        helm(
            "upgrade", RELEASE, str(CHART), "-n", namespace, *kubeconfig, "-f", str(values_file), timeout=300
        )
        new = gateway_pod(core, namespace, not_uid=pod.metadata.uid)
        gateway = Gateway(new.status.pod_ip)
        wait_for(answers, 300, "the upgraded gateway to answer")
        status, body = gateway.request("GET", f"/api/elastic/kernels/{kernel_id}")
        assert status == 200, (status, body, gateway_log(core, namespace, new))
        assert gateway.execute(kernel_id, "print(x)").strip() == "42"
        # helm test: its pod (the gateway's image, on the node) asks the gateway. Forced here: no cluster
        # DNS resolves the Service's name, so the test pod is given the gateway pod's address.
        values["tests"] = {"gatewayUrl": gateway.url}
        values_file.write_text(yaml.safe_dump(values))
        helm(
            "upgrade", RELEASE, str(CHART), "-n", namespace, *kubeconfig, "-f", str(values_file), timeout=300
        )
        tested = helm(
            "test", RELEASE, "-n", namespace, *kubeconfig, "--timeout", "600s", check=False, timeout=660
        )
        hook = f"{RELEASE}-test-gateway"
        said = core.read_namespaced_pod_log(hook, namespace)
        assert tested.returncode == 0, (tested.stdout, tested.stderr, said)
        assert f"the gateway answers at {gateway.url}/api version" in said, said
        assert core.read_namespaced_pod(hook, namespace).spec.node_name == node.name
        assert (
            core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=gateway")
            .items[0]
            .metadata.uid
            == new.metadata.uid
        )  # the test values changed no gateway setting
        status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
        assert status == 204
        kernel_id = None
    finally:
        helm("uninstall", RELEASE, "-n", namespace, *kubeconfig, "--wait", check=False, timeout=300)
        from tests.support import rbac

        rbac.delete(
            kube_api,
            [
                {"kind": kind, "metadata": {"name": f"{RELEASE}:{name}"}}
                for kind in ("ClusterRole", "ClusterRoleBinding")
                for name in ("kernel-pods", "nodes", "namespaces")
            ],
        )
        for pod in core.list_namespaced_pod(namespace).items:
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(namespace).items, 300, "the pods to be gone")
        core.delete_namespace(namespace)
        core.delete_persistent_volume(volume)
        shutil.rmtree(storage, ignore_errors=True)
