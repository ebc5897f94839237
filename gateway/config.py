"""The gateway's configuration: how users are identified, who is an admin, and their quotas.

Traitlets, like the rest of the project, so one ``jupyter_server_config.json`` (a Helm
ConfigMap) holds the gateway's settings beside ``ElasticKernels`` and ``CullPolicy``.
"""

from __future__ import annotations

from traitlets import Dict, Enum, List, Unicode
from traitlets.config import Configurable

from gateway.quota import QuotaTable, parse_limits


class ElasticGateway(Configurable):
    """Identity and administration of the shared gateway."""

    auth = Enum(
        ["jupyterhub", "token"],
        default_value="jupyterhub",
        help="""How requests are identified. 'jupyterhub': the gateway runs as a JupyterHub service and
        checks every request's token with the Hub (each user owns their own kernels). 'token': one
        static token (ServerApp.IdentityProvider.token); single-tenant, everyone with the token sees
        every kernel.""",
    ).tag(config=True)

    admin_users = List(
        Unicode(),
        help="Hub users who see and act on every user's kernels (besides the Hub's own admins).",
    ).tag(config=True)

    admin_groups = List(
        Unicode(),
        help="Hub groups whose members see and act on every user's kernels.",
    ).tag(config=True)


class ElasticQuota(Configurable):
    """Per-user and per-group limits: GPU sizes offered, kernels, GPU held at once.

    Each entry is a mapping of ``max_kernels`` (int), ``max_gpu`` (GPUs, the sum of the sizes'
    fractions of a user's kernels that hold a slice: hibernated kernels do not count) and
    ``profiles`` (the GPU size names offered); ``null`` or a missing key: no limit (or, in a
    group or user entry, the next level's value).
    """

    default = Dict(
        help='Limits for every user, e.g. {"max_kernels": 4, "max_gpu": 1, "profiles": ["quarter"]}.',
    ).tag(config=True)

    groups = Dict(
        help="""Limits per Hub group; a user in several groups gets the most generous value of each
        limit. Example: {"research": {"max_gpu": 2, "profiles": ["quarter", "half", "full"]}}.""",
    ).tag(config=True)

    users = Dict(
        help="Limits per Hub user; a user's own entry wins over the defaults and groups.",
    ).tag(config=True)

    def build(self, known_profiles: list[str]) -> QuotaTable:
        """The validated table; raises ConfigError naming the entry to fix."""
        default = parse_limits("ElasticQuota.default", self.default, known_profiles)
        groups = {
            name: parse_limits(f"ElasticQuota.groups[{name!r}]", raw, known_profiles)
            for name, raw in self.groups.items()
        }
        users = {
            name: parse_limits(f"ElasticQuota.users[{name!r}]", raw, known_profiles)
            for name, raw in self.users.items()
        }
        return QuotaTable(default=default, groups=groups, users=users)
