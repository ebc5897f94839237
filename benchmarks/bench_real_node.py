"""Kernel pods in real containers: start and resume to the first reply, beside a plain pod (issue 27).

The test cluster's real node (kubelet + containerd + runc + CNI bridge, ``tests/support/node.py``)
with the Helm chart installed with its defaults (``tests/test_chart_on_real_node.py``): the gateway
runs as a pod, kernels run in the project's kernel image. Measured through the gateway's REST API
and websocket, as a notebook does:

* **start**: ``POST /api/kernels`` for a GPU size, then one cell, timed to that cell's reply;
* **resume** at each state size: a kernel holds ``bytearray(os.urandom(size))``, is hibernated
  (checkpoint on the claim, pod deleted), then a cell that reads it is timed to its reply.

Beside each, in the same run, a **plain pod**: the same image and pod spec (the elastic kernel's
own, read back from the API), started with the same API calls (a Secret with the connection file,
the pod, the Secret's owner; the pod IP from a watch), running plain ipykernel (the project's pod
entry point without the checkpoint agent), reached from this machine with jupyter_client. Its
"resume" floor reads the same number of bytes raw from a file on the same claim, into one buffer.
Both read from the page cache (the checkpoint and the file were just written).

Run as root on a machine where ``tests/test_chart_on_real_node.py`` runs (``scripts/envtest.sh``,
``scripts/helm.sh``, ``scripts/images.sh``, ``scripts/node.sh`` built), under the node's lock:
``flock /tmp/ek-real-node.lock python benchmarks/bench_real_node.py``. Prints a Markdown table for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_client import BlockingKernelClient
from kubernetes import client, watch

from benchmarks.markdown import print_header, print_row
from tests.support.kube import ControlPlane, free_port, wait_for
from tests.support.node import Node, require_node
from tests.test_chart_on_real_node import CLAIM_IN_KERNEL, Chart, Gateway, installed_chart
from tests.test_images import images_script

MIB = 2**20


def timed_cell(gateway: Gateway, kernel_id: str, code: str) -> tuple[float, str]:
    """Seconds from sending ``code`` through the kernel's websocket to its reply; its stdout."""
    with gateway.channel(kernel_id, 900) as chan:
        start = time.perf_counter()
        result = chan.execute(code, timeout=900)
        took = time.perf_counter() - start
    assert not result.error, result.error
    return took, result.stdout


def elastic_start(chart: Chart, gateway: Gateway) -> tuple[float, str]:
    """Seconds from ``POST /api/kernels`` to the first cell's reply; the kernel id."""
    start = time.perf_counter()
    kernel_id = chart.start_kernel(gateway)
    with gateway.channel(kernel_id, 900) as chan:
        result = chan.execute("print(6 * 7)", timeout=900)
    took = time.perf_counter() - start
    assert result.stdout.strip() == "42", result
    return took, kernel_id


def shut_down(chart: Chart, gateway: Gateway, kernel_id: str) -> None:
    status, _ = gateway.request("DELETE", f"/api/kernels/{kernel_id}", timeout=300)
    assert status == 204
    wait_for(lambda: not chart.kernel_pods(kernel_id), 300, "the kernel pod to go")


def elastic_resume(chart: Chart, gateway: Gateway, nbytes: int) -> float:
    """Seconds from the first cell after a hibernation to its reply, ``nbytes`` of state."""
    _, kernel_id = elastic_start(chart, gateway)
    timed_cell(gateway, kernel_id, f"import os\nt = bytearray(os.urandom({nbytes}))")
    chart.hibernate(gateway, kernel_id)
    took, said = timed_cell(gateway, kernel_id, "print(len(t))")
    assert said.strip() == str(nbytes), said
    shut_down(chart, gateway, kernel_id)
    return took


