"""The shared gateway's configuration for the local JupyterHub example.

GPU sizes, the cull policy and per-user quotas; in a cluster the same settings come from the
Helm chart's values. On a machine without an NVIDIA driver, two declared demo GPUs stand in.

Each user's kernels run as their own OS account (the gateway runs as root and drops to it, as
JupyterHub's LocalProcessSpawner does): Hub user ``alice`` runs as the account named by
ELASTIC_KERNEL_ACCOUNT (default ``{username}``: the account ``alice``, which must exist). A demo
for one person, without root: ELASTIC_SINGLE_TENANT=1 runs every kernel as the gateway's account.
"""

import os

from kernelmgr.activity.nvml import NvmlUnavailable, PynvmlNvml

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file

state = os.environ.get("ELASTIC_HUB_STATE", "elastic-hub-state")
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.root_dir = state
c.ElasticGateway.auth = "jupyterhub"
c.ElasticKernels.checkpoint_root = os.path.join(state, "checkpoints")
# The master checkpoint secret: never on the checkpoint volume; a folder only the gateway reads (0700).
c.ElasticKernels.checkpoint_secret_file = os.path.join(state, "gateway-secret", "checkpoint-secret")
if os.environ.get("ELASTIC_SINGLE_TENANT") == "1":
    # One person: kernels share the gateway's account (nothing separates Hub users' kernels).
    c.ElasticGateway.kernel_accounts = "shared"
    c.ElasticGateway.single_tenant = True
else:
    c.ElasticGateway.kernel_accounts = "per-user"
    c.ElasticGateway.kernel_account = os.environ.get("ELASTIC_KERNEL_ACCOUNT") or "{username}"
    # Connection and key files, one root-owned folder per account (state and its parents: o+x).
    c.ElasticGateway.kernel_runtime_dir = os.path.join(state, "kernel-runtime")
    # Other accounts can reach a kernel's localhost ports, and its IOPub publishes to anyone who
    # subscribes: CurveZMQ (jupyter_client 8.9+, ipykernel 7.4+) keeps its outputs theirs alone.
    from jupyter_client.manager import KernelManager

    if "transport_encryption" in KernelManager.class_trait_names():
        c.KernelManager.transport_encryption = "auto"
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
# Quotas and the cull policy that change without a restart: a JSON file of CullPolicy/ElasticQuota
# sections, re-read every live_config_interval seconds (the chart's live ConfigMap is one).
if os.environ.get("ELASTIC_LIVE_CONFIG"):
    c.ElasticKernels.live_config_file = os.environ["ELASTIC_LIVE_CONFIG"]
    c.ElasticKernels.live_config_interval = float(os.environ.get("ELASTIC_LIVE_CONFIG_INTERVAL") or 10)

try:
    PynvmlNvml().devices()
except NvmlUnavailable:
    c.ElasticKernels.gpu_inventory = [
        {"uuid": "GPU-demo-0000-declared", "name": "Demo GPU (declared, no hardware)", "memory_mib": 40960},
        {"uuid": "GPU-demo-0001-declared", "name": "Demo GPU (declared, no hardware)", "memory_mib": 40960},
    ]
