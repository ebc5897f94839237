"""Kernel pods whose checkpoints go to an object store: no shared claim at all (issue 31).

The real control plane and the node runners (``tests/support/node_runner.py``) run the kernel pods;
a real S3-compatible server (``tests/support/s3.py``) holds the checkpoints. The pods mount no
PersistentVolumeClaim: the agent writes its checkpoint to the pod's emptyDir and sends it to the
bucket through presigned part URLs; a resume on another node reads it back by presigned ranged
GETs. The server's ``checkpoint_root`` is its own folder, which no pod sees.

Why another owner's checkpoints stay out of reach of a user's notebook code: the kernel holds no
credential of the store (the gateway's is in the gateway's environment only), and every URL it is
handed is signed for one method on one key of its own checkpoint; the signature covers the key, so
a URL rewritten to another prefix is refused, and the bucket answers nothing unsigned. The test
below is what such code tries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from tests.support.node_runner import NodeRunner  # noqa: E402
from tests.support.oracle import SETUP, Reference, check_same, cycle_cell, run_both  # noqa: E402
from tests.support.pod_cluster import PodCluster, pod_cluster  # noqa: E402
from tests.support.s3 import S3Server, running_s3  # noqa: E402
from tests.support.server import RunningServer, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("numpy")

NAMESPACE = "elastic-s3"
SIZE = "python3-gpu-whole"
BUCKET = "pod-checkpoints"
OTHER_BUCKET = "pod-attack"
ID_ENV, KEY_ENV = "ELASTIC_TEST_S3_ACCESS_KEY", "ELASTIC_TEST_S3_SECRET_KEY"


@pytest.fixture(scope="module")
def cluster(kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner) -> Iterator[PodCluster]:
    with pod_cluster(kube_plane, kube_api, kube_runner, NAMESPACE) as made:
        yield made


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with running_s3(tmp_path_factory.mktemp("s3")) as server:
        yield server


def start(cluster: PodCluster, s3: S3Server, home: Path, bucket: str = BUCKET) -> RunningServer:
    """A server whose kernel pods mount no claim and whose checkpoints are in the bucket, encrypted."""
    master = home / "master-key"
    master.write_text(os.urandom(32).hex())
    master.chmod(0o600)
    config = cluster.config(checkpoint_claim="")
    config["ElasticKernels"]["checkpoint_root"] = str(home / "scratch")  # the server's own disk
    config["ElasticKernels"]["checkpoint_store"] = "s3"
    config["S3Checkpoints"] = {
        "endpoint": s3.endpoint,
        "bucket": bucket,  # one per test: each has its own master key
        "create_bucket": True,
        "access_key_id_env": ID_ENV,
        "secret_access_key_env": KEY_ENV,
        "encryption_key_files": [str(master)],
    }
    return start_server(home, config, env_extra={ID_ENV: s3.admin.access_key, KEY_ENV: s3.admin.secret_key})


def model(server: RunningServer, kernel_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/elastic/kernels/{kernel_id}"))


def committed(s3: S3Server, owner: str, kernel_id: str) -> str | None:
    raw = s3.bucket(BUCKET).get(f"{owner}/{kernel_id}/current")
    return None if raw is None else raw.decode().strip()


#: The file behind ``big``'s buffer in the kernel (``/proc/self/maps``), or None; leaves no name.
MAPPED_FILE = """
print(next(
    (line.split(maxsplit=5)[5:] or [None])[0]
    for line in open("/proc/self/maps")
    if int(line.split("-")[0], 16) <= big.ctypes.data < int(line.split()[0].split("-")[1], 16)
))
"""


def test_pod_kernels_hibernate_to_the_bucket_and_resume_on_another_node(
    cluster: PodCluster, s3: S3Server, reference: Reference, tmp_path: Path
) -> None:
    server = start(cluster, s3, tmp_path)
    try:
        kernel_id = server.start_kernel(SIZE)
        owner = model(server, kernel_id)["owner"]
        run_both(server, kernel_id, reference, SETUP)
        pod = cluster.running_pod(kernel_id)
        assert all(v.persistent_volume_claim is None for v in pod.spec.volumes), pod.spec.volumes
        nodes, seen = [pod.spec.node_name], set()
        for n in range(1, 4):
            reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
            assert reply.status == 200, reply.body
            assert cluster.pod_of(kernel_id) is None and model(server, kernel_id)["state"] == "hibernated"
            checkpoint = committed(s3, owner, kernel_id)
            assert checkpoint is not None and checkpoint not in seen
            seen.add(checkpoint)
            # Nothing of it on the server's disk: the resume can only read it from the bucket.
            assert not list((tmp_path / "scratch").rglob("data.bin"))
            cluster.cordon(nodes[-1])  # resume elsewhere
            for runner in cluster.runners:
                if runner.node_name != nodes[-1]:
                    cluster.cordon(runner.node_name, False)
            run_both(server, kernel_id, reference, cycle_cell(n))
            pod = cluster.running_pod(kernel_id)
            assert pod.spec.node_name != nodes[-1]
            nodes.append(pod.spec.node_name)
            check_same(server, kernel_id, reference)
            # The restore URLs and the checkpoint's key are in the pod's Secret, not in its spec
            # (which anyone allowed to read pods in the namespace sees).
            spec = json.dumps(pod.spec.to_dict(), default=str)
            assert "X-Amz-Signature" not in spec and "ELASTIC_RESTORE_DATA_URL" in spec
        # The pod's agent kept its restore report in its emptyDir; the server asked it for it.
        report = server.get(f"/api/elastic/kernels/{kernel_id}/report")["restore_report"]
        assert report["refused"] is None and report["checkpoint"] in seen and report["restored"], report
        # The pod's entry point started the download before ipykernel ran (kernelmgr.checkpoint.prefetch).
        assert report["prefetch"] is not None and report["prefetch"]["lead"] > 0, report
        # The big array came from the bucket into the download's memory file, mapped from there
        # (the file let go of), not read a second time into new memory nor written to the node.
        run_both(
            server, kernel_id, reference, "import numpy as np; big = np.arange(1 << 21, dtype=np.float64)"
        )
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply.body
        mapped = server.execute(kernel_id, MAPPED_FILE).strip()  # resumes it
        assert mapped == "/memfd:elastic-checkpoint-data (deleted)", mapped
        reply = server.request("DELETE", f"/api/kernels/{kernel_id}")
        assert reply.status == 204
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
        wait_for(
            lambda: not list(s3.bucket(BUCKET).listing(f"{owner}/{kernel_id}/")),
            60,
            "the kernel's objects to go",
        )
    finally:
        server.stop()
        for runner in cluster.runners:
            cluster.cordon(runner.node_name, False)


#: What a user's notebook code tries, to read another owner's checkpoint: a credential in its
#: environment or files, the bucket unsigned, and its own presigned URLs rewritten to the prefix.
ATTACK = r"""
import json, os, pathlib, urllib.error, urllib.request
def _status(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return [r.status, r.read()[:200].decode("latin-1")]
    except urllib.error.HTTPError as e:
        return [e.code, ""]
_environ = dict(os.environ)
_initial = pathlib.Path("/proc/self/environ").read_bytes().split(b"\0")
_environ.update(dict(v.decode().split("=", 1) for v in _initial if b"=" in v))
_own = _environ["ELASTIC_RESTORE_DATA_URL"]
_head, _query = _own.split("?", 1)
_found = {
    "credentials": sorted(k for k in _environ if "AWS" in k or "S3" in k or "ACCESS_KEY" in k),
    "credential_files": [p for p in ("~/.aws/credentials", "~/.aws/config", "~/.s3cfg")
                         if pathlib.Path(p).expanduser().exists()],
    "own": _status(_own)[0],
    "unsigned": _status(ENDPOINT + "/" + BUCKET + "/" + VICTIM),
    "listing": _status(ENDPOINT + "/" + BUCKET + "?list-type=2&prefix=" + VICTIM.split("/")[0]),
    "rewritten": _status(ENDPOINT + "/" + BUCKET + "/" + VICTIM + "?" + _query),
}
print(json.dumps(_found))
"""


def test_a_users_notebook_code_cannot_read_another_owners_checkpoints(
    cluster: PodCluster, s3: S3Server, tmp_path: Path
) -> None:
    secret = "the-other-owners-variables"
    victim = "someone-else/k-victim/20260101T000000.000000Z-0001/data.bin"
    server = start(cluster, s3, tmp_path, OTHER_BUCKET)
    try:
        s3.bucket(OTHER_BUCKET).put(victim, secret.encode())
        kernel_id = server.start_kernel(SIZE)
        assert server.execute(kernel_id, "x = 1; print(x)").strip() == "1"
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply.body
        code = f"ENDPOINT, BUCKET, VICTIM = {s3.endpoint!r}, {OTHER_BUCKET!r}, {victim!r}\n" + ATTACK
        found = json.loads(server.execute(kernel_id, code).strip().splitlines()[-1])  # resumes it
        assert found["credentials"] == [] and found["credential_files"] == [], found
        assert found["own"] == 200, found  # the store is reachable, and its own checkpoint readable
        for attempt in ("unsigned", "listing", "rewritten"):
            status, body = found[attempt]
            assert status == 403 and secret not in body, (attempt, found)
        server.shutdown_kernel(kernel_id)
    finally:
        server.stop()
