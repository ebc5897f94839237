"""Shared fixtures: one real server per test module that asks for it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.costs import assign
from tests.support.kube import ControlPlane, require_envtest, wait_for
from tests.support.server import RunningServer, start_server

PROFILES = {
    "small": {"gpu_fraction": 0.25, "memory_mib": 10240},
    "whole": {"gpu_fraction": 1},
    "huge": {"gpu_fraction": 0.5, "memory_mib": 100_000},
}
INVENTORY = [
    {"uuid": "GPU-test-0000", "name": "Test A100", "memory_mib": 40960},
    {"uuid": "GPU-test-0001", "name": "Test A100", "memory_mib": 40960},
]


def elastic_config(checkpoints: Path, **elastic: Any) -> dict[str, Any]:
    """A server configuration with the test GPUs and sizes, checkpoints under ``checkpoints``."""
    return {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "reap_interval": 1,
            "checkpoint_root": str(checkpoints),
            **elastic,
        }
    }


CONFIG = {"ElasticKernels": {"profiles": PROFILES, "gpu_inventory": INVENTORY, "reap_interval": 1}}


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server with two declared test GPUs and the sizes above."""
    running = start_server(tmp_path_factory.mktemp("server"), CONFIG)
    yield running
    running.stop()


# ---- a real Kubernetes control plane (tests/support/kube.py), shared by every test session that asks


@pytest.fixture(scope="session")
def kube_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok for the whole session.

    Skips (or fails, with ELASTIC_REQUIRE_ENVTEST=1 as in CI) when scripts/envtest.sh build has not run.
    """
    require_envtest()
    with ControlPlane(tmp_path_factory.mktemp("kube-plane")) as plane:
        yield plane


@pytest.fixture(scope="session")
def kube_api(kube_plane: ControlPlane) -> Iterator[Any]:
    """An admin ``kubernetes.client.ApiClient`` for ``kube_plane``."""
    with kube_plane.api_client() as api:
        yield api


@pytest.fixture(scope="session")
def kube_runner(kube_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A node runner node ("runner-0", one ``nvidia.com/gpu``) that runs its pods as local processes.

    Pods land on it with ``nodeSelector: {"elastic.test/node-runner": "true"}``.
    """
    from tests.support.node_runner import NodeRunner

    name = "runner-0"
    with NodeRunner(
        kube_plane.configuration(user=f"system:node:{name}", groups=["system:nodes"]),
        name,
        tmp_path_factory.mktemp("kube-runner"),
        capacity={"nvidia.com/gpu": "1"},
        heartbeat_interval=5,
        admin_configuration=kube_plane.configuration(),
        unpullable_images={"registry.invalid/missing:latest"},
    ) as runner:
        yield runner


@pytest.fixture
def kube_namespace(kube_api: Any) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount ready), deleted after the test."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(
        lambda: core.read_namespaced_service_account("default", name), 60, f"default ServiceAccount in {name}"
    )
    yield name
    core.delete_namespace(name)


@pytest.fixture
def reference() -> Iterator[Any]:
    """A plain ipykernel that runs the same cells and is never hibernated (tests/support/oracle.py)."""
    from tests.support.oracle import Reference

    ref = Reference()
    yield ref
    ref.close()


# ---- one cost marker per test (pure, server, cluster, browser, gpu), derived by tests/support/costs.py


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with the most expensive part it needs, before ``-m`` selects (first of the hooks).

    Then the real node's modules go first (stable otherwise), so under pytest-xdist their one worker
    starts on the longest share of the run while the others take the rest.
    """
    assign(items, Path(__file__).parent)
    items.sort(key=lambda item: worker_group(item.nodeid) != REAL_NODE_GROUP)


# ---- pytest-xdist: the suite runs in workers (pyproject's addopts), a whole module to one worker

# These modules start the machine's one real node (containerd, kubelet, the bridge and its routes) or
# use the one image store: two at once on different workers would fight over them, so one worker takes
# them all, one after another.
ONE_NODE_MODULES = frozenset(
    {
        "test_chart_on_real_node",
        "test_cluster_network",
        "test_hub_images",
        "test_hub_on_real_node",
        "test_images",
        "test_real_node",
        "test_user_files_on_real_node",
    }
)
REAL_NODE_GROUP = "the real node"


def worker_group(nodeid: str) -> str:
    """The unit of work handed to one worker: the module, or the real node's group of modules."""
    module = nodeid.split("::", 1)[0]
    return REAL_NODE_GROUP if Path(module).stem in ONE_NODE_MODULES else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's ``loadscope`` with :func:`worker_group` as the scope.

    (xdist's own ``loadgroup`` reads ``xdist_group`` marks from the node ids, which pytest 9 no longer
    carries, so it put the real-node modules on three workers at once.)
    """
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByWorkerGroup(config, log)
