"""The gateway's configuration: how users are identified, who is an admin, and their quotas.

Traitlets, like the rest of the project, so one ``jupyter_server_config.json`` (a Helm
ConfigMap) holds the gateway's settings beside ``ElasticKernels`` and ``CullPolicy``.
"""

from __future__ import annotations

import os

from traitlets import Bool, Dict, Enum, Float, List, Unicode, default
from traitlets.config import Configurable

from gateway.quota import QuotaTable, parse_limits

#: Where the Prometheus scrape token may come from (a Kubernetes Secret as an env variable).
METRICS_TOKEN_VARIABLE = "ELASTIC_METRICS_TOKEN"


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

    kernel_accounts = Enum(
        ["per-user", "shared"],
        default_value="per-user",
        help="""Which OS account runs local kernels (ElasticKernels.kernel_provisioner =
        elastic-local-provisioner) when auth is 'jupyterhub'. 'per-user': each kernel runs as its
        owner's system account (ElasticGateway.kernel_account), with its connection file, key file
        and checkpoint folder readable by that account only and none of the gateway's secrets in
        its environment; the gateway must run as root (it starts kernels the way JupyterHub's
        LocalProcessSpawner starts servers) and refuses to start otherwise. 'shared': every
        kernel runs as the gateway's own account, so any user's cell can read every other user's
        kernel (connection files), checkpoints, the checkpoint secret and the gateway's Hub token:
        accepted only with ElasticGateway.single_tenant = True; otherwise the gateway refuses to
        start. ElasticKernels.warm_pool is refused with 'per-user' (a warm process has no owner).""",
    ).tag(config=True)

    single_tenant = Bool(
        False,
        help="""Say that one person (or one trust domain) uses this gateway, so kernels may share the
        gateway's OS account (ElasticGateway.kernel_accounts = 'shared'). Nothing then separates
        one Hub user's kernels from another's.""",
    ).tag(config=True)

    kernel_account = Unicode(
        "{username}",
        help="""The system account a Hub user's kernels run as with kernel_accounts = 'per-user': a
        template with {username}, e.g. '{username}' (the same name) or 'jupyter-{username}'. The
        account must exist (useradd) and must not be root; a user without one cannot start kernels.""",
    ).tag(config=True)

    kernel_runtime_dir = Unicode(
        "/run/jupyter-elastic-kernels",
        help="""With kernel_accounts = 'per-user': the root-owned folder (0711) holding one folder per
        account for its kernels' connection and key files. Every folder above it must be enterable
        by other users (o+x).""",
    ).tag(config=True)

    user_ids_from_auth_state = Dict(
        help="""Run each Hub user's kernel pods as the uid and gid their JupyterHub auth state holds, e.g.
        {"uid": "uidNumber", "gid": "gidNumber"}: the auth state's keys (dots for nested keys, e.g.
        "user_attributes.uidNumber"; an LDAP attribute's one-value list is its value; gid optional:
        the uid). "uid_base"/"gid_base" (numbers) are added, for a numeric id that is not a uid yet
        (e.g. {"uid": "github_user.id", "uid_base": 100000}). The gateway reads the auth state from the
        Hub's API with its service token, which needs admin:auth_state and read:users; answers
        are cached for user_ids_refresh_seconds. A user without the key is refused (403, saying what to
        fix), never run as another uid. ElasticKubernetesProvisioner.user_ids wins where it names the
        user. Kubernetes kernels only (local kernels run as kernel_account). Empty: off.""",
    ).tag(config=True)

    user_ids_refresh_seconds = Float(
        300.0,
        min=0,
        help="""How long a user's uid and gid read from their auth state are used before the Hub is asked
        again (at their next kernel start or resume). A Hub that does not answer then leaves the last
        answer in use.""",
    ).tag(config=True)

    metrics_token = Unicode(
        help="""A token Prometheus sends to scrape /metrics (Authorization: Bearer <token>); without
        it /metrics is for the gateway's admins only. Default: the ELASTIC_METRICS_TOKEN
        environment variable (taken out of the environment at start, so kernels never see it).""",
    ).tag(config=True)

    @default("metrics_token")
    def _default_metrics_token(self) -> str:
        return os.environ.get(METRICS_TOKEN_VARIABLE, "")


class ElasticQuota(Configurable):
    """Per-user and per-group limits: GPU sizes offered, kernels, GPU held at once, checkpoint bytes.

    Each entry is a mapping of ``max_kernels`` (int), ``max_gpu`` (GPUs, the sum of the sizes'
    fractions of a user's kernels that hold a slice: hibernated kernels do not count),
    ``profiles`` (the GPU size names offered) and ``max_checkpoint_bytes`` (bytes or "20Gi": the
    user's share of the checkpoint store; the default entry's falls back to
    ElasticKernels.max_checkpoint_bytes); ``null`` or a missing key: no limit (or, in a group or
    user entry, the next level's value).
    """

    default = Dict(
        help='Limits for every user, e.g. {"max_kernels": 4, "max_gpu": 1, "profiles": ["quarter"], '
        '"max_checkpoint_bytes": "50Gi"}.',
    ).tag(config=True)

    groups = Dict(
        help="""Limits per Hub group; a user in several groups gets the most generous value of each
        limit. Example: {"research": {"max_gpu": 2, "profiles": ["quarter", "half", "full"]}}.""",
    ).tag(config=True)

    users = Dict(
        help="Limits per Hub user; a user's own entry wins over the defaults and groups.",
    ).tag(config=True)

    def build(self, known_profiles: list[str], checkpoint_bytes: int | None = None) -> QuotaTable:
        """The validated table; raises ConfigError naming the entry to fix. ``checkpoint_bytes``:
        the default's checkpoint quota when it sets none (``ElasticKernels.max_checkpoint_bytes``)."""
        default = parse_limits("ElasticQuota.default", self.default, known_profiles)
        default.setdefault("max_checkpoint_bytes", checkpoint_bytes)
        groups = {
            name: parse_limits(f"ElasticQuota.groups[{name!r}]", raw, known_profiles)
            for name, raw in self.groups.items()
        }
        users = {
            name: parse_limits(f"ElasticQuota.users[{name!r}]", raw, known_profiles)
            for name, raw in self.users.items()
        }
        return QuotaTable(default=default, groups=groups, users=users)
