"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and kwok, started as local processes on loopback (controller-runtime's "envtest" way, plus a scheduler,
controllers and simulated nodes).

Why real binaries: the provisioner's manifests, RBAC, watches, 410 Gone and scheduling messages must be the
API server's own, not a mock's idea of them. ``scripts/envtest.sh build`` compiles the binaries once into a
cache folder (the ``KUBEBUILDER_ASSETS`` convention); this module only starts and stops them, so the script
(``scripts/envtest.sh start|stop``) and the pytest fixtures share one implementation.

Each ``ControlPlane`` keeps all its state (certificates, kubeconfigs, etcd data, logs, pids) in one folder
and picks free ports, so several independent clusters can run side by side in temporary folders.

Command line (used by the script): ``python -m tests.support.kube start|stop DIR``.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
ENVTEST_SCRIPT = REPO_ROOT / "scripts" / "envtest.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")

# kwok manages only nodes carrying this annotation, so a test's own node (the node runner) is left alone.
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
#: The real node's bridge address (tests/support/node.py): the host as its pods see it, where they
#: reach this API server through the ``kubernetes`` Service (tests/support/cluster_network.py).
POD_NETWORK_HOST = "10.88.0.1"
KWOK_POD_CIDR = "10.244.0.0/16"
GPU = "nvidia.com/gpu"
HAMI_GPUMEM = "nvidia.com/gpumem"
HAMI_GPUCORES = "nvidia.com/gpucores"

T = TypeVar("T")
START_ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


class ControlPlaneError(RuntimeError):
    """A component failed to start or become ready; the message carries the tail of its log."""


def bin_dir() -> Path:
    """The folder with the control plane's binaries.

    ``KUBEBUILDER_ASSETS`` wins (the convention envtest users know); otherwise the script says where it
    builds, so the Kubernetes version and cache path are written down in one place only.
    """
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        return Path(assets)
    out = subprocess.run(
        ["bash", str(ENVTEST_SCRIPT), "bindir"], check=True, capture_output=True, text=True
    ).stdout
    return Path(out.strip())


def binaries_built(directory: Path | None = None) -> bool:
    """True when every binary the control plane needs is in ``directory`` (default: ``bin_dir()``)."""
    directory = directory or bin_dir()
    return all(os.access(directory / name, os.X_OK) for name in BINARIES)


REQUIRE_ENV = "ELASTIC_REQUIRE_ENVTEST"
NOT_BUILT = "Kubernetes control plane not built: run scripts/envtest.sh build"


def require_envtest(*, module_level: bool = False) -> None:
    """Skip the calling test (or module) when the binaries are missing; fail instead when CI requires them.

    A fresh checkout runs the README's test command without a Go build, so those tests skip with the
    command that enables them; CI sets ``ELASTIC_REQUIRE_ENVTEST=1`` so they can never skip silently.
    """
    import pytest

    if binaries_built():
        return
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set but the control plane binaries are missing in {bin_dir()}: "
                    "run scripts/envtest.sh build", pytrace=False)  # fmt: skip
    pytest.skip(NOT_BUILT, allow_module_level=module_level)


