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
from typing import Any

from jupyter_server.serverapp import ServerApp
from traitlets import default

from gateway.access import GatewayAccess
from gateway.config import ElasticGateway, ElasticQuota
from gateway.identity import HubIdentityProvider
from kernelmgr.config import CullPolicy, ElasticKernels
from kernelmgr.core.errors import ConfigError
from kernelmgr.server.ownership import SETTINGS_KEY

CONFIG_ERROR_EXIT = 2
#: Where JupyterHub puts a service's API token (current and legacy names).
HUB_SECRET_VARIABLES = ("JUPYTERHUB_API_TOKEN", "JPY_API_TOKEN")


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

    def find_server_extensions(self) -> None:
        """Only the extensions configured for the gateway: a headless gateway loads no UI."""

    def init_configurables(self) -> None:
        self.gateway_settings = ElasticGateway(parent=self)
        if self.gateway_settings.auth == "jupyterhub" and not self.trait_has_value("identity_provider_class"):
            self.identity_provider_class = HubIdentityProvider
        super().init_configurables()

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
            quotas = ElasticQuota(parent=self).build(list(runtime.profiles))
        except ConfigError as exc:
            self.log.critical("elastic-gateway: invalid configuration: %s", exc.message)
            sys.exit(CONFIG_ERROR_EXIT)
        _keep_hub_token_from_kernels(identity)
        access = GatewayAccess(
            km,
            runtime,
            identity,
            quotas,
            self.gateway_settings.admin_users,
            self.gateway_settings.admin_groups,
        )
        self.web_app.settings[SETTINGS_KEY] = access
        if km.hibernator is not None:
            km.hibernator.admission = access.resume_refusal
        self.log.info("elastic-gateway: JupyterHub users own their kernels; quotas %s", quotas)


def _keep_hub_token_from_kernels(identity: HubIdentityProvider) -> None:
    """The Hub gives this service its API token in the environment, which local kernels inherit:
    read it into the Hub client, then take it out, so no user's kernel holds the gateway's token."""
    if identity.hub_auth.api_token:
        for name in HUB_SECRET_VARIABLES:
            os.environ.pop(name, None)


main = ElasticGatewayApp.launch_instance


if __name__ == "__main__":
    main()
