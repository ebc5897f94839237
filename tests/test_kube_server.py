"""The server with kernels as pods, end to end, against the real control plane and two runner nodes.

A real jupyter_server subprocess (``ElasticKernels.kernel_provisioner = elastic-kubernetes-provisioner``)
starts each GPU-size kernel as a pod; the node runners (``tests/support/node_runner.py``) run the pods as
local processes with their own loopback IPs. Checkpoints go to a PersistentVolumeClaim bound to a real
PersistentVolume by the controller manager; the runners map the claim to one folder, which the server
also uses as its ``checkpoint_root`` (as a server pod mounting the same ReadWriteMany claim would).
"""

from __future__ import annotations

import getpass
import json
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.server import undelivered
from tests.support.gate import Gate
from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from tests.support.node_runner import NodeRunner  # noqa: E402
from tests.support.oracle import SETUP, Reference, check_same, cycle_cell, run_both  # noqa: E402
from tests.support.pod_cluster import CLAIM, PodCluster, pod_cluster  # noqa: E402
from tests.support.server import START_SECONDS, KernelChannel, RunningServer, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("numpy")

NAMESPACE = "elastic-e2e"
SIZE = "python3-gpu-whole"


@pytest.fixture(scope="module")
def cluster(kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner) -> Iterator[PodCluster]:
    with pod_cluster(kube_plane, kube_api, kube_runner, NAMESPACE) as made:
        yield made


@pytest.fixture
def server(cluster: PodCluster, tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(tmp_path, cluster.config())
    yield running
    running.stop()
    for runner in cluster.runners:
        cluster.cordon(runner.node_name, False)


def model(server: RunningServer, kernel_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/elastic/kernels/{kernel_id}"))


def probe(server: RunningServer, name: str) -> tuple[int, Any]:
    """A kubelet's probe: no token."""
    try:
        with urllib.request.urlopen(f"{server.url}/api/elastic/{name}", timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def hibernate(server: RunningServer, cluster: PodCluster, kernel_id: str) -> None:
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply.body
    # The pod is gone (not merely terminating) before the answer: its GPU is really free.
    assert cluster.pod_of(kernel_id) is None
    assert f"kernel-{kernel_id}" not in cluster.secrets()
    assert model(server, kernel_id)["state"] == "hibernated"


def test_pod_kernel_hibernates_and_resumes_on_another_node_five_times(
    cluster: PodCluster, server: RunningServer, reference: Reference
) -> None:
    kernel_id = server.start_kernel(SIZE)
    run_both(server, kernel_id, reference, SETUP)
    check_same(server, kernel_id, reference)
    pod = cluster.running_pod(kernel_id)
    assert pod.metadata.annotations["elastic.jupyter.org/kernelspec"] == SIZE
    assert pod.spec.volumes[1].persistent_volume_claim.claim_name == CLAIM
    nodes = [pod.spec.node_name]
    ips = [pod.status.pod_ip]
    # One websocket open through every cycle, as a notebook tab keeps it: it must follow the kernel.
    with server.channel(kernel_id, timeout=120) as tab:
        for n in range(1, 6):
            hibernate(server, cluster, kernel_id)
            cluster.cordon(nodes[-1])  # the node it ran on is full or gone: resume elsewhere
            for runner in cluster.runners:
                if runner.node_name != nodes[-1]:
                    cluster.cordon(runner.node_name, False)
            code = cycle_cell(n)
            result = tab.execute(code, timeout=120)
            assert result.error == "", result.error
            reference.run(code)
            pod = cluster.running_pod(kernel_id)
            assert pod.spec.node_name != nodes[-1]
            nodes.append(pod.spec.node_name)
            ips.append(pod.status.pod_ip)
            check_same(server, kernel_id, reference)
            assert model(server, kernel_id)["state"] == "running"
        assert "42" in tab.execute("print(6 * 7)").stdout
    # The pod's agent wrote its restore report on the checkpoint volume; the server serves it.
    report = server.get(f"/api/elastic/kernels/{kernel_id}/report")["restore_report"]
    assert report["refused"] is None and report["checkpoint"] and report["restored"], report
    assert len(set(ips)) > 1, ips
    reply = server.request("DELETE", f"/api/kernels/{kernel_id}")
    assert reply.status == 204
    wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
    assert cluster.secrets() == []
    assert not (cluster.checkpoints / getpass.getuser() / kernel_id).exists()


def test_only_pod_kernelspecs_are_offered_and_a_cpu_kernel_is_a_pod_with_resources(
    cluster: PodCluster, server: RunningServer
) -> None:
    """The server runs no kernel itself: python3 is not offered (404 naming python3-cpu), python3-cpu
    is a pod of its own through the same provisioner, with cpu/memory requests and limits."""
    specs = server.get("/api/kernelspecs")
    assert set(specs["kernelspecs"]) == {"python3-cpu", SIZE}, specs["kernelspecs"].keys()
    assert specs["default"] == "python3-cpu"
    cpu = specs["kernelspecs"]["python3-cpu"]["spec"]
    assert cpu["metadata"]["kernel_provisioner"] == {"provisioner_name": "elastic-kubernetes-provisioner"}
    assert cpu["metadata"]["elastic"]["profile"] is None and cpu["display_name"] == "Python 3 · CPU"
    reply = server.request("POST", "/api/kernels", {"name": "python3"})
    assert reply.status == 404, reply.body
    assert "not offered here" in reply.body["message"] and "python3-cpu" in reply.body["message"]
    assert server.request("GET", "/api/kernelspecs/python3").status == 404
    assert server.get("/api/kernels") == []  # nothing started for the refused requests

    kernel_id = server.start_kernel("python3-cpu")
    pod = cluster.running_pod(kernel_id)
    assert pod.metadata.annotations["elastic.jupyter.org/kernelspec"] == "python3-cpu"
    assert "elastic.jupyter.org/size" not in pod.metadata.annotations  # no GPU slice
    (container,) = pod.spec.containers
    assert container.resources.requests == {"cpu": "250m", "memory": "1Gi"}
    assert container.resources.limits == {"cpu": "2", "memory": "4Gi"}
    # The kernel's process is the pod's (the runner's child), not the server's.
    ppid = int(server.execute(kernel_id, "import os; print(os.getppid())").strip())
    assert ppid != server.process.pid
    assert model(server, kernel_id)["profile"] is None
    # An elastic kernel like the GPU ones: it hibernates (its pod gone) and resumes with its variables.
    assert server.execute(kernel_id, "kept = 41 + 1; print(kept)").strip() == "42"
    hibernate(server, cluster, kernel_id)
    assert server.execute(kernel_id, "print(kept)", timeout=120).strip() == "42"
    # A GPU size's pod gets the GPU kernels' defaults beside its slice.
    gpu_id = server.start_kernel(SIZE)
    resources = cluster.running_pod(gpu_id).spec.containers[0].resources
    assert resources.requests == {"cpu": "1", "memory": "4Gi", "nvidia.com/gpu": "1"}
    assert resources.limits == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}
    for kid in (kernel_id, gpu_id):
        server.shutdown_kernel(kid)
        wait_for(lambda kid=kid: cluster.pod_of(kid) is None, 60, "the kernel pod to be deleted")


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        (
            {"cpu_kernel_resources": {"limits": {"nvidia.com/gpu": 1}}},
            "cpu_kernel_resources.limits.nvidia.com/gpu",
        ),
        ({"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}}, "memory request (8Gi)"),
        ({"size_resources": {"tiny": {"limits": {"cpu": "1"}}}}, "unknown GPU sizes ['tiny']"),
    ],
)
def test_bad_pod_resources_stop_the_server_at_start_with_one_line(
    cluster: PodCluster, tmp_path: Path, setting: dict[str, Any], named: str
) -> None:
    from tests.support.server import launch

    process, log_path, _url, _env = launch(tmp_path, cluster.config(**setting), None, None, "jupyter_server")
    try:
        assert process.wait(timeout=START_SECONDS) == 2
    finally:
        if process.poll() is None:
            process.kill()
    critical = [line for line in log_path.read_text().splitlines() if "invalid configuration" in line]
    assert len(critical) == 1 and named in critical[0], critical


def test_pod_without_checkpoint_claim_refuses_to_hibernate(cluster: PodCluster, tmp_path: Path) -> None:
    running = start_server(tmp_path, cluster.config(checkpoint_claim=""))
    try:
        kernel_id = running.start_kernel(SIZE)
        assert running.execute(kernel_id, "x = 1; print(x)").strip() == "1"
        reply = running.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 409, reply.body
        assert "checkpoint_claim" in reply.body["message"]
        assert running.execute(kernel_id, "print(x + 1)").strip() == "2"
        running.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
    finally:
        running.stop()


def hibernated_model(server: RunningServer, kernel_id: str) -> dict[str, Any] | None:
    """The kernel's model once it is hibernated (a ``wait_for`` predicate)."""
    current = model(server, kernel_id)
    return current if current["state"] == "hibernated" else None


def evict(cluster: PodCluster, kernel_id: str) -> None:
    """Evict the kernel's pod through the Eviction API, as ``kubectl drain`` does."""
    pod = cluster.running_pod(kernel_id)
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod.metadata.name, namespace=NAMESPACE))
    cluster.core.create_namespaced_pod_eviction(pod.metadata.name, NAMESPACE, eviction)


