"""More than one gateway, and the kernel registry in the Kubernetes API, against the real control plane.

- the registry is one ConfigMap per kernel, no file on the claim and no SQLite there: a gateway
  started with nothing but the API lists a hibernated kernel (no pod) and adopts a running one;
- two gateways share a ``coordination.k8s.io`` Lease: the standby is not ready and refuses kernel
  starts; SIGKILL the active one and the standby serves the same kernels (same process, same
  variables) within the Lease duration plus adoption;
- a leader stopped (SIGSTOP) past its Lease, then continued, writes nothing: the API server's
  audit log (kube-apiserver ``--audit-log-path``) holds no successful write from it after the
  standby took over, and it exits;
- the fence itself: a Lease holder whose renewals stopped refuses every write at once, and a gateway
  without the Lease makes no per-user namespace, RoleBinding or NetworkPolicy (none appears).

Its own control plane (module scope) with an audit log; the pods run on the node runners.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from kernelmgr.kube.access import ExplainedCoreV1Api  # noqa: E402
from kernelmgr.kube.leader import Fenced, LeaderLease  # noqa: E402
from tests.support.node_runner import NodeRunner  # noqa: E402
from tests.support.pod_cluster import PodCluster, pod_cluster  # noqa: E402
from tests.support.server import RunningServer, start_server  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

NAMESPACE = "elastic-failover"
SIZE = "python3-gpu-whole"
#: The test's Lease timings (the defaults are 15 / 10 / 2 s): failover within LEASE + RETRY + adoption.
LEASE, RENEW, RETRY = 6.0, 4.0, 1.0
WRITES = ("create", "update", "patch", "delete", "deletecollection")
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
"""


# ---- a control plane of our own, with the API server's audit log


@pytest.fixture(scope="module")
def kube_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    root = tmp_path_factory.mktemp("failover-plane")
    policy = root / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    audit = [f"--audit-policy-file={policy}", f"--audit-log-path={root / 'audit.log'}"]
    with ControlPlane(root / "plane", extra_args={"kube-apiserver": audit}) as plane:
        plane.audit_log = root / "audit.log"  # type: ignore[attr-defined]
        yield plane


@pytest.fixture(scope="module")
def kube_api(kube_plane: ControlPlane) -> Iterator[Any]:
    with kube_plane.api_client() as api:
        yield api


@pytest.fixture(scope="module")
def kube_runner(kube_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeRunner]:
    with NodeRunner(
        kube_plane.configuration(user="system:node:runner-0", groups=["system:nodes"]),
        "runner-0",
        tmp_path_factory.mktemp("failover-runner"),
        capacity={"nvidia.com/gpu": "1"},
        heartbeat_interval=5,
        admin_configuration=kube_plane.configuration(),
    ) as runner:
        yield runner


@pytest.fixture(scope="module")
def cluster(kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner) -> Iterator[PodCluster]:
    with pod_cluster(kube_plane, kube_api, kube_runner, NAMESPACE) as made:
        yield made


def gateway_config(cluster: PodCluster, lease: str | None) -> dict[str, Any]:
    config = cluster.config()
    if lease is not None:
        config["ElasticLeaderElection"] = {
            "enabled": True,
            "lease_name": lease,
            "lease_duration": LEASE,
            "renew_deadline": RENEW,
            "retry_period": RETRY,
        }
    return config


def ready(server: RunningServer) -> bool:
    """The readiness probe's answer (what the Service routes by)."""
    return bool(server.request("GET", "/api/elastic/leader", token=None).status == 200)


def records(cluster: PodCluster) -> dict[str, dict[str, Any]]:
    """The kernel records in the API: kernel id -> record."""
    found = cluster.core.list_namespaced_config_map(
        NAMESPACE, label_selector="elastic.jupyter.org/component=kernel-record"
    )
    return {
        item.metadata.labels["elastic.jupyter.org/kernel-id"]: json.loads(item.data["record.json"])
        for item in found.items
    }


def hibernate(server: RunningServer, cluster: PodCluster, kernel_id: str) -> None:
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply.body
    assert cluster.pod_of(kernel_id) is None


