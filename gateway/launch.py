"""``jupyter elastic-gateway``'s entry point: JupyterHub's client is an extra, so say which one when it is
missing (one line, exit code 2) instead of an ImportError traceback."""

from __future__ import annotations

import sys

MISSING = (
    "jupyter elastic-gateway needs JupyterHub's client, which is not installed: "
    "pip install 'jupyter-elastic-kernels[gateway]'"
)


def main() -> None:
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        print(f"jupyter-elastic-gateway: {MISSING}", file=sys.stderr)
        sys.exit(2)
    from gateway.app import main as launch

    launch()
