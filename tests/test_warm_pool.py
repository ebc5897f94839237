"""Warm kernels (issue 13) against a real server, real ipykernel kernels and real websockets.

A resume (and, with ``starts``, a new kernel) that takes a warm process must keep every promise
of the cold path: the variables over several cycles, the restore report, the cell numbers, and
the environment, working directory and ``sys.path`` of a fresh kernel with its new slice's
``CUDA_VISIBLE_DEVICES``. Warm processes are never kernels nor slices, the pool refills after
use, a server stop leaves none behind, and a preload that touches the GPU at import (a test
double: tests/support/doubles/gpu_at_import/torch) makes kernels start cold.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import elastic_config
from tests.support.gate import Gate, slow_to_load_cell
from tests.support.server import START_SECONDS, RunningServer, launch, process_alive, start_server, wait_for

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parent.parent
DOUBLE = REPO / "tests" / "support" / "doubles" / "gpu_at_import"
PRELOAD = "tests.support.warm_preload"

#: What a kernel reports about itself; binds only underscore names and deletes them.
PROBE = """
import json as _j, os as _o, sys as _s
print(_j.dumps({
    "pid": _o.getpid(), "cwd": _o.getcwd(), "path": _s.path, "env": dict(_o.environ),
    "argv0": _o.path.basename(_s.argv[0]), "preloaded": "tests.support.warm_preload" in _s.modules,
    "names": sorted(n for n in get_ipython().user_ns if not n.startswith("_")
                    and n not in ("In", "Out", "get_ipython", "exit", "quit", "open")),
    "history": len(get_ipython().user_ns["In"]),
}))
del _j, _o, _s
"""
#: Variables that differ between a first start and a resume on the cold path too.
RESUME_ONLY = {"ELASTIC_RESTORE", "ELASTIC_RESTORE_CHECKPOINT", "ELASTIC_RESTORE_MAPPED"}


def warm_config(checkpoints: Path, **pool: Any) -> dict[str, Any]:
    settings = {"size": 1, "preload": [PRELOAD], "memory_mib": 2048, "starts": False, **pool}
    return elastic_config(checkpoints, warm_pool={"python3": settings})


def parent_of(pid: str) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])


def warm_pids(server: RunningServer) -> set[int]:
    """Live processes of ``server`` running the warm worker (or kernels that were one)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"kernelmgr.warm.worker" in cmdline
            and parent_of(entry.name) == server.process.pid
            and process_alive(int(entry.name))
        ):
            found.add(int(entry.name))
    return found


