"""N kernel pods started at once through the server, on the real control plane (issue 34, part 4).

A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) with kwok
nodes advertising HAMi GPU resources, and a real jupyter_server subprocess with the extension (or, with
``--gateway``, the multi-tenant gateway in token mode), configured with
``ElasticKernels.kernel_provisioner = elastic-kubernetes-provisioner`` and a declared inventory
of the nodes' GPUs. ``--kernels`` ``POST /api/kernels`` are sent at once (one thread each); kwok
marks each scheduled pod Running with an IP and runs nothing, so a start here is the server's
whole path up to a running pod (slice, Secret, pod, the shared pod watch), never a kernel.

Then, in that order: every kernel's model (``/api/elastic/kernels``: any kernel not ``running``
is *stuck*), the allocator's slices (``/api/elastic/gpus``) against the running kernels, the pods
against them; every kernel deleted at once; then whatever is left (kernels, slices, pods,
Secrets) once the pods are gone, or after ``--settle`` seconds.

``--over K`` sends K starts beyond the slices (they must be refused with a 4xx JSON reason);
``--repeat R`` runs R rounds on the same server. Run:
``python benchmarks/bench_kube_concurrent.py --kernels 200 --repeat 3`` (needs ``bash
scripts/envtest.sh build``). Prints a Markdown table for docs/benchmarks.md; ``--json FILE``
also writes the numbers; exits 1 if anything was stuck, lost or leaked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubernetes import client

from tests.support.kube import ControlPlane, fake_gpu_node, node_schedulable, wait_for
from tests.support.server import TOKEN, RunningServer, start_server

NAMESPACE = "concurrent"
GPUS_PER_NODE = 4
GPU_MIB = 40960
SPLIT = 10  # HAMi's default device split count: nvidia.com/gpu shares per GPU
PER_GPU = 4  # quarter-GPU kernels per GPU
PROFILES = {"quarter": {"gpu_fraction": 0.25, "memory_mib": 10240, "backend": "hami"}}
KERNELSPEC = "python3-gpu-quarter"
NODE_LABEL = {"elastic.bench/concurrent": "true"}


def call(server: RunningServer, method: str, path: str, body: Any = None) -> tuple[int, Any, float]:
    """One request with no client-side timeout shorter than the server's own (a start under load
    may take longer than the test helper's 60 s): (status, body, seconds)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method)
    request.add_header("Authorization", f"token {TOKEN}")
    request.add_header("Content-Type", "application/json")
    began = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None, time.perf_counter() - began
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            payload = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            payload = raw.decode(errors="replace")
        return err.code, payload, time.perf_counter() - began
    except OSError as exc:  # no answer at all
        return 0, str(exc), time.perf_counter() - began


def create_nodes(core: Any, count: int) -> list[str]:
    names = [f"cgpu-{i:03d}" for i in range(count)]
    for name in names:
        core.create_node(
            fake_gpu_node(
                name,
                gpus=GPUS_PER_NODE * SPLIT,
                gpumem_mib=GPUS_PER_NODE * GPU_MIB,
                gpucores=GPUS_PER_NODE * 100,
                labels=NODE_LABEL,
            )
        )

    def all_ready() -> bool:
        nodes = core.list_node(label_selector="elastic.bench/concurrent=true").items
        return len(nodes) == count and all(node_schedulable(n) for n in nodes)

    wait_for(all_ready, 120 + count, f"{count} kwok nodes to be schedulable")
    return names


def server_config(root: Path, plane: ControlPlane, nodes: list[str]) -> dict[str, Any]:
    inventory = [
        {"uuid": f"GPU-{node}-{g}", "name": "kwok A100", "memory_mib": GPU_MIB, "node": node}
        for node in nodes
        for g in range(GPUS_PER_NODE)
    ]
    return {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": inventory,
            "reap_interval": 1,
            "checkpoint_root": str(root / "checkpoints"),
            "kernel_provisioner": "elastic-kubernetes-provisioner",
        },
        "ElasticKubernetesProvisioner": {
            "namespace": NAMESPACE,
            "kubeconfig": str(plane.admin_kubeconfig),
            "image": "python:3.12",
            "node_selector": NODE_LABEL,
            "launch_timeout": 600.0,
            # kwok nodes run no kernel: nothing would ever answer the first kernel_info.
            "wait_for_first_reply": False,
        },
    }


def slices_of(server: RunningServer) -> list[str]:
    _, body, _ = call(server, "GET", "/api/elastic/gpus")
    return [s["kernel_id"] for d in body["devices"] for s in d["slices"]]


def left_in_cluster(core: Any) -> dict[str, int]:
    return {
        "pods": len(core.list_namespaced_pod(NAMESPACE).items),
        "secrets": sum(
            1 for s in core.list_namespaced_secret(NAMESPACE).items if s.metadata.name.startswith("kernel-")
        ),
    }


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    if not ordered:
        return {"p50": math.nan, "max": math.nan}
    return {"p50": statistics.median(ordered), "max": ordered[-1]}


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"kernels": args.kernels, "over": args.over, "gateway": args.gateway}
    began = time.perf_counter()
    plane = ControlPlane(root / "plane")
    plane.start()
    try:
        results["plane_seconds"] = time.perf_counter() - began
        admin = client.ApiClient(plane.configuration())
        core = client.CoreV1Api(admin)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
        began = time.perf_counter()
        node_count = math.ceil(args.kernels / (GPUS_PER_NODE * PER_GPU))
        if args.over and args.kernels % (GPUS_PER_NODE * PER_GPU):
            raise SystemExit(f"--over needs --kernels a multiple of {GPUS_PER_NODE * PER_GPU} (whole nodes)")
        nodes = create_nodes(core, node_count)
        results["nodes"] = node_count
        results["nodes_seconds"] = time.perf_counter() - began
        config = server_config(root, plane, nodes)
        if args.gateway:
            server = start_server(
                root / "server", config, extra_args=["--ElasticGateway.auth=token"], app_module="gateway.app"
            )
        else:
            server = start_server(root / "server", config)
        try:
            results["rounds"] = [exercise(server, core, args) for _ in range(args.repeat)]
        finally:
            server.stop()
        results["server_errors"] = server.log().count("Traceback")
    finally:
        plane.stop()
    return results


