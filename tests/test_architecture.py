"""The layering rules: the core model imports no web, Jupyter, Kubernetes or config framework;
``kube/`` (the cluster) imports no provisioner; no module keeps Kubernetes clients in its globals."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kernelmgr

pytestmark = pytest.mark.pure

PACKAGE = Path(kernelmgr.__file__).parent
FORBIDDEN_IN_CORE = ("tornado", "jupyter_server", "jupyter_client", "kubernetes", "traitlets", "pynvml")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def violations(directory: Path, forbidden: tuple[str, ...]) -> list[str]:
    """Every import under ``directory`` (or in that one file) of a top-level package in ``forbidden``."""
    bad = []
    for path in [directory] if directory.is_file() else sorted(directory.rglob("*.py")):
        for module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(directory.parent)} imports {module}")
    return bad


def test_core_imports_no_framework() -> None:
    assert violations(PACKAGE / "core", FORBIDDEN_IN_CORE) == []


def test_core_does_not_import_adapters() -> None:
    adapters = tuple(
        f"kernelmgr.{name}" for name in ("backends", "provisioners", "activity", "server", "cli", "config")
    )
    bad = [
        f"{path.name} imports {module}"
        for path in (PACKAGE / "core").rglob("*.py")
        for module in imported_modules(path)
        if module.startswith(adapters)
    ]
    assert bad == []


def test_backends_import_no_web_framework() -> None:
    assert (
        violations(PACKAGE / "backends", ("tornado", "jupyter_server", "jupyter_client", "kubernetes")) == []
    )


def test_node_agent_imports_no_kubernetes_or_jupyter() -> None:
    """The node agent holds no API rights and needs no Jupyter server: it does not even import them."""
    forbidden = ("kubernetes", "jupyter_server", "jupyter_client", "traitlets")
    assert violations(PACKAGE / "nodeagent", forbidden) == []
    assert violations(PACKAGE / "kube" / "node_agents.py", forbidden) == []


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    fake = tmp_path / "core"
    fake.mkdir()
    (fake / "bad.py").write_text("from tornado import web\n")
    assert violations(fake, FORBIDDEN_IN_CORE) == ["core/bad.py imports tornado"]


def test_core_public_names_resolve_lazily_and_agree() -> None:
    # kernelmgr.core lists its public names three times (type-checking imports, _HOMES,
    # __all__) so static tools see them; they must agree and each must resolve to its home.
    import importlib
    import subprocess
    import sys

    import kernelmgr.core as core

    assert sorted(core.__all__) == sorted(core._HOMES)
    for name, home in core._HOMES.items():
        assert getattr(core, name) is getattr(importlib.import_module(f"kernelmgr.core.{home}"), name)
    # What the in-kernel agent imports must not pull in the allocator and the rest.
    probe = "import sys, kernelmgr.core.errors; print('kernelmgr.core.allocator' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def string_literals(path: Path, wanted: set[str]) -> list[str]:
    """``path:line`` of each string constant in ``wanted`` that is code, not a docstring."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.name}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in wanted and id(node) not in docstrings
    ]


def test_each_provisioner_name_is_defined_once_and_is_its_entry_point() -> None:
    """Code asks ``runtime.mode``; the names live in core/modes.py alone, as pyproject's entry points."""
    import tomllib

    from kernelmgr.core.modes import KernelMode

    names = {mode.provisioner for mode in KernelMode}
    found = [
        hit
        for root in (PACKAGE, PACKAGE.parent / "gateway")
        for path in sorted(root.rglob("*.py"))
        if path != PACKAGE / "core" / "modes.py"
        for hit in string_literals(path, names)
    ]
    assert found == []
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    assert set(pyproject["project"]["entry-points"]["jupyter_client.kernel_provisioners"]) == names


