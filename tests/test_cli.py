"""``jupyter elastic`` against a real server: tables, JSON, discovery and one-line errors."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from kernelmgr import cli_colour
from kernelmgr.cli import _outcome
from kernelmgr.cli_refs import KernelRefError, resolve, shorten_path
from kernelmgr.cli_render import human_bytes, human_mib, render_kernel, render_kernels, render_progress
from tests.conftest import CONFIG
from tests.support.server import TOKEN, RunningServer, start_server

pytestmark = pytest.mark.pure


def cli(
    server: RunningServer | None, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["jupyter", "elastic", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env if env is not None else (server.env if server else None),
    )


def test_profiles_table_from_the_runtime_file(plain_server: RunningServer) -> None:
    result = cli(plain_server, "profiles")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["SIZE", "DISPLAY", "NAME"]
    small = next(line for line in lines if line.startswith("small "))
    assert "GPU small (10 GiB)" in small and "25%" in small and "python3-gpu-small" in small
    assert " none/none " in small  # a local fraction without MPS: nothing enforced, only told its share


def test_gpus_json(plain_server: RunningServer) -> None:
    result = cli(plain_server, "--json", "gpus")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [d["uuid"] for d in doc["devices"]] == ["GPU-test-0000", "GPU-test-0001"]


def test_list_shows_a_running_kernel(plain_server: RunningServer) -> None:
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        result = cli(plain_server, "--url", plain_server.url, "--token", TOKEN, "list")
        assert result.returncode == 0, result.stderr
        row = next(line for line in result.stdout.splitlines() if line.startswith(kernel_id[:8]))
        assert row.split()[1:4] == ["-", "small", "running"]  # no notebook: a kernel of /api/kernels
    finally:
        plain_server.shutdown_kernel(kernel_id)
    assert cli(plain_server, "list").stdout.strip() == "no kernels"


def on_a_terminal(server: RunningServer, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run the CLI with stdout and stderr on a pseudo-terminal, as a user's shell does: its exit
    code and everything it wrote there."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            ["jupyter", "elastic", *args],
            stdout=follower,
            stderr=follower,
            env={**server.env, "TERM": "xterm", **(env or {})},
        )
        os.close(follower)
        chunks: list[bytes] = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closes when the process has exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        return proc.wait(timeout=60), b"".join(chunks).decode()
    finally:
        os.close(leader)


def test_states_and_errors_are_coloured_on_a_terminal_only(plain_server: RunningServer) -> None:
    """Issue 44: colours on a TTY; a pipe (and NO_COLOR) gets the same text without them."""
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        code, shown = on_a_terminal(plain_server, "list")
        assert code == 0, shown
        assert "\x1b[32mrunning\x1b[0m" in shown, repr(shown)
        piped = cli(plain_server, "list")
        assert "\x1b[" not in piped.stdout and "running" in piped.stdout
        assert "\x1b[" not in on_a_terminal(plain_server, "list", env={"NO_COLOR": "1"})[1]
        code, shown = on_a_terminal(plain_server, "hibernate", "0000ffff")
        assert code == 2 and shown.startswith("\x1b[31mjupyter elastic: "), repr(shown)
    finally:
        plain_server.shutdown_kernel(kernel_id)


def test_a_coloured_table_has_the_plain_tables_widths() -> None:
    kernels = [
        {"id": "a" * 36, "profile": "small", "state": "running", "activity": {}},
        {
            "id": "b" * 36,
            "profile": "whole",
            "state": "hibernated",
            "activity": {},
            "checkpoint": {"bytes": 2048},
        },
    ]
    plain = render_kernels(kernels)
    coloured = render_kernels(kernels, colour=True)
    assert coloured != plain and re.sub(r"\x1b\[[0-9;]*m", "", coloured) == plain
    assert not cli_colour.wanted(io.StringIO())  # not a terminal
    tty = io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    assert cli_colour.wanted(tty, {"TERM": "xterm"})
    assert not cli_colour.wanted(tty, {"TERM": "xterm", "NO_COLOR": "1"})
    assert not cli_colour.wanted(tty, {"TERM": "dumb"})


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "a command is required"),
        (["--url", "not-a-url", "gpus"], "--url must look like http://host:port/base/"),
    ],
)
def test_bad_usage_is_exit_2_and_one_line(
    plain_server: RunningServer, args: list[str], fragment: str
) -> None:
    result = cli(plain_server, *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert fragment in result.stderr


def test_wrong_token_is_one_line(plain_server: RunningServer) -> None:
    result = cli(plain_server, "--url", plain_server.url, "--token", "wrong", "gpus")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"jupyter elastic: {plain_server.url} refused the request (HTTP 403): check --token"
    ]


def test_no_server_is_one_line(tmp_path: Path, plain_server: RunningServer) -> None:
    env = dict(plain_server.env, JUPYTER_RUNTIME_DIR=str(tmp_path))
    result = cli(None, "gpus", env=env)
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"jupyter elastic: no running Jupyter server found in {tmp_path}; pass --url and --token"
    )


def test_unreachable_server_is_one_line(plain_server: RunningServer) -> None:
    result = cli(plain_server, "--url", "http://127.0.0.1:9", "gpus")
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "cannot reach http://127.0.0.1:9" in result.stderr


def test_hibernate_and_resume_from_the_cli(plain_server: RunningServer) -> None:
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        plain_server.execute(kernel_id, "import numpy as np; arr = np.ones(10); gen = (i for i in [1])")
        result = cli(plain_server, "hibernate", kernel_id)
        assert result.returncode == 0, result.stderr
        line = result.stdout.strip()
        assert line.startswith(f"kernel {kernel_id} is hibernated: ") and "not saved: gen" in line
        listing = cli(plain_server, "list").stdout.splitlines()
        assert listing[0].split()[:5] == ["KERNEL", "NOTEBOOK", "SIZE", "STATE", "IDLE"]
        row = next(r for r in listing if r.startswith(kernel_id[:8]))
        assert row.split()[1:4] == ["-", "small", "hibernated"]
        as_json = json.loads(cli(plain_server, "--json", "list").stdout)
        assert as_json[0]["state"] == "hibernated"
        resumed = cli(plain_server, "resume", kernel_id)
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.strip() == f"kernel {kernel_id} is running (GPU size small, on GPU-test-0000)"
    finally:
        plain_server.shutdown_kernel(kernel_id)


def test_hibernate_errors_are_one_line(plain_server: RunningServer) -> None:
    for action in ("hibernate", "resume", "report"):  # an unknown id is the user's mistake: exit 2
        missing = cli(plain_server, action, "no-such-kernel")
        assert missing.returncode == 2, (action, missing.stderr)
        assert missing.stderr.strip().splitlines() == [
            "jupyter elastic: no kernel is 'no-such-kernel': "
            "`jupyter elastic list` shows their ids and notebooks"
        ]
    bad = cli(plain_server, "resume", "../etc")
    assert bad.returncode == 2 and "no kernel is '../etc'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def slow_both_ways(seconds: float) -> str:
    """Source of a class whose pickling and unpickling each take ``seconds``.

    Its checkpoint and its restore then outlast a client whose request timeout is shorter, which
    is what a notebook holding gigabytes does to a 30 s client.
    """
    return (
        "import time\n"
        "class SlowBoth:\n"
        "    def __reduce__(self):\n"
        f"        time.sleep({seconds})\n"
        "        return (SlowBoth, (), {'ok': True})\n"
        "    def __setstate__(self, state):\n"
        f"        time.sleep({seconds})\n"
        "        self.__dict__.update(state)\n"
    )


def test_hibernate_and_resume_wait_past_the_request_timeout(plain_server: RunningServer) -> None:
    """A hibernation (and a resume) slower than one request is waited for, not reported failed."""
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        plain_server.execute(kernel_id, slow_both_ways(3) + "slow = SlowBoth(); kept = 7")
        result = cli(plain_server, "--request-timeout", "0.5", "hibernate", kernel_id)
        assert result.returncode == 0, result.stderr
        line = result.stdout.strip()
        assert line.startswith(f"kernel {kernel_id} is hibernated: ") and line.endswith("not saved: none")
        assert result.stderr == ""
        resumed = cli(plain_server, "--request-timeout", "0.5", "--json", "resume", kernel_id)
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(resumed.stdout)["state"] == "running"
        assert plain_server.execute(kernel_id, "print(kept, slow.ok)").strip() == "7 True"
    finally:
        plain_server.shutdown_kernel(kernel_id)


def test_failure_reported_after_the_request_timeout_is_one_line(tmp_path: Path) -> None:
    """The server gives up on the checkpoint after the client stopped waiting for the answer:
    the CLI still reports the server's reason, in one line, with exit code 1."""
    running = start_server(
        tmp_path, {"ElasticKernels": {**CONFIG["ElasticKernels"], "checkpoint_timeout": 1}}
    )
    try:
        assert running.get("/api/elastic/policy")["checkpoint_timeout"] == 1
        kernel_id = running.start_kernel("python3-gpu-small")
        running.execute(kernel_id, slow_both_ways(4) + "slow = SlowBoth()")
        result = cli(running, "--request-timeout", "0.5", "hibernate", kernel_id)
        assert result.returncode == 1
        assert result.stderr.strip().splitlines() == [
            f"jupyter elastic: hibernate of kernel {kernel_id} failed, it is running: "
            "the kernel did not answer within 1s"
        ]
    finally:
        running.stop()


