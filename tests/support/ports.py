"""Fixed ports for kernels that tests start, below the machine's ephemeral range.

A kernel's ports are chosen before it binds them, sometimes seconds before (a restore first). A
port from the ephemeral range (what binding port 0 gives) can meanwhile become the source port of
any outgoing connection on the machine, and a client that keeps reconnecting to a port nobody
listens on yet can even connect to itself there (TCP simultaneous open): the kernel then cannot
bind it, or the client talks to itself and never hears the kernel. Ports under the range are never
handed out that way; picked at random and checked free, concurrent test workers rarely meet.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

#: The lowest port picked: above the well-known and registered services tests might meet.
LOWEST = 20000
#: Kubernetes' default NodePort range starts here; kube-proxy redirects those ports on the node.
NODE_PORTS_FROM = 30000


def ephemeral_floor() -> int:
    """The first port of the ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(size: int = 5) -> int:
    """The first of ``size`` consecutive ports free everywhere, below the ephemeral and NodePort ranges."""
    top = min(ephemeral_floor(), NODE_PORTS_FROM) - size
    for _ in range(200):
        first = random.randrange(LOWEST, top, size)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + size):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("0.0.0.0", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no free block of {size} ports between {LOWEST} and {top}")
