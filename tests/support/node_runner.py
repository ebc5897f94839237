"""A test-side Kubernetes "node": runs the pods bound to it as local processes.

kwok marks pods Running but runs nothing; the Kubernetes provisioner needs its kernels to really execute
cells. ``NodeRunner`` is the smallest honest kubelet for that:

- it registers a ``Node`` (not managed by kwok) with GPU capacity, keeps its ``Ready`` condition and its
  ``kube-node-lease`` Lease fresh, so the scheduler and the node lifecycle controller treat it as alive;
- it watches the pods whose ``spec.nodeName`` is its name, and for each one starts the first container's
  ``command`` + ``args`` as a local process, with the pod's ``env``/``envFrom`` resolved (values,
  ``secretKeyRef``, ``configMapKeyRef``, ``fieldRef``), a pod IP of its own from 127.0.0.0/8 (Linux routes
  all of it to ``lo``, so a kernel can bind fixed ports on "its" address as it would in a cluster) and its
  volumes emulated by local folders;
- it reports the pod's status through the ``pods/status`` subresource (Running with ready containers, then
  Succeeded/Failed with the exit code), and on deletion stops the process (SIGTERM, the grace period, then
  SIGKILL) before finalising the pod with ``gracePeriodSeconds=0``, as a kubelet does.

Volumes. A process cannot see a container's mount namespace, so each ``volumeMount`` maps its
``mountPath`` to a local folder, and the runner rewrites every occurrence of a mount path (as a whole path
prefix) in the command, args and env values to that folder. The mapping is also passed to the process as
JSON in ``NODE_RUNNER_MOUNTS`` (``{"/mnt/ckpt": "/tmp/.../pvc/ns/claim"}``) for code that builds paths
itself. Folders:

- ``emptyDir``: a fresh folder per pod, removed with the pod;
- ``secret`` / ``configMap`` / ``projected`` / ``downwardAPI``: a folder per pod with the keys as files
  (a projected ServiceAccount token is requested through the TokenRequest API, bound to the pod);
- ``persistentVolumeClaim``: ``<volumes_root>/pvc/<namespace>/<claim>``, the same folder for the same claim,
  so data outlives pods (hibernate in one pod, resume in another);
- ``hostPath``: ``<volumes_root>/host/<path>``.

A mount's ``subPath`` is a sub-folder of the volume's folder. ``readOnly`` is not enforced.

Images are not pulled: ``command_map`` maps a command's first word to a local program (by default
``python``/``python3`` to this interpreter), standing in for what the image would have. The process's
environment is the pod's env on top of a small base (``PATH``, ``HOME``, ``LANG``, ``PYTHONPATH`` so
that the image's package is the tested checkout's, and ``base_env``), not the test's environment, so a
kernel sees what a container would.

Failures a provisioner must explain: an image listed in ``unpullable_images`` leaves the container
Waiting with ``ErrImagePull`` and a ``Failed`` Event on the pod, as a kubelet reports it; ``crash()`` kills
every process and stops the heartbeats without a word, as a node that loses power.

Not emulated: probes (a started container counts as ready), init containers, more than the first container,
resource limits, image pulls, ``restartPolicy`` beyond a plain restart of the process with a short delay,
and the ``securityContext``: the process runs as the test's user, and ``readOnlyRootFilesystem`` is not
enforced (a local process has no root filesystem of its own); a pod that sets ``HOME``/``TMPDIR`` to its
emptyDir mounts gets those folders through the path rewriting above. The API server's Pod Security
Admission, which checks those settings, is real.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from tests.support.kube import kill_with_parent, node_schedulable, wait_for

log = logging.getLogger(__name__)

LEASE_NAMESPACE = "kube-node-lease"
MOUNTS_ENV = "NODE_RUNNER_MOUNTS"
POD_ROOT_ENV = "NODE_RUNNER_POD_ROOT"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _log_tail(path: Path, lines: int = 80, limit: int = 4096) -> str:
    """The end of a container's log, as a kubelet puts it in a failed container's termination message."""
    try:
        text = path.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _rfc3339(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class LoopbackPool:
    """Hands out loopback addresses (127.0.0.2, 127.0.0.3, ...), each pod its own.

    Addresses are given round robin rather than lowest-free, so a pod replaced by a new one does not
    inherit the address its predecessor's sockets may still hold in TIME_WAIT.
    """

    def __init__(self, first: str = "127.0.0.2", last: str = "127.0.255.254") -> None:
        self._first = int(ipaddress.IPv4Address(first))
        self._last = int(ipaddress.IPv4Address(last))
        self._next = self._first
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self) -> str:
        with self._lock:
            for _ in range(self._last - self._first + 1):
                candidate = self._next
                self._next = self._first if self._next >= self._last else self._next + 1
                if candidate not in self._used:
                    self._used.add(candidate)
                    return str(ipaddress.IPv4Address(candidate))
        raise RuntimeError("no loopback address left for a pod")

    def release(self, address: str) -> None:
        with self._lock:
            self._used.discard(int(ipaddress.IPv4Address(address)))


def _worker_pool() -> LoopbackPool:
    """This test process's addresses: 127.0.x.x alone, 127.<n+1>.x.x for pytest-xdist's worker ``gw<n>``.

    Workers run at once on one machine; pods of two workers on one address would take each other's ports.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return LoopbackPool()
    second = int(worker[2:]) + 1
    return LoopbackPool(f"127.{second}.0.2", f"127.{second}.255.254")


