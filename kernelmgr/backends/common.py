"""Helpers shared by the Kubernetes slice backends: option checking and size metadata.

Backend options come from the admin's JSON/Python configuration, so every check here raises
``ConfigError`` with the exact path of the bad value (``ElasticKernels.profiles['small'].
options.scheduler_name``) and what to write instead. Checking at configuration load, not at
pod creation, means a typo is reported once when the server starts rather than as a pod that
never schedules.

Kubernetes' own schema does not check the *syntax* of names inside maps (resource names,
label values), so the few that the admin supplies are checked here with the apiserver's rules.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from kernelmgr.core.errors import ConfigError
from kernelmgr.core.profiles import GpuProfile

#: Label on every kernel pod (and side object) naming its GPU size.
SIZE_LABEL = "elastic.jupyter.org/gpu-size"
#: Annotation on every kernel pod with the size's GPU fraction (``"0.25"``, ``"2"``).
FRACTION_ANNOTATION = "elastic.jupyter.org/gpu-fraction"
#: Label on side objects, so they can be listed and garbage-collected.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "jupyter-elastic-kernels"

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_QUALIFIED_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def fraction_text(profile: GpuProfile) -> str:
    """The GPU fraction as a short decimal string: ``0.25``, ``1``, ``2``."""
    return f"{profile.gpu_fraction:g}"


def size_labels(profile: GpuProfile) -> dict[str, str]:
    """Labels every fragment carries, so pods can be selected by size."""
    return {SIZE_LABEL: profile.name}


def size_annotations(profile: GpuProfile) -> dict[str, str]:
    """Annotations every fragment carries (the fraction is not a valid label value for all sizes)."""
    return {FRACTION_ANNOTATION: fraction_text(profile)}


def framework_share_env(profile: GpuProfile, share: float) -> dict[str, str]:
    """The variables that tell a kernel its memory share when nothing else enforces it.

    Used by every backend whose memory limit is not enforced below the framework (local
    without MPS, time-slicing, gpushare): JAX preallocates 75 % of the device at first use and
    TensorFlow maps nearly all of it, either of which alone would starve the other sharers.
    ``share`` is the fraction of the device's memory the size may use (``XLA_PYTHON_CLIENT_MEM_
    FRACTION``); ``ELASTIC_GPU_MEMORY_FRACTION`` carries the same number for PyTorch, which reads
    no variable for it: ``torch.cuda.set_per_process_memory_fraction`` must be called with it.
    """
    env = {
        "ELASTIC_GPU_PROFILE": profile.name,
        "ELASTIC_GPU_FRACTION": fraction_text(profile),
        "ELASTIC_GPU_MEMORY_FRACTION": f"{share:.3f}",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{share:.3f}",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    if profile.memory_mib is not None:
        env["ELASTIC_GPU_MEMORY_MIB"] = str(profile.memory_mib)
    return env


def option_error(profile: GpuProfile, key: str, problem: str) -> ConfigError:
    """A ``ConfigError`` pointing at ``ElasticKernels.profiles['<name>'].options.<key>``."""
    return ConfigError(f"ElasticKernels.profiles[{profile.name!r}].options.{key}: {problem}")


def profile_error(profile: GpuProfile, key: str, problem: str) -> ConfigError:
    """A ``ConfigError`` pointing at a top-level key of the profile (``gpu_fraction``, ...)."""
    return ConfigError(f"ElasticKernels.profiles[{profile.name!r}].{key}: {problem}")


def reject_unknown_options(profile: GpuProfile, allowed: Collection[str]) -> None:
    """Fail on the first option key this backend does not know (sorted, so errors are stable)."""
    unknown = sorted(set(profile.options) - set(allowed))
    if not unknown:
        return
    hint = f"allowed options are {', '.join(sorted(allowed))}" if allowed else "this backend takes no options"
    raise option_error(profile, unknown[0], f"unknown option for backend {profile.backend!r}; {hint}")


def get_str(profile: GpuProfile, key: str, default: str | None = None, *, example: str) -> str | None:
    """A non-empty string option, or ``default`` when absent."""
    value = profile.options.get(key, default)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise option_error(profile, key, f"must be a non-empty string (e.g. {example!r}), got {value!r}")
    return value


def require_str(profile: GpuProfile, key: str, *, example: str, why: str) -> str:
    """A required non-empty string option."""
    value = get_str(profile, key, example=example)
    if value is None:
        raise option_error(profile, key, f"is required {why} (e.g. {example!r})")
    return value


def get_choice(profile: GpuProfile, key: str, choices: Collection[str], default: str | None) -> str | None:
    """A string option restricted to ``choices``."""
    value = profile.options.get(key, default)
    if value is None:
        return None
    if value not in choices:
        raise option_error(profile, key, f"must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def get_bool(profile: GpuProfile, key: str, default: bool) -> bool:
    value = profile.options.get(key, default)
    if not isinstance(value, bool):
        raise option_error(profile, key, f"must be true or false, got {value!r}")
    return value


def get_positive_int(profile: GpuProfile, key: str, *, example: int) -> int | None:
    value = profile.options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise option_error(profile, key, f"must be a positive integer (e.g. {example}), got {value!r}")
    return value


def get_str_list(profile: GpuProfile, key: str, *, example: str) -> tuple[str, ...]:
    """A list of non-empty strings (a single string is accepted as a one-item list)."""
    value = profile.options.get(key, ())
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v.strip() for v in value):
        raise option_error(
            profile, key, f"must be a list of non-empty strings (e.g. [{example!r}]), got {value!r}"
        )
    return tuple(value)


def check_dns_subdomain(profile: GpuProfile, key: str, value: str, *, example: str) -> str:
    """Names such as scheduler names and device classes: lowercase DNS subdomains."""
    if len(value) > 253 or not _DNS_SUBDOMAIN_RE.match(value):
        raise option_error(
            profile,
            key,
            f"must be a lowercase DNS name (letters, digits, '-', '.'; e.g. {example!r}), got {value!r}",
        )
    return value


def check_label_value(profile: GpuProfile, key: str, value: str, *, example: str) -> str:
    """Values that end up as label values (node selectors): at most 63 of ``[A-Za-z0-9-_.]``."""
    if len(value) > 63 or not _LABEL_VALUE_RE.match(value):
        raise option_error(
            profile,
            key,
            f"must be a valid Kubernetes label value (at most 63 letters, digits, '-', '_', '.'; "
            f"e.g. {example!r}), got {value!r}",
        )
    return value


def is_extended_resource_name(name: str) -> bool:
    """``<domain>/<name>`` as the apiserver accepts for extended resources.

    The domain must be a DNS subdomain that is not ``kubernetes.io`` (reserved for native
    resources); the name part is a qualified name of at most 63 characters.
    """
    domain, slash, local = name.partition("/")
    if not slash or len(name) > 253 or len(local) > 63:
        return False
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io") or "." not in domain:
        return False
    return bool(_DNS_SUBDOMAIN_RE.match(domain) and _QUALIFIED_NAME_RE.match(local))


def check_resource_name(profile: GpuProfile, key: str, value: str, *, example: str) -> str:
    if not is_extended_resource_name(value):
        raise option_error(
            profile,
            key,
            f"must be an extended resource name '<domain>/<name>' (e.g. {example!r}), got {value!r}",
        )
    return value
