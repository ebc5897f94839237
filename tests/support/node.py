"""A real Kubernetes node on this machine: containerd (CRI) + runc + CNI bridge + kubelet (issue 27).

It registers with a control plane of :mod:`tests.support.kube`, beside its kwok nodes, and runs pods
for real: images from containerd's store (imported archives, or a local registry over plain HTTP),
namespaces and cgroups from runc, a veth on a dedicated bridge with an address from a dedicated subnet
(host-local IPAM), reachable from the host. Everything it changes on the machine is:

* the bridge ``ekcni0`` with ``10.88.0.1/16``, forwarding on it alone (a ClusterIP's packets come
  back out the bridge to the pod behind it; nothing is masqueraded out of this machine);
* the cluster network's iptables rules and ipsets (:mod:`tests.support.cluster_network`: kube-proxy,
  CoreDNS, kube-router's NetworkPolicy firewall), removed by their own cleanup commands;
* processes (containerd, its shims, the kubelet, the network's) and mounts under its state folder, all
  removed by :meth:`Node.stop` (the bridge too, when it made it).

The node carries the taint :data:`TAINT` and the label :data:`LABEL`, so only pods that ask for it run
there: the other tests' pods stay on kwok nodes. ``scripts/node.sh`` builds the kubelet and the pause
image and starts this from the command line.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.cluster_network import CLUSTER_DOMAIN, DNS_SERVICE_IP, ClusterNetwork
from tests.support.containerd import Containerd, require_node_tools, unmount_under
from tests.support.kube import free_port, kill_with_parent, wait_for

REPO = Path(__file__).resolve().parents[2]
NODE_SCRIPT = REPO / "scripts" / "node.sh"
BRIDGE = "ekcni0"
SUBNET = "10.88.0.0/16"  # its first address is POD_NETWORK_HOST, which the API server advertises
#: The pods that may run on the real node tolerate this taint (and select this label).
TAINT = {"key": "jupyter-elastic-kernels/real-node", "value": "true", "effect": "NoSchedule"}
LABEL = ("jupyter-elastic-kernels/real-node", "true")
PAUSE_IMAGE = "localhost/jupyter-elastic-kernels-pause:1"
TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "ip", "buildah", "ipset", "iptables")
HOW = (
    "apt-get install -y containerd runc ipset containernetworking-plugins buildah, as root, then "
    "scripts/node.sh build"
)


def node_paths() -> dict[str, Path]:
    """What ``scripts/node.sh build`` made: the kubelet, the pause image's archive, the CNI plugins."""
    out = subprocess.run(["bash", str(NODE_SCRIPT), "paths"], capture_output=True, text=True, check=True)
    return {key: Path(value) for key, value in (line.split("=", 1) for line in out.stdout.split())}


def require_node() -> dict[str, Path]:
    """Skip (or with ``ELASTIC_REQUIRE_NODE=1``, fail) when the node cannot run here; its paths."""
    import pytest

    require_node_tools(TOOLS, what="the real node", how=HOW)
    paths = node_paths()
    missing = [str(path) for key, path in paths.items() if key != "cni" and not path.exists()]
    if not (paths["cni"] / "bridge").exists():
        missing.append(str(paths["cni"] / "bridge"))
    if missing:
        from tests.support.containerd import REQUIRE_ENV

        message = f"the real node is not built ({', '.join(missing)} missing): run scripts/node.sh build"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but {message}", pytrace=False)
        pytest.skip(message)
    return paths


def _addresses_in_use() -> list[tuple[str, ipaddress.IPv4Network]]:
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    found = []
    for link in json.loads(out):
        for addr in link.get("addr_info", []):
            found.append(
                (link["ifname"], ipaddress.ip_network(f"{addr['local']}/{addr['prefixlen']}", strict=False))
            )
    return found


