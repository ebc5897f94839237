"""The Helm chart installed with its defaults on the real node: the gateway and its kernels in containers.

The images come from the local registry the node pulls from (``scripts/images.sh push``); the gateway pod
runs the gateway image with the chart's ServiceAccount and talks to the API server in-cluster; the kernel
pods run the kernel image; the checkpoint claim binds a hostPath volume on the node. One install for the
module (installs are slow); through the gateway's REST API and websockets, as a notebook uses it:

- a GPU-size kernel runs a cell, is hibernated (its pod gone) and resumed (the variable back);
  ``helm upgrade`` with a live change (the idle timeout) keeps the gateway pod, which applies it once the
  kubelet updates its file; one that needs a restart replaces the gateway pod, and three running
  kernels are adopted by the new one, same processes (a generator and a held lock survive); ``helm test``;
- an interrupt reaches a cell running in the container (PID 1's signal handling), a restart gives a
  new pod and an empty namespace;
- five hibernate/resume cycles, each checked with the namespace oracle (``tests/support/oracle.py``);
- the kernel pod evicted (Eviction API) during a cell: the cell finishes, its output arrives, the
  kernel checkpoints at SIGTERM and resumes with what the cell made;
- the gateway pod deleted while kernels run: the new gateway pod adopts them in their pods (the busy one
  and the idle one), same kernel ids, same processes; the notebook reconnecting with its session while
  the cell runs gets the cell's output and reply;
- a cell spanning ``helm upgrade`` (a new gateway pod) that prints and ends while no gateway is
  there: the notebook reconnecting with its session gets its output and reply;
- a cell that runs its pod out of memory is answered at once with the cause and the limit;
- ``helm uninstall`` with the hook's admin token hibernates every running kernel (the hook's pod in a
  container on the node reads its token).

The values override only what an admin must set (images) and what this test cluster forces, each with
its reason beside it. Needs root, the node and the images (as ``tests/test_real_node.py``): skipped
without them, failed with ``ELASTIC_REQUIRE_NODE=1``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kernelmgr import __version__
from kernelmgr.kube.labels import KERNEL_ID_LABEL
from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from tests.support.node import LABEL, TAINT, Node  # noqa: E402
from tests.support.oracle import PLAIN_SETUP, Reference, check_same, cycle_cell, run_both  # noqa: E402
from tests.support.server import TOKEN, ExecResult, KernelChannel  # noqa: E402
from tests.test_cluster_network import PROBE, Namespace, probe  # noqa: E402
from tests.test_helm_chart import CHART, helm  # noqa: E402
from tests.test_images import images_script  # noqa: E402
from tests.test_real_node import node, registry  # noqa: E402, F401

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]
RELEASE = "jupyter-elastic-kernels"
ON_THE_NODE = {
    "nodeSelector": {LABEL[0]: LABEL[1]},
    "tolerations": [{**TAINT, "operator": "Equal"}],
}
#: Where a kernel pod sees its owner's folder of the checkpoint claim.
CLAIM_IN_KERNEL = "/var/lib/elastic/checkpoints"


#: What no checkpoint can keep: a half-used generator and a held lock (neither pickles).
UNPICKLABLE = "import os, threading; g = iter(range(10)); next(g); lock = threading.Lock(); lock.acquire()"


class Gateway:
    """The gateway's REST API at ``url`` (its Service's ClusterIP: kube-proxy routes it from the host)."""

    def __init__(self, url: str) -> None:
        self.url = url

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

    def answers(self) -> bool:
        try:
            return self.request("GET", "/api/status", timeout=10)[0] == 200
        except OSError:
            return False

    def channel(self, kernel_id: str, timeout: float = 300, session: str | None = None) -> KernelChannel:
        return KernelChannel(self.url, kernel_id, timeout, session=session)

    def execute(self, kernel_id: str, code: str, timeout: float = 300) -> str:
        with self.channel(kernel_id, timeout) as chan:
            result = chan.execute(code, timeout=timeout)
        assert not result.error, result.error
        return result.stdout

    def model(self, kernel_id: str) -> dict[str, Any]:
        status, body = self.request("GET", f"/api/elastic/kernels/{kernel_id}")
        assert status == 200, (status, body)
        return dict(body)


def gateway_pod(core: Any, namespace: str, not_uid: str | None = None) -> Any:
    """The gateway's pod that serves (Ready, with the serving label the Service selects), a new one
    when ``not_uid`` names the old one."""

    def ready() -> Any:
        selector = "app.kubernetes.io/component=gateway,elastic.jupyter.org/serving=true"
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
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


@dataclass
class Chart:
    """The release installed in its own namespace, and what the tests need to reach it."""

    core: Any
    namespace: str
    node: Node
    values: dict[str, Any]
    values_file: Path
    kubeconfig: list[str]
    #: The claim's folder on this machine (a hostPath PV).
    storage: Path
    images: dict[str, str]
    pod: Any = None

    def gateway(self, not_uid: str | None = None) -> Gateway:
        """The current gateway pod's API, once it answers (a new pod when ``not_uid`` names the old)."""
        self.pod = gateway_pod(self.core, self.namespace, not_uid)
        gateway = Gateway(self.service_url(dns=False))
        wait_for(gateway.answers, 300, "the gateway to answer")
        return gateway

    def service_url(self, dns: bool = True) -> str:
        """The gateway Service's URL: by its DNS name (as pods reach it) or its ClusterIP (this host)."""
        (service,) = self.core.list_namespaced_service(
            self.namespace, label_selector="app.kubernetes.io/component=gateway"
        ).items
        host = f"{service.metadata.name}.{self.namespace}.svc" if dns else service.spec.cluster_ip
        return f"http://{host}:{service.spec.ports[0].port}"

    def log(self) -> str:
        return gateway_log(self.core, self.namespace, self.pod)

    def wait_gone(self, old: Any) -> None:
        """Until the gateway pod ``old`` (replaced: deleted, or an upgrade) is gone from the API."""

        def gone() -> bool:
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector="app.kubernetes.io/component=gateway"
            ).items
            return old.metadata.uid not in {p.metadata.uid for p in pods}

        wait_for(gone, 600, "the old gateway pod to be gone")

    def start_kernel(self, gateway: Gateway, name: str = "") -> str:
        """A kernel of kernelspec ``name`` (empty: the GPU size)."""
        specs = gateway.request("GET", "/api/kernelspecs")[1]["kernelspecs"]
        size = name or next(name for name in specs if name.endswith("gpu-whole"))
        status, body = gateway.request("POST", "/api/kernels", {"name": size}, timeout=600)
        assert status == 201, (status, body, self.log())
        return str(body["id"])

    def kernel_pods(self, kernel_id: str) -> list[Any]:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{KERNEL_ID_LABEL}={kernel_id}"
        ).items
        return list(pods)

    def kernel_pod(self, kernel_id: str) -> Any:
        (pod,) = self.kernel_pods(kernel_id)
        return pod

    def hibernate(self, gateway: Gateway, kernel_id: str) -> None:
        """Hibernate through the REST API: the kernel's pod gone, its slice free."""
        status, body = gateway.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate", timeout=600)
        assert status == 200, (status, body, self.log())
        assert self.kernel_pods(kernel_id) == []
        devices = gateway.request("GET", "/api/elastic/gpus")[1]["devices"]
        assert all(not d["slices"] for d in devices), devices

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> Any:
        return helm(*args, "-n", self.namespace, *self.kubeconfig, check=check, timeout=timeout)

    def upgrade(self) -> None:
        self.values_file.write_text(yaml.safe_dump(self.values))
        self.helm("upgrade", RELEASE, str(CHART), "-f", str(self.values_file))


