"""Every private name of jupyter_server, jupyter_client and JupyterHub the project relies on.

Underscored names carry no compatibility promise, so they are reached from here only (or, where a
subclass overrides a private method, listed in ``PRIVATE_NAMES``), and pyproject.toml caps the
packages at the next major version. ``tests/test_compat.py`` checks that every name still exists in
the installed releases; ``.ci/pins.sh lowest|newest`` runs it, with the server tests, on both ends
of each range.

Checked against (the lowest and newest releases each range allowed on 2026-11-27):
jupyter_server 2.18.0 and 2.21.1, jupyter_client 8.3.0 and 8.10.0, jupyterhub 5.0.0 and 6.1.1.

No Jupyter import here: ``lifecycle/`` uses it and must not import jupyter_server.
"""

from __future__ import annotations

from typing import Any

_CHANNELS = "jupyter_server.services.kernels.connection.channels"

#: (module, class or "" for the module, name) for each private name used; a class name also means
#: its subclasses in this project override or read the name.
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    # MultiKernelManager's kernel table and the mapping manager's per-kernel bookkeeping
    ("jupyter_client.multikernelmanager", "MultiKernelManager", "_kernels"),
    ("jupyter_client.multikernelmanager", "MultiKernelManager", "_check_kernel_id"),
    ("jupyter_client.multikernelmanager", "MultiKernelManager", "_async_start_kernel"),
    ("jupyter_client.multikernelmanager", "MultiKernelManager", "_async_shutdown_kernel"),
    ("jupyter_client.multikernelmanager", "MultiKernelManager", "_async_shutdown_all"),
    ("jupyter_server.services.kernels.kernelmanager", "MappingKernelManager", "_kernel_connections"),
    ("jupyter_server.services.kernels.kernelmanager", "MappingKernelManager", "_kernel_ports"),
    ("jupyter_server.services.kernels.kernelmanager", "MappingKernelManager", "_handle_kernel_died"),
    ("jupyter_server.services.kernels.kernelmanager", "MappingKernelManager", "_activity_stream"),
    # one kernel's manager: its launch arguments, start flag, connection and shutdown steps
    ("jupyter_client.manager", "KernelManager", "_launch_args"),
    ("jupyter_client.manager", "KernelManager", "_attempted_start"),
    ("jupyter_client.manager", "KernelManager", "_reconcile_connection_info"),
    ("jupyter_client.manager", "KernelManager", "_connect_control_socket"),
    ("jupyter_client.manager", "KernelManager", "_async_request_shutdown"),
    ("jupyter_client.manager", "KernelManager", "_async_kill_kernel"),
    ("jupyter_client.manager", "KernelManager", "_async_finish_shutdown"),
    ("jupyter_client.manager", "KernelManager", "_async_cleanup_resources"),
    # the kernel websocket (server/websocket.py subclasses it)
    (_CHANNELS, "ZMQChannelsWebsocketConnection", "_open_sessions"),
    (_CHANNELS, "ZMQChannelsWebsocketConnection", "_open_sockets"),
    (_CHANNELS, "ZMQChannelsWebsocketConnection", "_register_session"),
    (_CHANNELS, "ZMQChannelsWebsocketConnection", "_close_future"),
    # set on the kernel's manager by the connection's request_kernel_info (server/websocket.py)
    (_CHANNELS, "ZMQChannelsWebsocketConnection", "_kernel_info_future"),
    ("jupyter_server.extension.application", "ExtensionApp", "_link_jupyter_server_extension"),
    # the gateway (gateway/)
    ("jupyter_server.gateway.managers", "GatewayMappingKernelManager", "_kernels"),
    ("jupyter_server.gateway.connections", "GatewayWebSocketConnection", "_connection_done"),
    ("jupyter_server.services.kernels.handlers", "", "_kernel_id_regex"),
    ("jupyter_server.services.kernels.handlers", "", "_kernel_action_regex"),
    ("jupyter_server.auth.identity", "IdentityProvider", "_token_authenticated"),
)


def kernels(multi: Any) -> dict[str, Any]:
    """A (mapping) multi-kernel manager's table of kernel managers by id (``_kernels``)."""
    table: dict[str, Any] = multi._kernels
    return table


def register(multi: Any, kernel_id: str, km: Any, ports: bool = True) -> None:
    """Put ``km`` in ``multi``'s tables as jupyter_server's own start does (no connection yet)."""
    multi._kernels[kernel_id] = km
    multi._kernel_connections[kernel_id] = 0
    if ports:
        multi._kernel_ports[kernel_id] = km.ports


def set_ports(multi: Any, kernel_id: str, ports: list[int]) -> None:
    """The ports jupyter_server compares at a restart to tell a relaunch on new ports."""
    multi._kernel_ports[kernel_id] = ports


def forget(multi: Any, kernel_id: str) -> None:
    """Drop the mapping manager's bookkeeping for a kernel removed from its table."""
    multi._kernel_connections.pop(kernel_id, None)
    multi._kernel_ports.pop(kernel_id, None)


def launch_args(km: Any) -> dict[str, Any]:
    """The keyword arguments of the kernel's last start, which a restart repeats."""
    args: dict[str, Any] = km._launch_args
    return args


def mark_started(km: Any, launch_args: dict[str, Any]) -> None:
    """Make ``km`` look started with ``launch_args`` (a kernel adopted or hibernated at start-up)."""
    km._launch_args = launch_args
    km._attempted_start = True  # so the next start makes a fresh ``ready`` future


def adopt_connection(km: Any, info: dict[str, Any]) -> None:
    """Take over a running kernel's connection ``info`` and open the control channel to it."""
    km._reconcile_connection_info(info)


def connect_control(km: Any) -> None:
    km._connect_control_socket()


async def stop_for_restart(km: Any, graceful: bool) -> None:
    """Stop the kernel's process keeping id, ports and connection file (a restart's first half)."""
    if graceful:
        await km._async_request_shutdown(restart=True)
    else:
        await km._async_kill_kernel(restart=True)
    await km._async_finish_shutdown(pollinterval=0.01, restart=True)
    await km._async_cleanup_resources(restart=True)


def kernel_id_patterns() -> tuple[str, str]:
    """jupyter_server's URL patterns for a kernel id and a kernel action."""
    from jupyter_server.services.kernels import handlers

    return handlers._kernel_id_regex, handlers._kernel_action_regex


def mark_token_authenticated(handler: Any) -> None:
    """Tell jupyter_server the request came with a token: no cookie, no XSRF check."""
    handler._token_authenticated = True