def metric(server: RunningServer, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in server.text("/metrics").splitlines():
        match = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if match and match.group(1) == name:
            have = ",".join(sorted(match.group(2).split(",")))
            if have == wanted:
                return float(match.group(3))
    return 0.0


def ready(server: RunningServer) -> float:
    return metric(server, "elastic_warm_pool_processes", kernel="python3", state="ready")


def probe(chan: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    result = chan.execute(PROBE, timeout=120)
    assert result.error == "", result.error
    return json.loads(result.stdout.strip().splitlines()[-1]), result.reply


def hibernate(server: RunningServer, kernel_id: str) -> None:
    reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
    assert reply.status == 200, reply


def slice_uuids(server: RunningServer, kernel_id: str) -> str:
    model = server.get(f"/api/elastic/kernels/{kernel_id}")
    return ",".join(d["uuid"] for d in model["slice"]["devices"])


def plain_kernel_path(cwd: Path) -> list[str]:
    """``sys.path`` of a plain ipykernel (no server, no pool) started in ``cwd``."""
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(cwd), env=env)
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    try:
        kc.execute_interactive("import json, sys; print(json.dumps(sys.path))", timeout=60, output_hook=hook)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return list(json.loads("".join(out)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("warm")
    running = start_server(home, warm_config(home / "checkpoints"), env_extra={"PYTHONPATH": str(REPO)})
    try:
        wait_for(lambda: ready(running) == 1, timeout=60, what="the warm pool to fill")
        yield running
    finally:
        running.stop()


def test_resume_through_the_pool_keeps_every_promise_of_the_cold_path(server: RunningServer) -> None:
    kernel_id = server.start_kernel("python3-gpu-small")
    before = warm_pids(server)
    with server.channel(kernel_id) as chan:
        cold, reply = probe(chan)  # starts are cold here ("starts": false)
        assert cold["pid"] not in before and not cold["preloaded"]
        assert reply["content"]["execution_count"] == 1
        assert chan.execute("counter = 10").error == ""
        count = 2
        seen_pids = {cold["pid"]}
        for cycle in range(3):
            wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to refill")
            pool = warm_pids(server) - seen_pids
            hibernate(server, kernel_id)
            result = chan.execute("print(counter); counter += 1", timeout=120)
            count += 1
            assert result.error == ""
            assert result.stdout.strip() == str(10 + cycle)
            assert "Kernel resumed: restored 1 variable" in "\n".join(result.displays), result.displays
            assert result.reply["content"]["execution_count"] == count
            warm, reply = probe(chan)
            count += 1
            assert reply["content"]["execution_count"] == count
            # The resumed kernel is the process the pool had ready, with the module imported ahead...
            assert warm["pid"] in pool, (warm["pid"], pool)
            assert warm["preloaded"]
            seen_pids.add(warm["pid"])
            # ...and is otherwise a fresh kernel: no preload leftovers, only the user's variable.
            assert warm["names"] == ["counter"]
            # In holds the cells since the resume, as on the cold path: "", the wake-up cell, the probe.
            assert warm["history"] == 3
            assert warm["cwd"] == cold["cwd"] and warm["path"] == cold["path"]
            assert warm["argv0"] == cold["argv0"] == "ipykernel_launcher.py"
            names = cold["env"].keys() | warm["env"].keys()
            differ = {k for k in names if cold["env"].get(k) != warm["env"].get(k)}
            assert differ <= RESUME_ONLY, {k: (cold["env"].get(k), warm["env"].get(k)) for k in differ}
            assert warm["env"]["CUDA_VISIBLE_DEVICES"] == slice_uuids(server, kernel_id)
    assert metric(server, "elastic_warm_pool_hits_total", kernel="python3", use="resume") >= 3
    assert metric(server, "elastic_resume_path_duration_seconds_count", size="small", path="warm") >= 3
    server.shutdown_kernel(kernel_id)


def test_a_warm_resume_is_not_judged_by_an_earlier_cold_process_s_errors(server: RunningServer) -> None:
    """The cold process's stderr file says a port was taken: a warm process writes its errors
    elsewhere, so the file must go at the warm launch, or a slow warm resume would be read as a
    bind failure and relaunched (issue 34)."""
    kernel_id = server.start_kernel("python3-gpu-small")
    stderr_file = server.home / "runtime" / f"kernel-{kernel_id}.stderr"
    with server.channel(kernel_id) as chan:
        assert chan.execute("kept = 5").error == ""
        assert stderr_file.exists()  # the cold start's
        wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to refill")
        pool = warm_pids(server)
        hibernate(server, kernel_id)
        stderr_file.write_text("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')\n")
        state, _ = probe(chan)
        assert state["pid"] in pool
        assert not stderr_file.exists()
        assert chan.execute("print(kept)").stdout.strip() == "5"
    server.shutdown_kernel(kernel_id)


def test_the_new_slice_reaches_the_warm_process(server: RunningServer) -> None:
    """A resume onto another GPU: the warm process sees the new slice, not the old one."""
    kernel_id = server.start_kernel("python3-gpu-whole")
    with server.channel(kernel_id) as chan:
        assert chan.execute("v = 1").error == ""
        first = slice_uuids(server, kernel_id)
        hibernate(server, kernel_id)
        blocker = server.start_kernel("python3-gpu-whole")  # takes the GPU this kernel had
        assert slice_uuids(server, blocker) == first
        wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to refill")
        pool = warm_pids(server)
        state, _ = probe(chan)
        assert state["pid"] in pool
        assert state["env"]["CUDA_VISIBLE_DEVICES"] == slice_uuids(server, kernel_id) != first
    server.shutdown_kernel(blocker)
    server.shutdown_kernel(kernel_id)


def test_pool_processes_are_neither_kernels_nor_slices(server: RunningServer) -> None:
    wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to refill")
    assert warm_pids(server)
    assert server.get("/api/kernels") == []
    assert all(not device["slices"] for device in server.get("/api/elastic/gpus")["devices"])
    assert server.get("/api/elastic/kernels") == [] or all(
        k["state"] != "running" for k in server.get("/api/elastic/kernels")
    )
    assert metric(server, "elastic_slices_allocated", size="small") == 0


def test_refill_after_use_and_stop_leaves_no_pool_process(tmp_path: Path) -> None:
    server = start_server(
        tmp_path,
        warm_config(tmp_path / "checkpoints", size=2, starts=True),
        env_extra={"PYTHONPATH": str(REPO)},
    )
    try:
        wait_for(lambda: ready(server) == 2, timeout=60, what="the warm pool to fill")
        pool = warm_pids(server)
        # A notebook in a sub-directory: the kernel runs there, as a cold one would.
        (tmp_path / "root" / "sub").mkdir()
        body = {"path": "sub/nb.ipynb", "type": "notebook", "kernel": {"name": "python3-gpu-small"}}
        session = server.request("POST", "/api/sessions", body)
        assert session.status == 201, session
        kernel_id = session.body["kernel"]["id"]  # "starts": true
        with server.channel(kernel_id) as chan:
            state, reply = probe(chan)
        assert state["pid"] in pool and state["names"] == [] and reply["content"]["execution_count"] == 1
        # A fresh kernel's sys.path: a plain ipykernel started by jupyter_client in the same directory.
        assert state["cwd"] == str(tmp_path / "root" / "sub")
        assert state["path"] == plain_kernel_path(tmp_path / "root" / "sub")
        assert state["env"]["CUDA_VISIBLE_DEVICES"] == slice_uuids(server, kernel_id)
        wait_for(lambda: ready(server) == 2, timeout=60, what="the pool to refill after a start")
        assert len(warm_pids(server) - pool) == 1  # one new process, the other still waiting
        assert metric(server, "elastic_warm_pool_hits_total", kernel="python3", use="start") == 1
        waiting = warm_pids(server) - {state["pid"]}
    finally:
        server.stop()
    wait_for(lambda: not any(map(process_alive, waiting)), timeout=30, what="the pool processes to end")


def test_a_preload_that_touches_the_gpu_means_cold_starts(tmp_path: Path) -> None:
    server = start_server(
        tmp_path,
        warm_config(tmp_path / "checkpoints", preload=["torch"], starts=True),
        env_extra={"PYTHONPATH": f"{DOUBLE}{os.pathsep}{REPO}"},
    )
    try:
        wait_for(lambda: "warm pool python3 disabled" in server.log(), timeout=60, what="the detection")
        detected = "a GPU was touched while preloading torch: torch (torch.cuda.is_initialized() is True)"
        assert detected in server.log()
        kernel_id = server.start_kernel("python3-gpu-small")
        with server.channel(kernel_id) as chan:
            state, _ = probe(chan)
        assert not warm_pids(server) and not state["preloaded"]
        assert state["env"]["CUDA_VISIBLE_DEVICES"] == slice_uuids(server, kernel_id)
        assert metric(server, "elastic_warm_pool_misses_total", kernel="python3", reason="gpu_touched") == 1
        assert f"kernel {kernel_id} starts cold (start): warm pool python3: gpu_touched" in server.log()
    finally:
        server.stop()


def test_a_preload_that_fails_means_cold_starts(tmp_path: Path) -> None:
    server = start_server(
        tmp_path,
        warm_config(tmp_path / "checkpoints", preload=["no_such_module_here"], starts=True),
        env_extra={"PYTHONPATH": str(REPO)},
    )
    try:
        wait_for(lambda: "warm pool python3 disabled" in server.log(), timeout=60, what="the failed preload")
        kernel_id = server.start_kernel("python3-gpu-small")
        assert server.execute(kernel_id, "print(1 + 1)").strip() == "2"
        misses = metric(server, "elastic_warm_pool_misses_total", kernel="python3", reason="preload_failed")
        assert misses == 1
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"size": -1}, "ElasticKernels.warm_pool['python3'].size must be an integer from 0 to 64"),
        ({"preload": "torch"}, "ElasticKernels.warm_pool['python3'].preload must be a list of module names"),
        ({"memory_mib": 0}, "ElasticKernels.warm_pool['python3'].memory_mib must be a positive integer"),
        ({"sise": 1}, "ElasticKernels.warm_pool['python3']: unknown key 'sise'"),
        ({"starts": "yes"}, "ElasticKernels.warm_pool['python3'].starts must be true or false"),
    ],
)
def test_bad_settings_are_one_line_errors(pool: dict[str, Any], message: str) -> None:
    from kernelmgr.core.errors import ConfigError
    from kernelmgr.warm.settings import WarmPoolConfigError, parse_warm_pool

    with pytest.raises(WarmPoolConfigError, match=re.escape(message)):
        parse_warm_pool({"python3": pool}, ["python3"])
    with pytest.raises(WarmPoolConfigError, match=r"'r' is not in ElasticKernels\.base_kernels"):
        parse_warm_pool({"r": {}}, ["python3"])
    assert issubclass(WarmPoolConfigError, ValueError) and ConfigError


