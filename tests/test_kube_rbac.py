"""The server's Kubernetes rights, namespaces and pod security, against the real control plane.

- deploy/kubernetes/rbac.yaml grants exactly the calls the code makes (read from the source);
- a server holding only those rights (a ServiceAccount token from the TokenRequest API, the RBAC objects
  applied as shipped) starts a kernel pod, executes a cell and shuts it down;
- with one verb taken away the kernel start or shutdown fails at once with an error naming the rule to add;
- a namespace enforcing Pod Security "restricted" admits the kernel pod, and it runs (read-only root
  filesystem, HOME and /tmp on emptyDirs);
- one namespace per owner (namespace_template), created by the server with rbac-namespaces.yaml's rights;
- CUDA_* / NVIDIA_* in the configured env is refused;
- the manifests are valid objects (kubernetes-validate, strict), and a 403 is explained by what refused it
  (RBAC: the rule to add; admission: the API server's reason).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpec
from traitlets import TraitError

from kernelmgr.config import ElasticRuntime
from kernelmgr.core.errors import ConfigError
from kernelmgr.kube import access
from kernelmgr.kube.access import KubeForbidden, KubeRefused, permission_of
from kernelmgr.kube.cluster import KubeCluster
from kernelmgr.kube.manifests import slice_env_refusal
from kernelmgr.kube.namespaces import dns_label, namespace_for
from tests.support import rbac
from tests.support.kernel_pods import execute, kernel_manager, make_runtime, pod_names, secret_names
from tests.support.kube import ControlPlane

pytestmark = [pytest.mark.pure, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[1]
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


@pytest.fixture
def informers() -> Iterator[KubeCluster]:
    """The cluster object the server would make: its pod watches are stopped after the test."""
    cluster = KubeCluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def runtime(tmp_path: Path, informers: KubeCluster) -> ElasticRuntime:
    return make_runtime(tmp_path / "ck", cluster=informers)


@pytest.fixture
def prefix(kube_api: Any) -> Iterator[str]:
    """A unique name prefix for this test's cluster-scoped RBAC objects; they are deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    yield name
    for path in (rbac.RBAC, rbac.RBAC_NAMESPACES):
        rbac.delete(kube_api, rbac.load(path, "unused", name))


def server_identity(
    tmp_path: Path, plane: ControlPlane, api: Any, namespace: str, docs: list[dict[str, Any]]
) -> tuple[Path, str]:
    """Apply ``docs`` and return a kubeconfig (and token) of the ServiceAccount they define."""
    rbac.apply(api, docs)
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    return rbac.service_account_kubeconfig(plane, api, namespace, account, tmp_path / "server.kubeconfig")


# ---- the rules match the code


def _calls_in_code(scope: str = "any") -> set[tuple[str, str]]:
    """(verb, resource) of every CoreV1Api call in kernelmgr/ (``core.<method>``), watches included;
    ``scope="cluster"``: only the calls across all namespaces (``*_for_all_namespaces``)."""
    needed: set[tuple[str, str]] = set()
    for path in (ROOT / "kernelmgr").rglob("*.py"):
        if path.name == "uninstall.py":
            continue  # the chart's uninstall Job: its own ServiceAccount and Roles (test_helm_chart.py)
        source = path.read_text()
        # ``core.<method>`` and ``CoreV1Api(...).<method>``; a list method passed uncalled is an
        # informer's list function (list, then watch).
        for method, after in re.findall(r"(?:\bcore|CoreV1Api\([^()]*\))\.([a-z_]+)(\(?)", source):
            permission = permission_of(method)
            if permission is None or (scope == "cluster" and not method.endswith("_for_all_namespaces")):
                continue
            verb, resource, _ = permission
            needed.add((verb, resource))
            passed = not after and not re.search(rf"to_thread\(\s*(?:self\.)?core\.{method}\b", source)
            if verb == "list" and (passed or re.search(rf"stream\(\s*core\.{method}\b", source)):
                needed.add(("watch", resource))
    return needed