def test_an_evicted_pod_checkpoints_its_kernel_before_it_goes(
    cluster: PodCluster, server: RunningServer, tmp_path: Path
) -> None:
    """A drain or an eviction: Kubernetes sends SIGTERM and waits the pod's grace period. The kernel
    checkpoints what changed since its last checkpoint; the server waits for the pod to end, then
    hibernates the kernel from that checkpoint. The next cell resumes it with nothing lost."""
    gate = Gate(tmp_path / "gates")
    kernel_id = server.start_kernel(SIZE)
    assert server.execute(kernel_id, "x = 41; print(x)").strip() == "41"
    hibernate(server, cluster, kernel_id)
    with server.channel(kernel_id, timeout=120) as tab:
        # ``gated`` holds the SIGTERM checkpoint at the gate: one slower than the server's polls.
        code = f"{gate.pickled_object()}gated = Gated()\ny = 'after the checkpoint'; print(x)"
        assert tab.execute(code).stdout.strip() == "41"
        evict(cluster, kernel_id)
        wait_for(gate.is_reached, 60, "the kernel to checkpoint at SIGTERM")
        deadline = time.monotonic() + 6  # two of the restarter's polls: the server must keep waiting
        while time.monotonic() < deadline:
            assert model(server, kernel_id)["state"] == "running"
            assert cluster.pod_of(kernel_id) is not None
            time.sleep(0.5)
        gate.open()

        current = wait_for(
            lambda: hibernated_model(server, kernel_id),
            60,
            "the evicted kernel to be hibernated from its checkpoint",
        )
        assert "lost: its pod was deleted" in current["state_reason"], current
        assert "y" in current["checkpoint"]["saved"], current  # written at SIGTERM
        devices = server.get("/api/elastic/gpus")["devices"]
        assert all(d["slices"] == [] for d in devices), devices  # the slice went with the pod
        assert cluster.pod_of(kernel_id) is None and cluster.secrets() == []
        result = tab.execute("print(x + 1, y)", timeout=120)
    assert result.stdout.split() == ["42", "after", "the", "checkpoint"], result
    assert "The kernel checkpointed itself first" in result.stderr, result.stderr
    assert re.search(
        r'^elastic_kernels_saved_at_stop_total\{size="[^"]+"\} 1\.0$', server.text("/metrics"), re.M
    )
    assert model(server, kernel_id)["state"] == "running"
    assert "stopped" not in server.execute(kernel_id, "print('again')")  # told once
    server.shutdown_kernel(kernel_id)
    wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")


