"""Repeated hibernation: the namespace after any number of cycles, by every trigger, equals
what it would be without hibernation.

An oracle, not a list of expectations: the same cells run in a reference kernel that is
never hibernated (a plain ipykernel started by jupyter_client in the test process), and
after every resume the elastic kernel's namespace digest must equal the reference's. The
digest covers every user variable (values, types, functions called, classes, instances),
shared references, deleted names, and what ``%who`` lists.

The triggers, one per cycle: the REST API, server shutdown (``hibernate_on_shutdown``),
the cull policy, a server killed with SIGKILL (the kernel's watchdog checkpoints it), and
the API again on the restarted server.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel

from tests.conftest import INVENTORY, PROFILES
from tests.support.server import RunningServer, process_alive, start_server, wait_for

pytest.importorskip("numpy")

SETUP = """
import numpy as np
x = 41
a = np.arange(10)
shared = [1]
pair = [shared, shared]
_private = "mine"
def f(v):
    return v * 2
class K:
    def __init__(self, value):
        self.value = value
k = K("kv")
"""


def cycle_cell(n: int) -> str:
    """What the user does between hibernations ``n-1`` and ``n``: add, change, delete."""
    lines = [
        f"t{n} = np.full(3, {n})",
        f"shared.append({n})",
        "a = a + 1",
        f"def g{n}():\n    return [{n}, x if 'x' in globals() else None]",
        f"class C{n}:\n    tag = {n}",
        f"k.value += '{n}'",
    ]
    if n >= 3:
        lines.append(f"del t{n - 2}")
    if n == 2:
        lines.append("del x")
    if n == 4:
        lines.append("x = 'back'")
    return "\n".join(lines)


# Binds no user name (a dunder is machinery by name), so it does not change what it measures.
# STARTUP_NAMES: what a fresh kernel's namespace holds (``open``, ``In``, ``exit`` …).
DIGEST_TEMPLATE = r"""
def __elastic_digest__():
    import json, re, types
    ip = get_ipython()
    out = {}
    for name, value in ip.user_ns.items():
        if name in STARTUP_NAMES:
            continue
        if re.fullmatch(r"_{1,3}|_\d+|_i{1,3}|_i\d+|_ih|_oh|_dh|__\w+__", name):
            continue
        if isinstance(value, types.ModuleType):
            shown = ["module", value.__name__]
        elif isinstance(value, type):
            shown = ["class", value.__name__, getattr(value, "tag", None)]
        elif isinstance(value, types.FunctionType):
            shown = ["function", value.__name__, value() if value.__code__.co_argcount == 0 else value(3)]
        elif hasattr(value, "tolist"):
            shown = ["array", str(value.dtype), value.tolist()]
        elif type(value).__name__ == "K":
            shown = ["K", value.value, isinstance(value, ip.user_ns.get("K", object))]
        else:
            shown = ["value", repr(value)]
        out[name] = shown
    ns = ip.user_ns
    out["#shared"] = "pair" in ns and ns["pair"][0] is ns["pair"][1] is ns["shared"]
    out["#who"] = sorted(ip.run_line_magic("who_ls", ""))
    return json.dumps(out, sort_keys=True)
print(__elastic_digest__())
del __elastic_digest__
"""


class Reference:
    """A kernel that is never hibernated: what the namespace should be."""

    def __init__(self) -> None:
        self.km, self.kc = start_new_kernel(kernel_name="python3")
        startup = self.run("print(__import__('json').dumps(sorted(get_ipython().user_ns)))")
        self.digest = DIGEST_TEMPLATE.replace("STARTUP_NAMES", repr(set(json.loads(startup))))

    def run(self, code: str) -> str:
        out: list[str] = []

        def keep(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                raise AssertionError(f"reference kernel: {msg['content']['evalue']}")

        reply = self.kc.execute_interactive(code, timeout=60, output_hook=keep)
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def reference() -> Iterator[Reference]:
    ref = Reference()
    yield ref
    ref.close()


def config(checkpoints: Path, policy: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "ElasticKernels": {
            "profiles": PROFILES,
            "gpu_inventory": INVENTORY,
            "reap_interval": 1,
            "checkpoint_root": str(checkpoints),
        }
    }
    if policy:
        cfg["CullPolicy"] = {"idle_timeout": 2, "warn_before": 0, "interval": 1}
    return cfg


def model(server: RunningServer, kernel_id: str) -> dict[str, Any]:
    return dict(server.get(f"/api/elastic/kernels/{kernel_id}"))


def user_names(digest: dict[str, Any]) -> set[str]:
    return {name for name in digest if not name.startswith("#")}


def run_both(server: RunningServer, kernel_id: str, reference: Reference, code: str) -> tuple[str, str]:
    """Run ``code`` in both kernels; return the elastic kernel's restore report (if any) and stdout."""
    with server.channel(kernel_id, timeout=120) as chan:
        result = chan.execute(code, timeout=120)
    assert result.error == "", result.error
    reference.run(code)
    return " ".join(result.displays), result.stdout


def check_same(server: RunningServer, kernel_id: str, reference: Reference) -> dict[str, Any]:
    got = json.loads(server.execute(kernel_id, reference.digest, timeout=120))
    want = json.loads(reference.run(reference.digest))
    assert got == want
    return dict(got)


def test_five_cycles_by_every_trigger_keep_the_namespace(tmp_path: Path, reference: Reference) -> None:
    checkpoints = tmp_path / "checkpoints"
    server = start_server(tmp_path, config(checkpoints))
    try:
        kernel_id = server.start_kernel("python3-gpu-small")
        run_both(server, kernel_id, reference, SETUP)
        digest = check_same(server, kernel_id, reference)

        def hibernated_with_everything(srv: RunningServer) -> None:
            current = model(srv, kernel_id)
            assert current["state"] == "hibernated", current
            assert set(current["checkpoint"]["saved"]) == user_names(digest), current["checkpoint"]

        for n, trigger in enumerate(["api", "shutdown", "policy", "crash", "api"], start=1):
            if trigger == "api":
                reply = server.request("POST", f"/api/elastic/kernels/{kernel_id}/hibernate")
                assert reply.status == 200, reply
                hibernated_with_everything(server)
            elif trigger == "shutdown":
                server.stop()  # SIGTERM: hibernate_on_shutdown
                server = start_server(tmp_path, config(checkpoints, policy=True))
                hibernated_with_everything(server)
            elif trigger == "policy":
                wait_for(
                    lambda srv=server: model(srv, kernel_id)["state"] == "hibernated",
                    timeout=60,
                    what="the cull policy to hibernate the idle kernel",
                )
                hibernated_with_everything(server)
                assert "policy" in model(server, kernel_id)["state_reason"]
            elif trigger == "crash":
                pid = int(server.execute(kernel_id, "import os; print(os.getpid())").strip())
                reference.run("import os")
                digest = check_same(server, kernel_id, reference)
                os.kill(server.process.pid, signal.SIGKILL)
                server.process.wait()
                wait_for(
                    lambda pid=pid: not process_alive(pid),
                    timeout=60,
                    what="the orphan to checkpoint",
                )
                server = start_server(tmp_path, config(checkpoints))
                hibernated_with_everything(server)

            # The next cell resumes it; the report counts every variable.
            report, _ = run_both(server, kernel_id, reference, cycle_cell(n))
            count = len(user_names(digest))
            assert f"restored {count} variables" in report, report
            digest = check_same(server, kernel_id, reference)
            assert digest["#shared"] is True
            assert f"t{n}" in digest and (n < 3 or f"t{n - 2}" not in digest)
    finally:
        server.stop()
