"""A hundred kernels at once: start, run, hibernate and resume, beside plain jupyter_server (issue 34).

Two servers side by side in one run: plain jupyter_server (no extension) and one with the
extension, 25 declared GPUs and a GPU size of a quarter GPU (so 100 kernels fill them exactly).
Each repetition, all at once (one thread per kernel):

* plain: N ``python3`` kernels started through ``POST /api/kernels``, a cell each (start to the
  cell's reply), then deleted;
* elastic: N ``python3-gpu-small`` kernels started and a cell each (``x = i``); all hibernated
  (``POST /api/elastic/kernels/{id}/hibernate``); all resumed by their next cell (``print(x)``,
  which must print ``i``); then deleted.

Counted, per repetition: **plain failed** (plain jupyter_server's starts or first cells that
failed: its own behaviour, for comparison; its phase is bounded by ``PLAIN_TIMEOUT`` per call, and a
plain server that stops answering is replaced by a fresh one and counted in **plain hung**, so the
comparison never takes the extension's rounds down with it), and for the extension **lost** (a resumed kernel
without its ``x``), **failed** (a request that did not answer 2xx, or a cell with no reply),
**stuck** (a kernel not ``running`` after the start, not ``hibernated`` after the hibernation,
or a slice held while all are hibernated), and **leaked** after the deletes: slices still held,
kernels still listed, kernel processes still alive. After both servers stopped, any process still
running from either server's runtime directory is an orphan.

``python benchmarks/bench_load.py --kernels 100 --repeat 3``; prints Markdown for
docs/benchmarks.md. No test asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.markdown import print_header, print_row
from tests.support.server import TOKEN, KernelChannel, RunningServer, start_server

PROFILES = {"small": {"gpu_fraction": 0.25, "memory_mib": 10240}}
TIMEOUT = 600.0
#: Plain jupyter_server's calls get less: it can stall for good under this load (its own
#: ``ZMQStream`` blocks on a port another kernel took), and a stalled comparison must not stop the run.
PLAIN_TIMEOUT = 180.0


def inventory(gpus: int) -> list[dict[str, Any]]:
    return [{"uuid": f"GPU-load-{i:04d}", "name": "declared", "memory_mib": 40960} for i in range(gpus)]


def call(
    server: RunningServer, method: str, path: str, body: Any = None, timeout: float = TIMEOUT
) -> tuple[int, Any]:
    """One REST call with a long timeout (under load a start may take a while); (status, body)."""
    req = urllib.request.Request(
        server.url + path, data=None if body is None else json.dumps(body).encode(), method=method
    )
    req.add_header("Authorization", f"token {TOKEN}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return err.code, raw.decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def cell(server: RunningServer, kernel_id: str, code: str, timeout: float = TIMEOUT) -> str | None:
    """Run ``code``; its stdout, or ``None`` when it got no reply or raised."""
    try:
        with KernelChannel(server.url, kernel_id, timeout=timeout) as chan:
            result = chan.execute(code, timeout=timeout)
    except Exception as exc:
        print(f"  cell in {kernel_id}: {exc!r}", file=sys.stderr)
        return None
    if result.error:
        print(f"  cell in {kernel_id}: {result.error[-300:]}", file=sys.stderr)
        return None
    return result.stdout


def at_once(n: int, work: Callable[[int], Any]) -> tuple[float, list[Any]]:
    """Run ``work(i)`` for every ``i < n``, all at once; (seconds, results)."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        start = time.perf_counter()
        results = list(pool.map(work, range(n)))
        return time.perf_counter() - start, results


def start_and_run(server: RunningServer, name: str, i: int, timeout: float = TIMEOUT) -> str | None:
    """Start a kernel and run its first cell; its id, or ``None`` when either failed."""
    status, body = call(server, "POST", "/api/kernels", {"name": name}, timeout)
    if status != 201:
        print(f"  start {i}: {status} {body}", file=sys.stderr)
        return None
    kernel_id = str(body["id"])
    out = cell(server, kernel_id, f"x = {i}\nprint('ok')", timeout)
    return kernel_id if out is not None and out.strip() == "ok" else None