# One pool per test process, so several runners in one session never hand out the same address.
DEFAULT_POOL = _worker_pool()


@dataclass
class RunningPod:
    """What the runner knows about one pod it runs."""

    uid: str
    namespace: str
    name: str
    ip: str
    root: Path
    mounts: dict[str, Path]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    started_at: dt.datetime = field(default_factory=_now)
    restart_count: int = 0
    exit_code: int | None = None
    stopping: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def log_path(self) -> Path:
        """Where the process's stdout and stderr go (``kubectl logs`` is not served)."""
        return self.root / "container.log"


class NodeRunner:
    """A node that runs its pods' first container as a local process. See the module docstring.

    ``configuration`` is a ``kubernetes.client.Configuration``; use the node's own credentials
    (``ControlPlane.configuration(user=f"system:node:{name}", groups=["system:nodes"])``) so the Node
    authorizer limits the runner to what a kubelet may do, as in a cluster.
    """

    def __init__(
        self,
        configuration: Any,
        node_name: str,
        volumes_root: Path,
        *,
        capacity: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
        pool: LoopbackPool = DEFAULT_POOL,
        command_map: Mapping[str, str] | None = None,
        base_env: Mapping[str, str] | None = None,
        lease_seconds: int = 40,
        heartbeat_interval: float = 10.0,
        max_grace_seconds: float = 30.0,
        admin_configuration: Any | None = None,
        unpullable_images: Iterable[str] = (),
    ) -> None:
        self.configuration = configuration
        self.node_name = node_name
        self.volumes_root = Path(volumes_root)
        self.capacity = {
            "cpu": "16",
            "memory": "64Gi",
            "pods": "110",
            "nvidia.com/gpu": "1",
            **(capacity or {}),
        }
        self.labels = dict(labels or {})
        self.taints = list(taints or [])
        self.pool = pool
        self.command_map = {"python": sys.executable, "python3": sys.executable, **(command_map or {})}
        self.base_env = dict(base_env or {})
        self.lease_seconds = lease_seconds
        self.heartbeat_interval = heartbeat_interval
        self.max_grace_seconds = max_grace_seconds
        self.admin_configuration = admin_configuration
        self.unpullable_images = set(unpullable_images)
        self.pods: dict[str, RunningPod] = {}
        self._pods_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._api = client.ApiClient(configuration)
        self.core: Any = client.CoreV1Api(self._api)
        self.coordination: Any = client.CoordinationV1Api(self._api)
        self.errors: list[str] = []
        self.relists = 0  # times the pod watch was answered 410 Gone and listed again
        self._registered_at = _rfc3339(_now())
        self._finalizing: set[str] = set()  # uids of deleted pods being stopped and removed

    # ---- public API

    def start(self, wait: float = 60.0) -> NodeRunner:
        """Register the node, start heartbeats and the pod watch; return once the node is schedulable."""
        self.volumes_root.mkdir(parents=True, exist_ok=True)
        self._register_node()
        self._renew_lease()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "watch")):
            thread = threading.Thread(target=target, name=f"node-runner-{self.node_name}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        wait_for(
            lambda: node_schedulable(self.core.read_node(self.node_name)),
            wait,
            f"node {self.node_name} schedulable",
        )
        return self

    def stop(self, *, delete_node: bool = True) -> None:
        """Stop every process (SIGTERM, then SIGKILL), the heartbeats and the watch.

        The Node object is removed when ``delete_node`` and an ``admin_configuration`` was given (a node's
        own credentials may not delete nodes); otherwise it stays and goes NotReady once its lease runs
        out, as a node that was switched off does.
        """
        self._stop.set()
        with self._pods_lock:
            pods = list(self.pods.values())
        # All at once, as a node shutting down does: the slowest process sets the pace, not their sum.
        stoppers = [
            threading.Thread(target=self._terminate, args=(pod, self.max_grace_seconds)) for pod in pods
        ]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join()
        self._shutdown(delete_node)

    def crash(self) -> None:
        """The node dies at once: processes get SIGKILL, no status is reported, the Node object stays.

        For tests of lost nodes: the API still shows the pods Running until the node lifecycle controller
        notices the lease has expired (``--node-monitor-grace-period``) and evicts them.
        """
        self._stop.set()
        with self._pods_lock:
            pods = list(self.pods.values())
        for pod in pods:
            self._terminate(pod, 0.0, signal.SIGKILL)
        self._shutdown(delete_node=False)

    def _shutdown(self, delete_node: bool) -> None:
        for thread in self._threads:
            thread.join(timeout=15)
        if delete_node and self.admin_configuration is not None:
            with (
                client.ApiClient(self.admin_configuration) as admin,
                contextlib.suppress(client.ApiException),
            ):
                client.CoreV1Api(admin).delete_node(self.node_name)
        self._api.close()

    def pod(self, namespace: str, name: str) -> RunningPod | None:
        """The running pod with that name (the latest one, if a pod of that name was recreated)."""
        with self._pods_lock:
            found = [p for p in self.pods.values() if p.namespace == namespace and p.name == name]
        return found[-1] if found else None

    def __enter__(self) -> NodeRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- node registration and heartbeats

    def _node_conditions(self) -> list[dict[str, Any]]:
        now = _rfc3339(_now())
        conditions = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "node runner is posting status",
            }
        ]
        for kind in ("MemoryPressure", "DiskPressure", "PIDPressure"):
            conditions.append(
                {"type": kind, "status": "False", "reason": f"KubeletHasNo{kind}", "message": ""}
            )
        for c in conditions:
            c["lastHeartbeatTime"] = now
            c["lastTransitionTime"] = self._registered_at
        return conditions

    def _register_node(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "elastic.test/node-runner": "true",
                    **self.labels,
                },
            },
            "spec": {"taints": self.taints},
            "status": {
                "capacity": dict(self.capacity),
                "allocatable": dict(self.capacity),
                "conditions": self._node_conditions(),
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node_name},
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "node-runner",
                    "containerRuntimeVersion": "node-runner://local-process",
                    "kernelVersion": os.uname().release,
                    "kubeProxyVersion": "",
                    "osImage": "node-runner",
                    "machineID": "",
                    "bootID": "",
                    "systemUUID": "",
                },
            },
        }
        try:
            self.core.create_node(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        # Status sent on create may be dropped; set it through the status subresource too.
        self._post_node_status()

    def _post_node_status(self) -> None:
        self.core.patch_node_status(
            self.node_name,
            {
                "status": {
                    "conditions": self._node_conditions(),
                    "capacity": self.capacity,
                    "allocatable": self.capacity,
                }
            },
        )

    def _renew_lease(self) -> None:
        now = _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            lease = self.coordination.read_namespaced_lease(self.node_name, LEASE_NAMESPACE)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            node = self.core.read_node(self.node_name)
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": self.node_name,
                    "namespace": LEASE_NAMESPACE,
                    # Owned by the Node, as a kubelet's lease is: deleting the node removes it.
                    "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node.metadata.uid}
                    ],
                },
                "spec": {
                    "holderIdentity": self.node_name,
                    "leaseDurationSeconds": self.lease_seconds,
                    "renewTime": now,
                },
            }
            self.coordination.create_namespaced_lease(LEASE_NAMESPACE, body)
            return
        lease.spec.renew_time = now
        self.coordination.replace_namespaced_lease(self.node_name, LEASE_NAMESPACE, lease)

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self._stop.wait(self.heartbeat_interval):
            try:
                self._renew_lease()
                beats += 1
                if beats % 6 == 0:  # the status itself changes rarely: refresh it every minute or so
                    self._post_node_status()
            except Exception as exc:
                self._record(f"heartbeat: {exc!r}")

    # ---- the pod watch

    def _watch_loop(self) -> None:
        selector = f"spec.nodeName={self.node_name}"
        resource_version = ""
        while not self._stop.is_set():
            try:
                if not resource_version:
                    listed = self.core.list_pod_for_all_namespaces(field_selector=selector)
                    resource_version = listed.metadata.resource_version
                    self._resync(listed.items)
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=resource_version,
                    timeout_seconds=5,
                    allow_watch_bookmarks=True,
                )
                for event in stream:
                    kind, raw = event["type"], event.get("raw_object") or {}
                    if kind == "ERROR":  # e.g. 410 Gone sent as a watch event: start over with a list
                        if raw.get("code") != 410:
                            self._record(f"watch error event: {raw.get('code')} {raw.get('message')}")
                        self.relists += 1
                        resource_version = ""
                        break
                    resource_version = raw.get("metadata", {}).get("resourceVersion") or resource_version
                    if kind == "DELETED":
                        self._forget(event["object"].metadata.uid)
                    elif kind in ("ADDED", "MODIFIED"):
                        self._sync(event["object"])
                    if self._stop.is_set():
                        break
            except client.ApiException as exc:
                if exc.status == 410:  # our resourceVersion is too old: list again
                    log.info("node runner %s: watch expired (410), listing again", self.node_name)
                    self.relists += 1
                    resource_version = ""
                    continue
                self._record(f"watch: {exc.status} {exc.reason}")
                self._stop.wait(1)
            except Exception as exc:  # a dropped connection: watch again from where we were, as informers do
                self._record(f"watch: {exc!r}")
                self._stop.wait(1)

    def _resync(self, pods: list[Any]) -> None:
        seen = {p.metadata.uid for p in pods}
        with self._pods_lock:
            gone = [uid for uid in self.pods if uid not in seen]
        for uid in gone:
            self._forget(uid)
        for pod in pods:
            self._sync(pod)

    def _sync(self, pod: Any) -> None:
        uid = pod.metadata.uid
        with self._pods_lock:
            running = self.pods.get(uid)
        if pod.metadata.deletion_timestamp is not None:
            with self._pods_lock:
                if uid in self._finalizing:  # every later update of a terminating pod lands here too
                    return
                self._finalizing.add(uid)
            grace = pod.metadata.deletion_grace_period_seconds
            threading.Thread(target=self._finalize, args=(pod, running, grace), daemon=True).start()
            return
        # A pod this runner does not know yet, or knew before a restart of the runner: (re)start its
        # container, as a kubelet does after its own restart.
        if running is None and pod.status.phase not in ("Succeeded", "Failed"):
            self._start_pod(pod)

    def _forget(self, uid: str) -> None:
        """The pod is gone from the API (force-deleted or finalised): its process must not outlive it."""
        with self._pods_lock:
            running = self.pods.get(uid)
        if running is not None and not running.stopping:
            running.stopping = True
            threading.Thread(target=self._terminate_and_drop, args=(running, 0.0), daemon=True).start()

    def _record(self, message: str) -> None:
        if not self._stop.is_set():
            log.warning("node runner %s: %s", self.node_name, message)
            self.errors.append(message)

    # ---- starting a pod

    def _start_pod(self, pod: Any) -> None:
        meta = pod.metadata
        root = self.volumes_root / "pods" / meta.uid
        root.mkdir(parents=True, exist_ok=True)
        running = RunningPod(
            uid=meta.uid,
            namespace=meta.namespace,
            name=meta.name,
            ip=self.pool.acquire(),
            root=root,
            mounts={},
        )
        with self._pods_lock:
            self.pods[meta.uid] = running
        # One thread per pod, alive as long as its process: it starts, watches and restarts the process,
        # and the process's parent-death signal is tied to it (see kill_with_parent).
        thread = threading.Thread(target=self._pod_worker, args=(pod, running), daemon=True)
        thread.name = f"node-runner-{self.node_name}-{meta.namespace}-{meta.name}"
        thread.start()

    def _pod_worker(self, pod: Any, running: RunningPod) -> None:
        """Start the container, retrying what a kubelet retries; then watch the process."""
        delay, last_reason = 0.2, ""
        while True:
            if running.stopping or self._stop.is_set():
                running.finished.set()
                return
            try:
                self._prepare_and_spawn(pod, running)
                break
            except PodStartError as exc:
                reason, message, permanent = exc.reason, exc.message, exc.permanent
            except Exception as exc:
                # 403 while the Node authorizer's graph catches up with a new binding (or a restarted API
                # server), a dropped connection, a Secret not created yet: a kubelet retries these.
                reason, message, permanent = "CreateContainerConfigError", repr(exc), False
            if reason != last_reason or permanent:
                self._report_failed_start(pod, running, reason, message)
                last_reason = reason
            if permanent:
                running.finished.set()
                return
            self._stop.wait(delay)
            delay = min(delay * 2, 5.0)
        self._report_running(pod, running)
        self._monitor(pod, running)

    def _prepare_and_spawn(self, pod: Any, running: RunningPod) -> None:
        container = pod.spec.containers[0]
        if container.image in self.unpullable_images:
            raise PodStartError(
                "ErrImagePull",
                f'failed to pull image "{container.image}": not found (node runner)',
                permanent=True,
            )
        argv = [*(container.command or []), *(container.args or [])]
        if not argv:
            raise PodStartError(
                "NoCommand", "the node runner needs an explicit command (images are not run)", permanent=True
            )
        volume_dirs = self._prepare_volumes(pod, running.root)
        for mount in container.volume_mounts or []:
            local = volume_dirs[mount.name]
            if mount.sub_path:
                local = local / mount.sub_path
                local.mkdir(parents=True, exist_ok=True)
            running.mounts[mount.mount_path.rstrip("/") or "/"] = local
        env = self._resolve_env(pod, container, running.ip)
        argv = [_expand_vars(a, env) for a in argv]
        argv = [self._rewrite_paths(a, running.mounts) for a in argv]
        argv[0] = self.command_map.get(argv[0], argv[0])
        env = {k: self._rewrite_paths(v, running.mounts) for k, v in env.items()}
        env[MOUNTS_ENV] = json.dumps({k: str(v) for k, v in running.mounts.items()})
        env[POD_ROOT_ENV] = str(running.root)
        cwd = running.root / "workdir"
        if container.working_dir:
            cwd = Path(self._rewrite_paths(container.working_dir, running.mounts))
            if not str(cwd).startswith(str(self.volumes_root)):
                cwd = running.root / "workdir" / container.working_dir.lstrip("/")
        cwd.mkdir(parents=True, exist_ok=True)
        running.argv, running.env, running.cwd = argv, {**self._base_env(running.root), **env}, cwd
        with running.lock:
            if running.stopping:
                raise PodStartError("Terminating", "the pod was deleted before its container started")
            self._spawn(running)

    def _base_env(self, root: Path) -> dict[str, str]:
        env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH") if k in os.environ}
        home = root / "home"
        home.mkdir(exist_ok=True)
        env["HOME"] = str(home)
        env.update(self.base_env)
        return env

    def _spawn(self, running: RunningPod) -> None:
        with running.log_path.open("ab") as out:
            try:
                running.process = subprocess.Popen(
                    running.argv,
                    env=running.env,
                    cwd=running.cwd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group, so stopping it stops its children too
                    # Killed if the thread that started it dies with the test process: no orphans on a
                    # shared machine (the starting thread lives as long as the process it watches).
                    preexec_fn=kill_with_parent,
                )
            except OSError as exc:
                raise PodStartError(
                    "StartError", f"cannot start {running.argv[0]!r}: {exc}", permanent=True
                ) from exc
        running.started_at = _now()

    def _rewrite_paths(self, value: str, mounts: Mapping[str, Path]) -> str:
        """Replace each mount path, as a whole path prefix, by its local folder (longest first).

        One pass over the value, so a folder put in for one mount (``/tmp/pytest-.../home``) is
        never rewritten again for another (a ``/tmp`` mount).
        """
        paths = sorted((m for m in mounts if m != "/"), key=len, reverse=True)
        if not paths:
            return value
        if os.path.isabs(value) and value.rstrip("/") not in mounts and os.path.exists(value):
            # A file of this machine (a test's interpreter in a checkout under /tmp), not the pod's:
            # what a pod makes under its mounts does not exist before it runs.
            return value
        # Not inside another path either: a /tmp mount leaves /var/tmp alone.
        pattern = (
            r"(?<![A-Za-z0-9_.\-/])(" + "|".join(re.escape(m) for m in paths) + r")(?=/|$|[^A-Za-z0-9_.\-])"
        )
        return re.sub(pattern, lambda match: str(mounts[match.group(1)]), value)

    # ---- env and volumes

    def _secret(self, namespace: str, name: str) -> dict[str, str]:
        secret = self.core.read_namespaced_secret(name, namespace)
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    def _config_map(self, namespace: str, name: str) -> dict[str, str]:
        cm = self.core.read_namespaced_config_map(name, namespace)
        return dict(cm.data or {})

    def _field(self, pod: Any, path: str, pod_ip: str) -> str:
        meta = pod.metadata
        simple = {
            "metadata.name": meta.name,
            "metadata.namespace": meta.namespace,
            "metadata.uid": meta.uid,
            "spec.nodeName": pod.spec.node_name,
            "spec.serviceAccountName": pod.spec.service_account_name,
            "status.podIP": pod_ip,
            "status.podIPs": pod_ip,
            "status.hostIP": "127.0.0.1",
            "status.hostIPs": "127.0.0.1",
        }
        if path in simple:
            return str(simple[path] or "")
        match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if match:
            source = (meta.labels if match.group(1) == "labels" else meta.annotations) or {}
            return str(source.get(match.group(2), ""))
        raise PodStartError(
            "CreateContainerConfigError",
            f"fieldRef {path} is not supported by the node runner",
            permanent=True,
        )

    def _resolve_env(self, pod: Any, container: Any, pod_ip: str) -> dict[str, str]:
        ns = pod.metadata.namespace
        env: dict[str, str] = {}
        for source in container.env_from or []:
            prefix = source.prefix or ""
            try:
                if source.secret_ref is not None:
                    data = self._secret(ns, source.secret_ref.name)
                elif source.config_map_ref is not None:
                    data = self._config_map(ns, source.config_map_ref.name)
                else:
                    continue
            except client.ApiException as exc:
                ref = source.secret_ref or source.config_map_ref
                if exc.status == 404 and ref.optional:
                    continue
                raise PodStartError(
                    "CreateContainerConfigError", f"envFrom {ref.name}: {exc.reason}"
                ) from exc
            env.update({prefix + k: v for k, v in data.items()})
        for var in container.env or []:
            if var.value_from is None:
                env[var.name] = _expand_vars(var.value or "", env)
                continue
            vf = var.value_from
            try:
                if vf.field_ref is not None:
                    env[var.name] = self._field(pod, vf.field_ref.field_path, pod_ip)
                elif vf.secret_key_ref is not None:
                    ref = vf.secret_key_ref
                    data = self._secret(ns, ref.name)
                    if ref.key not in data and not ref.optional:
                        raise PodStartError(
                            "CreateContainerConfigError", f"secret {ref.name} has no key {ref.key}"
                        )
                    if ref.key in data:
                        env[var.name] = data[ref.key]
                elif vf.config_map_key_ref is not None:
                    ref = vf.config_map_key_ref
                    data = self._config_map(ns, ref.name)
                    if ref.key not in data and not ref.optional:
                        raise PodStartError(
                            "CreateContainerConfigError", f"configmap {ref.name} has no key {ref.key}"
                        )
                    if ref.key in data:
                        env[var.name] = data[ref.key]
                elif vf.resource_field_ref is not None:
                    env[var.name] = self._resource_field(container, vf.resource_field_ref.resource)
            except client.ApiException as exc:
                ref = vf.secret_key_ref or vf.config_map_key_ref
                if exc.status == 404 and ref is not None and ref.optional:
                    continue
                raise PodStartError(
                    "CreateContainerConfigError", f"env {var.name}: {exc.status} {exc.reason}"
                ) from exc
        return env

    @staticmethod
    def _resource_field(container: Any, resource: str) -> str:
        kind, _, name = resource.partition(".")
        resources = container.resources
        values = (resources.limits if kind == "limits" else resources.requests) if resources else None
        return str((values or {}).get(name, "0"))

    def _prepare_volumes(self, pod: Any, root: Path) -> dict[str, Path]:
        ns = pod.metadata.namespace
        dirs: dict[str, Path] = {}
        for volume in pod.spec.volumes or []:
            per_pod = root / "volumes" / volume.name
            if volume.persistent_volume_claim is not None:
                path = self.volumes_root / "pvc" / ns / volume.persistent_volume_claim.claim_name
            elif volume.host_path is not None:
                path = self.volumes_root / "host" / volume.host_path.path.lstrip("/")
            elif volume.secret is not None:
                per_pod.mkdir(parents=True, exist_ok=True)
                try:
                    data = self._secret(ns, volume.secret.secret_name)
                except client.ApiException as exc:
                    if not (exc.status == 404 and volume.secret.optional):
                        raise PodStartError(
                            "CreateContainerConfigError", f"secret {volume.secret.secret_name}: {exc.reason}"
                        ) from exc
                    data = {}
                _write_items(per_pod, data, volume.secret.items)
                if volume.secret.default_mode is not None:  # as a kubelet does (kernel key files rely on it)
                    for written in per_pod.rglob("*"):
                        if written.is_file():
                            written.chmod(volume.secret.default_mode)
                path = per_pod
            elif volume.config_map is not None:
                per_pod.mkdir(parents=True, exist_ok=True)
                _write_items(per_pod, self._config_map(ns, volume.config_map.name), volume.config_map.items)
                path = per_pod
            elif volume.projected is not None:
                per_pod.mkdir(parents=True, exist_ok=True)
                self._write_projected(pod, per_pod, volume.projected)
                path = per_pod
            elif volume.downward_api is not None:
                per_pod.mkdir(parents=True, exist_ok=True)
                for item in volume.downward_api.items or []:
                    if item.field_ref is not None:
                        (per_pod / item.path).write_text(self._field(pod, item.field_ref.field_path, ""))
                path = per_pod
            else:  # emptyDir and anything else a test might use: a fresh folder for this pod
                path = per_pod
            path.mkdir(parents=True, exist_ok=True)
            dirs[volume.name] = path
        return dirs

    def _write_projected(self, pod: Any, target: Path, projected: Any) -> None:
        ns = pod.metadata.namespace
        for source in projected.sources or []:
            if source.service_account_token is not None:
                sat = source.service_account_token
                bound = {"name": pod.metadata.name, "uid": pod.metadata.uid}
                request = {
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenRequest",
                    "spec": {
                        "audiences": [sat.audience] if sat.audience else None,
                        "expirationSeconds": sat.expiration_seconds or 3600,
                        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", **bound},
                    },
                }  # fmt: skip
                token = self.core.create_namespaced_service_account_token(
                    pod.spec.service_account_name or "default", ns, request
                )
                (target / sat.path).write_text(token.status.token)
            elif source.config_map is not None:
                _write_items(target, self._config_map(ns, source.config_map.name), source.config_map.items)
            elif source.secret is not None:
                _write_items(target, self._secret(ns, source.secret.name), source.secret.items)
            elif source.downward_api is not None:
                for item in source.downward_api.items or []:
                    if item.field_ref is not None:
                        (target / item.path).write_text(self._field(pod, item.field_ref.field_path, ""))

    # ---- status

    def _container_status(
        self, pod: Any, running: RunningPod, state: dict[str, Any], ready: bool
    ) -> dict[str, Any]:
        container = pod.spec.containers[0]
        pid = running.process.pid if running.process else 0
        return {
            "name": container.name,
            "image": container.image or "",
            "imageID": "",
            "containerID": f"node-runner://{self.node_name}/{pid}",
            "ready": ready,
            "started": "running" in state,
            "restartCount": running.restart_count,
            "state": state,
        }

    def _patch_status(self, running: RunningPod, status: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(running.name, running.namespace, {"status": status})
        except client.ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile has no status to report
                self._record(f"status of {running.namespace}/{running.name}: {exc.status} {exc.reason}")

    def _conditions(self, ready: bool) -> list[dict[str, str]]:
        now = _rfc3339(_now())
        value = "True" if ready else "False"
        return [
            {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": value, "lastTransitionTime": now},
            {"type": "Ready", "status": value, "lastTransitionTime": now},
        ]

    def _report_running(self, pod: Any, running: RunningPod) -> None:
        started = _rfc3339(running.started_at)
        self._patch_status(
            running,
            {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": running.ip,
                "podIPs": [{"ip": running.ip}],
                "startTime": started,
                "conditions": self._conditions(True),
                "containerStatuses": [
                    self._container_status(pod, running, {"running": {"startedAt": started}}, ready=True)
                ],
            },
        )

    def _event(self, pod: Any, reason: str, message: str, kind: str = "Warning") -> None:
        """Record an Event on the pod, as a kubelet does: where a launch timeout finds the reason."""
        now = _now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{pod.metadata.name}.", "namespace": pod.metadata.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod.metadata.name,
                "namespace": pod.metadata.namespace,
                "uid": pod.metadata.uid,
                "fieldPath": f"spec.containers{{{pod.spec.containers[0].name}}}",
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": self.node_name},
            "reportingComponent": "kubelet",
            "reportingInstance": self.node_name,
            "firstTimestamp": _rfc3339(now),
            "lastTimestamp": _rfc3339(now),
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(pod.metadata.namespace, body)
        except client.ApiException as exc:
            self._record(f"event {reason} on {pod.metadata.name}: {exc.status} {exc.reason}")

    def _report_failed_start(self, pod: Any, running: RunningPod, reason: str, message: str) -> None:
        """A container that cannot start stays Waiting with the reason, as a kubelet shows it."""
        self._record(f"{running.namespace}/{running.name}: {reason}: {message}")
        self._event(pod, "Failed", message)
        self._patch_status(
            running,
            {
                "phase": "Pending",
                "hostIP": "127.0.0.1",
                "podIP": running.ip,
                "podIPs": [{"ip": running.ip}],
                "startTime": _rfc3339(running.started_at),
                "conditions": self._conditions(False),
                "containerStatuses": [
                    self._container_status(
                        pod, running, {"waiting": {"reason": reason, "message": message}}, False
                    )
                ],
            },
        )

    def _monitor(self, pod: Any, running: RunningPod) -> None:
        """Wait for the process; report how it ended, or restart it if the pod's policy says so."""
        policy = pod.spec.restart_policy or "Always"
        while True:
            proc = running.process
            assert proc is not None
            code = proc.wait()
            running.exit_code = code
            if running.stopping or self._stop.is_set():
                break
            finished = _rfc3339(_now())
            terminated = {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": _rfc3339(running.started_at),
                "finishedAt": finished,
            }
            if code < 0:
                terminated["exitCode"] = 128 - code
                terminated["signal"] = -code
            if code != 0:  # a kubelet's terminationMessagePolicy FallbackToLogsOnError: the log's tail
                terminated["message"] = _log_tail(running.log_path)
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                with running.lock:
                    if running.stopping:
                        break
                    running.restart_count += 1
                    time.sleep(1)  # a kubelet backs off; one second keeps tests quick
                    try:
                        self._spawn(running)
                    except PodStartError as exc:
                        self._record(str(exc))
                        break
                status = self._container_status(
                    pod, running, {"running": {"startedAt": _rfc3339(running.started_at)}}, True
                )
                status["lastState"] = {"terminated": terminated}
                self._patch_status(running, {"containerStatuses": [status]})
                continue
            self._patch_status(
                running,
                {
                    "phase": "Succeeded" if code == 0 else "Failed",
                    "conditions": self._conditions(False),
                    "containerStatuses": [
                        self._container_status(pod, running, {"terminated": terminated}, False)
                    ],
                },
            )
            break
        running.finished.set()

    # ---- stopping

    def _terminate(self, running: RunningPod, grace: float, first: signal.Signals = signal.SIGTERM) -> None:
        """SIGTERM the process group, wait up to ``grace`` seconds, then SIGKILL it."""
        with running.lock:
            running.stopping = True
            proc = running.process
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, first)
        try:
            proc.wait(timeout=max(grace, 0.0) or 0.5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # Children that left the group die with it only if they were in it; kill what remains of the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _drop(self, running: RunningPod) -> None:
        with self._pods_lock:
            self.pods.pop(running.uid, None)
        self.pool.release(running.ip)
        shutil.rmtree(running.root / "volumes", ignore_errors=True)

    def _terminate_and_drop(self, running: RunningPod, grace: float) -> None:
        self._terminate(running, grace)
        self._drop(running)

    def _finalize(self, pod: Any, running: RunningPod | None, grace: int | None) -> None:
        """A deleted pod: stop its process within the grace period, then remove the pod for good."""
        if running is not None:
            self._terminate(running, min(float(grace if grace is not None else 30), self.max_grace_seconds))
        try:
            self.core.delete_namespaced_pod(
                pod.metadata.name,
                pod.metadata.namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=pod.metadata.uid)
                ),
            )
        except client.ApiException as exc:
            if exc.status not in (404, 409):
                self._record(
                    f"finalize {pod.metadata.namespace}/{pod.metadata.name}: {exc.status} {exc.reason}"
                )
        if running is not None:
            self._drop(running)
        with self._pods_lock:
            self._finalizing.discard(pod.metadata.uid)


class PodStartError(Exception):
    """A pod that cannot start, with the container-waiting ``reason`` a kubelet would report."""

    def __init__(self, reason: str, message: str, *, permanent: bool = False) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.permanent = permanent  # False: retried with backoff, as a kubelet retries a pod's sync


def _write_items(target: Path, data: Mapping[str, str], items: list[Any] | None) -> None:
    """Write a Secret's or ConfigMap's keys as files (only the listed ``items``, renamed, when given)."""
    if items:
        for item in items:
            if item.key in data:
                path = target / item.path
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(data[item.key])
        return
    for key, value in data.items():
        (target / key).write_text(value)


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def _expand_vars(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, ``$$`` escapes, others stay."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_REF.sub(sub, value)
