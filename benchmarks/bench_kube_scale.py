"""Kernels as pods at scale: API calls, memory, watch latency, against per-kernel polling.

A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and kwok
with ``--nodes`` fake GPU nodes (HAMi resources: ``nvidia.com/gpu``, ``gpumem``, ``gpucores``).
kwok marks a scheduled pod Running with a pod IP and runs nothing, so this measures the
provisioner and the cluster's answers, never a kernel: ``--kernels`` starts through the real
:class:`~kernelmgr.provisioners.kubernetes.ElasticKubernetesProvisioner` (the provisioner
jupyter_client creates for the kernelspec, then ``pre_launch`` + ``launch_kernel``, as
``AsyncKernelManager.start_kernel`` calls them; its ZMQ connection afterwards is left out), and
shutdowns through ``kill`` + ``cleanup``.

Measured, side by side in one run:

* **API requests** per start, per shutdown and per tick, counted twice: in the client (the
  provisioner's ``ApiClient.call_api``, wrapped here, not in product code) and on the API
  server (its audit log, one ``RequestReceived`` event per request, for the benchmark's own
  users only: ``elastic-bench`` is the provisioner and its pod watch, ``eg-baseline`` the
  baseline below);
* **a tick**: what runs every few seconds per kernel in a server: jupyter_client's restarter
  check (``AsyncKernelManager.is_alive`` → ``provisioner.poll``) for every kernel, plus one
  tick of the project's :class:`~kernelmgr.server.culler.Culler` over all of them (half idle
  past the warning point); and **the baseline**, labeled so: what Enterprise Gateway and
  gateway_provisioners do on the same restarter check, one ``list_namespaced_pod`` with a
  ``kernel_id=`` label selector per kernel per check (and a variant with one GET per kernel),
  implemented here in the benchmark;
* **memory**: the process's resident size before the first start and after the last, per
  kernel; and the pod watch's cache alone (a second informer listing the same pods, under
  tracemalloc), per pod;
* **the watch's event-to-model latency**: a label patch sent (admin client) until the shared
  informer's cache holds the new pod (the moment it notifies waiters), one patch at a time and
  as a burst of one patch per kernel from 4 threads;
* **our own time in a start** beside the API round trips: per start, the time inside API calls
  (request, response, (de)serialization, in worker threads), the time waiting on the watch for
  the pod to run (scheduler + kwok + watch delivery), the time waiting for a free worker thread
  (the loop's default executor, metered) and the rest (our code, thread hand-offs, event loop);
  starts one at a time first (``--sequential``), then ``--concurrency`` at once; plus the
  process CPU time per start, the watch thread's CPU per event, the full garbage collections
  and the event loop's worst stall.

Run: ``python benchmarks/bench_kube_scale.py --kernels 1000 --nodes 100`` (``--quick``: 5
kernels on 2 nodes, a smoke test). Needs ``bash scripts/envtest.sh build``. Prints Markdown
tables for docs/benchmarks.md; ``--json FILE`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gc
import json
import logging
import os
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.provisioning import KernelProvisionerFactory
from kubernetes import client
from traitlets.config import Config, Configurable

from benchmarks.markdown import print_header, print_row
from kernelmgr.config import CullPolicy, ElasticKernels, ElasticRuntime
from kernelmgr.kube.cluster import KubeCluster
from kernelmgr.kube.informer import PodInformer
from kernelmgr.kube.labels import KERNEL_ID_LABEL
from kernelmgr.kube.settings import KubeSettings
from kernelmgr.lifecycle.records import KernelStateFile
from kernelmgr.lifecycle.service import Hibernator
from kernelmgr.provisioners import kubernetes as kprov
from kernelmgr.server.culler import Culler
from tests.support.kube import ControlPlane, fake_gpu_node, node_schedulable, wait_for

NAMESPACE = "bench"
BENCH_USER = "elastic-bench"
BASELINE_USER = "eg-baseline"
GPUS_PER_NODE = 4
GPU_MIB = 40960
#: HAMi splits each GPU into this many ``nvidia.com/gpu`` shares (its default device split count).
SPLIT = 10
PROFILE = {"quarter": {"gpu_fraction": 0.25, "memory_mib": 10240, "backend": "hami"}}
POLL_INTERVAL = 3.0  # jupyter_client's KernelRestarter.time_to_dead: one check per kernel this often
AUDIT_POLICY = f"""\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [ResponseStarted, ResponseComplete, Panic]
rules:
- level: Metadata
  users: [{BENCH_USER}, {BASELINE_USER}]
