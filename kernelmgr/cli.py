"""``jupyter elastic``: look at GPU sizes, GPUs and managed kernels of a running server.

Talks to the REST API only (never imports the server), so it works the same against a local
server, a remote one or the gateway. Without ``--url`` it finds the newest running local
server through its runtime file, the way ``jupyter server list`` does.

``node-agent`` is different: it runs the per-node GPU activity agent
(:mod:`kernelmgr.nodeagent`) in the foreground, for a DaemonSet, and talks to no server.

``hibernate`` and ``resume`` wait for the outcome, however long the server allows: a request
that outlasts ``--request-timeout`` is not a failure (the server keeps going), so the CLI then
polls the kernel until it is hibernated (or running), until the server reports the attempt
failed, or until the server's own ``checkpoint_timeout`` (from ``/api/elastic/policy``) plus a
margin has passed.

Exit codes: 0 success; 1 the server could not be reached, refused the request or reported the
action failed (one line on stderr saying why); 2 bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from jupyter_core.paths import jupyter_runtime_dir

USAGE_ERROR = 2
FAILURE = 1
#: Seconds to wait for one HTTP answer (``--request-timeout``).
DEFAULT_REQUEST_TIMEOUT = 30.0
#: Seconds between polls of a kernel whose hibernate/resume outlasted one request.
POLL_INTERVAL = 1.0
#: What the server allows a checkpoint when it does not say (``ElasticKernels.checkpoint_timeout``).
DEFAULT_CHECKPOINT_TIMEOUT = 600.0
#: Beyond the checkpoint timeout: verifying, stopping the process and releasing the slice
#: (hibernate), or starting the process (resume).
SETTLE_MARGIN = 120.0


class CliError(Exception):
    """A failure to report as one line on stderr with exit code 1."""


class NotFound(CliError):
    """The server answered 404 for a kernel path: an unknown id (a user mistake, exit 2)."""


class RequestTimedOut(CliError):
    """No answer within the request timeout: the server may still be working on it."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


@dataclass(frozen=True)
class Target:
    url: str
    token: str


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError):
        return False
    return True


def find_local_server(runtime_dir: str | None = None) -> Target:
    """The newest running server that wrote a ``jpserver-*.json`` runtime file."""
    directory = runtime_dir or jupyter_runtime_dir()
    candidates = sorted(
        glob.glob(os.path.join(directory, "jpserver-*.json")), key=os.path.getmtime, reverse=True
    )
    for path in candidates:
        try:
            with open(path) as handle:
                info = json.load(handle)
        except (OSError, ValueError):
            continue
        if _pid_alive(info.get("pid")) and info.get("url"):
            return Target(url=str(info["url"]).rstrip("/"), token=str(info.get("token", "")))
    raise CliError(f"no running Jupyter server found in {directory}; pass --url and --token")


def resolve_target(url: str | None, token: str | None) -> Target:
    if url:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--url must look like http://host:port/base/, got {url!r}")
        return Target(url=url.rstrip("/"), token=token or os.environ.get("JUPYTER_TOKEN", ""))
    found = find_local_server()
    return Target(url=found.url, token=token or found.token)


