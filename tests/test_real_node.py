"""Kernel pods on a real node: kubelet + containerd + runc + CNI, beside the kwok nodes (issue 27).

The node (:mod:`tests.support.node`, ``scripts/node.sh``) registers with the session's real control
plane; the kernel image (``scripts/images.sh``) is imported into its containerd as a pull would leave
it. A plain pod from the image answers on its pod IP from the host; and a real jupyter_server with the
project's Kubernetes provisioner starts a kernel pod there (read-only root, uid 1000, the connection
Secret mounted, ipykernel on the pod IP) and runs a cell in it through the websocket, as a notebook
does.

Needs root, the Debian packages and ``scripts/node.sh build``: skipped without them, failed instead
with ``ELASTIC_REQUIRE_NODE=1`` (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelmgr import __version__
from kernelmgr.checkpoint.version import KERNEL_INFO_KEY
from tests.support.kube import ControlPlane, free_port, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from tests.support.containerd import require_node_tools  # noqa: E402
from tests.support.node import HOW, LABEL, TAINT, Node, pod_tolerating_the_node, require_node  # noqa: E402
from tests.support.server import TOKEN, RunningServer, start_server  # noqa: E402
from tests.test_images import images_script  # noqa: E402

pytestmark = pytest.mark.timeout(900)
NAMESPACE = "elastic-real-node"
SERVE_VERSION = (
    "import http.server, kernelmgr\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = ('kernelmgr ' + kernelmgr.__version__).encode()\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "http.server.HTTPServer(('0.0.0.0', 8080), H).serve_forever()\n"
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local registry (Debian's docker-registry, plain HTTP on 127.0.0.1), as scripts/images.sh runs it."""
    require_node()
    require_node_tools(("docker-registry", "skopeo"), what="the local registry", how=HOW)
    directory = tmp_path_factory.mktemp("registry")
    try:
        yield images_script("registry-start", str(directory), str(free_port())).strip()
    finally:
        images_script("registry-stop", str(directory))


@pytest.fixture(scope="module")
def node(kube_plane: ControlPlane, registry: str) -> Iterator[Node]:
    paths = require_node()
    directory = Path(f"/tmp/ekn-{os.getpid()}")  # short: shim sockets and mount options are length-limited
    try:
        with Node(directory, kube_plane.admin_kubeconfig, paths=paths, registry=registry) as running:
            yield running
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel_image(node: Node) -> str:
    archive = Path(images_script("export").split()[0])
    names = node.import_image(archive)
    assert names, "the archive brought no image name"
    return names[0]


@pytest.fixture(scope="module")
def core(kube_api: Any) -> Iterator[Any]:
    api = client.CoreV1Api(kube_api)
    api.create_namespace({"metadata": {"name": NAMESPACE}})
    wait_for(lambda: api.read_namespaced_service_account("default", NAMESPACE), 60, "default ServiceAccount")
    yield api
    api.delete_namespace(NAMESPACE)


def running_pod(core: Any, name: str, timeout: float = 300) -> Any:
    def running() -> Any:
        pod = core.read_namespaced_pod(name, NAMESPACE)
        if pod.status.phase in ("Failed", "Succeeded"):
            raise AssertionError(f"pod {name} ended: {pod.status}")
        return pod if pod.status.phase == "Running" and pod.status.pod_ip else None

    try:
        return wait_for(running, timeout, f"pod {name} to run")
    except TimeoutError as exc:
        events = core.list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={name}").items
        said = "; ".join(f"{e.reason}: {e.message}" for e in events)
        raise AssertionError(f"{exc}; its events: {said}") from None


def test_the_node_is_real_and_kept_for_pods_that_ask(node: Node, core: Any) -> None:
    found = core.read_node(node.name)
    assert found.status.node_info.container_runtime_version.startswith("containerd://")
    assert found.status.node_info.kubelet_version.startswith("v1.36")
    assert found.metadata.labels[LABEL[0]] == LABEL[1]
    assert [t.key for t in found.spec.taints or []] == [TAINT["key"]]
    assert found.status.addresses[0].address == node.gateway_ip


