"""``jupyter elastic``: look at GPU sizes, GPUs and managed kernels of a running server.

Talks to the REST API only (never imports the server), so it works the same against a local
server, a remote one or the gateway. Without ``--url`` it finds the newest running local
server through its runtime file, the way ``jupyter server list`` does.

``node-agent``, ``simulate`` and ``demo-config`` are different: they run here and talk to no server
(:mod:`kernelmgr.cli_local`). The tables are drawn by :mod:`kernelmgr.cli_render`.

``hibernate``, ``resume`` and ``resize`` (hibernate, then resume at another GPU size when it fits)
wait for the outcome, however long the server allows: a request that outlasts
``--request-timeout`` is not a failure (the server keeps going), so the CLI then polls the kernel
until it is hibernated (or running), until the server reports the attempt failed, or until the
server's own ``checkpoint_timeout`` (from ``/api/elastic/policy``) plus a margin has passed.

``hibernate`` and ``resume`` show where they are on stderr (``--progress``, the default on a
terminal): the phase, the bytes read back, "waiting for a free GPU slice". Ctrl-C while a resume
waits for a slice cancels the wait on the server (``POST .../cancel``): the kernel stays
hibernated, and no slice is taken behind the user's back later.

Exit codes: 0 success; 1 the server could not be reached, refused the request or reported the
action failed (one line on stderr saying why); 2 bad usage or an unknown kernel id (one line on
stderr); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kernelmgr import cli_colour
from kernelmgr.cli_http import (
    DEFAULT_REQUEST_TIMEOUT,
    CliError,
    NotFound,
    RequestTimedOut,
    Target,
    _try_fetch,
    fetch,
    resolve_target,
)
from kernelmgr.cli_local import (
    FAILURE,
    LOCAL_COMMANDS,
    USAGE_ERROR,
    add_local_commands,
    run_local_command,
)
from kernelmgr.cli_refs import FULL_ID, KernelRefError, notebooks_of, resolve
from kernelmgr.cli_render import (
    Progress,
    human_bytes,
    render_gpus,
    render_kernel,
    render_kernels,
    render_profiles,
    render_progress,
    render_report,
    render_storage,
)

#: Exit code after Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED = 130
#: Seconds between polls of a kernel whose hibernate/resume outlasted one request.
POLL_INTERVAL = 1.0
#: What the server allows a checkpoint when it does not say (``ElasticKernels.checkpoint_timeout``).
DEFAULT_CHECKPOINT_TIMEOUT = 600.0
#: Beyond the checkpoint timeout: verifying, stopping the process and releasing the slice
#: (hibernate), or starting the process (resume).
SETTLE_MARGIN = 120.0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def _outcome(action: str, model: dict[str, Any], before: dict[str, Any] | None) -> str | None:
    """``"done"``, a failure message, or ``None`` while the action is still under way.

    The kernel goes back to where it started when the action fails (``running`` after a failed
    hibernation, ``hibernated`` after a failed resume); ``state_since`` (server time) then moved
    on from the reading taken before the request, which tells a failure from "not started yet".
    """
    state = model.get("state")
    if state == "dead":
        return f"kernel {model.get('id')} died: {model.get('state_reason') or 'no reason given'}"
    if action == "resize":  # running at another size; hibernated between is on the way, not a failure
        changed = before is None or model.get("profile") != before.get("profile")
        return "done" if state == "running" and changed else None
    if state == ("hibernated" if action == "hibernate" else "running"):
        return "done"
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


class Interrupted(CliError):
    """Ctrl-C during hibernate/resume: exit code 130, after telling the server what it means."""


def cancel_on_interrupt(target: Target, action: str, kernel_id: str, timeout: float) -> Interrupted:
    """Ctrl-C: a resume waiting for a slice is cancelled on the server (``POST .../cancel``);
    anything further along goes on there, and the message says so."""
    if action in ("resume", "resize"):
        try:
            fetch(target, f"/api/elastic/kernels/{kernel_id}/cancel", "POST", timeout=timeout)
        except CliError as err:
            return Interrupted(
                f"interrupted; the server goes on with the resume of kernel {kernel_id} ({err}); "
                "see `jupyter elastic list`"
            )
        return Interrupted(
            f"interrupted: the resume of kernel {kernel_id} stopped waiting for a GPU slice; "
            "it stays hibernated"
        )
    return Interrupted(
        f"interrupted; the server goes on with the hibernation of kernel {kernel_id} "
        "(its checkpoint is never left half-written); see `jupyter elastic list`"
    )


def run_kernel_action(
    target: Target,
    action: str,
    kernel_id: str,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    progress: Progress | None = None,
    body: dict[str, Any] | None = None,
) -> Any:
    """POST hibernate/resume/resize (``body``: its JSON) and return the kernel's model once done.

    The POST runs in a thread while the kernel's model is polled for ``progress`` (the phase,
    bytes read, "waiting for a free GPU slice"). A hibernation takes as long as the kernel's
    checkpoint (minutes for large state), so an answer slower than ``request_timeout`` is
    followed by polling, up to the server's ``checkpoint_timeout`` plus :data:`SETTLE_MARGIN`;
    raises :class:`CliError` saying why when the server refuses, reports a failure, or is still
    at it after that; :class:`Interrupted` on Ctrl-C, after cancelling a wait for a slice.
    """
    progress = progress or Progress(False)
    try:
        return _run_kernel_action(target, action, kernel_id, request_timeout, clock, sleep, progress, body)
    except KeyboardInterrupt:
        progress.done()
        raise cancel_on_interrupt(target, action, kernel_id, request_timeout) from None
    finally:
        progress.done()


def _run_kernel_action(
    target: Target,
    action: str,
    kernel_id: str,
    request_timeout: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    progress: Progress,
    body: dict[str, Any] | None = None,
) -> Any:
    path = f"/api/elastic/kernels/{kernel_id}"
    try:
        before = fetch(target, path, timeout=request_timeout)
    except NotFound:
        raise  # an unknown id: the user's mistake (exit 2), said before anything is sent
    except CliError:
        before = None
    answer: dict[str, Any] = {}

    def post() -> None:
        try:
            answer["model"] = fetch(target, f"{path}/{action}", "POST", timeout=request_timeout, body=body)
        except CliError as err:
            answer["error"] = err

    began = clock()
    sender = threading.Thread(target=post, name=f"elastic-{action}", daemon=True)
    sender.start()
    while sender.is_alive():
        sender.join(POLL_INTERVAL)
        if sender.is_alive() and progress.enabled:
            progress.show(
                kernel_id, render_progress(action, _try_fetch(target, path, request_timeout)), clock() - began
            )
    if "model" in answer:
        return answer["model"]
    if not isinstance(answer.get("error"), RequestTimedOut):
        raise answer["error"]
    policy = _try_fetch(target, "/api/elastic/policy", request_timeout) or {}
    allowed = float(policy.get("checkpoint_timeout") or DEFAULT_CHECKPOINT_TIMEOUT) + SETTLE_MARGIN
    waited = clock()
    if sys.stderr.isatty() and not progress.enabled:
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
        progress.show(kernel_id, render_progress(action, model), clock() - began)
        if clock() - waited >= allowed:
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
    "storage": ("/api/elastic/storage", render_storage, "checkpoint space used, against your quota"),
}


KERNEL_ACTIONS = {
    "hibernate": "checkpoint a kernel's variables, stop it and release its GPU slice",
    "resume": "bring a hibernated kernel back now",
    "resize": "change a kernel's GPU size: hibernate it, resume it at SIZE when that fits",
}
#: Read-only views of one kernel: ``jupyter elastic report <id>``.
KERNEL_VIEWS: dict[str, tuple[str, Renderer, str]] = {
    "report": ("report", render_report, "what the kernel's last resume restored, recomputed and lost"),
}
DISCARD_HELP = "shut down a hibernated kernel and delete its checkpoint (its variables), to free space"
KERNEL_HELP = "the kernel: its id, its first characters (as `jupyter elastic list` shows) or its notebook"


def _options_after(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The general options after the command too: ``jupyter elastic hibernate --progress ID`` as
    well as ``jupyter elastic --progress hibernate ID`` (given here, they win)."""
    after = argparse.SUPPRESS
    command.add_argument("--json", action="store_true", default=after, help="print JSON")
    command.add_argument("--url", default=after, help="server URL")
    command.add_argument("--token", default=after, help="API token")
    command.add_argument("--progress", action=argparse.BooleanOptionalAction, default=after, help="phases")
    command.add_argument("--request-timeout", type=float, default=after, metavar="SECONDS", help="per answer")
    return command


