"""The Kubernetes client is an extra (``jupyter-elastic-kernels[kubernetes]``): local mode never imports it.

Modules that need it import it at their top and are themselves imported only once Kubernetes mode is
chosen; this module (no Kubernetes import) says so in one line when it is missing.
"""

from __future__ import annotations

from kernelmgr.core.errors import ConfigError

MISSING = (
    "Kubernetes mode needs the Kubernetes client, which is not installed: "
    "pip install 'jupyter-elastic-kernels[kubernetes]'"
)


def available() -> bool:
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    """Raise a ConfigError naming the extra when the Kubernetes client is missing."""
    if not available():
        raise ConfigError(MISSING)


def refusals() -> tuple[type[Exception], ...]:
    """What ``except`` should catch for an API refusal: nothing when the client is not even installed."""
    if not available():
        return ()
    from kernelmgr.kube.access import KubeRefused

    return (KubeRefused,)


def launch_failures() -> tuple[type[Exception], ...]:
    """What ``except`` should catch for a kernel pod that did not run (its message says why)."""
    if not available():
        return ()
    from kernelmgr.kube.cluster import PodNotRunning

    return (PodNotRunning,)
