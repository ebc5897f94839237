"""``jupyter elastic node-agent``, ``simulate``, ``demo-config`` and ``rotate-keys``: the subcommands
that run here and talk to no server (the node's GPU activity agent, the policy simulator, the
tour's example configuration, a master key rotation of the file-system store's encryption at rest),
kept apart from the REST client in :mod:`kernelmgr.cli`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

#: Exit codes of every ``jupyter elastic`` command: a failure said in one line, bad usage.
USAGE_ERROR = 2
FAILURE = 1

NODE_AGENT = "node-agent"
SIMULATE = "simulate"
DEMO_CONFIG = "demo-config"
ROTATE_KEYS = "rotate-keys"
#: The subcommands of this module, in ``jupyter elastic --help``'s order.
LOCAL_COMMANDS = (NODE_AGENT, SIMULATE, DEMO_CONFIG, ROTATE_KEYS)
#: The tour's configuration: ``examples/local/jupyter_server_config.py`` in a checkout, put into
#: the wheel at this place in the package by pyproject.toml (``force-include``).
DEMO_CONFIG_PACKAGED = ("demo", "jupyter_server_config.py")
DEMO_CONFIG_CHECKOUT = os.path.join("examples", "local", "jupyter_server_config.py")
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


def add_node_agent(sub: Any) -> None:
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


def add_simulate(sub: Any) -> None:
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
    sim.add_argument(
        "--pod-s",
        type=_seconds,
        default=d.pod_s,
        help="Kubernetes: pod scheduling and container start before each start or resume, s (default 0)",
    )
    sim.add_argument(
        "--pull-s",
        type=_seconds,
        default=d.pull_s,
        help="Kubernetes: image pull on a node's first kernel (each simulated GPU is a node), s (default 0)",
    )
    sim.add_argument(
        "--pressure-idle-minimum",
        type=_seconds,
        metavar="S",
        help="also replay culling under pressure at S seconds idle (default: "
        "CullPolicy.pressure_idle_minimum from --config; that column is shown when either is set)",
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
    delays = DelayModel(
        args.start_s, args.read_mib_s, args.hibernate_s, args.write_mib_s, args.pod_s, args.pull_s
    )
    try:
        setup, sessions, results = simulate_cli.run(
            args.trace, args.config, args.gpus, delays, args.pressure_idle_minimum
        )
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


def add_demo_config(sub: Any) -> None:
    demo = sub.add_parser(
        DEMO_CONFIG,
        help="print (or write to FILE) the tour's local-mode configuration: three GPU sizes, a cull "
        "policy, two declared demo GPUs where no NVIDIA driver is found",
        description="The example configuration of the README's tour, for an installed package: "
        f"`jupyter elastic {DEMO_CONFIG} demo_config.py && jupyter lab --config=demo_config.py`.",
    )
    demo.add_argument("file", nargs="?", metavar="FILE", help="write it here (default: print it)")
    demo.add_argument("--force", action="store_true", help="replace FILE if it exists")


def demo_config_text() -> str:
    """The tour's configuration: the wheel's packaged copy, else (a checkout, editable or not) the
    example itself."""
    from importlib import resources

    folder, name = DEMO_CONFIG_PACKAGED
    packaged = resources.files("kernelmgr").joinpath(folder).joinpath(name)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), DEMO_CONFIG_CHECKOUT)
    with open(checkout, encoding="utf-8") as file:
        return file.read()


def run_demo_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Print the configuration, or write it to a new file (an existing one only with --force)."""
    text = demo_config_text()
    if not args.file:
        sys.stdout.write(text)
        return 0
    if os.path.exists(args.file) and not args.force:
        parser.error(f"{DEMO_CONFIG}: {args.file!r} exists; pass --force to replace it")
    try:
        with open(args.file, "w", encoding="utf-8") as file:
            file.write(text)
    except OSError as err:
        reason = err.strerror or err
        print(f"{parser.prog} {DEMO_CONFIG}: cannot write {args.file!r}: {reason}", file=sys.stderr)
        return FAILURE
    print(f"wrote {args.file}; start with: jupyter lab --config={args.file}", file=sys.stderr)
    return 0


def add_rotate_keys(sub: Any) -> None:
    rotate = sub.add_parser(
        ROTATE_KEYS,
        help="re-wrap every owner's checkpoint key (file-system store, encryption at rest) under a new "
        "master key; no checkpoint is rewritten",
        description="Run it on the server's machine (or in its pod) with the checkpoint root and both "
        "master keys, then make the new key ElasticKernels.checkpoint_encryption_key_files' only entry "
        "and restart the server. Safe to run again; a server still running with the old key re-wraps "
        "nothing back.",
    )
    rotate.add_argument("--checkpoint-root", required=True, help="ElasticKernels.checkpoint_root")
    rotate.add_argument("--new-key", required=True, metavar="FILE", help="the new master key file")
    rotate.add_argument(
        "--old-key",
        action="append",
        default=[],
        metavar="FILE",
        help="a master key the owners' keys are wrapped by now (repeat for several)",
    )


def run_rotate_keys(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Re-wrap the owners' keys under ``--new-key``; one line and exit 1 when one cannot be."""
    from kernelmgr.config import ConfigError, read_master_keys
    from kernelmgr.objectstore.envelope import OWNER_KEYS_DIR, EnvelopeError, FileKeyRecords, OwnerKeys

    prog = f"{parser.prog} {ROTATE_KEYS}"
    if not os.path.isdir(os.path.join(args.checkpoint_root, OWNER_KEYS_DIR)):
        parser.error(f"{ROTATE_KEYS}: {args.checkpoint_root!r} holds no {OWNER_KEYS_DIR} folder (no keys)")
    try:
        files = [args.new_key, *args.old_key]
        masters = read_master_keys(files, "--new-key/--old-key", args.checkpoint_root)
    except ConfigError as err:
        parser.error(f"{ROTATE_KEYS}: {err}")
    keys = OwnerKeys(FileKeyRecords(args.checkpoint_root), "", masters, setting="--old-key")
    try:
        done, kept = keys.rewrap_all()
    except EnvelopeError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return FAILURE
    print(f"re-wrapped {done} owner key(s) under the new master key ({kept} already were)")
    return 0


def add_local_commands(sub: Any) -> None:
    add_node_agent(sub)
    add_simulate(sub)
    add_demo_config(sub)
    add_rotate_keys(sub)


def run_local_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run one of :data:`LOCAL_COMMANDS`."""
    if args.command == SIMULATE:
        args.sim_json = args.sim_json or args.json  # `--json simulate` as well as `simulate --json`
    runners = {
        NODE_AGENT: run_node_agent,
        SIMULATE: run_simulate,
        DEMO_CONFIG: run_demo_config,
        ROTATE_KEYS: run_rotate_keys,
    }
    return runners[args.command](parser, args)
