"""The test control plane itself: a real API server with RBAC, the real scheduler placing pods on kwok's fake
GPU nodes, and the node runner running a pod's command as a process reachable on its own pod IP.

These are the foundations the Kubernetes provisioner's end-to-end tests stand on, so they must fail loudly
when the foundations move (a new Kubernetes release, a kwok stage that no longer matches, ...).
"""

from __future__ import annotations

import http.client
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import (
    GPU,
    HAMI_GPUCORES,
    HAMI_GPUMEM,
    ControlPlane,
    create_fake_gpu_nodes,
    create_local_volume,
    require_envtest,
    wait_for,
)

require_envtest(module_level=True)

from kubernetes import client, watch  # noqa: E402  (after the skip: a missing build should not cost an import)

from tests.support.kernel_ready import wait_for_kernel_info  # noqa: E402
from tests.support.node_runner import NodeRunner  # noqa: E402
from tests.support.server import process_alive  # noqa: E402

pytestmark = pytest.mark.timeout(180)
ON_RUNNER = {"elastic.test/node-runner": "true"}


@pytest.fixture(scope="module")
def core(kube_api: Any) -> Any:
    return client.CoreV1Api(kube_api)


@pytest.fixture
def namespace(kube_namespace: str) -> str:
    return kube_namespace


@pytest.fixture(scope="module")
def runner(kube_runner: NodeRunner) -> NodeRunner:
    return kube_runner


@pytest.fixture(scope="module")
def plane(kube_plane: ControlPlane) -> ControlPlane:
    return kube_plane


@pytest.fixture(scope="module")
def gpu_nodes(kube_api: Any) -> list[str]:
    """Two fake GPU nodes: 4 GPUs with HAMi's memory/cores resources, and an A100 split into MIG slices."""
    names = create_fake_gpu_nodes(kube_api, ["kwok-gpu-0"], gpus=4, gpumem_mib=4 * 40960, gpucores=400)
    names += create_fake_gpu_nodes(kube_api, ["kwok-mig-0"], gpus=0, mig={"1g.10gb": 7})
    return names


def _pod(name: str, *, resources: dict[str, str] | None = None, node_selector: dict[str, str] | None = None,
         command: list[str] | None = None, **spec: Any) -> dict[str, Any]:  # fmt: skip
    container: dict[str, Any] = {"name": "main", "image": "python:3.11-slim"}
    if resources:
        container["resources"] = {"limits": resources, "requests": resources}
    if command:
        container["command"] = command
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [container],
            "nodeSelector": node_selector or {},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            **spec,
        },
    }


# ---- the API server


