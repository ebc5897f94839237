"""Kubernetes warm pods end to end: the real control plane, two runner nodes, a real jupyter_server.

A warm pod holds a slice of its size before any kernel does, shown as warm and never as a kernel; a
kernel takes it (start or resume) and must be indistinguishable from one in a cold pod: cells, cell
numbers, variables through hibernation cycles (the namespace oracle), the restore report, and
nothing of the warm pod's own in its environment. The checkpoints a warm-origin kernel writes stay
in its pod's emptyDir until the server commits them in its store, before the pod goes.
"""

from __future__ import annotations

import getpass
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from tests.support.gate import slow_to_load_cell  # noqa: E402
from tests.support.node_runner import NodeRunner  # noqa: E402
from tests.support.oracle import SETUP, Reference, check_same, cycle_cell, run_both  # noqa: E402
from tests.support.pod_cluster import PodCluster, pod_cluster  # noqa: E402
from tests.support.server import RunningServer, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("numpy")

NAMESPACE = "elastic-warm"
SIZE = "python3-gpu-whole"  # the kernelspec of the size "whole"


@pytest.fixture(scope="module")
def cluster(kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner) -> Iterator[PodCluster]:
    with pod_cluster(kube_plane, kube_api, kube_runner, NAMESPACE) as made:
        yield made


def warm_config(cluster: PodCluster, count: int = 1, starts: bool = True) -> dict[str, Any]:
    return cluster.config(warm_pods={"whole": {"count": count, "preload": ["numpy"], "starts": starts}})


@contextmanager
def serving(cluster: PodCluster, home: Path, config: dict[str, Any]) -> Iterator[RunningServer]:
    """A server for one test; once it has stopped, it has left no warm pod behind."""
    server = start_server(home, config)
    try:
        yield server
    finally:
        server.stop()
    wait_for(lambda: cluster.pods("warm-kernel") == [], 60, "the warm pods to be deleted")


def gpus(server: RunningServer) -> dict[str, Any]:
    return dict(server.get("/api/elastic/gpus"))


def warm_ready(server: RunningServer, count: int) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        doc = gpus(server)
        return doc if doc["warm_pods"].get("whole", {}).get("ready") == count else None

    return dict(wait_for(ready, 120, f"{count} warm pod(s) to be ready"))


def holders(doc: dict[str, Any]) -> list[tuple[str, bool]]:
    return sorted((s["kernel_id"], s["warm"]) for d in doc["devices"] for s in d["slices"])


def metric(server: RunningServer, name: str) -> float:
    """The sum of ``name`` over its labels."""
    text = server.text("/metrics")
    lines = [line for line in text.splitlines() if line.startswith((name + "{", name + " "))]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def hibernate(server: RunningServer, cluster: PodCluster, kernel_id: str) -> None:
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply.body
    assert cluster.pod_of(kernel_id) is None  # gone before the answer: its GPU is free


