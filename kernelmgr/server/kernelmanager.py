"""The elastic kernel manager installed into jupyter_server.

It is jupyter_server's own ``AsyncMappingKernelManager`` (so ``/api/kernels``, sessions,
websockets, culling and restarts behave exactly as users know them) plus two things:

* it carries the :class:`~kernelmgr.config.ElasticRuntime` that provisioners find through
  their ``parent`` chain;
* it checks a GPU size *before* anything is created, so a size that is unknown or does not
  fit fails at once with a 4xx JSON message naming the size, what is free and what to do —
  instead of jupyter_client logging a traceback and the user seeing a 500.
"""

from __future__ import annotations

from typing import Any

from jupyter_client.kernelspec import NoSuchKernel
from jupyter_core.utils import ensure_async
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager

from kernelmgr.config import ElasticRuntime
from kernelmgr.core.errors import CapacityError, UnknownProfileError
from kernelmgr.server.errors import http_error
from kernelmgr.server.kernelspecs import ElasticKernelSpecManager
from kernelmgr.server.models import elastic_kernel_model


class ElasticMappingKernelManager(AsyncMappingKernelManager):
    """jupyter_server's kernel manager with GPU sizes checked up front."""

    elastic_runtime: ElasticRuntime | None = None

    def _require_runtime(self) -> ElasticRuntime:
        if self.elastic_runtime is None:
            raise http_error(503, "the kernelmgr extension has not finished loading; try again")
        return self.elastic_runtime

    def check_size(self, kernel_name: str) -> None:
        """Refuse, with a 4xx that says what to do, a kernelspec whose GPU size is unknown or full."""
        runtime = self._require_runtime()
        ksm = self.kernel_spec_manager
        try:
            profile_name = ksm.profile_of(kernel_name) if isinstance(ksm, ElasticKernelSpecManager) else None
        except NoSuchKernel:
            gpu_names = (
                sorted(ksm.elastic_kernel_names()) if isinstance(ksm, ElasticKernelSpecManager) else []
            )
            offered = ", ".join(gpu_names) if gpu_names else "none (this server has no GPUs)"
            raise http_error(
                404,
                f"no kernelspec named {kernel_name!r}. GPU kernelspecs here: {offered}; "
                "list all of them at /api/kernelspecs",
            ) from None
        if profile_name is None:
            return
        try:
            profile = runtime.profile(profile_name)
        except UnknownProfileError as exc:
            raise http_error(400, f"kernelspec {kernel_name!r} asks for an {exc.message}") from None
        try:
            runtime.allocator.check(profile)
        except CapacityError as exc:
            raise http_error(409, exc.message) from None

    async def _async_start_kernel(
        self, *, kernel_id: str | None = None, path: Any = None, **kwargs: Any
    ) -> str:
        if kernel_id is None or kernel_id not in self:
            self.check_size(kwargs.get("kernel_name") or self.default_kernel_name)
        try:
            started: str = await super()._async_start_kernel(kernel_id=kernel_id, path=path, **kwargs)
        except CapacityError as exc:  # lost a race with another start after the check
            raise http_error(409, exc.message) from None
        except UnknownProfileError as exc:
            raise http_error(400, exc.message) from None
        return started

    start_kernel = _async_start_kernel  # type: ignore[assignment]

    async def reap_dead_slices(self) -> None:
        """Poll every kernel that holds a slice, so a dead process gives its slice back.

        jupyter_client's restarter polls kernels only while autorestart is on; with it off a
        crashed kernel would keep its GPU until someone shut it down. ``is_alive`` reaches the
        provisioner's ``poll()``, which releases the slice when the process is gone.
        """
        runtime = self._require_runtime()
        for granted in runtime.allocator.slices():
            if granted.kernel_id in self:
                await ensure_async(self.get_kernel(granted.kernel_id).is_alive())

    def elastic_model(self, kernel_id: str) -> dict[str, Any]:
        """The ``/api/elastic/kernels/{id}`` model; 404 when the id is not a kernel here."""
        runtime = self._require_runtime()
        if kernel_id not in self:
            raise http_error(404, f"no kernel with id {kernel_id!r}; list kernels at /api/elastic/kernels")
        return elastic_kernel_model(runtime, self.kernel_model(kernel_id))

    def elastic_models(self) -> list[dict[str, Any]]:
        runtime = self._require_runtime()
        return [elastic_kernel_model(runtime, model) for model in self.list_kernels()]
