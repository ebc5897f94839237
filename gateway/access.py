"""Ownership and quotas of a shared gateway: one answer for every path that names a kernel.

Every REST path, the websocket and the elastic API ask :meth:`GatewayAccess.may_access`; a
kernel of another user answers 404 as if it did not exist. Starts reserve their place in the
user's quota before any await, so two starts at once cannot both squeeze under a limit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.identity import HubIdentityProvider
from gateway.quota import Holding, Limits, QuotaTable, refusal
from kernelmgr.config import ElasticRuntime
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.server.errors import http_error
from kernelmgr.server.ownership import KernelAccess

#: States in which a kernel holds (or is about to hold) its GPU slice.
_HOLDING_STATES = {KernelState.STARTING, KernelState.RUNNING, KernelState.RESUMING, KernelState.HIBERNATING}


class GatewayAccess(KernelAccess):
    """Users see and act on their own kernels; admins on all; starts and resumes within quota."""

    def __init__(
        self,
        km: Any,
        runtime: ElasticRuntime,
        identity: HubIdentityProvider,
        quotas: QuotaTable,
        admin_users: list[str],
        admin_groups: list[str],
    ) -> None:
        self.km = km
        self.runtime = runtime
        self.identity = identity
        self.quotas = quotas
        self.admin_users = set(admin_users)
        self.admin_groups = set(admin_groups)
        #: Owners of kernels without a GPU size (the elastic registry records the others').
        self.started_by: dict[str, str] = {}
        #: Starts in progress per user: counted against the kernel and GPU quotas.
        self._pending: Counter[str] = Counter()
        self._pending_gpu: dict[str, float] = {}

    # -- identity ------------------------------------------------------------------------

    @staticmethod
    def _user(handler: Any) -> str | None:
        user = getattr(handler, "current_user", None)
        return getattr(user, "username", None)

    def is_admin(self, name: str) -> bool:
        groups = set(self.identity.groups_of(name))
        return (
            name in self.admin_users or bool(groups & self.admin_groups) or self.identity.is_hub_admin(name)
        )

    def owner_of(self, kernel_id: str) -> str | None:
        record = self.runtime.kernels.get(kernel_id)
        return record.owner if record is not None else self.started_by.get(kernel_id)

    def may_access(self, handler: Any, kernel_id: str) -> bool:
        name = self._user(handler)
        if name is None:
            return False
        return self.is_admin(name) or self.owner_of(kernel_id) == name

    def is_admin_request(self, handler: Any) -> bool:
        """``KernelAccess.is_admin_request``: the gateway's admins only."""
        name = self._user(handler)
        return name is not None and self.is_admin(name)

    def forget(self, kernel_id: str) -> None:
        self.started_by.pop(kernel_id, None)

    # -- quotas --------------------------------------------------------------------------

    def limits_for(self, name: str) -> Limits:
        return self.quotas.limits_for(name, self.identity.groups_of(name))

    def holding(self, name: str) -> Holding:
        """The user's kernels (hibernated included) and GPU held, with starts in progress."""
        kernels = 0
        gpu = 0.0
        for kernel_id in list(self.km.list_kernel_ids()):
            if self.owner_of(kernel_id) != name:
                continue
            kernels += 1
            record = self.runtime.kernels.get(kernel_id)
            if record is not None and record.profile and record.state in _HOLDING_STATES:
                gpu += self.runtime.profile(record.profile).gpu_fraction
        return Holding(kernels + self._pending[name], gpu + self._pending_gpu.get(name, 0.0))

    def _fraction(self, profile: str | None) -> float:
        return self.runtime.profile(profile).gpu_fraction if profile else 0.0

    def start_refusal(self, name: str, profile: str | None) -> str | None:
        return refusal(self.limits_for(name), self.holding(name), profile, self._fraction(profile), True)

    def resume_refusal(self, name: str, profile: str | None) -> str | None:
        """The hibernator's admission: a resume takes a slice again, so the GPU quota applies."""
        return refusal(self.limits_for(name), self.holding(name), profile, self._fraction(profile), False)

    @contextmanager
    def reserve_start(self, name: str, profile: str | None) -> Iterator[None]:
        """Check the quota and hold the place until the start has registered the kernel."""
        why = self.start_refusal(name, profile)
        if why is not None:
            raise http_error(403, why)
        self._pending[name] += 1
        self._pending_gpu[name] = self._pending_gpu.get(name, 0.0) + self._fraction(profile)
        try:
            yield
        finally:
            self._pending[name] -= 1
            self._pending_gpu[name] -= self._fraction(profile)
            if self._pending[name] <= 0:
                del self._pending[name]
                self._pending_gpu.pop(name, None)
