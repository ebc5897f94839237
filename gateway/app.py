"""``jupyter elastic-gateway``: one place where every user's GPU kernels live.

A headless jupyter_server (no contents, no notebook UI, no other server extensions) running the
elastic kernel manager and serving what jupyter_server's ``GatewayClient`` speaks
(``/api/kernels``, ``/api/kernelspecs``, the kernel websocket), plus ``/api/elastic/*`` and
``/metrics``. Single-user servers point ``GatewayClient.url`` at it; their kernels, GPU slices,
quotas and culling are then the admin's, and a user's kernels outlive the user's own server.

It takes the same configuration file as ``jupyter server`` with the extension (``ServerApp``,
``ElasticKernels``, ``CullPolicy``, provisioner settings) plus ``ElasticGateway`` and
``ElasticQuota``: ``jupyter-elastic-gateway --config=/etc/jupyter-elastic/jupyter_server_config.json``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from typing import Any

from jupyter_server.serverapp import ServerApp
from traitlets import default

from gateway.access import GatewayAccess
from gateway.authorizer import GatewayAuthorizer
from gateway.config import METRICS_TOKEN_VARIABLE, ElasticGateway, ElasticQuota
from gateway.hub_ids import HubUserIds, parse_setting
from gateway.identity import HubIdentityProvider
from gateway.kernel_accounts import install as install_kernel_accounts
from gateway.kernel_accounts import per_user, start_up_refusal
from gateway.limits import (
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_MAX_BUFFER_SIZE,
    WEBSOCKET_MAX_MESSAGE_SIZE,
    BodyLimit,
)
from kernelmgr.config import CullPolicy, ElasticKernels
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.modes import KUBERNETES_PROVISIONER, LOCAL_PROVISIONER
from kernelmgr.kube.settings import KubeSettings
from kernelmgr.server.live_config import LiveConfig, sizes
from kernelmgr.server.ownership import SETTINGS_KEY

CONFIG_ERROR_EXIT = 2
#: Where JupyterHub puts a service's API token (current and legacy names).
HUB_SECRET_VARIABLES = ("JUPYTERHUB_API_TOKEN", "JPY_API_TOKEN")
NO_HUB_TOKEN = (
    "ElasticGateway.auth is 'jupyterhub' but there is no Hub API token (JUPYTERHUB_API_TOKEN, which "
    "JupyterHub sets for a service it starts, or HubAuth.api_token): run the gateway as a JupyterHub "
    "service, or set ElasticGateway.auth = 'token' for a single-tenant gateway"
)
#: What ``--help`` shows in full: the gateway's own settings (ServerApp's are in ``--help-all``).
OWN_SETTINGS = (ElasticGateway, ElasticQuota)


class ElasticGatewayApp(ServerApp):
    """The multi-tenant elastic kernel gateway."""

    name = "jupyter-elastic-gateway"
    description = __doc__
    # No contents, files, sessions, nbconvert or UI: kernels only.
    default_services = ("api", "auth", "security", "shutdown", "events")  # type: ignore[assignment]

    # The gateway's own configurables join ServerApp's in --help-all and the config file.
    classes = [  # noqa: RUF012
        *ServerApp.classes,
        ElasticKernels,
        CullPolicy,
        ElasticGateway,
        ElasticQuota,
        HubIdentityProvider,
    ]

    def emit_help(self, classes: bool = False) -> Generator[str, None, None]:
        """``--help``: the gateway's own settings, not jupyter server's flags (``--help-all`` has all)."""
        if classes:
            yield from super().emit_help(classes=True)
            return
        yield from self.emit_description()
        yield "The gateway's own settings (in the config file, or on the command line as shown):"
        yield ""
        for configurable in OWN_SETTINGS:
            yield configurable.class_get_help()
        yield (
            "Kernels, GPU sizes and the cull policy are the extension's (ElasticKernels.*, CullPolicy.*; "
            "see `jupyter elastic-gateway --help-all`), and so are jupyter server's own options "
            "(--ServerApp.port, --ServerApp.ip, ...)."
        )
        yield ""
        yield "Example:"
        yield ""
        yield "    jupyter elastic-gateway --config=/etc/jupyter-elastic/jupyter_server_config.json"
        yield ""

    @default("extra_services")
    def _default_extra_services(self) -> list[str]:
        return ["gateway.handlers"]

    @default("jpserver_extensions")
    def _default_extensions(self) -> dict[str, bool]:
        return {"kernelmgr": True}

    @default("default_url")
    def _default_url_gateway(self) -> str:
        return "/api"

    @default("open_browser")
    def _default_open_browser(self) -> bool:
        return False

    @default("max_body_size")
    def _default_max_body_size(self) -> int:
        return DEFAULT_MAX_BODY_SIZE  # kernel requests are small JSON (gateway/limits.py)

    @default("max_buffer_size")
    def _default_max_buffer_size(self) -> int:
        # Room for a whole body and a whole websocket message (tornado_settings can raise that).
        message = int(self.tornado_settings.get("websocket_max_message_size", WEBSOCKET_MAX_MESSAGE_SIZE))
        return max(DEFAULT_MAX_BUFFER_SIZE, self.max_body_size, message + 1024 * 1024)

    @default("reraise_server_extension_failures")
    def _default_reraise_server_extension_failures(self) -> bool:
        return True  # load_server_extensions below turns the failure into one line

    def load_server_extensions(self) -> None:
        """A gateway whose kernelmgr extension failed has no elastic kernels, yet jupyter_server only
        warns and serves on (a pod Running and Ready to its probe): stop in one line, exit code 2.
        Found deploying the chart: a checkpoint claim the gateway's user could not write."""
        try:
            super().load_server_extensions()
        except Exception as exc:
            self.log.debug("the kernelmgr extension's failure", exc_info=True)
            # A file the gateway cannot write is most often the storage's owner: say whose it must be.
            account = ""
            if isinstance(exc, OSError):
                account = f" (running as uid {os.getuid()}, gid {os.getgid()})"
            self.log.critical(
                "elastic-gateway: the kernelmgr extension failed to start%s: %s: %s",
                account,
                type(exc).__name__,
                " ".join(str(exc).split()),
            )
            sys.exit(CONFIG_ERROR_EXIT)

    def init_httpserver(self) -> None:
        """Answer an oversized body with 413 from its headers, before reading (and buffering) it."""
        super().init_httpserver()
        self.http_server.request_callback = BodyLimit(self.web_app, self.max_body_size)

    def find_server_extensions(self) -> None:
        """Only the extensions configured for the gateway: a headless gateway loads no UI."""

    def init_configurables(self) -> None:
        self.gateway_settings = ElasticGateway(parent=self)
        if self.gateway_settings.auth == "jupyterhub" and not self.trait_has_value("identity_provider_class"):
            self.identity_provider_class = HubIdentityProvider
        if self.gateway_settings.auth == "jupyterhub" and not self.trait_has_value("authorizer_class"):
            self.authorizer_class = GatewayAuthorizer  # shutdown, event posting, status: admins only
        self.gateway_settings.metrics_token  # noqa: B018 - read now, then out of the environment:
        os.environ.pop(METRICS_TOKEN_VARIABLE, None)  # no kernel inherits the scrape token
        self._check_kernel_accounts()
        self._check_user_ids()
        super().init_configurables()

    def _check_kernel_accounts(self) -> None:
        """Multi-user local kernels run as their owners' accounts, or the admin said single-tenant."""
        elastic = ElasticKernels(parent=self)
        why = start_up_refusal(self.gateway_settings, elastic)
        if why is not None:
            self.log.critical("elastic-gateway: %s", why)
            sys.exit(CONFIG_ERROR_EXIT)
        if per_user(self.gateway_settings, elastic):
            # Kernelspecs that name no provisioner (python3) start through the one that drops
            # privileges too, never as the gateway's root.
            self.config.KernelProvisionerFactory.default_provisioner_name = LOCAL_PROVISIONER

    def initialize(self, argv: Any = None, *args: Any, **kwargs: Any) -> None:
        super().initialize(argv, *args, **kwargs)
        if self.gateway_settings.auth == "jupyterhub":
            self._install_access()

    def _install_access(self) -> None:
        """Ownership and quotas on every path, and the quota check on resumes."""
        km: Any = self.kernel_manager
        runtime = km.elastic_runtime
        identity = self.identity_provider
        if runtime is None or not isinstance(identity, HubIdentityProvider):
            self.log.critical(
                "elastic-gateway: with ElasticGateway.auth='jupyterhub' the gateway needs the kernelmgr "
                "extension and gateway.identity.HubIdentityProvider"
            )
            sys.exit(CONFIG_ERROR_EXIT)
        try:
            quotas = ElasticQuota(parent=self).build(list(runtime.profiles), runtime.max_checkpoint_bytes)
        except ConfigError as exc:
            self.log.critical("elastic-gateway: invalid configuration: %s", exc.message)
            sys.exit(CONFIG_ERROR_EXIT)
        if not identity.hub_auth.api_token:
            self.log.critical("elastic-gateway: %s", NO_HUB_TOKEN)
            sys.exit(CONFIG_ERROR_EXIT)
        _keep_hub_token_from_kernels(identity)
        if per_user(self.gateway_settings, ElasticKernels(parent=self)):
            try:
                accounts = install_kernel_accounts(self.gateway_settings, runtime, self.kernel_spec_manager)
            except ConfigError as exc:
                self.log.critical("elastic-gateway: %s", exc.message)
                sys.exit(CONFIG_ERROR_EXIT)
            self.log.info(
                "elastic-gateway: kernels run as their owners' accounts (%s), files under %s",
                accounts.template,
                accounts.runtime_root,
            )
        self._install_user_ids(runtime, identity)
        access = GatewayAccess(
            km,
            runtime,
            identity,
            quotas,
            self.gateway_settings.admin_users,
            self.gateway_settings.admin_groups,
        )
        self.web_app.settings[SETTINGS_KEY] = access
        live = self.web_app.settings.get("elastic_live_config")
        if isinstance(live, LiveConfig):
            live.appliers.append(self._live_quotas(access))
        if km.hibernator is not None:
            km.hibernator.admission = access.reserve_resume  # quota held until the resume ends
            km.hibernator.space.quota_of = lambda owner: access.limits_for(owner).max_checkpoint_bytes
        self.log.info("elastic-gateway: JupyterHub users own their kernels; quotas %s", quotas)

    def _check_user_ids(self) -> None:
        """user_ids_from_auth_state checked before anything starts: one line and exit code 2."""
        raw = self.gateway_settings.user_ids_from_auth_state
        if not raw:
            return
        try:
            parse_setting(raw)
            if self.gateway_settings.auth != "jupyterhub":
                raise ConfigError(
                    "ElasticGateway.user_ids_from_auth_state needs ElasticGateway.auth = 'jupyterhub' "
                    "(the uids come from the Hub's auth state)"
                )
            if ElasticKernels(parent=self).kernel_provisioner != KUBERNETES_PROVISIONER:
                raise ConfigError(
                    "ElasticGateway.user_ids_from_auth_state is for Kubernetes kernels "
                    f"(ElasticKernels.kernel_provisioner = {KUBERNETES_PROVISIONER}); local kernels run as "
                    "their owner's OS account (ElasticGateway.kernel_account): remove it"
                )
            if KubeSettings(parent=self).warm_pods:
                raise ConfigError(
                    "ElasticKubernetesProvisioner.warm_pods cannot be used with "
                    "ElasticGateway.user_ids_from_auth_state: a warm pod runs before it has an owner, so "
                    "not as its owner's uid (no kernel would take one): remove warm_pods"
                )
        except ConfigError as exc:
            self.log.critical("elastic-gateway: %s", exc.message)
            sys.exit(CONFIG_ERROR_EXIT)

    def _install_user_ids(self, runtime: Any, identity: HubIdentityProvider) -> None:
        """Kernel pods as each user's uid and gid from their Hub auth state (user_ids_from_auth_state)."""
        raw = self.gateway_settings.user_ids_from_auth_state
        if not raw:
            return
        setting = parse_setting(raw)  # checked at start (_check_user_ids)
        runtime.owner_ids = HubUserIds(
            identity.hub_auth, setting, self.gateway_settings.user_ids_refresh_seconds, self.log
        )
        self.log.info("elastic-gateway: kernel pods run as the uids in auth state %s", setting)

    def _live_quotas(self, access: GatewayAccess) -> Any:
        """The quotas' part of a live change (ElasticKernels.live_config_file): the next start or
        resume is checked against the new table; running kernels keep running."""

        def prepare(config: Any) -> Any:
            table = ElasticQuota(config=config).build(sizes(config), access.runtime.max_checkpoint_bytes)

            def apply() -> None:
                access.quotas = table
                self.log.info("elastic-gateway: quotas %s", table)

            return apply

        return prepare


def _keep_hub_token_from_kernels(identity: HubIdentityProvider) -> None:
    """The Hub gives this service its API token in the environment, which local kernels inherit:
    read it into the Hub client, then take it out, so no user's kernel holds the gateway's token."""
    if identity.hub_auth.api_token:
        for name in HUB_SECRET_VARIABLES:
            os.environ.pop(name, None)


main = ElasticGatewayApp.launch_instance


if __name__ == "__main__":
    main()
