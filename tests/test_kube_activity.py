"""Kubernetes mode reads per-kernel GPU activity from the node agents, against the real control plane.

The node agent runs AS A POD on the node runner ("runner-0"), its spec taken from the shipped
DaemonSet (deploy/kubernetes/node-agent.yaml) with three test changes: the host ``/proc`` hostPath
points at a fake ``/proc`` tree (the runner maps hostPath volumes to local folders), the NVML TEST
DOUBLE (``FileNvmlDouble``) reads its script from another hostPath, and it samples more often. The
"kernel" is a real pod with the kernel labels; its UID comes from the API and goes into the fake
``/proc/<pid>/cgroup`` as the kubelet would write it. No environ file is written, so the agent
cannot name the kernel: only the server's pod UID -> kernel id mapping can.

Two levels:

* the adapter (:class:`kernelmgr.server.cluster_activity.ClusterGpuSampler`) driven directly, with
  the real watches (agent pods, kernel pods) and a clock the test moves, so idle seconds are exact;
* a real jupyter_server subprocess in Kubernetes mode with a kernel pod it started, read through
  ``/api/elastic/kernels/<id>`` and ``/api/elastic/policy``.

An agent pod that runs but does not answer makes its node's kernels "not measured", never idle.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from kernelmgr.activity.gpu import GpuActivity  # noqa: E402
from kernelmgr.kube.cluster import KubeCluster  # noqa: E402
from kernelmgr.kube.labels import DEFAULT_INSTANCE, kernel_labels  # noqa: E402
from kernelmgr.kube.node_agents import NodeAgentClient  # noqa: E402
from kernelmgr.kube.settings import KubeSettings  # noqa: E402
from kernelmgr.server.cluster_activity import ClusterGpuSampler  # noqa: E402
from tests.support import rbac  # noqa: E402
from tests.support.node_runner import NodeRunner  # noqa: E402

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parent.parent
NVML_DOUBLE = "kernelmgr.activity.nvml_double.FileNvmlDouble"
GPU = "GPU-agent-0000"
KERNEL_PID = 4242
CID = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
# Not the defaults (9401, 52000): other test sessions on this machine run pods on the same loopback IPs.
AGENT_PORT = random.randrange(20000, 30000)
FIRST_KERNEL_PORT = random.randrange(30000, 40000, 5)
ON_RUNNER = {"kubernetes.io/hostname": "runner-0"}
#: The agents' shared token, in the Secret the shipped DaemonSet mounts.
AGENT_TOKEN = "agent-token-for-this-test"


class Host:
    """The runner node's host folders for this test: a fake /proc and the NVML double's script."""

    def __init__(self, runner: NodeRunner, namespace: str) -> None:
        self.path = f"/elastic-test/{namespace}"  # as the pod spec names it
        self.local = runner.volumes_root / "host" / self.path.lstrip("/")
        self.proc = self.local / "proc"
        self.script = self.local / "nvml" / "gpu.json"
        self.proc.mkdir(parents=True)
        self.script.parent.mkdir(parents=True)
        self.gpu(None)

    def add_pod_process(self, pid: int, pod_uid: str) -> None:
        """A process in the pod's cgroup (cgroupfs driver, cgroup v2), as the kubelet makes it."""
        directory = self.proc / str(pid)
        directory.mkdir()
        (directory / "cgroup").write_text(f"0::/kubepods/burstable/pod{pod_uid}/{CID}\n")
        (directory / "stat").write_text(f"{pid} (python) S 1 {pid} {pid} 0 -1\n")

    def gpu(self, sm_percent: int | None, memory_mib: int = 1024) -> None:
        """What the GPU shows: the kernel's process at ``sm_percent`` (None: no process on the GPU)."""
        processes = (
            []
            if sm_percent is None
            else [{"pid": KERNEL_PID, "device": GPU, "memory_mib": memory_mib, "sm_percent": sm_percent}]
        )
        script = {
            "devices": [{"uuid": GPU, "name": "Test H100", "memory_mib": 81920}],
            "processes": processes,
        }
        tmp = self.script.with_suffix(".tmp")
        tmp.write_text(json.dumps(script))
        tmp.replace(self.script)


