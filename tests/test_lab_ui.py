"""The JupyterLab extension in a real headless Chromium against a real ``jupyter lab``.

The issue's scenario, step by step: open a notebook on a GPU size and run a cell (the size,
GPU use and state show in the status bar); let a short demo policy warn (a notification with
the time left), click "Keep running" (the warning goes); hibernate from the GPUs panel (the
status says "hibernated"); run a cell (the status shows the resume's phase, waiting for a
free GPU slice while both GPUs are taken, and the restore report appears as a note).

GPU use comes from the NVML TEST DOUBLE (``FileNvmlDouble``): the test scripts what "the GPU"
shows for the kernel's process. The browser is Debian's ``chromium`` driven by Playwright
(PyPI), never a downloaded one. Without them the test skips, naming the install; with
``ELASTIC_REQUIRE_BROWSER=1`` (CI) it fails instead. ``ELASTIC_UI_SCREENSHOTS=<folder>``
writes the screenshots there (``docs/images`` for the README's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import INVENTORY, PROFILES, elastic_config
from tests.support.server import TOKEN, RunningServer, launch, wait_for

CHROMIUM = os.environ.get("ELASTIC_CHROMIUM", "/usr/bin/chromium")
REQUIRE_ENV = "ELASTIC_REQUIRE_BROWSER"
POLICY = {
    "idle_timeout": 14,
    "warn_before": 11,
    "interval": 1,
    # The whole-GPU kernels that fill the GPUs stay until the test shuts them down.
    "rules": [{"profiles": ["whole", "medium"], "idle_timeout": 3600, "warn_before": 60}],
}
#: The test sizes, and "medium", which the policy leaves alone (the commands test hibernates it itself).
LAB_PROFILES = {**PROFILES, "medium": {"gpu_fraction": 0.5, "memory_mib": 20480}}


def _require_browser() -> Any:
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("the playwright package (pip install -e '.[test]')")
        sync_playwright = None
    if not shutil.which(CHROMIUM):
        missing.append(f"{CHROMIUM} (apt-get install -y chromium)")
    if missing:
        why = "the JupyterLab browser test needs " + " and ".join(missing)
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but {why}", pytrace=False)
        pytest.skip(why)
    return sync_playwright


class GpuScript:
    """The NVML double's script: which process uses how much of which GPU."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.processes: dict[int, dict[str, Any]] = {}
        self.write()

    def write(self) -> None:
        script = {"devices": INVENTORY, "processes": list(self.processes.values())}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(script))
        tmp.replace(self.path)

    def set(self, pid: int, memory_mib: int, sm_percent: int) -> None:
        device = INVENTORY[0]["uuid"]
        self.processes[pid] = {
            "pid": pid,
            "device": device,
            "memory_mib": memory_mib,
            "sm_percent": sm_percent,
        }
        self.write()


NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "execution_count": None,
            "metadata": {},
            "outputs": [],
            "source": "import os, socket\nx = 41\nbig = bytearray(400 * 2**20)\n"
            "sock = socket.socket()\n"
            "class SlowToLoad:  # loads back in 6 s, as a large model's state would\n"
            "    def __reduce__(self):\n"
            "        import time\n"
            "        return (time.sleep, (6,))\n"
            "slow = SlowToLoad()\n"
            "os.getpid()",
        },
        {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "x + 1"},
    ],
    "metadata": {
        "kernelspec": {
            "name": "python3-gpu-small",
            "display_name": "Python 3 · GPU small",
            "language": "python",
        }
    },
    "nbformat": 4,
    "nbformat_minor": 5,
}


def _start_lab(home: Path) -> tuple[RunningServer, GpuScript]:
    """``jupyter lab`` with this checkout's extension, the test GPUs (NVML double) and sizes."""
    assert _require_browser() is not None
    gpu = GpuScript(home / "gpu.json")
    config = elastic_config(
        home / "checkpoints",
        nvml_class="kernelmgr.activity.nvml_double.FileNvmlDouble",
        gpu_sample_interval=0.5,
    )
    config["ElasticKernels"]["profiles"] = LAB_PROFILES
    config["CullPolicy"] = POLICY
    config["LabApp"] = {"check_for_updates_class": "jupyterlab.NeverCheckForUpdate"}
    proc, log_path, url, env = launch(
        home,
        config,
        env_extra={"ELASTIC_NVML_DOUBLE_FILE": str(gpu.path), **_this_checkouts_build(home)},
        app_module="jupyterlab",
    )
    server = RunningServer(url=url, process=proc, home=home, log_path=log_path, env=env)
    (home / "root" / "demo.ipynb").write_text(json.dumps(NOTEBOOK))
    _no_news_prompt(env)
    try:
        wait_for(lambda: _status(server) == 200, timeout=90, what="jupyter lab to answer")
    except BaseException:
        server.stop()
        raise
    return server, gpu


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, GpuScript]]:
    server, gpu = _start_lab(tmp_path_factory.mktemp("lab-ui"))
    try:
        yield server, gpu
    finally:
        server.shutdown_all_kernels()
        server.stop()


@contextmanager
def browser_page() -> Iterator[Any]:
    """A page in a fresh headless Chromium (the machine's own, driven by Playwright), closed after."""
    sync_playwright = _require_browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            # On a loaded machine JupyterLab's theme stylesheet can fail to load (its retries spent);
            # its dialog then covers the page. A user reloads, and so does the test, whenever it shows.
            theme_failed = page.locator(".jp-Dialog", has_text="Error Loading Theme")
            page.add_locator_handler(theme_failed, lambda: page.reload())
            yield page
        finally:
            browser.close()


def _this_checkouts_build(home: Path) -> dict[str, str]:
    """The browser loads this checkout's committed build (kernelmgr/labextension), not the copy an
    install made once: JupyterLab takes the first folder of an extension's name on its path, and
    ``JUPYTER_PATH`` comes first (a virtualenv's own share/ comes before the user's data dir)."""
    build = Path(__file__).resolve().parents[1] / "kernelmgr" / "labextension"
    path = home / "jupyter-path"
    target = path / "labextensions" / "jupyter-elastic-kernels"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(build, target_is_directory=True)
    return {"JUPYTER_PATH": str(path)}


def _no_news_prompt(env: dict[str, str]) -> None:
    """JupyterLab's own "get notified about news?" prompt would cover the screenshots."""
    labconfig = Path(env["JUPYTER_CONFIG_DIR"]) / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )


def _status(server: RunningServer) -> int | None:
    if server.process.poll() is not None:
        raise RuntimeError(f"jupyter lab exited:\n{server.log()}")
    try:
        return server.request("GET", "/api/status").status
    except OSError:
        return None


