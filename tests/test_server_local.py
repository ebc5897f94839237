"""Local mode end to end: a real jupyter_server with the extension and real ipykernel kernels."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CONFIG, PROFILES, elastic_config
from tests.support.server import START_SECONDS, RunningServer, launch, start_server, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("server")
    # A hand-written kernelspec that asks for a size the admin never configured.
    bad = home / "data" / "kernels" / "bad-size"
    bad.mkdir(parents=True)
    (bad / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Bad size",
                "language": "python",
                "metadata": {
                    "elastic": {"profile": "gigantic"},
                    "kernel_provisioner": {"provisioner_name": "elastic-local-provisioner"},
                },
            }
        )
    )
    running = start_server(home, CONFIG)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def no_kernels_left(server: RunningServer) -> Iterator[None]:
    yield
    server.shutdown_all_kernels()
    wait_for(lambda: not slices(server), what="all slices free")


def slices(server: RunningServer) -> list[dict]:
    return [s for d in server.get("/api/elastic/gpus")["devices"] for s in d["slices"]]


def test_profiles_are_listed_with_their_kernelspecs(server: RunningServer) -> None:
    body = server.get("/api/elastic/profiles")
    assert body["gpus_available"] is True
    by_name = {p["name"]: p for p in body["profiles"]}
    assert list(by_name) == ["small", "whole", "huge"]
    assert by_name["small"]["gpu_fraction"] == 0.25 and by_name["small"]["memory_mib"] == 10240
    assert by_name["small"]["kernelspecs"] == ["python3-gpu-small"]
    assert by_name["small"]["fits_now"] is True
    assert by_name["huge"]["fits_ever"] is False
    # local kernels: the size's Kubernetes backend (hami) does not apply; without MPS a fraction is
    # only told its share, and a whole GPU is hidden from others by CUDA_VISIBLE_DEVICES alone
    assert {k: by_name["small"]["isolation"][k] for k in ("mechanism", "memory", "compute")} == {
        "mechanism": "local",
        "memory": "none",
        "compute": "none",
    }
    assert (by_name["whole"]["isolation"]["memory"], by_name["whole"]["isolation"]["compute"]) == (
        "soft",
        "soft",
    )


def test_kernelspecs_are_generated_per_size(server: RunningServer) -> None:
    specs = server.get("/api/kernelspecs")["kernelspecs"]
    assert "python3" in specs, "the CPU kernel stays available"
    small = specs["python3-gpu-small"]["spec"]
    assert small["display_name"] == "Python 3 · GPU small (10 GiB)"
    assert small["metadata"]["elastic"]["profile"] == "small"
    assert small["metadata"]["kernel_provisioner"]["provisioner_name"] == "elastic-local-provisioner"
    assert specs["python3-gpu-whole"]["spec"]["display_name"] == "Python 3 · GPU whole (1 GPU)"
    assert "logo-64x64" in specs["python3-gpu-small"]["resources"]


def test_small_kernel_sees_its_slice_and_frees_it_on_shutdown(server: RunningServer) -> None:
    kernel_id = server.start_kernel("python3-gpu-small")
    out = server.execute(
        kernel_id,
        "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['ELASTIC_GPU_MEMORY_MIB'])",
    )
    assert out.split() == ["GPU-test-0000", "10240"]
    # ipykernel's banner (stdout) goes to the kernel's own file, never the server's terminal.
    banner = "To connect another client to this kernel"
    assert banner not in server.log()
    runtime = Path(server.env["JUPYTER_RUNTIME_DIR"])
    assert banner in (runtime / f"kernel-{kernel_id}.stderr").read_text()

    model = server.get(f"/api/elastic/kernels/{kernel_id}")
    assert model["profile"] == "small" and model["state"] == "running"
    assert model["name"] == "python3-gpu-small"
    assert model["slice"]["devices"] == [{"uuid": "GPU-test-0000", "fraction": 0.25, "memory_mib": 10240}]
    assert {"last_activity", "gpu_utilization", "gpu_memory_mib", "gpu_idle_seconds"} <= set(
        model["activity"]
    )
    assert [k["id"] for k in server.get("/api/elastic/kernels")] == [kernel_id]
    assert slices(server) == [
        {"kernel_id": kernel_id, "profile": "small", "warm": False, "fraction": 0.25, "memory_mib": 10240}
    ]

    server.shutdown_kernel(kernel_id)
    assert slices(server) == []
    assert server.request("GET", f"/api/elastic/kernels/{kernel_id}").status == 404


def test_cpu_kernel_sees_no_gpu_and_is_not_given_a_slice(server: RunningServer) -> None:
    kernel_id = server.start_kernel("python3")
    out = server.execute(kernel_id, "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))")
    assert out.strip() in ("None", "''")
    assert slices(server) == []


def test_over_capacity_is_a_clear_409(server: RunningServer) -> None:
    first = server.start_kernel("python3-gpu-whole")
    second = server.start_kernel("python3-gpu-whole")
    reply = server.request("POST", "/api/kernels", {"name": "python3-gpu-small"})
    assert reply.status == 409
    message = reply.body["message"]
    assert "'small' (25% of a GPU, 10 GiB) does not fit right now" in message
    assert "GPU-test-0000: 0% free" in message and "shut down" in message
    # Short first (what happened, what to do), the per-GPU figures after.
    assert message.index("shut down") < message.index("Free: ")
    assert len(server.get("/api/kernels")) == 2, "the refused kernel was not half-created"

    server.shutdown_kernel(first)
    third = server.start_kernel("python3-gpu-small")
    assert {s["kernel_id"] for s in slices(server)} == {second, third}


def test_metrics_count_starts_refusals_and_show_the_queue_and_the_volume(server: RunningServer) -> None:
    """What an admin alerts on: time to running, capacity refusals (unserved demand) and failed
    starts by reason, the slice queue's length, the checkpoint volume's free space."""

    def sample(text: str, name: str) -> float:
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    before = server.text("/metrics")
    first = server.start_kernel("python3-gpu-whole")
    second = server.start_kernel("python3-gpu-whole")
    assert server.request("POST", "/api/kernels", {"name": "python3-gpu-small"}).status == 409
    after = server.text("/metrics")
    started = 'elastic_kernel_start_duration_seconds_count{size="whole"}'
    assert sample(after, started) == sample(before, started) + 2
    refused = 'elastic_capacity_refusals_total{size="small"}'
    assert sample(after, refused) == sample(before, refused) + 1
    failed = 'elastic_kernel_start_failures_total{reason="capacity",size="small"}'
    assert sample(after, failed) == sample(before, failed) + 1
    assert sample(after, "elastic_slice_queue_length") == 0
    assert sample(after, "elastic_checkpoint_volume_free_bytes") > 0
    assert sample(after, "elastic_checkpoint_volume_size_bytes") >= sample(
        after, "elastic_checkpoint_volume_free_bytes"
    )
    for kernel_id in (first, second):
        server.shutdown_kernel(kernel_id)


def test_size_that_never_fits_says_so(server: RunningServer) -> None:
    reply = server.request("POST", "/api/kernels", {"name": "python3-gpu-huge"})
    assert reply.status == 409
    assert "can never fit" in reply.body["message"]


def test_unknown_kernelspec_is_404_listing_gpu_kernels(server: RunningServer) -> None:
    reply = server.request("POST", "/api/kernels", {"name": "python3-gpu-enormous"})
    assert reply.status == 404
    assert "no kernelspec named 'python3-gpu-enormous'" in reply.body["message"]
    assert "python3-gpu-small" in reply.body["message"]


def test_kernelspec_with_unconfigured_size_is_400(server: RunningServer) -> None:
    reply = server.request("POST", "/api/kernels", {"name": "bad-size"})
    assert reply.status == 400
    assert "unknown GPU size 'gigantic'" in reply.body["message"]
    assert "small, whole, huge" in reply.body["message"]


def test_sessions_api_gets_the_same_errors(server: RunningServer) -> None:
    reply = server.request(
        "POST",
        "/api/sessions",
        {"path": "a.ipynb", "type": "notebook", "kernel": {"name": "python3-gpu-huge"}},
    )
    assert reply.status == 409 and "can never fit" in reply.body["message"]


def test_unknown_kernel_id_is_404(server: RunningServer) -> None:
    reply = server.request("GET", "/api/elastic/kernels/not-a-kernel")
    assert reply.status == 404 and "no kernel with id" in reply.body["message"]


def test_api_requires_auth(server: RunningServer) -> None:
    assert server.request("GET", "/api/elastic/gpus", token=None).status == 403


def kernel_pid(server: RunningServer, kernel_id: str) -> int:
    return int(server.execute(kernel_id, "import os; print(os.getpid())").strip())


def test_killed_kernel_gives_back_its_slice_and_autorestarts(server: RunningServer) -> None:
    """Both GPUs full; kill -9 one kernel: its restart only succeeds if the dead one's slice was freed."""
    victim = server.start_kernel("python3-gpu-whole")
    other = server.start_kernel("python3-gpu-whole")
    old_pid = kernel_pid(server, victim)
    os.kill(old_pid, signal.SIGKILL)

    def restarted() -> bool:
        try:
            return kernel_pid(server, victim) != old_pid
        except (AssertionError, TimeoutError, OSError):
            return False

    wait_for(restarted, timeout=60, what="the killed kernel to be restarted")
    held = sorted(s["kernel_id"] for s in slices(server))
    assert held == sorted([victim, other])
    assert server.get(f"/api/elastic/kernels/{victim}")["state"] == "running"