def _granted(docs: list[dict[str, Any]], kind: str = "ClusterRole") -> set[tuple[str, str]]:
    return {
        (verb, resource)
        for doc in docs
        if doc["kind"] == kind
        for rule in doc["rules"]
        if rule["apiGroups"] == [""]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_shipped_rules_are_exactly_the_calls_the_code_makes() -> None:
    needed = _calls_in_code()
    # What the code does today: one watch per namespace, pod + Secret per kernel, events to explain.
    assert {("create", "pods"), ("delete", "pods"), ("list", "pods"), ("watch", "pods")} <= needed
    assert {("create", "secrets"), ("patch", "secrets"), ("delete", "secrets"), ("list", "events")} <= needed
    docs = rbac.read(rbac.RBAC)
    kernel_role = [d for d in docs if d["metadata"]["name"] == "jupyter-elastic-kernels:kernel-pods"]
    # The server's own state (the kernel records) is its own namespace's Role, not the kernel ClusterRole
    # that every kernel namespace (a per-user one too) binds.
    own = {(v, r) for v, r in needed if r == "configmaps"}
    assert own == {("create", "configmaps"), ("update", "configmaps"), ("delete", "configmaps")} | {
        ("list", "configmaps")
    }
    namespaced = {(v, r) for v, r in needed if r not in ("namespaces", "nodes", "configmaps")}
    assert _granted(kernel_role) == namespaced, "rbac.yaml's kernel-pods rules differ from the code's calls"
    gateway_role = [d for d in docs if d["metadata"]["name"] == "jupyter-elastic-kernels:gateway"]
    assert [d["kind"] for d in gateway_role] == ["Role", "RoleBinding"]
    # And the serving label the Lease holder puts on its own pod there (kube/serving_label.py).
    serving = ROOT / "kernelmgr" / "kube" / "serving_label.py"
    assert "self.core.patch_namespaced_pod(" in serving.read_text()
    assert _granted(gateway_role, "Role") == own | {("patch", "pods")}
    (lease_rule,) = [r for r in gateway_role[0]["rules"] if r["apiGroups"] == ["coordination.k8s.io"]]
    assert lease_rule == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update", "patch"],
    }
    assert not [r for d in kernel_role for r in d["rules"] if "leases" in r["resources"]]
    cluster_role = [d for d in docs if d["metadata"]["name"] == "jupyter-elastic-kernels:nodes"]
    nodes = {("get", "nodes"), ("list", "nodes"), ("watch", "nodes")}
    across = _calls_in_code("cluster")
    assert across == {("list", "pods"), ("watch", "pods")}  # the other GPU pods (kube/other_gpu_pods.py)
    assert _granted(cluster_role) == nodes | across
    cluster = {(v, r) for v, r in needed if r == "namespaces"}
    assert cluster == {("create", "namespaces")}
    assert cluster <= _granted(rbac.read(rbac.RBAC_NAMESPACES))


# ---- a server with only the shipped rights


def test_kernel_runs_with_only_the_shipped_rbac(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    kube_runner: Any,
    runtime: ElasticRuntime,
    informers: KubeCluster,
    prefix: str,
) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    docs = rbac.load(rbac.RBAC, kube_namespace, prefix)
    kubeconfig, token = server_identity(tmp_path, kube_plane, kube_api, kube_namespace, docs)
    rbac.wait_allowed(kube_plane, token, "create", "pods", kube_namespace)
    with kube_plane.api_client(token=token) as limited:  # the identity really is limited
        with pytest.raises(client.ApiException) as refused:
            client.CoreV1Api(limited).read_namespaced_secret("anything", kube_namespace)  # no get
        assert refused.value.status == 403
        with pytest.raises(client.ApiException) as refused:
            # Not a kernel namespace: no pod may be made there. (Listing pods everywhere is allowed:
            # the GPUs of pods that are not kernels are counted, kube/other_gpu_pods.py.)
            client.CoreV1Api(limited).create_namespaced_pod(
                "default",
                {"metadata": {"name": "not-here"}, "spec": {"containers": [{"name": "c", "image": "x"}]}},
            )
        assert refused.value.status == 403
    km = kernel_manager(tmp_path, kube_plane, kube_namespace, runtime, "one", kubeconfig=str(kubeconfig))

    async def scenario() -> None:
        await km.start_kernel()
        assert await execute(km, "6 * 7") == ["42"]
        await km.shutdown_kernel()

    asyncio.run(scenario())
    assert pod_names(core, kube_namespace) == []
    assert secret_names(core, kube_namespace) == []
    assert runtime.allocator.slices() == []


