"""The local slice backend: the environment a local kernel gets for its slice."""

from __future__ import annotations

import pytest

from kernelmgr.backends.local import cpu_environment, local_environment
from kernelmgr.core.allocator import SliceAllocator
from kernelmgr.core.inventory import GpuInventory
from kernelmgr.core.profiles import parse_profile

pytestmark = pytest.mark.pure

INVENTORY = GpuInventory.declared(
    [{"uuid": f"GPU-{i}", "name": "A100", "memory_mib": 40_000} for i in range(2)]
)


def test_fractional_slice_environment() -> None:
    small = parse_profile("small", {"gpu_fraction": 0.25, "memory_mib": 10_000})
    granted = SliceAllocator(INVENTORY).allocate("k", small)
    env = local_environment(small, granted, INVENTORY)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["ELASTIC_GPU_MEMORY_MIB"] == "10000"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["ELASTIC_GPU_MEMORY_FRACTION"] == "0.250"  # for torch.cuda.set_per_process_memory_fraction
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_mps_limits_when_configured() -> None:
    small = parse_profile("small", {"gpu_fraction": 0.25, "memory_mib": 10_000, "compute_percent": 30})
    granted = SliceAllocator(INVENTORY).allocate("k", small)
    env = local_environment(small, granted, INVENTORY, use_mps=True)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10000M"


def test_whole_gpus_environment() -> None:
    two = parse_profile("two", {"gpu_fraction": 2})
    granted = SliceAllocator(INVENTORY).allocate("k", two)
    env = local_environment(two, granted, INVENTORY)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0,GPU-1"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env


def test_cpu_kernels_see_no_gpu() -> None:
    assert cpu_environment() == {"CUDA_VISIBLE_DEVICES": ""}


def test_example_configs_are_valid() -> None:
    """The shipped examples must build, so a copied example never starts a broken server."""
    import json
    import runpy
    from pathlib import Path

    from traitlets.config import Config

    from kernelmgr.config import CullPolicy, ElasticKernels

    examples = Path(__file__).parent.parent / "examples"
    json_config = Config(json.loads((examples / "jupyter_server_config.json").read_text()))
    sizes = list(ElasticKernels(config=json_config).build().profiles)
    assert sizes == ["small", "medium", "mig-1g", "whole"]
    assert CullPolicy(config=json_config).build(sizes).for_profile("whole").idle_timeout == 600

    py_config = Config()
    runpy.run_path(
        str(examples / "local" / "jupyter_server_config.py"), init_globals={"get_config": lambda: py_config}
    )
    runtime = ElasticKernels(config=py_config).build()
    assert list(runtime.profiles) == ["small", "medium", "whole"]
    assert CullPolicy(config=py_config).build(list(runtime.profiles)).enabled
    assert runtime.gpus_available
