"""Who owns a kernel, and who may see it.

A single user's server owns every kernel it starts (``ElasticRuntime.owner``). A shared gateway
starts kernels for many users: the handler that starts a kernel sets
:data:`kernelmgr.core.kernels.requesting_owner` for the duration of the start, and the
provisioner records that owner on the kernel (its checkpoints, keys and namespace follow from
it). asyncio copies context variables into the tasks a start creates, so the owner reaches the
provisioner without threading it through jupyter_client's signatures.

:class:`KernelAccess` is the one question every handler asks before it touches a kernel id.
The default answers "yes" (one user per server); the gateway installs its own in the web
application's settings under ``elastic_kernel_access``.
"""

from __future__ import annotations

from typing import Any

SETTINGS_KEY = "elastic_kernel_access"


class KernelAccess:
    """Everyone the server authenticated may see and act on every kernel (one user's server)."""

    def may_access(self, handler: Any, kernel_id: str) -> bool:
        """Whether the request's user may see or act on the kernel ``kernel_id``.

        A kernel the user may not see answers exactly like a kernel that does not exist (404),
        so ids of other users' kernels cannot even be probed.
        """
        return True

    def is_admin_request(self, handler: Any) -> bool:
        """Whether the request's user may see every GPU and kernel (one user's server: yes)."""
        return True

    def owner_of_request(self, handler: Any, server_owner: str) -> str | None:
        """Whose checkpoints and quota the request's user has (one user's server: the server's)."""
        return server_owner


def access_of(settings: dict[str, Any]) -> KernelAccess:
    """The access rule the web application runs with (the default one if none is installed)."""
    access = settings.get(SETTINGS_KEY)
    return access if isinstance(access, KernelAccess) else _DEFAULT


_DEFAULT = KernelAccess()
