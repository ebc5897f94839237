"""A private containerd for the tests: its own root, state and socket under a test folder.

It never touches a containerd the machine may run (/run/containerd, /var/lib/containerd): every path
is under ``directory``, and what it started (tasks, the daemon, mounts left under its root) is
stopped and removed by :meth:`Containerd.stop`. With ``cri``, containerd's CRI plugin is configured
for a kubelet (:mod:`tests.support.node`); without it the plugin is disabled and only ``ctr`` drives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.kube import kill_with_parent, wait_for

REQUIRE_ENV = "ELASTIC_REQUIRE_NODE"
NAMESPACE = "elastic-test"


def missing_tools(tools: tuple[str, ...]) -> list[str]:
    return [tool for tool in tools if shutil.which(tool) is None]


def require_node_tools(tools: tuple[str, ...], *, what: str, how: str) -> None:
    """Skip the calling test when ``tools`` are missing or this is not root; fail instead when CI
    sets ``ELASTIC_REQUIRE_NODE=1`` (as ``ELASTIC_REQUIRE_ENVTEST`` does for the control plane)."""
    import pytest

    problems = [f"missing {', '.join(missing)}" for missing in [missing_tools(tools)] if missing]
    if os.geteuid() != 0:
        problems.append("not root (namespaces, cgroups and overlay mounts need it)")
    if not problems:
        return
    message = f"{what} cannot run here: {'; '.join(problems)} ({how})"
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set but {message}", pytrace=False)
    pytest.skip(message)


@dataclass
class Containerd:
    """containerd with every path under ``directory``; ``cri``: the CRI plugin's settings, or ``None``."""

    directory: Path
    cri: dict[str, Any] | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def root(self) -> Path:
        return self.directory / "root"

    def config(self) -> str:
        d = self.directory
        lines = [
            "version = 2",
            f'root = "{d / "root"}"',
            f'state = "{d / "state"}"',
            f'[grpc]\naddress = "{self.socket}"',
            f'[ttrpc]\naddress = "{d / "containerd.sock.ttrpc"}"',
            '[debug]\naddress = ""\nlevel = "info"',
            '[metrics]\naddress = ""',
            f'[plugins."io.containerd.internal.v1.opt"]\npath = "{d / "opt"}"',
        ]
        if self.cri is None:
            lines.insert(1, 'disabled_plugins = ["io.containerd.grpc.v1.cri"]')
        else:
            lines.append(self.cri["toml"])
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 60) -> Containerd:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "config.toml").write_text(self.config())
        log = (self.directory / "containerd.log").open("ab")
        self.process = subprocess.Popen(
            ["containerd", "--config", str(self.directory / "config.toml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=kill_with_parent,
        )
        log.close()

        def up() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"containerd exited: {self.log_tail()}")
            return self.socket.exists() and self.ctr("version", check=False).returncode == 0

        wait_for(up, timeout, "containerd to answer on its socket")
        return self

    def log_tail(self, lines: int = 30) -> str:
        path = self.directory / "containerd.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def ctr(
        self, *args: str, namespace: str = NAMESPACE, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["ctr", "--address", str(self.socket), "--namespace", namespace, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def import_image(self, archive: Path, namespace: str = NAMESPACE) -> list[str]:
        """Import an OCI or docker archive; the names it brought."""
        done = self.ctr("images", "import", "--all-platforms", str(archive), namespace=namespace)
        return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("unpacking ")]

    def run_detached(
        self, image: str, container_id: str, argv: list[str], *, options: list[str] = (), log: Path
    ) -> subprocess.Popen[bytes]:
        """``ctr run --rm`` in the background (its stdout and stderr into ``log``); stop with :meth:`kill`."""
        with log.open("ab") as out:
            return subprocess.Popen(
                [
                    "ctr",
                    "--address",
                    str(self.socket),
                    "--namespace",
                    NAMESPACE,
                    "run",
                    "--rm",
                    *options,
                    image,
                    container_id,
                    *argv,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=kill_with_parent,
            )

    def kill(self, container_id: str, namespace: str = NAMESPACE) -> None:
        self.ctr("tasks", "kill", "--signal", "SIGKILL", container_id, namespace=namespace, check=False)

    def _namespaces(self) -> list[str]:
        done = self.ctr("namespaces", "list", "--quiet", check=False)
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]

    def _network_namespaces(self, namespace: str, container: str) -> list[str]:
        """The network namespace files a container joins (the CRI pins each pod's under /run/netns)."""
        done = self.ctr("containers", "info", container, namespace=namespace, check=False)
        try:
            spec = json.loads(done.stdout).get("Spec") or {}
        except json.JSONDecodeError:
            return []
        found = spec.get("linux", {}).get("namespaces", [])
        return [ns["path"] for ns in found if ns.get("type") == "network" and "/netns/" in ns.get("path", "")]

    def _remove_everything_running(self) -> None:
        """Kill and delete every task and container, in every namespace (the shims exit with them).

        Also removes the pods' network namespaces (and so their veths): the CRI pins them under
        /run/netns, outside this containerd's folders, and removes them only through its own API.
        """
        pinned: set[str] = set()
        for namespace in self._namespaces():
            for container in self.ctr(
                "containers", "list", "--quiet", namespace=namespace, check=False
            ).stdout.split():
                pinned.update(self._network_namespaces(namespace, container))
            tasks = self.ctr("tasks", "list", "--quiet", namespace=namespace, check=False).stdout.split()
            for task in tasks:
                self.ctr(
                    "tasks", "kill", "--all", "--signal", "SIGKILL", task, namespace=namespace, check=False
                )
            for task in tasks:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if self.ctr("tasks", "delete", task, namespace=namespace, check=False).returncode == 0:
                        break
                    time.sleep(0.2)
            containers = self.ctr("containers", "list", "--quiet", namespace=namespace, check=False).stdout
            for container in containers.split():
                self.ctr("containers", "delete", container, namespace=namespace, check=False)
        for path in sorted(pinned):
            subprocess.run(["umount", path], capture_output=True, check=False)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(Exception):
                self._remove_everything_running()
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        unmount_under(self.directory)

    def __enter__(self) -> Containerd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def unmount_under(directory: Path) -> list[str]:
    """Unmount everything mounted below ``directory`` (deepest first); what was unmounted."""
    prefix = str(directory.resolve()) + "/"
    mounts = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if target.startswith(prefix):
            mounts.append(target)
    for target in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)
    return mounts


def image_labels(image_config: str) -> dict[str, Any]:
    return dict(json.loads(image_config).get("config", {}).get("Labels") or {})
