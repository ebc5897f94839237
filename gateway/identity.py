"""Who is asking: JupyterHub users, identified by their token, checked with the Hub.

The gateway runs as a Hub service. A single-user server sends its own Hub token
(``GatewayClient.auth_token`` from ``JUPYTERHUB_API_TOKEN``); a user's own API token works as
well. The token is checked with JupyterHub's client library (:class:`HubAuth`, which caches
answers for a few minutes), and it must carry the scope to access this service
(``access:services!service=<name>``), as JupyterHub's own services require.

The Hub's user model (name, groups, admin) is remembered per user name, so decisions made
without a request at hand (a resume started by the next cell) use the same groups.
"""

from __future__ import annotations

from typing import Any

from jupyter_server.auth.identity import IdentityProvider, User
from jupyterhub.services.auth import HubAuth
from traitlets import Instance, default

from kernelmgr import compat


class HubIdentityProvider(IdentityProvider):
    """Identify requests as JupyterHub users; no login page (the Hub does logins)."""

    hub_auth = Instance(
        HubAuth, help="The Hub client; configured from the service's JUPYTERHUB_* environment."
    )

    @default("hub_auth")
    def _default_hub_auth(self) -> HubAuth:
        return HubAuth(parent=self)

    @default("token")
    def _token_default(self) -> str:
        return ""  # no server token: every request carries a Hub token

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hub_users: dict[str, dict[str, Any]] = {}

    @property
    def auth_enabled(self) -> bool:
        return True

    @property
    def login_available(self) -> bool:
        return False

    @property
    def logout_available(self) -> bool:
        return False

    def get_handlers(self) -> list[tuple[str, object]]:
        return []

    async def get_user(self, handler: Any) -> User | None:
        model = await self.hub_auth.get_user(handler, sync=False)
        if not model:
            return None
        if model.get("kind", "user") != "user":
            self.log.warning(
                "elastic-gateway: refused a %s token (%s): only users own kernels",
                model.get("kind"),
                model.get("name"),
            )
            return None
        if not self.hub_auth.check_scopes(self.hub_auth.access_scopes, model):
            self.log.warning(
                "elastic-gateway: user %s's token lacks %s",
                model.get("name"),
                sorted(self.hub_auth.access_scopes),
            )
            return None
        compat.mark_token_authenticated(handler)  # token auth: no cookie, no XSRF check
        name = str(model["name"])
        self.hub_users[name] = model
        return User(username=name)

    def groups_of(self, name: str) -> list[str]:
        """The user's Hub groups as last seen (empty when the token may not read them)."""
        return list(self.hub_users.get(name, {}).get("groups") or [])

    def is_hub_admin(self, name: str) -> bool:
        return bool(self.hub_users.get(name, {}).get("admin"))

    def validate_security(self, app: Any, ssl_options: dict[str, Any] | None = None) -> None:
        """Nothing to warn about: no server token or password is used."""
