"""The deployment users run, end to end (issue 46): JupyterHub with KubeSpawner in the test cluster,
shaped like zero-to-jupyterhub, with the project's chart beside it as the Hub's ``elastic-gateway``
service, configured by ``examples/jupyterhub/z2jh/values.yaml`` itself.

On the real node with its cluster network (Services, DNS, enforced NetworkPolicies): the Hub, its
proxy and the users' servers from the images ``scripts/images.sh export-hub`` builds, the gateway and
kernel pods from the project's images (:mod:`tests.support.z2jh`). A user logs in through the proxy,
gets a server from KubeSpawner (a pod with the ``claim-{username}`` home), and through their server
starts a GPU kernel at the gateway (a kernel pod with the same home, beside the server's pod, as the
server's user: ``examples/jupyterhub/z2jh/gateway-values.yaml``), runs cells that read the home,
hibernates it through the Hub's route to the gateway and resumes it with the next cell; the Hub
stops and starts the user's server and the notebook's session names the same kernel, still running.
Another user's token is refused at the gateway.

Needs root, the Debian packages, ``scripts/node.sh build`` and the images: skipped without them,
failed instead with ``ELASTIC_REQUIRE_NODE=1`` (CI).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client, utils  # noqa: E402

from tests.support.hub import HubClient  # noqa: E402
from tests.support.node import LABEL, TAINT, Node  # noqa: E402
from tests.support.server import KernelChannel  # noqa: E402
from tests.support.z2jh import NAMESPACE, PASSWORD, example_values, manifests  # noqa: E402
from tests.test_chart_on_real_node import TOKEN, Chart, installed_chart  # noqa: E402
from tests.test_images import images_script  # noqa: E402
from tests.test_real_node import node, registry  # noqa: E402, F401

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]
PLACEMENT = {"nodeSelector": {LABEL[0]: LABEL[1]}, "tolerations": [{**TAINT, "operator": "Equal"}]}
USERS = ("alice", "bob")
#: The project's chart values for this deployment (the users' homes in their kernel pods).
GATEWAY_VALUES = (
    Path(__file__).resolve().parents[1] / "examples" / "jupyterhub" / "z2jh" / "gateway-values.yaml"
)


@dataclass
class ClusterHub(HubClient):
    """The Hub at its proxy's public Service; its log is its pod's."""

    core: Any = None

    def log(self) -> str:
        said = []
        for pod in _pods(self.core, "app=jupyterhub,component in (hub,proxy)"):
            text = self.core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE, tail_lines=80)
            said.append(f"--- {pod.metadata.name}\n{text}")
        return "\n".join(said)


@dataclass
class Deployment:
    """The Hub at its proxy's public Service, and the chart's release beside it."""

    hub: ClusterHub
    chart: Chart
    core: Any


def _homes(core: Any, users: tuple[str, ...]) -> Iterator[Path]:
    """A volume per user for z2jh's ``claim-{username}`` (no dynamic provisioner here): a folder on
    the node owned by the singleuser uid, bound ahead to that claim, as an admin's static PV."""
    for user in users:
        folder = Path(f"/tmp/ekh-{os.getpid()}-{user}")
        folder.mkdir(mode=0o770)
        os.chown(folder, 1000, 100)
        core.create_persistent_volume(
            {
                "metadata": {"name": f"{NAMESPACE}-claim-{user}"},
                "spec": {
                    "capacity": {"storage": "10Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "",
                    "hostPath": {"path": str(folder), "type": "Directory"},
                    "claimRef": {"namespace": NAMESPACE, "name": f"claim-{user}"},
                },
            }
        )
        yield folder


def _routed(hub: HubClient) -> bool:
    """Whether the proxy sends /services/elastic-gateway/ to the gateway (which answers its API's
    version there) rather than to the Hub (whose 404 page it is until the route exists)."""
    answer = hub.api("GET", "/services/elastic-gateway/api", "", timeout=10)
    return answer.status_code == 200 and "version" in answer.json()


def _pods(core: Any, selector: str) -> list[Any]:
    return list(core.list_namespaced_pod(NAMESPACE, label_selector=selector).items)


def _ready(core: Any, component: str) -> bool:
    pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"app=jupyterhub,component={component}").items
    return any(c.type == "Ready" and c.status == "True" for p in pods for c in p.status.conditions or [])