def test_a_bad_setting_stops_the_server_with_one_line(tmp_path: Path) -> None:
    config = elastic_config(tmp_path / "checkpoints", warm_pool={"python3": {"size": "two"}})
    proc, log_path, _url, _env = launch(tmp_path, config)
    try:
        proc.wait(timeout=START_SECONDS)  # a whole server start, then the refusal
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log = log_path.read_text()
    assert proc.returncode == 2
    assert "ElasticKernels.warm_pool['python3'].size must be an integer from 0 to 64, got 'two'" in log
    assert "Traceback" not in log


def test_the_pool_stays_within_its_memory_cap(tmp_path: Path) -> None:
    """A cap below one process's resident memory: the first is started, no second one."""
    server = start_server(
        tmp_path,
        warm_config(tmp_path / "checkpoints", size=3, memory_mib=1),
        env_extra={"PYTHONPATH": str(REPO)},
    )
    try:
        wait_for(lambda: ready(server) == 1, timeout=60, what="the first warm process")
        wait_for(lambda: "another would pass memory_mib=1" in server.log(), timeout=30, what="the cap")
        kernel_id = server.start_kernel("python3-gpu-small")
        server.execute(kernel_id, "v = 1")
        hibernate(server, kernel_id)
        assert server.execute(kernel_id, "print('back')", timeout=120).strip() == "back"
        # The one process was used; the refill starts one again (the pool is empty), never three.
        wait_for(lambda: ready(server) == 1, timeout=60, what="the refill")
        assert len(warm_pids(server)) == 2  # the kernel that was warm, and the new one
        assert metric(server, "elastic_warm_pool_processes", kernel="python3", state="starting") == 0
    finally:
        server.stop()