def test_a_cell_sent_while_the_pod_stops_waits_for_the_resume(
    cluster: PodCluster, server: RunningServer, tmp_path: Path
) -> None:
    """While an evicted kernel checkpoints itself, a cell the notebook sends would reach a process
    about to end and get no answer. The server holds it, takes the kernel over, resumes it, and
    then delivers it: the cell runs, with every variable, and its notebook is told why."""
    gate = Gate(tmp_path / "gates")
    kernel_id = server.start_kernel(SIZE)
    with server.channel(kernel_id, timeout=120) as tab:
        code = f"{gate.pickled_object()}gated = Gated()\nx = 41; print(x)"
        assert tab.execute(code).stdout.strip() == "41"
        evict(cluster, kernel_id)
        wait_for(gate.is_reached, 60, "the kernel to checkpoint at SIGTERM")
        wait_for(
            lambda: f"Kernel {kernel_id}: its pod is being stopped" in server.log(),
            60,
            "the server to see the pod stopping (it holds the notebook's messages from then on)",
        )
        held = tab.send("execute_request", {"code": "print(x + 1)", "silent": False, "store_history": True})
        gate.open()
        reply, iopub = tab.collect(held, 120)
    assert reply["content"]["status"] == "ok", reply
    streams = {"stdout": "", "stderr": ""}
    for msg in iopub:
        if msg["msg_type"] == "stream":
            streams[msg["content"]["name"]] += msg["content"]["text"]
    assert streams["stdout"].strip() == "42", streams
    assert "The kernel checkpointed itself first" in streams["stderr"], streams
    assert model(server, kernel_id)["state"] == "running"
    server.shutdown_kernel(kernel_id)
    wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")


def test_a_pod_evicted_during_a_cell_lets_it_finish_and_keeps_what_it_made(
    cluster: PodCluster, server: RunningServer, tmp_path: Path
) -> None:
    """A drain while a long cell runs (a training step): the cell finishes within the grace period,
    its output reaches the notebook, and what it made is in the checkpoint the kernel writes next.
    The kernel never hibernated before: the SIGTERM checkpoint is its first."""
    gate = Gate(tmp_path / "cell-gate")
    kernel_id = server.start_kernel(SIZE)
    with server.channel(kernel_id, timeout=120) as tab:
        code = gate.cell() + "made = 'by the running cell'\nprint('cell done')"
        msg_id = tab.send("execute_request", {"code": code, "silent": False, "store_history": True})
        wait_for(gate.is_reached, 60, "the cell to be running")
        evict(cluster, kernel_id)
        wait_for(
            lambda: (pod := cluster.pod_of(kernel_id)) is not None and pod.metadata.deletion_timestamp,
            30,
            "the pod to be stopping",
        )
        time.sleep(1)  # the node runner's SIGTERM reaches the kernel mid-cell
        gate.open()
        reply, iopub = tab.collect(msg_id, 60)
        assert reply["content"]["status"] == "ok", reply
        printed = "".join(m["content"].get("text", "") for m in iopub if m["msg_type"] == "stream")
        assert "cell done" in printed
        current = wait_for(
            lambda: hibernated_model(server, kernel_id), 60, "the evicted kernel to be hibernated"
        )
        assert "made" in current["checkpoint"]["saved"], current
        result = tab.execute("print(made)", timeout=120)
    assert result.stdout.strip() == "by the running cell", result
    server.shutdown_kernel(kernel_id)
    wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")


def test_restarted_server_adopts_running_pods_and_recovers_lost_ones(
    cluster: PodCluster, server: RunningServer, tmp_path: Path
) -> None:
    adopted = server.start_kernel(SIZE)
    assert server.execute(adopted, "x = 41; print(x)").strip() == "41"
    lost = server.start_kernel(SIZE)
    assert server.execute(lost, "z = 'checkpointed'; print(z)").strip() == "checkpointed"
    hibernate(server, cluster, lost)
    assert server.execute(lost, "w = 'after'; print(z)").strip() == "checkpointed"
    pid_before = server.execute(adopted, "import os; print(os.getpid())").strip()
    server.process.send_signal(signal.SIGKILL)  # the server dies; its kernel pods do not
    server.process.wait()
    assert cluster.pod_of(adopted).status.phase == "Running"
    cluster.core.delete_namespaced_pod(f"kernel-{lost}", NAMESPACE)  # lost while nobody watched
    wait_for(lambda: cluster.pod_of(lost) is None, 60, "the deleted pod to be gone")

    restarted = start_server(tmp_path, cluster.config())
    try:
        wait_for(lambda: model(restarted, adopted)["state"] == "running", 60, "the running pod to be adopted")
        # The same process, variables and all: nothing was restarted or restored.
        assert restarted.execute(adopted, "print(os.getpid(), x + 1)").split() == [pid_before, "42"]
        assert model(restarted, lost)["state"] == "hibernated"
        with restarted.channel(lost, timeout=120) as tab:
            result = tab.execute("print(z, 'w' in globals())", timeout=120)
        assert result.stdout.split() == ["checkpointed", "True"], result
        assert "its pod ended while the server was down" in result.stderr
        # Both hold their slices again, and one more kernel does not fit (two GPUs).
        devices = restarted.get("/api/elastic/gpus")["devices"]
        assert sorted(s["kernel_id"] for d in devices for s in d["slices"]) == sorted([adopted, lost])
        for kernel_id in (adopted, lost):
            restarted.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pods() == [], 60, "every kernel pod to be deleted")
        assert cluster.secrets() == []
    finally:
        restarted.stop()


#: What no checkpoint can keep: a half-consumed generator and a held lock (both unpicklable).
UNPICKLABLE = "import os, threading; g = iter(range(10)); next(g); lock = threading.Lock(); lock.acquire()"