class Shots:
    """Screenshots into ``ELASTIC_UI_SCREENSHOTS`` (the README's come from docs/images)."""

    def __init__(self, page: Any, folder: Path) -> None:
        self.page = page
        self.folder = folder
        self.taken: list[str] = []

    def __call__(self, name: str) -> None:
        time.sleep(0.8)  # notifications slide in
        self.folder.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(self.folder / f"{name}.png"))
        self.taken.append(name)


def test_the_issue_scenario_in_a_real_browser(lab: tuple[RunningServer, GpuScript], tmp_path: Path) -> None:
    server, gpu = lab
    folder = Path(os.environ.get("ELASTIC_UI_SCREENSHOTS") or tmp_path / "screenshots")
    with browser_page() as page:
        shots = Shots(page, folder)
        _scenario(server, gpu, page, shots)


def _seconds_left(toast_text: str) -> int:
    found = re.search(r"hibernated in (\d+) s", toast_text)
    assert found, toast_text
    return int(found.group(1))


def _model(server: RunningServer, kernel_id: str) -> dict[str, Any]:
    return server.get(f"/api/elastic/kernels/{kernel_id}")  # type: ignore[no-any-return]


def _scenario(server: RunningServer, gpu: GpuScript, page: Any, shots: Shots) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/lab/tree/demo.ipynb?token={TOKEN}")
    status = page.locator(".jp-ElasticStatus")
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    expect(cells.first).to_be_visible(timeout=60_000)

    # 1. Run a cell: the size (and, with the GPU in use, its use) in the status bar.
    wait_for(lambda: server.get("/api/kernels"), timeout=60, what="the notebook's kernel")
    kernel_id = server.get("/api/kernels")[0]["id"]
    wait_for(lambda: _model(server, kernel_id)["execution_state"] == "idle", timeout=60, what="kernel ready")
    cells.first.click()
    page.keyboard.press("Shift+Enter")
    output = cells.first.locator(".jp-OutputArea-output")
    expect(output).to_have_text(re.compile(r"^\d+$"), timeout=60_000)
    pid = int(output.inner_text().strip())
    gpu.set(pid, memory_mib=2048, sm_percent=35)
    expect(status).to_have_text("GPU small · 35% · 2.0 GiB · idle", timeout=15_000)
    # One state in the status bar: JupyterLab's own "Python 3 · GPU small | Idle" is hidden.
    stock = page.locator(".jp-ElasticStatus-replaced")
    expect(stock).to_have_count(1, timeout=10_000)
    expect(stock).to_contain_text("Python 3 · GPU small")
    expect(stock).to_be_hidden()
    expect(page.locator(".jp-StatusBar-Item:visible", has_text=" | ")).to_have_count(0)
    badge = page.locator(".jp-NotebookPanel-toolbar .jp-ElasticToolbarState")
    expect(badge).to_be_hidden()  # running: the circle says it
    shots("jupyterlab-status-running")

    # 2. The GPU goes idle: the policy warns; the notification has the time left and "Keep running".
    gpu.set(pid, memory_mib=2048, sm_percent=0)
    toast = page.locator(".Toastify__toast", has_text="will be hibernated in")
    expect(toast).to_be_visible(timeout=20_000)
    expect(toast).to_contain_text("demo.ipynb: idle kernel (GPU small)")
    # One warning: the notification, not also a red block under a cell (saved with the notebook).
    expect(page.locator(".jp-Notebook .jp-OutputArea-output", has_text="will be hibernated")).to_have_count(0)
    assert _model(server, kernel_id)["activity"]["warning"] is not None
    # The time left counts down in the open notification (a local timer, no extra request).
    shown = _seconds_left(toast.inner_text())
    expect(toast).not_to_contain_text(f"hibernated in {shown} s", timeout=3_000)
    assert _seconds_left(toast.inner_text()) < shown
    shots("jupyterlab-idle-warning")
    toast.get_by_role("button", name="Keep running").click()
    expect(toast).to_have_count(0, timeout=5_000)  # the warning went away
    assert _model(server, kernel_id)["activity"]["warning"] is None  # cancelled by the click itself
    gpu.set(pid, memory_mib=2048, sm_percent=35)  # busy again: no new warning
    assert _model(server, kernel_id)["state"] == "running"
    wait_for(
        lambda: _model(server, kernel_id)["activity"]["gpu_utilization"] == 35,
        timeout=30,
        what="the GPU sampler to see it busy",
    )
    # A warning cancelled another way (a cell run from elsewhere) goes away too.
    gpu.set(pid, memory_mib=2048, sm_percent=0)
    expect(toast).to_be_visible(timeout=20_000)
    server.execute(kernel_id, "x")
    expect(toast).to_have_count(0, timeout=8_000)
    gpu.set(pid, memory_mib=2048, sm_percent=35)

    # 3. Hibernate from the GPUs panel; the status says so.
    tab = page.locator('.lm-TabBar-tab[data-id="jupyter-elastic-kernels-gpus"]')
    expect(tab.locator("svg")).to_have_count(1)  # an icon, not the vertical word "GPUs"
    # Also in the View menu (issue 44: only the 16-px icon led to it), and the command palette.
    page.get_by_role("menuitem", name="View", exact=True).click()
    page.get_by_role("menuitem", name="GPUs Panel").click()
    expect(page.locator(".jp-ElasticPanel")).to_be_visible(timeout=10_000)
    row = page.locator(f'.jp-ElasticPanel-kernel[data-kernel-id="{kernel_id}"]')
    # Named by its notebook (the sessions API), with its size and state.
    expect(row.locator(".jp-ElasticPanel-kernelName")).to_have_text("demo.ipynb", timeout=10_000)
    expect(row.locator(".jp-ElasticPanel-kernelInfo")).to_contain_text("small · idle")
    expect(page.locator(".jp-ElasticPanel")).to_contain_text("All GPUs (admin)", timeout=10_000)
    devices = page.locator(".jp-ElasticPanel-device")
    gpus = server.get("/api/elastic/gpus")["devices"]
    # Numbered, so that two GPUs of one model are told apart (issue 44).
    expect(devices.first).to_contain_text(f"GPU {gpus[0]['index']} · {gpus[0]['name']} · 25% allocated")
    assert gpus[0]["name"] == gpus[1]["name"] and gpus[0]["index"] != gpus[1]["index"]
    expect(devices.first.locator(".jp-ElasticPanel-sliceList")).to_have_text("small (demo.ipynb)")
    # The slice drawn as its part of the GPU: the API's fraction of the bar.
    segment = devices.first.locator('.jp-ElasticPanel-slice[data-profile="small"]')
    assert gpus[0]["slices"][0]["fraction"] == 0.25
    assert segment.evaluate("e => e.style.width") == "25%"
    # Live meters of the GPU's use and memory, the figures of /api/elastic/gpus (the NVML double
    # says 35% and 2 GiB of the kernel's process), with a history that grows at each poll.
    util = devices.first.locator('.jp-ElasticPanel-meter[data-kind="util"]')
    memory = devices.first.locator('.jp-ElasticPanel-meter[data-kind="memory"]')
    expect(util.locator(".jp-ElasticPanel-meterText")).to_have_text("GPU use 35%", timeout=10_000)
    expect(memory.locator(".jp-ElasticPanel-meterText")).to_have_text("Memory 2.0 GiB of 40.0 GiB")
    live = server.get("/api/elastic/gpus")["devices"][0]
    assert live["activity"] == {"gpu_utilization": 35.0, "memory_used_mib": 2048.0}
    assert float(util.get_attribute("data-fraction") or -1) == live["activity"]["gpu_utilization"] / 100
    assert float(memory.get_attribute("data-fraction") or -1) == 2048 / live["memory_mib"]
    expect(devices.nth(1).locator(".jp-ElasticPanel-meterText").first).to_have_text("GPU use: not measured")
    spark = util.locator(".jp-ElasticPanel-spark")
    expect(spark).to_have_attribute("data-samples", re.compile(r"^([3-9]|\d\d)$"), timeout=15_000)
    expect(spark.locator("path")).to_have_count(1)
    shots("jupyterlab-gpus-panel")
    row.get_by_role("button", name="Hibernate").click()
    expect(status).to_have_text("GPU small · hibernated", timeout=60_000)
    expect(badge).to_have_text("Hibernated", timeout=10_000)  # the toolbar says it too
    expect(row.get_by_role("button", name="Resume")).to_be_visible(timeout=10_000)
    expect(row.locator(".jp-ElasticPanel-kernelInfo")).to_contain_text(
        re.compile(r"checkpoint \d+(\.\d+)? MiB")
    )
    expect(page.locator(".jp-ElasticPanel-device").first).to_contain_text("0% allocated")
    expect(page.locator(".jp-ElasticPanel-sliceList").first).to_have_text("no slices")
    # The trend: a quarter GPU released at this moment, as /api/elastic/me says.
    assert server.get("/api/elastic/me")["gpus_released_now"] == 0.25
    expect(page.locator(".jp-ElasticPanel-releasedText")).to_contain_text(
        "0.25 GPU released now (+15 GPU-minutes per hour)", timeout=10_000
    )
    shots("jupyterlab-hibernated")

    # 4. Both GPUs taken: the next cell's resume waits for a slice, visibly; then restores and reports.
    holders = [server.start_kernel("python3-gpu-whole") for _ in range(2)]
    cells.nth(1).click()
    page.keyboard.press("Shift+Enter")
    # Its place in the queue for a slice too (issue 29): the only one waiting.
    expect(status).to_have_text(
        "GPU small · resuming: waiting for a free GPU slice (1 of 1 in the queue)", timeout=15_000
    )
    expect(badge).to_have_text("Resuming: waiting for a GPU…")
    # In the cell: one note, updated in place with the place in the queue (not a block per GPU).
    note = cells.nth(1).locator(".jp-OutputArea-output", has_text="Waiting for a GPU slice")
    expect(note).to_contain_text("number 1 of 1 in the queue", timeout=10_000)
    expect(note).to_have_count(1)
    # The panel offers to stop waiting (issue 44: the only way was an interrupt).
    expect(row.get_by_role("button", name="Cancel")).to_be_enabled(timeout=10_000)
    # The admin view follows: both GPUs wholly held by the two whole-GPU kernels.
    for index in (0, 1):
        expect(page.locator(".jp-ElasticPanel-device").nth(index)).to_contain_text("100% allocated")
        expect(page.locator(".jp-ElasticPanel-sliceList").nth(index)).to_contain_text("whole (")
    shots("jupyterlab-resume-waiting")
    server.shutdown_kernel(holders[0])
    # Reading the 400 MiB back takes under a second here, less than one poll; loading the
    # variables (``slow`` takes 6 s: six polls, room for a loaded machine) follows the read, and
    # the status shows how much was read.
    # The phase's figures while the read is under way: tests/test_lab_api.py.
    expect(status).to_have_text(
        re.compile(r"^GPU small · resuming: restoring 40\d of 40\d MiB$"), timeout=30_000
    )
    # ... and so does the cell that woke the kernel, in one line updated in place.
    expect(cells.nth(1).locator(".jp-OutputArea-output", has_text="Resuming the kernel: ")).to_have_count(1)
    expect(cells.nth(1)).not_to_contain_text("Waiting for a GPU slice")  # the same display, updated
    shots("jupyterlab-resume-restoring")
    report = page.locator(".Toastify__toast", has_text="Kernel resumed")
    expect(report).to_be_visible(timeout=90_000)
    expect(report).to_contain_text("variable(s) restored; not restored: sock.")
    # The report is the notification's: not also an output of the cell, saved with the notebook.
    expect(cells.nth(1)).not_to_contain_text("Kernel resumed")
    # Something was lost: a warning that stays until read (a full restore closes by itself).
    expect(report).to_have_class(re.compile(r"\bToastify__toast--warning\b"))
    shots("jupyterlab-restore-report")
    # The full report, readable: what was not restored and why.
    report.get_by_role("button", name="Details").click()
    dialog = page.locator(".jp-Dialog")
    expect(dialog).to_contain_text("Not restored: sock: socket: TypeError: cannot pickle 'socket' object")
    expect(dialog).to_contain_text("not recomputed:")
    shots("jupyterlab-restore-report-details")
    dialog.get_by_role("button", name="Close").click()
    released = page.locator(".jp-ElasticPanel-released")
    # A quarter GPU, hibernated for as long as this (possibly loaded) machine took: more than 0,
    # in words (not "0.0000"), the same figure as /api/elastic/me; with what is released now
    # (nothing, or the quarter again if the demo policy has hibernated the idle kernel since), the
    # trend drawn beside it.
    expect(released.locator(".jp-ElasticPanel-releasedText")).to_have_text(
        re.compile(
            r"^GPU time released by hibernation: (under 1 GPU-minute|\d+ GPU-minutes?) · "
            r"(none released now|0\.25 GPU released now \(\+15 GPU-minutes per hour\))$"
        ),
        timeout=10_000,
    )
    assert float(released.get_attribute("data-hours") or 0) > 0
    expect(released.locator(".jp-ElasticPanel-spark path")).to_have_count(1)
    expect(cells.nth(1).locator('.jp-OutputArea-output[data-mime-type="text/plain"]')).to_have_text(
        "42", timeout=30_000
    )
    # The waiting note and the progress are gone from the cell (and from the saved notebook).
    expect(cells.nth(1)).not_to_contain_text("Waiting for a GPU slice")
    expect(cells.nth(1)).not_to_contain_text("Resuming the kernel")
    # A new process (not in the GPU script: 0% of the GPU), running.
    expect(status).to_have_text("GPU small · 0% · 0 MiB · idle", timeout=10_000)
    expect(badge).to_be_hidden()
    shots("jupyterlab-resumed")

    # 5. No room for a new notebook's size: the dialog shows the server's whole 409 message,
    # what to do first and the per-GPU figures after, wrapped rather than cut off.
    server.shutdown_kernel(kernel_id)  # its idle warnings would show up in the next test's page
    holders.append(server.start_kernel("python3-gpu-whole"))  # both GPUs wholly held again
    (server.home / "root" / "full.ipynb").write_text(json.dumps({**NOTEBOOK, "cells": NOTEBOOK["cells"][1:]}))
    page.goto(f"{server.url}/lab/tree/full.ipynb?reset&token={TOKEN}")
    dialog = page.locator(".jp-Dialog", has_text="Error Starting Kernel")
    expect(dialog).to_be_visible(timeout=60_000)
    message = dialog.locator(".jp-Dialog-body pre").first
    expect(message).to_contain_text("does not fit right now. Pick a smaller size")
    expect(message).to_contain_text("GPU-test-0001: 0% free")
    text = message.inner_text()
    assert text.index("Pick a smaller size") < text.index("Free: ") and text.rstrip().endswith("free."), text
    assert message.evaluate("e => e.scrollWidth <= e.clientWidth"), "the message is cut off"
    shots("jupyterlab-error-starting-kernel")
    dialog.get_by_role("button", name="Ok").click()
    for holder in holders[1:]:
        server.shutdown_kernel(holder)