@pytest.mark.parametrize(
    ("resource", "verb", "when"),
    [("pods", "create", "start"), ("pods", "watch", "start"), ("pods", "delete", "shutdown")],
)
def test_a_missing_permission_fails_at_once_naming_the_rule(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    kube_runner: Any,
    runtime: ElasticRuntime,
    informers: KubeCluster,
    prefix: str,
    resource: str,
    verb: str,
    when: str,
) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    docs = rbac.without(rbac.load(rbac.RBAC, kube_namespace, prefix), resource, verb)
    kubeconfig, token = server_identity(tmp_path, kube_plane, kube_api, kube_namespace, docs)
    rbac.wait_allowed(kube_plane, token, "create", "secrets", kube_namespace)
    km = kernel_manager(tmp_path, kube_plane, kube_namespace, runtime, "one", kubeconfig=str(kubeconfig))

    async def scenario() -> KubeForbidden:
        if when == "shutdown":
            await km.start_kernel()
            with pytest.raises(KubeForbidden) as failed:
                await km.shutdown_kernel()
        else:
            with pytest.raises(KubeForbidden) as failed:
                await km.start_kernel()
        return failed.value

    began = time.monotonic()
    error = asyncio.run(scenario())
    # At once: not after the 60 s launch timeout (or the stop timeout) ran out.
    assert time.monotonic() - began < 30
    message = str(error)
    account = f"system:serviceaccount:{kube_namespace}:{prefix}"
    assert message.startswith(
        f"the server's Kubernetes identity ({account}) may not {verb} {resource} "
        f"in namespace {kube_namespace}: "
        f'add {{apiGroups: [""], resources: ["{resource}"], verbs: ["{verb}"]}} to the Role'
    ), message
    assert "deploy/kubernetes/rbac.yaml" in message and "The API server said: " in message
    assert error.status == 403
    if when == "start":  # nothing is left behind; the slice is free again
        assert runtime.allocator.slices() == []
        assert pod_names(core, kube_namespace) == []
        if verb == "create":
            assert secret_names(core, kube_namespace) == []
    else:
        for name in pod_names(core, kube_namespace):
            core.delete_namespaced_pod(name, kube_namespace, grace_period_seconds=0)


# ---- pod security


