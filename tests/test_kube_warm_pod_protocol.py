"""The warm pod's HTTP protocol, with the pod's program run as a local process (no cluster).

What the server relies on: only its token is answered; nothing outside the pod's one kernel
directory can be read or written; a pod becomes one kernel, once; a checkpoint taken from it is
committed in the store whole (verified with the owner's key) or not at all; and one pushed into a
fresh pod is what that pod's kernel restores. The end-to-end path through a real control plane is
tests/test_kube_warm_pods.py.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient

from kernelmgr.checkpoint.agent import CHECKPOINT_CODE
from kernelmgr.checkpoint.keys import owner_key
from kernelmgr.checkpoint.layout import read_current
from kernelmgr.checkpoint.verify import load_verified_manifest
from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.kube.warm_client import WarmPodClient, WarmPodError
from tests.support.kernel_ready import still_running, wait_for_kernel_info
from tests.support.ports import free_port_block

pytestmark = [pytest.mark.pure, pytest.mark.timeout(180)]

OWNER = "alice"
SECRET = b"s" * 32


@pytest.mark.server  # the warm pod's program as a real process, waited for (tests/support/costs.py)
class LocalWarmPod:
    """``python -m kernelmgr.kube.warm_pod`` as a process, with a pod's environment."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root / name
        self.checkpoints = self.root / "checkpoints"
        tmp = self.root / "tmp"
        for folder in (self.checkpoints, tmp):
            folder.mkdir(parents=True)
        self.token = secrets.token_urlsafe(16)
        (self.root / "token").write_text(self.token)
        self.first_port = free_port_block(6)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(self.root),
            "TMPDIR": str(tmp),
            "POD_IP": "127.0.0.1",
            "PYTHONPATH": os.pathsep.join(sys.path),
            "ELASTIC_WARM_TOKEN_FILE": str(self.root / "token"),
            "ELASTIC_WARM_CHECKPOINTS": str(self.checkpoints),
        }
        self.port = self.first_port + 5
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kernelmgr.kube.warm_pod", "--port", str(self.port), "colorsys"],
            env=env,
            cwd=self.root,
        )
        self.client = WarmPodClient("127.0.0.1", self.port, self.token)
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.client.status()["state"] == "ready":
                    break
            except WarmPodError:
                pass
            assert time.monotonic() < deadline, "the warm pod did not become ready"
            assert self.process.poll() is None, "the warm pod exited"
            time.sleep(0.1)

    def connection(self) -> dict[str, Any]:
        names = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
        info: dict[str, Any] = {n: self.first_port + i for i, n in enumerate(names)}
        info.update(
            key=secrets.token_hex(16), transport="tcp", signature_scheme="hmac-sha256", kernel_name=""
        )
        return info

    def handoff(self, kernel_id: str, restore: str | None = None) -> BlockingKernelClient:
        info = self.connection()
        env = {
            "ELASTIC_KERNEL_ID": kernel_id,
            "ELASTIC_OWNER": OWNER,
            "ELASTIC_RESTORE": "1" if restore else "0",
        }
        if restore:
            env["ELASTIC_RESTORE_CHECKPOINT"] = restore
        self.client.handoff(
            {
                "kernel_id": kernel_id,
                "connection": info,
                "key": owner_key(SECRET, OWNER).hex(),
                "env": env,
                "args": ["--IPKernelApp.extra_extensions=kernelmgr.checkpoint.agent"],
            }
        )
        kernel = BlockingKernelClient()
        kernel.load_connection_info({**info, "ip": "127.0.0.1"})
        kernel.start_channels()
        wait_for_kernel_info(kernel, still_running(self.process), 120)
        return kernel

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def run(kernel: BlockingKernelClient, code: str) -> str:
    out: list[str] = []

    def output(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    reply = kernel.execute_interactive(code, timeout=60, output_hook=output)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[LocalWarmPod]]:
    made: list[LocalWarmPod] = []
    yield made
    for pod in made:
        pod.stop()


def raw(pod: LocalWarmPod, method: str, path: str, token: str | None, body: bytes = b"") -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", pod.port, timeout=10)
    headers = {"Content-Length": str(len(body))}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data) if data else None