def test_bad_request_timeout_is_usage(plain_server: RunningServer) -> None:
    result = cli(plain_server, "--request-timeout", "0", "gpus")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "jupyter elastic: error: --request-timeout must be > 0 seconds, got 0 (see --help)"
    ]


RUNNING_SINCE_10 = {"id": "k", "state": "running", "state_since": 10.0, "last_error": "disk full"}


@pytest.mark.parametrize(
    ("action", "model", "expected"),
    [
        ("hibernate", {"id": "k", "state": "hibernated", "state_since": 12.0}, "done"),
        ("hibernate", {"id": "k", "state": "hibernating", "state_since": 11.0}, None),
        # An earlier failure's last_error is still there, but nothing happened since: wait.
        ("hibernate", RUNNING_SINCE_10, None),
        (
            "hibernate",
            {**RUNNING_SINCE_10, "state_since": 12.0, "last_error": "the kernel did not answer within 1s"},
            "hibernate of kernel k failed, it is running: the kernel did not answer within 1s",
        ),
        ("resume", {"id": "k", "state": "running", "state_since": 12.0}, "done"),
        ("resume", {"id": "k", "state": "resuming", "state_since": 11.0}, None),
        (
            "resume",
            {"id": "k", "state": "hibernated", "state_since": 12.0, "state_reason": "resume failed: boom"},
            "resume of kernel k failed, it is hibernated: resume failed: boom",
        ),
    ],
)
def test_poll_outcome_tells_failure_from_not_started(
    action: str, model: dict[str, Any], expected: str | None
) -> None:
    """What a poll concludes, given the reading taken before the request (state since t=10)."""
    before = {"id": "k", "state": "running" if action == "hibernate" else "hibernated", "state_since": 10.0}
    assert _outcome(action, model, before) == expected