class PlainPods:
    """Plain ipykernel pods made from an elastic kernel pod's spec, with the same API calls."""

    def __init__(self, chart: Chart, kernel_pod: Any, secret: Any) -> None:
        self.chart = chart
        self.core = chart.core
        api = client.ApiClient()
        self.spec = api.sanitize_for_serialization(kernel_pod.spec)
        self.secret_name = kernel_pod.metadata.name
        self.secret_data = dict(secret.data)
        self.info = json.loads(base64.b64decode(secret.data["connection.json"]))
        for key in ("nodeName",):
            self.spec.pop(key, None)
        container = self.spec["containers"][0]
        container["command"] = [a for a in container["command"] if "extra_extensions" not in a]
        for volume in self.spec["volumes"]:
            if volume.get("secret", {}).get("secretName") == self.secret_name:
                self.secret_volume = volume

    def run(self, code: str) -> float:
        """Seconds from the first API call to the reply of ``code`` in a new plain pod."""
        name = f"plain-{uuid.uuid4().hex[:8]}"
        namespace = self.chart.namespace
        self.secret_volume["secret"]["secretName"] = name
        pod = {"metadata": {"name": name, "labels": {"app": "plain-bench"}}, "spec": self.spec}
        start = time.perf_counter()
        self.core.create_namespaced_secret(namespace, {"metadata": {"name": name}, "data": self.secret_data})
        created = self.core.create_namespaced_pod(namespace, pod)
        owner = {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": created.metadata.uid}
        self.core.patch_namespaced_secret(name, namespace, {"metadata": {"ownerReferences": [owner]}})
        ip = None
        for event in watch.Watch().stream(
            self.core.list_namespaced_pod,
            namespace,
            field_selector=f"metadata.name={name}",
            timeout_seconds=600,
        ):
            seen = event["object"]
            if seen.status.phase == "Running" and seen.status.pod_ip:
                ip = seen.status.pod_ip
                break
            assert seen.status.phase not in ("Failed", "Succeeded"), seen.status
        assert ip is not None, "the plain pod did not run"
        kc = BlockingKernelClient()
        kc.load_connection_info({**self.info, "ip": ip})
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=600)
            reply = kc.execute_interactive(code, timeout=900, output_hook=lambda msg: None)
            took = time.perf_counter() - start
            assert reply["content"]["status"] == "ok", reply["content"]
        finally:
            kc.stop_channels()
        self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        wait_for(
            lambda: (
                not self.core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}").items
            ),
            300,
            "the plain pod to go",
        )
        return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,256,1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with chart_on_the_real_node("elastic-real-node-bench-") as chart:
        measure(chart, sizes, args.repeat)


@contextlib.contextmanager
def chart_on_the_real_node(prefix: str) -> Iterator[Chart]:
    """A control plane, the images in a registry, the real node, and the chart installed on it (as
    ``tests/test_chart_on_real_node.py`` does); all of it gone after."""
    paths = require_node()
    with (
        tempfile.TemporaryDirectory(prefix=prefix) as tmp,
        ControlPlane(Path(tmp) / "plane") as plane,
    ):
        api = plane.api_client()
        registry_dir = Path(tmp) / "registry"
        registry_dir.mkdir()
        registry = images_script("registry-start", str(registry_dir), str(free_port())).strip()
        node_dir = Path(f"/tmp/ekb-{os.getpid()}")  # short: shim sockets and mount options are length-limited
        try:
            with Node(node_dir, plane.admin_kubeconfig, paths=paths, registry=registry) as node:
                kernel, gateway_image = images_script("push", registry).split()
                images = {"kernel": kernel, "gateway": gateway_image}
                with installed_chart(api, node, images, plane, Path(tmp)) as chart:
                    yield chart
        finally:
            images_script("registry-stop", str(registry_dir))
            shutil.rmtree(node_dir, ignore_errors=True)


def measure(chart: Chart, sizes: list[int], repeat: int) -> None:
    gateway = chart.gateway()
    # The plain pods' template: the first elastic kernel pod, as the API returns it.
    _, kernel_id = elastic_start(chart, gateway)
    kernel_pod = chart.kernel_pod(kernel_id)
    secret = chart.core.read_namespaced_secret(kernel_pod.metadata.name, chart.namespace)
    plain = PlainPods(chart, kernel_pod, secret)
    marker = f"bench-marker-{uuid.uuid4().hex[:8]}"
    timed_cell(gateway, kernel_id, f"open('{CLAIM_IN_KERNEL}/{marker}', 'w').close()")
    # The claim's folder the pods mount. The marker stays: the server removes an owner's folder once
    # it is empty, and a plain pod's subPath mount would then make it again, as root.
    owner_dir = next(chart.storage.rglob(marker)).parent
    shut_down(chart, gateway, kernel_id)
    print_header(["what", "elastic kernel pod", "plain pod, same image and API calls", "elastic / plain"])
    rows: list[tuple[str, list[float], list[float]]] = []
    starts: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        took, kernel_id = elastic_start(chart, gateway)
        shut_down(chart, gateway, kernel_id)
        starts[0].append(took)
        starts[1].append(plain.run("print(6 * 7)"))
    rows.append(("start → first reply", *starts))
    for mib in sizes:
        nbytes = mib * MIB
        data = owner_dir / f"bench-{mib}.bin"
        with open(data, "wb") as out:
            for _ in range(mib):
                out.write(os.urandom(MIB))
        os.chown(data, 1000, 100)
        read = (
            f"buffer = bytearray({nbytes})\n"
            f"with open('{CLAIM_IN_KERNEL}/{data.name}', 'rb', buffering=0) as f:\n"
            "    view, got = memoryview(buffer), 0\n"
            "    while got < len(buffer):\n"
            "        got += f.readinto(view[got:])\n"
            "print(got)"
        )
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(repeat):
            times[0].append(elastic_resume(chart, gateway, nbytes))
            times[1].append(plain.run(read))
        data.unlink()
        rows.append((f"resume → first reply, {mib} MiB" if mib else "resume → first reply, 0", *times))
    for what, elastic, plain_times in rows:
        e, p = statistics.median(elastic), statistics.median(plain_times)
        print_row([what, f"{e:.2f} s", f"{p:.2f} s", f"{e / p:.2f}×"])
        sys.stdout.flush()


if __name__ == "__main__":
    main()
