"""The checkpoint agent's version handshake between a kernel image and the server.

The server drives the agent by executing code in the kernel and shares a byte-level checkpoint
format with it, yet the two usually come from different images (the gateway's and the kernel's). So
the agent adds its package version and checkpoint format to every ``kernel_info`` reply, under
:data:`KERNEL_INFO_KEY`, and the server compares them with its own (:func:`compare`): a kernel whose
checkpoints the server cannot read is refused with both versions named; any other difference is
a warning (the format is what must agree; the rest only hints at a stale image).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernelmgr import __version__
from kernelmgr.core.manifest import FORMAT

#: The ``kernel_info`` reply's key holding :func:`agent_info`.
KERNEL_INFO_KEY = "elastic_agent"


def agent_info() -> dict[str, str]:
    """What this installation's agent says about itself in ``kernel_info``."""
    return {"version": __version__, "checkpoint_format": FORMAT}


@dataclass(frozen=True)
class AgentCheck:
    """The outcome of :func:`compare`: a refusal (the kernel cannot be used), or warnings."""

    refusal: str | None = None
    warnings: tuple[str, ...] = ()


def compare(reply: Mapping[str, Any], *, version: str = __version__, fmt: str = FORMAT) -> AgentCheck:
    """Compare a ``kernel_info`` reply's agent with this server's (``version``, ``fmt``)."""
    ours = f"jupyter-elastic-kernels {version} (checkpoint format {fmt})"
    agent = reply.get(KERNEL_INFO_KEY)
    if not isinstance(agent, Mapping):
        return AgentCheck(
            warnings=(
                f"the kernel reports no checkpoint agent version (its kernelmgr predates the handshake, or "
                f"the agent did not load); this server is {ours}",
            )
        )
    theirs_version = str(agent.get("version", "unknown"))
    theirs_format = str(agent.get("checkpoint_format", "unknown"))
    theirs = f"jupyter-elastic-kernels {theirs_version} (checkpoint format {theirs_format})"
    if theirs_format != fmt:
        return AgentCheck(
            refusal=(
                f"the kernel image's checkpoint agent is {theirs}, this server is {ours} and cannot read "
                f"its checkpoints: build the kernel image from the server's version "
                f"(scripts/images.sh build) or install jupyter-elastic-kernels=={version} in it"
            )
        )
    if theirs_version != version:
        return AgentCheck(
            warnings=(f"the kernel image's checkpoint agent is {theirs}, this server is {ours}",)
        )
    return AgentCheck()


def advertise(kernel: Any, info: Mapping[str, str] | None = None) -> bool:
    """Make ``kernel`` (an ipykernel ``Kernel``) add ``info`` (default :func:`agent_info`) to its
    ``kernel_info`` replies.

    ipykernel builds the reply from a read-only property, so the agent replaces the instance's
    ``kernel_info_request`` handler (shell and control) with one that adds its key. Returns whether
    it could (a shell without an ipykernel kernel, as in plain IPython, has none).
    """
    handlers = [getattr(kernel, name, None) for name in ("shell_handlers", "control_handlers")]
    if kernel is None or not any(isinstance(h, dict) and "kernel_info_request" in h for h in handlers):
        return False

    advertised = dict(info) if info is not None else agent_info()

    async def kernel_info_request(stream: Any, ident: Any, parent: Any) -> None:
        if not kernel.session:
            return
        content = {"status": "ok", **kernel.kernel_info, KERNEL_INFO_KEY: advertised}
        kernel.session.send(stream, "kernel_info_reply", content, parent, ident)

    for table in handlers:
        if isinstance(table, dict) and "kernel_info_request" in table:
            table["kernel_info_request"] = kernel_info_request
    return True
