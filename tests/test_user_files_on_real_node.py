"""A user's files and environment in a kernel pod on the real node (kubelet + containerd + runc), issue 28.

The owner's home is z2jh's ``claim-{owner}`` (a hostPath PersistentVolume on this machine: one file
system, as an RWX home is for every node) and the checkpoints are on their own claim. A notebook opened
in ``proj/`` beside ``data.csv`` and ``mymodule.py`` gets a kernel pod in the project's kernel image,
running as the owner's own uid (``user_ids``), whose working directory is that folder and whose HOME
is the volume. In it:

- ``open("data.csv")`` and ``import mymodule`` work by relative name;
- ``pip install --user`` of a wheel (built here; no network) lands in ``~/.local`` on the home and
  imports after a hibernation and a resume on a new pod;
- two worker processes hand the parent 96 MiB each through shared memory, as a DataLoader's workers
  do: the pod has a ``/dev/shm`` of ``shm_size`` (the runtime's 64 MiB would kill them with SIGBUS);
- the files the kernel writes on the home belong to the owner's uid and gid.

And an admin's kernelspec for a PyTorch environment: ``torch`` names the PyTorch kernel image
(``kernelspec_images``; ``scripts/images.sh export-torch``: the kernel image on a base with Debian's CPU
build of PyTorch) and runs its own argv in its pods (``kernelspec_argv``): ``/opt/elastic/bin/python -X
elastic_env=torch -m ipykernel_launcher``, which the kernel sees from inside, with the kernelspec's env
and the checkpoint agent. A PyTorch DataLoader with two workers hands back batches of 96 MiB, each made
by a worker in shared memory, as every DataLoader with workers does: the GPU size carries ``shmSize:
1Gi`` and its kernel gets every batch; the same kernelspec's CPU kernel has no shm setting here
(``shm_size: ""``: the runtime's 64 MiB) and there the same DataLoader's workers die of a bus error.

Needs root, the node and the kernel image (as ``tests/test_real_node.py``); run it under
``flock /tmp/ek-real-node.lock`` (one real node per machine).
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import io
import json
import os
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import ControlPlane, require_envtest, wait_for

require_envtest(module_level=True)

from kubernetes import client  # noqa: E402

from kernelmgr.kube.labels import KERNEL_ID_LABEL  # noqa: E402
from kernelmgr.kube.namespaces import dns_label  # noqa: E402
from tests.support.node import Node  # noqa: E402
from tests.support.server import start_server  # noqa: E402
from tests.test_images import images_script  # noqa: E402
from tests.test_real_node import kernel_image, node, registry, server_config  # noqa: E402, F401

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]
NAMESPACE = "elastic-user-files"
HOME = "/home/jovyan"
#: The owner's own identity on their home (not the image's 1000).
UID, GID = 1234, 1235
WHEEL = "tinypkg-1.0-py3-none-any.whl"

#: Two workers each fill a 96 MiB shared-memory block and hand its name to the parent, which reads
#: them (a DataLoader's batches come back the same way); a worker that runs out of /dev/shm dies of SIGBUS.
SHARED_MEMORY_CELL = """
import multiprocessing as mp, queue
from multiprocessing import shared_memory
MiB = 2 ** 20
def worker(i, q, done):
    block = shared_memory.SharedMemory(create=True, size=96 * MiB)
    chunk = bytes([i + 1]) * MiB
    for at in range(0, block.size, MiB):
        block.buf[at:at + MiB] = chunk
    q.put(block.name)
    done.wait()
    block.close()
ctx = mp.get_context("fork")
q, done = ctx.Queue(), ctx.Event()
workers = [ctx.Process(target=worker, args=(i, q, done)) for i in range(2)]
for w in workers:
    w.start()
names = []
while len(names) < 2:
    try:
        names.append(q.get(timeout=1))
    except queue.Empty:
        if not all(w.is_alive() for w in workers):
            break
total = 0
for name in names:
    block = shared_memory.SharedMemory(name=name)
    total += block.buf[0] + block.buf[block.size - 1]
    block.close()
    block.unlink()
done.set()
for w in workers:
    w.join()
