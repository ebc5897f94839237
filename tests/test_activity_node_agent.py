"""The node activity agent (``jupyter elastic node-agent``) and its server-side reader.

The agent runs as a real subprocess over real HTTP, against a fake ``/proc`` tree in
``tmp_path`` (``--proc-root``) and the NVML TEST DOUBLE (``FileNvmlDouble``, scripted through
``$ELASTIC_NVML_DOUBLE_FILE``) listing processes on those PIDs. The fake tree holds the cgroup
files the kubelet writes with both drivers (cgroupfs, systemd), cgroup v1 (a line per
controller) and v2 (one ``0::`` line), every QoS class, a relative path as seen from a private
cgroup namespace, and ``environ`` files (NUL-separated) carrying ``ELASTIC_KERNEL_ID`` the way
kernel pods get it from ``CheckpointStore.agent_env``.

Processes in no pod are *reported*, summed under ``unattributed`` (``pids``); PIDs NVML lists
that ``/proc`` does not show are under ``unattributed.missing_pids``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kernelmgr.activity.nvml_double import NvmlDouble
from kernelmgr.checkpoint_store import CheckpointStore
from kernelmgr.core.inventory import GpuDevice
from kernelmgr.kube.node_agents import (
    AGENT_COMPONENT_LABEL,
    AGENT_INSTANCE_LABEL,
    NodeAgentClient,
    agent_labels,
    agent_urls,
)
from kernelmgr.nodeagent.cgroups import pod_uid_from_cgroup, read_pod_uid
from kernelmgr.nodeagent.environ import environ_value, read_kernel_id
from kernelmgr.nodeagent.sampler import NodeSampler

pytestmark = pytest.mark.pure

NVML_DOUBLE = "kernelmgr.activity.nvml_double.FileNvmlDouble"
REPO = Path(__file__).resolve().parent.parent

UID_A = "4d3c8a2e-1b6f-4c1e-9a4d-2f7e8b9c0d1e"  # systemd, burstable, cgroup v2
UID_B = "0f1e2d3c-4b5a-6978-8a9b-acbdcedf0011"  # cgroupfs, besteffort, cgroup v1
UID_C = "abcdef01-2345-4678-9abc-def012345678"  # systemd, guaranteed, cgroup v1
UID_D = "11111111-2222-4333-8444-555555555555"  # cgroupfs, burstable, v2 in a private cgroup namespace
CID = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def systemd(uid: str, qos: str | None, runtime: str = "cri-containerd") -> str:
    """The path the kubelet's systemd driver writes: dashes in the UID become underscores."""
    if qos is None:
        return f"/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/{runtime}-{CID}.scope"
    return (
        f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid.replace('-', '_')}.slice/"
        f"{runtime}-{CID}.scope"
    )


def v1(path: str) -> str:
    """A cgroup v1 file: one line per controller, plus the v2 line of a hybrid host."""
    controllers = ["cpuset", "cpu,cpuacct", "memory", "devices", "pids", "name=systemd"]
    lines = [f"{12 - n}:{c}:{path}" for n, c in enumerate(controllers)]
    return "\n".join([*lines, "0::/"]) + "\n"


def v2(path: str) -> str:
    return f"0::{path}\n"


def environ(**variables: str) -> bytes:
    """An environ file as the kernel writes it: NUL-separated, NUL-terminated."""
    base = {"PATH": "/usr/bin", "HOME": "/home/jovyan", **variables}
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in base.items())


@dataclass
class FakeProc:
    root: Path

    def add(self, pid: int, cgroup: str, env: bytes | None = None) -> None:
        directory = self.root / str(pid)
        directory.mkdir(parents=True)
        (directory / "cgroup").write_text(cgroup)
        (directory / "stat").write_text(f"{pid} (python) S 1 {pid} {pid} 0 -1\n")
        if env is not None:
            (directory / "environ").write_bytes(env)


