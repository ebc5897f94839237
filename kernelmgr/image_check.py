"""Check that an image can run elastic kernels, and say what is missing.

An admin who adds the kernel side to an image they already have (the z2jh singleuser image, an NGC
or PyTorch image) runs this inside it, as the kernel pod would: with the ``python`` first on PATH. It
checks what the kernel pod's command needs (``python -m kernelmgr.kube.pod_kernel``, which execs
``ipykernel_launcher`` with the checkpoint agent) and prints one line per check, each failure with
what to do. Exit status 0 when everything is there, 1 otherwise.

Usage::

    python -m kernelmgr.image_check [--server-version VERSION | --gateway URL [--same-version]] [--json]

``--server-version``: the gateway's version (``jupyter elastic-gateway --version``), to tell whether
that gateway accepts this image's checkpoint agent. ``--gateway``: ask a running gateway instead
(``GET /api/elastic/version``: its version and checkpoint format); ``--same-version`` fails on any
version difference, not only on a checkpoint format the gateway cannot read (the chart's ``helm test``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import asdict, dataclass

from kernelmgr import __version__
from kernelmgr.checkpoint.version import KERNEL_INFO_KEY, agent_info, compare
from kernelmgr.core.manifest import FORMAT

#: The pip line that adds the kernel side to an image (docs/images.md).
PIP_LINE = f"pip install 'jupyter-elastic-kernels=={__version__}'"

#: Modules the kernel pod imports, the oldest version that works, and the distribution to install.
REQUIRED = (
    ("ipykernel", (6, 25), "ipykernel"),
    ("jupyter_client", (8, 3), "jupyter-client"),
    ("cloudpickle", (3, 0), "cloudpickle"),
    ("blake3", (0, 4), "blake3"),
    ("kernelmgr.checkpoint.agent", None, "jupyter-elastic-kernels"),
    ("kernelmgr.kube.pod_kernel", None, "jupyter-elastic-kernels"),
)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def check_module(module: str, minimum: tuple[int, ...] | None, distribution: str) -> Check:
    """``module`` imports (and is at least ``minimum``)."""
    try:
        imported = importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken dependency of it
        return Check(
            module, False, f"cannot import it ({type(exc).__name__}: {exc}): pip install '{distribution}'"
        )
    version = str(getattr(imported, "__version__", ""))
    if minimum is not None and version and _version_tuple(version) < minimum:
        wanted = ".".join(map(str, minimum))
        return Check(module, False, f"{version} is too old: pip install '{distribution}>={wanted}'")
    return Check(module, True, version or "importable")


def check_python_on_path(environ: dict[str, str]) -> Check:
    """The pod runs ``python`` from PATH: it must be this environment, where kernelmgr is."""
    found = shutil.which("python", path=environ.get("PATH", os.defpath))
    if found is None:
        return Check(
            "python on PATH",
            False,
            f"no `python` on PATH (the kernel command runs `python -m ...`): link it to {sys.executable}",
        )
    try:
        prefix = subprocess.run(
            [found, "-c", "import sys; print(sys.prefix)"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("python on PATH", False, f"{found} does not run: {exc}")
    if os.path.realpath(prefix) != os.path.realpath(sys.prefix):
        return Check(
            "python on PATH",
            False,
            f"{found} is the environment {prefix}, not {sys.prefix} where kernelmgr is: put "
            f"{os.path.dirname(sys.executable)} first on PATH, or install there",
        )
    return Check("python on PATH", True, found)


def check_tmpdir() -> Check:
    """The pod writes its connection file (0600) to ``$TMPDIR``: the root filesystem is read-only."""
    try:
        with tempfile.NamedTemporaryFile(prefix="kernel-connection-check-"):
            pass
    except OSError as exc:
        return Check("TMPDIR", False, f"{tempfile.gettempdir()} is not writable ({exc}): set TMPDIR")
    return Check("TMPDIR", True, tempfile.gettempdir())


def check_server(server_version: str, server_format: str = FORMAT, same_version: bool = False) -> Check:
    """Whether a gateway of ``server_version`` (reading ``server_format``) accepts this agent.

    Given only a version, a gateway is assumed to read this agent's format (:data:`FORMAT`): what
    *this* agent writes is what the gateway will compare. ``same_version``: another version fails
    too (it is accepted with a warning, but means a stale image or gateway).
    """
    result = compare({KERNEL_INFO_KEY: agent_info()}, version=server_version, fmt=server_format)
    if result.refusal:
        return Check("gateway handshake", False, result.refusal)
    if result.warnings:
        if same_version:
            return Check("gateway handshake", False, f"{result.warnings[0]}: use the same version for both")
        return Check("gateway handshake", True, f"accepted with a warning: {result.warnings[0]}")
    return Check("gateway handshake", True, f"gateway {server_version} accepts this agent")


def ask_gateway(url: str, same_version: bool = False) -> Check:
    """The handshake with a running gateway's version and format (``GET <url>/api/elastic/version``)."""
    where = url.rstrip("/") + "/api/elastic/version"
    try:
        with urllib.request.urlopen(where, timeout=30) as reply:
            said = json.loads(reply.read())
        version, fmt = str(said["version"]), str(said["checkpoint_format"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Check("gateway handshake", False, f"the gateway at {where} did not say its version: {exc}")
    return check_server(version, fmt, same_version)


def run_checks(
    server_version: str | None = None,
    environ: dict[str, str] | None = None,
    gateway: str | None = None,
    same_version: bool = False,
) -> list[Check]:
    environ = dict(os.environ) if environ is None else environ
    checks = [
        Check(
            "python",
            sys.version_info >= (3, 10),
            f"{sys.version.split()[0]} ({sys.executable})"
            + ("" if sys.version_info >= (3, 10) else ": Python 3.10 or newer is needed"),
        )
    ]
    checks += [check_module(*required) for required in REQUIRED]
    checks.append(check_python_on_path(environ))
    checks.append(check_tmpdir())
    checks.append(Check("checkpoint agent", True, f"jupyter-elastic-kernels {__version__}, format {FORMAT}"))
    if server_version:
        checks.append(check_server(server_version, same_version=same_version))
    if gateway:
        checks.append(ask_gateway(gateway, same_version))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernelmgr.image_check", description="Check that this image can run elastic kernels."
    )
    parser.add_argument("command", nargs="?", default="check", choices=["check"])
    parser.add_argument(
        "--server-version", default=None, help="the gateway's jupyter-elastic-kernels version"
    )
    parser.add_argument(
        "--gateway", default=None, help="a running gateway's URL (with its base URL): ask it its version"
    )
    parser.add_argument(
        "--same-version", action="store_true", help="fail when the gateway's version differs from this one"
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    checks = run_checks(args.server_version, gateway=args.gateway, same_version=args.same_version)
    ok = all(check.ok for check in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(check) for check in checks]}, indent=1))
    else:
        for check in checks:
            print(f"{'ok     ' if check.ok else 'MISSING'} {check.name}: {check.detail}")
        print(
            "this image can run elastic kernels" if ok else f"not ready: fix the MISSING lines ({PIP_LINE})"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
