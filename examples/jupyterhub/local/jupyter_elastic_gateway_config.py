"""The shared gateway's configuration for the local JupyterHub example.

GPU sizes, the cull policy and per-user quotas; in a cluster the same settings come from the
Helm chart's values. On a machine without an NVIDIA driver, two declared demo GPUs stand in.
"""

import os

from kernelmgr.activity.nvml import NvmlUnavailable, PynvmlNvml

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file

state = os.environ.get("ELASTIC_HUB_STATE", "elastic-hub-state")
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.root_dir = state
c.ElasticGateway.auth = "jupyterhub"
c.ElasticKernels.checkpoint_root = os.path.join(state, "checkpoints")
c.ElasticKernels.profiles = {
    "small": {"display_name": "GPU small (10 GiB)", "gpu_fraction": 0.25, "memory_mib": 10240},
    "medium": {"display_name": "GPU medium (20 GiB)", "gpu_fraction": 0.5, "memory_mib": 20480},
    "whole": {"display_name": "GPU whole (1 GPU)", "gpu_fraction": 1},
}

# Every user: up to 3 kernels holding at most half a GPU at once, small and medium sizes.
# The "research" group may hold two GPUs and pick whole GPUs.
c.ElasticQuota.default = {"max_kernels": 3, "max_gpu": 0.5, "profiles": ["small", "medium"]}
c.ElasticQuota.groups = {"research": {"max_gpu": 2, "profiles": ["small", "medium", "whole"]}}
if os.environ.get("ELASTIC_QUOTA_USERS"):  # e.g. the tests' tighter limits, as JSON
    import json

    c.ElasticQuota.users = json.loads(os.environ["ELASTIC_QUOTA_USERS"])

c.CullPolicy.idle_timeout = 1800
c.CullPolicy.warn_before = 120

try:
    PynvmlNvml().devices()
except NvmlUnavailable:
    c.ElasticKernels.gpu_inventory = [
        {"uuid": "GPU-demo-0000-declared", "name": "Demo GPU (declared, no hardware)", "memory_mib": 40960},
        {"uuid": "GPU-demo-0001-declared", "name": "Demo GPU (declared, no hardware)", "memory_mib": 40960},
    ]
