"""The user's files in their kernel pods, end to end: the real server, API server and runner nodes.

The owner's home is a claim named by template (z2jh's ``claim-{owner}``), bound to a PersistentVolume
by the controller manager; the runner nodes map a claim to one folder, as a ReadWriteMany home is one
file system for every node. A notebook opened in ``proj/`` beside ``data.csv`` and ``helper.py`` gets a
kernel pod whose working directory is that folder on the home volume and whose HOME is the volume, so
what the notebook reads and imports, and what the kernel leaves in ``~/.cache``, is still there after a
hibernation and a resume on another pod.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from kernelmgr.kube.namespaces import dns_label  # noqa: E402
from tests.support.node_runner import NodeRunner  # noqa: E402
from tests.support.pod_cluster import PodCluster, pod_cluster  # noqa: E402
from tests.support.server import start_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)

NAMESPACE = "elastic-files"
SIZE = "python3-gpu-whole"
HOME = "/home/jovyan"


@pytest.fixture(scope="module")
def cluster(kube_plane: ControlPlane, kube_api: Any, kube_runner: NodeRunner) -> Iterator[PodCluster]:
    with pod_cluster(kube_plane, kube_api, kube_runner, NAMESPACE) as made:
        yield made


def home_claim(cluster: PodCluster, owner: str) -> Path:
    """The owner's home claim, bound, and the folder the runner nodes map it to."""
    name = f"claim-{dns_label(owner)}"
    volume = f"{NAMESPACE}-{name}"
    cluster.core.create_persistent_volume(
        {
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": "/srv/homes"},
                "claimRef": {"namespace": NAMESPACE, "name": name},
            },
        }
    )
    cluster.core.create_namespaced_persistent_volume_claim(
        NAMESPACE,
        {
            "metadata": {"name": name},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    wait_for(
        lambda: cluster.core.read_namespaced_persistent_volume_claim(name, NAMESPACE).status.phase == "Bound",
        60,
        "the home claim to be bound",
    )
    folder = cluster.runners[0].volumes_root / "pvc" / NAMESPACE / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_a_notebook_reads_and_imports_its_neighbours_through_hibernate_and_resume(
    cluster: PodCluster, tmp_path: Path
) -> None:
    owner = getpass.getuser()  # a single-user server's kernels are its user's
    home = home_claim(cluster, owner)
    (home / "proj").mkdir()
    (home / "proj" / "data.csv").write_text("a,b\n1,2\n")
    (home / "proj" / "helper.py").write_text("VALUE = 42\n")
    # The single-user server's root is the home (z2jh mounts the same claim at /home/jovyan there).
    (tmp_path / "root" / "proj").mkdir(parents=True)
    config = cluster.config(
        user_volumes=[{"name": "home", "claimName": "claim-{owner}", "mountPath": HOME}],
        home_volume="home",
        notebook_root=str(tmp_path / "root"),
    )
    server = start_server(tmp_path, config)
    try:
        reply = server.request(
            "POST", "/api/sessions", {"path": "proj/nb.ipynb", "type": "notebook", "kernel": {"name": SIZE}}
        )
        assert reply.status == 201, reply.body
        kernel_id = reply.body["kernel"]["id"]
        pod = cluster.running_pod(kernel_id)
        (container,) = pod.spec.containers
        assert container.working_dir == f"{HOME}/proj"
        assert {e.name: e.value for e in container.env}["HOME"] == HOME
        claims = [v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.persistent_volume_claim]
        assert f"claim-{dns_label(owner)}" in claims
        cell = (
            "import os, csv, helper\n"
            "rows = list(csv.reader(open('data.csv')))\n"
            "print(rows[1], helper.VALUE, os.getcwd().endswith('proj'))\n"
        )
        assert server.execute(kernel_id, cell, timeout=120).strip() == "['1', '2'] 42 True"
        cache = "os.makedirs(os.path.expanduser('~/.cache/models'), exist_ok=True)\n"
        cache += "open(os.path.expanduser('~/.cache/models/w.bin'), 'w').write('weights')\n"
        server.execute(kernel_id, cache)
        assert (home / ".cache" / "models" / "w.bin").read_text() == "weights"  # on the home volume

        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply.body
        assert cluster.pod_of(kernel_id) is None
        # The resumed kernel's `helper` is re-imported from the notebook's folder, and the cache is there.
        again = (
            "print(list(csv.reader(open('data.csv')))[1], helper.VALUE, "
            "open(os.path.expanduser('~/.cache/models/w.bin')).read())"
        )
        assert server.execute(kernel_id, again, timeout=120).strip() == "['1', '2'] 42 weights"
        assert cluster.running_pod(kernel_id).spec.containers[0].working_dir == f"{HOME}/proj"
        server.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
    finally:
        server.stop()


def test_two_kernelspecs_run_in_their_own_images_with_their_own_env(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """A PyTorch and a JAX environment: each base kernelspec its image (kernelspec_images), and the env
    its kernel.json declares reaches its pods."""
    import json
    import sys

    spec_dir = tmp_path / "data" / "kernels" / "pyjax"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "JAX",
        "language": "python",
        "env": {"FRAMEWORK": "jax"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    config = cluster.config(kernelspec_images={"pyjax": "registry.example/kernel-jax:0.4"})
    config["ElasticKernels"]["base_kernels"] = ["python3", "pyjax"]
    server = start_server(tmp_path, config)
    try:
        jax = server.start_kernel("pyjax-gpu-whole")
        pod = cluster.running_pod(jax)
        assert pod.spec.containers[0].image == "registry.example/kernel-jax:0.4"
        assert server.execute(jax, "import os; print(os.environ['FRAMEWORK'])", timeout=120).strip() == "jax"
        server.shutdown_kernel(jax)
        wait_for(lambda: cluster.pod_of(jax) is None, 60, "the kernel pod to be deleted")
        torch = server.start_kernel("python3-gpu-whole")
        assert cluster.running_pod(torch).spec.containers[0].image == "python:3.12"  # the default image
        server.shutdown_kernel(torch)
        wait_for(lambda: cluster.pod_of(torch) is None, 60, "the kernel pod to be deleted")
    finally:
        server.stop()


def test_a_kernelspecs_own_argv_runs_in_its_pods_and_cpu_kernels_take_their_settings(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """kernelspec_argv: an admin's kernelspec for another environment runs its own argv in the pod
    (here a Python started with its own -X option), the entry point handing it the pod's connection
    file and the agent loaded; other kernelspecs run the default command. cpu_pod_settings reach the
    '-cpu' kernels' pods."""
    import json
    import sys

    spec_dir = tmp_path / "data" / "kernels" / "alt"
    spec_dir.mkdir(parents=True)
    argv = [sys.executable, "-X", "elastic_env=alt", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = {"argv": argv, "display_name": "Alt", "language": "python", "env": {"FRAMEWORK": "alt"}}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    config = cluster.config(
        kernelspec_argv=["alt"],
        cpu_pod_settings={"resources": {"requests": {"cpu": "150m", "memory": "300Mi"}}, "shmSize": "300Mi"},
    )
    config["ElasticKernels"]["base_kernels"] = ["python3", "alt"]
    server = start_server(tmp_path, config)
    cell = (
        "import sys, os\n"
        "print(sys._xoptions.get('elastic_env'), os.environ.get('FRAMEWORK'),\n"
        "      'kernelmgr.checkpoint.agent' in get_ipython().extension_manager.loaded)\n"
    )
    try:
        alt = server.start_kernel("alt-gpu-whole")
        (container,) = cluster.running_pod(alt).spec.containers
        assert container.command[container.command.index("--") + 1 :][:3] == argv[:3], container.command
        assert server.execute(alt, cell, timeout=120).split() == ["alt", "alt", "True"]
        server.shutdown_kernel(alt)
        wait_for(lambda: cluster.pod_of(alt) is None, 60, "the kernel pod to be deleted")
        plain = server.start_kernel("python3-cpu")
        pod = cluster.running_pod(plain)
        assert "--" not in pod.spec.containers[0].command
        assert pod.spec.containers[0].resources.requests == {"cpu": "150m", "memory": "300Mi"}
        shm = next(v for v in pod.spec.volumes if v.name == "dshm")
        assert shm.empty_dir.size_limit == "300Mi"
        assert server.execute(plain, cell, timeout=120).split() == ["None", "None", "True"]
        server.shutdown_kernel(plain)
        wait_for(lambda: cluster.pod_of(plain) is None, 60, "the kernel pod to be deleted")
    finally:
        server.stop()


def test_an_owner_with_their_own_uid_gets_their_checkpoint_folder_and_hibernates(
    cluster: PodCluster, tmp_path: Path
) -> None:
    """user_ids: the pod runs as the owner's uid and gid, and the server (root here) gives the
    owner's checkpoint folder on the claim to them, so their kernel can write its checkpoints
    (the runner nodes run pods as this user: the real node shows the kernel's own uid at work)."""
    owner = getpass.getuser()
    config = cluster.config(user_ids={owner: {"uid": 4321, "gid": 4322}})
    server = start_server(tmp_path, config)
    try:
        kernel_id = server.start_kernel(SIZE)
        context = cluster.running_pod(kernel_id).spec.security_context
        assert (context.run_as_user, context.run_as_group, context.fs_group) == (4321, 4322, 4322)
        found = (cluster.checkpoints / owner).stat()
        assert (found.st_uid, found.st_gid) == (4321, 4322)
        server.execute(kernel_id, "x = 41", timeout=120)
        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
        assert reply.status == 200, reply.body
        assert server.execute(kernel_id, "print(x + 1)", timeout=120).strip() == "42"
        server.shutdown_kernel(kernel_id)
        wait_for(lambda: cluster.pod_of(kernel_id) is None, 60, "the kernel pod to be deleted")
    finally:
        server.stop()
        os.chown(cluster.checkpoints / owner, os.getuid(), os.getgid())  # as the other tests expect it