def test_gpus_view_counts_warm_pod_slices_apart() -> None:
    from kernelmgr.cli import render_gpus

    device = {"index": 0, "uuid": "GPU-0", "name": "A100", "memory_mib": 40960, "free_memory_mib": 0}
    slices = [{"kernel_id": "k1", "warm": False}, {"kernel_id": "warm:warm-whole-1", "warm": True}]
    doc = {
        "message": "2 GPUs",
        "strategy": "binpack",
        "devices": [{**device, "used_fraction": 1.0, "slices": slices}],
        "warm_pods": {"whole": {"ready": 1, "starting": 0}},
    }
    out = render_gpus(doc)
    assert "k1 (-), +1 warm" in out
    assert "100%" in out and "1 GPU" not in out  # one unit in USED
    assert (
        "Warm pods (each holds a slice, given up to any kernel that needs it): whole: 1 ready, 0 starting"
        in out
    )
    plain = render_gpus(
        {**doc, "devices": [{**device, "used_fraction": 0.5, "slices": slices[:1]}], "warm_pods": {}}
    )
    assert "warm" not in plain.lower()


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (0, "0 B"),
        (80, "80 B"),
        (1536, "1.5 KiB"),
        (300 * 2**20, "300 MiB"),
        (10 * 2**30, "10 GiB"),
        (int(1.25 * 2**30), "1.25 GiB"),
        (int(12.34 * 2**30), "12.3 GiB"),
        (1023 * 2**20, "1023 MiB"),
        (None, "-"),
    ],
)
def test_sizes_are_human(count: int | None, text: str) -> None:
    assert human_bytes(count) == text