def test_a_pod_from_the_kernel_image_answers_on_its_ip_from_the_host(
    node: Node, core: Any, kernel_image: str
) -> None:
    name = "serve-version"
    core.create_namespaced_pod(
        NAMESPACE, pod_tolerating_the_node(name, kernel_image, ["python", "-c", SERVE_VERSION])
    )
    try:
        pod = running_pod(core, name)
        assert pod.spec.node_name == node.name
        assert pod.status.pod_ip.startswith("10.88.")

        def answer() -> str:
            with urllib.request.urlopen(f"http://{pod.status.pod_ip}:8080/", timeout=5) as reply:
                return str(reply.read().decode())

        assert wait_for(answer, 60, "the pod's HTTP answer") == f"kernelmgr {__version__}"
        # The container's output reaches `kubectl logs` (the API server asks the kubelet).
        core.create_namespaced_pod(
            NAMESPACE,
            pod_tolerating_the_node(
                "says-hello", kernel_image, ["python", "-c", "print('hello from', 6 * 7)"]
            ),
        )
        wait_for(
            lambda: core.read_namespaced_pod("says-hello", NAMESPACE).status.phase == "Succeeded",
            300,
            "the pod to end",
        )
        assert core.read_namespaced_pod_log("says-hello", NAMESPACE) == "hello from 42\n"
    finally:
        for pod in core.list_namespaced_pod(NAMESPACE).items:
            core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the pods to be gone")


def server_config(kube_plane: ControlPlane, image: str) -> dict[str, Any]:
    return {
        "ElasticKernels": {
            "profiles": {"whole": {"gpu_fraction": 1}},
            "gpu_inventory": [{"uuid": "GPU-real-0000", "name": "Test A100", "memory_mib": 40960}],
            "reap_interval": 1,
            "kernel_provisioner": "elastic-kubernetes-provisioner",
            # The stop cleans the namespace for the next test (pod mode's default leaves pods running).
            "hibernate_on_shutdown": True,
        },
        "ElasticKubernetesProvisioner": {
            "namespace": NAMESPACE,
            "kubeconfig": str(kube_plane.admin_kubeconfig),
            "image": image,
            "node_selector": {LABEL[0]: LABEL[1]},
            "tolerations": [{**TAINT, "operator": "Equal"}],
            "run_as_user": 1000,
            "launch_timeout": 240.0,
        },
    }


@pytest.fixture
def server(
    node: Node, core: Any, kube_plane: ControlPlane, kernel_image: str, tmp_path: Path
) -> Iterator[RunningServer]:
    running = start_server(tmp_path, server_config(kube_plane, kernel_image))
    yield running
    running.stop()