class ClaimGate:
    """A cell that holds until the test opens its gate: a file on the checkpoint claim (the kernel
    sees its owner's folder at ``CLAIM_IN_KERNEL``, this machine the PV's folder). The cell says it
    runs by leaving a file there first; no sleeps on the test's side."""

    def __init__(self, storage: Path) -> None:
        self.storage = storage
        self.token = uuid.uuid4().hex[:8]

    def cell(self, then: str) -> str:
        return (
            "import os, time\n"
            f"open('{CLAIM_IN_KERNEL}/running-{self.token}', 'w').close()\n"
            f"while not os.path.exists('{CLAIM_IN_KERNEL}/gate-{self.token}'):\n"
            "    time.sleep(0.1)\n"
            f"{then}\n"
        )

    def _running(self) -> Path | None:
        return next(self.storage.rglob(f"running-{self.token}"), None)

    def wait_running(self) -> None:
        wait_for(self._running, 300, "the gated cell to run")

    def open(self) -> None:
        running = self._running()
        assert running is not None
        (running.parent / f"gate-{self.token}").touch()


@pytest.fixture(scope="module")
def pushed(registry: str) -> dict[str, str]:  # noqa: F811
    """The two images in the local registry, as an admin pushes them: {"kernel": ref, "gateway": ref}."""
    kernel, gateway = images_script("push", registry).split()
    return {"kernel": kernel, "gateway": gateway}