def test_the_literal_rule_catches_a_comparison(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""Mentions elastic-local-provisioner."""\nlocal = name == "elastic-local-provisioner"\n')
    assert string_literals(bad, {"elastic-local-provisioner"}) == ["bad.py:2"]


def test_the_lifecycle_imports_no_web_or_kubernetes_framework_and_not_the_server() -> None:
    """``server/`` depends on ``lifecycle/``, never the reverse (jupyter_server is reached via KernelHost)."""
    assert violations(PACKAGE / "lifecycle", ("jupyter_server", "tornado", "kubernetes")) == []
    upward = [
        f"{path.name} imports {module}"
        for path in sorted((PACKAGE / "lifecycle").rglob("*.py"))
        for module in imported_modules(path)
        if module.startswith(("kernelmgr.server", "gateway"))
    ]
    assert upward == []


def test_only_the_controller_module_moves_a_lifecycle() -> None:
    """Every state write goes through core/controller.py (``KernelStates`` and the controller)."""
    moves = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "core" / "controller.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "move"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "lifecycle"
    ]
    assert moves == []


def execution_state_writes(root: Path) -> list[str]:
    """Every assignment to an ``execution_state`` attribute (or ``setattr`` of one) under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in ast.walk(target)]
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and len(node.args) > 1:
                targets = [ast.Attribute(value=node.args[0], attr=str(getattr(node.args[1], "value", "")))]
            if any(isinstance(t, ast.Attribute) and t.attr == "execution_state" for t in targets):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


#: The one writer of jupyter_server's execution_state: the observer of the lifecycle's transitions.
EXECUTION_STATE_WRITER = "kernelmgr/server/execution_state.py"


def test_only_the_transition_observer_sets_jupyters_execution_state() -> None:
    """jupyter's execution_state follows the lifecycle (``server/execution_state.py`` observes
    ``KernelStates``); no path sets it by hand as a third state machine."""
    writes = execution_state_writes(PACKAGE) + execution_state_writes(PACKAGE.parent / "gateway")
    assert [w for w in writes if not w.startswith(EXECUTION_STATE_WRITER + ":")] == []


def test_the_execution_state_rule_catches_a_write(tmp_path: Path) -> None:
    fake = tmp_path / "lifecycle"
    fake.mkdir()
    (fake / "bad.py").write_text(
        "def f(km):\n    km.execution_state = 'idle'\n    a = km.execution_state = 'x'\n"
        "    setattr(km, 'execution_state', 'dead')\n    print(km.execution_state == 'idle')\n"
    )
    assert execution_state_writes(fake) == ["lifecycle/bad.py:2", "lifecycle/bad.py:3", "lifecycle/bad.py:4"]


#: Past this many lines a module says in its docstring why it stays whole.
LONG_MODULE_LINES = 500


def long_modules_without_a_reason(root: Path) -> list[str]:
    """Modules over :data:`LONG_MODULE_LINES` lines whose docstring has no paragraph starting
    "Long because" (why it stays one module rather than two)."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines <= LONG_MODULE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text, filename=str(path))) or ""
        if not any(paragraph.startswith("Long because") for paragraph in doc.split("\n\n")):
            bad.append(f"{path.relative_to(root.parent)} ({lines} lines)")
    return bad


def test_no_long_module_without_a_reason() -> None:
    """A module over 500 lines does two jobs (split it) or says why it stays whole."""
    assert (
        long_modules_without_a_reason(PACKAGE) + long_modules_without_a_reason(PACKAGE.parent / "gateway")
        == []
    )


def test_the_long_module_rule_catches_one(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    filler = "x = 1\n" * LONG_MODULE_LINES
    (package / "long.py").write_text('"""Two jobs."""\n' + filler)
    (package / "reasoned.py").write_text('"""One job.\n\nLong because it is one job."""\n' + filler)
    (package / "short.py").write_text(filler)
    assert long_modules_without_a_reason(package) == [f"pkg/long.py ({LONG_MODULE_LINES + 1} lines)"]


def imported_from(path: Path) -> set[str]:
    """``pkg.name`` of each ``from pkg import name`` (``name`` may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        for alias in node.names
    }