def test_kernels_take_warm_pods_and_keep_their_state_through_cycles(
    cluster: PodCluster, tmp_path: Path, reference: Reference
) -> None:
    with serving(cluster, tmp_path, warm_config(cluster)) as server:
        doc = warm_ready(server, 1)
        # The warm pod holds a slice, shown as warm; it is no kernel.
        assert [warm for _, warm in holders(doc)] == [True], doc
        assert server.get("/api/kernels") == []
        (warm_pod,) = cluster.pods("warm-kernel")
        # Made before its user is known: no checkpoint claim, no owner's key, only its token.
        assert all(v.persistent_volume_claim is None for v in warm_pod.spec.volumes)
        secret = cluster.core.read_namespaced_secret(warm_pod.metadata.name, NAMESPACE)
        assert sorted(secret.data) == ["warm-token"]

        kernel_id = server.start_kernel(SIZE)
        pod = cluster.running_pod(kernel_id)
        assert pod.metadata.name == warm_pod.metadata.name  # the kernel took the warm pod
        assert pod.metadata.annotations["elastic.jupyter.org/warm-pod"] == "true"
        run_both(server, kernel_id, reference, SETUP)
        check_same(server, kernel_id, reference)
        # (Binding no name: the oracle compares the namespaces.)
        probe = (
            "print(sorted(k for k in __import__('os').environ if k.startswith('ELASTIC_WARM')), "
            "'numpy' in __import__('sys').modules, "
            f"__import__('os').environ['ELASTIC_KERNEL_ID'] == {kernel_id!r})"
        )
        assert server.execute(kernel_id, probe).strip() == "[] True True"
        # The slice the warm pod held is the kernel's now; the pool refills on the other GPU.
        doc = warm_ready(server, 1)
        assert holders(doc)[0] == (kernel_id, False) and holders(doc)[1][1] is True, doc
        assert metric(server, "elastic_warm_pod_hits_total") == 1

        with server.channel(kernel_id, timeout=120) as tab:
            numbers = [tab.execute("pass").reply["content"]["execution_count"]]
            for n in range(1, 4):
                hibernate(server, cluster, kernel_id)
                # Committed in the server's store before the pod went.
                assert (cluster.checkpoints / getpass.getuser() / kernel_id / "current").exists()
                code = cycle_cell(n)
                result = tab.execute(code, timeout=120)
                assert result.error == "", result.error
                numbers.append(result.reply["content"]["execution_count"])
                reference.run(code)
                pod = cluster.running_pod(kernel_id)
                assert pod.metadata.name.startswith("warm-"), pod.metadata.name  # resumed warm
                check_same(server, kernel_id, reference)
                report = server.get(f"/api/elastic/kernels/{kernel_id}/report")["restore_report"]
                assert report["refused"] is None and "a" in report["restored"], report
                warm_ready(server, 1)
        # The notebook's cell numbers went on through the resumes (a fresh kernel would say 1).
        assert numbers == sorted(set(numbers)) and numbers[0] > 1, numbers
        assert metric(server, "elastic_warm_pod_hits_total") == 4
        server.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")


def test_a_kernelspec_with_its_own_image_never_takes_a_warm_pod(cluster: PodCluster, tmp_path: Path) -> None:
    """A warm pod runs the size's image and entry point: a kernel whose kernelspec has its own
    (kernelspec_images, kernelspec_argv) starts cold, counted as a miss."""
    config = warm_config(cluster)
    config["ElasticKubernetesProvisioner"]["kernelspec_images"] = {"python3": "python:3.12-own"}
    with serving(cluster, tmp_path, config) as server:
        warm_ready(server, 1)
        kernel_id = server.start_kernel(SIZE)
        pod = cluster.running_pod(kernel_id)
        assert pod.metadata.name == f"kernel-{kernel_id}", pod.metadata.name
        assert pod.spec.containers[0].image == "python:3.12-own"
        assert metric(server, "elastic_warm_pod_misses_total") == 1
        assert metric(server, "elastic_warm_pod_hits_total") == 0
        server.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")


def test_warm_pods_give_their_gpu_to_a_kernel_that_needs_it_and_refill_when_it_sleeps(
    cluster: PodCluster, tmp_path: Path
) -> None:
    # Both GPUs held by warm pods that new kernels do not take (``starts`` off): a new kernel must
    # still get one.
    with serving(cluster, tmp_path, warm_config(cluster, count=2, starts=False)) as server:
        warm_ready(server, 2)
        kernel_id = server.start_kernel(SIZE)
        pod = cluster.running_pod(kernel_id)
        assert pod.metadata.name == f"kernel-{kernel_id}"  # a cold pod: starts are not served warm
        assert server.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        doc = warm_ready(server, 1)
        assert [warm for _, warm in holders(doc)] == [False, True], doc
        assert metric(server, "elastic_warm_pod_misses_total") == 0  # a start the pool does not serve
        hibernate(server, cluster, kernel_id)
        warm_ready(server, 2)  # the GPU the kernel gave back holds a warm pod again
        assert server.execute(kernel_id, "print(x + 1)", timeout=120).strip() == "42"
        assert cluster.running_pod(kernel_id).metadata.name.startswith("warm-")  # the resume took one
        server.shutdown_kernel(kernel_id)