def test_api_server_is_real_and_enforces_rbac(plane: ControlPlane, core: Any, namespace: str) -> None:
    version = client.VersionApi(core.api_client).get_code()
    assert version.git_version.startswith("v1."), version

    core.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
    token = core.create_namespaced_service_account_token(
        "nobody", namespace, {"spec": {"expirationSeconds": 600}}
    ).status.token
    with plane.api_client(token=token) as as_nobody:
        with pytest.raises(client.ApiException) as denied:
            client.CoreV1Api(as_nobody).list_namespaced_pod(namespace)
        assert denied.value.status == 403
        assert f"system:serviceaccount:{namespace}:nobody" in denied.value.body

        # Granting exactly "list pods" is enough: RBAC, not a permissive mode, decided the 403.
        rbac = client.RbacAuthorizationV1Api(core.api_client)
        rbac.create_namespaced_role(
            namespace,
            {
                "metadata": {"name": "pod-reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": "nobody-reads-pods"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
                "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}],
            },
        )
        wait_for(
            lambda: client.CoreV1Api(as_nobody).list_namespaced_pod(namespace) is not None, 10, "RBAC grant"
        )


def test_invalid_manifest_rejected_by_server(core: Any, namespace: str) -> None:
    bad = _pod("Bad_Name", resources={GPU: "1"})
    with pytest.raises(client.ApiException) as rejected:
        core.create_namespaced_pod(namespace, bad)
    assert rejected.value.status == 422


# ---- scheduling onto kwok's fake GPU nodes


def _wait_phase(core: Any, namespace: str, name: str, phase: str, timeout: float = 60) -> Any:
    """Wait for a pod's phase; on timeout say where the pod is stuck (conditions, container states)."""
    try:
        return wait_for(
            lambda: (p := core.read_namespaced_pod(name, namespace)) and p.status.phase == phase and p,
            timeout,
            f"pod {namespace}/{name} to be {phase}",
        )
    except TimeoutError as exc:
        status = core.read_namespaced_pod(name, namespace).status
        conditions = [(c.type, c.status, c.reason, c.message) for c in status.conditions or []]
        states = [c.state.to_dict() for c in status.container_statuses or []]
        raise TimeoutError(
            f"{exc}: phase {status.phase}, conditions {conditions}, containers {states}"
        ) from None


def test_scheduler_binds_gpu_pod_to_fake_node_and_kwok_runs_it(
    core: Any, namespace: str, gpu_nodes: list[str]
) -> None:
    core.create_namespaced_pod(
        namespace, _pod("one-gpu", resources={GPU: "1"}, node_selector={"type": "kwok"})
    )
    pod = _wait_phase(core, namespace, "one-gpu", "Running")
    assert pod.spec.node_name == "kwok-gpu-0"
    assert pod.status.pod_ip.startswith("10.244.")
    assert all(c.ready for c in pod.status.container_statuses)

    core.create_namespaced_pod(
        namespace,
        _pod(
            "hami-slice",
            resources={GPU: "1", HAMI_GPUMEM: "10240", HAMI_GPUCORES: "25"},
            node_selector={"type": "kwok"},
        ),
    )
    assert _wait_phase(core, namespace, "hami-slice", "Running").spec.node_name == "kwok-gpu-0"

    core.create_namespaced_pod(namespace, _pod("mig-slice", resources={"nvidia.com/mig-1g.10gb": "1"}))
    assert _wait_phase(core, namespace, "mig-slice", "Running").spec.node_name == "kwok-mig-0"

    # Deleting a pod on a kwok node completes (kwok plays the kubelet's part of graceful deletion).
    core.delete_namespaced_pod("one-gpu", namespace)
    wait_for(lambda: not _exists(core, namespace, "one-gpu"), 30, "pod one-gpu to be gone")


def test_pod_too_big_for_any_node_is_unschedulable_with_reason(
    core: Any, namespace: str, gpu_nodes: list[str]
) -> None:
    core.create_namespaced_pod(namespace, _pod("eight-gpus", resources={GPU: "8"}))

    def unschedulable() -> Any:
        pod = core.read_namespaced_pod("eight-gpus", namespace)
        for cond in pod.status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                return cond
        return None

    cond = wait_for(unschedulable, 60, "the Unschedulable condition")
    assert f"Insufficient {GPU}" in cond.message, cond.message
    assert core.read_namespaced_pod("eight-gpus", namespace).status.phase == "Pending"
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=eight-gpus").items
    assert any(e.reason == "FailedScheduling" and GPU in e.message for e in events)


def _exists(core: Any, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


# ---- the node runner: pods that really run


SERVER = textwrap.dedent(
    """
    import http.server, os, pathlib, socketserver

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            token = pathlib.Path(os.environ["TOKEN_FILE"]).read_text()
            env = os.environ
            body = f"{env['POD_NAME']} {env['POD_IP']} {env['GREETING']} {token}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    data = pathlib.Path(os.environ["DATA_DIR"])
    data.mkdir(parents=True, exist_ok=True)
    (data / "started").write_text(os.environ["POD_IP"])
    http.server.HTTPServer((os.environ["POD_IP"], 8080), Handler).serve_forever()
    """
)


def test_node_runner_runs_pod_as_process_on_its_own_ip(core: Any, namespace: str, runner: NodeRunner) -> None:
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}}
    )
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "settings"}, "data": {"greeting": "hello"}}
    )
    # Two pods on the same fixed port: each has its own loopback IP, as pods have their own network.
    names = ["web-a", "web-b"]
    for name in names:
        manifest = _pod(
            name,
            command=["python", "-c", SERVER],
            resources={GPU: "1"} if name == "web-a" else None,
            node_selector=ON_RUNNER,
            container={
                "env": [
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {
                        "name": "GREETING",
                        "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}},
                    },
                    {"name": "TOKEN_FILE", "value": "/etc/creds/token"},
                    {"name": "DATA_DIR", "value": "/data/$(POD_NAME)"},
                ],
                "volumeMounts": [
                    {"name": "creds", "mountPath": "/etc/creds", "readOnly": True},
                    {"name": "data", "mountPath": "/data"},
                ],
            },
            volumes=[
                {"name": "creds", "secret": {"secretName": "creds"}},
                {"name": "data", "emptyDir": {}},
            ],
        )
        if name == "web-b":
            # The runner's one GPU is taken by web-a: web-b asks for none, so it fits beside it.
            manifest["spec"]["containers"][0].pop("resources", None)
        core.create_namespaced_pod(namespace, manifest)

    ips = {}
    for name in names:
        pod = _wait_phase(core, namespace, name, "Running")
        assert pod.spec.node_name == runner.node_name
        assert pod.status.container_statuses[0].ready
        ips[name] = pod.status.pod_ip
    assert len(set(ips.values())) == 2 and all(ip.startswith("127.") for ip in ips.values())

    for name, ip in ips.items():
        body = wait_for(lambda ip=ip: _http_get(ip, 8080), 30, f"{name}'s server on {ip}:8080")
        assert body == f"{name} {ip} hello s3cret"
        data_dir = runner.pod(namespace, name).mounts["/data"]
        assert (data_dir / name / "started").read_text() == ip


