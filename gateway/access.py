"""Ownership and quotas of a shared gateway: one answer for every path that names a kernel.

Every REST path, the websocket and the elastic API ask :meth:`GatewayAccess.may_access`; a
kernel of another user answers 404 as if it did not exist. Starts and resumes reserve their
place in the user's quota before any await, so requests sent at once cannot all squeeze under a
limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gateway.identity import HubIdentityProvider
from gateway.quota import Holding, Limits, QuotaTable, refusal
from kernelmgr.config import ElasticRuntime
from kernelmgr.core.controller import LifecycleError
from kernelmgr.core.errors import ElasticError
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
        #: Starts and resumes in progress, by kernel id: counted against their owner's quotas
        #: from the moment they are admitted (before any await) until they end either way.
        self._reserved: dict[str, _Reservation] = {}

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

    def owner_of_request(self, handler: Any, server_owner: str) -> str | None:
        """``KernelAccess.owner_of_request``: the Hub user (kernels are owned by Hub names here)."""
        return self._user(handler)

    def forget(self, kernel_id: str) -> None:
        self.started_by.pop(kernel_id, None)

    # -- quotas --------------------------------------------------------------------------

    def limits_for(self, name: str) -> Limits:
        return self.quotas.limits_for(name, self.identity.groups_of(name))

    def holding(self, name: str, excluding: str | None = None) -> Holding:
        """The user's kernels (hibernated included) and GPU held, with starts and resumes in
        progress; ``excluding`` leaves one kernel out (the one asking to resume)."""
        kernel_ids = {k for k in self.km.list_kernel_ids() if self.owner_of(k) == name}
        gpu = 0.0
        for kernel_id in kernel_ids - set(self._reserved) - {excluding}:
            record = self.runtime.kernels.get(kernel_id)
            if record is not None and record.profile and record.state in _HOLDING_STATES:
                gpu += self.runtime.profile(record.profile).gpu_fraction
        for kernel_id, held in self._reserved.items():
            if held.owner == name and kernel_id != excluding:
                kernel_ids.add(kernel_id)
                gpu += held.fraction
        kernel_ids.discard(excluding or "")
        return Holding(len(kernel_ids), gpu)

    def _fraction(self, profile: str | None) -> float:
        return self.runtime.profile(profile).gpu_fraction if profile else 0.0

    def start_refusal(self, name: str, profile: str | None) -> str | None:
        return refusal(self.limits_for(name), self.holding(name), profile, self._fraction(profile), True)

    def resume_refusal(self, name: str, profile: str | None, kernel_id: str | None = None) -> str | None:
        """A resume takes a slice again, so the GPU quota applies (the kernel itself not counted)."""
        holding = self.holding(name, excluding=kernel_id)
        return refusal(self.limits_for(name), holding, profile, self._fraction(profile), False)

    @contextmanager
    def _reserve(self, name: str, profile: str | None, kernel_id: str, why: str | None) -> Iterator[None]:
        """Hold the place of ``kernel_id`` in its owner's quota; refused (``why``) before any await.

        The check and the booking are one synchronous step, so requests that run at once (three
        resumes, two starts) see each other's places and cannot all squeeze under a limit.
        """
        held = self._reserved.get(kernel_id)
        if held is not None:  # a second caller of the same resume shares its place
            held.count += 1
        elif why is not None:
            raise QuotaRefused(why)
        else:
            held = self._reserved[kernel_id] = _Reservation(name, self._fraction(profile))
        try:
            yield
        finally:
            held.count -= 1
            if held.count <= 0 and self._reserved.get(kernel_id) is held:
                del self._reserved[kernel_id]

    @contextmanager
    def reserve_start(self, name: str, profile: str | None, kernel_id: str) -> Iterator[None]:
        """Check the quota and hold the place until the start of ``kernel_id`` has ended."""
        try:
            with self._reserve(name, profile, kernel_id, self.start_refusal(name, profile)):
                yield
        except QuotaRefused as exc:
            raise http_error(403, exc.message) from None

    @contextmanager
    def reserve_resume(self, name: str, profile: str | None, kernel_id: str) -> Iterator[None]:
        """The hibernator's admission: the GPU quota checked and held until the resume has ended
        (running: its record holds the GPU from then on; failed: nothing is held)."""
        why = None if kernel_id in self._reserved else self.resume_refusal(name, profile, kernel_id)
        try:
            with self._reserve(name, profile, kernel_id, why):
                yield
        except QuotaRefused as exc:
            raise LifecycleError(exc.message, status=403) from None


class QuotaRefused(ElasticError):
    """A start or resume over the user's quota (the message says which limit and what is held)."""


@dataclass
class _Reservation:
    """The place one start or resume in progress holds in its owner's quota."""

    owner: str
    fraction: float
    count: int = 1