def _kernel_of(server: RunningServer, path: str) -> str | None:
    for session in server.get("/api/sessions"):
        if session["path"] == path and session.get("kernel"):
            return str(session["kernel"]["id"])
    return None


def _open(page: Any, server: RunningServer, path: str) -> Any:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/lab/tree/{path}?reset&token={TOKEN}")  # only this notebook open
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    expect(cells.first).to_be_visible(timeout=60_000)
    kernel_id = wait_for(lambda: _kernel_of(server, path), timeout=60, what="the notebook's kernel")
    wait_for(
        lambda: server.get(f"/api/kernels/{kernel_id}")["execution_state"] == "idle",
        timeout=60,
        what="the kernel to be ready",
    )
    cells.first.click()
    page.keyboard.press("Shift+Enter")
    expect(cells.first.locator(".jp-OutputArea-output")).to_have_text("2", timeout=60_000)
    return cells


CPU_NOTEBOOK = {
    **NOTEBOOK,
    "cells": [
        {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "1 + 1"}
    ],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
}


#: 1 + 1, then a variable and a cell that reads it, on the medium size (which the test policy
#: leaves alone: only the test hibernates or resizes it).
KEPT_NOTEBOOK = {
    **CPU_NOTEBOOK,
    "cells": [
        *CPU_NOTEBOOK["cells"],
        {**CPU_NOTEBOOK["cells"][0], "source": "kept = 7"},
        {**CPU_NOTEBOOK["cells"][0], "source": "kept * 6"},
    ],
    "metadata": {"kernelspec": {"name": "python3-gpu-medium", "display_name": "Python 3 · GPU medium"}},
}