def test_deleting_pod_stops_its_process(core: Any, namespace: str, runner: NodeRunner) -> None:
    # The process says when its SIGTERM handler is in place: "Running" only means it was started.
    script = (
        "import os, pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "pathlib.Path(os.environ['DATA_DIR'], 'handler-set').write_text('yes')\n"
        "time.sleep(600)\n"
    )
    core.create_namespaced_pod(
        namespace,
        _pod(
            "sleeper",
            command=["python", "-c", script],
            node_selector=ON_RUNNER,
            container={
                "env": [{"name": "DATA_DIR", "value": "/data"}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            },
            volumes=[{"name": "data", "emptyDir": {}}],
        ),
    )
    _wait_phase(core, namespace, "sleeper", "Running")
    running = runner.pod(namespace, "sleeper")
    assert running is not None and running.process is not None
    pid = running.process.pid
    handler_set = running.mounts["/data"] / "handler-set"
    wait_for(handler_set.exists, 60, "the sleeper's SIGTERM handler")
    assert process_alive(pid)

    core.delete_namespaced_pod("sleeper", namespace)
    wait_for(lambda: not _exists(core, namespace, "sleeper"), 30, "pod sleeper to be gone")
    # Exit code 0 comes only from the handler: a SIGKILL after the grace period would read -9.
    assert running.process.returncode == 0, "SIGTERM first: the process exits through its handler"
    assert not process_alive(pid)
    assert runner.pod(namespace, "sleeper") is None


def test_process_exit_is_reported_with_exit_code(core: Any, namespace: str, runner: NodeRunner) -> None:
    core.create_namespaced_pod(
        namespace,
        _pod("fails", command=["python", "-c", "raise SystemExit(3)"], node_selector=ON_RUNNER),
    )
    pod = _wait_phase(core, namespace, "fails", "Failed")
    terminated = pod.status.container_statuses[0].state.terminated
    assert terminated.exit_code == 3 and terminated.reason == "Error"


def test_persistent_claim_folder_outlives_the_pod(
    core: Any, namespace: str, runner: NodeRunner, tmp_path: Path
) -> None:
    create_local_volume(core.api_client, f"pv-{namespace}", tmp_path, storage_class="manual")
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "metadata": {"name": "ckpt"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "manual",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    volume = [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}]
    mount = {"volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt", "subPath": "alice"}]}
    write = "import pathlib; pathlib.Path('/ckpt/state').write_text('kept')"
    read = "import pathlib; assert pathlib.Path('/ckpt/state').read_text() == 'kept'"
    for name, code in (("writer", write), ("reader", read)):
        core.create_namespaced_pod(
            namespace,
            _pod(name, command=["python", "-c", code], node_selector=ON_RUNNER,
                 container=mount, volumes=volume),
        )  # fmt: skip
        _wait_phase(core, namespace, name, "Succeeded")


def _http_get(ip: str, port: int) -> str | None:
    try:
        conn = http.client.HTTPConnection(ip, port, timeout=2)
        conn.request("GET", "/")
        return conn.getresponse().read().decode()
    except (TimeoutError, OSError):
        return None


def test_unpullable_image_leaves_pod_waiting_with_an_event(
    core: Any, namespace: str, runner: NodeRunner
) -> None:
    manifest = _pod("no-image", command=["python", "-c", "pass"], node_selector=ON_RUNNER)
    manifest["spec"]["containers"][0]["image"] = "registry.invalid/missing:latest"
    core.create_namespaced_pod(namespace, manifest)

    def waiting_reason() -> str | None:
        statuses = core.read_namespaced_pod("no-image", namespace).status.container_statuses or []
        return statuses[0].state.waiting.reason if statuses and statuses[0].state.waiting else None

    assert wait_for(waiting_reason, 30, "the container to wait on its image") == "ErrImagePull"
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=no-image").items
    assert any(e.reason == "Failed" and "failed to pull image" in e.message for e in events)