def kernel_pids(runtime_dir: Path) -> list[int]:
    """Live processes whose command line names a connection file in ``runtime_dir``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if str(runtime_dir) in cmdline and "State:\tZ" not in status:
            pids.append(int(entry.name))
    return pids


def delete_all(server: RunningServer, known: list[str | None], timeout: float = TIMEOUT) -> int:
    """Delete every kernel at once; how many deletes (or listings) failed.

    A server whose listing keeps failing (plain jupyter_server after a start that failed its
    ``ready`` future answers 500 to every ``GET /api/kernels``) gets the ids this round started.
    """
    status, listed = call(server, "GET", "/api/kernels", timeout=timeout)
    for _ in range(10 if timeout >= TIMEOUT else 2):  # under load a GET may time out: ask again
        if status == 200:
            break
        print(f"  GET /api/kernels: {status} {listed}", file=sys.stderr)
        status, listed = call(server, "GET", "/api/kernels", timeout=timeout)
    unlisted = status != 200 or not isinstance(listed, list)
    ids = [k for k in known if k] if unlisted else [k["id"] for k in listed]
    if not ids:
        return int(unlisted)
    _, results = at_once(
        len(ids), lambda i: call(server, "DELETE", f"/api/kernels/{ids[i]}", timeout=timeout)[0]
    )
    return int(unlisted) + sum(1 for status in results if status != 204)


class PlainServer:
    """Plain jupyter_server for the comparison, replaced by a fresh one when it stops answering."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0
        self.logs: list[Path] = []
        self.server = self._start()

    def _start(self) -> RunningServer:
        self.generation += 1
        server = start_server(
            self.root / f"plain-{self.generation}",
            {"ServerApp": {"jpserver_extensions": {"kernelmgr": False}}},
        )
        self.logs.append(server.log_path)
        return server

    def answers(self) -> bool:
        return call(self.server, "GET", "/api/kernels", timeout=60)[0] == 200

    def replace(self) -> int:
        """Kill the stalled server and its kernels; start a fresh one. How many kernels it left."""
        self.server.process.kill()
        self.server.process.wait()
        left = kernel_pids(self.server.home / "runtime")
        for pid in left:
            os.kill(pid, 9)
        self.server = self._start()
        return len(left)

    def runtimes(self) -> list[Path]:
        return [self.root / f"plain-{g}" / "runtime" for g in range(1, self.generation + 1)]


def plain_round(plain: PlainServer, n: int) -> dict[str, Any]:
    """Plain jupyter_server's phase, bounded: a hung server is replaced, never waited on."""
    server = plain.server
    seconds, ids = at_once(n, lambda i: start_and_run(server, "python3", i, PLAIN_TIMEOUT))
    failed = sum(1 for k in ids if k is None)
    hung = 0
    if plain.answers():
        failed += delete_all(server, ids, PLAIN_TIMEOUT)
        # Its own leftovers (processes of starts it answered 500 to) are its failures.
        failed += len(kernel_pids(server.home / "runtime"))
    else:
        print("  plain jupyter_server stopped answering: replaced by a fresh one", file=sys.stderr)
        hung = 1
        failed += plain.replace()
    return {"plain_start": seconds, "plain_failed": failed, "plain_hung": hung}


