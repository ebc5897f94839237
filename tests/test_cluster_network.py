"""The real node's pods are in a cluster network (issue 46): Services, cluster DNS, NetworkPolicy.

kube-proxy, CoreDNS and kube-router's firewall run with the node (:mod:`tests.support.cluster_network`).
What a pod sees is read from pods of the kernel image that probe and print what they reached: a
Service by its short and full DNS names and its ClusterIP, the ``kubernetes`` Service with the pod's
own ServiceAccount (in-cluster configuration, TLS checked), and the same connections cut by standard
NetworkPolicies (ingress by pod label, egress default-deny) and let through again by an allow rule.

Needs root, the Debian packages and ``scripts/node.sh build``: skipped without them, failed instead
with ``ELASTIC_REQUIRE_NODE=1`` (CI).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.kube import require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from tests.support.cluster_network import DNS_SERVICE_IP  # noqa: E402
from tests.support.node import Node, pod_tolerating_the_node  # noqa: E402
from tests.test_real_node import kernel_image, node, registry  # noqa: E402, F401

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

#: A pod's HTTP answer: its own name (the pod behind a Service is seen by what it says).
SERVE_NAME = (
    "import http.server, os\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = os.environ['POD_NAME'].encode()\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "http.server.HTTPServer(('0.0.0.0', 8080), H).serve_forever()\n"
)

#: Run in a probe pod (or a kernel): each target of $PROBES (a URL, dns:NAME, tcp:HOST:PORT or
#: "kubernetes"), what it answered or why not, as one JSON line.
PROBE = """
import json, os, socket, ssl, time, urllib.request
SA = "/var/run/secrets/kubernetes.io/serviceaccount"
def reach(target):
    try:
        if target.startswith("tcp:"):
            host, port = target[4:].rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=5).close()
            return "connected"
        if target.startswith("dns:"):
            return "address " + socket.gethostbyname(target[4:])
        if target == "kubernetes":
            request = urllib.request.Request(
                "https://kubernetes.default.svc/version",
                headers={"Authorization": "Bearer " + open(SA + "/token").read()},
            )
            context = ssl.create_default_context(cafile=SA + "/ca.crt")
            with urllib.request.urlopen(request, timeout=5, context=context) as answer:
                return "version " + json.load(answer)["gitVersion"]
        with urllib.request.urlopen(target, timeout=5) as answer:
            return "said " + answer.read().decode()
    except Exception as exc:
        return "failed " + type(exc).__name__
def settled(target):
    # A new pod's address reaches the firewall's sets a moment after the pod starts (as in any
    # cluster): where an answer is expected ($UNTIL_REACHED), try again until then.
    deadline = time.monotonic() + float(os.environ["UNTIL_REACHED"])
    while (said := reach(target)).startswith("failed") and time.monotonic() < deadline:
        time.sleep(1)
    return said
print(json.dumps({t: settled(t) for t in os.environ["PROBES"].split()}))
"""


@dataclass
class Namespace:
    """A namespace of the test's own and the API to it."""

    core: Any
    name: str


@pytest.fixture(scope="module")
def ns(kube_api: Any, node: Node) -> Iterator[Namespace]:  # noqa: F811
    core = client.CoreV1Api(kube_api)
    name = f"net-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), 60, "default ServiceAccount")
    yield Namespace(core, name)
    core.delete_namespace(name)