def kernel_named(target: Target, ref: str, timeout: float) -> str:
    """The id of the kernel ``ref`` names (:mod:`kernelmgr.cli_refs`); a full id as it is."""
    if FULL_ID.match(ref):
        return ref
    kernels = fetch(target, "/api/elastic/kernels", timeout=timeout) or []
    sessions = _try_fetch(target, "/api/sessions", timeout)
    return resolve(ref, [str(k["id"]) for k in kernels], notebooks_of(sessions))


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="jupyter elastic", description="GPU-size kernels of a running Jupyter server."
    )
    parser.add_argument("--url", help="server URL (default: the newest running local server)")
    parser.add_argument("--token", help="API token (default: the local server's, or $JUPYTER_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hibernate/resume: show the phase on stderr (default: when stderr is a terminal)",
    )
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
        metavar="{" + ",".join([*COMMANDS, *KERNEL_VIEWS, *KERNEL_ACTIONS, "discard", *LOCAL_COMMANDS]) + "}",
    )
    for name, (_path, _render, help_text) in COMMANDS.items():
        _options_after(sub.add_parser(name, help=help_text))
    for name, (_sub, _render, help_text) in KERNEL_VIEWS.items():
        view = _options_after(sub.add_parser(name, help=help_text))
        view.add_argument("kernel_id", metavar="KERNEL", help=KERNEL_HELP)
    for name, help_text in KERNEL_ACTIONS.items():
        action = _options_after(sub.add_parser(name, help=help_text))
        action.add_argument("kernel_id", metavar="KERNEL", help=KERNEL_HELP)
        if name == "resize":
            action.add_argument("size", help="the new GPU size (see `jupyter elastic profiles`)")
    discard = _options_after(sub.add_parser("discard", help=DISCARD_HELP))
    discard.add_argument("kernel_id", metavar="KERNEL", help=KERNEL_HELP)
    discard.add_argument("--yes", action="store_true", help="do not ask (needed when not on a terminal)")
    add_local_commands(sub)
    return parser