print([w.exitcode for w in workers], total)
"""


#: The kernelspec's own argv: the image's Python with an option the kernel can see.
ARGV = [
    "/opt/elastic/bin/python",
    "-X",
    "elastic_env=torch",
    "-m",
    "ipykernel_launcher",
    "-f",
    "{connection_file}",
]

#: Two workers, each making batches of 4 x 24 MiB in shared memory (a worker's collate writes the
#: batch there for the parent): with the runtime's 64 MiB of /dev/shm no batch fits.
DATALOADER_CELL = """
import torch
from torch.utils.data import DataLoader, Dataset
class Blocks(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return torch.full((6 * 2 ** 20,), float(i))  # 24 MiB of float32
try:
    sums = [int(batch[:, 0].sum()) for batch in DataLoader(Blocks(), batch_size=4, num_workers=2)]
    print("ok", sums)
except RuntimeError as exc:
    print("failed", " ".join(str(exc).split()))
"""


def tiny_wheel() -> bytes:
    """A pure-Python wheel (``tinypkg``, ``ANSWER = 42``), as ``pip wheel`` would make it."""
    files = {
        "tinypkg/__init__.py": b"ANSWER = 42\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr("tinypkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return out.getvalue()


@pytest.fixture(scope="module")
def torch_image(node: Node) -> str:  # noqa: F811
    """The PyTorch kernel image, in the node's image store."""
    archive = Path(images_script("export-torch").split()[0])
    names = node.import_image(archive)
    assert names, "the archive brought no image name"
    return names[0]


@pytest.fixture(scope="module")
def core(kube_api: Any, node: Node) -> Iterator[Any]:  # noqa: F811
    api = client.CoreV1Api(kube_api)
    api.create_namespace({"metadata": {"name": NAMESPACE}})
    wait_for(lambda: api.read_namespaced_service_account("default", NAMESPACE), 60, "default ServiceAccount")
    # The node has no GPU: it advertises one (what a device plugin would do) so the size is placed.
    api.patch_node_status(node.name, {"status": {"capacity": {"nvidia.com/gpu": "1"}}})
    yield api
    api.delete_namespace(NAMESPACE)


def bound_claim(core: Any, name: str, folder: Path) -> str:
    """A claim in the namespace bound to a hostPath volume on ``folder``; the volume's name."""
    volume = f"{NAMESPACE}-{name}"
    core.create_persistent_volume(
        {
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": str(folder), "type": "Directory"},
                "claimRef": {"namespace": NAMESPACE, "name": name},
            },
        }
    )
    core.create_namespaced_persistent_volume_claim(
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
        lambda: core.read_namespaced_persistent_volume_claim(name, NAMESPACE).status.phase == "Bound",
        60,
        f"the claim {name} to be bound",
    )
    return volume


def kernel_pod(core: Any, kernel_id: str) -> Any:
    def running() -> Any:
        for pod in core.list_namespaced_pod(NAMESPACE, label_selector=f"{KERNEL_ID_LABEL}={kernel_id}").items:
            if pod.status.phase == "Running" and not pod.metadata.deletion_timestamp:
                return pod
        return None

    return wait_for(running, 300, "the kernel pod to run")


