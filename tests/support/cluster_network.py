"""What makes the real node's pods a cluster network (issue 46): Services, cluster DNS, NetworkPolicy.

Started by :class:`tests.support.node.Node` once its kubelet is Ready, stopped before it:

* **the API server as the ``kubernetes`` Service's endpoint**: the control plane advertises the node's
  bridge address (:data:`tests.support.kube.POD_NETWORK_HOST`) and a forwarder there carries the port
  to the API server on 127.0.0.1 (:mod:`tests.support.forward`);
* **kube-proxy** (iptables mode, the Kubernetes modules the kubelet is built from): ClusterIPs route
  to their endpoints, from pods and from this machine;
* **CoreDNS** on the bridge address, serving ``cluster.local`` from the API, behind the ``kube-dns``
  Service at :data:`DNS_SERVICE_IP` (the kubelet's ``clusterDNS``), as kubeadm lays it out; its pod
  is a process on the node, which a Service without a selector reaches through an EndpointSlice;
* **kube-router's firewall** alone (no routing, no proxy): standard NetworkPolicy enforced on the
  bridge with iptables and ipsets. docs/envtest.md says why not kube-network-policies.

Each runs as a process of this machine with its log in the node's folder, and each one's rules are
removed at :meth:`ClusterNetwork.stop` (``kube-proxy --cleanup``, :func:`remove_firewall`).
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.forward import Forwarder
from tests.support.kube import SERVICE_CLUSTER_IP_RANGE, free_port, kill_with_parent

CLUSTER_DOMAIN = "cluster.local"
#: The ``kube-dns`` Service's ClusterIP: what every pod's resolv.conf names (kubeadm's choice, .10).
DNS_SERVICE_IP = "10.96.0.10"
KUBE_DNS = {"namespace": "kube-system", "name": "kube-dns"}
MANAGED_BY = "jupyter-elastic-kernels-tests"


def _api_server(kubeconfig: Path) -> tuple[str, int]:
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    host, _, port = server.removeprefix("https://").rpartition(":")
    return host, int(port)


@dataclass
class ClusterNetwork:
    """The network services for node ``node_name`` whose pods are in ``subnet`` behind ``host_ip``."""

    directory: Path
    kubeconfig: Path
    node_name: str
    host_ip: str
    subnet: str
    paths: dict[str, Path]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, init=False)
    forwarder: Forwarder | None = field(default=None, init=False)

    def start(self) -> ClusterNetwork:
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_firewall()  # what a killed run left would cut the new pods off
        try:
            host, port = _api_server(self.kubeconfig)
            self.forwarder = Forwarder((self.host_ip, port), (host, port)).start()
            self._start_dns()
            self._start("kube-proxy", ["--config", str(self._kube_proxy_config())], self._proxy_ready)
            self._start("kube-router", self._kube_router_args(), self._firewall_ready)
        except BaseException:
            self.stop()
            raise
        return self

    # -- the processes

    def _start(self, name: str, args: list[str], ready: Any) -> None:
        with (self.directory / f"{name}.log").open("ab") as log:
            command = [str(self.paths[name]), *args]
            self.processes[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=kill_with_parent
            )
        process, deadline = self.processes[name], time.monotonic() + 120
        while not ready():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited ({process.returncode}):\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after 120 s:\n{self.log_tail(name)}")
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.directory / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _healthy(self, port: int, path: str = "/healthz") -> bool:
        import urllib.request

        url = f"http://127.0.0.1:{port}{path}"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
        return False

    # -- DNS

    def _start_dns(self) -> None:
        health, ready = free_port(), free_port()
        corefile = self.directory / "Corefile"
        corefile.write_text(
            # The cluster's own names from the API; everything else goes on to this machine's resolver.
            f"{CLUSTER_DOMAIN}:53 in-addr.arpa:53 {{\n"
            f"    bind {self.host_ip}\n"
            "    errors\n"
            f"    health 127.0.0.1:{health}\n"
            f"    ready 127.0.0.1:{ready}\n"
            f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{\n"
            f"        kubeconfig {self.kubeconfig}\n"
            "        fallthrough in-addr.arpa\n"
            "    }\n"
            "    cache 5\n"
            "}\n"
            ".:53 {\n"
            f"    bind {self.host_ip}\n"
            "    errors\n"
            "    forward . /etc/resolv.conf\n"
            "}\n"
        )
        self._start("coredns", ["-conf", str(corefile)], lambda: self._healthy(ready, "/ready"))
        self._publish_dns()

    def _publish_dns(self) -> None:
        """The ``kube-dns`` Service (no selector) and its EndpointSlice: CoreDNS on the bridge address."""
        from kubernetes import client, config

        api = config.new_client_from_config(str(self.kubeconfig))
        core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
        namespace, name = KUBE_DNS["namespace"], KUBE_DNS["name"]
        ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_service(name, namespace)
        with contextlib.suppress(client.ApiException):
            discovery.delete_namespaced_endpoint_slice(name, namespace)
        core.create_namespaced_service(
            namespace,
            {
                "metadata": {"name": name, "labels": {"k8s-app": "kube-dns"}},
                "spec": {
                    "clusterIP": DNS_SERVICE_IP,
                    "ports": [{"name": n, "port": 53, "protocol": p, "targetPort": 53} for n, p in ports],
                },
            },
        )
        discovery.create_namespaced_endpoint_slice(
            namespace,
            {
                "metadata": {
                    "name": name,
                    "labels": {
                        "kubernetes.io/service-name": name,
                        "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
                    },
                },
                "addressType": "IPv4",
                "endpoints": [
                    {"addresses": [self.host_ip], "conditions": {"ready": True}, "nodeName": self.node_name}
                ],
                "ports": [{"name": n, "port": 53, "protocol": p} for n, p in ports],
            },
        )

    # -- Services

    def _kube_proxy_config(self) -> Path:
        self._proxy_health = free_port()
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.kubeconfig)},
            "hostnameOverride": self.node_name,
            "mode": "iptables",
            "clusterCIDR": self.subnet,
            "healthzBindAddress": f"127.0.0.1:{self._proxy_health}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # A shared machine: leave its conntrack table and timeouts, and its loopback routing, as they are.
            "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            "iptables": {"localhostNodePorts": False},
        }
        path = self.directory / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _proxy_ready(self) -> bool:
        return self._healthy(self._proxy_health)

    # -- NetworkPolicy

    def _kube_router_args(self) -> list[str]:
        self._router_health = free_port()
        return [
            f"--kubeconfig={self.kubeconfig}",
            f"--hostname-override={self.node_name}",
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--enable-ipv4=true",
            "--enable-ipv6=false",
            "--enable-cni=false",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            f"--health-port={self._router_health}",
            "--metrics-port=0",
            "--v=1",
        ]

    def _firewall_ready(self) -> bool:
        return self._healthy(self._router_health)

    # -- the end

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self.paths.get("kube-proxy", Path("/nonexistent")).exists():
            subprocess.run([str(self.paths["kube-proxy"]), "--cleanup"], capture_output=True, timeout=120)
        remove_firewall()
        if self.forwarder is not None:
            self.forwarder.stop()
            self.forwarder = None


#: What kube-router's firewall adds: chains in the filter table, jumps to them, ipsets of addresses.
FIREWALL_CHAINS = ("KUBE-ROUTER-", "KUBE-NWPLCY-", "KUBE-POD-FW-")
FIREWALL_SETS = ("KUBE-SRC-", "KUBE-DST-", "kube-router-")


def remove_firewall() -> None:
    """Remove kube-router's firewall rules and sets. Not ``kube-router --cleanup-config``: in v2.1.0
    it cleans the service proxy first (every IPVS service on the machine), then panics before the
    firewall's turn."""
    saved = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True).stdout
    lines = saved.splitlines()
    chains = [line[1:].split()[0] for line in lines if line.startswith(":KUBE-")]
    ours = [chain for chain in chains if chain.startswith(FIREWALL_CHAINS)]
    for line in lines:
        rule = shlex.split(line)
        if rule[:1] == ["-A"] and rule[1] not in ours and any(f"-j {chain}" in line for chain in ours):
            subprocess.run(["iptables", "-t", "filter", "-D", *rule[1:]], capture_output=True)
    for flag in ("-F", "-X"):
        for chain in ours:
            subprocess.run(["iptables", "-t", "filter", flag, chain], capture_output=True)
    listed = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split()
    for name in listed:
        if name.startswith(FIREWALL_SETS):
            subprocess.run(["ipset", "destroy", name], capture_output=True)
