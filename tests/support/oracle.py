"""The namespace oracle: a kernel that is never hibernated runs the same cells as the elastic one.

After every resume (or any other disruption) the elastic kernel's namespace digest must equal the
reference kernel's. The digest covers every user variable (values, types, functions called, classes,
instances), shared references, deleted names, and what ``%who`` lists.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from jupyter_client.manager import start_new_kernel

from tests.support.server import KernelChannel

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

# The same without numpy, for kernels in an image that has only the package (the real node's).
PLAIN_SETUP = SETUP.replace("import numpy as np\n", "").replace("np.arange(10)", "list(range(10))")


def cycle_cell(n: int, plain: bool = False) -> str:
    """What the user does between hibernations ``n-1`` and ``n``: add, change, delete
    (``plain``: lists instead of numpy arrays, after :data:`PLAIN_SETUP`)."""
    lines = [
        f"t{n} = [{n}] * 3" if plain else f"t{n} = np.full(3, {n})",
        f"shared.append({n})",
        "a = [v + 1 for v in a]" if plain else "a = a + 1",
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


class Server(Protocol):
    """Where the elastic kernel runs: a test server (``RunningServer``) or a gateway pod."""

    def channel(self, kernel_id: str, timeout: float = ...) -> KernelChannel: ...

    def execute(self, kernel_id: str, code: str, timeout: float = ...) -> str: ...


def run_both(
    server: Server, kernel_id: str, reference: Reference, code: str, timeout: float = 120
) -> tuple[str, str]:
    """Run ``code`` in both kernels; return the elastic kernel's restore report (if any) and stdout."""
    with server.channel(kernel_id, timeout=timeout) as chan:
        result = chan.execute(code, timeout=timeout)
    assert result.error == "", result.error
    reference.run(code)
    return " ".join(result.displays), result.stdout


def check_same(server: Server, kernel_id: str, reference: Reference, timeout: float = 120) -> dict[str, Any]:
    got = json.loads(server.execute(kernel_id, reference.digest, timeout=timeout))
    want = json.loads(reference.run(reference.digest))
    assert got == want
    return dict(got)