def test_a_notebook_lives_in_its_home_on_the_real_node(
    node: Node,  # noqa: F811
    core: Any,
    kube_plane: ControlPlane,
    kernel_image: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    owner = getpass.getuser()  # a single-user server's kernels are its user's
    storage = Path(f"/tmp/eku-{os.getpid()}")  # on the node's machine: the PVs' hostPaths
    home, checkpoints = storage / "home", storage / "checkpoints"
    (home / "proj").mkdir(parents=True)
    checkpoints.mkdir()
    (home / "proj" / "data.csv").write_text("a,b\n1,2\n")
    (home / "proj" / "mymodule.py").write_text("VALUE = 42\n")
    (home / "proj" / WHEEL).write_bytes(tiny_wheel())
    for path in (home, *home.rglob("*")):  # the owner's home is the owner's (as on an NFS server)
        os.chown(path, UID, GID)
    volumes: list[str] = []
    try:
        volumes.append(bound_claim(core, f"claim-{dns_label(owner)}", home))
        volumes.append(bound_claim(core, "checkpoints", checkpoints))
        run_the_notebook(core, node, kube_plane, kernel_image, tmp_path, owner, home, checkpoints)
    finally:
        for pod in core.list_namespaced_pod(NAMESPACE).items:
            core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
        wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the pods to be gone")
        for claim in core.list_namespaced_persistent_volume_claim(NAMESPACE).items:
            core.delete_namespaced_persistent_volume_claim(claim.metadata.name, NAMESPACE)
        for volume in volumes:
            core.delete_persistent_volume(volume)
        shutil.rmtree(storage, ignore_errors=True)


def run_the_notebook(
    core: Any,
    node: Node,  # noqa: F811
    kube_plane: ControlPlane,
    image: str,
    tmp_path: Path,
    owner: str,
    home: Path,
    checkpoints: Path,
) -> None:
    """Start the server, open the notebook, run its cells through a hibernation and a resume."""
    (tmp_path / "root" / "proj").mkdir(parents=True)  # the single-user server's view of the home
    config = server_config(kube_plane, image)
    config["ElasticKubernetesProvisioner"]["namespace"] = NAMESPACE
    config["ElasticKubernetesProvisioner"].update(
        checkpoint_claim="checkpoints",
        user_volumes=[{"name": "home", "claimName": "claim-{owner}", "mountPath": HOME}],
        home_volume="home",
        notebook_root=str(tmp_path / "root"),
        user_ids={owner: {"uid": UID, "gid": GID}},
        # Two cores: the GPU size's default request (1 CPU) beside the node's own pods is too much.
        resources={"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
    )
    config["ElasticKernels"]["checkpoint_root"] = str(checkpoints)
    server = start_server(tmp_path, config)
    try:
        reply = server.request(
            "POST",
            "/api/sessions",
            {"path": "proj/nb.ipynb", "type": "notebook", "kernel": {"name": "python3-gpu-whole"}},
            timeout=300,
        )
        assert reply.status == 201, (reply.body, server.log()[-3000:])
        kernel_id = reply.body["kernel"]["id"]
        pod = kernel_pod(core, kernel_id)
        assert pod.spec.node_name == node.name
        assert (pod.spec.security_context.run_as_user, pod.spec.security_context.run_as_group) == (UID, GID)
        (container,) = pod.spec.containers
        assert container.working_dir == f"{HOME}/proj"
        shm = next(v for v in pod.spec.volumes if v.name == "dshm")
        assert (shm.empty_dir.medium, shm.empty_dir.size_limit) == ("Memory", "1Gi")

        cell = (
            "import os, csv, mymodule\n"
            "x = 41\n"
            "print(os.getcwd(), list(csv.reader(open('data.csv')))[1], mymodule.VALUE,\n"
            "      os.getuid(), os.getgid())\n"
            "open('out.txt', 'w').write('written by the kernel')\n"
        )
        printed = server.execute(kernel_id, cell, timeout=300).strip().split(maxsplit=1)
        assert printed == [f"{HOME}/proj", f"['1', '2'] 42 {UID} {GID}"], printed
        written = (home / "proj" / "out.txt").stat()
        assert (written.st_uid, written.st_gid) == (UID, GID)  # the user's file, on the user's home

        pip = (
            "import subprocess, sys\n"
            "r = subprocess.run([sys.executable, '-m', 'pip', 'install', '--user', '--no-index',\n"
            f"    '--no-cache-dir', '--disable-pip-version-check', '{WHEEL}'],\n"
            "    capture_output=True, text=True)\n"
            "print(r.returncode, r.stdout[-300:], r.stderr[-600:])\n"
        )
        said = server.execute(kernel_id, pip, timeout=300)
        assert said.split()[0] == "0", said
        installed = next(home.glob(".local/lib/python3*/site-packages/tinypkg/__init__.py"))
        assert installed.stat().st_uid == UID

        statvfs = "import os; s = os.statvfs('/dev/shm'); print(s.f_blocks * s.f_frsize)"
        assert int(server.execute(kernel_id, statvfs, timeout=120)) > 64 * 2**20
        assert server.execute(kernel_id, SHARED_MEMORY_CELL, timeout=300).strip() == "[0, 0] 6"

        reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate", timeout=300)
        assert reply.status == 200, (reply.body, server.log()[-3000:])
        wait_for(
            lambda: (
                not core.list_namespaced_pod(NAMESPACE, label_selector=f"{KERNEL_ID_LABEL}={kernel_id}").items
            ),
            120,
            "the kernel pod to be gone",
        )
        # The next cell resumes it in a new pod: the variable restored, the neighbours and the
        # package the user installed still there (the user site is on the home volume).
        again = (
            "import tinypkg\n"
            "print(x + 1, list(csv.reader(open('data.csv')))[1], mymodule.VALUE, tinypkg.ANSWER,\n"
            "      tinypkg.__file__.startswith(os.path.expanduser('~/.local/')))\n"
        )
        # ``block``, a shared-memory handle whose segment the cell unlinked, cannot be loaded back:
        # the first cell says so and is not run (kernelmgr/checkpoint/first_cell.py); run again, it runs.
        with server.channel(kernel_id, timeout=300) as chan:
            first = chan.execute(again, timeout=300)
        assert first.error.startswith("RestoreIncomplete: Not all of your variables could be restored: "), (
            first
        )
        assert "block did not come back" in first.error and first.stdout == "", first
        assert server.execute(kernel_id, again, timeout=300).strip() == "42 ['1', '2'] 42 42 True"
        assert kernel_pod(core, kernel_id).metadata.uid != pod.metadata.uid  # a new pod
        server.shutdown_kernel(kernel_id)
        wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the kernel pod to be deleted")
    finally:
        server.stop()


def test_a_pytorch_kernelspec_runs_its_argv_and_a_dataloader_with_workers_on_the_real_node(
    node: Node,  # noqa: F811
    core: Any,
    kube_plane: ControlPlane,
    torch_image: str,
    tmp_path: Path,
) -> None:
    spec_dir = tmp_path / "data" / "kernels" / "torch"
    spec_dir.mkdir(parents=True)
    spec = {"argv": ARGV, "display_name": "PyTorch", "language": "python", "env": {"FRAMEWORK": "torch"}}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    plain_image = images_script("names").split()[0]  # the default image: never used by this kernelspec
    config = server_config(kube_plane, plain_image)
    config["ElasticKernels"]["base_kernels"] = ["torch"]
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "3Gi"}}
    config["ElasticKubernetesProvisioner"].update(
        namespace=NAMESPACE,
        kernelspec_images={"torch": torch_image},
        kernelspec_argv=["torch"],
        shm_size="",  # no /dev/shm of the kernels' own: the runtime's 64 MiB
        size_pod_settings={"whole": {"shmSize": "1Gi", "resources": small}},
        cpu_pod_settings={"resources": small},
    )
    server = start_server(tmp_path, config)
    try:
        gpu = server.start_kernel("torch-gpu-whole", timeout=300)  # a first start unpacks the large image
        pod = kernel_pod(core, gpu)
        assert (pod.spec.node_name, pod.spec.containers[0].image) == (node.name, torch_image)
        inside = (
            "import sys, os, torch\n"
            "print(sys._xoptions.get('elastic_env'), sys.executable, os.environ.get('FRAMEWORK'),\n"
            "      'kernelmgr.checkpoint.agent' in get_ipython().extension_manager.loaded,\n"
            "      torch.__version__.split('.')[0])\n"
        )
        seen = server.execute(gpu, inside, timeout=300).split()
        assert seen == ["torch", "/opt/elastic/bin/python", "torch", "True", "1"], seen
        # 16 samples valued 0..15 in batches of 4: each batch's first column sums to 4i + 6.
        said = server.execute(gpu, DATALOADER_CELL, timeout=300).strip()
        assert said == "ok [6, 22, 38, 54]", said
        server.shutdown_kernel(gpu)

        cpu = server.start_kernel("torch-cpu", timeout=300)
        pod = kernel_pod(core, cpu)
        assert not [volume for volume in pod.spec.volumes if volume.name == "dshm"]
        said = server.execute(cpu, DATALOADER_CELL, timeout=300).strip()
        assert said.startswith("failed DataLoader worker (pid(s)") and said.endswith("exited unexpectedly"), (
            said
        )
        # What the workers said before they died (on the container's stderr, not the cell's).
        log = core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE)
        assert "Unexpected bus error encountered in worker" in log and "shared memory" in log, log[-2000:]
        server.shutdown_kernel(cpu)
        wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 120, "the kernel pods to be deleted")
    finally:
        server.stop()
        for pod in core.list_namespaced_pod(NAMESPACE).items:
            core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