def test_a_stopped_server_leaves_its_kernel_pods_running_and_the_next_adopts_them(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """SIGTERM (an upgrade, a drain, a restart) with three running kernels: in Kubernetes mode the
    default is to leave the pods running, so the next server adopts the same processes with what no
    checkpoint keeps; nothing is hibernated."""
    config = cluster.config()
    del config["ElasticKernels"]["hibernate_on_shutdown"]  # the default of pod mode
    first = start_server(tmp_path, config)
    kernels = [first.start_kernel(SIZE), first.start_kernel(SIZE), first.start_kernel("python3-cpu")]
    pids = {}
    for kernel_id in kernels:
        pids[kernel_id] = first.execute(kernel_id, f"{UNPICKLABLE}; print(os.getpid())").strip()
    pods = {kernel_id: cluster.pod_of(kernel_id).metadata.uid for kernel_id in kernels}
    first.stop()  # SIGTERM, as Kubernetes stops a gateway pod
    assert first.process.returncode == 0, first.log()[-3000:]
    assert "left running in its pod for the next server to adopt" in first.log()
    for kernel_id in kernels:
        pod = cluster.pod_of(kernel_id)
        assert pod is not None and pod.metadata.uid == pods[kernel_id] and pod.status.phase == "Running"
    second = start_server(tmp_path, config)  # the same root: as a new gateway pod
    try:
        for kernel_id in kernels:
            wait_for(lambda k=kernel_id: model(second, k)["state"] == "running", 60, "the pod to be adopted")
            said = second.execute(kernel_id, "print(os.getpid(), next(g), lock.locked())").split()
            assert said == [pids[kernel_id], "1", "True"], said
            assert cluster.pod_of(kernel_id).metadata.uid == pods[kernel_id]
        for kernel_id in kernels:
            second.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pods() == [], 60, "every kernel pod to be deleted")
    finally:
        second.stop()


def test_a_notebook_reconnecting_to_the_next_gateway_during_a_cell_gets_the_cells_output_and_reply(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """A gateway replaced while a cell runs (an upgrade): the notebook's reconnect, with its session,
    opens at once though the kernel is busy and no kernel_info is cached in the new gateway, and
    what the cell prints after it, its reply and its idle status reach the notebook.

    jupyter_server's handshake asked kernel_info on shell, answered only after the cell, so the
    reconnect waited for the whole cell; its give-up time is set out of the way here, so that on
    that code the handshake times out with the gate still closed."""
    config = cluster.config()
    del config["ElasticKernels"]["hibernate_on_shutdown"]  # the default of pod mode: pods left running
    config["MappingKernelManager"] = {"kernel_info_timeout": 3600}
    gate = Gate(tmp_path / "gate", "cell")
    first = start_server(tmp_path, config)
    kernel_id = first.start_kernel(SIZE)
    tab = first.channel(kernel_id, timeout=120)
    cell = "print('before', flush=True)\n" + gate.cell(limit=600) + "made = 42\nprint('after', made)\n"
    msg_id = tab.send("execute_request", {"code": cell, "silent": False, "store_history": True})
    wait_for(gate.is_reached, 120, "the cell to reach its gate")
    first.stop()  # SIGTERM, as Kubernetes stops a gateway pod in an upgrade
    tab.close()
    second = start_server(tmp_path, config)
    try:
        wait_for(lambda: model(second, kernel_id)["state"] == "running", 120, "the pod to be adopted")
        with KernelChannel(second.url, kernel_id, timeout=120, session=tab.session) as back:
            # The handshake is over with the cell still at its gate.
            assert not gate.release_file.exists()
            gate.open()
            reply, iopub = back.collect(msg_id, timeout=120)
            assert reply["content"]["status"] == "ok", reply
            said = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
            assert said == "after 42\n", (said, second.log()[-3000:])
            assert back.execute("print(made)").stdout == "42\n"
        second.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pods() == [], 60, "every kernel pod to be deleted")
    finally:
        second.stop()


def test_what_a_cell_sent_while_no_gateway_was_there_reaches_the_notebook_that_reconnects(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """The gateway stops while a cell runs; the cell prints and finishes before the next gateway is
    up, so its output, its reply and its idle status go to no one. The kernel kept them for the
    notebook's session (:mod:`kernelmgr.checkpoint.outbox`): the notebook reconnecting to the next
    gateway gets them, in order, once; its next cell runs as usual."""
    config = cluster.config()
    del config["ElasticKernels"]["hibernate_on_shutdown"]  # the default of pod mode: pods left running
    gate = Gate(tmp_path / "gate", "gap")
    done = tmp_path / "gate" / "cell.done"
    first = start_server(tmp_path, config)
    kernel_id = first.start_kernel(SIZE)
    tab = first.channel(kernel_id, timeout=120)
    assert tab.execute("n = 1; print(n)").stdout == "1\n"
    cell = (
        "print('before', flush=True)\n"
        + gate.cell(limit=600)
        + "for i in range(3):\n    print('in the gap', i, flush=True)\n"
        + "print('x' * (17 * 2**20), flush=True)\n"  # more than the kernel keeps: told, not kept
        + f"open({str(done)!r}, 'w').close()\n"
    )
    msg_id = tab.send("execute_request", {"code": cell, "silent": False, "store_history": True})
    wait_for(gate.is_reached, 120, "the cell to reach its gate")
    first.stop()  # SIGTERM, as Kubernetes stops a gateway pod
    tab.close()
    gate.open()  # the cell goes on with no gateway anywhere
    wait_for(done.exists, 120, "the cell to finish with no gateway")
    second = start_server(tmp_path, config)
    try:
        wait_for(lambda: model(second, kernel_id)["state"] == "running", 120, "the pod to be adopted")
        with KernelChannel(second.url, kernel_id, timeout=120, session=tab.session) as back:
            reply, iopub = back.collect(msg_id, timeout=120)
            assert reply["content"]["status"] == "ok", reply
            streams = [m["content"] for m in iopub if m["msg_type"] == "stream"]
            said = "".join(c["text"] for c in streams if c["name"] == "stdout")
            assert said == "in the gap 0\nin the gap 1\nin the gap 2\n", (said[:300], second.log()[-3000:])
            told = "".join(c["text"] for c in streams if c["name"] == "stderr")
            assert told == undelivered.LOST_NOTE + "\n", told
            assert [m["content"]["execution_state"] for m in iopub if m["msg_type"] == "status"] == ["idle"]
            assert back.execute("n += 1; print(n)").stdout == "2\n"
        # Once: a second reconnect of the same notebook gets nothing of that cell again.
        with KernelChannel(second.url, kernel_id, timeout=120, session=tab.session) as again:
            next_id = again.send("execute_request", {"code": "print('next')", "silent": False})
            parents: list[str] = []
            deadline = time.monotonic() + 120
            while parents[-2:] != [next_id, "idle"]:
                msg = again.recv(deadline)
                parents.append(msg["parent_header"].get("msg_id"))
                if msg["msg_type"] == "status" and parents[-1] == next_id:
                    parents.append(msg["content"]["execution_state"])
            assert msg_id not in parents, parents
        second.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pods() == [], 60, "every kernel pod to be deleted")
    finally:
        second.stop()