- level: None
"""


# ---- counting API requests ------------------------------------------------------------------


@dataclass
class Costs:
    """What one operation (a start, a shutdown) spent, filled in by the wrappers below."""

    api_calls: int = 0
    api_seconds: float = 0.0
    watch_seconds: float = 0.0
    queue_seconds: float = 0.0
    total: float = 0.0
    calls: Counter[str] = field(default_factory=Counter)


CURRENT: contextvars.ContextVar[Costs | None] = contextvars.ContextVar("bench_costs", default=None)


def request_kind(method: str, url: str) -> str:
    """``DELETE pods/{name}`` from ``DELETE https://.../namespaces/bench/pods/kernel-1?grace...``."""
    found = re.search(r"/namespaces/[^/]+/([a-z]+)(/[^/?]+)?(/[a-z]+)?", url.split("?")[0])
    if found is None:
        return f"{method} {url.split('?')[0]}"
    resource, name, sub = found.groups()
    return f"{method} {resource}" + ("/{name}" if name else "") + (sub or "")


class ClientCounter:
    """Wraps one ``ApiClient``'s ``call_api``: counts requests, globally and per operation.

    ``asyncio.to_thread`` copies the caller's context, so a call made in a worker thread is
    charged to the start or shutdown that made it.
    """

    def __init__(self, api: client.ApiClient) -> None:
        self.total: Counter[str] = Counter()
        self._lock = threading.Lock()
        original = api.call_api

        def call_api(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            key = request_kind(method, url)
            start = time.perf_counter()
            try:
                response = original(method, url, *args, **kwargs)
                status = getattr(response, "status", 200)
                if isinstance(status, int) and status >= 400:
                    key += f" → {status}"
                return response
            except client.ApiException as exc:
                key += f" → {exc.status}"
                raise
            finally:
                elapsed = time.perf_counter() - start
                with self._lock:
                    self.total[key] += 1
                costs = CURRENT.get()
                if costs is not None:
                    costs.api_calls += 1
                    costs.api_seconds += elapsed
                    costs.calls[key] += 1

        api.call_api = call_api  # type: ignore[method-assign]

    def count(self) -> int:
        with self._lock:
            return sum(self.total.values())


class MeteredExecutor(ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``), same size as asyncio's own default,
    charging the time a call waits for a free worker thread to the operation that made it."""

    def __init__(self) -> None:
        super().__init__(max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="asyncio")

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        costs = CURRENT.get()  # submit runs on the loop, in the operation's context
        queued = time.perf_counter()

        def run() -> Any:
            if costs is not None:
                costs.queue_seconds += time.perf_counter() - queued
            return fn(*args, **kwargs)

        return super().submit(run)


class AuditLog:
    """The API server's audit log: one line per request received from the benchmark's users."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def since(self, offset: int, user: str) -> Counter[str]:
        """Requests per "verb resource[/subresource]" by ``user`` after ``offset``."""
        counts: Counter[str] = Counter()
        if not self.path.exists():
            return counts
        with self.path.open("rb") as handle:
            handle.seek(offset)
            for line in handle:
                event = json.loads(line)
                if event.get("user", {}).get("username") != user:
                    continue
                ref = event.get("objectRef") or {}
                what = ref.get("resource", event.get("requestURI", "?"))
                if ref.get("subresource"):
                    what += "/" + ref["subresource"]
                counts[f"{event['verb']} {what}"] += 1
        return counts


WATCH_KEYS = ("list pods", "watch pods")


def without_watch(counts: Counter[str]) -> int:
    """Requests of the provisioner itself (the pod watch's own list/watch calls left out)."""
    return sum(n for key, n in counts.items() if key not in WATCH_KEYS)


# ---- small measurements ---------------------------------------------------------------------


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_cpu_seconds(native_id: int | None) -> float:
    """User + system CPU of one thread of this process (from /proc)."""
    if native_id is None:
        return 0.0
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_full_gc() -> float:
    """Seconds one full collection takes (median of 3): how long it stops every thread."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class GcPauses:
    """Full (generation 2) garbage collections and how long each stopped every thread."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._started)

    def take(self) -> list[float]:
        pauses, self.pauses = self.pauses, []
        return pauses


class LoopLag:
    """Measures how late a 10 ms sleep wakes up: the event loop's stalls."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            self.samples.append(time.perf_counter() - start - 0.01)

    def start(self) -> None:
        self.samples = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> list[float]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.samples


# ---- the cluster ----------------------------------------------------------------------------


def start_plane(root: Path) -> tuple[ControlPlane, AuditLog]:
    policy = root / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    audit = root / "audit.log"
    plane = ControlPlane(
        root / "plane",
        extra_args={
            "kube-apiserver": [
                f"--audit-policy-file={policy}",
                f"--audit-log-path={audit}",
                "--audit-log-mode=blocking",
                "--audit-log-maxsize=0",
            ]
        },
    )
    plane.start()
    return plane, AuditLog(audit)


def create_nodes(core: Any, count: int) -> None:
    for i in range(count):
        core.create_node(
            fake_gpu_node(
                f"gpu-{i:03d}",
                gpus=GPUS_PER_NODE * SPLIT,
                gpumem_mib=GPUS_PER_NODE * GPU_MIB,
                gpucores=GPUS_PER_NODE * 100,
                labels={"elastic.bench/node": "true"},
            )
        )

    def all_ready() -> bool:
        nodes = core.list_node(label_selector="elastic.bench/node=true").items
        return len(nodes) == count and all(node_schedulable(n) for n in nodes)

    wait_for(all_ready, 120 + count, f"{count} kwok nodes to be schedulable")


class Holder(Configurable):
    """Stands in for the elastic kernel manager: the parent that carries the runtime."""

    elastic_runtime: ElasticRuntime


class KernelManagerStandIn:
    """Just enough of the elastic kernel manager for the culler's tick: the real kernel managers."""

    def __init__(self, kernels: dict[str, AsyncKernelManager]) -> None:
        self.kernels = kernels
        self.log = logging.getLogger("bench")
        self.starting_kernels: set[str] = set()

    def __contains__(self, kernel_id: object) -> bool:
        return kernel_id in self.kernels

    def get_kernel(self, kernel_id: str) -> AsyncKernelManager:
        return self.kernels[kernel_id]


def build_runtime(root: Path, nodes: int) -> ElasticRuntime:
    inventory = [
        {"uuid": f"GPU-{n:03d}-{g}", "name": "kwok A100", "memory_mib": GPU_MIB, "node": f"gpu-{n:03d}"}
        for n in range(nodes)
        for g in range(GPUS_PER_NODE)
    ]
    elastic = ElasticKernels(profiles=PROFILE, gpu_inventory=inventory, checkpoint_root=str(root / "ck"))
    return elastic.build()


def kernel_spec_dir(root: Path, kubeconfig: Path) -> Path:
    spec_dir = root / "kernels" / "pod-quarter"
    spec_dir.mkdir(parents=True)
    provisioner_config = {
        "namespace": NAMESPACE,
        "kubeconfig": str(kubeconfig),
        "image": "python:3.12",
        "node_selector": {"elastic.bench/node": "true"},
        "launch_timeout": 600.0,
        "stop_timeout": 600.0,
    }
    spec = {
        "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (pod, quarter)",
        "language": "python",
        "interrupt_mode": "message",
        "metadata": {
            "kernel_provisioner": {"provisioner_name": kprov.PROVISIONER_NAME, "config": provisioner_config},
            "elastic": {"profile": "quarter"},
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return root / "kernels"


# ---- the phases -----------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, plane: ControlPlane, audit: AuditLog) -> None:
        self.args = args
        self.root = root
        self.plane = plane
        self.audit = audit
        self.admin = client.ApiClient(plane.configuration())
        self.kubeconfig = plane.user_kubeconfig(BENCH_USER, ["system:masters"])
        self.runtime = build_runtime(root, args.nodes)
        # What the server extension makes: the clients and the one pod watch the provisioners share.
        self.runtime.kube = KubeCluster(KubeSettings(kubeconfig=str(self.kubeconfig), namespace=NAMESPACE))
        self.holder = Holder()
        self.holder.elastic_runtime = self.runtime
        self.ksm = KernelSpecManager(kernel_dirs=[str(kernel_spec_dir(root, self.kubeconfig))])
        self.api = self.runtime.kube.api()
        self.counter = ClientCounter(self.api)
        self.kms: dict[str, AsyncKernelManager] = {}
        self.results: dict[str, Any] = {}
        self.notified: dict[str, float] = {}
        self.events = 0
        self.lag = LoopLag()
        self.gc = GcPauses()

    # -- the shared informer, instrumented from outside

    def start_informer(self) -> PodInformer:
        informer = self.runtime.kube.pod_informer()
        original_wait = informer.wait_for

        def notify(changes: Any) -> None:  # a listener: runs on the watch thread as the cache changes
            now = time.perf_counter()
            for kernel_id in changes:
                self.notified[kernel_id] = now
                self.events += 1

        async def timed_wait(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await original_wait(*args, **kwargs)
            finally:
                costs = CURRENT.get()
                if costs is not None:
                    costs.watch_seconds += time.perf_counter() - start

        informer.add_listener(notify)
        informer.wait_for = timed_wait  # type: ignore[method-assign]
        wait_for(lambda: informer.synced, 60, "the pod watch's first list")
        self.informer = informer
        return informer

    def informer_cpu(self) -> float:
        thread = self.informer._thread
        return thread_cpu_seconds(thread.native_id if thread else None)

    # -- starts and shutdowns

    async def start_one(self, kernel_id: str) -> Costs:
        costs = Costs()
        CURRENT.set(costs)
        km = AsyncKernelManager(parent=self.holder, kernel_name="pod-quarter", kernel_spec_manager=self.ksm)
        km.kernel_id = kernel_id
        start = time.perf_counter()
        # What AsyncKernelManager.start_kernel does up to the kernel's connection info.
        provisioner = KernelProvisionerFactory.instance(parent=km.parent).create_provisioner_instance(
            kernel_id, km.kernel_spec, parent=km
        )
        km.provisioner = provisioner
        kw = await provisioner.pre_launch()
        cmd = kw.pop("cmd")
        info = await provisioner.launch_kernel(cmd, **kw)
        costs.total = time.perf_counter() - start
        assert info["ip"], info
        self.kms[kernel_id] = km
        return costs

    async def stop_one(self, kernel_id: str) -> Costs:
        costs = Costs()
        CURRENT.set(costs)
        provisioner = self.kms[kernel_id].provisioner
        assert provisioner is not None
        start = time.perf_counter()
        await provisioner.kill()
        await provisioner.cleanup()
        costs.total = time.perf_counter() - start
        return costs

    async def run_many(self, fn: Any, ids: list[str], concurrency: int) -> list[Costs]:
        gate = asyncio.Semaphore(concurrency)

        async def one(kernel_id: str) -> Costs:
            async with gate:
                # a task of its own: its own copy of the context, so CURRENT is per operation
                return await asyncio.create_task(fn(kernel_id))

        return list(await asyncio.gather(*(one(k) for k in ids)))

    async def phase(self, name: str, fn: Any, ids: list[str]) -> None:
        """``ids[:sequential]`` one at a time, the rest ``concurrency`` at once."""
        seq = ids[: self.args.sequential]
        rest = ids[self.args.sequential :]
        mark = self.audit.mark()
        client_before = self.counter.count()
        cpu_before = cpu_seconds()
        informer_cpu_before = self.informer_cpu()
        events_before = self.events
        self.lag.start()
        self.gc.take()
        start = time.perf_counter()
        sequential = [await asyncio.create_task(fn(k)) for k in seq]
        seq_wall = time.perf_counter() - start
        start = time.perf_counter()
        concurrent = await self.run_many(fn, rest, self.args.concurrency)
        conc_wall = time.perf_counter() - start
        lags = await self.lag.stop()
        pauses = self.gc.take()
        await asyncio.sleep(0.5)  # late watch events of this phase
        server = self.audit.since(mark, BENCH_USER)
        n = len(ids)
        self.results[name] = {
            "count": n,
            "client_calls": (self.counter.count() - client_before) / n,
            "server_calls": without_watch(server) / n,
            "server_breakdown": {k: v / n for k, v in sorted(server.items()) if k not in WATCH_KEYS},
            "watch_requests": server["list pods"] + server["watch pods"],
            "client_breakdown": {
                k: v / n
                for k, v in sorted(sum((c.calls for c in sequential + concurrent), Counter()).items())
            },
            "cpu_ms": (cpu_seconds() - cpu_before) * 1000 / n,
            "informer_cpu_ms_per_event": (self.informer_cpu() - informer_cpu_before)
            * 1000
            / max(1, self.events - events_before),
            "watch_events": self.events - events_before,
            "loop_lag_p99_ms": pct(lags, 99) * 1000,
            "loop_lag_max_ms": max(lags, default=0.0) * 1000,
            "full_gcs": len(pauses),
            "full_gc_max_ms": max(pauses, default=0.0) * 1000,
            "sequential": summarize(sequential, seq_wall),
            "concurrent": summarize(concurrent, conc_wall),
        }

    # -- ticks: ours (cache) against the baseline (one request per kernel)

    async def ticks(self) -> None:
        args = self.args
        config = Config({"CullPolicy": {"idle_timeout": 600, "warn_before": 60, "interval": 30}})
        policy = CullPolicy(config=config).build(list(self.runtime.profiles))
        mkm = KernelManagerStandIn(self.kms)
        hibernator = Hibernator(mkm, self.runtime, KernelStateFile(self.root / "kernels.json"))  # type: ignore[arg-type]
        now = time.time()
        for n, kernel_id in enumerate(self.kms):
            hibernator.activity.get(kernel_id).last_execution_end = now - (30 if n % 2 else 580)
        culler = Culler(mkm, self.runtime, hibernator, policy, None, broadcast=lambda _k, _t: 0)  # type: ignore[arg-type]

        mark = self.audit.mark()
        client_before = self.counter.count()
        tick_times, culler_times, decided = [], [], 0
        self.lag.start()
        for _ in range(args.ticks):
            start = time.perf_counter()
            alive = [await km.is_alive() for km in self.kms.values()]  # the restarter's check
            mid = time.perf_counter()
            decided += len(await culler.tick())
            tick_times.append(time.perf_counter() - start)
            culler_times.append(time.perf_counter() - mid)
            assert all(alive), "a kernel pod is not running"
        lags = await self.lag.stop()
        await asyncio.sleep(0.5)
        server = self.audit.since(mark, BENCH_USER)
        ours = {
            "client_calls": (self.counter.count() - client_before) / args.ticks,
            "server_calls": without_watch(server) / args.ticks,
            "watch_requests": server["list pods"] + server["watch pods"],
            "tick_ms": statistics.median(tick_times) * 1000,
            "culler_ms": statistics.median(culler_times) * 1000,
            "decisions": decided / args.ticks,
            "loop_lag_max_ms": max(lags, default=0.0) * 1000,
        }

        baseline_api = client.ApiClient(
            self.plane.configuration(user=BASELINE_USER, groups=["system:masters"])
        )
        baseline_counter = ClientCounter(baseline_api)
        core: Any = client.CoreV1Api(baseline_api)
        ids = list(self.kms)

        def list_tick() -> bool:  # Enterprise Gateway / gateway_provisioners' poll(), once per kernel
            # (EG selects its own bare kernel_id label; ours is the prefixed one: the same one LIST.)
            phases = [
                core.list_namespaced_pod(NAMESPACE, label_selector=f"{KERNEL_ID_LABEL}={k}").items
                for k in ids
            ]
            return all(p and p[0].status.phase == "Running" for p in phases)

        def get_tick() -> bool:  # the cheapest per-kernel poll: one GET of the pod
            return all(
                core.read_namespaced_pod(f"kernel-{k}", NAMESPACE).status.phase == "Running" for k in ids
            )

        baselines = {}
        for label, tick in (("list", list_tick), ("get", get_tick)):
            mark = self.audit.mark()
            before = baseline_counter.count()
            times = []
            for _ in range(args.baseline_ticks):
                start = time.perf_counter()
                assert await asyncio.to_thread(tick)
                times.append(time.perf_counter() - start)
            await asyncio.sleep(0.5)
            server = self.audit.since(mark, BASELINE_USER)
            baselines[label] = {
                "client_calls": (baseline_counter.count() - before) / args.baseline_ticks,
                "server_calls": sum(server.values()) / args.baseline_ticks,
                "tick_ms": statistics.median(times) * 1000,
            }
        baseline_api.close()
        self.results["tick"] = {"ours": ours, **{f"baseline_{k}": v for k, v in baselines.items()}}

    # -- the watch's latency

    async def latency(self) -> None:
        core: Any = client.CoreV1Api(self.admin)
        ids = list(self.kms)
        samples = ids[: self.args.latency_samples] or ids

        def patch(kernel_id: str, value: str) -> tuple[float, float]:
            start = time.perf_counter()
            core.patch_namespaced_pod(
                f"kernel-{kernel_id}", NAMESPACE, {"metadata": {"labels": {"bench-touch": value}}}
            )
            return start, time.perf_counter()

        def touched(value: str) -> Any:
            return lambda pod: pod is not None and (pod.metadata.labels or {}).get("bench-touch") == value

        sequential, rtts, to_waiter = [], [], []
        for n, kernel_id in enumerate(samples):
            value = f"s{n}"
            sent, answered = await asyncio.to_thread(patch, kernel_id, value)
            await self.informer.wait_for(kernel_id, touched(value), 30)
            woke = time.perf_counter()
            sequential.append(self.notified[kernel_id] - sent)
            to_waiter.append(woke - sent)
            rtts.append(answered - sent)

        sent_at: dict[str, float] = {}

        def send(kernel_id: str) -> None:
            sent_at[kernel_id] = patch(kernel_id, "burst")[0]

        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            waits = [self.informer.wait_for(k, touched("burst"), 120) for k in ids]
            await asyncio.gather(asyncio.to_thread(lambda: list(pool.map(send, ids))), *waits)
        burst_wall = time.perf_counter() - start
        burst = [self.notified[k] - sent_at[k] for k in ids]
        self.results["latency"] = {
            "sequential": percentiles(sequential),
            "sequential_to_waiter": percentiles(to_waiter),
            "patch_rtt": percentiles(rtts),
            "burst": percentiles(burst),
            "burst_rate": len(ids) / burst_wall,
        }

    # -- memory

    def one_pod_costs(self) -> None:
        """One kernel pod as JSON, as a plain dict and as the client's model (what the cache holds)."""
        core: Any = client.CoreV1Api(self.admin)
        raw = core.list_namespaced_pod(
            NAMESPACE, label_selector="app.kubernetes.io/component=kernel", limit=1, _preload_content=False
        )
        text = json.dumps(json.loads(raw.data)["items"][0])

        def size_and_time(make: Any) -> tuple[float, float]:
            gc.collect()
            tracemalloc.start()
            kept = [make() for _ in range(20)]
            size, _ = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del kept
            times = []
            for _ in range(50):
                start = time.perf_counter()
                make()
                times.append(time.perf_counter() - start)
            return size / 20 / 1024, statistics.median(times) * 1000

        dict_kib, dict_ms = size_and_time(lambda: json.loads(text))
        model_kib, model_ms = size_and_time(lambda: self.api.deserialize(text, "V1Pod", "application/json"))
        self.results["one_pod"] = {
            "json_kib": len(text) / 1024,
            "dict_kib": dict_kib,
            "dict_ms": dict_ms,
            "model_kib": model_kib,
            "model_ms": model_ms,
        }

    def cache_memory(self) -> None:
        """A second informer's list of the same pods, under tracemalloc: the cache's own size."""
        gc.collect()
        objects_before = len(gc.get_objects())
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        informer = PodInformer(
            client.ApiClient(self.api.configuration), NAMESPACE, "app.kubernetes.io/component=kernel"
        ).start()
        wait_for(lambda: informer.synced, 120, "the second informer's list")
        informer.stop()
        gc.collect()
        cached, peak = tracemalloc.get_traced_memory()
        cache = informer.items()
        count = len(cache)
        objects = len(gc.get_objects()) - objects_before
        # The informer drops managedFields as it caches; this measures what is left per pod.
        gc.collect()
        stripped, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.results["cache"] = {
            "pods": count,
            "kib_per_pod": (cached - base) / 1024 / max(1, count),
            "peak_kib_per_pod": (peak - base) / 1024 / max(1, count),
            "managed_fields_kib_per_pod": (cached - stripped) / 1024 / max(1, count),
            "gc_objects_per_pod": objects / max(1, count),
        }


def summarize(costs: list[Costs], wall: float) -> dict[str, float]:
    if not costs:
        return {"count": 0}
    totals = [c.total for c in costs]
    return {
        "count": len(costs),
        "wall_s": wall,
        "per_second": len(costs) / wall if wall else float("nan"),
        "p50_ms": pct(totals, 50) * 1000,
        "p90_ms": pct(totals, 90) * 1000,
        "p99_ms": pct(totals, 99) * 1000,
        "mean_ms": statistics.fmean(totals) * 1000,
        "api_ms": statistics.fmean(c.api_seconds for c in costs) * 1000,
        "watch_ms": statistics.fmean(c.watch_seconds for c in costs) * 1000,
        "queue_ms": statistics.fmean(c.queue_seconds for c in costs) * 1000,
        "ours_ms": statistics.fmean(
            c.total - c.api_seconds - c.watch_seconds - c.queue_seconds for c in costs
        )
        * 1000,
        "api_calls": statistics.fmean(c.api_calls for c in costs),
    }


def percentiles(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": pct(values, 50) * 1000,
        "p90_ms": pct(values, 90) * 1000,
        "p99_ms": pct(values, 99) * 1000,
        "max_ms": max(values, default=float("nan")) * 1000,
    }


async def scenario(bench: Bench) -> None:
    args = bench.args
    core: Any = client.CoreV1Api(bench.admin)
    asyncio.get_running_loop().set_default_executor(MeteredExecutor())
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    bench.start_informer()
    ids = [str(uuid.uuid4()) for _ in range(args.kernels)]
    gc.collect()
    gc_before = timed_full_gc()
    rss_before, objects_before = rss_kib(), len(gc.get_objects())
    await bench.phase("start", bench.start_one, ids)
    gc.collect()
    gc_after = timed_full_gc()
    rss_after, objects_after = rss_kib(), len(gc.get_objects())
    pods = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=kernel").items
    running = sum(1 for p in pods if p.status.phase == "Running" and p.status.pod_ip)
    assert running == args.kernels, f"{running} of {args.kernels} kernel pods running"
    nodes_used = len({p.spec.node_name for p in pods})
    bench.results["memory"] = {
        "rss_before_mib": rss_before / 1024,
        "rss_after_mib": rss_after / 1024,
        "kib_per_kernel": (rss_after - rss_before) / args.kernels,
        "gc_objects_per_kernel": (objects_after - objects_before) / args.kernels,
        "gc_objects_before": objects_before,
        "gc_objects_after": objects_after,
        "full_gc_before_ms": gc_before * 1000,
        "full_gc_after_ms": gc_after * 1000,
    }
    bench.results["cluster"] = {"running": running, "nodes_used": nodes_used}
    bench.cache_memory()
    bench.one_pod_costs()
    await bench.ticks()
    await bench.latency()
    await bench.phase("shutdown", bench.stop_one, ids)
    left_pods = len(core.list_namespaced_pod(NAMESPACE).items)
    left_secrets = len(
        core.list_namespaced_secret(NAMESPACE, label_selector="app.kubernetes.io/component=kernel").items
    )
    bench.results["left"] = {
        "pods": left_pods,
        "secrets": left_secrets,
        "slices": len(bench.runtime.allocator.slices()),
    }


# ---- output ---------------------------------------------------------------------------------


def ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    start, stop, tick, lat = results["start"], results["shutdown"], results["tick"], results["latency"]
    ours, blist, bget = tick["ours"], tick["baseline_list"], tick["baseline_get"]
    n = args.kernels
    per_hour = 3600 / POLL_INTERVAL
    used = results["cluster"]["nodes_used"]
    print(
        f"{n} kernels on {args.nodes} kwok nodes ({used} used); "
        f"ticks: {args.ticks} ours, {args.baseline_ticks} per baseline\n"
    )

    print_header(
        [
            "API requests",
            "client-counted",
            "server (audit log)",
            "goal",
            "per hour, one check per kernel every 3 s",
        ]
    )
    # The goal counts the start's own requests; the Kubernetes Event ("KernelStarted", created in the
    # background off the start's path) is the one more.
    print_row(
        [
            "per kernel start",
            f"{start['client_calls']:.2f}",
            f"{start['server_calls']:.2f}",
            "≤ 3 + 1 Event",
            "",
        ]
    )
    print_row(
        [
            "per kernel shutdown (kill + cleanup)",
            f"{stop['client_calls']:.2f}",
            f"{stop['server_calls']:.2f}",
            "",
            "",
        ]
    )
    print_row(
        [
            f"per tick, ours: restarter check + culler tick over {n} kernels",
            f"{ours['client_calls']:.0f}",
            f"{ours['server_calls']:.0f}",
            "0",
            f"{ours['server_calls'] * per_hour:.0f} (+ 12 watch renewals)",
        ]
    )
    print_row(
        [
            "per tick, **baseline** (EG/gateway_provisioners): LIST by `kernel_id` label per kernel",
            f"{blist['client_calls']:.0f}",
            f"{blist['server_calls']:.0f}",
            "",
            f"{blist['server_calls'] * per_hour:,.0f}",
        ]
    )
    print_row(
        [
            "per tick, **baseline**: GET pod per kernel",
            f"{bget['client_calls']:.0f}",
            f"{bget['server_calls']:.0f}",
            "",
            f"{bget['server_calls'] * per_hour:,.0f}",
        ]
    )
    print()
    print(
        "Requests seen by the API server per start: "
        + ", ".join(f"{k} {v:.2f}" for k, v in start["server_breakdown"].items())
    )
    print("Per shutdown: " + ", ".join(f"{k} {v:.2f}" for k, v in stop["server_breakdown"].items()))
    print(
        "Per shutdown, as the client saw them: "
        + ", ".join(f"`{k}` {v:.2f}" for k, v in stop["client_breakdown"].items())
    )
    print()

    print_header(["tick over all kernels", "median time", "API requests", "vs ours"])
    print_row(
        [
            "ours: restarter check (cache) + culler tick",
            ms(ours["tick_ms"]),
            f"{ours['server_calls']:.0f}",
            "1.00×",
        ]
    )
    print_row(["of which the culler tick", ms(ours["culler_ms"]), "0", ""])
    print_row(
        [
            "**baseline**: LIST by label per kernel",
            ms(blist["tick_ms"]),
            f"{blist['server_calls']:.0f}",
            f"{blist['tick_ms'] / ours['tick_ms']:.0f}×",
        ]
    )
    print_row(
        [
            "**baseline**: GET per kernel",
            ms(bget["tick_ms"]),
            f"{bget['server_calls']:.0f}",
            f"{bget['tick_ms'] / ours['tick_ms']:.0f}×",
        ]
    )
    print()

    print_header(
        [
            "operation",
            "how",
            "count",
            "rate",
            "p50",
            "p90",
            "p99",
            "mean",
            "in API calls",
            "waiting on the watch",
            "waiting for a worker thread",
            "ours (rest)",
            "API calls",
        ]
    )
    for label, phase in (("start", start), ("shutdown", stop)):
        for how in ("sequential", "concurrent"):
            s = phase[how]
            if not s.get("count"):
                continue
            how_text = "one at a time" if how == "sequential" else f"{args.concurrency} at once"
            print_row(
                [
                    label,
                    how_text,
                    str(s["count"]),
                    f"{s['per_second']:.1f}/s",
                    ms(s["p50_ms"]),
                    ms(s["p90_ms"]),
                    ms(s["p99_ms"]),
                    ms(s["mean_ms"]),
                    ms(s["api_ms"]),
                    ms(s["watch_ms"]),
                    ms(s["queue_ms"]),
                    ms(s["ours_ms"]),
                    f"{s['api_calls']:.2f}",
                ]
            )
    print()
    print_header(["", "start", "shutdown"])
    print_row(["process CPU per kernel (all threads)", ms(start["cpu_ms"]), ms(stop["cpu_ms"])])
    print_row(["pod watch events", str(start["watch_events"]), str(stop["watch_events"])])
    print_row(
        ["the watch's own requests (list, watch)", str(start["watch_requests"]), str(stop["watch_requests"])]
    )
    print_row(
        [
            "watch thread CPU per event",
            ms(start["informer_cpu_ms_per_event"]),
            ms(stop["informer_cpu_ms_per_event"]),
        ]
    )
    print_row(
        [
            "full garbage collections (generation 2), count / longest",
            f"{start['full_gcs']} / {start['full_gc_max_ms']:.0f} ms",
            f"{stop['full_gcs']} / {stop['full_gc_max_ms']:.0f} ms",
        ]
    )
    print_row(
        [
            "event loop stall, p99 / max",
            f"{start['loop_lag_p99_ms']:.1f} / {start['loop_lag_max_ms']:.1f} ms",
            f"{stop['loop_lag_p99_ms']:.1f} / {stop['loop_lag_max_ms']:.1f} ms",
        ]
    )
    print()

    print_header(["watch: label patch sent → informer cache", "n", "p50", "p90", "p99", "max"])
    for label, key in (
        ("one at a time", "sequential"),
        ("one at a time, until the waiting coroutine runs", "sequential_to_waiter"),
        ("(the patch's own round trip)", "patch_rtt"),
        (f"burst: {n} patches from 4 threads ({lat['burst_rate']:.0f}/s)", "burst"),
    ):
        p = lat[key]
        print_row([label, str(p["n"]), ms(p["p50_ms"]), ms(p["p90_ms"]), ms(p["p99_ms"]), ms(p["max_ms"])])
    print()

    mem, cache = results["memory"], results["cache"]
    print_header(["memory", "value"])
    print_row(
        [
            f"process RSS before the first start → after {n} running",
            f"{mem['rss_before_mib']:.0f} → {mem['rss_after_mib']:.0f} MiB",
        ]
    )
    print_row(
        [
            "RSS per running kernel (provisioner, kernel manager, records, cached pod)",
            f"{mem['kib_per_kernel']:.1f} KiB",
        ]
    )
    print_row(
        ["objects the garbage collector tracks, per running kernel", f"{mem['gc_objects_per_kernel']:.0f}"]
    )
    print_row(
        [
            "a full garbage collection (all threads stop): before the first start → with all running",
            f"{mem['full_gc_before_ms']:.0f} → {mem['full_gc_after_ms']:.0f} ms "
            f"({mem['gc_objects_before'] / 1000:.0f}k → {mem['gc_objects_after'] / 1000:.0f}k objects)",
        ]
    )
    print_row(["pod watch cache per pod (tracemalloc, second informer)", f"{cache['kib_per_pod']:.1f} KiB"])
    print_row(["objects the garbage collector tracks, per cached pod", f"{cache['gc_objects_per_pod']:.0f}"])
    print_row(
        ["of which the pods' managedFields (never read)", f"{cache['managed_fields_kib_per_pod']:.1f} KiB"]
    )
    print_row(["peak while listing, per pod", f"{cache['peak_kib_per_pod']:.1f} KiB"])
    one = results["one_pod"]
    print_row(["one kernel pod: JSON from the API server", f"{one['json_kib']:.1f} KiB"])
    print_row(
        ["the same as a plain dict (`json.loads`)", f"{one['dict_kib']:.1f} KiB, {one['dict_ms']:.2f} ms"]
    )
    print_row(
        [
            "the same as the client's `V1Pod` model (`ApiClient.deserialize`)",
            f"{one['model_kib']:.1f} KiB, {one['model_ms']:.2f} ms",
        ]
    )
    left = results["left"]
    print(
        f"\nLeft after the shutdowns: {left['pods']} pods, {left['secrets']} kernel Secrets, "
        f"{left['slices']} GPU slices."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument(
        "--concurrency", type=int, default=10, help="starts/shutdowns at once after the sequential ones"
    )
    parser.add_argument(
        "--sequential", type=int, default=50, help="starts/shutdowns done one at a time first"
    )
    parser.add_argument("--ticks", type=int, default=5)
    parser.add_argument("--baseline-ticks", type=int, default=1)
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="smoke test: 5 kernels on 2 nodes")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once the cluster is up: imported modules leave every full collection",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.kernels, args.nodes, args.sequential, args.concurrency = 5, 2, 2, 3
        args.ticks, args.latency_samples = 2, 5
    if args.kernels > args.nodes * GPUS_PER_NODE * 4:
        parser.error(
            f"{args.kernels} quarter-GPU kernels do not fit on {args.nodes} nodes of {GPUS_PER_NODE} GPUs"
        )
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-kube-") as tmp:
        root = Path(tmp)
        plane, audit = start_plane(root)
        bench: Bench | None = None
        try:
            admin: Any = client.CoreV1Api(client.ApiClient(plane.configuration()))
            admin.create_namespace({"metadata": {"name": NAMESPACE}})
            wait_for(lambda: admin.read_namespaced_service_account("default", NAMESPACE), 60, "default SA")
            create_nodes(admin, args.nodes)
            bench = Bench(args, root, plane, audit)
            asyncio.run(scenario(bench))
        finally:
            if bench is not None:
                bench.runtime.kube.stop()
            plane.stop()
            gc.callbacks[:] = [
                c for c in gc.callbacks if not isinstance(getattr(c, "__self__", None), GcPauses)
            ]
    report(bench.results, args)
    if args.json:
        args.json.write_text(json.dumps(bench.results, indent=2) + "\n")
    return bench.results


if __name__ == "__main__":
    main()
