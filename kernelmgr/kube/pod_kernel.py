"""The kernel pod's entry point: ipykernel listening on the pod's own IP, nowhere else.

The connection file comes from the kernel's Secret, written before the pod (and its IP) existed, and
ipykernel takes the address from the file over any ``--ip`` flag. Listening on ``0.0.0.0`` would work
inside a pod's network namespace, but not where pods share one (a node whose pods run as processes,
as in the tests) and it exposes the kernel on every interface. So this reads the Secret's file, puts
``$POD_IP`` in it, writes it privately (0600, ``$TMPDIR``: the Secret volume is read-only) and
replaces itself with ``python -m ipykernel_launcher -f <that file> <the other arguments>``.

A kernelspec whose own argv runs in the pod (``kernelspec_argv``: another Python environment in the
image) comes after ``--``: that argv runs instead, ``{connection_file}`` replaced by the written file.

A resume from an object store runs ipykernel in this process instead (``runpy``, as ``python -m``
would), after starting the checkpoint's download (:mod:`kernelmgr.checkpoint.prefetch`), so the
download overlaps ipykernel's start and the agent takes it. A kernelspec's own argv is another
program: it is exec'd as always, and its agent downloads the checkpoint when it loads.

Usage: ``python -m kernelmgr.kube.pod_kernel -f /etc/elastic/connection.json [ipykernel args...]``, or
``... -f /etc/elastic/connection.json -- /opt/jax/bin/python -m ipykernel_launcher -f {connection_file}``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from collections.abc import Mapping

#: Separates the entry point's arguments from a kernelspec's own argv.
ARGV_SEPARATOR = "--"
LAUNCHER = "ipykernel_launcher"
#: Set (a presigned URL) when the kernel resumes from an object store (``checkpoint.prefetch``).
ENV_RESTORE_DATA_URL = "ELASTIC_RESTORE_DATA_URL"


def write_pod_connection_file(info: dict[str, object], environ: Mapping[str, str]) -> str:
    """Write ``info`` with the pod's own IP to a private file (0600, ``$TMPDIR``); its path.

    Also what a warm pod (:mod:`kernelmgr.kube.warm_pod`) does with the connection it is handed.
    """
    info = {**info, "ip": environ.get("POD_IP") or "0.0.0.0"}
    fd, path = tempfile.mkstemp(prefix="kernel-connection-", suffix=".json")  # 0600
    with os.fdopen(fd, "w") as target:
        json.dump(info, target)
    return path


def prepare(argv: list[str], environ: dict[str, str]) -> list[str]:
    """The ipykernel command line for ``argv``, after writing the pod's own connection file."""
    if len(argv) < 2 or argv[0] != "-f":
        raise SystemExit("usage: python -m kernelmgr.kube.pod_kernel -f CONNECTION_FILE [ipykernel args...]")
    with open(argv[1]) as source:
        info = json.load(source)
    path = write_pod_connection_file(info, environ)
    rest = argv[2:]
    if ARGV_SEPARATOR in rest:
        own = rest[rest.index(ARGV_SEPARATOR) + 1 :]
        if not own:
            raise SystemExit(f"nothing to run after {ARGV_SEPARATOR!r}")
        return [part.replace("{connection_file}", path) for part in own]
    return [sys.executable, "-m", LAUNCHER, "-f", path, *rest]


def main() -> None:
    command = prepare(sys.argv[1:], dict(os.environ))
    if os.environ.get(ENV_RESTORE_DATA_URL) and command[:3] == [sys.executable, "-m", LAUNCHER]:
        # A resume from an object store: start the download now, while ipykernel starts, and run
        # ipykernel in this process (as ``python -m`` would) so that its agent can take it.
        from kernelmgr.checkpoint import prefetch

        if prefetch.start() is not None:
            sys.argv = [command[0], *command[3:]]
            runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)
            return
    os.execvp(command[0], command)  # a kernelspec's argv may name its program by PATH


if __name__ == "__main__":
    main()