@pytest.fixture(scope="module")
def chart(
    node: Node,  # noqa: F811
    kube_api: Any,
    pushed: dict[str, str],
    kube_plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Chart]:
    """The chart installed once for the module, with its defaults and what this cluster forces."""
    with installed_chart(kube_api, node, pushed, kube_plane, tmp_path_factory.mktemp("chart")) as c:
        yield c


@contextlib.contextmanager
def installed_chart(
    kube_api: Any,
    node: Node,  # noqa: F811
    pushed: dict[str, str],
    kube_plane: ControlPlane,
    tmp: Path,
    *,
    namespace: str = "",
    hub_api_url: str = "",
    extra_values: dict[str, Any] | None = None,
) -> Iterator[Chart]:
    """Install the chart on the real node (also for benchmarks/bench_real_node.py); uninstall after.

    With ``hub_api_url`` the gateway is a JupyterHub service (the chart's default auth) whose token
    is the Secret ``gateway-token``; otherwise that Secret holds its one static token."""
    core = client.CoreV1Api(kube_api)
    namespace = namespace or f"chart-{uuid.uuid4().hex[:6]}"
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
    # The node has no GPU: it advertises two (what a device plugin would do) so GPU sizes are placed.
    core.patch_node_status(node.name, {"status": {"capacity": {"nvidia.com/gpu": "2"}}})
    repository, _, tag = pushed["gateway"].rpartition(":")
    values: dict[str, Any] = {
        # What every admin sets: where the images are.
        "image": {"repository": repository, "tag": tag},
        # (The kernel image is the one beside it, <repository>-kernel:<tag>: the chart's default.)
        # Forced here: the real node is tainted so that only the pods that ask run there, and it has
        # 2 cores: two GPU kernels beside the gateway fit only with a smaller CPU request.
        "kernels": {**ON_THE_NODE, "resources": {"requests": {"cpu": "250m"}}},
        # This fixture's uninstall only cleans up (the hook is the module's last test).
        "uninstallHook": {"enabled": False},
        "gateway": {**ON_THE_NODE},
    }
    if hub_api_url:
        values["jupyterhub"] = {"apiUrl": hub_api_url, "apiTokenSecret": "gateway-token"}
    else:
        # Forced here: no JupyterHub in this test's cluster, so one static token (a Secret).
        values["gateway"].update({"auth": "token", "tokenSecret": "gateway-token"})
    for section, settings in (extra_values or {}).items():  # an example's values, under what is forced
        values[section] = {**settings, **values.get(section, {})}
    kubeconfig = ["--kubeconfig", str(kube_plane.admin_kubeconfig)]
    values_file = tmp / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "gateway-token"}, "data": {"token": base64.b64encode(TOKEN.encode()).decode()}},
    )
    installed = Chart(core, namespace, node, values, values_file, kubeconfig, storage, pushed)
    try:
        installed.helm("install", RELEASE, str(CHART), "-f", str(values_file))
        wait_for(
            lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound",
            120,
            "the checkpoint claim to bind",
        )
        yield installed
    finally:
        installed.helm("uninstall", RELEASE, "--wait", check=False)
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