@pytest.fixture(scope="module")
def deployment(
    node: Node,  # noqa: F811
    kube_api: Any,
    kube_plane: ControlPlane,
    registry: str,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    kernel, gateway = images_script("push", registry).split()
    hub_image, proxy_image, singleuser_image = images_script("push-hub", registry).split()
    core = client.CoreV1Api(kube_api)
    hub_api = f"http://hub.{NAMESPACE}.svc.cluster.local:8081/hub/api"
    tmp = tmp_path_factory.mktemp("hub")
    pushed = {"kernel": kernel, "gateway": gateway}
    homes = list(_homes(core, USERS))
    try:
        gateway_values = yaml.safe_load(GATEWAY_VALUES.read_text())
        with installed_chart(
            kube_api,
            node,
            pushed,
            kube_plane,
            tmp,
            namespace=NAMESPACE,
            hub_api_url=hub_api,
            extra_values=gateway_values,
        ) as chart:
            images = {"hub": hub_image, "proxy": proxy_image, "singleuser": singleuser_image}
            objects = manifests(example_values(), images, PLACEMENT, TOKEN)
            utils.create_from_yaml(kube_api, yaml_objects=objects, namespace=NAMESPACE)
            try:
                for component in ("hub", "proxy"):
                    what = f"the {component} to be Ready"
                    wait_for(lambda component=component: _ready(core, component), 300, what)
                public = core.read_namespaced_service("proxy-public", NAMESPACE).spec.cluster_ip
                hub = ClusterHub(f"http://{public}", PASSWORD, core)
                # The Hub answers its API before its start is over: it routes its services last
                # (after it tried each one's URL). Wait for the gateway's route, as its users would.
                wait_for(lambda: _routed(hub), 300, "the Hub to route /services/elastic-gateway/")
                yield Deployment(hub, chart, core)
            finally:
                # The Hub and proxy first (their Deployments would make new pods), then the
                # users' servers; the chart's own cleanup takes the rest.
                apps = client.AppsV1Api(kube_api)
                for name in ("hub", "proxy"):
                    with contextlib.suppress(client.ApiException):
                        apps.delete_namespaced_deployment(name, NAMESPACE)
                wait_for(
                    lambda: not _pods(core, "app=jupyterhub,component in (hub,proxy)"),
                    300,
                    "the Hub to be gone",
                )
    finally:
        for user in USERS:
            with contextlib.suppress(client.ApiException):
                core.delete_persistent_volume(f"{NAMESPACE}-claim-{user}")
        for folder in homes:
            shutil.rmtree(folder, ignore_errors=True)


def test_a_user_of_the_hub_runs_hibernates_and_resumes_a_gpu_kernel_through_their_server(
    deployment: Deployment,
) -> None:
    hub, core = deployment.hub, deployment.core
    token = hub.login_token("alice")
    hub.start_server("alice", token, timeout=600)
    (pod,) = core.list_namespaced_pod(NAMESPACE, label_selector="component=singleuser-server").items
    assert pod.spec.node_name == deployment.chart.node.name
    claims = [v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.persistent_volume_claim]
    assert claims == ["claim-alice"], claims

    server = f"{hub.url}/user/alice"
    specs = hub.api("GET", "/user/alice/api/kernelspecs", token).json()["kernelspecs"]
    size = next(name for name in specs if name.endswith("gpu-whole"))
    started = hub.api("POST", "/user/alice/api/kernels", token, json={"name": size}, timeout=600)
    assert started.status_code == 201, started.text
    kernel_id = started.json()["id"]
    kernel_pods = deployment.chart.kernel_pods(kernel_id)
    assert len(kernel_pods) == 1 and kernel_pods[0].spec.node_name == deployment.chart.node.name

    # Her home, as KubeSpawner mounted it in her server, is in her kernel pod (gateway-values.yaml):
    # the same claim, on the node of her server's pod (ReadWriteOnce), as her server's user.
    written = hub.api(
        "PUT",
        "/user/alice/api/contents/hello.txt",
        token,
        json={"type": "file", "format": "text", "content": "written by alice's server"},
    )
    assert written.status_code in (200, 201), written.text
    (kernel_pod,) = kernel_pods
    claims = [
        v.persistent_volume_claim.claim_name for v in kernel_pod.spec.volumes if v.persistent_volume_claim
    ]
    assert "claim-alice" in claims, claims
    affinity = kernel_pod.spec.affinity.pod_affinity.required_during_scheduling_ignored_during_execution
    assert affinity[0].label_selector.match_labels == {
        "component": "singleuser-server",
        "hub.jupyter.org/username": "alice",
    }
    with KernelChannel(server, kernel_id, timeout=300, token=token) as tab:
        assert tab.execute("x = 41; print(x + 1)").stdout == "42\n"
        said = tab.execute(
            "import os; print(open('/home/jovyan/hello.txt').read(), os.getuid(), os.environ['HOME'])"
        )
        contexts = (pod.spec.containers[0].security_context, pod.spec.security_context)
        uid = next((c.run_as_user for c in contexts if c is not None and c.run_as_user is not None), None)
        assert said.stdout == f"written by alice's server {uid} /home/jovyan\n", said

    # Hibernate at the gateway through the Hub's route to its service, with alice's own token;
    # bob's token is refused there (by the gateway: a JSON message, not the Hub's page).
    gateway = f"/services/elastic-gateway/api/elastic/kernels/{kernel_id}"
    bob = hub.login_token("bob")
    refused = hub.api("POST", f"{gateway}/hibernate", bob, timeout=60)
    assert refused.status_code in (403, 404) and "message" in refused.json(), refused.text
    hibernated = hub.api("POST", f"{gateway}/hibernate", token, timeout=600)
    assert hibernated.status_code == 200, hibernated.text
    assert deployment.chart.kernel_pods(kernel_id) == []
    with KernelChannel(server, kernel_id, timeout=600, token=token) as tab:
        assert tab.execute("print(x)", timeout=600).stdout == "41\n"

    # Her notebook's kernel outlives her server: the Hub stops it and starts it again, and the
    # notebook's session (the database in her home) names the same kernel, still at the gateway.
    notebook = {"path": "work.ipynb", "name": "work.ipynb", "type": "notebook", "kernel": {"id": kernel_id}}
    made = hub.api("POST", "/user/alice/api/sessions", token, json=notebook, timeout=120)
    assert made.status_code == 201 and made.json()["kernel"]["id"] == kernel_id, made.text
    hub.stop_server("alice", token, timeout=300)
    assert len(deployment.chart.kernel_pods(kernel_id)) == 1
    hub.start_server("alice", token, timeout=600)
    sessions = hub.api("GET", "/user/alice/api/sessions", token, timeout=120).json()
    assert [(s["path"], s["kernel"]["id"]) for s in sessions] == [("work.ipynb", kernel_id)], sessions
    with KernelChannel(server, kernel_id, timeout=300, token=token) as tab:
        assert tab.execute("print(x)", timeout=300).stdout == "41\n"
    assert hub.api("DELETE", f"/user/alice/api/kernels/{kernel_id}", token, timeout=300).status_code == 204


def test_the_examples_research_profile_is_offered_to_the_research_group_only(deployment: Deployment) -> None:
    """KubeSpawner offers every profile to every user; the example's extraConfig narrows the
    whole-GPU default to the research group (it once said so with a key KubeSpawner ignores)."""
    hub, core = deployment.hub, deployment.core
    admin = hub.login_token("admin")
    made = hub.api("POST", "/hub/api/groups/research", admin, json={"users": ["alice"]})
    assert made.status_code in (201, 409), made.text
    bob = hub.login_token("bob")
    refused = hub.api("POST", "/hub/api/users/bob/server", bob, json={"profile": "gpu-whole"}, timeout=120)
    assert refused.status_code >= 400, refused.text
    assert not _pods(core, "component=singleuser-server,hub.jupyter.org/username=bob")
    # alice's server (stopped first if the test before left it running) on the research profile.
    alice = hub.login_token("alice")
    hub.stop_server("alice", alice, timeout=300)
    hub.start_server("alice", alice, timeout=600, options={"profile": "gpu-whole"})
    (pod,) = _pods(core, "component=singleuser-server,hub.jupyter.org/username=alice")
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env["ELASTIC_DEFAULT_KERNEL"] == "python3-gpu-whole", env
    hub.stop_server("alice", alice, timeout=300)