def test_a_kernel_without_a_gpu_size_shows_nothing(
    lab: tuple[RunningServer, GpuScript], tmp_path: Path
) -> None:
    server, _gpu = lab
    (server.home / "root" / "cpu.ipynb").write_text(json.dumps(CPU_NOTEBOOK))
    with browser_page() as page:
        try:
            _open(page, server, "cpu.ipynb")
            kernel_id = _kernel_of(server, "cpu.ipynb")
            assert server.get(f"/api/elastic/kernels/{kernel_id}")["profile"] is None
            # The extension runs (its panel is there) and has polled since the kernel started ...
            tab = page.locator('.lm-TabBar-tab[data-id="jupyter-elastic-kernels-gpus"]')
            from playwright.sync_api import expect

            expect(tab).to_have_count(1, timeout=10_000)
            time.sleep(4)
            # ... and shows no status for a kernel without a GPU size.
            expect(page.locator(".jp-ElasticStatus")).to_be_hidden()
            expect(page.locator(".Toastify__toast")).to_have_count(0)
        finally:
            server.shutdown_all_kernels()


def short_label(display_name: str) -> str:
    """The card's label: the display name without its memory in parentheses (the icon shows it)."""
    return re.sub(r"\s*\([^)]*\)\s*$", "", display_name) or display_name