def test_chart_defaults_on_the_real_node_start_hibernate_resume_and_upgrade(chart: Chart) -> None:
    core, namespace = chart.core, chart.namespace
    gateway = chart.gateway()
    pod = chart.pod
    assert pod.spec.node_name == chart.node.name
    assert pod.spec.containers[0].image == chart.images["gateway"]
    kernel_id = chart.start_kernel(gateway)
    kernel_pod = chart.kernel_pod(kernel_id)
    assert kernel_pod.spec.node_name == chart.node.name
    assert kernel_pod.spec.containers[0].image == chart.images["kernel"]
    said = gateway.execute(
        kernel_id, "import kernelmgr, os; x = 41; print(kernelmgr.__version__, os.getuid())"
    )
    assert said.split() == [__version__, "1000"]

    # Hibernate: the checkpoint on the claim, the pod gone; the next cell resumes it in a new pod.
    chart.hibernate(gateway, kernel_id)
    assert gateway.execute(kernel_id, "x += 1; print(x)").strip() == "42"

    # helm upgrade with a live change (the idle timeout): the same gateway pod applies it once the
    # kubelet has updated its copy of the live ConfigMap; no restart.
    chart.values["cull"] = {"idleTimeout": 1800}
    chart.upgrade()
    wait_for(
        lambda: gateway.request("GET", "/api/elastic/policy")[1]["idle_timeout"] == 1800,
        600,
        "the kubelet's update of the live ConfigMap to be applied",
    )
    gateways = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=gateway").items
    assert [p.metadata.uid for p in gateways] == [pod.metadata.uid]  # not restarted

    # helm upgrade with a setting that needs a restart, three kernels running (two GPU sizes and a CPU
    # kernel), each holding what no checkpoint keeps: the gateway pod is replaced (a surge: the new
    # one starts as a standby); the old one leaves the kernel pods running at SIGTERM and releases
    # the Lease, the new one takes it, adopts them (same processes) and labels itself serving.
    kernels = [kernel_id, chart.start_kernel(gateway), chart.start_kernel(gateway, "python3-cpu")]
    pids = {k: gateway.execute(k, f"{UNPICKLABLE}; print(os.getpid())").strip() for k in kernels}
    pods = {k: chart.kernel_pod(k).metadata.uid for k in kernels}
    chart.values["kernels"]["launchTimeout"] = 301
    chart.upgrade()
    gateway = chart.gateway(not_uid=pod.metadata.uid)
    new = chart.pod
    status, body = gateway.request("GET", f"/api/elastic/kernels/{kernel_id}")
    assert status == 200, (status, body, chart.log())
    for k in kernels:
        assert gateway.model(k)["state"] == "running", chart.log()
        assert chart.kernel_pod(k).metadata.uid == pods[k]
        said = gateway.execute(k, "print(os.getpid(), next(g), lock.locked())").split()
        assert said == [pids[k], "1", "True"], said
    assert gateway.execute(kernel_id, "print(x)").strip() == "42"
    for k in kernels[1:]:
        assert gateway.request("DELETE", f"/api/kernels/{k}", timeout=300)[0] == 204
    # helm test: its pod (the gateway's image, on the node) asks the gateway at its Service's DNS name.
    tested = chart.helm("test", RELEASE, "--timeout", "600s", check=False, timeout=660)
    hook = f"{RELEASE}-test-gateway"
    said = core.read_namespaced_pod_log(hook, namespace)
    assert tested.returncode == 0, (tested.stdout, tested.stderr, said)
    assert f"the gateway answers at {chart.service_url()}/api version" in said, said
    assert core.read_namespaced_pod(hook, namespace).spec.node_name == chart.node.name
    # The kernel image, where kernels run, checked against the running gateway's version.
    checked = core.read_namespaced_pod(f"{RELEASE}-test-kernel-image", namespace)
    assert checked.spec.containers[0].image == chart.images["kernel"]
    assert checked.spec.node_name == chart.node.name
    said = core.read_namespaced_pod_log(checked.metadata.name, namespace)
    assert f"gateway handshake: gateway {__version__} accepts this agent" in said, said
    assert "this image can run elastic kernels" in said, said
    assert (
        core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=gateway")
        .items[0]
        .metadata.uid
        == new.metadata.uid
    )  # the test values changed no gateway setting
    status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
    assert status == 204
    wait_for(lambda: not chart.kernel_pods(kernel_id), 120, "the kernel pod to be deleted")


def wait_stream(chan: KernelChannel, msg_id: str, text: str) -> None:
    """Read the channel until the cell ``msg_id`` has printed ``text`` (it is running)."""
    printed = ""
    while text not in printed:
        msg = chan.recv()
        if msg.get("parent_header", {}).get("msg_id") == msg_id and msg["msg_type"] == "stream":
            printed += msg["content"]["text"]