def test_two_resumes_at_once_share_one_warm_process_and_both_come_back(server: RunningServer) -> None:
    """Pool of one, two resumes together: one takes the warm process, the other starts cold; both
    get their own variables and slice, and the miss is counted as "empty"."""
    kernels = [server.start_kernel("python3-gpu-small") for _ in range(2)]
    for n, kernel_id in enumerate(kernels):
        server.execute(kernel_id, f"mine = {n}")
        hibernate(server, kernel_id)
    wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to refill")
    pool = warm_pids(server)
    misses = metric(server, "elastic_warm_pool_misses_total", kernel="python3", reason="empty")
    with ThreadPoolExecutor(2) as both:
        replies = list(
            both.map(lambda k: server.request("POST", f"/api/elastic/kernels/{k}/resume"), kernels)
        )
    assert [r.status for r in replies] == [200, 200], replies
    states = []
    for n, kernel_id in enumerate(kernels):
        with server.channel(kernel_id) as chan:
            assert chan.execute("print(mine)").stdout.strip() == str(n)
            state, _ = probe(chan)
        assert state["env"]["CUDA_VISIBLE_DEVICES"] == slice_uuids(server, kernel_id)
        states.append(state)
    assert sorted(s["pid"] in pool for s in states) == [False, True]
    assert metric(server, "elastic_warm_pool_misses_total", kernel="python3", reason="empty") == misses + 1
    for kernel_id in kernels:
        server.shutdown_kernel(kernel_id)