def test_tiny_checkpoints_and_memory_read_as_bytes_not_exponents() -> None:
    """An 80-byte checkpoint once printed as ``7.45058e-08 GiB``."""
    kernel = {
        "id": "k1",
        "profile": "small",
        "state": "hibernated",
        "checkpoint": {"bytes": 80, "saved": [{"name": "x"}], "not_saved": []},
        "activity": {"gpu_memory_mib": 0.5},
    }
    assert render_kernel(kernel) == "kernel k1 is hibernated: 1 variable(s) saved (80 B), not saved: none"
    row = render_kernels([kernel]).splitlines()[1]
    assert row.split()[-2:] == ["80", "B"] and "e-0" not in row
    assert human_mib(10240) == "10 GiB" and human_mib(512) == "512 MiB"


def test_hibernate_progress_says_the_bytes_written() -> None:
    """The kernel model's ``hibernate`` (the agent's progress file) in the CLI's progress line."""
    model = {"state": "hibernating", "hibernate": {"written_mib": 120.0, "expected_mib": 2048.0}}
    assert render_progress("hibernate", model) == (
        "hibernating: writing the checkpoint, 120 MiB of about 2 GiB written"
    )
    assert render_progress("hibernate", {"state": "hibernating", "hibernate": {}}) == (
        "hibernating: writing the checkpoint"
    )


def test_json_after_the_command_too(plain_server: RunningServer) -> None:
    for args in (["gpus", "--json"], ["--json", "gpus"]):
        result = cli(plain_server, *args)
        assert result.returncode == 0, result.stderr
        assert [d["uuid"] for d in json.loads(result.stdout)["devices"]] == ["GPU-test-0000", "GPU-test-0001"]
    profiles = json.loads(cli(plain_server, "profiles", "--json").stdout)
    assert "small" in [p["name"] for p in profiles["profiles"]]
    assert json.loads(cli(plain_server, "list", "--json").stdout) == []


def test_hibernate_shows_its_progress_and_human_sizes(plain_server: RunningServer) -> None:
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        plain_server.execute(kernel_id, slow_both_ways(3) + "slow = SlowBoth(); kept = 7")
        result = cli(plain_server, "--progress", "hibernate", kernel_id)
        assert result.returncode == 0, result.stderr
        assert any(
            text.startswith(f"jupyter elastic: kernel {kernel_id[:8]} hibernating: writing the checkpoint")
            for text in result.stderr.splitlines()
        ), result.stderr
        line = result.stdout.strip()
        assert re.fullmatch(
            rf"kernel {kernel_id} is hibernated: \d variable\(s\) saved \(\d+(\.\d+)? KiB\), not saved: none",
            line,
        ), line
        resumed = cli(plain_server, "--progress", "resume", kernel_id)
        assert resumed.returncode == 0, resumed.stderr
        # Unpickling takes 3 s: the poll sees the kernel started and reading its checkpoint.
        assert any(
            text.startswith(f"jupyter elastic: kernel {kernel_id[:8]} resuming: ")
            for text in resumed.stderr.splitlines()
        ), resumed.stderr
        assert resumed.stdout.strip() == f"kernel {kernel_id} is running (GPU size small, on GPU-test-0000)"
    finally:
        plain_server.shutdown_kernel(kernel_id)