def exercise(server: RunningServer, core: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One round: ``--kernels`` + ``--over`` starts at once, checks, every kernel deleted at once."""
    out: dict[str, Any] = {}
    n = args.kernels
    sent = n + args.over
    with ThreadPoolExecutor(max_workers=sent) as pool:
        began = time.perf_counter()
        starts = list(
            pool.map(lambda _: call(server, "POST", "/api/kernels", {"name": KERNELSPEC}), range(sent))
        )
        out["start_seconds"] = time.perf_counter() - began
    out["start_latency"] = summary([s for status, _, s in starts if status == 201])
    out["start_status"] = dict(Counter(str(status) for status, _, _ in starts))
    out["start_errors"] = sorted({str(body)[:300] for status, body, _ in starts if status != 201})
    started = [body["id"] for status, body, _ in starts if status == 201]
    # A start past the slices must be refused with a JSON reason, never wedge or answer 500.
    out["refused_cleanly"] = all(
        status == 201 or (400 <= status < 500 and isinstance(body, dict) and body.get("message"))
        for status, body, _ in starts
    )

    _, kernels, _ = call(server, "GET", "/api/elastic/kernels")
    states = Counter(k["state"] for k in kernels)
    running = {k["id"] for k in kernels if k["state"] == "running"}
    out["states"] = dict(states)
    out["stuck"] = len(kernels) - len(running) + max(0, n - len(started))  # not running, or no kernel
    slices = slices_of(server)
    out["slices"] = len(slices)
    out["slices_match"] = sorted(slices) == sorted(running) == sorted(started)
    pods = core.list_namespaced_pod(NAMESPACE).items
    out["pods_running"] = sum(1 for p in pods if p.status.phase == "Running" and p.status.pod_ip)

    with ThreadPoolExecutor(max_workers=max(1, len(started))) as pool:
        began = time.perf_counter()
        deletes = list(pool.map(lambda k: call(server, "DELETE", f"/api/kernels/{k}"), started))
        out["delete_seconds"] = time.perf_counter() - began
    out["delete_status"] = dict(Counter(str(status) for status, _, _ in deletes))
    began = time.perf_counter()
    with contextlib.suppress(Exception):  # what is still there is counted below as leaked
        wait_for(
            lambda: left_in_cluster(core) == {"pods": 0, "secrets": 0}, args.settle, "pods and Secrets gone"
        )
    out["cleanup_seconds"] = time.perf_counter() - began
    _, after, _ = call(server, "GET", "/api/kernels")
    out["left"] = {**left_in_cluster(core), "slices": len(slices_of(server)), "kernels": len(after or [])}
    return out


def report(results: dict[str, Any], command: str) -> None:
    print(f"`{command}`\n")
    print(
        "| round | starts sent | all answered | start p50 / max | answers | stuck | "
        "slices = running kernels | pods Running | deletes (all answered) | pods + Secrets gone after | "
        "left (kernels, slices, pods, Secrets) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(results["rounds"], 1):
        left = r["left"]
        print(
            f"| {i} | {results['kernels'] + results['over']} | {r['start_seconds']:.1f} s | "
            f"{r['start_latency']['p50']:.1f} / {r['start_latency']['max']:.1f} s | {r['start_status']} | "
            f"{r['stuck']} | {r['slices']} ({'yes' if r['slices_match'] else 'NO'}) | {r['pods_running']} | "
            f"{r['delete_seconds']:.1f} s ({r['delete_status']}) | {r['cleanup_seconds']:.1f} s | "
            f"{left['kernels']}, {left['slices']}, {left['pods']}, {left['secrets']} |"
        )
    print(
        f"\n{results['nodes']} kwok nodes ({results['nodes'] * GPUS_PER_NODE * PER_GPU} quarter-GPU slices); "
        f"control plane up {results['plane_seconds']:.1f} s, "
        f"nodes schedulable {results['nodes_seconds']:.1f} s; "
        f"tracebacks in the server log: {results['server_errors']}"
    )
    for error in sorted({e for r in results["rounds"] for e in r["start_errors"]}):
        print(f"- start refused: {error}")


def clean(results: dict[str, Any]) -> bool:
    """Nothing stuck, every slice accounted for, nothing left, in every round."""
    n = results["kernels"]
    return results["server_errors"] == 0 and all(
        r["stuck"] == 0
        and r["refused_cleanly"]
        and r["start_status"].get("201") == n
        and r["slices_match"]
        and r["slices"] == n
        and r["pods_running"] == n
        and r["delete_status"] == {"204": n}
        and all(v == 0 for v in r["left"].values())
        for r in results["rounds"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--kernels", type=int, default=200, help="kernels started at once")
    parser.add_argument("--over", type=int, default=0, help="starts sent beyond the slices (refused)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds on the same server and cluster")
    parser.add_argument(
        "--gateway", action="store_true", help="through the gateway (jupyter elastic-gateway, token auth)"
    )
    parser.add_argument("--settle", type=float, default=300.0, help="seconds to wait for pods to be gone")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-kube-concurrent-") as tmp:
        results = run(args, Path(tmp))
    report(results, "python benchmarks/bench_kube_concurrent.py " + " ".join(argv or sys.argv[1:]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if clean(results) else 1


if __name__ == "__main__":
    sys.exit(main())
