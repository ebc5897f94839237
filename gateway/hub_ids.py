"""Each Hub user's uid and gid, read from their JupyterHub auth state (``user_ids_from_auth_state``).

Why the auth state: where homes are uid-owned (NFS), the directory that owns the uids (LDAP's
``uidNumber``/``gidNumber``) is what the Hub's authenticator already reads at login, and it keeps
what it read in the user's encrypted auth state (``Authenticator.enable_auth_state``). The gateway
reads it from the Hub's REST API with its own service token, which needs the scopes
``admin:auth_state`` (the auth state) and ``read:users`` (the user model that carries it):
never from the client (a ``KERNEL_UID`` any user could send would claim anyone's files).

Answers are cached per user for ``user_ids_refresh_seconds`` and asked again after that (a changed
uid is followed at the next start or resume); a Hub that cannot be reached then keeps the last
answer, but an auth state that lost the key refuses. A user without the key is refused with what
the admin must fix: their kernel never runs as ``run_as_user`` (which may be another user's uid)
nor as root.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from kernelmgr.core.errors import ConfigError, ElasticError

SETTING = "ElasticGateway.user_ids_from_auth_state"
#: What the gateway's service token needs (JupyterHub's scope names).
SCOPES = "admin:auth_state and read:users"
KEYS = ("uid", "gid", "uid_base", "gid_base")


class IdentityRefused(ElasticError):
    """The owner has no usable uid in their auth state (or the Hub would not say): refuse the kernel."""


class IdentityUnknownYet(IdentityRefused):
    """The Hub cannot be reached and the owner's uid was never read: refused for now (a 503, not a
    403: nothing is wrong with the user, and the same start works when the Hub is back)."""


def parse_setting(raw: Any) -> dict[str, Any]:
    """The checked setting: ``{"uid": path, "gid": path, "uid_base": N, "gid_base": N}`` (gid and
    bases optional). A path names a key of the auth state, dots for nested keys
    (``user_attributes.uidNumber``). ConfigError saying what to fix."""
    if not isinstance(raw, dict) or "uid" not in raw or set(raw) - set(KEYS):
        raise ConfigError(
            f'{SETTING} must be {{"uid": "<auth state key>", "gid": "<auth state key>"}} (gid, uid_base and '
            f'gid_base optional; dots for nested keys, e.g. "user_attributes.uidNumber"), got {raw!r}'
        )
    for key in ("uid", "gid"):
        if key in raw and (not isinstance(raw[key], str) or not raw[key].strip(".")):
            raise ConfigError(f"{SETTING}.{key} must name an auth state key (a string), got {raw[key]!r}")
    for key in ("uid_base", "gid_base"):
        value = raw.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{SETTING}.{key} must be a number >= 0, got {value!r}")
    return dict(raw)


def _lookup(state: dict[str, Any], path: str) -> Any:
    """The value at ``path`` (dots for nesting); an LDAP attribute's one-value list gives its value."""
    value: Any = state
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value


def _number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (str, bytes)):
        text = value.decode() if isinstance(value, bytes) else value
        if text.strip().isdigit():
            return int(text.strip())
    return None