def free_port() -> int:
    """A port that was free a moment ago; good enough on a test machine, and what every component wants."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` so a timeout says why."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:  # the thing may not exist yet: keep polling, report it at the end
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


# --------------------------------------------------------------------------------------------------------
# Certificates (openssl), so the API server runs with TLS, client certificates and RBAC like a real one.


class Pki:
    """A throw-away certificate authority in ``directory``, issuing with the ``openssl`` command line."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca_cert = self.dir / "ca.crt"
        self.ca_key = self.dir / "ca.key"

    def _openssl(self, *args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ControlPlaneError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")

    def _ec_key(self, path: Path) -> None:
        # P-256 keys: generated in milliseconds, accepted by Go's TLS and Python's ssl alike.
        self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
        path.chmod(0o600)

    def create_ca(self) -> None:
        """Create the CA once; later calls keep it so issued certificates stay valid."""
        if self.ca_cert.exists():
            return
        self._ec_key(self.ca_key)
        self._openssl(
            "req", "-x509", "-new", "-key", str(self.ca_key), "-out", str(self.ca_cert),
            "-days", "3650", "-subj", "/CN=elastic-envtest-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )  # fmt: skip

    def issue(
        self,
        name: str,
        common_name: str,
        organizations: Iterable[str] = (),
        *,
        server_names: Iterable[str] = (),
        server_ips: Iterable[str] = (),
    ) -> tuple[Path, Path]:
        """Issue a certificate signed by the CA: ``(cert, key)``.

        Kubernetes reads a client certificate's CN as the user name and each O as a group, which is how
        tests get an admin (``system:masters``), a node (``system:node:NAME`` in ``system:nodes``) or any
        user with exactly the rights RBAC gives it.
        """
        cert, key = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        if cert.exists() and key.exists():
            return cert, key
        self._ec_key(key)
        subject = "".join(f"/O={org}" for org in organizations) + f"/CN={common_name}"
        csr = self.dir / f"{name}.csr"
        self._openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", subject)
        sans = [f"DNS:{n}" for n in server_names] + [f"IP:{ip}" for ip in server_ips]
        ext_lines = [
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=serverAuth,clientAuth" if sans else "extendedKeyUsage=clientAuth",
        ]
        if sans:
            ext_lines.append("subjectAltName=" + ",".join(sans))
        ext = self.dir / f"{name}.ext"
        ext.write_text("\n".join(ext_lines) + "\n")
        serial = "0x" + os.urandom(12).hex()
        self._openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.ca_cert), "-CAkey", str(self.ca_key),
            "-set_serial", serial, "-days", "3650", "-out", str(cert), "-extfile", str(ext),
        )  # fmt: skip
        csr.unlink()
        ext.unlink()
        return cert, key

    def service_account_keys(self) -> tuple[Path, Path]:
        """The key pair that signs and verifies ServiceAccount tokens: ``(private, public)``."""
        private, public = self.dir / "sa.key", self.dir / "sa.pub"
        if not private.exists():
            self._openssl(
                "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(private)
            )
            private.chmod(0o600)
            self._openssl("pkey", "-in", str(private), "-pubout", "-out", str(public))
        return private, public


def write_kubeconfig(
    path: Path, server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None, token: str = ""
) -> Path:
    """Write a kubeconfig (JSON, which every YAML reader accepts) with one user and one context."""
    user: dict[str, str] = {}
    if cert and key:
        user = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        user["token"] = token
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "envtest", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": "user"}}],
        "current-context": "envtest",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path


# --------------------------------------------------------------------------------------------------------
# kwok's behaviour is given as Stages. These are this project's own: a fake node becomes Ready and keeps a
# lease; a pod bound to a fake node becomes Running with its containers ready; a deleted pod is removed.