def test_kernel_pod_is_admitted_by_pod_security_restricted_and_runs(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    kube_runner: Any,
    runtime: ElasticRuntime,
    informers: KubeCluster,
) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    core.patch_namespace(kube_namespace, {"metadata": {"labels": RESTRICTED}})
    # Pod Security Admission is on: a pod without the restricted settings is refused.
    plain = {
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "python:3.12", "command": ["true"]}]},
    }
    with pytest.raises(client.ApiException) as refused:
        core.create_namespaced_pod(kube_namespace, plain)
    said = json.loads(refused.value.body)["message"]
    assert refused.value.status == 403 and 'violates PodSecurity "restricted:latest"' in said, said

    km = kernel_manager(tmp_path, kube_plane, kube_namespace, runtime, "one")

    async def scenario() -> None:
        await km.start_kernel()
        pod = core.read_namespaced_pod(f"kernel-{km.kernel_id}", kube_namespace)
        context = pod.spec.containers[0].security_context
        assert context.read_only_root_filesystem is True
        assert context.allow_privilege_escalation is False and context.capabilities.drop == ["ALL"]
        assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
        assert pod.spec.security_context.run_as_non_root is True
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["HOME"] == "/home/kernel" and env["TMPDIR"] == "/tmp"
        mounts = {m.mount_path: m.name for m in pod.spec.containers[0].volume_mounts}
        volumes = {v.name: v for v in pod.spec.volumes}
        assert volumes[mounts["/home/kernel"]].empty_dir is not None
        assert volumes[mounts["/tmp"]].empty_dir is not None
        # The kernel writes only where a container could: HOME and TMPDIR are the pod's emptyDirs
        # (the node runner maps them to folders of the pod; it does not enforce the read-only root).
        code = (
            "import json, os, tempfile, IPython\n"
            "mounts = json.loads(os.environ['NODE_RUNNER_MOUNTS'])\n"
            "with tempfile.NamedTemporaryFile(dir=None) as f: tmp = f.name\n"
            "print(os.environ['HOME'] == mounts['/home/kernel'], tmp.startswith(mounts['/tmp'] + '/'),"
            " IPython.paths.get_ipython_dir().startswith(mounts['/home/kernel'] + '/'))"
        )
        assert await execute(km, code) == ["True True True\n"]
        await km.shutdown_kernel()

    asyncio.run(scenario())
    assert pod_names(core, kube_namespace) == []

    # A configuration the namespace's policy forbids fails with the API server's reason, and is not
    # mistaken for a missing RBAC rule.
    as_root = kernel_manager(tmp_path, kube_plane, kube_namespace, runtime, "one", name="root", run_as_user=0)
    with pytest.raises(KubeRefused) as refused_kernel:
        asyncio.run(as_root.start_kernel())
    message = str(refused_kernel.value)
    assert not isinstance(refused_kernel.value, KubeForbidden) and "Role" not in message, message
    assert message.startswith(f"the API server refused to create pods in namespace {kube_namespace}: ")
    assert 'violates PodSecurity "restricted:latest"' in message and "runAsUser=0" in message, message
    assert runtime.allocator.slices() == [] and pod_names(core, kube_namespace) == []


def test_cuda_and_nvidia_env_are_refused() -> None:
    from kernelmgr.provisioners.kubernetes import ElasticKubernetesProvisioner

    spec = KernelSpec(argv=["python"], display_name="k", language="python")
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DISABLE_CONTROL", "HOME"):
        with pytest.raises(TraitError) as refused:
            ElasticKubernetesProvisioner(kernel_id="k", kernel_spec=spec, extra_env={name: "all", "OK": "1"})
        assert f"may not set {name}" in str(refused.value)
        assert "OK" not in str(refused.value).split(":")[0]
    ok = ElasticKubernetesProvisioner(kernel_id="k", kernel_spec=spec, extra_env={"OMP_NUM_THREADS": "4"})
    assert ok.extra_env == {"OMP_NUM_THREADS": "4"}
    assert "device plugin" in (slice_env_refusal({"NVIDIA_DRIVER_CAPABILITIES"}, "x") or "")


# ---- namespaces


def test_namespace_template_gives_each_owner_a_label() -> None:
    assert namespace_for("jupyter-{owner}", "alice") == "jupyter-alice"
    changed = namespace_for("jupyter-{owner}", "Alice.Smith")
    assert re.fullmatch(r"jupyter-alice-smith-[0-9a-f]{8}", changed)
    assert namespace_for("jupyter-{owner}", "alice_smith") != namespace_for("jupyter-{owner}", "alice.smith")
    assert namespace_for("jupyter-{owner}", changed[len("jupyter-") :]) != changed  # no look-alike
    long = namespace_for("jupyter-{owner}", "x" * 200)
    assert len(long) == 63 and long.startswith("jupyter-xxx")
    assert len(dns_label("bob@example.org")) <= 63
    for bad in ("jupyter", "Jupyter-{owner}", "{owner}-{kernel}", "x" * 60 + "{owner}"):
        with pytest.raises(ConfigError):
            namespace_for(bad, "alice")