def test_interrupt_and_restart_a_kernel_in_its_container(chart: Chart) -> None:
    """The interrupt is an ``interrupt_request`` the kernel turns into SIGINT to itself, PID 1 of its
    container (where a signal without a handler is ignored); the restart deletes the pod and starts
    a new one, with an empty namespace and the same kernel id."""
    gateway = chart.gateway()
    kernel_id = chart.start_kernel(gateway)
    with gateway.channel(kernel_id) as chan:
        assert chan.execute("import os; x = 41; print(os.getpid())").stdout.strip() == "1"
        code = "import time\nprint('sleeping', flush=True)\nwhile True:\n    time.sleep(0.1)"
        msg_id = chan.send("execute_request", {"code": code, "silent": False, "store_history": True})
        wait_stream(chan, msg_id, "sleeping")
        status, body = gateway.request("POST", f"/api/kernels/{kernel_id}/interrupt")
        assert status == 204, (status, body)
        reply, _ = chan.collect(msg_id, 120)
        assert reply["content"]["status"] == "error", reply
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply
        assert chan.execute("print(x)").stdout.strip() == "41"  # the same process
    before = chart.kernel_pod(kernel_id).metadata.uid
    status, body = gateway.request("POST", f"/api/kernels/{kernel_id}/restart", timeout=600)
    assert status == 200, (status, body, chart.log())
    assert body["id"] == kernel_id
    (after,) = chart.kernel_pods(kernel_id)
    assert after.metadata.uid != before and after.status.phase == "Running"
    assert gateway.execute(kernel_id, "print('x' in globals())").strip() == "False"
    devices = gateway.request("GET", "/api/elastic/gpus")[1]["devices"]
    assert sum(len(d["slices"]) for d in devices) == 1, devices  # one slice, not one per pod
    status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
    assert status == 204
    wait_for(lambda: not chart.kernel_pods(kernel_id), 120, "the kernel pod to be deleted")


def test_five_hibernation_cycles_in_containers_keep_the_namespace(chart: Chart) -> None:
    """Each cycle: hibernate (pod deleted, slice free), then a cell that adds, changes and deletes
    names runs in a new pod and in a reference kernel never hibernated; the namespaces must match."""
    gateway = chart.gateway()
    kernel_id = chart.start_kernel(gateway)
    reference = Reference()
    try:
        run_both(gateway, kernel_id, reference, PLAIN_SETUP, timeout=300)
        check_same(gateway, kernel_id, reference, timeout=300)
        pods = {chart.kernel_pod(kernel_id).metadata.uid}
        # One websocket open through every cycle, as a notebook tab keeps it: it follows the kernel
        # to each new pod (a new IP).
        with gateway.channel(kernel_id) as tab:
            for n in range(1, 6):
                chart.hibernate(gateway, kernel_id)
                code = cycle_cell(n, plain=True)
                result = tab.execute(code, timeout=300)
                assert result.error == "", result.error
                reference.run(code)
                pods.add(chart.kernel_pod(kernel_id).metadata.uid)
                check_same(gateway, kernel_id, reference, timeout=300)
                assert gateway.model(kernel_id)["state"] == "running"
        assert len(pods) == 6  # a new container each time
    finally:
        reference.close()
    status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
    assert status == 204
    wait_for(lambda: not chart.kernel_pods(kernel_id), 120, "the kernel pod to be deleted")


def kubelet_stopping(chart: Chart, pod: Any) -> Any:
    """The kubelet's event that it is stopping ``pod``'s container (SIGTERM sent)."""
    events = chart.core.list_namespaced_event(
        chart.namespace, field_selector=f"involvedObject.uid={pod.metadata.uid}"
    ).items
    return next((e for e in events if e.reason == "Killing"), None)


def test_a_kernel_pod_evicted_during_a_cell_loses_nothing(chart: Chart) -> None:
    """``kubectl drain`` while a cell runs: the kubelet sends SIGTERM to the kernel (PID 1), which
    lets the cell finish within the pod's grace period, checkpoints on the claim and exits; the
    gateway hibernates the kernel from that checkpoint and the next cell resumes it."""
    gateway = chart.gateway()
    kernel_id = chart.start_kernel(gateway)
    gate = ClaimGate(chart.storage)
    with gateway.channel(kernel_id) as tab:
        assert tab.execute("x = 41; print(x)").stdout.strip() == "41"
        code = gate.cell("made = 'by the running cell'\nprint('cell done')")
        msg_id = tab.send("execute_request", {"code": code, "silent": False, "store_history": True})
        gate.wait_running()
        pod = chart.kernel_pod(kernel_id)
        eviction = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=pod.metadata.name, namespace=chart.namespace)
        )
        chart.core.create_namespaced_pod_eviction(pod.metadata.name, chart.namespace, eviction)
        wait_for(lambda: kubelet_stopping(chart, pod), 120, "the kubelet to stop the kernel's container")
        gate.open()
        reply, iopub = tab.collect(msg_id, 300)
        assert reply["content"]["status"] == "ok", reply
        printed = "".join(m["content"].get("text", "") for m in iopub if m["msg_type"] == "stream")
        assert "cell done" in printed
        current = wait_for(
            lambda: (m := gateway.model(kernel_id))["state"] == "hibernated" and m,
            300,
            "the evicted kernel to be hibernated",
        )
        assert {"x", "made"} <= set(current["checkpoint"]["saved"]), current
        devices = gateway.request("GET", "/api/elastic/gpus")[1]["devices"]
        assert all(not d["slices"] for d in devices), devices  # the slice went with the pod
        result: ExecResult = tab.execute("print(x, made)", timeout=300)
    assert result.stdout.strip() == "41 by the running cell", result
    assert "The kernel checkpointed itself first" in result.stderr, result.stderr
    assert chart.kernel_pod(kernel_id).metadata.uid != pod.metadata.uid
    status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
    assert status == 204
    wait_for(lambda: not chart.kernel_pods(kernel_id), 120, "the kernel pod to be deleted")


