"""Every way a local kernel's start can fail, through a real server and real processes (issue 34).

Each kernelspec here is a GPU size (``small``) run by the elastic local provisioner, so every test
also checks that a failed start gives its slice back and leaves no process behind:

* a bind error: another process takes the kernel's shell port between the choice and the bind
  (``port_thief.py``, on the kernel's first launch only); the kernel must come up on new ports;
* a crash at import: a real ``ModuleNotFoundError``; the start answers 500 naming it;
* a timeout: a process that never answers; the start answers 504 with its last stderr line;
* a delete during the start; and a server stop during the start (no orphan process);
* a bind error at a resume: a port of a hibernated kernel taken while it slept; the resume must
  come back on new ports with the kernel's variables restored; one that loses its port at every
  relaunch gives up after 3 (503), still hibernated with its checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kernelmgr.server.kernelmanager import ElasticMappingKernelManager
from tests.conftest import elastic_config
from tests.support.server import Reply, RunningServer, process_alive, start_server, wait_for

#: Run as a kernel: on the kernel's first launch, a separate process binds one port of the
#: connection file (as another program grabbing a free port would), then ipykernel starts on it.
#: The shell port is bound first: ipykernel exits. Any later one: it hangs after the traceback
#: (the sockets it had bound keep ZeroMQ's context from terminating).
PORT_THIEF = """
import json, os, subprocess, sys
state, connection_file = sys.argv[1], sys.argv[-1]
marker = os.path.join(state, os.path.basename(connection_file))
if not os.path.exists(marker):
    open(marker, "w").close()
    port = json.load(open(connection_file))[sys.argv[2]]
    holder = (
        "import socket, sys, time\\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\\n"
        "print('bound', flush=True); time.sleep(300)\\n"
    )
    if sys.argv[3] == "zeromq":  # as another kernel's IOPub pipe (a PULL socket on a random port)
        holder = (
            "import sys, time, zmq\\n"
            "s = zmq.Context().socket(zmq.PULL); s.bind(f'tcp://127.0.0.1:{sys.argv[1]}')\\n"
            "print('bound', flush=True); time.sleep(300)\\n"
        )
    thief = subprocess.Popen([sys.executable, "-c", holder, str(port)], stdout=subprocess.PIPE,
                             start_new_session=True)
    open(marker + ".thief", "w").write(str(thief.pid))
    assert thief.stdout.readline().strip() == b"bound"
os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f", connection_file])
"""

#: Run as a kernel (``-m ipykernel_launcher ...`` after the two arguments, so the agent is loaded):
#: on every launch but the first, until ``<connection file>.let-it-bind`` exists in the state
#: folder, a separate process takes the port before ipykernel starts. Counts its launches.
THIEF_AT_EVERY_RESUME = """
import json, os, subprocess, sys
state, port_name, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
connection_file = rest[rest.index("-f") + 1]
marker = os.path.join(state, os.path.basename(connection_file))
with open(marker + ".launches", "a") as launches:
    launches.write("x")
if os.path.getsize(marker + ".launches") > 1 and not os.path.exists(marker + ".let-it-bind"):
    port = json.load(open(connection_file))[port_name]
    holder = (
        "import socket, sys, time\\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\\n"
        "print('bound', flush=True); time.sleep(300)\\n"
    )
    thief = subprocess.Popen([sys.executable, "-c", holder, str(port)], stdout=subprocess.PIPE,
                             start_new_session=True)
    open(f"{marker}.{thief.pid}.thief", "w").write(str(thief.pid))
    assert thief.stdout.readline().strip() == b"bound"