def test_per_owner_namespaces_created_by_the_server_with_its_own_rights(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    kube_runner: Any,
    informers: KubeCluster,
    prefix: str,
) -> None:
    """Two owners, two namespaces the server creates (Pod Security restricted), one watch each."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    docs = rbac.load(rbac.RBAC, kube_namespace, prefix) + rbac.load(
        rbac.RBAC_NAMESPACES, kube_namespace, prefix
    )
    kubeconfig, token = server_identity(tmp_path, kube_plane, kube_api, kube_namespace, docs)
    rbac.wait_allowed(kube_plane, token, "create", "namespaces", "")
    template = f"{prefix}-{{owner}}"
    owners = {
        "alice": make_runtime(tmp_path / "ck", "alice", cluster=informers),
        "Bob.Smith": make_runtime(tmp_path / "ck", "Bob.Smith", cluster=informers),
    }
    expected = {owner: namespace_for(template, owner) for owner in owners}
    managers = {
        owner: kernel_manager(
            tmp_path,
            kube_plane,
            "unused",
            runtime,
            None,
            name=f"cpu-{i}",
            kubeconfig=str(kubeconfig),
            namespace_template=template,
            create_namespace=True,
            namespace_cluster_role=f"{prefix}:kernel-pods",
        )
        for i, (owner, runtime) in enumerate(owners.items())
    }

    async def scenario() -> None:
        await asyncio.gather(*(km.start_kernel() for km in managers.values()))
        for owner, km in managers.items():
            namespace = expected[owner]
            assert pod_names(core, namespace) == [f"kernel-{km.kernel_id}"]
            info = await km.provisioner.get_provisioner_info()
            assert info["namespace"] == namespace
            assert await execute(km, "import os; print(os.environ['POD_IP'] != '')") == ["True\n"]
        await asyncio.gather(*(km.shutdown_kernel() for km in managers.values()))

    try:
        asyncio.run(scenario())
        assert set(expected.values()) == {f"{prefix}-alice", namespace_for(template, "Bob.Smith")}
        assert informers.watched_namespaces() == set(expected.values())  # one watch per namespace
        for namespace in expected.values():
            labels = core.read_namespace(namespace).metadata.labels
            assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
            assert pod_names(core, namespace) == [] and secret_names(core, namespace) == []
    finally:
        for namespace in expected.values():
            try:
                core.delete_namespace(namespace)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise


def test_namespace_creation_without_its_rights_names_the_missing_rule(
    tmp_path: Path,
    kube_plane: ControlPlane,
    kube_api: Any,
    kube_namespace: str,
    informers: KubeCluster,
    prefix: str,
) -> None:
    docs = rbac.load(rbac.RBAC, kube_namespace, prefix)  # rbac-namespaces.yaml not applied
    kubeconfig, _ = server_identity(tmp_path, kube_plane, kube_api, kube_namespace, docs)
    km = kernel_manager(
        tmp_path,
        kube_plane,
        "unused",
        make_runtime(tmp_path / "ck", "carol", cluster=informers),
        None,
        kubeconfig=str(kubeconfig),
        namespace_template=f"{prefix}-{{owner}}",
        create_namespace=True,
    )
    with pytest.raises(KubeForbidden) as failed:
        asyncio.run(km.start_kernel())
    message = str(failed.value)
    assert "may not create namespaces at cluster scope" in message, message
    assert "deploy/kubernetes/rbac-namespaces.yaml" in message


# ---- without a cluster


def test_shipped_manifests_are_valid_kubernetes_objects() -> None:
    import kubernetes_validate

    for path in (rbac.RBAC, rbac.RBAC_NAMESPACES, rbac.NODE_AGENT):
        for doc in rbac.read(path):
            kubernetes_validate.validate(doc, "1.35", strict=True)


def test_node_agent_daemonset_holds_no_gpu_and_reads_the_host_proc_read_only() -> None:
    from kernelmgr.kube.node_agents import AGENT_COMPONENT, AGENT_COMPONENT_LABEL

    (daemonset,) = rbac.read(rbac.NODE_AGENT)
    spec = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["template"]["metadata"]["labels"][AGENT_COMPONENT_LABEL] == AGENT_COMPONENT
    assert spec["hostPID"] is True and spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert not any("nvidia.com" in r for r in container["resources"].get("requests", {}))
    assert not any("nvidia.com" in r for r in container["resources"].get("limits", {}))
    proc = next(v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == "/proc")
    mount = next(m for m in container["volumeMounts"] if m["name"] == proc["name"])
    assert mount["readOnly"] is True and f"--proc-root={mount['mountPath']}" in container["args"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_a_403_is_explained_by_what_refused_it() -> None:
    from kubernetes import client

    def refusal(message: str) -> client.ApiException:
        exc = client.ApiException(status=403, reason="Forbidden")
        exc.body = json.dumps({"kind": "Status", "message": message, "code": 403})
        return exc

    class Refusing:
        def __init__(self, exc: client.ApiException) -> None:
            self.exc = exc

        def delete_namespaced_secret(self, name: str, namespace: str) -> None:
            raise self.exc

    rbac_said = (
        'secrets "kernel-1" is forbidden: User "system:serviceaccount:hub:server" cannot delete resource '
        '"secrets" in API group "" in the namespace "jupyter-alice"'
    )
    api: Any = access.ExplainedCoreV1Api.__new__(access.ExplainedCoreV1Api)
    api._core = Refusing(refusal(rbac_said))
    with pytest.raises(KubeForbidden) as denied:
        api.delete_namespaced_secret("kernel-1", "jupyter-alice")
    assert str(denied.value) == (
        "the server's Kubernetes identity (system:serviceaccount:hub:server) may not delete secrets in "
        'namespace jupyter-alice: add {apiGroups: [""], resources: ["secrets"], verbs: ["delete"]} to the '
        "Role (or ClusterRole) bound to it in jupyter-alice (the shipped rules are in "
        f"{access._shipped('rbac.yaml')}). The API server said: {rbac_said}"
    )
    assert denied.value.status == 403 and isinstance(denied.value, client.ApiException)

    quota_said = 'secrets "kernel-1" is forbidden: exceeded quota: q, requested: count/secrets=1'
    api._core = Refusing(refusal(quota_said))
    with pytest.raises(KubeRefused) as refused:
        api.delete_namespaced_secret("kernel-1", "jupyter-alice")
    assert not isinstance(refused.value, KubeForbidden)
    assert (
        str(refused.value)
        == f"the API server refused to delete secrets in namespace jupyter-alice: {quota_said}"
    )

    other = client.ApiException(status=404, reason="Not Found")
    api._core = Refusing(other)
    with pytest.raises(client.ApiException) as missing:
        api.delete_namespaced_secret("kernel-1", "jupyter-alice")
    assert missing.value is other


def test_an_owners_own_uid_and_dev_shm_pass_pod_security_restricted(
    kube_api: Any, kube_namespace: str
) -> None:
    """The API server (its validation and Pod Security "restricted") takes a kernel pod running as
    its owner's uid and gid (user_ids) with the /dev/shm emptyDir, as the provisioner makes it."""
    from kubernetes import client

    from kernelmgr.kube.manifests import make_kernel_pod
    from kernelmgr.kube.settings import KubeSettings

    core = client.CoreV1Api(kube_api)
    core.patch_namespace(kube_namespace, {"metadata": {"labels": RESTRICTED}})
    template = KubeSettings(user_ids={"alice": {"uid": 2001, "gid": 3001}}).pod_template()
    pod = make_kernel_pod(
        template,
        name="kernel-uid",
        kernel_id="uid",
        cmd=["python", "-m", "kernelmgr.kube.pod_kernel"],
        agent_env={},
        owner="alice",
        kernelspec="python3-cpu",
        profile=None,
        checkpoint_sub_path=None,
    )
    made = core.create_namespaced_pod(kube_namespace, pod, dry_run="All", field_validation="Strict")
    context = made.spec.security_context
    assert (context.run_as_user, context.run_as_group, context.fs_group) == (2001, 3001, 3001)
    shm = next(v for v in made.spec.volumes if v.name == "dshm")
    assert (shm.empty_dir.medium, shm.empty_dir.size_limit) == ("Memory", "1Gi")