def test_restart_keeps_one_slice(server: RunningServer) -> None:
    kernel_id = server.start_kernel("python3-gpu-small")
    before = server.get(f"/api/elastic/kernels/{kernel_id}")["slice"]
    reply = server.request("POST", f"/api/kernels/{kernel_id}/restart")
    assert reply.status == 200, reply
    assert server.get(f"/api/elastic/kernels/{kernel_id}")["slice"] == before
    assert len(slices(server)) == 1
    assert (
        server.execute(kernel_id, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])").strip()
        == "GPU-test-0000"
    )


def test_dead_kernel_without_autorestart_frees_its_slice(tmp_path: Path) -> None:
    running = start_server(tmp_path, CONFIG, ["--KernelManager.autorestart=False"])
    try:
        kernel_id = running.start_kernel("python3-gpu-whole")
        os.kill(kernel_pid(running, kernel_id), signal.SIGKILL)
        wait_for(lambda: not slices(running), timeout=30, what="the dead kernel's slice to be reaped")
        assert running.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "dead"
        running.start_kernel("python3-gpu-whole")
        running.start_kernel("python3-gpu-whole")
    finally:
        running.stop()


def test_server_exit_hibernates_or_shuts_kernels_down(tmp_path: Path) -> None:
    """Idle elastic kernels are hibernated on exit (default), CPU kernels shut down; no process is left."""
    running = start_server(tmp_path, CONFIG)
    kernel_id = running.start_kernel("python3-gpu-small")
    cpu_id = running.start_kernel("python3")
    pid = kernel_pid(running, kernel_id)
    cpu_pid = kernel_pid(running, cpu_id)
    running.stop()
    assert running.process.returncode == 0
    assert f"Kernel {kernel_id} hibernated (server shutdown)" in running.log()
    wait_for(
        lambda: not os.path.exists(f"/proc/{cpu_pid}") or _zombie(cpu_pid), timeout=30, what="CPU kernel exit"
    )
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), timeout=30, what="kernel exit")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"profiles": {"small": {"gpu_fraction": 1.5}}}, "ElasticKernels.profiles['small'].gpu_fraction"),
        ({"gpu_inventory": [{"uuid": "GPU-x", "name": "A"}]}, "ElasticKernels.gpu_inventory[0].memory_mib"),
        ({"allocation_strategy": "random"}, "allocation_strategy"),
    ],
)
def test_bad_config_stops_the_server_with_one_clear_line(tmp_path: Path, config: dict, fragment: str) -> None:
    proc, log_path, _url, _env = launch(tmp_path, {"ElasticKernels": {**CONFIG["ElasticKernels"], **config}})
    try:
        proc.wait(timeout=START_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log = log_path.read_text()
    assert proc.returncode != 0
    assert fragment in log
    assert "Traceback" not in log


def test_no_gpus_means_cpu_kernels_only(tmp_path: Path) -> None:
    from kernelmgr.activity.nvml import NvmlUnavailable, PynvmlNvml

    try:
        PynvmlNvml().devices()
        pytest.skip("this machine has a GPU driver; the no-GPU path needs one without")
    except NvmlUnavailable:
        pass
    running = start_server(tmp_path, {"ElasticKernels": {"profiles": PROFILES}})
    try:
        gpus = running.get("/api/elastic/gpus")
        assert gpus["source"] == "none" and gpus["devices"] == []
        assert gpus["message"].startswith("No GPUs: NVML unavailable")
        assert "only CPU kernels are offered" in gpus["message"]
        profiles = running.get("/api/elastic/profiles")
        assert profiles["gpus_available"] is False
        assert all(p["kernelspecs"] == [] and not p["fits_now"] for p in profiles["profiles"])
        specs = running.get("/api/kernelspecs")["kernelspecs"]
        assert "python3" in specs and not [n for n in specs if "-gpu-" in n]
        assert "only CPU kernels are offered" in running.log()
    finally:
        running.stop()


def test_kernels_stopped_with_their_server_by_sigterm_lose_nothing(tmp_path: Path) -> None:
    """systemd stopping the server's unit sends SIGTERM to every process in it at once: the server
    and its kernels (which run in process groups of their own). Each kernel checkpoints what
    changed before it exits; the restarted server lists it hibernated, and the next cell has it all."""
    running = start_server(tmp_path, CONFIG)
    try:
        kernel_id = running.start_kernel("python3-gpu-small")
        pid = kernel_pid(running, kernel_id)
        running.execute(kernel_id, "x = 41")
        os.kill(pid, signal.SIGTERM)
        running.process.send_signal(signal.SIGTERM)
        running.process.wait(timeout=60)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), timeout=30, what="kernel exit")
    finally:
        running.stop()
    restarted = start_server(tmp_path, CONFIG)
    try:
        assert restarted.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "hibernated"
        assert restarted.execute(kernel_id, "print(x + 1)").split()[-1] == "42"
    finally:
        restarted.stop()