def node_tree(root: Path) -> FakeProc:
    """One node: kernels a (two processes), b, c, d in pods; a host daemon; nothing for PID 999."""
    proc = FakeProc(root)
    proc.add(101, v2(systemd(UID_A, "burstable")), environ(ELASTIC_KERNEL_ID="kernel-a"))
    proc.add(102, v2(systemd(UID_A, "burstable")), environ(ELASTIC_KERNEL_ID="kernel-a"))  # a worker
    proc.add(201, v1(f"/kubepods/besteffort/pod{UID_B}/{CID}"), environ())  # no kernel id known
    proc.add(301, v1(systemd(UID_C, None, "docker")), environ(ELASTIC_KERNEL_ID="kernel-c"))
    proc.add(401, v2(f"/../../burstable/pod{UID_D}/{CID}"))  # environ unreadable (no file)
    proc.add(501, v2("/system.slice/nvidia-persistenced.service"), environ())
    return proc


NODE_PROCESSES = [
    {"pid": 101, "device": "GPU-n1-0", "memory_mib": 1000, "sm_percent": 20},
    {"pid": 102, "device": "GPU-n1-1", "memory_mib": 500, "sm_percent": 70},
    {"pid": 201, "device": "GPU-n1-0", "memory_mib": 300, "sm_percent": 0},
    {"pid": 301, "device": "GPU-n1-1", "memory_mib": 2048, "sm_percent": 5},
    {"pid": 401, "device": "GPU-n1-0", "memory_mib": 64, "sm_percent": 0},
    {"pid": 501, "device": "GPU-n1-0", "memory_mib": 16, "sm_percent": 0},
    {"pid": 999, "device": "GPU-n1-1", "memory_mib": 8, "sm_percent": 0},
]


def write_script(
    path: Path, devices: list[str], processes: list[dict[str, Any]], unavailable: str = ""
) -> None:
    script = {
        "devices": [{"uuid": uuid, "name": "Test H100", "memory_mib": 81920} for uuid in devices],
        "processes": processes,
        "unavailable": unavailable,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(script))
    tmp.replace(path)


# ---- the agent as a subprocess

#: The token the agents under test require (as the chart's shared Secret holds it).
TOKEN = "node-agent-test-token"