@dataclass
class Node:
    """A kubelet node ``name`` for the cluster of ``kubeconfig`` (an admin one), state in ``directory``."""

    directory: Path
    kubeconfig: Path
    name: str = "elastic-real-node"
    subnet: str = SUBNET
    bridge: str = BRIDGE
    registry: str | None = None
    paths: dict[str, Path] = field(default_factory=node_paths)
    containerd: Containerd | None = field(default=None, init=False)
    kubelet: subprocess.Popen[bytes] | None = field(default=None, init=False)
    network: ClusterNetwork | None = field(default=None, init=False)
    made_bridge: bool = field(default=False, init=False)

    @property
    def gateway_ip(self) -> str:
        return str(next(ipaddress.ip_network(self.subnet).hosts()))

    # -- network

    def _ensure_bridge(self) -> None:
        network = ipaddress.ip_network(self.subnet)
        for ifname, used in _addresses_in_use():
            if ifname != self.bridge and used.overlaps(network):
                raise RuntimeError(f"{self.subnet} overlaps {used} on {ifname}: choose another subnet")
        exists = subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0
        if not exists:
            subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True)
            self.made_bridge = True
        addr = f"{self.gateway_ip}/{network.prefixlen}"
        shown = subprocess.run(
            ["ip", "-4", "addr", "show", self.bridge], capture_output=True, text=True
        ).stdout
        if addr not in shown:
            subprocess.run(["ip", "addr", "add", addr, "dev", self.bridge], check=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True)
        # Forwarding for what comes in on the bridge only: a pod's packet to a ClusterIP is routed
        # (kube-proxy's DNAT) back out to the pod behind it. The rest of the machine keeps its setting.
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding").write_text("1")

    def _cni_config(self) -> Path:
        conf_dir = self.directory / "cni" / "net.d"
        conf_dir.mkdir(parents=True, exist_ok=True)
        network = ipaddress.ip_network(self.subnet)
        hosts = network.hosts()
        gateway = str(next(hosts))
        conflist = {
            "cniVersion": "1.0.0",
            "name": "elastic-node",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    # Not the gateway: the plugin would turn on the host's IP forwarding for it. The
                    # bridge has its address already (``_ensure_bridge``), and the pods route via it.
                    "isGateway": False,
                    "ipMasq": False,
                    # A pod reaching its own Service comes back through its own port (kube-proxy
                    # masquerades it), as on every Kubernetes bridge network.
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [
                            [{"subnet": self.subnet, "rangeStart": str(network[10]), "gateway": gateway}]
                        ],
                        "routes": [{"dst": "0.0.0.0/0", "gw": gateway}],
                        "dataDir": str(self.directory / "cni" / "ipam"),
                    },
                }
            ],
        }
        (conf_dir / "10-elastic-node.conflist").write_text(json.dumps(conflist, indent=1))
        return conf_dir

    # -- containerd and the kubelet

    def _cri_toml(self, conf_dir: Path) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        lines = [
            f"[{cri}]",
            f'sandbox_image = "{PAUSE_IMAGE}"',
            # This machine forbids lowering an oom_score_adj (the sandbox asks for -998): runc's init
            # then dies with "can't get final child's PID from pipe". Restricted, it keeps the parent's.
            "restrict_oom_score_adj = true",
            f"[{cri}.containerd]",
            'snapshotter = "overlayfs"',
            'default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]",
            'runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]",
            "SystemdCgroup = false",
            f"[{cri}.cni]",
            f'bin_dir = "{self.paths["cni"]}"',
            f'conf_dir = "{conf_dir}"',
        ]
        if self.registry:
            lines += [
                f'[{cri}.registry.mirrors."{self.registry}"]',
                f'endpoint = ["http://{self.registry}"]',
            ]
        return "\n".join(lines)

    def _kubelet_config(self) -> Path:
        assert self.containerd is not None
        d = self.directory / "kubelet"
        d.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # Kubelet 1.35+ refuses cgroup v1 unless told; this machine has only v1 controllers.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            # No kubepods/QoS cgroup tree on the shared machine: each container gets runc's own cgroup.
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "containerRuntimeEndpoint": f"unix://{self.containerd.socket}",
            "address": self.gateway_ip,
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            # Only the API server and this machine reach it (the bridge address).
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "failSwapOn": False,
            # A shared machine's disk: never evict the test pods for it.
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "registerWithTaints": [TAINT],
            "podLogsDir": str(self.directory / "pod-logs"),
            "volumePluginDir": str(self.directory / "volume-plugins"),
            "serializeImagePulls": False,
            "resolvConf": "/etc/resolv.conf",
            # Pods resolve through the cluster's DNS (tests/support/cluster_network.py).
            "clusterDNS": [DNS_SERVICE_IP],
            "clusterDomain": CLUSTER_DOMAIN,
        }
        path = d / "config.json"
        path.write_text(json.dumps(config, indent=1))
        return path

    def start(self, timeout: float = 300) -> Node:
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._ensure_bridge()
            conf_dir = self._cni_config()
            self.containerd = Containerd(
                self.directory / "containerd", cri={"toml": self._cri_toml(conf_dir)}
            )
            self.containerd.start()
            self.containerd.import_image(self.paths["pause"], namespace="k8s.io")
            config = self._kubelet_config()
            log = (self.directory / "kubelet.log").open("ab")
            self.kubelet = subprocess.Popen(
                [
                    str(self.paths["kubelet"]),
                    f"--config={config}",
                    f"--kubeconfig={self.kubeconfig}",
                    f"--root-dir={self.directory / 'kubelet' / 'root'}",
                    f"--cert-dir={self.directory / 'kubelet' / 'pki'}",
                    f"--hostname-override={self.name}",
                    f"--node-ip={self.gateway_ip}",
                    f"--node-labels={LABEL[0]}={LABEL[1]}",
                    # cAdvisor reads container stats from containerd (the default is /run/containerd).
                    f"--containerd={self.containerd.socket}",
                    "--v=1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=kill_with_parent,
            )
            log.close()
            wait_for(self._ready, timeout, f"node {self.name} to be Ready")
            network = ClusterNetwork(
                self.directory / "network",
                self.kubeconfig,
                self.name,
                self.gateway_ip,
                self.subnet,
                self.paths,
            )
            self.network = network.start()
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, lines: int = 40) -> str:
        path = self.directory / "kubelet.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _ready(self) -> bool:
        if self.kubelet is not None and self.kubelet.poll() is not None:
            raise RuntimeError(f"the kubelet exited ({self.kubelet.returncode}):\n{self.log_tail()}")
        done = subprocess.run(
            [sys.executable, "-c", _NODE_READY, str(self.kubeconfig), self.name],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.stdout.strip() == "True"

    def import_image(self, archive: Path) -> list[str]:
        """Put an image archive into the node's image store (what a pull would do)."""
        assert self.containerd is not None
        return self.containerd.import_image(archive, namespace="k8s.io")

    def stop(self) -> None:
        if self.network is not None:
            self.network.stop()
            self.network = None
        if self.kubelet is not None and self.kubelet.poll() is None:
            self.kubelet.terminate()
            try:
                self.kubelet.wait(30)
            except subprocess.TimeoutExpired:
                self.kubelet.kill()
                self.kubelet.wait()
        self._leave_the_cluster()
        if self.containerd is not None:
            self.containerd.stop()  # kills every pod's containers and the sandboxes, then itself
        unmount_under(self.directory)
        if self.made_bridge:
            with contextlib.suppress(Exception):
                subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, check=False)
            self.made_bridge = False

    def _leave_the_cluster(self) -> None:
        """Delete the Node object, as a drained node leaving a cluster is: the next node of the same
        name (the next test module's) registers fresh, without the ``unreachable`` taint the node
        controller puts on a node that stopped answering."""
        with contextlib.suppress(Exception):
            subprocess.run(
                [sys.executable, "-c", _NODE_DELETE, str(self.kubeconfig), self.name],
                capture_output=True,
                timeout=60,
                check=False,
            )

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Delete a Node object (gone already is fine).
_NODE_DELETE = """
import sys
from kubernetes import client, config
from kubernetes.client.rest import ApiException
api = client.CoreV1Api(config.new_client_from_config(sys.argv[1]))
try:
    api.delete_node(sys.argv[2])
except ApiException as exc:
    if exc.status != 404:
        raise
"""

#: Whether a node is Ready (run in a subprocess: it loads the kubeconfig without touching this process).
_NODE_READY = """
import sys
from kubernetes import client, config
api = client.CoreV1Api(config.new_client_from_config(sys.argv[1]))
node = api.read_node(sys.argv[2])
print(any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or []))
"""


def pod_tolerating_the_node(name: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    """A pod manifest that runs on the real node only, with the image as imported (never pulled)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {LABEL[0]: LABEL[1]},
            "tolerations": [{**TAINT, "operator": "Equal"}],
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            **spec,
        },
    }


def _main(argv: list[str]) -> int:
    """``python -m tests.support.node start DIR KUBECONFIG [REGISTRY]`` (runs until interrupted)."""
    if len(argv) < 3 or argv[0] != "start":
        print(_main.__doc__, file=sys.stderr)
        return 2
    node = Node(Path(argv[1]), Path(argv[2]), registry=argv[3] if len(argv) > 3 else None)
    node.start()
    print(f"node {node.name} Ready; its pods get addresses in {node.subnet} (Ctrl-C stops it)", flush=True)
    try:
        assert node.kubelet is not None
        node.kubelet.wait()
    except KeyboardInterrupt:
        pass
    finally:
        node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