def fetch(target: Target, path: str, method: str = "GET", timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Any:
    """Call the API, turning every failure into one readable :class:`CliError`."""
    request = urllib.request.Request(
        f"{target.url}{path}", method=method, data=b"" if method == "POST" else None
    )
    if target.token:
        request.add_header("Authorization", f"token {target.token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read()).get("message") or err.reason
        except (ValueError, AttributeError):
            message = err.reason
        if err.code in (401, 403):
            raise CliError(f"{target.url} refused the request (HTTP {err.code}): check --token") from None
        if err.code == 404 and path.startswith("/api/elastic/") and path.count("/") <= 3:
            raise CliError(
                f"{target.url} has no /api/elastic API: is the kernelmgr extension enabled?"
            ) from None
        if err.code == 404:
            raise NotFound(f"HTTP {err.code} from {target.url}{path}: {message}") from None
        raise CliError(f"HTTP {err.code} from {target.url}{path}: {message}") from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise RequestTimedOut(f"no answer from {target.url}{path} within {timeout:g}s") from None
        raise CliError(f"cannot reach {target.url}: {err.reason}") from None
    except TimeoutError:
        raise RequestTimedOut(f"no answer from {target.url}{path} within {timeout:g}s") from None
    except ValueError as err:
        raise CliError(f"bad answer from {target.url}{path}: {err}") from None


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns, two spaces apart; ``-`` for missing values."""
    cells = [[("-" if value in (None, "") else str(value)) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def _gib(mib: Any) -> str:
    return "-" if mib is None else f"{mib / 1024:g} GiB"


def _fraction(value: Any) -> str:
    if value is None:
        return "-"
    return f"{int(value)} GPU" if value >= 1 else f"{value:.0%}"


def _isolation(isolation: dict[str, Any] | None) -> str:
    """``hard/soft``: what the platform enforces for the size's memory and compute (``-`` if unknown)."""
    if not isolation:
        return "-"
    return f"{isolation.get('memory', '?')}/{isolation.get('compute', '?')}"


def render_profiles(doc: dict[str, Any]) -> str:
    rows = [
        [
            p["name"],
            p["display_name"],
            _fraction(p["gpu_fraction"]),
            _gib(p["memory_mib"]),
            p["backend"],
            _isolation(p.get("isolation")),
            "yes" if p.get("fits_now") else "no",
            ", ".join(p.get("kernelspecs", [])),
        ]
        for p in doc.get("profiles", [])
    ]
    headers = [
        "SIZE",
        "DISPLAY NAME",
        "GPU",
        "MEMORY",
        "BACKEND",
        "ENFORCED MEM/COMPUTE",
        "FITS NOW",
        "KERNELSPECS",
    ]
    out = table(headers, rows)
    if not doc.get("gpus_available", True):
        out += f"\n\n{doc.get('message', 'No GPUs.')}"
    return out


def render_gpus(doc: dict[str, Any]) -> str:
    def holders(slices: list[dict[str, Any]], others: dict[str, Any] | None) -> str:
        warm = sum(1 for s in slices if s.get("warm"))
        kernels = str(len(slices) - warm)
        if others and others.get("slices"):  # a gateway user: other users' slices, counted only
            kernels += f" (+{others['slices']} of other users)"
        return f"{kernels} (+{warm} warm)" if warm else kernels

    rows = [
        [
            d["index"],
            d["uuid"],
            d["name"],
            _gib(d["memory_mib"]),
            _fraction(d["used_fraction"]) if d["used_fraction"] else "0%",
            _gib(d["free_memory_mib"]),
            holders(d["slices"], d.get("other_users")),
        ]
        for d in doc.get("devices", [])
    ]
    head = f"{doc.get('message', '')} (placement: {doc.get('strategy', '-')})"
    out = head + "\n" + table(["#", "UUID", "NAME", "MEMORY", "USED", "FREE MEMORY", "KERNELS"], rows)
    pools = doc.get("warm_pods") or {}
    if pools:
        each = ", ".join(
            f"{size}: {c['ready']} ready, {c['starting']} starting" for size, c in sorted(pools.items())
        )
        out += f"\n\nWarm pods (each holds a slice, given up to any kernel that needs it): {each}"
    return out


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def render_kernels(kernels: list[dict[str, Any]]) -> str:
    rows = []
    for k in kernels:
        activity = k.get("activity") or {}
        devices = [d["uuid"] for d in (k.get("slice") or {}).get("devices", [])]
        utilization = activity.get("gpu_utilization")
        memory = activity.get("gpu_memory_mib")
        checkpoint = k.get("checkpoint") or {}
        rows.append(
            [
                k["id"],
                k.get("profile") or "cpu",
                k.get("state"),
                k.get("execution_state"),
                _duration(activity.get("idle_seconds")),
                "-" if utilization is None else f"{utilization:.0f}%",
                "-" if memory is None else f"{memory} MiB",
                _duration(activity.get("gpu_idle_seconds")),
                ",".join(devices),
                _gib(checkpoint["bytes"] / MIB) if checkpoint.get("bytes") else "-",
                k.get("owner"),
            ]
        )
    if not rows:
        return "no kernels"
    headers = [
        "KERNEL",
        "SIZE",
        "STATE",
        "EXECUTION",
        "IDLE",
        "GPU",
        "GPU MEM",
        "GPU IDLE",
        "GPUS",
        "CHECKPOINT",
        "OWNER",
    ]
    return table(headers, rows)


def render_kernel(kernel: dict[str, Any]) -> str:
    """One kernel after hibernate/resume: a line that says where it stands."""
    line = f"kernel {kernel['id']} is {kernel.get('state')}"
    checkpoint = kernel.get("checkpoint") or {}
    if kernel.get("state") == "hibernated" and checkpoint:
        not_saved = ", ".join(v["name"] for v in checkpoint.get("not_saved", [])) or "none"
        saved = len(checkpoint.get("saved", []))
        size = _gib(checkpoint.get("bytes", 0) / MIB)
        line += f": {saved} variable(s) saved ({size}), not saved: {not_saved}"
    elif kernel.get("slice"):
        line += " on " + ", ".join(d["uuid"] for d in kernel["slice"]["devices"])
    return line


def render_report(doc: dict[str, Any]) -> str:
    """``jupyter elastic report``: the last restore, one fact a line."""
    report = doc.get("restore_report")
    kernel = doc.get("id")
    if not report:
        return f"kernel {kernel} has not been resumed from a checkpoint yet"
    if report.get("error"):  # the server did not read it (too large, or a link)
        return f"kernel {kernel}: {report['error']}"
    if report.get("refused"):
        return f"kernel {kernel} resumed without its variables: {report['refused']}"
    lines = [
        f"kernel {kernel} resumed from {report.get('checkpoint')} (saved {report.get('created')})",
        f"restored: {', '.join(report.get('restored', [])) or 'none'}",
    ]
    recomputed = report.get("recomputed") or []
    if recomputed:
        cells = sorted({c for item in recomputed for c in item.get("cells", [])})
        names = ", ".join(item["name"] for item in recomputed)
        lines.append(f"recomputed: {names} (re-ran cells {', '.join(map(str, cells))})")
    for item in report.get("not_restored", []):
        stage = "not saved" if item.get("stage") == "save" else "failed to load"
        line = f"{stage}: {item['name']} ({item.get('reason', '')})"
        if item.get("not_recomputed"):
            line += f"; not recomputed: {item['not_recomputed']}"
        lines.append(line)
    for name, why in (report.get("differs") or {}).items():
        lines.append(f"restored with differences: {name} ({why})")
    return "\n".join(lines)


def _try_fetch(target: Target, path: str, timeout: float) -> Any:
    """``fetch``, but ``None`` instead of an error (for polls and best-effort reads)."""
    try:
        return fetch(target, path, timeout=timeout)
    except CliError:
        return None


def _outcome(action: str, model: dict[str, Any], before: dict[str, Any] | None) -> str | None:
    """``"done"``, a failure message, or ``None`` while the action is still under way.

    The kernel goes back to where it started when the action fails (``running`` after a failed
    hibernation, ``hibernated`` after a failed resume); ``state_since`` (server time) then moved
    on from the reading taken before the request, which tells a failure from "not started yet".
    """
    state = model.get("state")
    if state == ("hibernated" if action == "hibernate" else "running"):
        return "done"
    if state == "dead":
        return f"kernel {model.get('id')} died: {model.get('state_reason') or 'no reason given'}"
    back_where_it_was = state == ("running" if action == "hibernate" else "hibernated")
    if not back_where_it_was:
        return None  # hibernating / resuming / starting: still under way
    since, since_before = model.get("state_since"), (before or {}).get("state_since")
    if since is not None and since_before is not None:
        moved = bool(since > since_before)
    else:  # a server without state_since: a failure leaves its reason behind
        moved = bool(model.get("last_error") or "failed" in str(model.get("state_reason", "")))
    if not moved:
        return None
    reason = model.get("last_error") or model.get("state_reason") or "no reason given"
    return f"{action} of kernel {model.get('id')} failed, it is {state}: {reason}"


def run_kernel_action(
    target: Target,
    action: str,
    kernel_id: str,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """POST hibernate/resume and return the kernel's model once the action is done.

    A hibernation takes as long as the kernel's checkpoint (minutes for large state), so an
    answer slower than ``request_timeout`` is followed by polling, up to the server's
    ``checkpoint_timeout`` plus :data:`SETTLE_MARGIN`; raises :class:`CliError` saying why
    when the server refuses, reports a failure, or is still at it after that.
    """
    path = f"/api/elastic/kernels/{kernel_id}"
    before = _try_fetch(target, path, request_timeout)
    try:
        return fetch(target, f"{path}/{action}", "POST", timeout=request_timeout)
    except RequestTimedOut:
        pass
    policy = _try_fetch(target, "/api/elastic/policy", request_timeout) or {}
    allowed = float(policy.get("checkpoint_timeout") or DEFAULT_CHECKPOINT_TIMEOUT) + SETTLE_MARGIN
    began = clock()
    if sys.stderr.isatty():
        print(
            f"jupyter elastic: {action} of {kernel_id} is under way; waiting (up to {allowed:g}s)",
            file=sys.stderr,
        )
    while True:
        model = _try_fetch(target, path, request_timeout)
        if model is not None:
            outcome = _outcome(action, model, before)
            if outcome == "done":
                return model
            if outcome is not None:
                raise CliError(outcome)
        if clock() - began >= allowed:
            state = model.get("state") if model else "unknown (no answer)"
            raise CliError(
                f"kernel {kernel_id} is still {state} after {allowed:g}s "
                "(the server's checkpoint_timeout plus a margin); see `jupyter elastic list`"
            )
        sleep(POLL_INTERVAL)


Renderer = Callable[[Any], str]

COMMANDS: dict[str, tuple[str, Renderer, str]] = {
    "profiles": ("/api/elastic/profiles", render_profiles, "the GPU sizes offered"),
    "gpus": ("/api/elastic/gpus", render_gpus, "the GPUs and the slices on them"),
    "list": ("/api/elastic/kernels", render_kernels, "every managed kernel"),
}


KERNEL_ACTIONS = {
    "hibernate": "checkpoint a kernel's variables, stop it and release its GPU slice",
    "resume": "bring a hibernated kernel back now",
}
#: Read-only views of one kernel: ``jupyter elastic report <id>``.
KERNEL_VIEWS: dict[str, tuple[str, Renderer, str]] = {
    "report": ("report", render_report, "what the kernel's last resume restored, recomputed and lost"),
}
KERNEL_ID = re.compile(r"^[\w-]+$")
MIB = 1024 * 1024


NODE_AGENT = "node-agent"
SIMULATE = "simulate"
DEFAULT_NVML_CLASS = "kernelmgr.activity.nvml.PynvmlNvml"


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535), got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535), got {port}")
    return port


def _positive(unit: str) -> Callable[[str], float]:
    """An argparse type: a finite number above 0, its error naming ``unit``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of {unit}, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be > 0 {unit}, got {text!r}")
        return value

    return parse


_seconds = _positive("seconds")


def _add_node_agent(sub: Any) -> None:
    from kernelmgr.nodeagent import DEFAULT_INTERVAL, DEFAULT_PORT

    agent = sub.add_parser(
        NODE_AGENT,
        help="run the per-node GPU activity agent (a DaemonSet with hostPID; no server needed)",
        description="Serve this node's GPU activity per pod: /activity (JSON), /metrics, /healthz.",
    )
    agent.add_argument("--ip", default="", help="address to listen on (default: all)")
    agent.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)"
    )
    agent.add_argument(
        "--proc-root", default="/proc", metavar="DIR", help="the host's /proc (default /proc; needs hostPID)"
    )
    agent.add_argument(
        "--interval",
        type=_seconds,
        default=DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"seconds between samples (default {DEFAULT_INTERVAL:g})",
    )
    agent.add_argument(
        "--node-name", default=None, help="node name reported (default: $NODE_NAME, else the host name)"
    )
    agent.add_argument(
        "--token-file",
        metavar="FILE",
        help="file holding the token /activity and /metrics require as 'Authorization: Bearer' (a Secret "
        "shared with the server: ElasticKubernetesProvisioner.node_agent_token_file); or --no-token",
    )
    agent.add_argument(
        "--no-token",
        action="store_true",
        help="answer /activity and /metrics without a token (anyone who reaches the port sees PIDs and pods)",
    )
    agent.add_argument(
        "--nvml-class",
        default=DEFAULT_NVML_CLASS,
        metavar="DOTTED.NAME",
        help="NVML implementation, as ElasticKernels.nvml_class (default: pynvml; "
        "kernelmgr.activity.nvml_double.FileNvmlDouble is the TEST DOUBLE fed from "
        "$ELASTIC_NVML_DOUBLE_FILE)",
    )


def _import_class(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ValueError(f"--nvml-class must be a dotted name like {DEFAULT_NVML_CLASS}, got {dotted!r}")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--nvml-class {dotted!r} cannot be imported: {err}") from None
    if not isinstance(found, type):
        raise ValueError(f"--nvml-class {dotted!r} is not a class")
    return found


def run_node_agent(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Validate what argparse cannot, then run the agent in the foreground until SIGTERM."""
    from kernelmgr.nodeagent.app import AgentOptions, run

    prog = f"{parser.prog} {NODE_AGENT}"
    if not os.path.isdir(args.proc_root):
        parser.error(f"{NODE_AGENT}: --proc-root {args.proc_root!r} is not a directory")
    token = ""
    if args.token_file and args.no_token:
        parser.error(f"{NODE_AGENT}: --token-file and --no-token exclude each other")
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as file:
                token = file.read().strip()
        except OSError as err:
            parser.error(f"{NODE_AGENT}: --token-file {args.token_file!r}: {err.strerror or err}")
        if not token:
            parser.error(f"{NODE_AGENT}: --token-file {args.token_file!r} is empty")
    elif not args.no_token:
        parser.error(
            f"{NODE_AGENT}: --token-file is required (the token the server sends, a Secret shared with it); "
            "--no-token serves anyone who reaches the port"
        )
    try:
        nvml = _import_class(args.nvml_class)()
    except ValueError as err:
        parser.error(f"{NODE_AGENT}: {err}")
    options = AgentOptions(
        ip=args.ip,
        port=args.port,
        proc_root=args.proc_root,
        interval=args.interval,
        node=args.node_name,
        token=token,
    )
    try:
        run(nvml, options)
    except OSError as err:
        where = f"{args.ip or '*'}:{args.port}"
        print(f"{prog}: cannot listen on {where}: {err.strerror or err}", file=sys.stderr)
        return FAILURE
    return 0


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_simulate(sub: Any) -> None:
    from kernelmgr.core.simulate.engine import DelayModel

    d = DelayModel()
    sim = sub.add_parser(
        SIMULATE,
        help="replay a notebook workload trace through the cull policy and GPU allocator (no server needed)",
        description="Replay TRACE.json with a simulated clock through the real CullPolicy, slice allocator "
        "and GPU sizes, beside static allocation and jupyter_server-style culling (see docs/simulate.md).",
    )
    sim.add_argument("trace", nargs="?", metavar="TRACE.json", help="the workload trace")
    sim.add_argument(
        "--config", metavar="FILE", help="jupyter_server_config.json (or .py) to take sizes and policy from"
    )
    sim.add_argument("--gpus", type=_count, metavar="N", help="N GPUs (default: as many as the peak needs)")
    sim.add_argument("--json", dest="sim_json", action="store_true", help="print JSON instead of a table")
    sim.add_argument("--plot", metavar="OUT.png", help="draw GPUs held over time and the table (matplotlib)")
    sim.add_argument(
        "--generate",
        type=_count,
        metavar="SESSIONS",
        help="print a synthetic trace of SESSIONS sessions instead",
    )
    sim.add_argument(
        "--days", type=_positive("days"), default=1.0, help="with --generate: days the sessions spread over"
    )
    sim.add_argument("--seed", type=int, default=0, help="with --generate: random seed (default 0)")
    sim.add_argument(
        "--start-s", type=_seconds, default=d.start_s, help=f"resume: kernel start, s (default {d.start_s:g})"
    )
    sim.add_argument(
        "--read-mib-s",
        type=_positive("MiB/s"),
        default=d.read_mib_s,
        help=f"resume: checkpoint read MiB/s (default {d.read_mib_s:g})",
    )
    sim.add_argument(
        "--hibernate-s",
        type=_seconds,
        default=d.hibernate_fixed_s,
        help=f"hibernate: fixed s (default {d.hibernate_fixed_s:g})",
    )
    sim.add_argument(
        "--write-mib-s",
        type=_positive("MiB/s"),
        default=d.write_mib_s,
        help=f"hibernate: checkpoint write MiB/s (default {d.write_mib_s:g})",
    )


def run_simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Replay (or generate) a trace; every user mistake is one line and exit code 2."""
    from kernelmgr import simulate_cli
    from kernelmgr.core.simulate.engine import DelayModel
    from kernelmgr.core.simulate.generate import generate
    from kernelmgr.core.simulate.trace import trace_to_dict

    prog = f"{parser.prog} {SIMULATE}"
    if args.generate is not None:
        print(json.dumps(trace_to_dict(generate(args.generate, args.days, args.seed))))
        return 0
    if not args.trace:
        parser.error(f"{SIMULATE}: a TRACE.json is required (or --generate SESSIONS)")
    delays = DelayModel(args.start_s, args.read_mib_s, args.hibernate_s, args.write_mib_s)
    try:
        setup, sessions, results = simulate_cli.run(args.trace, args.config, args.gpus, delays)
        if args.plot:
            title = f"{os.path.basename(args.trace)}: {len(sessions)} sessions"
            simulate_cli.plot(results, args.plot, title)
    except simulate_cli.SimulateError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    if not setup.policy.enabled:
        # Otherwise three identical columns, and nothing says why.
        where = f"--config {args.config}" if args.config else "the default configuration (no --config)"
        print(
            f"{prog}: note: {where} sets no CullPolicy.idle_timeout: nothing is culled or hibernated; "
            "pass the server's configuration file with --config",
            file=sys.stderr,
        )
    if args.sim_json:
        print(json.dumps({mode: result.to_dict() for mode, result in results.items()}, indent=2))
    else:
        print(simulate_cli.render_table(results))
    return 0


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="jupyter elastic", description="GPU-size kernels of a running Jupyter server."
    )
    parser.add_argument("--url", help="server URL (default: the newest running local server)")
    parser.add_argument("--token", help="API token (default: the local server's, or $JUPYTER_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        metavar="SECONDS",
        help="seconds to wait for one answer (hibernate/resume then poll until the server's "
        f"checkpoint timeout; default {DEFAULT_REQUEST_TIMEOUT:g})",
    )
    sub = parser.add_subparsers(
        dest="command",
        metavar="{" + ",".join([*COMMANDS, *KERNEL_VIEWS, *KERNEL_ACTIONS, NODE_AGENT, SIMULATE]) + "}",
    )
    for name, (_path, _render, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text)
    for name, (_sub, _render, help_text) in KERNEL_VIEWS.items():
        view = sub.add_parser(name, help=help_text)
        view.add_argument("kernel_id", help="the kernel's id (see `jupyter elastic list`)")
    for name, help_text in KERNEL_ACTIONS.items():
        action = sub.add_parser(name, help=help_text)
        action.add_argument("kernel_id", help="the kernel's id (see `jupyter elastic list`)")
    _add_node_agent(sub)
    _add_simulate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("a command is required: " + ", ".join([*COMMANDS, *KERNEL_ACTIONS, NODE_AGENT]))
    if args.command == NODE_AGENT:
        return run_node_agent(parser, args)
    if args.command == SIMULATE:
        return run_simulate(parser, args)
    if not args.request_timeout > 0:
        parser.error(f"--request-timeout must be > 0 seconds, got {args.request_timeout:g}")
    method = "GET"
    render: Renderer
    if args.command in KERNEL_ACTIONS:
        if not KERNEL_ID.match(args.kernel_id):
            parser.error(f"{args.kernel_id!r} is not a kernel id (letters, digits and '-')")
        path, render, method = f"/api/elastic/kernels/{args.kernel_id}/{args.command}", render_kernel, "POST"
    elif args.command in KERNEL_VIEWS:
        if not KERNEL_ID.match(args.kernel_id):
            parser.error(f"{args.kernel_id!r} is not a kernel id (letters, digits and '-')")
        sub_path, render, _help = KERNEL_VIEWS[args.command]
        path = f"/api/elastic/kernels/{args.kernel_id}/{sub_path}"
    else:
        path, render, _help = COMMANDS[args.command]
    try:
        target = resolve_target(args.url, args.token)
    except ValueError as err:
        parser.error(str(err))
    except CliError as err:
        print(f"jupyter elastic: {err}", file=sys.stderr)
        return FAILURE
    try:
        if method == "POST":
            doc = run_kernel_action(target, args.command, args.kernel_id, args.request_timeout)
        else:
            doc = fetch(target, path, method, timeout=args.request_timeout)
    except NotFound as err:
        print(f"jupyter elastic: {err}", file=sys.stderr)
        return USAGE_ERROR if args.command in KERNEL_VIEWS else FAILURE
    except CliError as err:
        print(f"jupyter elastic: {err}", file=sys.stderr)
        return FAILURE
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