def test_deleting_a_kernel_while_it_resumes_warm_frees_everything(server: RunningServer) -> None:
    """The user deletes the kernel while its resume runs in the warm process: no kernel, slice or
    process is left behind, and the pool refills."""
    kernel_id = server.start_kernel("python3-gpu-small")
    server.execute(kernel_id, slow_to_load_cell(10))  # its resume takes 10 s: one to cut into
    hibernate(server, kernel_id)
    wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to refill")
    pool = warm_pids(server)
    hits = metric(server, "elastic_warm_pool_hits_total", kernel="python3", use="resume")
    with ThreadPoolExecutor(1) as background:
        resuming = background.submit(server.request, "POST", f"/api/elastic/kernels/{kernel_id}/resume")
        wait_for(
            lambda: server.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "resuming",
            timeout=30,
            interval=0.05,
            what="the resume to begin",
        )
        assert server.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "resuming"
        deleted = server.request("DELETE", f"/api/kernels/{kernel_id}")
        assert deleted.status == 204, deleted
        answer = resuming.result(timeout=120)
    # The resume is told the kernel is gone; never a 5xx.
    assert answer.status in (404, 409) and answer.body["message"], answer
    assert metric(server, "elastic_warm_pool_hits_total", kernel="python3", use="resume") == hits + 1
    wait_for(lambda: kernel_id not in [k["id"] for k in server.get("/api/kernels")], timeout=30, what="gone")
    wait_for(
        lambda: metric(server, "elastic_slices_allocated", size="small") == 0, timeout=30, what="slice free"
    )
    wait_for(lambda: not any(map(process_alive, pool)), timeout=30, what="the taken warm process to end")
    wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to refill")


def test_the_pool_refills_once_the_resume_that_took_its_process_is_over(
    server: RunningServer, tmp_path: Path
) -> None:
    """A new warm process spends CPU importing; the user waits for the resume that took the last
    one. So no process starts while that resume restores (held here at a gate in its unpickling),
    and one starts after it."""
    kernel_id = server.start_kernel("python3-gpu-small")
    gate = Gate(tmp_path / "gate")
    server.execute(kernel_id, gate.restored_object() + "held = HeldAtRestore()\nx = 7")
    hibernate(server, kernel_id)
    wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to fill")
    pool = warm_pids(server)
    with ThreadPoolExecutor(1) as background:
        resuming = background.submit(server.request, "POST", f"/api/elastic/kernels/{kernel_id}/resume")
        wait_for(gate.is_reached, timeout=120, what="the warm process to restore")
        # The pool's one process is the kernel restoring; nothing started beside it.
        assert warm_pids(server) == pool
        assert metric(server, "elastic_warm_pool_processes", kernel="python3", state="starting") == 0
        gate.open()
        assert resuming.result(timeout=120).status == 200
    wait_for(lambda: ready(server) == 1, timeout=60, what="the pool to refill after the resume")
    assert len(warm_pids(server) - pool) == 1
    assert server.execute(kernel_id, "print(x)").strip() == "7"
    server.shutdown_kernel(kernel_id)


def test_a_server_that_dies_leaves_no_pool_process(tmp_path: Path) -> None:
    """SIGKILL to the server (no stop hook runs): its warm processes notice and exit by themselves."""
    server = start_server(
        tmp_path, warm_config(tmp_path / "checkpoints", size=2), env_extra={"PYTHONPATH": str(REPO)}
    )
    try:
        wait_for(lambda: ready(server) == 2, timeout=60, what="the warm pool to fill")
        pool = warm_pids(server)
        assert len(pool) == 2
        server.process.kill()
        server.process.wait()
        wait_for(
            lambda: not any(map(process_alive, pool)), timeout=30, what="the orphaned pool processes to end"
        )
    finally:
        server.stop()
