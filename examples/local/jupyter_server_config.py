"""Local-mode demo configuration for jupyter-elastic-kernels.

Three GPU sizes. On a machine with an NVIDIA driver the GPUs are discovered with NVML; on a
machine without one, two *declared* demo GPUs stand in (kernels then get their UUIDs in
CUDA_VISIBLE_DEVICES but, of course, no real GPU), so the launcher still shows the sizes.
"""

from kernelmgr.activity.nvml import NvmlUnavailable, PynvmlNvml

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file

c.ElasticKernels.profiles = {
    "small": {"display_name": "GPU small (10 GiB)", "gpu_fraction": 0.25, "memory_mib": 10240},
    "medium": {"display_name": "GPU medium (20 GiB)", "gpu_fraction": 0.5, "memory_mib": 20480},
    "whole": {"display_name": "GPU whole (1 GPU)", "gpu_fraction": 1},
}
c.ElasticKernels.allocation_strategy = "binpack"

# Hibernate kernels idle (no cell run, GPU idle) for 30 minutes, after a 2-minute warning;
# the whole-GPU size sooner. Running a cell brings a hibernated kernel back.
c.CullPolicy.idle_timeout = 1800
c.CullPolicy.warn_before = 120
c.CullPolicy.interval = 30
c.CullPolicy.rules = [{"profiles": ["whole"], "idle_timeout": 600, "warn_before": 60}]

try:
    PynvmlNvml().devices()
except NvmlUnavailable:
    c.ElasticKernels.gpu_inventory = [
        {"uuid": "GPU-demo-0000-declared", "name": "Demo GPU (declared, no hardware)", "memory_mib": 40960},
        {"uuid": "GPU-demo-0001-declared", "name": "Demo GPU (declared, no hardware)", "memory_mib": 40960},
    ]