def test_a_kernel_pod_started_by_the_provisioner_runs_a_cell_in_the_container(
    server: RunningServer, core: Any, node: Node
) -> None:
    # The node has no GPU: it advertises one as an extended resource (what a device plugin would do),
    # so the GPU size's pod is scheduled there; the kernel does not touch it.
    core.patch_node_status(node.name, {"status": {"capacity": {"nvidia.com/gpu": "1"}}})
    wait_for(
        lambda: core.read_node(node.name).status.allocatable.get("nvidia.com/gpu") == "1",
        60,
        "the GPU advertised",
    )
    specs = server.get("/api/kernelspecs")["kernelspecs"]
    size = next(name for name in specs if name.endswith("gpu-whole"))
    # The start waits for the pod to run (schedule, sandbox, container): longer than a request's 60 s
    # on a loaded machine, so with its own timeout, and what the cluster said when it fails.
    request = urllib.request.Request(
        f"{server.url}/api/kernels",
        data=json.dumps({"name": size}).encode(),
        method="POST",
        headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            kernel_id = json.loads(reply.read())["id"]
    except Exception as exc:
        events = [
            f"{e.involved_object.name} {e.reason}: {e.message}"
            for e in core.list_namespaced_event(NAMESPACE).items
        ]
        raise AssertionError(f"the start failed: {exc}\nevents: {events}\n{server.log()[-3000:]}") from None
    try:
        pods = [
            p
            for p in core.list_namespaced_pod(NAMESPACE).items
            if p.metadata.labels.get("elastic.jupyter.org/kernel-id") == kernel_id
        ]
        assert len(pods) == 1 and pods[0].spec.node_name == node.name
        with server.channel(kernel_id, timeout=300) as chan:
            info = chan.request("kernel_info_request", {})
            assert info["content"][KERNEL_INFO_KEY]["version"] == __version__
            result = chan.execute(
                "import os, sys, kernelmgr; print(sys.executable, os.getuid(), os.environ['POD_IP'], 6 * 7)",
                timeout=300,
            )
        assert not result.error, result.error
        executable, uid, pod_ip, answer = result.stdout.split()
        assert (executable, uid, answer) == ("/opt/elastic/bin/python", "1000", "42")
        assert pod_ip == core.read_namespaced_pod(pods[0].metadata.name, NAMESPACE).status.pod_ip
    finally:
        server.shutdown_kernel(kernel_id)
    wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the kernel pod to be gone")


def start_request(server: RunningServer, size: str) -> tuple[int, dict[str, Any]]:
    """POST /api/kernels with a long timeout (the start waits for the pod): status and JSON body."""
    import urllib.error

    request = urllib.request.Request(
        f"{server.url}/api/kernels",
        data=json.dumps({"name": size}).encode(),
        method="POST",
        headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_a_kernel_that_fails_at_import_says_why_in_the_start_error(
    node: Node, core: Any, kube_plane: ControlPlane, kernel_image: str, tmp_path: Path
) -> None:
    """The container's last log lines (its termination message) reach the user; the failed pod stays
    a while for ``kubectl logs`` (out of the kernels), then the server deletes it."""
    config = server_config(kube_plane, kernel_image)
    # As a kernel image without the package: the kernel's command fails at its first import.
    config["ElasticKubernetesProvisioner"]["command"] = ["python", "-c", "import kernelmgr_not_in_this_image"]
    config["ElasticKubernetesProvisioner"]["failed_pod_retention"] = 20
    server = start_server(tmp_path, config)
    try:
        specs = server.get("/api/kernelspecs")["kernelspecs"]
        # A CPU kernel (no GPU to advertise), as the node's own pods run it.
        status, body = start_request(server, next(name for name in specs if name.endswith("-cpu")))
        assert status >= 500, (status, body, server.log()[-3000:])
        message = body.get("message", "")
        assert "exited with code 1; its last output:" in message, (message, server.log()[-3000:])
        assert "ModuleNotFoundError: No module named 'kernelmgr_not_in_this_image'" in message, message
        (kept,) = core.list_namespaced_pod(NAMESPACE).items
        assert kept.metadata.labels["app.kubernetes.io/component"] == "kernel-failed", kept.metadata.labels
        logs = core.read_namespaced_pod_log(kept.metadata.name, NAMESPACE)  # kubectl logs
        assert "No module named 'kernelmgr_not_in_this_image'" in logs, logs
        assert all(not d["slices"] for d in server.get("/api/elastic/gpus")["devices"])
        wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the kept pod to be deleted")
    finally:
        server.stop()


# Before the registry test: containerd 1.6's CRI image cache forgets the imported name once the
# same image is pulled under another (the kubelet then tries to pull "localhost/...").
def test_a_kernel_pod_without_a_claim_hibernates_through_the_object_store_and_resumes(
    node: Node, core: Any, kube_plane: ControlPlane, kernel_image: str, tmp_path: Path
) -> None:
    """Issue 31 on real containers: the S3 server listens on the node's bridge address, which the
    pods reach through the CNI bridge; the GPU-size kernel pod mounts no claim, sends its checkpoint
    through presigned part URLs, and its next pod reads it back by presigned ranged GETs."""
    from tests.support.s3 import running_s3

    core.patch_node_status(node.name, {"status": {"capacity": {"nvidia.com/gpu": "1"}}})
    wait_for(
        lambda: core.read_node(node.name).status.allocatable.get("nvidia.com/gpu") == "1",
        60,
        "the GPU advertised",
    )
    with running_s3(tmp_path / "s3", host=node.gateway_ip) as s3:
        config = server_config(kube_plane, kernel_image)
        config["ElasticKernels"].update(
            {"checkpoint_store": "s3", "checkpoint_root": str(tmp_path / "scratch")}  # the server's own disk
        )
        config["ElasticKubernetesProvisioner"]["checkpoint_claim"] = ""
        config["S3Checkpoints"] = {
            "endpoint": s3.endpoint,
            "bucket": "real-node-checkpoints",
            "create_bucket": True,
            "access_key_id_env": "ELASTIC_TEST_S3_ACCESS_KEY",
            "secret_access_key_env": "ELASTIC_TEST_S3_SECRET_KEY",
        }
        env = {
            "ELASTIC_TEST_S3_ACCESS_KEY": s3.admin.access_key,
            "ELASTIC_TEST_S3_SECRET_KEY": s3.admin.secret_key,
        }
        server = start_server(tmp_path / "home", config, env_extra=env)
        kernel_id = ""
        try:
            specs = server.get("/api/kernelspecs")["kernelspecs"]
            status, body = start_request(server, next(name for name in specs if name.endswith("gpu-whole")))
            assert status == 201, (status, body, server.log()[-3000:])
            kernel_id = body["id"]
            (pod,) = core.list_namespaced_pod(NAMESPACE).items
            assert pod.spec.node_name == node.name
            assert all(v.persistent_volume_claim is None for v in pod.spec.volumes), pod.spec.volumes
            server.execute(kernel_id, "words = b'REAL-NODE-' * 50000\nfacts = {'answer': 42}", timeout=300)
            reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate", timeout=300)
            assert reply.status == 200, (reply, server.log()[-3000:])
            assert reply.body["state"] == "hibernated", reply.body
            wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the kernel pod to be gone")
            owner = reply.body["owner"]
            committed = (
                s3.bucket("real-node-checkpoints").get(f"{owner}/{kernel_id}/current") or b""
            ).decode()
            assert committed.strip() == reply.body["checkpoint"]["id"], (committed, reply.body)
            assert not list((tmp_path / "scratch").rglob("data.bin"))  # only in the bucket
            out = server.execute(kernel_id, "print(words[:10], len(words), facts['answer'])", timeout=300)
            assert out.strip() == "b'REAL-NODE-' 500000 42", (out, server.log()[-3000:])
            # Downloaded as the container started, into a memory file (the runtime's seccomp
            # profile allows memfd_create), nothing written to the node's disk.
            prefetch = server.get(f"/api/elastic/kernels/{kernel_id}/report")["restore_report"]["prefetch"]
            assert prefetch["in_child"] is True and prefetch["in_memory"] is True, prefetch
            (pod,) = core.list_namespaced_pod(NAMESPACE).items
            assert pod.spec.node_name == node.name
        finally:
            if kernel_id:
                server.shutdown_kernel(kernel_id)
            server.stop()
    wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the kernel pod to be gone")


def test_the_node_pulls_the_kernel_image_from_the_local_registry(
    node: Node, core: Any, registry: str
) -> None:
    archive = Path(images_script("export").split()[0])
    image = f"{registry}/jupyter-elastic-kernels-kernel:{__version__}"
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            f"oci-archive:{archive}",
            f"docker://{image}",
        ],
        check=True,
        timeout=600,
    )
    pod = pod_tolerating_the_node(
        "pulled", image, ["python", "-c", "import kernelmgr; print(kernelmgr.__version__)"]
    )
    pod["spec"]["containers"][0]["imagePullPolicy"] = "Always"
    core.create_namespaced_pod(NAMESPACE, pod)
    try:
        wait_for(
            lambda: core.read_namespaced_pod("pulled", NAMESPACE).status.phase == "Succeeded", 300, "the pod"
        )
        assert core.read_namespaced_pod_log("pulled", NAMESPACE) == f"{__version__}\n"
        reasons = [
            e.reason
            for e in core.list_namespaced_event(NAMESPACE, field_selector="involvedObject.name=pulled").items
        ]
        assert "Pulled" in reasons
    finally:
        core.delete_namespaced_pod("pulled", NAMESPACE, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the pod to be gone")