def test_ctrl_c_on_a_waiting_resume_cancels_the_wait_on_the_server(plain_server: RunningServer) -> None:
    """Both GPUs are held by whole-GPU kernels: the resume waits; Ctrl-C stops the wait there too."""
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    holders: list[str] = []
    try:
        plain_server.execute(kernel_id, "kept = 7")
        assert cli(plain_server, "hibernate", kernel_id).returncode == 0
        holders = [plain_server.start_kernel("python3-gpu-whole") for _ in range(2)]
        refused = plain_server.request("POST", f"/api/elastic/kernels/{kernel_id}/cancel")
        assert refused.status == 409 and "not waiting for a GPU slice" in refused.body["message"]
        process = subprocess.Popen(
            ["jupyter", "elastic", "--progress", "resume", kernel_id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=plain_server.env,
            # Ctrl-C as at a terminal: a suite started in the background (a CI runner, `cmd &`)
            # hands its children SIGINT ignored, and an ignored signal stays ignored across exec.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert process.stderr is not None
        lines: list[str] = []
        waiting = threading.Event()

        def read() -> None:
            assert process.stderr is not None
            for text in process.stderr:
                lines.append(text.rstrip("\n"))
                if "waiting for a free GPU slice" in text:
                    waiting.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert waiting.wait(180), lines
        process.send_signal(signal.SIGINT)
        assert process.wait(180) == 130  # a failure budget for a loaded machine, not a timing
        reader.join(10)
        assert lines[-1] == (
            f"jupyter elastic: interrupted: the resume of kernel {kernel_id} stopped waiting for a "
            "GPU slice; it stays hibernated"
        ), lines
        assert (
            f"jupyter elastic: kernel {kernel_id[:8]} resuming: waiting for a free GPU slice (small), "
            "number 1 of 1 in the queue; " in "\n".join(lines)
        ), lines
        model = plain_server.get(f"/api/elastic/kernels/{kernel_id}")
        assert model["state"] == "hibernated" and model["resume"] is None
        # A slice that frees up now is not taken behind the user's back.
        plain_server.shutdown_kernel(holders.pop())
        assert plain_server.get(f"/api/elastic/kernels/{kernel_id}")["state"] == "hibernated"
        assert plain_server.execute(kernel_id, "print(kept)").strip() == "7"
    finally:
        for holder in holders:
            plain_server.shutdown_kernel(holder)
        plain_server.shutdown_kernel(kernel_id)


def test_cancel_of_an_unknown_kernel_is_404(plain_server: RunningServer) -> None:
    answer = plain_server.request("POST", "/api/elastic/kernels/no-such-kernel/cancel")
    assert answer.status == 404 and "no kernel with id 'no-such-kernel'" in answer.body["message"]


def test_progress_rewrites_one_line_on_a_terminal_and_prints_changes_elsewhere() -> None:
    import io

    from kernelmgr.cli import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    shown = Progress(True, terminal)
    shown.show("k", "resuming: starting the kernel", 1.2)
    shown.show("k", "resuming: starting the kernel", 2.4)
    shown.done()
    assert terminal.getvalue() == (
        "\r\x1b[Kjupyter elastic: kernel k resuming: starting the kernel (1s)"
        "\r\x1b[Kjupyter elastic: kernel k resuming: starting the kernel (2s)\r\x1b[K"
    )
    log = io.StringIO()
    lines = Progress(True, log)
    for text in ("hibernating: writing the checkpoint", "hibernating: writing the checkpoint", "x"):
        lines.show("k", text, 0)
    assert log.getvalue().splitlines() == [
        "jupyter elastic: kernel k hibernating: writing the checkpoint",
        "jupyter elastic: kernel k x",
    ]
    quiet = io.StringIO()
    Progress(False, quiet).show("k", "x", 0)
    assert quiet.getvalue() == ""
    # An 80-column terminal: the line is cut to fit (a wrapped line leaves a row behind each \r).
    narrow = Terminal()
    long_phase = "resuming: restoring the checkpoint, 1.2 GiB of 10 GiB read back, 3 variables of 41 restored"
    with mock.patch("shutil.get_terminal_size", return_value=os.terminal_size((80, 24))):
        Progress(True, narrow).show("0a1b2c3d-0000-4000-8000-000000000001", long_phase, 3)
    written = narrow.getvalue().removeprefix("\r\x1b[K")
    assert len(written) == 79 and written.startswith("jupyter elastic: kernel 0a1b2c3d resuming")
    assert written.endswith("..."), written


EXAMPLE_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "local" / "jupyter_server_config.py"


def test_demo_config_prints_the_tours_example(capsys: pytest.CaptureFixture[str]) -> None:
    """A wheel user has no examples/ folder: `jupyter elastic demo-config` gives them the tour's config
    (the installed wheel's copy is checked by tests/test_release_artifacts.py)."""
    from kernelmgr.cli import main

    assert main(["demo-config"]) == 0
    assert capsys.readouterr().out == EXAMPLE_CONFIG.read_text()


def test_demo_config_writes_a_file_and_keeps_an_existing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernelmgr.cli import main

    target = tmp_path / "demo_config.py"
    assert main(["demo-config", str(target)]) == 0
    assert target.read_text() == EXAMPLE_CONFIG.read_text()
    assert f"jupyter lab --config={target}" in capsys.readouterr().err
    target.write_text("# mine\n")
    with pytest.raises(SystemExit) as refused:
        main(["demo-config", str(target)])
    assert refused.value.code == 2 and target.read_text() == "# mine\n"
    assert "exists; pass --force to replace it" in capsys.readouterr().err
    assert main(["demo-config", "--force", str(target)]) == 0
    assert target.read_text() == EXAMPLE_CONFIG.read_text()


def test_a_resume_waiting_for_a_node_says_so() -> None:
    """A resume whose pod waits for the cluster autoscaler (ElasticKernels.scale_up_wait) says that,
    in the CLI and in the cell, not "starting"."""
    from kernelmgr.cli_render import render_progress
    from kernelmgr.server.websocket import resume_progress_text

    phase = {"phase": "waiting_for_node", "scale_up_wait_s": 600}
    model = {"state": "resuming", "profile": "whole", "resume": phase}
    assert "waits for the cluster to add a node (whole)" in render_progress("resume", model)
    assert "waiting for the cluster to add a node" in resume_progress_text(phase)


def test_resize_from_the_cli(plain_server: RunningServer) -> None:
    """``jupyter elastic resize KERNEL SIZE``: the kernel runs at the new size, its variables kept;
    refusals are one line (exit 1 for the server's 4xx, 2 for an unknown kernel)."""
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        plain_server.execute(kernel_id, "kept = 5")
        result = cli(plain_server, "--json", "resize", kernel_id, "whole")
        assert result.returncode == 0, result.stderr
        model = json.loads(result.stdout)
        assert (model["profile"], model["state"]) == ("whole", "running")
        back = cli(plain_server, "resize", kernel_id[:8], "small")  # what it says: the new size
        assert back.returncode == 0, back.stderr
        assert back.stdout.strip().startswith(f"kernel {kernel_id} is running (GPU size small, on GPU-test-")
        assert plain_server.execute(kernel_id, "print(kept)").strip() == "5"
        refused = cli(plain_server, "resize", kernel_id, "tiny")
        assert refused.returncode == 1
        assert refused.stderr.strip().splitlines() == [
            f"jupyter elastic: HTTP 400 from {plain_server.url}/api/elastic/kernels/{kernel_id}/resize: "
            "unknown GPU size 'tiny'; the sizes here: huge, small, whole"
        ]
        missing = cli(plain_server, "resize", "no-such-kernel", "small")
        assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
        usage = cli(plain_server, "resize", kernel_id)
        assert usage.returncode == 2 and "size" in usage.stderr
    finally:
        plain_server.shutdown_kernel(kernel_id)


def test_a_kernel_by_its_short_id_or_notebook_with_options_after_the_command(
    plain_server: RunningServer,
) -> None:
    """Issue 44: ``hibernate --progress ID`` was refused, the short id JupyterLab shows was refused
    (the hint named a REST path), and ``list`` was 136 columns of full ids with no notebook."""
    session = plain_server.request(
        "POST",
        "/api/sessions",
        {"path": "course/week-49/train.ipynb", "type": "notebook", "kernel": {"name": "python3-gpu-small"}},
    )
    assert session.status == 201, session
    kernel_id = session.body["kernel"]["id"]
    other = plain_server.start_kernel("python3-gpu-small")
    try:
        plain_server.execute(kernel_id, "kept = 6")
        listing = cli(plain_server, "list")
        assert listing.returncode == 0, listing.stderr
        assert max(len(line) for line in listing.stdout.splitlines()) <= 80, listing.stdout
        row = next(line for line in listing.stdout.splitlines() if line.startswith(kernel_id[:8] + " "))
        assert row.split()[1:4] == ["...week-49/train.ipynb", "small", "running"], row

        hibernated = cli(plain_server, "hibernate", "--no-progress", kernel_id[:8])
        assert hibernated.returncode == 0, hibernated.stderr
        assert hibernated.stdout.startswith(f"kernel {kernel_id} is hibernated: 1 variable(s) saved")
        resumed = cli(plain_server, "resume", "train.ipynb", "--request-timeout", "60")
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.startswith(f"kernel {kernel_id} is running")
        report = cli(plain_server, "report", "course/week-49/train.ipynb", "--json")
        assert report.returncode == 0 and "kept" in report.stdout, report
        assert plain_server.execute(kernel_id, "print(kept * 7)").strip() == "42"

        for ref, says in [
            (kernel_id[:3], "too short: give at least 4 characters"),
            ("nothing.ipynb", "no kernel is 'nothing.ipynb': `jupyter elastic list` shows"),
            ("0000000-not-a-kernel", "no kernel is '0000000-not-a-kernel'"),
        ]:
            refused = cli(plain_server, "hibernate", ref)
            assert refused.returncode == 2, (ref, refused)
            lines = refused.stderr.strip().splitlines()
            assert len(lines) == 1 and says in lines[0] and "/api/" not in lines[0], (ref, lines)
        missing = cli(plain_server, "resume", "00000000-0000-4000-8000-000000000000")
        assert missing.returncode == 2 and "`jupyter elastic list` shows them" in missing.stderr, missing
    finally:
        plain_server.shutdown_kernel(other)
        plain_server.request("DELETE", f"/api/sessions/{session.body['id']}")


def test_kernel_references_name_one_kernel_or_say_why() -> None:
    ids = ["0a1b2c3d-0000-4000-8000-000000000001", "0a1b2c3d-9999-4000-8000-000000000002", "ffee0011-0-0"]
    notebooks = {ids[0]: "a/train.ipynb", ids[1]: "b/train.ipynb", ids[2]: "solo.ipynb"}
    assert resolve(ids[1], ids, notebooks) == ids[1]
    assert resolve("ffee", ids, notebooks) == ids[2]
    assert resolve("solo.ipynb", ids, notebooks) == ids[2]
    assert resolve("a/train.ipynb", ids, notebooks) == ids[0]
    assert resolve("0a1b2c3d-9", ids, notebooks) == ids[1]
    for ref, says in [
        ("0a1b2c3d", "names 2 kernels: 0a1b2c3d (a/train.ipynb), 0a1b2c3d (b/train.ipynb)"),
        ("train.ipynb", "names 2 kernels"),
        ("ff", "too short"),
        ("beef", "no kernel is 'beef'"),
    ]:
        with pytest.raises(KernelRefError, match=re.escape(says)):
            resolve(ref, ids, notebooks)
    assert shorten_path("course/week-49/train.ipynb", 22) == "...week-49/train.ipynb"
    assert shorten_path(None, 22) == "-" and shorten_path("a.ipynb", 22) == "a.ipynb"
