"""A session manager whose notebook ↔ kernel sessions survive a server restart.

jupyter_server keeps sessions in an in-memory SQLite database, so after a restart every
notebook loses its kernel. With hibernated kernels re-registered at start-up that is the one
missing piece: this manager keeps its database in a file next to the server's kernel
registry (one per server root directory), so an open notebook reconnects to the same,
hibernated kernel and its next cell resumes it. In Kubernetes mode the database stays in
memory: SQLite on a shared (NFS) claim is unsafe, and a gateway's sessions live in the
single-user servers that call it.

Hibernated kernels stay registered in the kernel manager, so jupyter_server's own
``kernel_culled`` test (``kernel_id not in kernel_manager``) already keeps their sessions.
"""

from __future__ import annotations

import hashlib
import os

from jupyter_server.services.sessions.sessionmanager import SessionManager
from traitlets import default

from kernelmgr.config import ElasticKernels
from kernelmgr.core.modes import KernelMode


def server_identity(root_dir: str) -> str:
    """A short stable name for "this server", from its root directory."""
    return hashlib.sha256(os.path.abspath(root_dir).encode()).hexdigest()[:12]


def state_dir(parent: object) -> str:
    """Where this server keeps its kernel registry and sessions (beside the checkpoints)."""
    return ElasticKernels(parent=parent).checkpoint_directory()


class ElasticSessionManager(SessionManager):
    """jupyter_server's session manager with a persistent database by default."""

    @default("database_filepath")
    def _elastic_database_filepath(self) -> str:
        if KernelMode(ElasticKernels(parent=self.parent).kernel_provisioner).in_pods:
            # Kubernetes mode: never SQLite on the shared claim (NFS locking; two gateways). A
            # gateway's notebooks keep their sessions in their own single-user servers; the
            # kernels themselves are rebuilt from the API after a restart or a failover.
            return ":memory:"
        root_dir = getattr(self.parent, "root_dir", os.getcwd())
        directory = state_dir(self.parent)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return os.path.join(directory, f"sessions-{server_identity(root_dir)}.db")
