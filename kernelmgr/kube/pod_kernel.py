"""The kernel pod's entry point: ipykernel listening on the pod's own IP, nowhere else.

The connection file comes from the kernel's Secret, written before the pod (and its IP) existed, and
ipykernel takes the address from the file over any ``--ip`` flag. Listening on ``0.0.0.0`` would work
inside a pod's network namespace, but not where pods share one (a node whose pods run as processes,
as in the tests) and it exposes the kernel on every interface. So this reads the Secret's file, puts
``$POD_IP`` in it, writes it privately (0600, ``$TMPDIR``: the Secret volume is read-only) and
replaces itself with ``python -m ipykernel_launcher -f <that file> <the other arguments>``.

Usage: ``python -m kernelmgr.kube.pod_kernel -f /etc/elastic/connection.json [ipykernel args...]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping


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
    return [sys.executable, "-m", "ipykernel_launcher", "-f", path, *argv[2:]]


def main() -> None:
    command = prepare(sys.argv[1:], dict(os.environ))
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