def ids_from_state(owner: str, state: Any, setting: dict[str, Any]) -> tuple[int, int]:
    """``owner``'s (uid, gid) from their auth state; IdentityRefused saying what to fix."""
    if not isinstance(state, dict):
        raise IdentityRefused(
            f"no uid for {owner!r}: the Hub holds no auth state for them ({SETTING} reads the uid from it). "
            "The admin must enable it (c.Authenticator.enable_auth_state = True, JUPYTERHUB_CRYPT_KEY set) "
            f"and {owner!r} must log in again"
        )
    found: dict[str, int] = {}
    for key in ("uid", "gid"):
        if key not in setting:
            continue
        raw = _lookup(state, setting[key])
        number = _number(raw)
        if number is None:
            what = "has no" if raw is None else f"has {raw!r}, not a number, as"
            raise IdentityRefused(
                f"no {key} for {owner!r}: their Hub auth state {what} {setting[key]!r} ({SETTING}.{key}). "
                f"The admin must give {owner!r} that attribute in the directory the Hub logs in with "
                f"(or list them in ElasticKubernetesProvisioner.user_ids); {owner!r} then logs in again"
            )
        found[key] = number + int(setting.get(f"{key}_base", 0))
    uid = found["uid"]
    gid = found.get("gid", uid)
    if uid == 0 or gid == 0:
        raise IdentityRefused(
            f"{owner!r}'s auth state maps them to uid {uid}, gid {gid}: kernels never run as root (0). "
            f"The admin must fix {owner!r}'s entry in the directory (or {SETTING})"
        )
    return uid, gid


class HubUserIds:
    """``ids_of(owner)`` for the runtime (``ElasticRuntime.owner_ids``), from the Hub's REST API."""

    def __init__(self, hub_auth: Any, setting: dict[str, Any], refresh_seconds: float, log: Any) -> None:
        self.hub_auth = hub_auth
        self.setting = setting
        self.refresh_seconds = refresh_seconds
        self.log = log
        #: owner -> ((uid, gid), when it was read, monotonic)
        self._cache: dict[str, tuple[tuple[int, int], float]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def ids_of(self, owner: str) -> tuple[int, int]:
        """``owner``'s (uid, gid): cached, asked again after ``refresh_seconds``."""
        lock = self._locks.setdefault(owner, asyncio.Lock())
        async with lock:
            cached = self._cache.get(owner)
            if cached is not None and time.monotonic() - cached[1] < self.refresh_seconds:
                return cached[0]
            try:
                state = await self._auth_state(owner)
            except _HubUnreachable as exc:
                if cached is None:
                    raise IdentityUnknownYet(
                        f"no uid for {owner!r} yet: the Hub could not be asked for their auth state ({exc}); "
                        "try again when the Hub is back"
                    ) from None
                self.log.warning("elastic-gateway: %s's uid from the cache: Hub unreachable (%s)", owner, exc)
                return cached[0]
            try:
                ids = ids_from_state(owner, state, self.setting)
            except IdentityRefused:
                self._cache.pop(owner, None)
                raise
            if cached is not None and cached[0] != ids:
                self.log.info("elastic-gateway: %s's uid/gid changed from %s to %s", owner, cached[0], ids)
            self._cache[owner] = (ids, time.monotonic())
            return ids

    async def _auth_state(self, owner: str) -> Any:
        url = f"{self.hub_auth.api_url.rstrip('/')}/users/{quote(owner, safe='')}"
        try:
            response = await AsyncHTTPClient().fetch(
                url,
                headers={"Authorization": f"token {self.hub_auth.api_token}"},
                request_timeout=30,
            )
        except HTTPClientError as exc:
            if exc.code in (401, 403):
                raise IdentityRefused(
                    f"the gateway may not read {owner!r}'s auth state (the Hub answered {exc.code}): the "
                    f"admin must grant the gateway's service the scopes {SCOPES} (c.JupyterHub.load_roles)"
                ) from None
            if exc.code == 404:
                raise IdentityRefused(
                    f"the Hub shows the gateway no user {owner!r}: the admin must grant the gateway's service"
                    f" {SCOPES} for them (c.JupyterHub.load_roles)"
                ) from None
            raise _HubUnreachable(str(exc)) from None
        except OSError as exc:
            raise _HubUnreachable(str(exc)) from None
        model = json.loads(response.body)
        if "auth_state" not in model:
            raise IdentityRefused(
                f"the Hub did not send {owner!r}'s auth state: the admin must grant the gateway's service "
                "the scope admin:auth_state (besides read:users) in c.JupyterHub.load_roles"
            )
        return model["auth_state"]


class _HubUnreachable(Exception):
    pass