def test_a_warm_pod_answers_its_token_only_and_keeps_to_its_kernel_directory(
    tmp_path: Path, pods: list[LocalWarmPod]
) -> None:
    pod = LocalWarmPod(tmp_path, "pod")
    pods.append(pod)
    for token in (None, "wrong"):
        status, body = raw(pod, "GET", "/status", token)
        assert status == 401 and "token" in body["message"]
        status, body = raw(pod, "PUT", "/checkpoint/k1/current", token, b"x")
        assert status == 401
    for bad in (
        "/checkpoint/k1/../../token",
        "/checkpoint/k1/.hidden",
        "/checkpoint/../x",
        "/checkpoint/k1/a/b/c",
    ):
        status, body = raw(pod, "PUT", bad, pod.token, b"x")
        assert status == 400, (bad, status, body)
    assert not (pod.root / "x").exists() and (pod.root / "token").read_text() == pod.token
    # Before the hand-off nothing can be read out of the pod; after it, only its kernel's files.
    assert raw(pod, "GET", "/checkpoint/k1/current", pod.token)[0] == 409
    assert raw(pod, "PUT", "/checkpoint/k1/current", pod.token, b"ckpt")[0] == 200
    refused = raw(pod, "PUT", "/checkpoint/k2/current", pod.token, b"ckpt")
    assert refused[0] == 409  # the pod serves the one kernel whose checkpoint it was given
    with pytest.raises(WarmPodError, match="kernel k1's"):
        pod.handoff("k2")
    bad_env = {"kernel_id": "k1", "connection": {}, "key": "00", "env": {"PATH": "/evil"}, "args": []}
    status, body = raw(pod, "POST", "/handoff", pod.token, json.dumps(bad_env).encode())
    assert status == 409 and "ELASTIC_*" in body["message"]
    kernel = pod.handoff("k1")
    try:
        seen = run(
            kernel,
            "import os, sys; print(sorted(k for k in os.environ if 'WARM' in k), 'colorsys' in sys.modules)",
        )
        assert seen.strip() == "[] True"
        assert raw(pod, "GET", "/status", pod.token)[1]["state"] == "kernel"
        assert raw(pod, "GET", "/checkpoint/k2/current", pod.token)[0] == 409
        with pytest.raises(WarmPodError, match="409"):
            pod.handoff("k1")  # once
    finally:
        kernel.stop_channels()


def test_a_checkpoint_goes_from_one_warm_pod_through_the_store_into_another(
    tmp_path: Path, pods: list[LocalWarmPod]
) -> None:
    checkpoints = CheckpointStore(tmp_path / "store", SECRET)
    store = checkpoints.kernel_dir(OWNER, "k1")
    key = owner_key(SECRET, OWNER)
    first = LocalWarmPod(tmp_path, "first")
    pods.append(first)
    kernel = first.handoff("k1")
    try:
        run(kernel, "x = {'n': 41}; y = list(range(5))")
        run(kernel, CHECKPOINT_CODE)
    finally:
        kernel.stop_channels()
    committed = first.client.pull_checkpoint("k1", checkpoints, OWNER)
    assert committed is not None and read_current(store) == committed
    manifest = load_verified_manifest(store, key, OWNER, "k1")  # signed with the owner's key, whole
    assert manifest is not None and {"x", "y"} <= {v.name for v in manifest.variables}
    assert first.client.pull_checkpoint("k1", checkpoints, OWNER) == committed  # a second pull moves nothing

    # A pod that is gone mid-hibernation: the pull fails, the store keeps its commit, nothing torn.
    first.stop()
    with pytest.raises(WarmPodError, match="did not answer"):
        first.client.pull_checkpoint("k1", checkpoints, OWNER)
    assert read_current(store) == committed
    assert [p.name for p in store.iterdir() if p.name.startswith(".partial")] == []

    second = LocalWarmPod(tmp_path, "second")
    pods.append(second)
    assert second.client.push_checkpoint("k1", checkpoints, OWNER, committed) > 0
    kernel = second.handoff("k1", restore=committed)
    try:
        assert run(kernel, "print(x['n'] + 1, y[-1])").strip() == "42 4"
    finally:
        kernel.stop_channels()
    assert second.client.pull_restore_report("k1", checkpoints, OWNER)
    report = json.loads((store / "restore-report.json").read_text())
    assert report["checkpoint"] == committed and report["refused"] is None