def stopped(*servers: RunningServer) -> None:
    for server in servers:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGCONT)
        server.stop()


def cleanup(cluster: PodCluster) -> None:
    """Delete what a test left (pods, Secrets, records, Leases) with admin rights."""
    core = cluster.core
    for pod in core.list_namespaced_pod(NAMESPACE).items:
        core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
    for secret in cluster.secrets():
        core.delete_namespaced_secret(secret, NAMESPACE)
    for kernel_id in records(cluster):
        core.delete_namespaced_config_map(f"elastic-kernel-{kernel_id}", NAMESPACE)
    wait_for(lambda: core.list_namespaced_pod(NAMESPACE).items == [], 60, "the pods to be gone")


def test_the_registry_lives_in_the_api_and_a_gateway_rebuilds_from_it(
    cluster: PodCluster, tmp_path: Path
) -> None:
    first = start_server(tmp_path, gateway_config(cluster, None))
    second: RunningServer | None = None
    try:
        running = first.start_kernel(SIZE)
        assert first.execute(running, "x = 41; print(x)").strip() == "41"
        sleeping = first.start_kernel(SIZE)
        assert first.execute(sleeping, "z = 'saved'; print(z)").strip() == "saved"
        hibernate(first, cluster, sleeping)
        # The state's move is written first, the committed checkpoint's id just after it: wait for
        # both (the API's copy is written behind, off the event loop).
        wait_for(
            lambda: (
                (record := records(cluster).get(sleeping, {})).get("state") == "hibernated"
                and record.get("checkpoint_id")
            ),
            30,
            "the record in the API, with its checkpoint",
        )
        assert records(cluster)[running]["state"] == "running"
        # Nothing on the shared claim but checkpoints: no registry file, no sessions database.
        on_claim = [p.name for p in cluster.checkpoints.rglob("*") if p.is_file()]
        assert not [n for n in on_claim if n.startswith("kernels-") or n.endswith(".db")], on_claim
        assert not list(tmp_path.rglob("sessions-*.db"))
        pid = first.execute(running, "import os; print(os.getpid())").strip()
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()

        second = start_server(tmp_path, gateway_config(cluster, None))
        wait_for(lambda: second.get(f"/api/elastic/kernels/{running}")["state"] == "running", 60, "adoption")
        assert second.get(f"/api/elastic/kernels/{sleeping}")["state"] == "hibernated"
        assert second.execute(running, "print(os.getpid(), x + 1)").split() == [pid, "42"]
        assert second.execute(sleeping, "print(z)", timeout=120).strip() == "saved"
        for kernel_id in (running, sleeping):
            second.shutdown_kernel(kernel_id)
        wait_for(lambda: records(cluster) == {}, 30, "the records to be deleted with their kernels")
    finally:
        stopped(first, *([second] if second else []))
        cleanup(cluster)


def test_the_standby_takes_over_the_kernels_when_the_leader_is_killed(
    cluster: PodCluster, tmp_path: Path
) -> None:
    lease = f"gw-{uuid.uuid4().hex[:8]}"
    active = start_server(tmp_path, gateway_config(cluster, lease))
    standby: RunningServer | None = None
    try:
        wait_for(lambda: ready(active), 60, "the first gateway to lead")
        standby = start_server(tmp_path, gateway_config(cluster, lease))
        refused = standby.request("GET", "/api/elastic/leader", token=None)
        assert refused.status == 503 and "standby" in refused.body["message"], refused
        start = standby.request("POST", "/api/kernels", {"name": SIZE})
        assert start.status == 503 and "standby" in start.body["message"], start

        running = active.start_kernel(SIZE)
        assert active.execute(running, "x = 41; print(x)").strip() == "41"
        sleeping = active.start_kernel(SIZE)
        assert active.execute(sleeping, "z = 'saved'; print(z)").strip() == "saved"
        hibernate(active, cluster, sleeping)
        pid = active.execute(running, "import os; print(os.getpid())").strip()

        killed = time.monotonic()
        active.process.send_signal(signal.SIGKILL)
        active.process.wait()
        # The stated bound: Lease duration + one retry + adoption; the margin is for two loaded cores.
        wait_for(lambda: ready(standby), LEASE + RETRY + 60, "the standby to take over")
        print(f"failover: {time.monotonic() - killed:.1f} s (lease {LEASE} s, retry {RETRY} s)")
        assert standby.get(f"/api/elastic/kernels/{running}")["state"] == "running"
        assert standby.get(f"/api/elastic/kernels/{sleeping}")["state"] == "hibernated"
        # The same kernel process, variables and all, through the new leader.
        assert standby.execute(running, "print(os.getpid(), x + 1)").split() == [pid, "42"]
        assert standby.execute(sleeping, "print(z)", timeout=120).strip() == "saved"
        for kernel_id in (running, sleeping):
            standby.shutdown_kernel(kernel_id)
    finally:
        stopped(active, *([standby] if standby else []))
        cleanup(cluster)