def one_round(plain: PlainServer, elastic: RunningServer, n: int) -> dict[str, Any]:
    row = plain_round(plain, n)

    failed = 0

    row["start"], ids = at_once(n, lambda i: start_and_run(elastic, "python3-gpu-small", i))
    failed += sum(1 for k in ids if k is None)
    models = {m["id"]: m for m in call(elastic, "GET", "/api/elastic/kernels")[1]}
    stuck = sum(1 for k in ids if k and models.get(k, {}).get("state") != "running")

    row["hibernate"], statuses = at_once(
        n, lambda i: call(elastic, "POST", f"/api/elastic/kernels/{ids[i]}/hibernate")[0] if ids[i] else 0
    )
    failed += sum(1 for i, s in enumerate(statuses) if ids[i] and s != 200)
    models = {m["id"]: m for m in call(elastic, "GET", "/api/elastic/kernels")[1]}
    stuck += sum(1 for k in ids if k and models.get(k, {}).get("state") != "hibernated")
    held = sum(len(d["slices"]) for d in call(elastic, "GET", "/api/elastic/gpus")[1]["devices"])
    stuck += held  # every slice must be free while all are hibernated

    row["resume"], outputs = at_once(n, lambda i: cell(elastic, ids[i], "print(x)") if ids[i] else None)
    lost = sum(1 for i, out in enumerate(outputs) if ids[i] and out is not None and out.strip() != str(i))
    failed += sum(1 for i, out in enumerate(outputs) if ids[i] and out is None)

    failed += delete_all(elastic, ids)
    leaked = len(call(elastic, "GET", "/api/kernels")[1] or [])
    leaked += sum(len(d["slices"]) for d in call(elastic, "GET", "/api/elastic/gpus")[1]["devices"])
    leaked += len(kernel_pids(elastic.home / "runtime"))
    row.update(lost=lost, failed=failed, stuck=stuck, leaked=leaked)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=25)
    parser.add_argument("--keep-logs", default="", help="copy both servers' logs to this directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        root = Path(tmp)
        plain = PlainServer(root)
        elastic_config = {
            "ElasticKernels": {
                "profiles": PROFILES,
                "gpu_inventory": inventory(args.gpus),
                "checkpoint_root": str(root / "checkpoints"),
                "start_timeout": TIMEOUT,
                "resume_timeout": TIMEOUT,
            }
        }
        elastic = start_server(root / "elastic", elastic_config)
        rows = []
        try:
            for r in range(args.repeat):
                row = one_round(plain, elastic, args.kernels)
                rows.append(row)
                print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), file=sys.stderr)
        finally:
            plain.server.stop()
            elastic.stop()
        orphans = [pid for rt in plain.runtimes() for pid in kernel_pids(rt)] + kernel_pids(
            root / "elastic" / "runtime"
        )
        for pid in orphans:  # report, then clean up what the servers left
            os.kill(pid, 9)
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            for log in [*plain.logs, elastic.log_path]:
                shutil.copy(log, Path(args.keep_logs) / f"{log.parent.name}-{log.name}")

    n = args.kernels
    print(f"N = {n} kernels at once, {args.repeat} repetitions, {args.gpus} declared GPUs, 1/4 GPU each\n")
    print_header(
        [
            "round",
            "plain start + cell",
            "elastic start + cell",
            "start ratio",
            "hibernate all",
            "resume all (cell)",
            "resume / plain start",
            "plain failed",
            "plain hung",
            "lost",
            "failed",
            "stuck",
            "leaked",
        ]
    )
    for r, row in enumerate(rows, 1):
        print_row(
            [
                str(r),
                "hung" if row["plain_hung"] else f"{row['plain_start']:.1f}",
                f"{row['start']:.1f}",
                "—" if row["plain_hung"] else f"{row['start'] / row['plain_start']:.2f}×",
                f"{row['hibernate']:.1f}",
                f"{row['resume']:.1f}",
                "—" if row["plain_hung"] else f"{row['resume'] / row['plain_start']:.2f}×",
                str(row["plain_failed"]),
                str(row["plain_hung"]),
                str(row["lost"]),
                str(row["failed"]),
                str(row["stuck"]),
                str(row["leaked"]),
            ]
        )
    med = {k: statistics.median(row[k] for row in rows) for k in ("start", "hibernate", "resume")}
    # A round whose plain server hung timed out rather than finished: it has no plain time.
    timed = [row["plain_start"] for row in rows if not row["plain_hung"]] or [float("nan")]
    med["plain_start"] = statistics.median(timed)
    print(
        f"\nmedians: plain start {med['plain_start']:.1f} s, elastic start {med['start']:.1f} s "
        f"({med['start'] / med['plain_start']:.2f}×), hibernate {med['hibernate']:.1f} s, resume "
        f"{med['resume']:.1f} s ({med['resume'] / med['plain_start']:.2f}× the plain start); "
        f"plain jupyter_server failed {sum(r['plain_failed'] for r in rows)} and hung "
        f"{sum(r['plain_hung'] for r in rows)} times; elastic: "
        f"lost {sum(r['lost'] for r in rows)}, failed {sum(r['failed'] for r in rows)}, stuck "
        f"{sum(r['stuck'] for r in rows)}, leaked {sum(r['leaked'] for r in rows)}, orphan processes after "
        f"the servers stopped {len(orphans)}"
    )


if __name__ == "__main__":
    main()