def test_the_gateway_pod_deleted_while_kernels_run_is_replaced_and_keeps_them(chart: Chart) -> None:
    """``kubectl delete pod`` on the gateway: the old pod, stopping, leaves both kernel pods running
    (the idle one and the one running a cell); the Deployment's new pod adopts them as they are
    (same pods, same processes, the cell's result there)."""
    gateway = chart.gateway()
    old = chart.pod
    idle = chart.start_kernel(gateway)
    busy = chart.start_kernel(gateway)
    assert gateway.execute(idle, "x = 'idle'; print(x)").strip() == "idle"
    gate = ClaimGate(chart.storage)
    with gateway.channel(busy) as tab:
        assert tab.execute("import os; y = 'busy'; print(y)").stdout.strip() == "busy"
        cell = tab.send(
            "execute_request",
            {"code": gate.cell("made = 'while the gateway changed'; print(made)"), "silent": False},
        )
        gate.wait_running()
    busy_pod = chart.kernel_pod(busy).metadata.uid
    idle_pod = chart.kernel_pod(idle).metadata.uid
    chart.core.delete_namespaced_pod(old.metadata.name, chart.namespace)
    chart.wait_gone(old)
    gateway = chart.gateway(not_uid=old.metadata.uid)
    kernels = {k["id"]: k for k in gateway.request("GET", "/api/kernels")[1]}
    assert {idle, busy} <= set(kernels), (kernels, chart.log())
    assert gateway.model(busy)["state"] == "running", chart.log()
    assert chart.kernel_pod(busy).metadata.uid == busy_pod  # adopted, not restarted
    assert gateway.model(idle)["state"] == "running", chart.log()  # adopted too, not hibernated
    assert chart.kernel_pod(idle).metadata.uid == idle_pod
    # The notebook reconnects with its session while the cell still runs: the handshake does not
    # wait for the cell, and the cell's output, reply and idle status reach it.
    with gateway.channel(busy, session=tab.session) as back:
        gate.open()
        reply, iopub = back.collect(cell, timeout=300)
    assert reply["content"]["status"] == "ok", reply
    printed = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    assert printed == "while the gateway changed\n", (iopub, chart.log())
    said = gateway.execute(busy, "print(y, made)")
    assert said.strip() == "busy while the gateway changed", said
    assert gateway.execute(idle, "print(x)").strip() == "idle"
    for kernel_id in (idle, busy):
        status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
        assert status == 204
        wait_for(lambda k=kernel_id: not chart.kernel_pods(k), 120, "the kernel pod to be deleted")


def test_a_cell_spanning_helm_upgrade_reaches_the_notebook_that_reconnects(chart: Chart) -> None:
    """``helm upgrade`` that replaces the gateway pod while a cell runs: the cell prints and ends
    after the old gateway has gone and before the notebook is back; the notebook reconnecting to
    the new gateway with its session gets that output and the cell's reply (the kernel kept them),
    and the kernel keeps its pod."""
    gateway = chart.gateway()
    old = chart.pod
    kernel_id = chart.start_kernel(gateway)
    pod = chart.kernel_pod(kernel_id).metadata.uid
    gate = ClaimGate(chart.storage)
    ended = f"open('{CLAIM_IN_KERNEL}/ended-{gate.token}', 'w').close()"
    with gateway.channel(kernel_id) as tab:
        assert tab.execute("z = 'kept'; print(z)").stdout == "kept\n"
        cell = tab.send(
            "execute_request", {"code": gate.cell(f"print('after the upgrade', z)\n{ended}"), "silent": False}
        )
        gate.wait_running()
    # A change that needs a new gateway pod (its environment).
    chart.values["gateway"]["extraEnv"] = [
        *chart.values["gateway"].get("extraEnv", []),
        {"name": "ELASTIC_TEST_UPGRADE", "value": uuid.uuid4().hex},
    ]
    chart.upgrade()
    chart.wait_gone(old)
    gate.open()
    wait_for(lambda: next(chart.storage.rglob(f"ended-{gate.token}"), None), 300, "the cell to end")
    gateway = chart.gateway(not_uid=old.metadata.uid)
    wait_for(lambda: gateway.model(kernel_id)["state"] == "running", 300, "the kernel to be adopted")
    with gateway.channel(kernel_id, session=tab.session) as back:
        reply, iopub = back.collect(cell, timeout=300)
    assert reply["content"]["status"] == "ok", reply
    printed = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    assert printed == "after the upgrade kept\n", (iopub, chart.log())
    assert chart.kernel_pod(kernel_id).metadata.uid == pod
    status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
    assert status == 204


