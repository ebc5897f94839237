"""The docs site's reference pages, generated at build time so they cannot drift from the code.

``settings.md`` lists every configurable trait of the project's classes (name, type, default,
help), read from the traits themselves; ``rest.md`` lists every path of ``docs/openapi.yaml``.
Both are written into ``docs/reference/`` when Sphinx starts (git ignores them); a pure test
checks the generators against the classes and the OpenAPI file.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import yaml

DOCS = Path(__file__).resolve().parent.parent
#: (module, class, why it is listed): the classes an admin configures, in reading order.
CONFIGURABLES = [
    ("kernelmgr.config", "ElasticKernels", "GPU sizes, inventory, checkpoints, timeouts, warm pool"),
    ("kernelmgr.config", "CullPolicy", "when idle kernels are warned and hibernated"),
    ("kernelmgr.config", "S3Checkpoints", "the bucket checkpoints go to with `checkpoint_store` s3"),
    (
        "kernelmgr.kube.settings",
        "KubeSettings",
        "kernels as pods; also read as `ElasticKubernetesProvisioner.<name>` (which wins, and is what "
        "the Helm chart renders)",
    ),
    ("kernelmgr.kube.leader", "ElasticLeaderElection", "more than one gateway: the Lease of the active one"),
    ("kernelmgr.server.websocket", "ElasticWebsocketConnection", "what a notebook connection may queue"),
    ("gateway.config", "ElasticGateway", "the shared gateway: identity, admins, kernel accounts"),
    ("gateway.config", "ElasticQuota", "per-user and per-group limits at the gateway"),
    ("gateway.singleuser", "ElasticGatewayMappingKernelManager", "a user's server that uses the gateway"),
]


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def _own_config_traits(cls: type) -> dict[str, Any]:
    """The configurable traits a class adds itself (its base's are the base project's to document)."""
    traits: dict[str, Any] = cls.class_own_traits(config=True)  # type: ignore[attr-defined]
    return dict(sorted(traits.items()))


def settings_markdown() -> str:
    """The settings reference: one table per configurable class."""
    lines = [
        "# Settings reference",
        "",
        "Every setting of the project, generated from the code when the docs are built. Set them in",
        "`jupyter_server_config.py` (`c.ElasticKernels.idle_timeout = 600`), in a JSON config file, or",
        "through the Helm chart's values (which render a JSON config file).",
        "",
    ]
    for module, name, why in CONFIGURABLES:
        cls = getattr(importlib.import_module(module), name)
        lines += [f"## {name}", "", f"{why}.", "", "| setting | type | default | what |", "|---|---|---|---|"]
        for trait_name, trait in _own_config_traits(cls).items():
            kind = type(trait).__name__
            default = trait.default_value_repr()
            lines.append(
                f"| `{name}.{trait_name}` | {kind} | `{_cell(default)}` | {_cell(trait.help or '')} |"
            )
        lines.append("")
    return "\n".join(lines)


HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options"}


def _resolve(spec: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """``node``, or what its local ``$ref`` (``#/components/...``) points at."""
    ref = node.get("$ref")
    if not ref:
        return node
    target: Any = spec
    for part in ref.lstrip("#/").split("/"):
        target = target[part]
    return dict(target)


def rest_markdown(openapi: Path = DOCS / "openapi.yaml") -> str:
    """The REST reference: every path and method of the OpenAPI description, with its answers."""
    spec = yaml.safe_load(openapi.read_text())
    lines = [
        "# REST API reference",
        "",
        _cell(spec["info"]["description"]),
        "",
        "Generated from [`openapi.yaml`](../openapi.yaml) when the docs are built.",
        "",
    ]
    for path, item in spec["paths"].items():
        shared = item.get("parameters", [])
        for method, operation in item.items():
            if method not in HTTP_METHODS:
                continue
            lines += [f"## `{method.upper()} {path}`", "", _cell(operation.get("summary", "")), ""]
            if operation.get("description"):
                lines += [_cell(operation["description"]), ""]
            params = [_resolve(spec, p) for p in [*shared, *operation.get("parameters", [])]]
            if params:
                lines += ["| parameter | in | what |", "|---|---|---|"]
                lines += [
                    f"| `{p['name']}` | {p['in']} | {_cell(p.get('description', ''))} |" for p in params
                ]
                lines.append("")
            lines += ["| status | meaning |", "|---|---|"]
            for status, answer in operation.get("responses", {}).items():
                answer = _resolve(spec, answer)
                lines.append(f"| {status} | {_cell(answer.get('description', ''))} |")
            lines.append("")
    return "\n".join(lines)


def write_pages(_app: Any = None) -> None:
    out = DOCS / "reference"
    out.mkdir(exist_ok=True)
    for name, text in [("settings.md", settings_markdown()), ("rest.md", rest_markdown())]:
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", write_pages)
    return {"parallel_read_safe": True}