def test_launcher_cards_are_ordered_by_size_with_icons_and_short_labels(
    lab: tuple[RunningServer, GpuScript], tmp_path: Path
) -> None:
    """The Notebook cards: no size first, then small, whole (by GPU share, not by name), each
    size with its own icon, the label without the memory (the icon shows it), on two lines."""
    from playwright.sync_api import expect

    server, _gpu = lab
    specs = server.get("/api/kernelspecs")["kernelspecs"]
    by_share = sorted(
        server.get("/api/elastic/profiles")["profiles"],
        key=lambda p: (p["gpu_fraction"], p["memory_mib"] or 0),
    )
    expected = [specs["python3"]["spec"]["display_name"]] + [
        specs[p["kernelspecs"][0]]["spec"]["display_name"] for p in by_share
    ]
    folder = Path(os.environ.get("ELASTIC_UI_SCREENSHOTS") or tmp_path / "screenshots")
    with browser_page() as page:
        page.goto(f"{server.url}/lab?reset&token={TOKEN}")  # nothing open: the launcher
        cards = page.locator(
            '.jp-Launcher-section[data-category="Notebook"] .jp-LauncherCard, '
            '.jp-LauncherCard[data-category="Notebook"]'
        )
        expect(cards.first).to_be_visible(timeout=60_000)
        expect(page.locator("#jupyter-elastic-kernels-launcher")).to_have_count(1, timeout=20_000)
        seen = cards.evaluate_all(
            "cards => cards.map(c => [c.title, c.getBoundingClientRect().top,"
            " c.getBoundingClientRect().left, getComputedStyle(c.querySelector('img')).content,"
            " getComputedStyle(c.querySelector('.jp-LauncherCard-label p'), '::after').content])"
        )
        in_order = [title for title, *_ in sorted(seen, key=lambda c: (round(c[1]), c[2]))]
        assert in_order == expected, seen
        icons = {title: icon for title, _t, _l, icon, _label in seen}
        assert icons[expected[0]] in ("normal", "none")  # the kernel's own logo
        sized_icons = [icons[title] for title in expected[1:]]
        assert all(i.startswith('url("data:image/svg+xml') for i in sized_icons), sized_icons
        assert len(set(sized_icons)) == len(sized_icons)  # one icon per size
        labels = {title: label for title, *_rest, label in seen}
        assert labels["Python 3 · GPU small (10 GiB)"] == '"Python 3 · GPU small"'
        time.sleep(0.8)
        folder.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(folder / "jupyterlab-launcher.png"))

        # Both GPUs taken: the whole card says a new kernel of it would not start now (issue 44:
        # the launcher looked the same when nothing fit); here starts are not queued
        # (ElasticKernels.start_queue_wait = 0), so it does not say it would wait.
        assert server.get("/api/elastic/profiles")["start_queue_wait"] == 0
        taken = [server.start_kernel("python3-gpu-whole") for _ in INVENTORY]
        try:
            title = specs["python3-gpu-whole"]["spec"]["display_name"]
            whole = page.locator(f'.jp-LauncherCard[title="{title}"] .jp-LauncherCard-label p').first

            def label_of_whole() -> str:
                return str(whole.evaluate("p => getComputedStyle(p, '::after').content"))

            wait_for(lambda: "all taken" in label_of_whole(), 30, what="the whole card to say so")
            label = label_of_whole()
            assert label == f'"{short_label(title)}\\a all taken now"', label

            # JupyterLab's kernel picker, which it opens after a refused start (issue 44: with the
            # refused size preselected, a loop): the sizes that would not start say so, and the
            # largest size of the same kernel that fits now is preselected.
            server.shutdown_kernel(taken.pop())
            taken.append(server.start_kernel("python3-gpu-medium"))  # the whole size still fits nowhere
            full = {
                **CPU_NOTEBOOK,
                "metadata": {"kernelspec": {"name": "python3-gpu-whole", "display_name": title}},
            }
            (server.home / "root" / "full.ipynb").write_text(json.dumps(full))
            page.goto(f"{server.url}/lab/tree/full.ipynb?reset&token={TOKEN}")
            error = page.locator(".jp-Dialog", has_text="Error Starting Kernel")
            expect(error).to_contain_text("does not fit right now", timeout=60_000)
            error.get_by_role("button", name="Ok").click()
            select = page.locator(".jp-Dialog", has_text="Select Kernel").locator("select")
            expect(select.locator("option", has_text=f"{title} — all taken now")).to_have_count(
                1, timeout=15_000
            )
            medium = specs["python3-gpu-medium"]["spec"]["display_name"]
            expect(select.locator("option:checked")).to_have_text(medium)
            huge = [p for p in server.get("/api/elastic/profiles")["profiles"] if not p["fits_ever"]]
            for profile in huge:
                never = specs[profile["kernelspecs"][0]]["spec"]["display_name"]
                expect(select.locator("option", has_text=f"{never} — never fits these GPUs")).to_have_count(1)
            page.screenshot(path=str(folder / "jupyterlab-kernel-picker.png"))
            page.keyboard.press("Escape")
        finally:
            for kernel_id in taken:
                server.shutdown_kernel(kernel_id)
        page.goto(f"{server.url}/lab?reset&token={TOKEN}")
        wait_for(lambda: "all taken" not in label_of_whole(), 60, what="the whole card to fit again")