def gateway_pods(chart: Chart) -> list[Any]:
    pods = chart.core.list_namespaced_pod(
        chart.namespace, label_selector="app.kubernetes.io/component=gateway"
    ).items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def test_helm_upgrade_with_two_gateways_rolls_out_and_keeps_the_kernel(chart: Chart) -> None:
    """``gateway.replicas: 2`` (active and standby behind the Lease), then an upgrade that changes the
    gateway's pod: the rollout replaces both pods and the new leader serves the kernel, its pod and
    variables kept. A standby is Ready (the Service selects the serving label, not readiness); before
    that a rolling update waiting for a Ready new pod before stopping the old leader never ended."""
    apps = client.AppsV1Api(chart.core.api_client)
    gateway = chart.gateway()
    kernel_id = chart.start_kernel(gateway)
    pod = chart.kernel_pod(kernel_id).metadata.uid
    assert gateway.execute(kernel_id, "w = 'kept'; print(w)").strip() == "kept"
    chart.values["gateway"]["replicas"] = 2
    try:
        chart.upgrade()
        wait_for(lambda: len(gateway_pods(chart)) == 2, 300, "a standby gateway beside the leader")
        before = {p.metadata.uid for p in gateway_pods(chart)}
        chart.values["gateway"]["extraEnv"] = [
            *chart.values["gateway"].get("extraEnv", []),
            {"name": "ELASTIC_TEST_ROLLOUT", "value": uuid.uuid4().hex},
        ]
        chart.upgrade()

        def rolled_out() -> bool:
            deployment = apps.read_namespaced_deployment(RELEASE, chart.namespace)
            pods = gateway_pods(chart)
            return (
                deployment.status.observed_generation == deployment.metadata.generation
                and (deployment.status.updated_replicas or 0) == 2
                and len(pods) == 2
                and not before & {p.metadata.uid for p in pods}
            )

        try:
            wait_for(rolled_out, 240, "the rollout to replace both gateway pods")
        except TimeoutError as exc:
            states = [
                (p.metadata.name, {c.type: c.status for c in p.status.conditions or []}.get("Ready"))
                for p in gateway_pods(chart)
            ]
            status = apps.read_namespaced_deployment(RELEASE, chart.namespace).status
            raise AssertionError(
                f"{exc}: gateway pods (name, Ready): {states}; the Deployment: updated "
                f"{status.updated_replicas}, available {status.available_replicas}, unavailable "
                f"{status.unavailable_replicas}"
            ) from None
        gateway = chart.gateway()
        wait_for(lambda: gateway.model(kernel_id)["state"] == "running", 300, "the kernel to be adopted")
        assert gateway.execute(kernel_id, "print(w)").strip() == "kept"
        assert chart.kernel_pod(kernel_id).metadata.uid == pod
    finally:
        chart.values["gateway"]["replicas"] = 1
        chart.upgrade()
    wait_for(lambda: len(gateway_pods(chart)) == 1, 420, "one gateway again")
    gateway = chart.gateway()
    status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
    assert status == 204