def test_background_checkpoint_brings_back_a_never_hibernated_kernel_whose_node_died(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """A node that stops answering: Kubernetes evicts the pod (``node_lost_seconds``), the server
    hibernates the kernel from its background checkpoint, and the next cell resumes it elsewhere."""
    doomed = NodeRunner(
        cluster.plane.configuration(user="system:node:runner-doomed", groups=["system:nodes"]),
        "runner-doomed",
        cluster.runners[0].volumes_root,
        capacity={"nvidia.com/gpu": "1"},
        heartbeat_interval=2,
        lease_seconds=10,
        admin_configuration=cluster.plane.configuration(),
    ).start()
    for runner in cluster.runners:
        cluster.cordon(runner.node_name)  # the kernel starts on the doomed node
    config = cluster.config(node_lost_seconds=1)
    config["ElasticKernels"]["background_checkpoint_interval"] = 1
    running = start_server(tmp_path, config)
    try:
        kernel_id = running.start_kernel(SIZE)
        assert cluster.running_pod(kernel_id).spec.node_name == "runner-doomed"
        assert running.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        checkpointed = wait_for(
            lambda: model(running, kernel_id)["checkpoint"], 60, "a background checkpoint of the kernel"
        )
        assert "x" in checkpointed["saved"], checkpointed
        assert model(running, kernel_id)["state"] == "running"  # it never stopped
        for runner in cluster.runners:
            cluster.cordon(runner.node_name, False)
        doomed.crash()  # power cut: the process dies, the kubelet says nothing more

        def lost() -> dict[str, Any] | None:
            current = model(running, kernel_id)
            return current if current["state"] == "hibernated" else None

        current = wait_for(
            lost, 180, "the node lifecycle controller to evict the pod and the server to notice"
        )
        assert "lost" in current["state_reason"], current
        with running.channel(kernel_id, timeout=120) as tab:
            result = tab.execute("print(x + 1)", timeout=120)
        assert result.stdout.strip() == "42", result
        assert "was lost" in result.stderr
        metrics = running.text("/metrics")
        assert re.search(r'^elastic_kernels_lost_total\{size="[^"]+"\} 1\.0$', metrics, re.M)
        assert "elastic_kernels_saved_at_stop_total{" not in metrics  # nothing saved at a power cut
        assert cluster.running_pod(kernel_id).spec.node_name in {r.node_name for r in cluster.runners}
        running.shutdown_kernel(kernel_id)
    finally:
        running.stop()
        cluster.core.delete_node("runner-doomed")


def test_gpu_inventory_from_the_cluster_nodes(cluster: PodCluster, tmp_path: Path) -> None:
    config = cluster.config()
    del config["ElasticKernels"]["gpu_inventory"]
    config["ElasticKernels"]["gpu_inventory_source"] = "kubernetes"
    running = start_server(tmp_path, config)
    try:

        def runner_devices() -> list[dict[str, Any]]:
            gpus = running.get("/api/elastic/gpus")
            return [d for d in gpus["devices"] if d.get("node") in {r.node_name for r in cluster.runners}]

        devices = wait_for(
            lambda: len(runner_devices()) == 2 and runner_devices(), 60, "the runner nodes' GPUs"
        )
        assert running.get("/api/elastic/gpus")["source"] == "kubernetes"
        # The scheduler may only use the last runner (a taint on the others the kernel pod does not
        # tolerate; the allocator does not read taints), while the allocator's first choice is the
        # first node by name: they disagree, and the booking must follow the pod.
        *others, target = sorted(r.node_name for r in cluster.runners)
        avoid = {"key": "elastic.test/avoid", "value": "true", "effect": "NoSchedule"}
        for name in others:
            cluster.core.patch_node(name, {"spec": {"taints": [avoid]}})
        try:
            kernel_id = running.start_kernel(SIZE)
            assert running.execute(kernel_id, "print(6 * 7)").strip() == "42"
        finally:
            for name in others:
                cluster.core.patch_node(name, {"spec": {"taints": []}})
        assert cluster.running_pod(kernel_id).spec.node_name == target
        everywhere = running.get("/api/elastic/gpus")["devices"]
        booked = [(d["node"], s["kernel_id"]) for d in everywhere for s in d["slices"]]
        assert booked == [(target, kernel_id)], (booked, devices)
        (device,) = running.get(f"/api/elastic/kernels/{kernel_id}")["slice"]["devices"]
        assert device["uuid"].startswith(f"{target}/"), device
        running.shutdown_kernel(kernel_id)
    finally:
        running.stop()


def test_restart_gives_a_fresh_pod_and_the_api_server_restarting_mid_watch_loses_nothing(
    cluster: PodCluster, server: RunningServer
) -> None:
    kernel_id = server.start_kernel(SIZE)
    assert server.execute(kernel_id, "x = 41; print(x)").strip() == "41"
    first = cluster.running_pod(kernel_id).metadata.uid
    reply = server.request("POST", f"/api/kernels/{kernel_id}/restart")
    assert reply.status == 200, reply.body
    second = cluster.running_pod(kernel_id)
    assert second.metadata.uid != first  # a new pod, same kernel id
    assert server.execute(kernel_id, "print('x' in globals())").strip() == "False"
    assert server.execute(kernel_id, "y = 7; print(y)").strip() == "7"

    hibernate(server, cluster, kernel_id)  # a checkpoint to come back to
    assert server.execute(kernel_id, "print(y)", timeout=120).strip() == "7"

    # The API server restarts: every watch breaks and must resume. The server's does if it sees
    # what happens next: the pod deleted under it (no scheduling involved, which a freshly
    # restarted control plane may take a while to resume).
    cluster.plane.restart("kube-apiserver")
    pod = cluster.running_pod(kernel_id)
    cluster.core.delete_namespaced_pod(pod.metadata.name, NAMESPACE)
    wait_for(
        lambda: model(server, kernel_id)["state"] == "hibernated",
        60,
        "the server's pod watch, resumed after the API server restart, to see the pod deleted",
    )
    server.shutdown_kernel(kernel_id)
    wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")


def test_the_server_runs_with_only_the_shipped_rbac(cluster: PodCluster, tmp_path: Path) -> None:
    """Every path of the server (start, hibernate, resume, background checkpoint, node inventory,
    shutdown, adoption after a crash) with the rights in deploy/kubernetes/rbac.yaml and no more."""
    from tests.support import rbac

    api = cluster.core.api_client
    docs = rbac.load(rbac.RBAC, NAMESPACE, "e2e-only-rbac")
    rbac.apply(api, docs)
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig, token = rbac.service_account_kubeconfig(
        cluster.plane, api, NAMESPACE, account, tmp_path / "server.kubeconfig"
    )
    rbac.wait_allowed(cluster.plane, token, "create", "pods", NAMESPACE)
    config = cluster.config(kubeconfig=str(kubeconfig))
    del config["ElasticKernels"]["gpu_inventory"]
    config["ElasticKernels"]["gpu_inventory_source"] = "kubernetes"
    config["ElasticKernels"]["background_checkpoint_interval"] = 1
    # A warm pod, which the resume takes (relabelling it, reading its checkpoint back after adoption).
    config["ElasticKubernetesProvisioner"]["warm_pods"] = {"whole": {"count": 1}}
    running = start_server(tmp_path, config)
    try:
        # The GPU sizes are offered once the node watch has listed the nodes' GPUs.
        wait_for(lambda: running.get("/api/elastic/gpus")["devices"], 60, "the nodes' GPUs listed")
        kernel_id = running.start_kernel(SIZE)
        assert running.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        wait_for(lambda: model(running, kernel_id)["checkpoint"], 60, "a background checkpoint")
        wait_for(lambda: running.get("/api/elastic/gpus")["warm_pods"]["whole"]["ready"], 60, "a warm pod")
        hibernate(running, cluster, kernel_id)
        assert running.execute(kernel_id, "print(x + 1)", timeout=120).strip() == "42"
        assert cluster.running_pod(kernel_id).metadata.name.startswith("warm-"), "\n".join(
            line[:300] for line in running.log().splitlines() if "warm" in line
        )
        running.process.send_signal(signal.SIGKILL)
        running.process.wait()
        running = start_server(tmp_path, config)
        wait_for(lambda: model(running, kernel_id)["state"] == "running", 60, "the pod to be adopted")
        assert running.execute(kernel_id, "print(x * 2)").strip() == "82"
        hibernate(running, cluster, kernel_id)
        assert running.execute(kernel_id, "print(x * 3)", timeout=120).strip() == "123"
        running.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
        assert "forbidden" not in running.log().lower(), running.log()[-3000:]
    finally:
        running.stop()
        rbac.delete(api, docs)


def test_a_restarted_server_adopts_running_pods_only_once_it_knows_the_nodes_gpus(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """With the GPU inventory from the nodes, a restarted server knows no GPU until it has listed the
    nodes, and so no GPU kernelspec to adopt a running pod under: adoption waits for that list (here
    held back by a missing right) instead of leaving the pod unadopted for good."""
    from tests.support import rbac

    api = cluster.core.api_client
    docs = rbac.load(rbac.RBAC, NAMESPACE, "e2e-late-nodes")
    rbac.apply(api, docs)
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig, token = rbac.service_account_kubeconfig(
        cluster.plane, api, NAMESPACE, account, tmp_path / "server.kubeconfig"
    )
    rbac.wait_allowed(cluster.plane, token, "list", "nodes", "")
    config = cluster.config(kubeconfig=str(kubeconfig))
    del config["ElasticKernels"]["gpu_inventory"]
    config["ElasticKernels"]["gpu_inventory_source"] = "kubernetes"
    roles = client.RbacAuthorizationV1Api(api)
    nodes_role = next(d for d in docs if d["kind"] == "ClusterRole" and "nodes" in str(d["rules"]))
    running = start_server(tmp_path, config)
    try:
        kernel_id = running.start_kernel(SIZE)
        pid = running.execute(kernel_id, "import os; x = 41; print(os.getpid())").strip()
        running.process.send_signal(signal.SIGKILL)  # the server dies; its kernel pod does not
        running.process.wait()
        no_list = next(
            d for d in rbac.without(docs, "nodes", "list") if d["metadata"] == nodes_role["metadata"]
        )
        roles.replace_cluster_role(nodes_role["metadata"]["name"], no_list)
        rbac.wait_allowed(cluster.plane, token, "list", "nodes", "", allowed=False)
        running = start_server(tmp_path, config)
        wait_for(lambda: "may not list nodes" in running.log(), 60, "the node list to be refused")
        assert kernel_id not in {k["id"] for k in running.get("/api/kernels")}
        # Not ready (the Service sends it no one) until the nodes are listed and the pods adopted.
        assert probe(running, "readyz") == (503, {"message": "not ready yet"})
        roles.replace_cluster_role(nodes_role["metadata"]["name"], nodes_role)
        wait_for(lambda: probe(running, "readyz")[0] == 200, 120, "the server to be ready")
        assert model(running, kernel_id)["state"] == "running"  # ready: the pod was adopted
        assert "Could not adopt" not in running.log(), running.log()[-3000:]
        assert running.execute(kernel_id, "print(os.getpid(), x + 1)").split() == [pid, "42"]
        running.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
    finally:
        running.stop()
        rbac.delete(api, docs)


def test_missing_rights_are_named_in_the_api_answer(cluster: PodCluster, tmp_path: Path) -> None:
    """A server whose ServiceAccount lacks a rule answers with the rule to add, not "Unhandled
    error", and loses nothing: the kernel comes back with its variables once the rule is added."""
    from tests.support import rbac

    api = cluster.core.api_client
    docs = rbac.without(rbac.load(rbac.RBAC, NAMESPACE, "e2e-no-delete"), "pods", "delete")
    rbac.apply(api, docs)
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig, token = rbac.service_account_kubeconfig(
        cluster.plane, api, NAMESPACE, account, tmp_path / "server.kubeconfig"
    )
    rbac.wait_allowed(cluster.plane, token, "create", "pods", NAMESPACE)
    running = start_server(tmp_path, cluster.config(kubeconfig=str(kubeconfig)))
    kernel_id = None
    try:
        kernel_id = running.start_kernel(SIZE)
        assert running.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        refused = running.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert refused.status == 500, refused
        message = refused.body["message"]
        assert "delete" in message and "pods" in message and "rbac.yaml" in message, message
        assert "Unhandled error" not in message
        # The checkpoint was committed before the pod was to go: the next cell's resume names
        # the same rule, and once the admin adds it, the kernel resumes with its variables.
        with running.channel(kernel_id, timeout=120) as chan:
            refused_cell = chan.execute("print(x + 1)", timeout=120)
        assert "may not delete pods" in refused_cell.error, refused_cell
        shipped = rbac.load(rbac.RBAC, NAMESPACE, "e2e-no-delete")
        role = next(d for d in shipped if d["kind"] == "ClusterRole" and "pods" in str(d["rules"]))
        client.RbacAuthorizationV1Api(api).replace_cluster_role(role["metadata"]["name"], role)
        rbac.wait_allowed(cluster.plane, token, "delete", "pods", NAMESPACE)
        assert running.execute(kernel_id, "print(x + 1)", timeout=120).strip() == "42"
    finally:
        running.stop()
        if kernel_id is not None and cluster.pod_of(kernel_id) is not None:
            cluster.core.delete_namespaced_pod(f"kernel-{kernel_id}", NAMESPACE, grace_period_seconds=0)
        rbac.delete(api, docs)


def test_pods_of_the_previous_labels_are_adopted_and_other_releases_and_eg_pods_left_alone(
    cluster: PodCluster, server: RunningServer, tmp_path: Path
) -> None:
    """An upgrade from the version that wrote Enterprise Gateway's bare labels: its running kernel
    pod (``component: kernel``, ``kernel_id``, no instance) is adopted, hibernated and resumed into a
    pod with the prefixed labels only; EG's kernel pod and another release's in the same namespace
    are neither adopted nor deleted."""
    from kernelmgr.kube.labels import label_value

    kernel_id = server.start_kernel(SIZE)
    assert server.execute(kernel_id, "x = 41; import os; print(os.getpid())").strip()
    pid = server.execute(kernel_id, "print(os.getpid())").strip()
    owner = model(server, kernel_id)["owner"]
    labels = cluster.pod_of(kernel_id).metadata.labels
    assert labels["elastic.jupyter.org/owner"] == label_value(owner)
    assert labels["app.kubernetes.io/instance"] == "jupyter-elastic-kernels"
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    # What the previous version wrote on its pod and Secret.
    name = f"kernel-{kernel_id}"
    old = {
        "app.kubernetes.io/instance": None,
        "app.kubernetes.io/component": None,
        "elastic.jupyter.org/kernel-id": None,
        "elastic.jupyter.org/owner": None,
        "component": "kernel",
        "kernel_id": kernel_id,
    }
    cluster.core.patch_namespaced_pod(name, NAMESPACE, {"metadata": {"labels": old}})
    cluster.core.patch_namespaced_secret(name, NAMESPACE, {"metadata": {"labels": old}})
    # Enterprise Gateway's kernel pod, and another release's, beside it (never scheduled).
    others = {
        "eg-kernel": {"component": "kernel", "kernel_id": "eg-1"},
        "other-release": {
            "app.kubernetes.io/name": "jupyter-elastic-kernels",
            "app.kubernetes.io/instance": "other",
            "app.kubernetes.io/component": "kernel",
            "elastic.jupyter.org/kernel-id": "other-1",
        },
    }
    for pod_name, pod_labels in others.items():
        cluster.core.create_namespaced_pod(
            NAMESPACE,
            {
                "metadata": {
                    "name": pod_name,
                    "labels": pod_labels,
                    "annotations": {"elastic.jupyter.org/owner": owner},
                },
                "spec": {
                    "nodeSelector": {"elastic.test/nowhere": "true"},
                    "containers": [{"name": "k", "image": "python:3.12", "command": ["true"]}],
                },
            },
        )
    restarted = start_server(tmp_path, cluster.config())
    try:
        wait_for(lambda: model(restarted, kernel_id)["state"] == "running", 60, "the old pod to be adopted")
        assert restarted.execute(kernel_id, "print(os.getpid(), x + 1)").split() == [pid, "42"]
        ids = {k["id"] for k in restarted.get("/api/elastic/kernels")}
        assert ids == {kernel_id}, ids
        hibernate(restarted, cluster, kernel_id)
        assert restarted.execute(kernel_id, "print(x + 2)", timeout=120).strip() == "43"
        labels = cluster.running_pod(kernel_id).metadata.labels
        assert labels["elastic.jupyter.org/kernel-id"] == kernel_id and "kernel_id" not in labels
        assert "component" not in labels and labels["app.kubernetes.io/component"] == "kernel"
        assert {p.metadata.name for p in cluster.core.list_namespaced_pod(NAMESPACE).items} >= set(others)
        restarted.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
    finally:
        restarted.stop()
        for pod_name in others:
            cluster.core.delete_namespaced_pod(pod_name, NAMESPACE, grace_period_seconds=0)


def test_the_server_tells_kubectl_what_it_did_to_each_kernel_pod(cluster: PodCluster, tmp_path: Path) -> None:
    """Kubernetes Events on the kernel's pods, read back through the API (what ``kubectl describe
    pod`` shows): started, hibernated, resumed, lost, and a launch that failed, with why."""
    running = start_server(tmp_path, cluster.config(launch_timeout=30.0))

    def events(pod_name: str) -> list[tuple[str, str, str]]:
        listed = cluster.core.list_namespaced_event(
            NAMESPACE, field_selector=f"involvedObject.name={pod_name},involvedObject.kind=Pod"
        ).items
        return [
            (e.reason, e.type, e.message)
            for e in sorted(listed, key=lambda e: e.metadata.creation_timestamp)
            if e.source.component == "jupyter-elastic-kernels"
        ]

    def reasons(pod_name: str) -> list[str]:
        return [reason for reason, _, _ in events(pod_name)]

    try:
        kernel_id = running.start_kernel(SIZE)
        assert running.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        first = cluster.pod_of(kernel_id)
        wait_for(lambda: reasons(first.metadata.name) == ["KernelStarted"], 30, "the start's Event")
        hibernate(running, cluster, kernel_id)
        # On the pod that was deleted (its uid): kubectl get events still lists it.
        wait_for(lambda: "Hibernated" in reasons(first.metadata.name), 30, "the hibernation's Event")
        (_, kind, message), *_ = [e for e in events(first.metadata.name) if e[0] == "Hibernated"]
        assert kind == "Normal" and kernel_id in message and "hibernated (api)" in message, message
        assert running.execute(kernel_id, "print(x + 1)", timeout=120).strip() == "42"
        second = cluster.running_pod(kernel_id)
        wait_for(
            lambda: {"KernelStarted", "Resumed"} <= set(reasons(second.metadata.name)), 30, "resume Events"
        )
        # Lost: the pod deleted behind the server's back (checkpointed at SIGTERM, hibernated).
        cluster.core.delete_namespaced_pod(second.metadata.name, NAMESPACE)
        wait_for(lambda: hibernated_model(running, kernel_id), 90, "the lost kernel to be hibernated")
        wait_for(lambda: "KernelLost" in reasons(second.metadata.name), 30, "the loss's Event")
        lost = next(e for e in events(second.metadata.name) if e[0] == "KernelLost")
        assert lost[1] == "Warning" and "lost" in lost[2], lost
        running.shutdown_kernel(kernel_id)
        # A launch that cannot run: no node takes it (both cordoned), launch_timeout passes.
        for runner in cluster.runners:
            cluster.cordon(runner.node_name)

        def launch_failures() -> list[Any]:  # this test's: earlier tests share the namespace
            listed = cluster.core.list_namespaced_event(NAMESPACE).items
            return [e for e in listed if e.reason == "LaunchFailed" and e.metadata.uid not in earlier]

        earlier: set[str] = set()
        earlier = {e.metadata.uid for e in launch_failures()}
        reply = running.request("POST", "/api/kernels", {"name": SIZE})
        assert reply.status >= 400, reply
        wait_for(launch_failures, 30, "the failed launch's Event")
        (failed,) = launch_failures()
        assert failed.type == "Warning" and "launch_timeout" in failed.message, failed.message
        assert failed.involved_object.name.startswith("kernel-")
        # And on /metrics: the failed start by why, every watch's lists and last event's age.
        text = running.text("/metrics")
        assert re.search(
            r'^elastic_kernel_start_failures_total\{reason="(unschedulable|timeout)",size="whole"\} 1\.0$',
            text,
            re.M,
        ), text
        assert re.search(rf'^elastic_informer_lists_total\{{informer="pod-{NAMESPACE}"\}} [1-9]', text, re.M)
        assert re.search(
            rf'^elastic_informer_last_event_age_seconds\{{informer="pod-{NAMESPACE}"\}} ', text, re.M
        )
        assert re.search(r'^elastic_kernel_start_duration_seconds_count\{size="whole"\} 1\.0$', text, re.M)
    finally:
        for runner in cluster.runners:
            cluster.cordon(runner.node_name, False)
        running.stop()


def test_an_upgrade_from_the_registry_file_imports_it_once(cluster: PodCluster, tmp_path: Path) -> None:
    """An earlier version kept the kernel registry in a file beside the checkpoints, not in ConfigMaps:
    the first server of this version lists its hibernated kernel (which resumes), writes its record
    as a ConfigMap and renames the file; a later server never reads it again."""
    from kernelmgr.lifecycle.records import KernelRecord, KernelStateFile

    selector = "elastic.jupyter.org/component=kernel-record"
    # Earlier tests in this namespace left hibernated kernels' records (their servers are gone):
    # this upgrade starts from an install whose only kernel is this test's.
    cluster.core.delete_collection_namespaced_config_map(NAMESPACE, label_selector=selector)
    wait_for(
        lambda: not cluster.core.list_namespaced_config_map(NAMESPACE, label_selector=selector).items,
        60,
        "no earlier record ConfigMap",
    )
    first = start_server(tmp_path, cluster.config())
    try:
        kernel_id = first.start_kernel(SIZE)
        assert first.execute(kernel_id, "kept = 41 + 1; print(kept)").strip() == "42"
        hibernate(first, cluster, kernel_id)
    finally:
        first.stop()
    # What the earlier version left: the same record in its file, and no ConfigMap.
    (item,) = cluster.core.list_namespaced_config_map(NAMESPACE, label_selector=selector).items
    registry = item.metadata.labels["elastic.jupyter.org/registry"]
    record = KernelRecord.from_dict(json.loads(item.data["record.json"]))
    # The size's definition travels with the record (a size removed later is rebuilt from it).
    assert record.profile_definition and record.profile_definition["name"] == record.profile, record
    legacy = cluster.checkpoints / f"kernels-{registry}.json"
    KernelStateFile(legacy).save({kernel_id: record})
    cluster.core.delete_namespaced_config_map(item.metadata.name, NAMESPACE)
    wait_for(
        lambda: not cluster.core.list_namespaced_config_map(NAMESPACE, label_selector=selector).items,
        60,
        "no record ConfigMap",
    )

    second = start_server(tmp_path, cluster.config())
    try:
        assert model(second, kernel_id)["state"] == "hibernated"
        assert not legacy.exists() and legacy.with_name(legacy.name + ".imported").exists()
        (item,) = cluster.core.list_namespaced_config_map(NAMESPACE, label_selector=selector).items
        assert json.loads(item.data["record.json"])["kernel_id"] == kernel_id
        assert second.execute(kernel_id, "print(kept)", timeout=120).strip() == "42"
        second.shutdown_kernel(kernel_id)
        wait_for(
            lambda: not cluster.core.list_namespaced_config_map(NAMESPACE, label_selector=selector).items,
            60,
            "the record to go with its kernel",
        )
    finally:
        second.stop()
    third = start_server(tmp_path, cluster.config())  # the imported file is not read again
    try:
        assert third.request("GET", f"/api/elastic/kernels/{kernel_id}").status == 404
        assert third.get("/api/kernels") == []
    finally:
        third.stop()