def imports_of(directory: Path, prefix: str) -> list[str]:
    """Every import under ``directory`` of ``prefix`` or a module below it (type-checking and
    function-level imports included: they are arrows too)."""
    return [
        f"{path.relative_to(directory.parent)} imports {module}"
        for path in sorted(directory.rglob("*.py"))
        for module in sorted(imported_modules(path) | imported_from(path))
        if module == prefix or module.startswith(f"{prefix}.")
    ]


#: What a module that may run inside the kernel (``checkpoint/``) may import from ``kernelmgr``:
#: its own package, the manifest types and errors of the core, and the package version.
#: ``objectstore.transfer`` is the kernel's side of the object store (presigned URLs, no credential).
IN_KERNEL_MAY_IMPORT = (
    "kernelmgr.checkpoint",
    "kernelmgr.core.manifest",
    "kernelmgr.core.errors",
    "kernelmgr.objectstore.transfer",
)
#: Frameworks of the server process, never loaded into a kernel. (Not tornado: ipykernel runs on
#: a tornado loop, and the SIGTERM guard installs itself there.)
SERVER_FRAMEWORKS = ("jupyter_server", "kubernetes", "prometheus_client", "gateway")


def in_kernel_violations(directory: Path) -> list[str]:
    """Imports under ``directory`` of a server-side ``kernelmgr`` module or a server framework
    (type-checking and function-level imports included)."""
    bad = violations(directory, SERVER_FRAMEWORKS)
    for path in sorted(directory.rglob("*.py")):
        for module in sorted(imported_modules(path) | imported_from(path)):
            if module.split(".")[0] != "kernelmgr" or module in ("kernelmgr", "kernelmgr.__version__"):
                continue
            if not any(
                module == allowed or module.startswith(f"{allowed}.") for allowed in IN_KERNEL_MAY_IMPORT
            ):
                bad.append(f"{path.relative_to(directory.parent)} imports {module}")
    return bad


def test_in_kernel_modules_import_nothing_of_the_server() -> None:
    """``checkpoint/`` is what runs inside the kernel (the agent and the format): it imports no
    server-side module and no server framework; the server's store is ``checkpoint_store.py``."""
    assert in_kernel_violations(PACKAGE / "checkpoint") == []


def test_the_in_kernel_rule_catches_a_violation(tmp_path: Path) -> None:
    fake = tmp_path / "checkpoint"
    fake.mkdir()
    (fake / "ok.py").write_text(
        "from kernelmgr import __version__\nfrom kernelmgr.checkpoint.errors import X\n"
        "from kernelmgr.core.manifest import Manifest\n"
    )
    (fake / "bad.py").write_text(
        "import jupyter_server\ndef f():\n    from kernelmgr.checkpoint_store import CheckpointStore\n"
    )
    assert in_kernel_violations(fake) == [
        "checkpoint/bad.py imports jupyter_server",
        "checkpoint/bad.py imports kernelmgr.checkpoint_store",
        "checkpoint/bad.py imports kernelmgr.checkpoint_store.CheckpointStore",
    ]


def test_no_product_module_imports_the_nvml_double() -> None:
    """The NVML test double ships (a test configuration names it in ``ElasticKernels.nvml_class``),
    clearly named as one; no product module imports it, so it is used only where a test asks."""
    double = "kernelmgr.activity.nvml_double"
    users = [
        f"{path.relative_to(PACKAGE.parent)}"
        for root in (PACKAGE, PACKAGE.parent / "gateway")
        for path in sorted(root.rglob("*.py"))
        if path.name != "nvml_double.py"
        and any(
            m == double or m.startswith(f"{double}.") for m in imported_modules(path) | imported_from(path)
        )
    ]
    assert users == []


def test_kube_imports_no_provisioner() -> None:
    """The cluster layer (clients, watches, manifests, warm pods) is below the per-kernel
    provisioner: it never reaches up into it (the warm pods once kept a whole provisioner)."""
    assert imports_of(PACKAGE / "kube", "kernelmgr.provisioners") == []


