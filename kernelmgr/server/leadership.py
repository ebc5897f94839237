"""What a gateway without the Lease may not do (several gateways: ``ElasticLeaderElection``).

The Lease itself is :mod:`kernelmgr.kube.leader`; writes to the cluster are fenced in the API
client (:mod:`kernelmgr.kube.access`). Kernels are also reached without the API (ZMQ: shutdown,
restart, interrupt, a cell): those are refused here, so a gateway that was stopped or partitioned
past its Lease never touches a kernel the new leader serves, not even for requests it had queued.
"""

from __future__ import annotations

from typing import Any

from kernelmgr.server.errors import http_error


def require_lease(runtime: Any, what: str) -> None:
    """Raise 503 unless this gateway holds the Lease (or is the only gateway)."""
    leader = runtime.leader if runtime is not None else None
    if leader is not None and not leader.holds():
        raise http_error(
            503,
            f"this gateway ({leader.identity}) does not hold the Lease {leader.namespace}/{leader.name} "
            f"and may not {what}; connect through the Service to the gateway that does",
        )


def require_serving(runtime: Any) -> None:
    """Raise 503 on a standby (or a leader still taking the kernels over): it starts no kernel."""
    leader = runtime.leader if runtime is not None else None
    if leader is not None and not leader.ready():
        raise http_error(
            503,
            f"this gateway ({leader.identity}) is a standby and serves no kernels; the one holding "
            f"the Lease {leader.namespace}/{leader.name} does (connect through the Service)",
        )