def test_a_restarted_server_adopts_a_kernel_in_a_warm_pod_and_still_collects_its_checkpoints(
    cluster: PodCluster, tmp_path: Path
) -> None:
    server = start_server(tmp_path, warm_config(cluster))
    warm_ready(server, 1)
    kernel_id = server.start_kernel(SIZE)
    assert server.execute(kernel_id, "x = 41; import os; print(os.getpid())").strip()
    pod_name = cluster.running_pod(kernel_id).metadata.name
    assert pod_name.startswith("warm-")
    warm_ready(server, 1)
    (leftover,) = [p.metadata.name for p in cluster.pods("warm-kernel")]
    server.process.send_signal(signal.SIGKILL)  # the server dies; the pods do not
    server.process.wait()

    with serving(cluster, tmp_path, warm_config(cluster)) as restarted:
        wait_for(
            lambda: restarted.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "running", 60, "adoption"
        )
        assert restarted.execute(kernel_id, "print(x + 1)").strip() == "42"  # the same process
        # The untaken warm pod of the dead server is gone, a new one stands in.
        wait_for(
            lambda: leftover not in [p.metadata.name for p in cluster.pods("warm-kernel")], 60, "cleanup"
        )
        warm_ready(restarted, 1)
        hibernate(restarted, cluster, kernel_id)  # the token is read back from the pod's Secret
        assert restarted.execute(kernel_id, "print(x + 2)", timeout=120).strip() == "43"
        restarted.shutdown_kernel(kernel_id)


def test_a_restarted_server_deletes_a_warm_kernel_pod_it_cannot_adopt(
    cluster: PodCluster, tmp_path: Path
) -> None:
    server = start_server(tmp_path, warm_config(cluster))
    warm_ready(server, 1)
    kernel_id = server.start_kernel(SIZE)
    assert server.execute(kernel_id, "print('up')").strip() == "up"
    pod_name = cluster.running_pod(kernel_id).metadata.name
    assert pod_name.startswith("warm-")
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    # Its connection file gone (as if the server died between the hand-off and writing it): the
    # pod cannot be adopted and must be deleted under its own name, not the cold pods' kernel-<id>.
    cluster.core.patch_namespaced_secret(pod_name, NAMESPACE, {"data": {"connection.json": None}})

    def pod_names() -> list[str]:
        return [p.metadata.name for p in cluster.core.list_namespaced_pod(NAMESPACE).items]

    with serving(cluster, tmp_path, warm_config(cluster)):
        wait_for(lambda: pod_name not in pod_names(), 60, "the pod nobody can adopt to be deleted")


def test_warm_pods_refuse_a_configuration_they_cannot_serve(cluster: PodCluster, tmp_path: Path) -> None:
    for extra, says in (
        ({"namespace_template": "jupyter-{owner}"}, "needs one kernel namespace"),
        ({"checkpoint_claim": ""}, "needs ElasticKubernetesProvisioner.checkpoint_claim"),
        ({"warm_pods": {"huge": {"count": 1}}}, "'huge' is not a GPU size"),
        ({"warm_pods": {"whole": {"count": -1}}}, "count must be an integer from 0 to 64"),
    ):
        config = warm_config(cluster)
        config["ElasticKubernetesProvisioner"].update(extra)
        with pytest.raises(RuntimeError, match="exited") as failed:
            start_server(tmp_path, config)
        assert says in str(failed.value), str(failed.value)[-2000:]


