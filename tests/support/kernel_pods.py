"""Driving ``elastic-kubernetes-provisioner`` from tests: a real ``AsyncKernelManager`` per kernel.

Shared by tests/test_kube_provisioner.py and tests/test_kube_rbac.py. The kernelspec names the
provisioner and carries its configuration in ``metadata.kernel_provisioner.config``, as the server's
generated kernelspecs will.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from traitlets.config import Configurable

from kernelmgr.config import ElasticKernels, ElasticRuntime
from kernelmgr.kube.cluster import KubeCluster
from kernelmgr.provisioners import kubernetes as kprov
from tests.support.kube import ControlPlane
from tests.support.ports import free_port_block

ON_RUNNER = {"elastic.test/node-runner": "true"}
PROFILES = {"one": {"gpu_fraction": 1}, "two": {"gpu_fraction": 2}}
INVENTORY = [
    {"uuid": "GPU-k8s-0000", "name": "Test A100", "memory_mib": 40960},
    {"uuid": "GPU-k8s-0001", "name": "Test A100", "memory_mib": 40960},
]


class Holder(Configurable):
    """Stands in for the elastic kernel manager: the parent that carries the runtime."""

    elastic_runtime: ElasticRuntime


def make_runtime(checkpoints: Path, owner: str | None = None, *, cluster: KubeCluster) -> ElasticRuntime:
    """The test GPUs and sizes above; ``owner`` replaces the server user as the kernels' owner.

    ``cluster`` stands in for the one the server extension makes (the test stops it).
    """
    elastic = ElasticKernels(profiles=PROFILES, gpu_inventory=INVENTORY, checkpoint_root=str(checkpoints))
    runtime = elastic.build()
    runtime.kube = cluster
    if owner is not None:
        runtime.owner = owner
    return runtime


def kernel_manager(
    tmp_path: Path,
    plane: ControlPlane,
    namespace: str,
    runtime: ElasticRuntime,
    size: str | None,
    *,
    name: str | None = None,
    **config: Any,
) -> AsyncKernelManager:
    """A kernel manager for a kernelspec of GPU size ``size`` (``None``: a CPU kernel) on the node runner.

    ``config`` overrides the provisioner's configuration (``kubeconfig`` defaults to the admin's).
    """
    name = name or f"k8s-{size or 'cpu'}"
    spec_dir = tmp_path / "kernels" / name
    spec_dir.mkdir(parents=True)
    provisioner_config = {
        "namespace": namespace,
        "kubeconfig": str(plane.admin_kubeconfig),
        "image": "python:3.12",
        "node_selector": ON_RUNNER,
        "run_as_user": os.getuid() or 1000,
        "launch_timeout": 60.0,
        "first_port": free_port_block(),
        **config,
    }
    metadata: dict[str, Any] = {
        "kernel_provisioner": {"provisioner_name": kprov.PROVISIONER_NAME, "config": provisioner_config}
    }
    if size is not None:
        metadata["elastic"] = {"profile": size}
    spec = {
        "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python (pod, {size or 'cpu'})",
        "language": "python",
        "interrupt_mode": "message",
        "metadata": metadata,
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    holder = Holder()
    holder.elastic_runtime = runtime
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return AsyncKernelManager(parent=holder, kernel_name=name, kernel_spec_manager=ksm)


async def execute(km: AsyncKernelManager, code: str, timeout: float = 30) -> list[str]:
    """Run ``code`` in the kernel; its ``execute_result`` and ``stream`` texts (the reply must be ok)."""
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        results: list[str] = []

        def collect(msg: dict[str, Any]) -> None:
            if msg["msg_type"] in ("execute_result", "stream"):
                results.append(msg["content"].get("text") or msg["content"]["data"]["text/plain"])

        reply = await kc.execute_interactive(code, timeout=timeout, output_hook=collect)
        assert reply["content"]["status"] == "ok", reply["content"]
        return results
    finally:
        kc.stop_channels()


def pod_names(core: Any, namespace: str) -> list[str]:
    return [p.metadata.name for p in core.list_namespaced_pod(namespace).items]


def secret_names(core: Any, namespace: str) -> list[str]:
    return [s.metadata.name for s in core.list_namespaced_secret(namespace).items]