def test_kernel_menu_and_palette_hibernate_resume_and_show_the_report(
    lab: tuple[RunningServer, GpuScript], tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    server, _gpu = lab
    notebook = {
        **CPU_NOTEBOOK,
        "cells": [*CPU_NOTEBOOK["cells"], {**CPU_NOTEBOOK["cells"][0], "source": "kept = 7"}],
        "metadata": {"kernelspec": {"name": "python3-gpu-medium", "display_name": "Python 3 · GPU medium"}},
    }
    (server.home / "root" / "commands.ipynb").write_text(json.dumps(notebook))
    folder = Path(os.environ.get("ELASTIC_UI_SCREENSHOTS") or tmp_path / "screenshots")
    with browser_page() as page:
        try:
            shots = Shots(page, folder)
            cells = _open(page, server, "commands.ipynb")
            kernel_id = _kernel_of(server, "commands.ipynb")
            assert kernel_id is not None
            cells.nth(1).click()
            page.keyboard.press("Shift+Enter")
            status = page.locator(".jp-ElasticStatus")
            expect(status).to_contain_text("GPU medium", timeout=15_000)
            kernel_name = page.locator(".jp-NotebookPanel-toolbar .jp-KernelName")
            expect(kernel_name).to_contain_text("GPU medium")

            # The Kernel menu: resume and the report are there; only hibernate applies to a running kernel.
            page.get_by_role("menuitem", name="Kernel", exact=True).click()
            hibernate = page.get_by_role("menuitem", name=re.compile("^Hibernate Kernel"))
            expect(hibernate).to_be_enabled()
            expect(page.get_by_role("menuitem", name="Resume Kernel")).to_be_disabled()
            shots("jupyterlab-kernel-menu")
            hibernate.click()
            expect(status).to_have_text("GPU medium · hibernated", timeout=60_000)
            assert _model(server, kernel_id)["state"] == "hibernated"

            # The command palette: resume it.
            page.keyboard.press("Control+Shift+c")
            page.keyboard.type("Resume Kernel")
            page.keyboard.press("Enter")
            expect(status).to_have_text(re.compile(r"^GPU medium · .*idle$"), timeout=60_000)
            assert _model(server, kernel_id)["state"] == "running"

            # The report, from the menu: the variables by name.
            page.get_by_role("menuitem", name="Kernel", exact=True).click()
            page.get_by_role("menuitem", name="Show Restore Report").click()
            dialog = page.locator(".jp-Dialog", has_text="Restore report")
            expect(dialog).to_contain_text("Kernel resumed: 1 variable(s) restored.", timeout=10_000)
            expect(dialog).to_contain_text("Restored: kept.")
            shots("jupyterlab-restore-report-command")
            dialog.get_by_role("button", name="Close").click()
        finally:
            server.shutdown_all_kernels()


def test_a_resume_that_lost_the_variables_does_not_run_the_cell_until_asked_again(
    lab: tuple[RunningServer, GpuScript],
) -> None:
    """Issue 44: a kernel whose checkpoint could not be loaded resumed empty and ran the cell at
    once (a NameError), under the same blue notification as a good resume."""
    from playwright.sync_api import expect

    server, _gpu = lab
    (server.home / "root" / "lost.ipynb").write_text(json.dumps(KEPT_NOTEBOOK))
    with browser_page() as page:
        try:
            cells = _open(page, server, "lost.ipynb")
            kernel_id = _kernel_of(server, "lost.ipynb")
            assert kernel_id is not None
            cells.nth(1).click()
            page.keyboard.press("Shift+Enter")  # kept = 7
            status = page.locator(".jp-ElasticStatus")
            expect(status).to_contain_text("GPU medium", timeout=15_000)
            assert server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate").status == 200
            expect(status).to_have_text("GPU medium · hibernated", timeout=60_000)
            # The checkpoint's data damaged while it slept: the restore refuses all of it.
            [data] = (server.home / "checkpoints").rglob(f"{kernel_id}/ckpt-*/data.bin")
            damaged = bytearray(data.read_bytes())
            damaged[-1] ^= 1
            data.write_bytes(damaged)

            cells.nth(2).click()
            page.keyboard.press("Shift+Enter")  # kept * 6: wakes the kernel
            output = cells.nth(2).locator(".jp-OutputArea-output")
            expect(output).to_contain_text(
                "RestoreIncomplete: Your variables could not be restored", timeout=90_000
            )
            expect(output).not_to_contain_text("NameError")  # the cell did not run
            toast = page.locator(".Toastify__toast", has_text="Kernel resumed, empty")
            expect(toast).to_be_visible(timeout=15_000)
            expect(toast).to_have_class(re.compile(r"\bToastify__toast--error\b"))
            # The panel does not show the refused checkpoint as the kernel's (it is kept aside).
            page.locator('.lm-TabBar-tab[data-id="jupyter-elastic-kernels-gpus"]').click()
            info = page.locator(
                f'.jp-ElasticPanel-kernel[data-kernel-id="{kernel_id}"] .jp-ElasticPanel-kernelInfo'
            )
            expect(info).to_contain_text("medium · ", timeout=10_000)
            expect(info).not_to_contain_text("checkpoint", timeout=10_000)
            # Run again: the user's word; it runs on the kernel as it is.
            cells.nth(2).click()
            page.keyboard.press("Shift+Enter")
            expect(output).to_contain_text("NameError: name 'kept' is not defined", timeout=30_000)
        finally:
            server.shutdown_all_kernels()


@pytest.fixture
def lab_without_server_part(tmp_path: Path) -> Iterator[RunningServer]:
    _require_browser()
    home = tmp_path / "plain-lab"
    config = {
        "ServerApp": {"jpserver_extensions": {"kernelmgr": False}},
        "LabApp": {"check_for_updates_class": "jupyterlab.NeverCheckForUpdate"},
    }
    proc, log_path, url, env = launch(home, config, app_module="jupyterlab")
    server = RunningServer(url=url, process=proc, home=home, log_path=log_path, env=env)
    (home / "root" / "cpu.ipynb").write_text(json.dumps(CPU_NOTEBOOK))
    _no_news_prompt(env)
    try:
        wait_for(lambda: _status(server) == 200, timeout=90, what="jupyter lab to answer")
        yield server
    finally:
        server.shutdown_all_kernels()
        server.stop()


def test_a_server_without_the_server_part_shows_nothing(lab_without_server_part: RunningServer) -> None:
    from playwright.sync_api import expect

    server = lab_without_server_part
    assert server.request("GET", "/api/elastic/kernels").status == 404
    with browser_page() as page:
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        _open(page, server, "cpu.ipynb")
        # The extension is loaded (its status item exists, empty and hidden), asked once, got 404.
        expect(page.locator(".jp-ElasticStatus")).to_have_count(1, timeout=10_000)
        time.sleep(4)
        expect(page.locator(".jp-ElasticStatus")).to_be_hidden()
        expect(page.locator('.lm-TabBar-tab[data-id="jupyter-elastic-kernels-gpus"]')).to_have_count(0)
        expect(page.locator(".Toastify__toast")).to_have_count(0)
        assert not [e for e in errors if "elastic" in e.lower()], errors


def test_change_size_from_the_panel_and_the_running_kernels_context_menu(
    lab: tuple[RunningServer, GpuScript], tmp_path: Path
) -> None:
    """Change GPU size (hibernate, resume at the size picked; variables kept) from the GPUs panel;
    hibernate and resume from the running-kernels panel's context menu; a status-bar setting."""
    from playwright.sync_api import expect

    server, _gpu = lab
    (server.home / "root" / "resize.ipynb").write_text(json.dumps(KEPT_NOTEBOOK))
    folder = Path(os.environ.get("ELASTIC_UI_SCREENSHOTS") or tmp_path / "screenshots")
    with browser_page() as page:
        try:
            shots = Shots(page, folder)
            cells = _open(page, server, "resize.ipynb")
            kernel_id = _kernel_of(server, "resize.ipynb")
            assert kernel_id is not None
            cells.nth(1).click()
            page.keyboard.press("Shift+Enter")
            status = page.locator(".jp-ElasticStatus")
            expect(status).to_contain_text("GPU medium", timeout=15_000)
            kernel_name = page.locator(".jp-NotebookPanel-toolbar .jp-KernelName")
            expect(kernel_name).to_contain_text("GPU medium")

            # 0. The status item opens "Change GPU size" (issue 44: it opened JupyterLab's kernel
            # picker, whose choice starts a new kernel and drops the variables without a warning).
            status.click()
            dialog = page.locator(".jp-Dialog", has_text="Change GPU size")
            expect(dialog.locator("select")).to_be_visible(timeout=10_000)
            expect(page.locator(".jp-Dialog", has_text="Select Kernel")).to_have_count(0)
            dialog.get_by_role("button", name="Cancel").click()
            expect(dialog).to_have_count(0)

            # 1. The GPUs panel's "Size…": the sizes that fit these GPUs, smallest first.
            page.locator('.lm-TabBar-tab[data-id="jupyter-elastic-kernels-gpus"]').click()
            row = page.locator(f'.jp-ElasticPanel-kernel[data-kernel-id="{kernel_id}"]')
            row.get_by_role("button", name="Size…").click()
            dialog = page.locator(".jp-Dialog", has_text="Change GPU size")
            select = dialog.locator("select")
            expect(select).to_be_visible(timeout=10_000)
            options = select.locator("option").all_inner_texts()
            assert options == ["small (25% of a GPU, 10.0 GiB)", "whole (1 GPU)"], options  # never 'huge'
            select.select_option(label="whole (1 GPU)")
            shots("jupyterlab-change-size")
            dialog.get_by_role("button", name="Change size").click()
            expect(status).to_have_text(re.compile(r"^GPU whole · .*idle$"), timeout=90_000)
            # One size on screen: the toolbar's kernel name follows (issue 44: it kept the old
            # size's until a reload), and the notification says the new size.
            expect(kernel_name).to_contain_text("GPU whole", timeout=15_000)
            expect(page.locator(".Toastify__toast", has_text="Kernel resized to GPU whole")).to_have_count(
                1, timeout=15_000
            )
            model = _model(server, kernel_id)
            assert (model["profile"], model["state"], model["name"]) == (
                "whole",
                "running",
                "python3-gpu-whole",
            )
            assert [d["fraction"] for d in model["slice"]["devices"]] == [1.0]
            cells.nth(2).click()
            page.keyboard.press("Shift+Enter")
            result = cells.nth(2).locator('.jp-OutputArea-output[data-mime-type="text/plain"]')
            expect(result).to_have_text("42", timeout=30_000)  # the variable came back
            expect(row.locator(".jp-ElasticPanel-kernelInfo")).to_contain_text("whole · ", timeout=10_000)

            # 2. The running-kernels panel's context menu: hibernate, then resume.
            page.locator('.lm-TabBar-tab[data-id="jp-running-sessions"]').click()
            item = page.locator(f'.jp-RunningSessions-item.jp-mod-kernel[data-context="{kernel_id}"]')
            expect(item).to_have_count(1, timeout=10_000)
            item.click(button="right")
            menu = page.locator(".lm-Menu")
            hibernate = menu.get_by_role("menuitem", name=re.compile("^Hibernate Kernel"))
            expect(hibernate).to_be_enabled(timeout=5_000)
            expect(menu.get_by_role("menuitem", name="Resume Kernel")).to_be_disabled()
            expect(menu.get_by_role("menuitem", name="Change GPU Size…")).to_be_enabled()
            shots("jupyterlab-running-kernels-menu")
            hibernate.click()
            expect(status).to_have_text("GPU whole · hibernated", timeout=60_000)
            assert _model(server, kernel_id)["state"] == "hibernated"
            item.click(button="right")
            menu.get_by_role("menuitem", name="Resume Kernel").click()
            expect(status).to_have_text(re.compile(r"^GPU whole · .*idle$"), timeout=60_000)
            assert _model(server, kernel_id)["state"] == "running"

            # 3. The settings for the status item (Settings Editor or the settings API): no size,
            # no GPU use; the state stays.
            settings = server.request(
                "PUT",
                "/lab/api/settings/jupyter-elastic-kernels:plugin",
                {"raw": json.dumps({"statusShowsSize": False, "statusShowsGpuUse": False})},
            )
            assert settings.status == 204, settings.body
            page.reload()
            expect(page.locator(".jp-ElasticStatus")).to_have_text(
                re.compile(r"^idle( for \d+ min)?$"), timeout=60_000
            )
        finally:
            server.request("PUT", "/lab/api/settings/jupyter-elastic-kernels:plugin", {"raw": "{}"})
            server.shutdown_all_kernels()


def test_reloading_the_page_never_wakes_hibernated_kernels(lab: tuple[RunningServer, GpuScript]) -> None:
    """Issue 44: a page reload resumed every hibernated kernel whose notebook was open (JupyterLab's
    debugger asks ``debugInfo`` of each ipykernel it connects to). Two notebooks open, hibernated,
    the page reloaded twice: both stay hibernated, and the next cell still resumes its kernel."""
    from playwright.sync_api import expect

    server, _gpu = lab
    paths = ["asleep-1.ipynb", "asleep-2.ipynb"]
    for path in paths:
        (server.home / "root" / path).write_text(json.dumps(KEPT_NOTEBOOK))
    with browser_page() as page:
        try:
            _open(page, server, paths[0])
            page.goto(f"{server.url}/lab/tree/{paths[1]}?token={TOKEN}")  # a second tab, both open
            kernels = [wait_for(lambda p=p: _kernel_of(server, p), 60, what=f"{p}'s kernel") for p in paths]
            cells = page.locator(".jp-NotebookPanel:visible .jp-CodeCell")
            for kernel_id in kernels:
                wait_for(lambda k=kernel_id: _model(server, k)["state"] == "running", 60, what="running")
            cells.nth(1).click()
            page.keyboard.press("Shift+Enter")
            wait_for(lambda: server.get(f"/api/kernels/{kernels[1]}")["execution_state"] == "idle", 60)
            for kernel_id in kernels:
                reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate", timeout=120)
                assert reply.status == 200 and reply.body["state"] == "hibernated", reply
            for reload in range(2):
                answered = server.log().count("answered debugInfo without waking")
                page.reload()
                expect(page.locator(".jp-ElasticStatus")).to_contain_text("hibernated", timeout=60_000)
                # The shown notebook's debugger has asked, and been answered (a notebook in a tab
                # behind it connects when JupyterLab gets to it, sometimes later).
                wait_for(
                    lambda n=answered: server.log().count("answered debugInfo without waking") > n,
                    60,
                    what=f"the notebook to connect after reload {reload + 1}",
                )
                states = [_model(server, k)["state"] for k in kernels]
                assert states == ["hibernated", "hibernated"], states
            woken = [line for line in server.log().splitlines() if "woken by" in line or " resumed " in line]
            assert not [line for line in woken if any(k in line for k in kernels)], woken
            # A user's cell still wakes its kernel, with its variables.
            cells = page.locator(".jp-NotebookPanel:visible .jp-CodeCell")
            cells.nth(2).click()
            page.keyboard.press("Shift+Enter")
            result = cells.nth(2).locator('.jp-OutputArea-output[data-mime-type="text/plain"]')
            expect(result).to_have_text("42", timeout=90_000)
            assert _model(server, kernels[1])["state"] == "running"
            assert _model(server, kernels[0])["state"] == "hibernated"
        finally:
            server.shutdown_all_kernels()


def test_a_stopped_server_shows_as_unreachable_with_its_actions_off(tmp_path: Path) -> None:
    """Issue 44: with the server stopped, the status item and the panel kept the last state as if
    it were now, with Resume and Hibernate enabled. Now both say "server unreachable"."""
    from playwright.sync_api import expect

    (tmp_path / "home").mkdir()
    server, _gpu = _start_lab(tmp_path / "home")
    notebook = {**CPU_NOTEBOOK, "metadata": {"kernelspec": {"name": "python3-gpu-medium"}}}
    (server.home / "root" / "away.ipynb").write_text(json.dumps(notebook))
    stopped = False
    with browser_page() as page:
        try:
            _open(page, server, "away.ipynb")
            status = page.locator(".jp-ElasticStatus")
            expect(status).to_contain_text("GPU medium", timeout=15_000)
            page.locator('.lm-TabBar-tab[data-id="jupyter-elastic-kernels-gpus"]').click()
            action = page.locator(".jp-ElasticPanel-kernel .jp-ElasticPanel-action").first
            expect(action).to_be_enabled(timeout=10_000)
            server.stop()  # hibernates the kernel and exits: nothing answers now
            stopped = True
            expect(status).to_have_text("server unreachable", timeout=30_000)
            expect(page.locator(".jp-ElasticPanel-unreachable")).to_contain_text("Server unreachable")
            buttons = page.locator(".jp-ElasticPanel-kernel button")
            assert buttons.count() >= 1
            for index in range(buttons.count()):
                expect(buttons.nth(index)).to_be_disabled()
        finally:
            if not stopped:
                server.shutdown_all_kernels()
                server.stop()


def _open_sized(page: Any, server: RunningServer, path: str, kernelspec: str) -> str:
    """A new notebook ``path`` on ``kernelspec``, opened in the page; its kernel's id."""
    notebook = {**CPU_NOTEBOOK, "metadata": {"kernelspec": {"name": kernelspec}}}
    (server.home / "root" / path).write_text(json.dumps(notebook))
    _open(page, server, path)
    kernel_id = _kernel_of(server, path)
    assert kernel_id is not None
    return kernel_id


def test_the_panel_cancels_a_resume_waiting_for_a_slice(lab: tuple[RunningServer, GpuScript]) -> None:
    """Both GPUs taken, a resume waits in the queue; the GPUs panel's Cancel ends the wait: the kernel
    stays hibernated with its checkpoint, and takes no slice when one frees up later."""
    from playwright.sync_api import expect

    server, _gpu = lab
    with browser_page() as page:
        try:
            kernel_id = _open_sized(page, server, "queued.ipynb", "python3-gpu-medium")
            reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate", timeout=120)
            assert reply.status == 200, reply
            holders = [server.start_kernel("python3-gpu-whole") for _ in INVENTORY]
            with ThreadPoolExecutor(1) as background:
                waiting = background.submit(
                    server.request, "POST", f"/api/elastic/kernels/{kernel_id}/resume", None, TOKEN, 120
                )
                page.locator('.lm-TabBar-tab[data-id="jupyter-elastic-kernels-gpus"]').click()
                row = page.locator(f'.jp-ElasticPanel-kernel[data-kernel-id="{kernel_id}"]')
                cancel = row.get_by_role("button", name="Cancel")
                expect(cancel).to_be_enabled(timeout=30_000)
                # A notification says so too, with the place in the queue and its own Cancel.
                toast = page.locator(".Toastify__toast", has_text="waiting for a free GPU slice (medium)")
                expect(toast).to_contain_text("queued.ipynb: ", timeout=15_000)
                expect(toast).to_contain_text("1 of 1 in the queue")
                expect(toast.get_by_role("button", name="Cancel")).to_be_visible()
                cancel.click()
                answer = waiting.result(timeout=60)
            assert answer.status >= 400 and answer.body["message"], answer  # said, never a 5xx crash
            assert answer.status < 500, answer
            expect(row.get_by_role("button", name="Resume")).to_be_visible(timeout=15_000)
            expect(toast).to_have_count(0, timeout=15_000)  # the wait is over: its notification goes
            # The notification's Cancel does the same.
            with ThreadPoolExecutor(1) as background:
                waiting = background.submit(
                    server.request, "POST", f"/api/elastic/kernels/{kernel_id}/resume", None, TOKEN, 120
                )
                expect(toast.get_by_role("button", name="Cancel")).to_be_visible(timeout=30_000)
                toast.get_by_role("button", name="Cancel").click()
                answer = waiting.result(timeout=60)
            assert 400 <= answer.status < 500 and answer.body["message"], answer
            expect(row.get_by_role("button", name="Resume")).to_be_visible(timeout=15_000)
            server.shutdown_kernel(holders.pop())  # a GPU frees up: the cancelled resume takes none of it
            server.start_kernel("python3-gpu-whole")  # ... so a whole-GPU kernel still fits there
            model = _model(server, kernel_id)
            assert (model["state"], model["slice"]) == ("hibernated", None), model
        finally:
            server.shutdown_all_kernels()


def test_a_policy_hibernation_says_so(lab: tuple[RunningServer, GpuScript]) -> None:
    """Issue 44: the idle policy hibernated a kernel without a word in JupyterLab (the warning went,
    nothing said what happened or how to come back)."""
    from playwright.sync_api import expect

    server, _gpu = lab
    with browser_page() as page:
        try:
            kernel_id = _open_sized(page, server, "culled.ipynb", "python3-gpu-small")
            # The test policy: a small kernel idle for 14 s is warned, then hibernated.
            told = page.locator(".Toastify__toast", has_text="was idle, so it was hibernated")
            expect(told).to_be_visible(timeout=90_000)
            expect(told).to_contain_text("culled.ipynb")
            expect(told).to_contain_text("Run a cell to bring it back.")
            model = _model(server, kernel_id)
            assert (model["state"], model["state_reason"]) == ("hibernated", "policy"), model
            expect(page.locator(".Toastify__toast", has_text="will be hibernated in")).to_have_count(0)
        finally:
            server.shutdown_all_kernels()


def test_the_panel_discards_a_hibernated_kernel_only_when_confirmed(
    lab: tuple[RunningServer, GpuScript],
) -> None:
    """Issue 48: the panel shows the checkpoint space the user's kernels take, and frees it: a
    hibernated kernel's Discard… asks first (Keep keeps it), then shuts it down and deletes its
    checkpoint."""
    from playwright.sync_api import expect

    server, _gpu = lab
    with browser_page() as page:
        try:
            kernel_id = _open_sized(page, server, "discarded.ipynb", "python3-gpu-small")
            server.execute(kernel_id, "blob = bytearray(3 * 2**20)")
            reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate", timeout=120)
            assert reply.status == 200, reply
            folders = list((server.home / "checkpoints").glob(f"*/{kernel_id}"))
            assert folders, "the checkpoint is on disk"
            page.locator('.lm-TabBar-tab[data-id="jupyter-elastic-kernels-gpus"]').click()
            expect(page.locator(".jp-ElasticPanel-storage")).to_contain_text("Checkpoints: 3", timeout=15_000)
            row = page.locator(f'.jp-ElasticPanel-kernel[data-kernel-id="{kernel_id}"]')
            discard = row.get_by_role("button", name="Discard…")
            expect(discard).to_be_enabled(timeout=15_000)
            discard.click()
            dialog = page.locator(".jp-Dialog")
            expect(dialog).to_contain_text("Discard the hibernated kernel?")
            expect(dialog).to_contain_text("discarded.ipynb")
            expect(dialog).to_contain_text("its variables cannot be brought back")
            dialog.get_by_role("button", name="Keep").click()
            expect(dialog).to_have_count(0)
            assert _model(server, kernel_id)["state"] == "hibernated" and folders[0].exists()
            discard.click()
            dialog.get_by_role("button", name="Discard").click()
            expect(page.locator(".Toastify__toast", has_text="Discarded discarded.ipynb")).to_be_visible(
                timeout=15_000
            )
            expect(row).to_have_count(0, timeout=15_000)
            assert server.request("GET", f"/api/elastic/kernels/{kernel_id}").status == 404
            assert not folders[0].exists(), "its checkpoint is deleted with it"
        finally:
            server.shutdown_all_kernels()