def _with_env(manifest: dict[str, Any], env: dict[str, str], labels: dict[str, str]) -> dict[str, Any]:
    container = manifest["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in env.items()] + [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    manifest["metadata"]["labels"] = labels
    return manifest


@pytest.fixture(scope="module")
def web(ns: Namespace, kernel_image: str) -> str:  # noqa: F811
    """Two pods answering their names behind the Service ``web`` (port 80 to 8080); its ClusterIP."""
    for name in ("web-1", "web-2"):
        ns.core.create_namespaced_pod(
            ns.name,
            _with_env(
                pod_tolerating_the_node(name, kernel_image, ["python", "-c", SERVE_NAME]), {}, {"app": "web"}
            ),
        )
    service = ns.core.create_namespaced_service(
        ns.name,
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    for name in ("web-1", "web-2"):
        wait_for(lambda name=name: _ready(ns, name), 300, f"pod {name} to be Ready")
    return str(service.spec.cluster_ip)


def _ready(ns: Namespace, name: str) -> bool:
    pod = ns.core.read_namespaced_pod(name, ns.name)
    if pod.status.phase in ("Failed", "Succeeded"):
        raise AssertionError(f"pod {name} ended: {pod.status}")
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def probe(
    ns: Namespace,
    image: str,
    targets: list[str],
    labels: dict[str, str] | None = None,
    *,
    expect: bool = True,
) -> dict[str, str]:
    """What a new pod (``labels``) reached of ``targets``: "said", "address", "connected" or "failed ...".

    With ``expect`` (answers expected) a failure is tried again for a minute first."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    ns.core.create_namespaced_pod(
        ns.name,
        _with_env(
            pod_tolerating_the_node(name, image, ["python", "-c", PROBE]),
            {"PROBES": " ".join(targets), "UNTIL_REACHED": "60" if expect else "0"},
            labels or {"app": "probe"},
        ),
    )

    def ended() -> bool:
        phase = ns.core.read_namespaced_pod(name, ns.name).status.phase
        return phase in ("Succeeded", "Failed")

    wait_for(ended, 300, f"probe {name} to end")
    said = ns.core.read_namespaced_pod_log(name, ns.name)
    ns.core.delete_namespaced_pod(name, ns.name, grace_period_seconds=0)
    return dict(json.loads(said.strip().splitlines()[-1]))


def test_services_their_dns_names_and_the_kubernetes_service_work_from_pods(
    node: Node,  # noqa: F811
    ns: Namespace,
    kernel_image: str,  # noqa: F811
    web: str,
) -> None:
    full = f"web.{ns.name}.svc.cluster.local"
    seen: set[str] = set()
    # Several probes: the Service spreads connections over both pods (kube-proxy's random choice).
    for _ in range(6):
        said = probe(
            ns, kernel_image, ["dns:web", f"dns:{full}", "http://web/", f"http://{web}/", "kubernetes"]
        )
        assert said["dns:web"] == said[f"dns:{full}"] == f"address {web}", said
        assert said["http://web/"].startswith("said web-"), said
        assert said[f"http://{web}/"].startswith("said web-"), said
        assert said["kubernetes"].startswith("version v1.36"), said
        seen |= {said["http://web/"], said[f"http://{web}/"]}
        if seen == {"said web-1", "said web-2"}:
            break
    assert seen == {"said web-1", "said web-2"}, seen
    # This machine reaches a ClusterIP too (kube-proxy's rules for the host's own connections).
    with urllib.request.urlopen(f"http://{web}/", timeout=10) as answer:
        assert answer.read().decode().startswith("web-")
    dns = ns.core.read_namespaced_service("kube-dns", "kube-system")
    assert dns.spec.cluster_ip == DNS_SERVICE_IP


def test_network_policies_are_enforced_between_pods(
    node: Node,  # noqa: F811
    ns: Namespace,
    kernel_image: str,  # noqa: F811
    web: str,
) -> None:
    networking = client.NetworkingV1Api(ns.core.api_client)
    namespace = ns.name

    def policy(name: str, spec: dict[str, Any]) -> None:
        networking.create_namespaced_network_policy(namespace, {"metadata": {"name": name}, "spec": spec})

    # Ingress: web takes connections only from pods labelled role=client.
    policy(
        "web-from-clients",
        {
            "podSelector": {"matchLabels": {"app": "web"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}],
        },
    )
    client_labels = {"app": "probe", "role": "client"}

    def web_answers(labels: dict[str, str] | None, expect: bool) -> str:
        return str(probe(ns, kernel_image, ["http://web/"], labels, expect=expect)["http://web/"])

    # The firewall applies a new policy within a moment: wait for it rather than guess how long.
    wait_for(
        lambda: web_answers(None, expect=False).startswith("failed"),
        120,
        "the ingress policy to cut a stranger off",
    )
    assert web_answers(client_labels, expect=True).startswith("said web-")

    # Egress default-deny for the clients: not even DNS; then DNS and web allowed again by rules.
    policy(
        "clients-deny-egress", {"podSelector": {"matchLabels": {"role": "client"}}, "policyTypes": ["Egress"]}
    )
    targets = ["dns:web", f"http://{web}/"]
    cut = wait_for(
        lambda: (
            (said := probe(ns, kernel_image, targets, client_labels, expect=False))["dns:web"].startswith(
                "failed"
            )
            and said
        ),
        120,
        "the egress policy to cut the client off",
    )
    assert cut[f"http://{web}/"].startswith("failed"), cut
    policy(
        "clients-to-dns-and-web",
        {
            "podSelector": {"matchLabels": {"role": "client"}},
            "policyTypes": ["Egress"],
            "egress": [
                {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
                {"to": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": 8080}]},
            ],
        },
    )
    back = wait_for(
        lambda: (
            (said := probe(ns, kernel_image, targets, client_labels))[f"http://{web}/"].startswith("said")
            and said
        ),
        120,
        "the allow rules to let the client through",
    )
    assert back["dns:web"] == f"address {web}", back