def test_a_warm_pods_slice_follows_it_to_the_node_it_runs_on(cluster: PodCluster, tmp_path: Path) -> None:
    config = warm_config(cluster)
    del config["ElasticKernels"]["gpu_inventory"]
    config["ElasticKernels"]["gpu_inventory_source"] = "kubernetes"
    # The scheduler may only use the last runner (a taint the pods do not tolerate, which the
    # allocator does not read), while the allocator's first choice is the first node by name.
    *others, target = sorted(r.node_name for r in cluster.runners)
    avoid = {"key": "elastic.test/avoid", "value": "true", "effect": "NoSchedule"}
    for name in others:
        cluster.core.patch_node(name, {"spec": {"taints": [avoid]}})
    server = start_server(tmp_path, config)
    try:
        doc = warm_ready(server, 1)
        (warm_pod,) = cluster.pods("warm-kernel")
        assert warm_pod.spec.node_name == target
        booked = [(d["node"], s["warm"]) for d in doc["devices"] for s in d["slices"]]
        assert booked == [(target, True)], booked
    finally:
        for name in others:
            cluster.core.patch_node(name, {"spec": {"taints": []}})
        server.stop()
    wait_for(lambda: cluster.pods("warm-kernel") == [], 60, "the warm pods to be deleted")


def test_faults_a_lost_warm_kernel_pod_a_warm_pod_deleted_under_a_take_a_failing_preload(
    cluster: PodCluster, tmp_path: Path
) -> None:
    config = warm_config(cluster)
    config["ElasticKernels"]["background_checkpoint_interval"] = 1
    with serving(cluster, tmp_path / "one", config) as server:
        warm_ready(server, 1)
        kernel_id = server.start_kernel(SIZE)
        assert server.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        pod = cluster.running_pod(kernel_id)
        assert pod.metadata.name.startswith("warm-")
        # A background checkpoint collected from the warm pod into the store...
        wait_for(lambda: server.get(f"/api/elastic/kernels/{kernel_id}")["checkpoint"], 60, "a checkpoint")
        # ... is what the kernel comes back to when its pod is lost (an admin, a drain, an eviction).
        cluster.core.delete_namespaced_pod(pod.metadata.name, NAMESPACE)
        state = lambda: server.get(f"/api/elastic/kernels/{kernel_id}")["state"]  # noqa: E731
        wait_for(lambda: state() == "hibernated", 60, "the lost kernel to be hibernated from its checkpoint")
        assert server.execute(kernel_id, "print(x + 1)", timeout=120).strip() == "42"

        # A ready warm pod deleted just before a kernel takes it: the kernel starts anyway.
        (warm,) = [p for p in cluster.pods("warm-kernel") if p.metadata.deletion_timestamp is None]
        cluster.core.delete_namespaced_pod(warm.metadata.name, NAMESPACE)
        second = server.start_kernel(SIZE)
        assert server.execute(second, "print('second')").strip() == "second"
        for kid in (kernel_id, second):
            server.shutdown_kernel(kid)

    # A preload that fails disables the pool (one error line), kernels start cold.
    failing = warm_config(cluster)
    failing["ElasticKubernetesProvisioner"]["warm_pods"]["whole"]["preload"] = ["no_such_module_here"]
    with serving(cluster, tmp_path / "two", failing) as server:
        wait_for(lambda: "warm pods of whole disabled" in server.log(), 120, "the pool to be disabled")
        assert "no_such_module_here" in server.log()
        kernel_id = server.start_kernel(SIZE)
        assert cluster.running_pod(kernel_id).metadata.name == f"kernel-{kernel_id}"
        assert server.execute(kernel_id, "print('cold')").strip() == "cold"
        assert 'reason="preload_failed"' in server.text("/metrics")
        assert gpus(server)["warm_pods"]["whole"] == {"ready": 0, "starting": 0}
        server.shutdown_kernel(kernel_id)