os.execv(sys.executable, [sys.executable, *rest])
"""

#: Run as a kernel: writes its pid, says what it is doing on stderr, and never answers.
STUCK = """
import os, sys, time
state, connection_file = sys.argv[1], sys.argv[-1]
open(os.path.join(state, os.path.basename(connection_file) + ".pid"), "w").write(str(os.getpid()))
print("loading the model weights from /nfs/slow ...", file=sys.stderr, flush=True)
time.sleep(600)
"""


def kernelspec(home: Path, name: str, argv: list[str]) -> None:
    spec = home / "data" / "kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": argv,
                "display_name": name,
                "language": "python",
                "metadata": {
                    "elastic": {"profile": "small"},
                    "kernel_provisioner": {"provisioner_name": "elastic-local-provisioner"},
                },
            }
        )
    )


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state")


def make_home(tmp_path_factory: pytest.TempPathFactory, state: Path) -> Path:
    home = tmp_path_factory.mktemp("server")
    (home / "thief.py").write_text(PORT_THIEF)
    (home / "stuck.py").write_text(STUCK)
    (home / "thief_at_resume.py").write_text(THIEF_AT_EVERY_RESUME)
    py = sys.executable
    for port in ("shell_port", "iopub_port"):
        for holder in ("socket", "zeromq"):
            argv = [py, str(home / "thief.py"), str(state), port, holder, "{connection_file}"]
            kernelspec(home, f"thief-{holder}-{port}", argv)
    kernelspec(home, "broken", [py, "-c", "import missing_gpu_library_xyz", "-f", "{connection_file}"])
    kernelspec(home, "stuck", [py, str(home / "stuck.py"), str(state), "{connection_file}"])
    kernelspec(home, "plain", [py, "-m", "ipykernel_launcher", "-f", "{connection_file}"])
    thief_at_resume = [py, str(home / "thief_at_resume.py"), str(state), "shell_port"]
    kernelspec(
        home, "thief-at-resume", [*thief_at_resume, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    )
    return home


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, state: Path) -> Iterator[RunningServer]:
    home = make_home(tmp_path_factory, state)
    running = start_server(home, elastic_config(home / "checkpoints", start_timeout=8))
    yield running
    running.stop()
    for thief in state.glob("*.thief"):  # the port holders of the bind test
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(thief.read_text()), signal.SIGKILL)


def slices(server: RunningServer) -> list[dict[str, Any]]:
    return [s for d in server.get("/api/elastic/gpus")["devices"] for s in d["slices"]]


def stuck_pid(state: Path, kernel_id: str) -> int:
    path = state / f"kernel-{kernel_id}.json.pid"
    return int(wait_for(lambda: path.exists() and path.read_text(), what="the stuck kernel's pid"))


@pytest.fixture(autouse=True)
def nothing_left(server: RunningServer) -> Iterator[None]:
    yield
    server.shutdown_all_kernels()
    wait_for(lambda: not slices(server), what="all slices free")


@pytest.mark.parametrize("holder", ["socket", "zeromq"])
@pytest.mark.parametrize("port", ["shell_port", "iopub_port"])
def test_a_port_taken_before_the_bind_is_retried_on_new_ports(
    server: RunningServer, state: Path, port: str, holder: str
) -> None:
    """The port's holder is a plain listening socket, or a ZeroMQ socket of another kernel (its
    IOPub pipe, bound to a random port): the server's probe then connects to a socket that
    refuses the handshake, where a blocking send would have stalled the whole server."""
    reply = server.request("POST", "/api/kernels", {"name": f"thief-{holder}-{port}"})
    assert reply.status == 201, reply
    kernel_id = reply.body["id"]
    assert server.execute(kernel_id, "print(6 * 7)", timeout=30).strip() == "42"
    assert (state / f"kernel-{kernel_id}.json.thief").exists(), "the port was taken before the bind"
    assert "could not bind its port" in server.log()
    assert [s["kernel_id"] for s in slices(server)] == [kernel_id]


@pytest.mark.parametrize("port", ["shell_port", "iopub_port"])
def test_a_port_taken_while_the_kernel_slept_is_retried_at_the_resume(
    server: RunningServer, port: str
) -> None:
    """A resume relaunches on the ports the kernel had: another process may hold one by then.

    The shell port's loss makes ipykernel exit, the IOPub port's makes it hang after the
    traceback; either way the resume must relaunch on new ports, still restoring the checkpoint.
    """
    kernel_id = server.start_kernel("plain")
    server.execute(kernel_id, "weights = list(range(5)); note = 'kept'")
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply
    assert slices(server) == []
    connection = json.loads((server.home / "runtime" / f"kernel-{kernel_id}.json").read_text())
    with socket.socket() as holder:  # another program, taking the port while the kernel sleeps
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old connections' TIME_WAIT
        holder.bind(("127.0.0.1", connection[port]))
        holder.listen()
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/resume")
        assert reply.status == 200, reply
        assert server.execute(kernel_id, "print(sum(weights), note)", timeout=30).strip() == "10 kept"
    assert f"Kernel {kernel_id} could not bind its port at its resume" in server.log()
    assert [s["kernel_id"] for s in slices(server)] == [kernel_id]
    assert server.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "running"


def test_a_resume_that_keeps_losing_its_port_gives_up_after_three_relaunches(
    server: RunningServer, state: Path
) -> None:
    """Bounded: the resume and 3 relaunches on new ports, then 503; the kernel stays hibernated
    with its checkpoint, holding no slice, and resumes with its variables once ports are free."""
    kernel_id = server.start_kernel("thief-at-resume")
    server.execute(kernel_id, "kept = 6 * 7")
    assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/resume")
    assert reply.status == 503, reply
    assert "could not bind its ports" in reply.body["message"]
    assert "Address already in use" in reply.body["message"]
    launches = state / f"kernel-{kernel_id}.json.launches"
    assert launches.read_text() == "x" * 5  # the start, the resume, 3 relaunches
    model = server.get(f"/api/elastic/kernels/{kernel_id}")
    assert model["state"] == "hibernated" and model["slice"] is None, model
    assert slices(server) == []
    (state / f"kernel-{kernel_id}.json.let-it-bind").touch()
    assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/resume").status == 200
    assert server.execute(kernel_id, "print(kept)", timeout=30).strip() == "42"


def test_a_crash_at_import_answers_500_naming_it_and_frees_the_slice(server: RunningServer) -> None:
    reply = server.request("POST", "/api/kernels", {"name": "broken"})
    assert reply.status == 500, reply
    message = reply.body["message"]
    assert "exited (status 1) before it answered" in message
    assert "No module named 'missing_gpu_library_xyz'" in message
    assert slices(server) == []
    assert server.get("/api/kernels") == []


def test_a_kernel_that_never_answers_is_stopped_at_the_timeout(server: RunningServer, state: Path) -> None:
    before = set(state.glob("*.json.pid"))
    reply = server.request("POST", "/api/kernels", {"name": "stuck"})
    assert reply.status == 504, reply
    message = reply.body["message"]
    assert "did not answer within 8s (ElasticKernels.start_timeout)" in message
    assert "loading the model weights from /nfs/slow" in message
    (pid_file,) = set(state.glob("*.json.pid")) - before
    assert not process_alive(int(pid_file.read_text())), "the stuck kernel's process was left running"
    assert slices(server) == []
    assert server.get("/api/kernels") == []


def start_in_background(server: RunningServer, name: str) -> tuple[threading.Thread, list[Reply | OSError]]:
    """``POST /api/kernels`` in a thread; its answer (or the connection's error) lands in the list."""
    replies: list[Reply | OSError] = []

    def post() -> None:
        try:
            replies.append(server.request("POST", "/api/kernels", {"name": name}))
        except OSError as exc:  # the server stopped before it answered
            replies.append(exc)

    thread = threading.Thread(target=post)
    thread.start()
    return thread, replies


def test_a_delete_during_the_start_stops_it(server: RunningServer, state: Path) -> None:
    thread, replies = start_in_background(server, "stuck")
    kernel_id = wait_for(lambda: [k["id"] for k in server.get("/api/kernels")], what="the starting kernel")[0]
    pid = stuck_pid(state, kernel_id)
    assert server.request("DELETE", f"/api/kernels/{kernel_id}").status == 204
    thread.join(timeout=30)
    assert replies and isinstance(replies[0], Reply) and replies[0].status == 409, replies
    assert "was shut down while it was starting" in replies[0].body["message"]
    assert not process_alive(pid)
    assert slices(server) == []


def test_a_server_stop_during_a_start_leaves_no_process(
    tmp_path_factory: pytest.TempPathFactory, state: Path
) -> None:
    home = make_home(tmp_path_factory, state)
    running = start_server(home, elastic_config(home / "checkpoints", start_timeout=60))
    pid = 0
    try:
        thread, _ = start_in_background(running, "stuck")
        kernel_id = wait_for(
            lambda: [k["id"] for k in running.get("/api/kernels")], what="the starting kernel"
        )[0]
        pid = stuck_pid(state, kernel_id)
        running.process.send_signal(signal.SIGTERM)
        running.process.wait(timeout=60)
        thread.join(timeout=30)
        assert not process_alive(pid), "the kernel that never came up outlived the server"
    finally:
        running.stop()
        if pid and process_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_kernel_managers_zeromq_context_is_not_capped_at_1023_sockets() -> None:
    """A hundred kernels with a notebook each need more sockets than libzmq's default per context."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < 4096:
        pytest.skip(f"this process may open only {soft} files: the limit stays near libzmq's default")
    mkm = ElasticMappingKernelManager()
    try:
        assert mkm.context.get(zmq.MAX_SOCKETS) > 1023
    finally:
        mkm.context.destroy()