def discard_kernel(target: Target, kernel_id: str, yes: bool, timeout: float) -> int:
    """``discard``: shut a hibernated kernel down for good, its checkpoint deleted with it.

    Only a hibernated kernel (a running one is shut down from its notebook, where its user sees
    it go); asked first on a terminal, and refused without ``--yes`` elsewhere: it cannot be undone.
    """
    try:
        model = fetch(target, f"/api/elastic/kernels/{kernel_id}", timeout=timeout)
    except NotFound:
        say_error(f"jupyter elastic: no kernel {kernel_id}: `jupyter elastic list` shows them")
        return USAGE_ERROR
    except CliError as err:
        say_error(f"jupyter elastic: {err}")
        return FAILURE
    if model.get("state") != "hibernated":
        say_error(
            f"jupyter elastic: kernel {kernel_id[:8]} is {model.get('state')}, not hibernated: only a "
            "hibernated kernel's checkpoint is discarded (shut a running one down from its notebook)"
        )
        return USAGE_ERROR
    size = human_bytes((model.get("checkpoint") or {}).get("bytes"))
    if not yes:
        if not sys.stdin.isatty():
            say_error(
                "jupyter elastic: discard deletes the kernel's variables for good: add --yes to confirm"
            )
            return USAGE_ERROR
        answer = input(
            f"Discard kernel {kernel_id[:8]} and its checkpoint ({size})? Its variables are lost. [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            print("kept")
            return 0
    try:
        fetch(target, f"/api/kernels/{kernel_id}", "DELETE", timeout=timeout)
    except CliError as err:
        say_error(f"jupyter elastic: {err}")
        return FAILURE
    print(f"kernel {kernel_id} discarded: {size} of checkpoint freed")
    return 0


def say_error(text: str) -> None:
    """One line on stderr, in red on a terminal (:mod:`kernelmgr.cli_colour`)."""
    painted = cli_colour.paint(text, cli_colour.ERROR_CODE) if cli_colour.wanted(sys.stderr) else text
    print(painted, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.error(
            "a command is required: "
            + ", ".join([*COMMANDS, *KERNEL_VIEWS, *KERNEL_ACTIONS, "discard", *LOCAL_COMMANDS])
        )
    if args.command in LOCAL_COMMANDS:
        return run_local_command(parser, args)
    if not args.request_timeout > 0:
        parser.error(f"--request-timeout must be > 0 seconds, got {args.request_timeout:g}")
    try:
        target = resolve_target(args.url, args.token)
    except ValueError as err:
        parser.error(str(err))
    except CliError as err:
        say_error(f"jupyter elastic: {err}")
        return FAILURE
    method = "GET"
    render: Renderer
    if args.command in (*KERNEL_ACTIONS, *KERNEL_VIEWS, "discard"):
        try:
            args.kernel_id = kernel_named(target, args.kernel_id, args.request_timeout)
        except KernelRefError as err:  # the user's to fix: one line, exit 2
            say_error(f"jupyter elastic: {err}")
            return USAGE_ERROR
        except CliError as err:
            say_error(f"jupyter elastic: {err}")
            return FAILURE
    if args.command == "discard":
        return discard_kernel(target, args.kernel_id, args.yes, args.request_timeout)
    if args.command in KERNEL_ACTIONS:
        path, render, method = f"/api/elastic/kernels/{args.kernel_id}/{args.command}", render_kernel, "POST"
    elif args.command in KERNEL_VIEWS:
        sub_path, render, _help = KERNEL_VIEWS[args.command]
        path = f"/api/elastic/kernels/{args.kernel_id}/{sub_path}"
    else:
        path, render, _help = COMMANDS[args.command]
    try:
        if method == "POST":
            shown = sys.stderr.isatty() if args.progress is None else args.progress
            doc = run_kernel_action(
                target,
                args.command,
                args.kernel_id,
                args.request_timeout,
                progress=Progress(shown),
                body={"size": args.size} if args.command == "resize" else None,
            )
        else:
            doc = fetch(target, path, method, timeout=args.request_timeout)
            if args.command == "list" and not args.json:
                sessions = _try_fetch(target, "/api/sessions", args.request_timeout)
                render = functools.partial(
                    render_kernels, notebooks=notebooks_of(sessions), colour=cli_colour.wanted(sys.stdout)
                )
            elif args.command == "storage" and not args.json:
                sessions = _try_fetch(target, "/api/sessions", args.request_timeout)
                render = functools.partial(render_storage, notebooks=notebooks_of(sessions))
    except NotFound:  # an unknown kernel id: the user's to fix, like a bad argument
        known = "`jupyter elastic list` shows them"
        say_error(f"jupyter elastic: no kernel {args.kernel_id}: {known}")
        return USAGE_ERROR
    except Interrupted as err:
        say_error(f"jupyter elastic: {err}")
        return INTERRUPTED
    except CliError as err:
        say_error(f"jupyter elastic: {err}")
        return FAILURE
    except KeyboardInterrupt:
        say_error("jupyter elastic: interrupted")
        return INTERRUPTED
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