def test_a_kernel_sent_sigterm_alone_resumes_from_the_checkpoint_it_wrote(tmp_path: Path) -> None:
    """SIGTERM to a kernel while its server runs (an admin's ``kill``, a process supervisor): it
    checkpoints what changed and exits; the server hibernates it from that checkpoint instead of
    restarting it empty, and the next cell has everything, told what happened."""
    running = start_server(tmp_path, CONFIG)
    try:
        kernel_id = running.start_kernel("python3-gpu-small")
        pid = kernel_pid(running, kernel_id)
        running.execute(kernel_id, "x = 41")
        os.kill(pid, signal.SIGTERM)
        wait_for(
            lambda: running.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "hibernated",
            timeout=30,
            what="the kernel to be hibernated from its own checkpoint",
        )
        assert slices(running) == []  # its GPU slice went with the process
        with running.channel(kernel_id) as tab:
            result = tab.execute("print(x + 1)", timeout=60)
        assert result.stdout.strip() == "42", result
        assert "stopped (its process was sent SIGTERM). The kernel checkpointed itself first" in result.stderr
        assert kernel_pid(running, kernel_id) != pid
        metrics = running.text("/metrics")
        assert 'elastic_kernels_saved_at_stop_total{size="small"} 1.0' in metrics
        assert 'elastic_kernels_lost_total{size="small"} 1.0' in metrics
    finally:
        running.stop()