SERVING = "elastic.jupyter.org/serving"


def placeholder_pod(cluster: PodCluster, name: str, labels: dict[str, str]) -> None:
    """A pod object standing for a gateway's own pod (it never runs: no node matches it)."""
    cluster.core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "nodeSelector": {"elastic.test/no-such-node": "true"},
                "containers": [{"name": "gateway", "image": "none"}],
            },
        },
    )


def serving(cluster: PodCluster, pod: str) -> bool:
    labels = cluster.core.read_namespaced_pod(pod, NAMESPACE).metadata.labels or {}
    return labels.get(SERVING) == "true"


def test_the_serving_label_follows_the_lease_and_a_standby_is_ready(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """With ``serving_label`` (the chart's), the Lease holder labels its own pod once it serves, which
    the gateway Service selects; a standby is Ready (so a surge rollout can start the new pod before
    it stops the old leader) and takes a stale label off its pod as it starts (a restarted container
    keeps its pod's labels). A gracefully stopped holder hands the Lease and the label over."""
    lease = f"gw-{uuid.uuid4().hex[:8]}"
    config = gateway_config(cluster, lease)
    config["ElasticLeaderElection"]["serving_label"] = SERVING
    placeholder_pod(cluster, f"{lease}-a", {})
    placeholder_pod(cluster, f"{lease}-b", {SERVING: "true"})  # left from a container that restarted

    def in_pod(pod: str) -> dict[str, str]:
        return {"POD_NAME": pod, "POD_NAMESPACE": NAMESPACE}

    # One home: the registry is named after the server's root directory, which replicas share.
    active = start_server(tmp_path, config, env_extra=in_pod(f"{lease}-a"))
    standby: RunningServer | None = None
    try:
        wait_for(lambda: ready(active), 60, "the first gateway to lead")
        wait_for(lambda: serving(cluster, f"{lease}-a"), 60, "the leader's pod to be labelled serving")
        standby = start_server(tmp_path, config, env_extra=in_pod(f"{lease}-b"))
        assert not serving(cluster, f"{lease}-b")  # taken off before the server answered
        assert standby.request("GET", "/api/elastic/readyz", token=None).status == 200
        assert standby.request("GET", "/api/elastic/leader", token=None).status == 503
        running = active.start_kernel(SIZE)
        assert active.execute(running, "x = 41; print(x)").strip() == "41"

        active.stop()  # SIGTERM, as a rollout stops the old pod: it releases the Lease at exit
        wait_for(lambda: serving(cluster, f"{lease}-b"), LEASE + 60, "the standby's pod to be labelled")
        assert ready(standby)
        assert standby.execute(running, "print(x + 1)").strip() == "42"
        standby.shutdown_kernel(running)
    finally:
        stopped(active, *([standby] if standby else []))
        cleanup(cluster)


def audit_writes(plane: ControlPlane, pid: int, after: float) -> list[dict[str, Any]]:
    """Successful writes (2xx) the gateway process ``pid`` made, received after ``after`` (epoch s)."""
    import datetime as dt

    found = []
    for line in Path(plane.audit_log).read_text().splitlines():  # type: ignore[attr-defined]
        event = json.loads(line)
        if f"_{pid})" not in event.get("userAgent", "") or event.get("verb") not in WRITES:
            continue
        received = dt.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        code = int(event.get("responseStatus", {}).get("code", 0))
        if received.timestamp() > after and 200 <= code < 300:
            found.append(event)
    return found


def test_a_partitioned_leader_makes_no_write_after_the_standby_took_over(
    cluster: PodCluster, tmp_path: Path
) -> None:
    lease = f"gw-{uuid.uuid4().hex[:8]}"
    old = start_server(tmp_path, gateway_config(cluster, lease))
    new: RunningServer | None = None
    try:
        wait_for(lambda: ready(old), 60, "the first gateway to lead")
        new = start_server(tmp_path, gateway_config(cluster, lease))
        kernel_id = old.start_kernel(SIZE)
        assert old.execute(kernel_id, "x = 41; print(x)").strip() == "41"
        pod_uid = cluster.pod_of(kernel_id).metadata.uid
        # The old leader's writes are seen in the audit log (its User-Agent names its pid).
        assert audit_writes(cluster.plane, old.process.pid, 0), "the audit log shows no write of the leader"

        old.process.send_signal(signal.SIGSTOP)  # partitioned: it cannot renew, and does not know it
        wait_for(lambda: ready(new), LEASE + RETRY + 60, "the standby to take over")
        took_over = time.time()
        # Queued at the stopped gateway: a shutdown (pod and Secret deletes) and a start (creates).
        answers: list[Any] = []

        def send(method: str, path: str, body: Any = None) -> None:
            try:
                answers.append(old.request(method, path, body).status)
            except OSError as exc:  # it exited before answering
                answers.append(type(exc).__name__)

        queued = [
            threading.Thread(target=send, args=("DELETE", f"/api/kernels/{kernel_id}")),
            threading.Thread(target=send, args=("POST", "/api/kernels", {"name": SIZE})),
        ]
        for thread in queued:
            thread.start()
        # Give the requests a moment to reach the stopped process's socket; a request arriving later
        # meets the same fence or a closed port, so the assertions below hold either way.
        time.sleep(0.5)
        old.process.send_signal(signal.SIGCONT)
        assert old.process.wait(timeout=60) == 3, old.log()[-3000:]  # it exits: another gateway leads
        for thread in queued:
            thread.join(timeout=60)
        assert "lost the Lease" in old.log()
        print("queued requests answered:", answers)
        assert 204 not in answers and 201 not in answers, answers
        assert audit_writes(cluster.plane, old.process.pid, took_over) == []
        # The kernel is the new leader's, untouched: same pod, same variables.
        assert cluster.pod_of(kernel_id).metadata.uid == pod_uid
        wait_for(lambda: new.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "running", 60, "adoption")
        assert new.execute(kernel_id, "print(x + 1)").strip() == "42"
        new.shutdown_kernel(kernel_id)
    finally:
        stopped(old, *([new] if new else []))
        cleanup(cluster)


def test_a_holder_whose_renewals_stopped_refuses_every_write(cluster: PodCluster, kube_api: Any) -> None:
    name = f"gw-{uuid.uuid4().hex[:8]}"
    timings = {"lease_duration": LEASE, "renew_deadline": RENEW, "retry_period": RETRY}
    first = LeaderLease(kube_api, NAMESPACE, name, "first", **timings).start()
    second = LeaderLease(kube_api, NAMESPACE, name, "second", **timings)
    try:
        wait_for(first.holds, 30, "the first to hold the Lease")
        fenced = ExplainedCoreV1Api(kube_api, first.check)
        manifest = {"metadata": {"name": f"{name}-a"}, "data": {"k": "v"}}
        fenced.create_namespaced_config_map(NAMESPACE, manifest)  # allowed while it holds the Lease
        second.start()
        assert not second.holds()
        first._stop.set()  # its renewals stop, as if stopped or partitioned (the thread ends)
        wait_for(lambda: not first.holds(), RENEW + 30, "the holder to count itself fenced")
        with pytest.raises(Fenced, match="does not hold the Lease"):
            fenced.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": f"{name}-b"}})
        with pytest.raises(Fenced):
            fenced.delete_namespaced_config_map(f"{name}-a", NAMESPACE)
        # Reads and dry runs stay allowed (a standby checks its pod manifests at start).
        fenced.read_namespaced_config_map(f"{name}-a", NAMESPACE)
        fenced.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": f"{name}-c"}}, dry_run="All")
        wait_for(second.holds, LEASE + 30, "the second to take the Lease over")
        lease = client.CoordinationV1Api(kube_api).read_namespaced_lease(name, NAMESPACE)
        assert lease.spec.holder_identity == "second" and lease.spec.lease_transitions == 1
        names = {c.metadata.name for c in cluster.core.list_namespaced_config_map(NAMESPACE).items}
        assert f"{name}-a" in names and f"{name}-b" not in names and f"{name}-c" not in names
    finally:
        second.stop(release=False)
        cluster.core.delete_namespaced_config_map(f"{name}-a", NAMESPACE)


def test_a_stopping_holder_releases_the_lease_so_the_standby_need_not_wait(
    cluster: PodCluster, kube_api: Any
) -> None:
    name = f"gw-{uuid.uuid4().hex[:8]}"
    # A Lease duration no test waits out: the standby can only get the Lease because it was released.
    timings = {"lease_duration": 600.0, "renew_deadline": 500.0, "retry_period": RETRY}
    first = LeaderLease(kube_api, NAMESPACE, name, "first", **timings).start()
    second = LeaderLease(kube_api, NAMESPACE, name, "second", **timings)
    try:
        wait_for(first.holds, 30, "the first to hold the Lease")
        second.start()
        first.stop(release=True)  # what a gateway does at exit (SIGTERM: rolling update, drain)
        assert not first.holds()
        wait_for(second.holds, 60, "the standby to take the released Lease")
    finally:
        second.stop(release=False)


def test_a_gateway_without_the_lease_creates_no_namespace_or_rolebinding(
    cluster: PodCluster, kube_api: Any
) -> None:
    """Per-user namespaces (create_namespace) go through the same fence as pod writes."""
    from kernelmgr.kube.namespaces import ensure_namespace

    name = f"gw-{uuid.uuid4().hex[:8]}"
    timings = {"lease_duration": LEASE, "renew_deadline": RENEW, "retry_period": RETRY}
    holder = LeaderLease(kube_api, NAMESPACE, name, "holder", **timings).start()
    standby = LeaderLease(kube_api, NAMESPACE, name, "standby", **timings)
    rbac = client.RbacAuthorizationV1Api(kube_api)
    policy = {"metadata": {"name": "deny-egress"}, "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    made = [f"{name}-standby", f"{name}-holder"]
    try:
        wait_for(holder.holds, 30, "the holder to hold the Lease")
        standby.start()
        assert not standby.holds()
        with pytest.raises(Fenced, match="may not create namespaces"):
            ensure_namespace(
                kube_api,
                made[0],
                labels={},
                cluster_role="view",
                network_policies=[policy],
                fence=standby.check,
            )
        with pytest.raises(client.ApiException) as missing:
            cluster.core.read_namespace(made[0])
        assert missing.value.status == 404
        # The namespace exists (made by its admin): the standby still binds nothing in it.
        cluster.core.create_namespace({"metadata": {"name": made[0]}})
        with pytest.raises(Fenced, match="does not hold the Lease"):
            ensure_namespace(kube_api, made[0], labels={}, cluster_role="view", fence=standby.check)
        assert rbac.list_namespaced_role_binding(made[0]).items == []
        # The holder makes all three.
        assert ensure_namespace(
            kube_api, made[1], labels={}, cluster_role="view", network_policies=[policy], fence=holder.check
        )
        (binding,) = rbac.list_namespaced_role_binding(made[1]).items
        assert binding.role_ref.name == "view"
        networking = client.NetworkingV1Api(kube_api)
        assert [p.metadata.name for p in networking.list_namespaced_network_policy(made[1]).items] == [
            "deny-egress"
        ]
    finally:
        standby.stop(release=False)
        holder.stop(release=True)
        for namespace in made:
            try:
                cluster.core.delete_namespace(namespace)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
