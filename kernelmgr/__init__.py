"""jupyter-elastic-kernels: GPU-size Jupyter kernels that share GPUs.

Importing the package is cheap: the server extension is only imported when jupyter_server
asks for its extension points.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from kernelmgr.server.extension import ElasticKernelsExtension

    return [{"module": "kernelmgr", "app": ElasticKernelsExtension}]