def test_a_lost_kernel_resumes_from_a_checkpoint_committed_after_the_server_read_its_newest(
    tmp_path: Path,
) -> None:
    """The race a force-deleted pod leaves: the server reads a lost kernel's newest checkpoint, then
    the kernel, still answering its SIGTERM, commits another. The resume takes the newer one (the
    kernel would refuse the one the server named, now superseded), never an older one."""
    from kernelmgr.checkpoint.integrity import load_or_create_secret
    from kernelmgr.checkpoint.writer import write_checkpoint
    from kernelmgr.checkpoint_store import CheckpointStore

    checkpoints = tmp_path / "checkpoints"
    running = start_server(tmp_path, elastic_config(checkpoints))
    try:
        kernel_id = running.start_kernel("python3-gpu-small")
        running.execute(kernel_id, "x = 41")
        os.kill(kernel_pid(running, kernel_id), signal.SIGTERM)
        wait_for(
            lambda: running.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "hibernated",
            timeout=30,
            what="the kernel to be hibernated from its own checkpoint",
        )
        # What the kernel would have committed next (its key derives from the server's secret).
        (owner_dir,) = [p for p in checkpoints.iterdir() if (p / kernel_id).is_dir()]
        secret = load_or_create_secret(str(running.home / "data" / "elastic-secret" / "checkpoint-secret"))
        store = CheckpointStore(checkpoints, secret)
        write_checkpoint(
            store.kernel_dir(owner_dir.name, kernel_id),
            {"x": 41, "later": "committed after the server looked"},
            key=store.key_for(owner_dir.name),
            owner=owner_dir.name,
            kernel_id=kernel_id,
        )
        printed = running.execute(kernel_id, "print(x + 1, later)")
        assert printed.strip().endswith("42 committed after the server looked"), printed
    finally:
        running.stop()