def test_the_kube_rule_catches_a_violation(tmp_path: Path) -> None:
    fake = tmp_path / "kube"
    fake.mkdir()
    (fake / "up.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from kernelmgr.provisioners.kubernetes import ElasticKubernetesProvisioner\n"
    )
    (fake / "up2.py").write_text("def f():\n    from kernelmgr import provisioners\n")
    assert imports_of(fake, "kernelmgr.provisioners") == [
        "kube/up.py imports kernelmgr.provisioners.kubernetes",
        "kube/up.py imports kernelmgr.provisioners.kubernetes.ElasticKubernetesProvisioner",
        "kube/up2.py imports kernelmgr.provisioners",
    ]


#: What a Kubernetes client, API or watch is called (``client.ApiClient``, ``ExplainedCoreV1Api``,
#: ``PodInformer``, ``watch.Watch`` ...).
KUBE_CLIENT_NAMES = re.compile(r"\b\w*(ApiClient|Api|Informer|Watch)\b")


def module_level_clients(path: Path) -> list[str]:
    """Kubernetes clients or watches kept in module globals: a module-level name annotated with
    or assigned one, or a function that stores one in a module-level name (``NAME[k] = ...``,
    ``NAME.add(...)``, ``global NAME``). They belong to the server's ``KubeCluster``, made and
    stopped by the extension, so that two servers (or two tests) in one process never share them."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    module_names: set[str] = set()
    for node in tree.body:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        module_names.update(names)
        annotation = getattr(node, "annotation", None)
        said = " ".join(ast.unparse(part) for part in (annotation, node.value) if part is not None)
        text = annotation is None and isinstance(node.value, ast.Constant)  # a name or message, no client
        if names and KUBE_CLIENT_NAMES.search(said) and not text:
            found.append(f"{path.name}: module-level {names[0]} = {said}")
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            stored: str | None = None
            if isinstance(node, ast.Global):
                stored = ", ".join(node.names)
                value = ast.unparse(func)
            elif isinstance(node, ast.Assign):
                bases = [t.value for t in node.targets if isinstance(t, ast.Subscript)]
                kept = [b.id for b in bases if isinstance(b, ast.Name) and b.id in module_names]
                stored = kept[0] if kept else None
                value = ast.unparse(node.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = node.func.value
                if (
                    isinstance(base, ast.Name)
                    and base.id in module_names
                    and node.func.attr in ("add", "append", "setdefault", "update", "__setitem__")
                ):
                    stored = base.id
                value = ast.unparse(node)
            if stored and KUBE_CLIENT_NAMES.search(value):
                found.append(f"{path.name}: {func.name} stores a Kubernetes client in module-level {stored}")
    return found


def test_no_kubernetes_clients_in_module_globals() -> None:
    bad = [v for path in sorted(PACKAGE.rglob("*.py")) for v in module_level_clients(path)]
    assert bad == []


def test_the_globals_rule_catches_a_client_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache.py"
    cache.write_text(
        "from kubernetes import client\n"
        "_clients: dict[str, client.ApiClient] = {}\n"
        "_watches = {}\n"
        "def api(k):\n"
        "    if k not in _clients:\n"
        "        _clients[k] = client.ApiClient()\n"
        "    return _clients[k]\n"
        "def watch(ns):\n"
        "    _watches.setdefault(ns, PodInformer(ns))\n"
        "class Cluster:\n"
        "    def api(self, k):\n"
        "        self.clients[k] = _clients[k] = client.ApiClient()\n"
    )
    assert module_level_clients(cache) == [
        "cache.py: module-level _clients = dict[str, client.ApiClient] {}",
        "cache.py: api stores a Kubernetes client in module-level _clients",
        "cache.py: watch stores a Kubernetes client in module-level _watches",
        "cache.py: api stores a Kubernetes client in module-level _clients",
    ]
    single = tmp_path / "single.py"
    single.write_text(
        "from kubernetes import client\nAPI = client.CoreV1Api()\n"
        "_shared: client.ApiClient | None = None\nNOTE = 'one ApiClient per kubeconfig'\n"
    )
    assert module_level_clients(single) == [
        "single.py: module-level API = client.CoreV1Api()",
        "single.py: module-level _shared = client.ApiClient | None None",
    ]


def import_cycles(root: Path) -> list[list[str]]:
    """Groups of ``kernelmgr`` modules that import each other, directly or not (every import
    counts: at the top, inside functions, and for type checking only)."""
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        names = imported_modules(path) | imported_from(path)
        graph[module] = {name for name in names if name.startswith(root.name + ".")}
    for module, names in graph.items():
        graph[module] = {name for name in names if name in graph and name != module}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for name in graph[module]:
            if name not in order:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in stack:
                low[module] = min(low[module], order[name])
        if low[module] == order[module]:
            group = []
            while True:
                name = stack.pop()
                group.append(name)
                if name == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_no_import_cycle() -> None:
    """The layers depend one way: server/ on lifecycle/ through KernelHost, never back."""
    assert import_cycles(PACKAGE) == []


def test_the_cycle_rule_catches_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"
    )
    (package / "c.py").write_text("import pkg.a\n")
    assert import_cycles(package) == [["pkg.a", "pkg.b"]]


#: The configuration objects: validated settings, made once at start-up and shared.
CONFIGURATION = ("config.py", "warm/settings.py")


def is_dataclass_node(node: ast.ClassDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "dataclass")
        or (isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "dataclass")
        for d in node.decorator_list
    )


def callable_fields(path: Path) -> list[str]:
    """Fields of the dataclasses in ``path`` typed as a callable (a slot a component could assign
    a callback to after construction, wiring the server by mutation)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.name}:{item.lineno} {node.name}.{ast.unparse(item.target)}: {ast.unparse(item.annotation)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and is_dataclass_node(node)
        for item in node.body
        if isinstance(item, ast.AnnAssign) and "Callable" in ast.unparse(item.annotation)
    ]