def test_api_server_restart_with_expired_history_gets_410_and_everything_recovers(
    plane: ControlPlane, core: Any, namespace: str, runner: NodeRunner
) -> None:
    old = core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "marker"}}
    ).metadata.resource_version
    relists = runner.relists
    plane.expire_resource_versions()
    with pytest.raises(client.ApiException) as gone:
        for _ in watch.Watch().stream(
            core.list_namespaced_pod, namespace, resource_version=old, timeout_seconds=5
        ):
            pass
    assert gone.value.status == 410

    # The runner's watch went through the same 410 and re-listed; the scheduler reconnected: a new pod runs.
    code = "import time; time.sleep(600)"
    core.create_namespaced_pod(
        namespace, _pod("after-410", command=["python", "-c", code], node_selector=ON_RUNNER)
    )
    _wait_phase(core, namespace, "after-410", "Running")
    assert runner.relists > relists


def test_script_starts_an_independent_cluster_and_stops_it(tmp_path: Path, plane: ControlPlane) -> None:
    """``scripts/envtest.sh start|env|stop``: a second cluster beside the session's, in its own folder."""
    import json
    import subprocess

    from kubernetes import config

    from tests.support.kube import ENVTEST_SCRIPT

    state = tmp_path / "cluster"
    started = subprocess.run(
        ["bash", str(ENVTEST_SCRIPT), "start", str(state)], capture_output=True, text=True, timeout=150
    )
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        assert f"export KUBECONFIG={state / 'admin.kubeconfig'}" in started.stdout
        env = subprocess.run(["bash", str(ENVTEST_SCRIPT), "env", str(state)], capture_output=True, text=True)
        assert f"KUBECONFIG={state / 'admin.kubeconfig'}" in env.stdout

        with config.new_client_from_config(str(state / "admin.kubeconfig")) as other:
            names = {n.metadata.name for n in client.CoreV1Api(other).list_namespace().items}
            assert "default" in names
            assert other.configuration.host != plane.server
    finally:
        pids = (
            json.loads((state / "state.json").read_text())["pids"] if (state / "state.json").exists() else {}
        )
        subprocess.run(["bash", str(ENVTEST_SCRIPT), "stop", str(state)], capture_output=True, timeout=120)
    assert pids and not any(process_alive(pid) for pid in pids.values())
    assert not (state / "state.json").exists()


def test_kernel_pod_executes_a_cell_on_its_pod_ip(core: Any, namespace: str, runner: NodeRunner) -> None:
    """What the Kubernetes provisioner does: ipykernel in a pod, connection info from a Secret, the kernel
    bound to its pod IP with fixed ports (``kernelmgr.kube.pod_kernel``), a client connecting from outside."""
    import json

    from jupyter_client import BlockingKernelClient

    ports = {
        "shell_port": 51001,
        "iopub_port": 51002,
        "stdin_port": 51003,
        "control_port": 51004,
        "hb_port": 51005,
    }
    connection = {**ports, "ip": "0.0.0.0", "key": uuid.uuid4().hex, "transport": "tcp"}
    connection["signature_scheme"] = "hmac-sha256"
    core.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "kernel-conn"}, "stringData": {"kernel.json": json.dumps(connection)}},
    )
    manifest = _pod(
        "kernel",
        # ipykernel takes its address from the file: the project's entry point puts the pod IP in.
        command=["python", "-m", "kernelmgr.kube.pod_kernel", "-f", "/conn/kernel.json"],
        node_selector=ON_RUNNER,
        container={
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "volumeMounts": [{"name": "conn", "mountPath": "/conn"}],
        },
        volumes=[{"name": "conn", "secret": {"secretName": "kernel-conn"}}],
    )
    core.create_namespaced_pod(namespace, manifest)
    pod_ip = _wait_phase(core, namespace, "kernel", "Running").status.pod_ip

    kc = BlockingKernelClient()
    kc.load_connection_info({**connection, "ip": pod_ip})
    kc.start_channels()
    try:
        wait_for_kernel_info(kc, lambda: None, 120)
        printed: list[str] = []

        def collect(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])

        code = "import os; print(os.environ['POD_IP'], 6 * 7)"
        reply = kc.execute_interactive(code, timeout=30, output_hook=collect)
        assert reply["content"]["status"] == "ok"
        assert "".join(printed).strip() == f"{pod_ip} 42"
    finally:
        kc.stop_channels()