def test_the_charts_network_policies_hold_for_kernel_pods(chart: Chart) -> None:
    """The chart's NetworkPolicies, enforced on the node (kube-router's firewall): a kernel reaches
    cluster DNS and the gateway, not the API server (private addresses are not in its defaults); a
    kernel's ports take the gateway's connections (its cells run) and no other pod's, while that other
    pod does reach the gateway (the probe itself works)."""
    gateway = chart.gateway()
    kernel_id = chart.start_kernel(gateway, "python3-cpu")
    service = chart.service_url().removeprefix("http://")
    targets = ["dns:kubernetes.default.svc", "tcp:kubernetes.default.svc:443", f"tcp:{service}"]
    cell = (
        f"import os; os.environ['PROBES'] = {' '.join(targets)!r}; os.environ['UNTIL_REACHED'] = '0'\n{PROBE}"
    )

    def from_the_kernel() -> dict[str, str]:
        return dict(json.loads(gateway.execute(kernel_id, cell).strip().splitlines()[-1]))

    # A new pod's address reaches the firewall's sets a moment after it starts: wait for the cut.
    said = wait_for(
        lambda: (found := from_the_kernel())[targets[1]].startswith("failed") and found,
        120,
        "the kernel's egress to the API server to be cut",
    )
    assert said[targets[0]] == "address 10.96.0.1", said
    assert said[targets[2]] == "connected", said

    kernel_pod = chart.kernel_pod(kernel_id)
    ports = [p.container_port for p in kernel_pod.spec.containers[0].ports]
    stranger = [f"tcp:{kernel_pod.status.pod_ip}:{port}" for port in ports]
    other = Namespace(chart.core, chart.namespace)
    seen = probe(other, chart.images["kernel"], [f"tcp:{service}", *stranger], expect=False)
    assert seen.pop(f"tcp:{service}") == "connected", seen
    assert len(seen) == 5 and all(v.startswith("failed") for v in seen.values()), seen
    assert gateway.execute(kernel_id, "print(6 * 7)").strip() == "42"
    assert gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)[0] == 204


def test_a_cell_that_runs_its_kernel_pod_out_of_memory_is_answered_with_the_cause(chart: Chart) -> None:
    """A cell that takes more memory than its pod's limit (a CPU kernel's default, 4Gi): the
    container is OOM-killed by the node, and the cell is answered at once as a kernel answers
    (an error reply, idle) saying so, with the limit, and what happens next; it no longer stays
    "running" in the notebook with nothing arriving, nor quotes the kernel's last log line."""
    gateway = chart.gateway()
    kernel_id = chart.start_kernel(gateway, "python3-cpu")
    with gateway.channel(kernel_id) as tab:
        assert tab.execute("x = 1; print(x)").stdout == "1\n"
        result = tab.execute("hog = b'x' * (6 * 2**30)", timeout=300)
        assert result.reply["content"].get("ename") == "KernelDied", (result, chart.log())
        assert "The kernel died while this cell ran: it ran out of memory: its pod's limit is 4Gi" in (
            result.error
        ), result.error
        assert "started again, empty" in result.error, result.error
        assert result.statuses[-1] == "idle"
        # It is: the restarted kernel, in a new pod, answers the next cell without the variable.
        wait_for(lambda: gateway.model(kernel_id)["state"] == "running", 300, "the kernel to restart")
        assert tab.execute("print('x' in dir())", timeout=300).stdout == "False\n"
    status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
    assert status == 204


def test_helm_uninstall_with_the_hooks_admin_token_hibernates_every_running_kernel(chart: Chart) -> None:
    """``helm uninstall`` with the hook's admin token (here the gateway's static token, the chart's
    default with ``gateway.auth: token``): the hook's pod, in a container on the node as uid 1000,
    reads its token's file and hibernates each running kernel, so their variables stay on the claim.
    The chart made that file root's (mode 0400, no fsGroup): the hook stopped every kernel instead.
    Last in the module: it uninstalls the release (the fixture's own uninstall then finds none)."""
    gateway = chart.gateway()
    kernels = [chart.start_kernel(gateway) for _ in range(2)]
    for n, kernel_id in enumerate(kernels):
        assert gateway.execute(kernel_id, f"kept = {n}; print(kept)").strip() == str(n)
    # The hook reaches the gateway at its Service's DNS name (the default); forced here: the node.
    chart.values["uninstallHook"] = {"enabled": True, **ON_THE_NODE}
    chart.upgrade()
    chart.helm("uninstall", RELEASE, "--wait", timeout=600)
    (hook,) = chart.core.list_namespaced_pod(
        chart.namespace, label_selector="app.kubernetes.io/component=uninstall-hook"
    ).items
    said = str(chart.core.read_namespaced_pod_log(hook.metadata.name, chart.namespace))
    assert "Permission denied" not in said and "variables are lost" not in said, said
    for kernel_id in kernels:
        assert f"hibernated kernel {kernel_id}" in said, said
        assert chart.kernel_pods(kernel_id) == []
        assert any(chart.storage.rglob(f"{kernel_id}/ckpt-*")), sorted(chart.storage.rglob("*"))