KWOK_STAGES = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: elastic-fake-node-ready
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values: ['True']
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - type: Ready
        status: "True"
        reason: KubeletReady
        message: "kwok fake node"
        lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
      {{ range list "MemoryPressure" "DiskPressure" "PIDPressure" "NetworkUnavailable" }}
      - type: {{ . }}
        status: "False"
        reason: "KwokFakeNode"
        lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
      {{ end }}
      addresses:
      {{ with NodeIP }}
      - type: InternalIP
        address: {{ . | Quote }}
      {{ end }}
      - type: Hostname
        address: {{ .metadata.name | Quote }}
      allocatable:
      {{ with .status.allocatable }}{{ YAML . 1 }}{{ else }}
        cpu: "32"
        memory: 256Gi
        pods: "110"
      {{ end }}
      capacity:
      {{ with .status.capacity }}{{ YAML . 1 }}{{ else }}
        cpu: "32"
        memory: 256Gi
        pods: "110"
      {{ end }}
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        kubeletVersion: fake
        containerRuntimeVersion: fake
        kernelVersion: fake
        kubeProxyVersion: fake
        osImage: fake
        machineID: ""
        bootID: ""
        systemUUID: ""
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: elastic-fake-pod-running
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Pending']
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Running
      startTime: {{ $now | Quote }}
      conditions:
      {{ range list "PodReadyToStartContainers" "Initialized" "ContainersReady" "Ready" }}
      - type: {{ . }}
        status: "True"
        lastTransitionTime: {{ $now | Quote }}
      {{ end }}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        imageID: ""
        ready: true
        started: true
        restartCount: 0
        state:
          running:
            startedAt: {{ $now | Quote }}
      {{ end }}
      {{ with NodeIPWith .spec.nodeName }}
      hostIP: {{ . | Quote }}
      hostIPs:
      - ip: {{ . | Quote }}
      {{ end }}
      {{ $uid := or .metadata.uid "" }}
      {{ $name := or .metadata.name "" }}
      {{ $namespace := or .metadata.namespace "" }}
      {{ with PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) $uid $name $namespace }}
      podIP: {{ . | Quote }}
      podIPs:
      - ip: {{ . | Quote }}
      {{ end }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: elastic-fake-pod-deleted
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
  next:
    delete: true
"""


# --------------------------------------------------------------------------------------------------------
# The control plane.


def kill_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the starting process dies (Linux prctl).

    A crashed or killed pytest must not leave an API server and etcd running on the shared machine; SIGKILL
    because an API server told to stop gracefully may drain its connections for a minute.
    """
    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler (+ kwok), state in ``state_dir``.

    ``extra_args`` adds or overrides flags per component (``{"kube-controller-manager":
    ["--node-monitor-grace-period=10s"]}``), so a test about lost nodes need not wait the default 50s.
    ``die_with_parent`` ties the processes' lives to the thread that starts them (what a fixture wants:
    start from the main thread; the command line's ``start`` turns it off so the cluster outlives it).
    """

    state_dir: Path
    binaries: Path | None = None
    kwok: bool = True
    die_with_parent: bool = True
    extra_args: Mapping[str, list[str]] = field(default_factory=dict)
    start_timeout: float = 120.0

    ports: dict[str, int] = field(default_factory=dict, init=False)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir).resolve()
        self.pki = Pki(self.state_dir / "pki")
        self.logs = self.state_dir / "logs"

    # ---- addresses and credentials

    @property
    def server(self) -> str:
        """The API server's URL."""
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    @property
    def admin_kubeconfig(self) -> Path:
        """A kubeconfig for a cluster admin (``system:masters``): what ``KUBECONFIG`` should point at."""
        return self.state_dir / "admin.kubeconfig"

    def _user_cert(self, user: str, groups: Iterable[str]) -> tuple[str, Path, Path]:
        """A certificate per (user, groups), named after both, so a cached one never has stale groups."""
        groups = sorted(groups)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
        if groups:
            safe += "-" + hashlib.sha256("\n".join(groups).encode()).hexdigest()[:10]
        cert, key = self.pki.issue(f"user-{safe}", user, groups)
        return safe, cert, key

    def user_kubeconfig(self, user: str, groups: Iterable[str] = ()) -> Path:
        """A kubeconfig with a client certificate for ``user`` in ``groups`` (RBAC decides its rights)."""
        safe, cert, key = self._user_cert(user, groups)
        return write_kubeconfig(
            self.state_dir / f"{safe}.kubeconfig", self.server, self.pki.ca_cert, cert=cert, key=key
        )

    def node_kubeconfig(self, node_name: str) -> Path:
        """Credentials a kubelet would have for ``node_name``: the Node authorizer limits it to its pods."""
        return self.user_kubeconfig(f"system:node:{node_name}", ["system:nodes"])

    def configuration(
        self, *, user: str | None = None, groups: Iterable[str] = (), token: str | None = None
    ) -> Any:
        """A ``kubernetes.client.Configuration``: admin by default, a certificate user, or a bearer token."""
        from kubernetes import client

        conf = client.Configuration()
        conf.host = self.server
        conf.ssl_ca_cert = str(self.pki.ca_cert)
        if token is not None:
            conf.api_key = {"authorization": f"Bearer {token}"}
        else:
            if user is None:
                cert, key = self.pki.dir / "admin.crt", self.pki.dir / "admin.key"
            else:
                _, cert, key = self._user_cert(user, groups)
            conf.cert_file, conf.key_file = str(cert), str(key)
        return conf

    def api_client(self, **kwargs: Any) -> Any:
        """A ``kubernetes.client.ApiClient`` for ``configuration(**kwargs)``; close it when done."""
        from kubernetes import client

        return client.ApiClient(self.configuration(**kwargs))

    def env(self) -> dict[str, str]:
        """Environment variables that point clients (kubectl, the server under test) at this cluster."""
        return {"KUBECONFIG": str(self.admin_kubeconfig), "KUBEBUILDER_ASSETS": str(self._bin_dir())}

    # ---- lifecycle

    def _bin_dir(self) -> Path:
        if self.binaries is None:
            self.binaries = bin_dir()
        return self.binaries

    def _write_pki(self) -> None:
        pki = self.pki
        pki.create_ca()
        pki.issue(
            "serving", "kube-apiserver",
            server_names=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"],
            # The kubernetes Service's ClusterIP and the real node's bridge address behind it, where
            # pods reach this API server (in-cluster configuration, TLS checked).
            server_ips=["127.0.0.1", "10.96.0.1", POD_NETWORK_HOST],
        )  # fmt: skip
        pki.service_account_keys()
        for name, cn, orgs in (
            ("admin", "envtest-admin", ["system:masters"]),
            ("controller-manager", "system:kube-controller-manager", []),
            ("scheduler", "system:kube-scheduler", []),
            ("kwok", "kwok-controller", ["system:masters"]),
        ):
            pki.issue(name, cn, orgs)

    def _kubeconfig(self, name: str) -> Path:
        cert, key = self.pki.dir / f"{name}.crt", self.pki.dir / f"{name}.key"
        return write_kubeconfig(
            self.state_dir / f"{name}.kubeconfig", self.server, self.pki.ca_cert, cert=cert, key=key
        )

    def _args(self, name: str) -> list[str]:
        s, pki = self.state_dir, self.pki.dir
        if name == "etcd":
            client_url = f"http://127.0.0.1:{self.ports['etcd']}"
            peer_url = f"http://127.0.0.1:{self.ports['etcd-peer']}"
            args = [
                f"--data-dir={s / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--listen-metrics-urls=",
                # Tests throw the data away: skipping fsync makes every write much faster on shared disks.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]
        elif name == "kube-apiserver":
            args = [
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address=127.0.0.1",
                # The kubernetes Service's endpoint: the real node's bridge address, forwarded to this
                # API server's port there while a real node runs (tests/support/cluster_network.py).
                f"--advertise-address={POD_NETWORK_HOST}",
                f"--secure-port={self.ports['kube-apiserver']}",
                f"--tls-cert-file={pki / 'serving.crt'}",
                f"--tls-private-key-file={pki / 'serving.key'}",
                f"--client-ca-file={self.pki.ca_cert}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--allow-privileged=true",
                # A real kubelet (tests/support/node.py) registers its node name as its Hostname, which no
                # DNS resolves here: `kubectl logs` and exec reach it at its InternalIP.
                "--kubelet-preferred-address-types=InternalIP,Hostname,ExternalIP",
                f"--cert-dir={s / 'apiserver-certs'}",
            ]
        elif name in ("kube-controller-manager", "kube-scheduler"):
            short = "controller-manager" if name == "kube-controller-manager" else "scheduler"
            kubeconfig = self._kubeconfig(short)
            args = [
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports[name]}",
                f"--tls-cert-file={pki / 'serving.crt'}",
                f"--tls-private-key-file={pki / 'serving.key'}",
            ]
            if name == "kube-controller-manager":
                args += [
                    f"--service-account-private-key-file={pki / 'sa.key'}",
                    f"--root-ca-file={self.pki.ca_cert}",
                    f"--cluster-signing-cert-file={self.pki.ca_cert}",
                    f"--cluster-signing-key-file={self.pki.ca_key}",
                    # Each controller acts as its own ServiceAccount, as in a real cluster, so RBAC applies.
                    "--use-service-account-credentials=true",
                    f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                    # A claim created right after its volume is otherwise bound only at the next resync.
                    "--pvclaimbinder-sync-period=1s",
                ]
        elif name == "kwok":
            stages = s / "kwok-stages.yaml"
            stages.write_text(KWOK_STAGES)
            args = [
                f"--kubeconfig={self._kubeconfig('kwok')}",
                f"--config={stages}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_ANNOTATION_VALUE}",
                f"--cidr={KWOK_POD_CIDR}",
                "--node-ip=10.0.0.1",
                "--node-lease-duration-seconds=40",
            ]
        else:
            raise ValueError(name)
        return args + list(self.extra_args.get(name, []))

    def _spawn(self, name: str) -> None:
        binary = self._bin_dir() / name
        log = (self.logs / f"{name}.log").open("ab")
        env = dict(os.environ)
        if name == "kwok":
            # kwok reads ~/.kwok/kwok.yaml when it exists; an isolated HOME keeps a developer's out.
            env["HOME"] = str(self.state_dir / "kwok-home")
            Path(env["HOME"]).mkdir(exist_ok=True)
        proc = subprocess.Popen(
            [str(binary), *self._args(name)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.state_dir,
            env=env,
            start_new_session=True,
            preexec_fn=kill_with_parent if self.die_with_parent else None,
        )
        log.close()
        self.procs[name] = proc
        self._save_state()

    def _save_state(self) -> None:
        state = {
            "server": self.server,
            "ports": self.ports,
            "pids": {name: p.pid for name, p in self.procs.items()},
            "kubeconfig": str(self.admin_kubeconfig),
        }
        (self.state_dir / "state.json").write_text(json.dumps(state, indent=2) + "\n")

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last lines of a component's log: what a failure message should show."""
        path = self.logs / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise ControlPlaneError(
                f"{name} exited with {proc.returncode} while starting; its log ends:\n{self.log_tail(name)}"
            )

    def _wait(self, name: str, probe: Callable[[], bool], what: str) -> None:
        def check() -> bool:
            self._check_alive(name)
            return probe()

        try:
            wait_for(check, self.start_timeout, what)
        except TimeoutError as exc:
            raise ControlPlaneError(f"{exc}; {name}'s log ends:\n{self.log_tail(name)}") from None

    def _https_ok(self, port: int, path: str, *, client_cert: bool) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        if client_cert:
            ctx.load_cert_chain(str(self.pki.dir / "admin.crt"), str(self.pki.dir / "admin.key"))
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=ctx, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def start(self, attempts: int = 3) -> ControlPlane:
        """Start every component and return once the cluster can run pods.

        Ready means: ``/readyz`` is ok, the controller-manager has created the ``default`` ServiceAccount
        (so pods can be admitted) and the scheduler answers its health check. Ports are picked free just
        before use; if another process takes one in between, the start is tried again on new ports.
        """
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except ControlPlaneError as exc:
                if "address already in use" not in str(exc) or attempt == attempts:
                    raise
                shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)
        raise AssertionError("unreachable")

    def _start_once(self) -> ControlPlane:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        if not binaries_built(self._bin_dir()):
            raise ControlPlaneError(
                f"control plane binaries missing in {self._bin_dir()}: run scripts/envtest.sh build"
            )
        for name in ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            self.ports[name] = free_port()
        self._write_pki()
        write_kubeconfig(
            self.admin_kubeconfig, self.server, self.pki.ca_cert,
            cert=self.pki.dir / "admin.crt", key=self.pki.dir / "admin.key",
        )  # fmt: skip
        try:
            self._spawn("etcd")
            self._wait(
                "etcd", lambda: _http_ok(f"http://127.0.0.1:{self.ports['etcd']}/health"), "etcd /health"
            )
            self._spawn("kube-apiserver")
            self._wait(
                "kube-apiserver",
                lambda: self._https_ok(self.ports["kube-apiserver"], "/readyz", client_cert=True),
                "kube-apiserver /readyz",
            )
            self._spawn("kube-controller-manager")
            self._spawn("kube-scheduler")
            if self.kwok:
                self._spawn("kwok")
            self._wait(
                "kube-scheduler",
                lambda: self._https_ok(self.ports["kube-scheduler"], "/healthz", client_cert=False),
                "kube-scheduler /healthz",
            )
            self._wait(
                "kube-controller-manager", self._default_service_account_exists, "the default ServiceAccount"
            )
            if self.kwok:
                self._check_alive("kwok")
        except BaseException:
            self.stop()
            raise
        return self

    def _default_service_account_exists(self) -> bool:
        from kubernetes import client

        with self.api_client() as api:
            try:
                client.CoreV1Api(api).read_namespaced_service_account("default", "default")
            except client.ApiException as exc:
                if exc.status == 404:
                    return False
                raise
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the components: clients, then the API server, then etcd (SIGTERM; SIGKILL after ``timeout``).

        The order matters for speed: an API server with watch clients still connected drains them for up
        to a minute before it exits; with its clients gone it exits in about a second.
        """
        for name in reversed(START_ORDER):
            if name in self.procs:
                _terminate(self.procs.pop(name), timeout)
        self.procs.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / "state.json").unlink()

    def restart(
        self, name: str, grace: float = 2.0, *, while_stopped: Callable[[], None] | None = None
    ) -> None:
        """Stop one component and start it again on the same port (an API server restart mid-watch).

        SIGTERM, then SIGKILL after ``grace`` seconds: with clients connected a graceful API server
        shutdown waits for their watches for up to a minute, which tests need not sit through; the
        clients see their connections drop either way. ``grace=0`` is a crash. ``while_stopped`` runs
        between the two (the component is down: what clients see is only its absence).
        """
        proc = self.procs.pop(name)
        if grace <= 0:
            proc.kill()
            proc.wait()
        else:
            _terminate(proc, grace)
        if while_stopped is not None:
            while_stopped()
        self._spawn(name)
        if name == "kube-apiserver":
            self._wait(
                name,
                lambda: self._https_ok(self.ports[name], "/readyz", client_cert=True),
                "kube-apiserver /readyz",
            )

    def compact_etcd(self, *, bump: bool = False) -> int:
        """Compact etcd's history up to now; returns the revision compacted to.

        With ``bump``, first write a key of etcd's own (outside Kubernetes' data) so the revision moves past
        every resourceVersion the API server has handed out, bookmarks included.
        """
        base = f"http://127.0.0.1:{self.ports['etcd']}/v3/kv"
        if bump:
            key, value = (
                base64.b64encode(b"/elastic-envtest/expire").decode(),
                base64.b64encode(b"x").decode(),
            )
            header = _post_json(f"{base}/put", {"key": key, "value": value})["header"]
        else:
            key = base64.b64encode(b"/").decode()
            header = _post_json(f"{base}/range", {"key": key, "limit": 1, "keys_only": True})["header"]
        revision = int(header["revision"])
        _post_json(f"{base}/compaction", {"revision": revision, "physical": True})
        return revision

    def expire_resource_versions(self) -> int:
        """Make every resourceVersion issued so far too old (410 Gone); returns the compacted revision.

        Stops the API server, moves etcd's revision on and compacts it, starts the API server again: every
        client's watch ends, and resuming it from its last resourceVersion gets 410 Gone ("too old resource
        version"), the informer's re-list path on demand. (Compaction alone would not do: a running API
        server's watch cache keeps serving the history it has seen; and a revision not moved on could equal
        a client's last resourceVersion, from which a watch is still allowed.)
        """
        compacted: list[int] = []
        self.restart("kube-apiserver", while_stopped=lambda: compacted.append(self.compact_etcd(bump=True)))
        return compacted[0]

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _post_json(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _running(pid: int) -> bool:
    """Alive and not a zombie: an orphan's exit is reaped by init whenever init gets to it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_state_dir(state_dir: Path, timeout: float = 15.0) -> list[str]:
    """Stop a control plane started by another process (the script's ``start``) from its ``state.json``.

    A pid is signalled only while its command line still names ``state_dir``, so a pid reused by an
    unrelated process after a reboot is never touched. Returns the names stopped.
    """
    state_dir = Path(state_dir).resolve()
    state_file = state_dir / "state.json"
    if not state_file.exists():
        return []
    pids: dict[str, int] = json.loads(state_file.read_text())["pids"]
    stopped = []
    for name, pid in sorted(pids.items(), key=lambda item: -START_ORDER.index(item[0])):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(state_dir).encode() not in cmdline:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stopped.append(name)
    state_file.unlink()
    return stopped


