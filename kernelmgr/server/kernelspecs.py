"""Per-size kernelspecs: one launcher entry per base kernel × GPU size.

The launcher is where a notebook user picks a GPU size, so each size becomes a kernelspec
("Python 3 · GPU small (10 GiB)") derived on the fly from a base kernelspec (``python3``).
Nothing is written to disk: the specs follow the configuration and the inventory, and
disappear when there are no GPUs (then only the CPU kernels are offered). Each derived spec
carries ``metadata.elastic.profile`` (the pinned name the rest of the project reads) and
selects the elastic provisioner, which takes the slice.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

from kernelmgr.config import ElasticRuntime
from kernelmgr.core.profiles import GpuProfile

SEPARATOR = "-gpu-"


def derived_name(base: str, profile: str) -> str:
    return f"{base}{SEPARATOR}{profile}"


def short_display_name(display_name: str) -> str:
    """``Python 3 (ipykernel)`` -> ``Python 3``: the implementation detail reads badly twice."""
    return re.sub(r"\s*\([^)]*\)\s*$", "", display_name).strip() or display_name


def derive_spec(
    base_name: str, base: KernelSpec, profile: GpuProfile, provisioner: str = "elastic-local-provisioner"
) -> KernelSpec:
    """The kernelspec for ``base`` running with a slice of size ``profile``."""
    spec = copy.deepcopy(base.to_dict())
    metadata = spec.setdefault("metadata", {})
    metadata["elastic"] = {
        "profile": profile.name,
        "base_kernelspec": base_name,
        "gpu_fraction": profile.gpu_fraction,
        "memory_mib": profile.memory_mib,
    }
    metadata["kernel_provisioner"] = {"provisioner_name": provisioner}
    spec["display_name"] = f"{short_display_name(base.display_name)} · {profile.display_name}"
    return KernelSpec(resource_dir=base.resource_dir, **spec)


class ElasticKernelSpecManager(KernelSpecManager):
    """Adds the per-size kernelspecs to whatever the base manager finds."""

    elastic_runtime: ElasticRuntime | None = None

    def _candidates(self) -> dict[str, tuple[str, GpuProfile]]:
        """Every derived name the configuration allows (no disk access: the base may be absent)."""
        runtime = self.elastic_runtime
        if runtime is None or not runtime.gpus_available:
            return {}
        return {
            derived_name(base, profile.name): (base, profile)
            for base in runtime.base_kernels
            for profile in runtime.profiles.values()
        }

    def _derived(self, found: dict[str, str]) -> dict[str, tuple[str, GpuProfile]]:
        """The derived kernelspecs whose base kernelspec is among ``found``."""
        return {name: entry for name, entry in self._candidates().items() if entry[0] in found}

    def find_kernel_specs(self) -> dict[str, str]:
        specs: dict[str, str] = super().find_kernel_specs()
        for name, (base, _profile) in self._derived(specs).items():
            specs[name] = specs[base]
        return specs

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        # One targeted lookup (of the base, which raises NoSuchKernel if absent) instead of a
        # scan of every kernel directory: get_all_specs calls this once per kernelspec.
        candidate = self._candidates().get(kernel_name)
        if candidate is None:
            return super().get_kernel_spec(kernel_name)
        base, profile = candidate
        provisioner = (
            self.elastic_runtime.provisioner_name if self.elastic_runtime else "elastic-local-provisioner"
        )
        return derive_spec(base, super().get_kernel_spec(base), profile, provisioner)

    def elastic_kernel_names(self) -> dict[str, str]:
        """Derived kernelspec name -> GPU size name, for error messages and the profiles API."""
        derived = self._derived(super().find_kernel_specs())
        return {name: profile.name for name, (_base, profile) in derived.items()}

    def profile_of(self, kernel_name: str) -> str | None:
        """The GPU size a kernelspec asks for, or None for a CPU kernelspec (NoSuchKernel if absent)."""
        spec = self.get_kernel_spec(kernel_name)
        elastic: dict[str, Any] = (spec.metadata or {}).get("elastic") or {}
        profile = elastic.get("profile")
        return str(profile) if profile else None