def resolved_callables(cls: type) -> list[str]:
    """Fields of dataclass ``cls`` whose resolved type is, or unions with, a callable (an alias too)."""
    import collections.abc
    import dataclasses
    import typing

    def has_callable(hint: object) -> bool:
        if typing.get_origin(hint) is collections.abc.Callable or hint is collections.abc.Callable:
            return True
        return any(has_callable(arg) for arg in typing.get_args(hint) if not isinstance(arg, list))

    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if has_callable(hints[f.name])]


def test_no_callbacks_stored_in_the_configuration() -> None:
    """Components get what they call as an explicit dependency (provisioners report losses to the
    server's ``kernel_losses``, found on their parents), never as a callable assigned into the
    configuration after it was built."""
    from kernelmgr.config import ElasticRuntime
    from kernelmgr.warm.settings import WarmPoolSettings

    assert [bad for name in CONFIGURATION for bad in callable_fields(PACKAGE / name)] == []
    assert resolved_callables(ElasticRuntime) == []
    assert resolved_callables(WarmPoolSettings) == []


def test_the_callback_rule_catches_a_callable_field(tmp_path: Path) -> None:
    import dataclasses
    from collections.abc import Callable

    config = tmp_path / "config.py"
    config.write_text(
        "from dataclasses import dataclass, field\n"
        "@dataclass\nclass Runtime:\n"
        "    name: str = ''\n"
        "    kernel_lost: Callable[[str], bool] | None = None\n"
        "@dataclass(frozen=True)\nclass Other:\n"
        "    hooks: list[Callable[[], None]] = field(default_factory=list)\n"
        "class NotData:\n"
        "    call: Callable[[], None]\n"
    )
    assert callable_fields(config) == [
        "config.py:5 Runtime.kernel_lost: Callable[[str], bool] | None",
        "config.py:8 Other.hooks: list[Callable[[], None]]",
    ]
    report = Callable[[str, str, float | None], bool]  # an alias hides the word from the source
    runtime = dataclasses.make_dataclass("Runtime", [("kernel_lost", report | None, None), ("name", str, "")])
    assert resolved_callables(runtime) == ["kernel_lost"]