def agent_token_secret(core: Any, namespace: str) -> None:
    """The Secret the shipped DaemonSet mounts its --token-file from (as an admin or the chart makes it)."""
    (daemonset,) = rbac.read(rbac.NODE_AGENT)
    volume = next(v for v in daemonset["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    secret = {"metadata": {"name": volume["secret"]["secretName"]}, "stringData": {"token": AGENT_TOKEN}}
    try:
        core.create_namespaced_secret(namespace, secret)
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def agent_pod(name: str, host: Host) -> dict[str, Any]:
    """A pod with the shipped DaemonSet's template, pointed at the test's host folders."""
    (daemonset,) = rbac.read(rbac.NODE_AGENT)
    template = copy.deepcopy(daemonset["spec"]["template"])
    spec = template["spec"]
    spec["nodeSelector"] = ON_RUNNER
    for volume in spec["volumes"]:
        if volume.get("hostPath", {}).get("path") == "/proc":
            volume["hostPath"]["path"] = f"{host.path}/proc"
    spec["volumes"].append({"name": "nvml", "hostPath": {"path": f"{host.path}/nvml"}})
    (container,) = spec["containers"]
    container["volumeMounts"].append({"name": "nvml", "mountPath": "/nvml", "readOnly": True})
    container["ports"][0]["containerPort"] = AGENT_PORT
    container["args"] = [a for a in container["args"] if not a.startswith(("--interval", "--port"))]
    container["args"] += ["--interval=0.3", f"--port={AGENT_PORT}", f"--nvml-class={NVML_DOUBLE}"]
    container["env"] += [
        {"name": "ELASTIC_NVML_DOUBLE_FILE", "value": "/nvml/gpu.json"},
        {"name": "PYTHONPATH", "value": str(REPO)},  # this checkout's kernelmgr, as the image would have
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **template["metadata"]},
        "spec": spec,
    }


def silent_agent_pod(name: str) -> dict[str, Any]:
    """An agent pod that runs but never answers (a hung or firewalled agent)."""
    (daemonset,) = rbac.read(rbac.NODE_AGENT)
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    container = {
        "name": "node-agent",
        "image": "silent",
        "command": ["python", "-c", "import time; time.sleep(3600)"],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeSelector": ON_RUNNER, "containers": [container], "terminationGracePeriodSeconds": 0},
    }


def kernel_pod(kernel_id: str) -> dict[str, Any]:
    """A pod labelled as the provisioner labels kernel pods (its process stands in for the kernel)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"kernel-{kernel_id}",
            "labels": kernel_labels(DEFAULT_INSTANCE, kernel_id, "alice"),
        },
        "spec": {
            "nodeSelector": ON_RUNNER,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "kernel",
                    "image": "python",
                    "command": ["python", "-c", "import time; time.sleep(3600)"],
                }
            ],
        },
    }


def running(core: Any, namespace: str, name: str) -> Any:
    def check() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase == "Running" and pod.status.pod_ip else None

    return wait_for(check, 60, f"pod {name} to run")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def informers(kube_plane: ControlPlane) -> Iterator[KubeCluster]:
    """The cluster object the server would make: its watches are stopped after the test."""
    cluster = KubeCluster(KubeSettings(kubeconfig=str(kube_plane.admin_kubeconfig)))
    yield cluster
    cluster.stop()


def sample_until(
    sampler: ClusterGpuSampler, kernel_id: str, predicate: Any, what: str, timeout: float = 60
) -> GpuActivity:
    """Sample (as the culler's timer does) until ``predicate(activity)``; the agents sample on their own."""
    seen: list[GpuActivity] = []

    def once() -> GpuActivity | None:
        activity = asyncio.run(sampler.sample({kernel_id: [GPU]}))[kernel_id]
        seen[:] = [activity]
        return activity if predicate(activity) else None

    try:
        result: GpuActivity = wait_for(once, timeout, what)
    except Exception as exc:
        raise AssertionError(f"{what}: last {seen}, source {sampler.source()}") from exc
    return result


def test_sampler_reads_the_agent_pod_through_the_watch_busy_idle_then_not_measured(
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_runner: NodeRunner,
    kube_namespace: str,
    informers: KubeCluster,
) -> None:
    core: Any = client.CoreV1Api(kube_api)
    namespace = kube_namespace
    host = Host(kube_runner, namespace)
    kernel_id = "k-agentwire-1"
    pod = core.create_namespaced_pod(namespace, kernel_pod(kernel_id))
    host.add_pod_process(KERNEL_PID, pod.metadata.uid)
    agent_token_secret(core, namespace)
    core.create_namespaced_pod(namespace, agent_pod("agent", host))
    running(core, namespace, "agent")
    running(core, namespace, pod.metadata.name)

    kernels = informers.pod_informer(namespace)
    agents = informers.agent_informer(namespace)
    assert kernels.wait_synced(60) and agents.wait_synced(60)
    clock = Clock()
    sampler = ClusterGpuSampler(
        agents,
        informers.kernel_pods,
        AGENT_PORT,
        busy_threshold=5.0,
        client=NodeAgentClient(token=AGENT_TOKEN),
        clock=clock,
        namespace=namespace,
    )

    # Busy: the agent on the kernel pod's node sees its process at 60 % SM.
    host.gpu(60)
    busy = sample_until(sampler, kernel_id, lambda a: a.utilization == 60.0, "the kernel to look busy")
    assert busy.available and busy.memory_mib == 1024 and busy.idle_seconds == 0.0
    assert busy.source == "node-agents" and sampler.source() == "node-agents"
    assert sampler.last is not None
    reported = sampler.last.kernels[kernel_id]
    assert reported.pod_uids == [pod.metadata.uid] and reported.source == "pod-watch"
    assert reported.nodes == ["runner-0"]

    # Idle: still holding memory, no SM use; idle time counts from the last busy sample.
    host.gpu(0)
    idle = sample_until(sampler, kernel_id, lambda a: a.utilization == 0.0, "the kernel to look idle")
    assert idle.available and idle.memory_mib == 1024 and idle.idle_seconds == 0.0
    clock.now += 90
    later = asyncio.run(sampler.sample({kernel_id: [GPU]}))[kernel_id]
    assert later.available and later.utilization == 0.0 and later.idle_seconds == 90.0

    # The agent answers but no longer lists the kernel's process: 0 %, still measured.
    host.gpu(None)
    gone = sample_until(sampler, kernel_id, lambda a: a.memory_mib == 0, "the process to leave the GPU")
    assert gone.available and gone.utilization == 0.0 and gone.idle_seconds == 90.0

    # The node's agent stops answering (its pod runs, nothing listens): not measured, never idle.
    core.delete_namespaced_pod("agent", namespace, grace_period_seconds=0)
    wait_for(lambda: "agent" not in agents.items(), 60, "the watch to see the agent pod go")
    absent = asyncio.run(sampler.sample({kernel_id: [GPU]}))[kernel_id]
    assert not absent.available and absent.idle_seconds is None
    assert absent.reason == "no node agent is running on node runner-0"
    assert sampler.source().startswith("unavailable: no running node agent pods")
    core.create_namespaced_pod(namespace, silent_agent_pod("silent"))
    running(core, namespace, "silent")
    wait_for(lambda: (p := agents.items().get("silent")) and p.status.pod_ip, 60, "the watch to see it run")
    silent = asyncio.run(sampler.sample({kernel_id: [GPU]}))[kernel_id]
    assert not silent.available and silent.idle_seconds is None and silent.utilization is None
    assert silent.reason.startswith("node agent on runner-0: "), silent.reason
    assert "/activity" in silent.reason
    assert sampler.source().startswith("node-agents: 1 of 1 agent(s) not usable")
    assert silent.last_busy == busy.sampled_at  # remembered, but no idle time counted meanwhile

    # An agent answers again, 50 s later: the unmeasured time is not idle time; counting restarts.
    core.delete_namespaced_pod("silent", namespace, grace_period_seconds=0)
    core.create_namespaced_pod(namespace, agent_pod("agent-2", host))
    clock.now += 50
    back = sample_until(sampler, kernel_id, lambda a: a.available, "the new agent to answer")
    assert back.utilization == 0.0 and back.idle_seconds == 0.0
    clock.now += 10
    assert asyncio.run(sampler.sample({kernel_id: [GPU]}))[kernel_id].idle_seconds == 10.0


# ---- the real server in Kubernetes mode


def server_config(plane: ControlPlane, namespace: str, checkpoints: Path) -> dict[str, Any]:
    token_file = checkpoints.parent / "agent-token"
    token_file.write_text(AGENT_TOKEN)
    return {
        "ElasticKernels": {
            "profiles": {"whole": {"gpu_fraction": 1}},
            "gpu_inventory": [{"uuid": GPU, "name": "Test H100", "memory_mib": 81920}],
            "reap_interval": 1,
            "gpu_sample_interval": 0.5,
            "checkpoint_root": str(checkpoints),
            "kernel_provisioner": "elastic-kubernetes-provisioner",
            # The stop cleans the namespace for the next test (pod mode's default leaves pods running).
            "hibernate_on_shutdown": True,
        },
        # node_agent_namespace left empty: the agents are found in the kernel namespace.
        "ElasticKubernetesProvisioner": {
            "namespace": namespace,
            "kubeconfig": str(plane.admin_kubeconfig),
            "image": "python:3.12",
            "node_selector": ON_RUNNER,
            "run_as_user": os.getuid() or 1000,
            "launch_timeout": 60.0,
            "first_port": FIRST_KERNEL_PORT,
            "node_agent_port": AGENT_PORT,
            "node_agent_token_file": str(token_file),
        },
    }


def test_server_shows_the_agents_numbers_per_kernel_and_not_measured_without_them(
    kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner, kube_namespace: str, tmp_path: Path
) -> None:
    from tests.support.server import start_server

    core: Any = client.CoreV1Api(kube_api)
    namespace = kube_namespace
    host = Host(kube_runner, namespace)
    host.gpu(60)
    agent_token_secret(core, namespace)
    core.create_namespaced_pod(namespace, agent_pod("agent", host))
    running(core, namespace, "agent")
    server = start_server(tmp_path / "server", server_config(kube_plane, namespace, tmp_path / "ck"))
    try:
        kernel_id = server.start_kernel("python3-gpu-whole")
        pod = running(core, namespace, f"kernel-{kernel_id}")
        host.add_pod_process(KERNEL_PID, pod.metadata.uid)  # the kernel's GPU process, in its pod's cgroup

        def activity(check: Any, what: str) -> dict[str, Any]:
            last: list[Any] = []

            def once() -> Any:
                last[:] = [server.get(f"/api/elastic/kernels/{kernel_id}")["activity"]]
                return last[0] if check(last[0]) else None

            try:
                found: dict[str, Any] = wait_for(once, 60, what)
            except Exception as exc:
                raise AssertionError(f"{what}: last {last}\n{server.log()[-4000:]}") from exc
            return found

        busy = activity(lambda a: a["gpu_utilization"] == 60.0, "the server to see the kernel busy")
        assert busy["gpu_memory_mib"] == 1024 and busy["gpu_activity_source"] == "node-agents"
        assert busy["idle_signals"] == "no cell run and no GPU activity"  # the policy counts the GPU
        assert server.get("/api/elastic/policy")["gpu_activity"] == "node-agents"

        host.gpu(0)
        idle = activity(lambda a: a["gpu_utilization"] == 0.0, "the server to see the kernel idle")
        assert idle["gpu_memory_mib"] == 1024 and idle["gpu_idle_seconds"] is not None

        # The agent goes away: the kernel is "not measured" (never idle) and the policy says so.
        core.delete_namespaced_pod("agent", namespace, grace_period_seconds=0)
        gone = activity(lambda a: a["gpu_utilization"] is None, "the server to lose the agent")
        assert gone["gpu_idle_seconds"] is None
        assert gone["gpu_activity_source"] == "unavailable: no node agent is running on node runner-0"
        assert gone["idle_signals"] == "no cell run; GPU activity not measurable here"
        assert server.get("/api/elastic/policy")["gpu_activity"].startswith(
            "unavailable: no running node agent pods"
        )
        # An agent pod that runs but does not answer: still not measured, and the reason says so.
        core.create_namespaced_pod(namespace, silent_agent_pod("silent"))
        silent = activity(
            lambda a: a["gpu_activity_source"].startswith("unavailable: node agent on runner-0: "),
            "the server to find the silent agent",
        )
        assert silent["gpu_idle_seconds"] is None and silent["gpu_utilization"] is None
        assert server.get("/api/elastic/policy")["gpu_activity"].startswith(
            "node-agents: 1 of 1 agent(s) not usable"
        )
        server.shutdown_kernel(kernel_id)
    finally:
        server.stop()