@dataclass
class Agent:
    process: subprocess.Popen[str]
    url: str
    log: Path

    def get(self, path: str, token: str | None = TOKEN) -> tuple[int, str, str]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        request = urllib.request.Request(f"{self.url}{path}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.headers.get("Content-Type", ""), response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("Content-Type", ""), err.read().decode()

    def activity(self) -> dict[str, Any]:
        status, _, body = self.get("/activity")
        assert status == 200, body
        doc: dict[str, Any] = json.loads(body)
        return doc

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def agent_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kernelmgr.cli", "node-agent", *args]


def agent_env(script: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if script is not None:
        env["ELASTIC_NVML_DOUBLE_FILE"] = str(script)
    return env


@pytest.mark.server  # a real node-agent process, waited for (tests/support/costs.py)
def start_agent(
    tmp: Path, proc_root: Path, script: Path, node: str, interval: float = 0.2, token: str = TOKEN
) -> Agent:
    """Start ``node-agent`` on a free port (``--port 0``) and read the URL from its first line."""
    log = tmp / f"agent-{node}.log"
    token_file = tmp / "agent-token"
    token_file.write_text(token + "\n")
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            agent_command(
                "--ip", "127.0.0.1", "--port", "0", "--proc-root", str(proc_root),
                "--token-file", str(token_file), "--interval", str(interval), "--node-name", node,
                "--nvml-class", NVML_DOUBLE,
            ),
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=agent_env(script),
        )  # fmt: skip
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    line = ""
    deadline = time.monotonic() + 60
    while not line and time.monotonic() < deadline and process.poll() is None:
        if selector.select(timeout=1):
            line = process.stdout.readline()
    selector.close()
    match = re.search(r"listening on (http://\S+)", line)
    if not match:
        process.kill()
        raise AssertionError(f"agent did not start: {line!r} {log.read_text()}")
    return Agent(process, match.group(1), log)


@pytest.fixture
def node1(tmp_path: Path) -> Iterator[Agent]:
    node_tree(tmp_path / "proc1")
    script = tmp_path / "gpu1.json"
    write_script(script, ["GPU-n1-0", "GPU-n1-1"], NODE_PROCESSES)
    agent = start_agent(tmp_path, tmp_path / "proc1", script, "node-1")
    yield agent
    agent.stop()


def wait_until(predicate: Any, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# ---- cgroup parsing, every format the kubelet writes


@pytest.mark.parametrize(
    ("cgroup", "uid"),
    [
        (v2(systemd(UID_A, "burstable")), UID_A),
        (v2(systemd(UID_A, "besteffort", "crio")), UID_A),
        (v2(systemd(UID_A, None)), UID_A),
        (v1(systemd(UID_C, "burstable", "docker")), UID_C),
        (v1(systemd(UID_C, None)), UID_C),
        (v1(f"/kubepods/burstable/pod{UID_B}/{CID}"), UID_B),
        (v1(f"/kubepods/besteffort/pod{UID_B}/{CID}"), UID_B),
        (v1(f"/kubepods/pod{UID_B}/{CID}"), UID_B),  # Guaranteed: no QoS level
        (v2(f"/kubepods/burstable/pod{UID_B}/{CID}"), UID_B),
        (v2(f"/../../burstable/pod{UID_D}/{CID}"), UID_D),  # private cgroup namespace
        (v2(f"/../kubepods-besteffort-pod{UID_D.replace('-', '_')}.slice/cri-containerd-{CID}.scope"), UID_D),
        (  # kind / a kubelet inside a container
            v2(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
                f"kubelet-kubepods-besteffort-pod{UID_A.replace('-', '_')}.slice/cri-containerd-{CID}.scope"
            ),
            UID_A,
        ),
        (v1(f"/kubepods/burstable/pod{UID_B.upper()}/{CID}"), UID_B),
        (
            v1(f"/kubepods/burstable/pod6e3ec1c5c7d53e0a52e1ba0c4b8d4a36/{CID}"),
            "6e3ec1c5c7d53e0a52e1ba0c4b8d4a36",
        ),
        ("0::/\n", None),
        (v2("/system.slice/containerd.service"), None),
        (v2("/user.slice/user-1000.slice/session-3.scope"), None),
        (v1("/docker/" + CID), None),
        (v2("/kubepods.slice/kubepods-burstable.slice"), None),  # the QoS slice itself, no pod
        (v2("/kubepods/burstable/podnot-a-uid/x"), None),
        ("garbage without colons\n", None),
        ("", None),
    ],
)
def test_pod_uid_from_every_cgroup_format(cgroup: str, uid: str | None) -> None:
    assert pod_uid_from_cgroup(cgroup) == uid


def test_proc_readers_tolerate_gone_and_unreadable_processes(tmp_path: Path) -> None:
    proc = node_tree(tmp_path)
    assert read_pod_uid(101, str(proc.root)) == UID_A
    assert read_pod_uid(999, str(proc.root)) is None  # gone
    assert read_kernel_id(101, str(proc.root)) == "kernel-a"
    assert read_kernel_id(201, str(proc.root)) is None  # not a kernel
    assert read_kernel_id(401, str(proc.root)) is None  # environ unreadable
    proc.add(600, v2(systemd(UID_A, "burstable")), environ(ELASTIC_KERNEL_ID="../../etc/passwd"))
    assert read_kernel_id(600, str(proc.root)) is None  # not a kernel id: ignored


def test_environ_parsing_matches_what_kernel_pods_get() -> None:
    block = environ(ELASTIC_KERNEL_ID="7f9c-kernel", ELASTIC_OWNER="alice")
    assert environ_value(block, "ELASTIC_KERNEL_ID") == "7f9c-kernel"
    assert environ_value(block, "ELASTIC_KERNEL") is None  # a prefix of a name is not the name
    assert environ_value(b"ELASTIC_KERNEL_ID=x", "ELASTIC_KERNEL_ID") == "x"  # no trailing NUL
    assert environ_value(b"", "ELASTIC_KERNEL_ID") is None


def test_kernel_pods_carry_the_variable_the_agent_reads(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", b"s" * 32)
    env = store.agent_env("alice", "kernel-a", key_file=tmp_path / "key", restore=False)
    block = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "environ").write_bytes(block)
    assert read_kernel_id(7, str(tmp_path)) == "kernel-a"


# ---- the sampler in-process (the NVML double scripted directly)


def test_sampler_attributes_processes_to_pods(tmp_path: Path) -> None:
    proc = node_tree(tmp_path / "proc")
    nvml = NvmlDouble([GpuDevice("GPU-0", "Test", 81920, 0), GpuDevice("GPU-mig", "Test MIG", 10240, 1)])
    nvml.set_mig("GPU-mig")
    nvml.set_memory("GPU-0", 101, 1000)
    nvml.add_sample("GPU-0", 101, 35)
    nvml.set_memory("GPU-mig", 301, 4096)
    nvml.set_memory("GPU-0", 501, 16)
    proc.add(302, v1(systemd(UID_C, None, "docker")), environ(ELASTIC_KERNEL_ID="kernel-x"))
    nvml.set_memory("GPU-0", 302, 10)
    sample = NodeSampler(nvml, proc_root=str(proc.root), node="n").sample()
    assert sample.error == ""
    a = sample.pods[UID_A]
    assert (a.kernel_id, a.gpu_utilization, a.gpu_memory_mib, a.devices, a.pids) == (
        "kernel-a", 35.0, 1000, ["GPU-0"], [101]
    )  # fmt: skip
    c = sample.pods[UID_C]
    # Two processes of one pod claim different kernel ids: neither is believed.
    assert c.kernel_id is None and c.kernel_id_conflict == ["kernel-c", "kernel-x"]
    assert c.gpu_memory_mib == 4106 and sorted(c.devices) == ["GPU-0", "GPU-mig"]
    assert sample.unattributed.pids == [501]
    assert [d["mig"] for d in sample.devices] == [False, True]
    # Only MIG: memory, and utilisation "not measured" rather than 0.
    nvml.remove_process("GPU-0", 302)
    assert NodeSampler(nvml, proc_root=str(proc.root)).sample().pods[UID_C].gpu_utilization is None


def test_sampler_reports_nvml_unavailable(tmp_path: Path) -> None:
    nvml = NvmlDouble(unavailable_reason="no NVIDIA driver (test double)")
    sample = NodeSampler(nvml, proc_root=str(tmp_path), node="n").sample()
    assert sample.pods == {} and "no NVIDIA driver" in sample.error
    assert sample.to_dict()["nvml"].startswith("NVML unavailable")


# ---- the real agent over HTTP


def test_activity_maps_gpu_processes_to_pods_and_kernels(node1: Agent) -> None:
    doc = node1.activity()
    assert doc["node"] == "node-1" and doc["nvml"] == "ok"
    assert isinstance(doc["sampled_at"], float)
    pods = doc["pods"]
    assert set(pods) == {UID_A, UID_B, UID_C, UID_D}
    assert pods[UID_A] == {
        "pod_uid": UID_A,
        "kernel_id": "kernel-a",
        "gpu_utilization": 70.0,  # the busier of its two processes
        "gpu_memory_mib": 1500,
        "devices": ["GPU-n1-0", "GPU-n1-1"],
        "pids": [101, 102],
    }
    assert (pods[UID_B]["kernel_id"], pods[UID_B]["gpu_memory_mib"], pods[UID_B]["pids"]) == (
        None,
        300,
        [201],
    )
    assert (pods[UID_C]["kernel_id"], pods[UID_C]["gpu_utilization"]) == ("kernel-c", 5.0)
    assert (pods[UID_D]["kernel_id"], pods[UID_D]["pids"]) == (None, [401])
    assert doc["unattributed"] == {
        "pids": [501],
        "missing_pids": [999],
        "gpu_memory_mib": 24,
        "gpu_utilization": 0.0,
        "devices": ["GPU-n1-0", "GPU-n1-1"],
    }


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(metric, sorted labels): value}, parsed by prometheus_client's parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_and_health(node1: Agent) -> None:
    status, content_type, text = node1.get("/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    values = samples(text)
    a = (("kernel_id", "kernel-a"), ("node", "node-1"), ("pod_uid", UID_A))
    b = (("kernel_id", ""), ("node", "node-1"), ("pod_uid", UID_B))
    node = (("node", "node-1"),)
    assert values[("elastic_node_pod_gpu_utilization_percent", a)] == 70.0
    assert values[("elastic_node_pod_gpu_memory_bytes", a)] == 1500 * 1024 * 1024
    assert values[("elastic_node_pod_gpu_processes", a)] == 2
    assert values[("elastic_node_pod_gpu_processes", b)] == 1
    assert values[("elastic_node_pod_gpu_utilization_percent", b)] == 0
    assert values[("elastic_node_unattributed_gpu_processes", node)] == 2
    assert values[("elastic_node_unattributed_gpu_memory_bytes", node)] == 24 * 1024 * 1024
    assert values[("elastic_node_nvml_up", node)] == 1
    assert values[("elastic_node_gpu_devices", node)] == 2
    pods = {dict(labels)["pod_uid"] for name, labels in values if name == "elastic_node_pod_gpu_processes"}
    assert pods == {UID_A, UID_B, UID_C, UID_D}
    status, _, body = node1.get("/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_activity_and_metrics_refuse_a_request_without_the_token(node1: Agent) -> None:
    """The agent lists every GPU pod and PID of its node: only the server, holding the token, may read it."""
    for path in ("/activity", "/metrics"):
        status, content_type, body = node1.get(path, token=None)
        assert status == 401 and content_type.startswith("application/json"), body
        assert "token" in json.loads(body)["message"]
        status, _, body = node1.get(path, token="not-the-token")
        assert status == 403 and "wrong token" in json.loads(body)["message"]
        assert node1.get(path)[0] == 200
    assert node1.get("/healthz", token=None)[0] == 200  # the kubelet's probe carries no token
    # The server's reader without the token gets the refusal as an error, no data.
    result = asyncio.run(NodeAgentClient(timeout=10).collect([node1.url]))
    assert result.kernels == {} and "HTTP 401" in result.errors[node1.url]


def test_agent_samples_again_on_its_interval(node1: Agent, tmp_path: Path) -> None:
    """kernel-a stops computing and pod B's process exits: the next samples say so."""
    processes = [dict(p, sm_percent=0) if p["pid"] in (101, 102) else p for p in NODE_PROCESSES]
    processes = [p for p in processes if p["pid"] != 201]
    write_script(tmp_path / "gpu1.json", ["GPU-n1-0", "GPU-n1-1"], processes)
    doc = wait_until(
        lambda: (d := node1.activity())["pods"].get(UID_A, {}).get("gpu_utilization") == 0.0 and d,
        "kernel-a to look idle",
    )
    assert UID_B not in doc["pods"]


def test_nvml_unavailable_is_reported_not_fatal(tmp_path: Path) -> None:
    node_tree(tmp_path / "proc")
    script = tmp_path / "gpu.json"
    write_script(script, [], [], unavailable="no NVIDIA driver (test double)")
    agent = start_agent(tmp_path, tmp_path / "proc", script, "node-x")
    try:
        doc = agent.activity()
        assert doc["pods"] == {} and "no NVIDIA driver" in doc["nvml"]
        _, _, text = agent.get("/metrics")
        assert samples(text)[("elastic_node_nvml_up", (("node", "node-x"),))] == 0
        assert agent.get("/healthz")[0] == 200  # a restart would not bring a driver
    finally:
        agent.stop()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--port", "http"], "argument --port: must be a port number (0-65535), got 'http'"),
        (["--port", "70000"], "argument --port: must be a port number (0-65535), got 70000"),
        (["--interval", "0"], "argument --interval: must be > 0 seconds"),
        (["--proc-root", "/no/such/dir"], "--proc-root '/no/such/dir' is not a directory"),
        (["--no-token", "--nvml-class", "no.such"], "--nvml-class 'no.such' cannot be imported"),
        (["--no-token", "--nvml-class", "json.dumps"], "--nvml-class 'json.dumps' is not a class"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        ([], "--token-file is required"),
        (["--token-file", "/no/such/token"], "--token-file '/no/such/token': No such file or directory"),
    ],
)
def test_bad_usage_is_exit_2_and_one_line(args: list[str], fragment: str) -> None:
    result = subprocess.run(agent_command(*args), capture_output=True, text=True, timeout=60, env=agent_env())
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_port_through_jupyter_elastic(tmp_path: Path) -> None:
    """The same through the installed ``jupyter elastic`` command."""
    result = subprocess.run(
        ["jupyter", "elastic", "node-agent", "--port", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=agent_env(),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "jupyter elastic node-agent: error: argument --port: "
        "must be a port number (0-65535), got -1 (see --help)"
    ]


def test_port_in_use_is_exit_1_and_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            agent_command("--ip", "127.0.0.1", "--port", str(port), "--proc-root", str(tmp_path),
                          "--nvml-class", NVML_DOUBLE, "--no-token"),
            capture_output=True, text=True, timeout=60, env=agent_env(tmp_path / "none.json"),
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"jupyter elastic node-agent: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


# ---- the server-side reader against running agents


def dead_url() -> str:
    """A URL nothing listens on (a port bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def node2(tmp_path: Path) -> Iterator[Agent]:
    proc = FakeProc(tmp_path / "proc2")
    uid_e = "22222222-3333-4444-8555-666666666666"
    proc.add(7001, v2(systemd(uid_e, "burstable")), environ(ELASTIC_KERNEL_ID="kernel-e"))
    # kernel-a's new pod (resumed here) while its old pod on node-1 still terminates.
    proc.add(
        7002, v1(f"/kubepods/burstable/pod{UID_D[:-4]}beef/{CID}"), environ(ELASTIC_KERNEL_ID="kernel-a")
    )
    script = tmp_path / "gpu2.json"
    write_script(
        script,
        ["GPU-n2-0"],
        [
            {"pid": 7001, "device": "GPU-n2-0", "memory_mib": 4000, "sm_percent": 90},
            {"pid": 7002, "device": "GPU-n2-0", "memory_mib": 100, "sm_percent": 10},
        ],
    )
    agent = start_agent(tmp_path, tmp_path / "proc2", script, "node-2")
    yield agent
    agent.stop()


def test_reader_merges_agents_and_records_a_dead_one(node1: Agent, node2: Agent) -> None:
    down = dead_url()
    client = NodeAgentClient(timeout=10, token=TOKEN)
    result = asyncio.run(client.collect([node1.url, node2.url, down, node2.url + "/"]))
    assert set(result.errors) == {down}
    assert "cannot reach" in result.errors[down] or "no answer" in result.errors[down]
    assert {v["node"] for v in result.nodes.values()} == {"node-1", "node-2"}
    a = result.kernels["kernel-a"]  # on both nodes, from the processes' environment
    assert a.source == "environ"
    assert (a.gpu_utilization, a.gpu_memory_mib, sorted(a.nodes)) == (70.0, 1600, ["node-1", "node-2"])
    assert sorted(a.pod_uids) == sorted([UID_A, UID_D[:-4] + "beef"])
    assert result.kernels["kernel-e"].gpu_utilization == 90.0
    assert set(result.unmapped) == {UID_B, UID_D}  # GPU pods whose kernel id nobody knows
    assert result.unmapped[UID_B]["node"] == "node-1"

    # An agent that dies between two collections is an error, the other's data stays.
    node1.stop()
    later = asyncio.run(client.collect([node1.url, node2.url]))
    assert set(later.errors) == {node1.url}
    assert set(later.kernels) == {"kernel-a", "kernel-e"}
    assert later.kernels["kernel-a"].nodes == ["node-2"]


def test_reader_trusts_the_pod_watch_over_the_environment(node1: Agent) -> None:
    mapping = {UID_A: "kernel-a", UID_B: "kernel-b", UID_C: "kernel-z"}
    result = asyncio.run(NodeAgentClient(timeout=10, token=TOKEN).collect([node1.url], uid_to_kernel=mapping))
    assert set(result.kernels) == {"kernel-a", "kernel-b", "kernel-z"}
    assert result.kernels["kernel-b"].source == "pod-watch"
    assert set(result.unmapped) == {UID_D}  # not a pod the server knows, whatever it claims
    assert result.conflicts == [f"pod {UID_C} on node-1 is kernel kernel-z, but its processes say kernel-c"]


def test_reader_reports_bad_answers_and_timeouts(tmp_path: Path) -> None:
    """An endpoint that answers something else, and one that accepts but never answers."""
    from tornado import httpserver, web

    class NotAnAgent(web.RequestHandler):
        def get(self) -> None:
            self.finish({"hello": "world"})

    class Silent(web.RequestHandler):
        async def get(self) -> None:
            await asyncio.sleep(30)

    async def scenario() -> dict[str, str]:
        wrong = httpserver.HTTPServer(web.Application([(r"/activity", NotAnAgent)]))
        silent = httpserver.HTTPServer(web.Application([(r"/activity", Silent)]))
        ports = []
        for server in (wrong, silent):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            sock.setblocking(False)
            server.add_socket(sock)
            ports.append(sock.getsockname()[1])
        try:
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            result = await NodeAgentClient(timeout=0.5).collect(urls)
        finally:
            wrong.stop()
            silent.stop()
        assert result.kernels == {}
        return {url.rsplit(":", 1)[1]: message for url, message in result.errors.items()}

    errors = asyncio.run(scenario())
    assert len(errors) == 2
    messages = sorted(errors.values())
    assert any("bad answer" in m and "no 'pods' object" in m for m in messages)
    assert any("no answer" in m for m in messages)


def test_agent_urls_from_pod_objects() -> None:
    """Client models (attributes ``metadata.labels``, ``status.pod_ip``, as the informer caches
    them; stand-ins here, importing the kubernetes client's models costs seconds) and plain dicts."""

    def pod(name: str, ip: str | None, phase: str = "Running", component: str = "node-agent") -> Any:
        return SimpleNamespace(
            metadata=SimpleNamespace(name=name, labels={**agent_labels(), AGENT_COMPONENT_LABEL: component}),
            status=SimpleNamespace(phase=phase, pod_ip=ip),
        )

    pods = [
        pod("a", "10.0.0.2"),
        pod("b", "10.0.0.1"),
        pod("pending", None, "Pending"),
        pod("failed", "10.0.0.9", "Failed"),
        pod("kernel", "10.0.0.7", component="kernel"),
        pod("v6", "fd00::5"),
        {
            "metadata": {"labels": agent_labels()},
            "status": {"phase": "Running", "podIP": "10.0.0.3"},
        },
        # The generic component label alone, or another release's agent: not trusted (never sent the token).
        {
            "metadata": {"labels": {AGENT_COMPONENT_LABEL: "node-agent"}},
            "status": {"phase": "Running", "podIP": "10.0.0.5"},
        },
        {
            "metadata": {"labels": {**agent_labels(), AGENT_INSTANCE_LABEL: "another-release"}},
            "status": {"phase": "Running", "podIP": "10.0.0.6"},
        },
        {"metadata": {}, "status": {"phase": "Running", "podIP": "10.0.0.4"}},
    ]  # fmt: skip
    assert agent_urls(pods) == [
        "http://10.0.0.1:9401",
        "http://10.0.0.2:9401",
        "http://10.0.0.3:9401",
        "http://[fd00::5]:9401",
    ]
    assert agent_urls(pods[:1], port=9999) == ["http://10.0.0.2:9999"]
    assert agent_urls(pods, instance="another-release") == ["http://10.0.0.6:9401"]


def test_the_charts_pod_monitor_scrapes_a_real_agent_with_the_rendered_token(tmp_path: Path) -> None:
    """Prometheus as the chart's PodMonitor (rendered by the real helm) has it scrape each agent pod:
    the port it names is the one the agent listens on, ``/metrics`` answers the rendered token Secret
    (which the DaemonSet mounts as the agent's --token-file) with Prometheus text, nobody else."""
    import base64

    from prometheus_client.parser import text_string_to_metric_families

    from tests.test_helm_chart import only, render

    docs = render({"metrics": {"serviceMonitor": {"enabled": True}}}, tmp_path)
    (endpoint,) = only(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    template = only(docs, "DaemonSet", "jupyter-elastic-kernels-node-agent")["spec"]["template"]["spec"]
    (container,) = template["containers"]
    (port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
    args = dict(a[2:].split("=", 1) for a in container["args"])
    assert args["port"] == str(port["containerPort"])  # the agent listens where the monitor scrapes
    ref = endpoint["bearerTokenSecret"]
    mounted = [v for v in template["volumes"] if v.get("secret", {}).get("secretName") == ref["name"]]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == mounted[0]["name"]]
    assert args["token-file"] == f"{mount['mountPath']}/{ref['key']}"  # the agent requires that token
    token = base64.b64decode(only(docs, "Secret", ref["name"])["data"][ref["key"]]).decode()

    node_tree(tmp_path / "proc")
    script = tmp_path / "gpu.json"
    write_script(script, ["GPU-m-0"], NODE_PROCESSES)
    agent = start_agent(tmp_path, tmp_path / "proc", script, "node-m", token=token)
    try:
        status, content_type, body = agent.get(endpoint["path"], token=token)
        assert status == 200 and content_type.startswith("text/plain"), (status, body[:300])
        families = {f.name for f in text_string_to_metric_families(body)}
        assert {"elastic_node_pod_gpu_memory_bytes", "elastic_node_nvml_up"} <= families, sorted(families)
        for wrong in (None, "not-the-token"):
            assert agent.get(endpoint["path"], token=wrong)[0] in (401, 403)
    finally:
        agent.stop()