# --------------------------------------------------------------------------------------------------------
# kwok fake nodes with GPU capacity.


def fake_gpu_node(
    name: str,
    *,
    gpus: int = 4,
    gpumem_mib: int | None = None,
    gpucores: int | None = None,
    mig: Mapping[str, int] | None = None,
    extra: Mapping[str, str] | None = None,
    cpu: str = "32",
    memory: str = "256Gi",
    pods: int = 110,
    labels: Mapping[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A Node manifest that kwok will manage, advertising GPU resources the way device plugins do.

    ``gpus`` is ``nvidia.com/gpu`` (whole GPUs, or shares under time-slicing); ``gpumem_mib`` and
    ``gpucores`` are HAMi's ``nvidia.com/gpumem`` / ``nvidia.com/gpucores``; ``mig`` maps MIG profiles to
    counts (``{"1g.10gb": 7}`` becomes ``nvidia.com/mig-1g.10gb: 7``); ``extra`` adds any other resource.
    """
    resources: dict[str, str] = {"cpu": cpu, "memory": memory, "pods": str(pods)}
    if gpus:
        resources[GPU] = str(gpus)
    if gpumem_mib is not None:
        resources[HAMI_GPUMEM] = str(gpumem_mib)
    if gpucores is not None:
        resources[HAMI_GPUCORES] = str(gpucores)
    for profile, count in (mig or {}).items():
        resources[f"nvidia.com/mig-{profile}"] = str(count)
    resources.update(extra or {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **(labels or {}),
            },
        },
        "spec": {"taints": taints or []},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def node_schedulable(node: Any) -> bool:
    """Ready, and free of the not-ready/unreachable taints the node lifecycle controller manages."""
    conditions = {c.type: c.status for c in (node.status.conditions or [])}
    if conditions.get("Ready") != "True":
        return False
    return not any(t.key.startswith("node.kubernetes.io/") for t in (node.spec.taints or []))


def create_fake_gpu_nodes(api: Any, names: Iterable[str], wait: float = 60.0, **kwargs: Any) -> list[str]:
    """Create kwok GPU nodes (``fake_gpu_node`` arguments) and wait until the scheduler may use them."""
    from kubernetes import client

    core: Any = client.CoreV1Api(api)
    names = list(names)
    for name in names:
        core.create_node(fake_gpu_node(name, **kwargs))

    def all_schedulable() -> bool:
        return all(node_schedulable(core.read_node(name)) for name in names)

    wait_for(all_schedulable, wait, f"kwok nodes {', '.join(names)} to be schedulable")
    return names


def create_local_volume(
    api: Any,
    name: str,
    path: Path,
    *,
    capacity: str = "10Gi",
    access_modes: tuple[str, ...] = ("ReadWriteMany",),
    storage_class: str = "",
) -> None:
    """A hostPath PersistentVolume, so a PersistentVolumeClaim can bind (the PV controller binds it).

    The node runner maps a claim to its own folder, not to this path; the PV only exists so that the
    scheduler and the claim see a bound volume as in a cluster with a storage provisioner.
    """
    from kubernetes import client

    core: Any = client.CoreV1Api(api)
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": capacity},
                "accessModes": list(access_modes),
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": storage_class,
                "hostPath": {"path": str(path)},
            },
        }
    )


def decode_secret(secret: Any) -> dict[str, bytes]:
    """A Secret's data, decoded."""
    return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python -m tests.support.kube start|stop STATE_DIR", file=sys.stderr)
        return 2
    action, state_dir = argv[0], Path(argv[1])
    if action == "stop":
        stopped = stop_state_dir(state_dir)
        print(f"stopped {', '.join(stopped) or 'nothing'} in {state_dir}", file=sys.stderr)
        return 0
    if (state_dir / "state.json").exists():
        print(f"{state_dir} has a running control plane; stop it first", file=sys.stderr)
        return 1
    plane = ControlPlane(state_dir, die_with_parent=False)
    started = time.monotonic()
    plane.start()
    print(f"control plane up in {time.monotonic() - started:.1f}s: {plane.server}", file=sys.stderr)
    for key, value in plane.env().items():
        print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
