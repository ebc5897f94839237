"""Per-size kernelspecs: one launcher entry per base kernel × GPU size.

The launcher is where a notebook user picks a GPU size, so each size becomes a kernelspec
("Python 3 · GPU small (10 GiB)") derived on the fly from a base kernelspec (``python3``).
Nothing is written to disk: the specs follow the configuration and the inventory, and
disappear when there are no GPUs (then only the CPU kernels are offered). Each derived spec
carries ``metadata.elastic.profile`` (the pinned name the rest of the project reads) and
selects the elastic provisioner, which takes the slice.

With the Kubernetes provisioner the server never runs a kernel itself: the base kernelspecs are not
offered (jupyter_client would run them as processes of the server, in its pod, next to its
ServiceAccount token and the master checkpoint secret). Each base kernel gets a CPU variant
instead (``python3-cpu``): a pod through the same provisioner, with no GPU slice and the pod
resources of ``ElasticKubernetesProvisioner.cpu_kernel_resources``. Starting a base name answers
404 with the names to start instead.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

from kernelmgr.config import ElasticRuntime
from kernelmgr.core.modes import LOCAL_PROVISIONER
from kernelmgr.core.profiles import GpuProfile

SEPARATOR = "-gpu-"
CPU_SUFFIX = "-cpu"


def derived_name(base: str, profile: str) -> str:
    return f"{base}{SEPARATOR}{profile}"


def cpu_name(base: str) -> str:
    """The kernelspec of ``base`` as a CPU-only pod (Kubernetes mode)."""
    return f"{base}{CPU_SUFFIX}"


def short_display_name(display_name: str) -> str:
    """``Python 3 (ipykernel)`` -> ``Python 3``: the implementation detail reads badly twice."""
    return re.sub(r"\s*\([^)]*\)\s*$", "", display_name).strip() or display_name


def derive_spec(
    base_name: str, base: KernelSpec, profile: GpuProfile, provisioner: str = LOCAL_PROVISIONER
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


def derive_cpu_spec(base_name: str, base: KernelSpec, provisioner: str) -> KernelSpec:
    """The kernelspec for ``base`` in a pod of its own without a GPU (``metadata.elastic.profile`` null)."""
    spec = copy.deepcopy(base.to_dict())
    metadata = spec.setdefault("metadata", {})
    metadata["elastic"] = {
        "profile": None,
        "base_kernelspec": base_name,
        "gpu_fraction": 0,
        "memory_mib": None,
    }
    metadata["kernel_provisioner"] = {"provisioner_name": provisioner}
    spec["display_name"] = f"{short_display_name(base.display_name)} · CPU"
    return KernelSpec(resource_dir=base.resource_dir, **spec)


class ElasticKernelSpecManager(KernelSpecManager):
    """Adds the per-size kernelspecs to whatever the base manager finds (in Kubernetes mode: only
    the derived ones, GPU sizes and CPU pods, so no kernel runs inside the server)."""

    elastic_runtime: ElasticRuntime | None = None

    @property
    def pods_only(self) -> bool:
        """Every kernel is a pod: the base kernelspecs (processes of the server) are not offered."""
        runtime = self.elastic_runtime
        return runtime is not None and runtime.mode.in_pods

    def _cpu_candidates(self) -> dict[str, str]:
        """CPU kernelspec name -> its base (Kubernetes mode only)."""
        runtime = self.elastic_runtime
        if runtime is None or not self.pods_only:
            return {}
        return {cpu_name(base): base for base in runtime.base_kernels}

    def _candidates(self, retired: bool = False) -> dict[str, tuple[str, GpuProfile]]:
        """Every derived name the configuration allows (no disk access: the base may be absent).

        ``retired``: with the sizes removed while the server ran, which are not offered but whose
        kernels still resolve their kernelspec (to run, resume, and be listed)."""
        runtime = self.elastic_runtime
        if runtime is None or not runtime.gpus_available:
            return {}
        sizes = [*runtime.profiles.values(), *(runtime.retired.values() if retired else ())]
        return {
            derived_name(base, profile.name): (base, profile)
            for base in runtime.base_kernels
            for profile in sizes
        }

    def _derived(self, found: dict[str, str]) -> dict[str, tuple[str, GpuProfile]]:
        """The derived kernelspecs whose base kernelspec is among ``found``."""
        return {name: entry for name, entry in self._candidates().items() if entry[0] in found}

    def find_kernel_specs(self) -> dict[str, str]:
        found: dict[str, str] = super().find_kernel_specs()
        specs = {} if self.pods_only else dict(found)
        for name, base in self._cpu_candidates().items():
            if base in found:
                specs[name] = found[base]
        for name, (base, _profile) in self._derived(found).items():
            specs[name] = found[base]
        return specs

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        # One targeted lookup (of the base, which raises NoSuchKernel if absent) instead of a
        # scan of every kernel directory: get_all_specs calls this once per kernelspec.
        provisioner = self.elastic_runtime.mode.provisioner if self.elastic_runtime else LOCAL_PROVISIONER
        cpu_base = self._cpu_candidates().get(kernel_name)
        if cpu_base is not None:
            return derive_cpu_spec(cpu_base, super().get_kernel_spec(cpu_base), provisioner)
        candidate = self._candidates(retired=True).get(kernel_name)
        if candidate is None:
            if self.pods_only:  # it would run inside the server: not offered
                raise NoSuchKernel(kernel_name)
            return super().get_kernel_spec(kernel_name)
        base, profile = candidate
        return derive_spec(base, super().get_kernel_spec(base), profile, provisioner)

    def default_for(self, name: str) -> str:
        """The kernelspec a server whose default is ``name`` should default to (``python3-cpu`` for
        ``python3`` in Kubernetes mode), so ``/api/kernelspecs``' default is one it offers."""
        return cpu_name(name) if name in self._cpu_candidates().values() else name

    def not_offered(self, kernel_name: str) -> str:
        """Why ``kernel_name`` cannot be started here and what to start instead (a 404's message)."""
        found = super().find_kernel_specs()
        derived = self._derived(found)
        if self.pods_only:
            cpu = {name: base for name, base in self._cpu_candidates().items() if base in found}
            if kernel_name in cpu.values():  # a base name: its own CPU pod and GPU sizes
                instead = [
                    cpu_name(kernel_name),
                    *sorted(n for n, e in derived.items() if e[0] == kernel_name),
                ]
            else:
                instead = [*sorted(cpu), *sorted(derived)]
            return (
                f"kernelspec {kernel_name!r} is not offered here: this server runs every kernel in a pod of "
                f"its own, never inside the server. Start one of: {', '.join(instead) or 'none'} "
                "(all are listed at /api/kernelspecs)"
            )
        offered = ", ".join(sorted(derived)) if derived else "none (this server has no GPUs)"
        return (
            f"no kernelspec named {kernel_name!r}. GPU kernelspecs here: {offered}; "
            "list all of them at /api/kernelspecs"
        )

    def elastic_kernel_names(self) -> dict[str, str]:
        """Derived kernelspec name -> GPU size name, for error messages and the profiles API."""
        derived = self._derived(super().find_kernel_specs())
        return {name: profile.name for name, (_base, profile) in derived.items()}

    def resized(self, kernel_name: str, profile: str) -> str | None:
        """The kernelspec of ``kernel_name``'s base at GPU size ``profile`` (a size change), if offered."""
        entry = self._candidates().get(kernel_name)
        name = derived_name(entry[0], profile) if entry is not None else None
        return name if name is not None and name in self._candidates() else None

    def profile_of(self, kernel_name: str) -> str | None:
        """The GPU size a kernelspec asks for, or None for a CPU kernelspec (NoSuchKernel if absent)."""
        spec = self.get_kernel_spec(kernel_name)
        elastic: dict[str, Any] = (spec.metadata or {}).get("elastic") or {}
        profile = elastic.get("profile")
        return str(profile) if profile else None