def test_a_kernel_in_a_warm_pod_restarts_into_a_fresh_pod_on_its_slice(
    cluster: PodCluster, tmp_path: Path
) -> None:
    with serving(cluster, tmp_path, warm_config(cluster)) as server:
        warm_ready(server, 1)
        kernel_id = server.start_kernel(SIZE)
        assert server.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        before = cluster.running_pod(kernel_id).metadata.name
        assert before.startswith("warm-")
        devices = server.get(f"/api/elastic/kernels/{kernel_id}")["slice"]["devices"]
        warm_ready(server, 1)  # a warm pod the restart must neither take nor push out
        reply = server.request("POST", f"/api/kernels/{kernel_id}/restart")
        assert reply.status == 200, reply.body
        after = cluster.running_pod(kernel_id)
        assert after.metadata.name == f"kernel-{kernel_id}", after.metadata.name  # fresh and cold
        assert server.execute(kernel_id, "print('x' in globals())").strip() == "False"
        assert server.get(f"/api/elastic/kernels/{kernel_id}")["slice"]["devices"] == devices
        doc = warm_ready(server, 1)
        assert sorted(warm for _, warm in holders(doc)) == [False, True], doc  # nothing leaked
        server.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")


def test_a_warm_pod_that_never_gets_ready_gives_its_gpu_back_and_the_pool_tries_later(
    cluster: PodCluster, tmp_path: Path
) -> None:
    config = warm_config(cluster)
    config["ElasticKubernetesProvisioner"]["launch_timeout"] = 3.0
    avoid = {"key": "elastic.test/avoid", "value": "true", "effect": "NoSchedule"}
    for runner in cluster.runners:  # nowhere to run: the warm pod stays Pending
        cluster.core.patch_node(runner.node_name, {"spec": {"taints": [avoid]}})
    server = start_server(tmp_path, config)
    try:
        wait_for(lambda: "not ready after" in server.log(), 60, "the pending warm pod to be given up")
        for runner in cluster.runners:
            cluster.core.patch_node(runner.node_name, {"spec": {"taints": []}})
        warm_ready(server, 1)  # after the back-off, a new one
        assert "did not become ready in time" in server.log()
    finally:
        for runner in cluster.runners:
            cluster.core.patch_node(runner.node_name, {"spec": {"taints": []}})
        server.stop()
    wait_for(lambda: cluster.pods("warm-kernel") == [], 60, "the warm pods to be deleted")


def test_deleting_a_kernel_while_it_resumes_in_a_warm_pod_frees_everything(
    cluster: PodCluster, tmp_path: Path
) -> None:
    with serving(cluster, tmp_path, warm_config(cluster)) as server:
        warm_ready(server, 1)
        kernel_id = server.start_kernel(SIZE)
        # Its resume takes 90 s: one to cut into, even on a loaded machine (the delete cancels it).
        server.execute(kernel_id, slow_to_load_cell(90))
        hibernate(server, cluster, kernel_id)
        warm_ready(server, 1)
        with ThreadPoolExecutor(1) as background:
            resuming = background.submit(server.request, "POST", f"/api/elastic/kernels/{kernel_id}/resume")
            state = lambda: server.get(f"/api/elastic/kernels/{kernel_id}")["state"]  # noqa: E731
            wait_for(lambda: state() == "resuming", 30, "the resume to begin", interval=0.05)
            wait_for(
                lambda: cluster.pod_of(kernel_id) is not None, 30, "the warm pod to be taken", interval=0.05
            )
            # The delete answers once the cancelled resume has cleaned up (its pod deleted through the
            # API server): minutes on a loaded machine (CI timed a 60 s wait out once), not a hang.
            deleted = server.request("DELETE", f"/api/kernels/{kernel_id}", timeout=240)
            assert deleted.status == 204, deleted
            answer = resuming.result(timeout=240)
        assert answer.status in (404, 409) and answer.body["message"], answer  # never a 5xx
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the taken warm pod to be deleted")
        assert kernel_id not in [k["id"] for k in server.get("/api/kernels")]
        doc = warm_ready(server, 1)
        assert [warm for _, warm in holders(doc)] == [True], doc  # only the refilled warm pod holds a GPU
        assert cluster.secrets() == []
