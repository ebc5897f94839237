"""MIG slices through the NVIDIA device plugin.

MIG is the only way to split one GPU with hardware isolation of both memory and compute, so
a MIG size is what to offer when sharers must not be able to hurt each other. The price is
that slice shapes are fixed by the GPU model (``1g.10gb``, ``3g.40gb``, ... on an A100-80GB)
and the node must be partitioned in advance (e.g. by the GPU operator's MIG manager).

How the pod asks depends on the device plugin's ``MIG_STRATEGY``:

* ``mixed`` (default here): every profile is its own resource, ``nvidia.com/mig-<profile>``.
  The plugin spells a ``+`` attribute as ``.`` because ``+`` is not allowed in resource names
  (``1g.10gb+me`` is advertised as ``nvidia.com/mig-1g.10gb.me``).
* ``single``: every GPU on a node is cut into the same profile and advertised as plain
  ``nvidia.com/gpu``, so the request cannot say which profile it wants; the only way to pick
  the right nodes is the ``nvidia.com/gpu.product`` label that GPU feature discovery writes
  (e.g. ``NVIDIA-A100-SXM4-40GB-MIG-1g.5gb``), which therefore is required.

Profile names are checked strictly: a misspelled profile is a resource no node advertises,
and the kernel would sit in ``Pending`` with no hint why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernelmgr.backends.common import (
    check_label_value,
    get_choice,
    get_str,
    option_error,
    profile_error,
    reject_unknown_options,
    require_str,
    size_annotations,
    size_labels,
)
from kernelmgr.backends.fragment import PodFragment
from kernelmgr.core.profiles import GpuProfile

OPTION_KEYS = frozenset({"mig_profile", "strategy", "product"})
STRATEGIES = ("mixed", "single")
PRODUCT_LABEL = "nvidia.com/gpu.product"

#: ``<slices>g.<memory>gb`` with an optional attribute suffix as NVML names them
#: (``+me`` media extensions, ``+me.all``, ``+gfx``). Compute-instance profiles
#: (``1c.2g.10gb``) are not listed: the device plugin only advertises whole GPU instances.
MIG_PROFILE_RE = re.compile(r"^[1-7]g\.[1-9][0-9]{0,3}gb(\+(me|me\.all|gfx))?$")
MIG_PROFILE_EXAMPLE = "1g.10gb"


def check_mig_profile(profile: GpuProfile, key: str, value: object) -> str:
    """Validate a MIG profile name such as ``1g.10gb`` or ``1g.10gb+me``."""
    if not isinstance(value, str) or not MIG_PROFILE_RE.match(value):
        raise option_error(
            profile,
            key,
            "must be a MIG profile name '<slices>g.<memory>gb' as `nvidia-smi mig -lgip` lists it "
            f"(e.g. '1g.10gb', '3g.40gb', '1g.10gb+me'), got {value!r}",
        )
    return value


def mig_resource_name(mig_profile: str) -> str:
    """The mixed-strategy resource name the device plugin advertises for ``mig_profile``."""
    return "nvidia.com/mig-" + mig_profile.replace("+", ".")


@dataclass(frozen=True)
class MigSettings:
    strategy: str
    mig_profile: str | None
    product: str | None


def parse_options(profile: GpuProfile) -> MigSettings:
    reject_unknown_options(profile, OPTION_KEYS)
    if profile.gpu_fraction > 1:
        raise profile_error(
            profile,
            "gpu_fraction",
            "a MIG size is one MIG slice; use gpu_fraction <= 1 (the slice's share of the GPU) "
            "or backend 'whole' for several GPUs",
        )
    strategy = get_choice(profile, "strategy", STRATEGIES, "mixed")
    if strategy == "mixed":
        if "product" in profile.options:
            raise option_error(
                profile, "product", "is only used with strategy 'single'; remove it for strategy 'mixed'"
            )
        if "mig_profile" not in profile.options:
            raise option_error(
                profile,
                "mig_profile",
                f"is required for strategy 'mixed' (e.g. {MIG_PROFILE_EXAMPLE!r}; it selects the resource "
                f"{mig_resource_name(MIG_PROFILE_EXAMPLE)!r})",
            )
        mig_profile = check_mig_profile(profile, "mig_profile", profile.options["mig_profile"])
        return MigSettings(strategy="mixed", mig_profile=mig_profile, product=None)

    product_example = "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    product = require_str(
        profile,
        "product",
        example=product_example,
        why=f"for strategy 'single' (the node label {PRODUCT_LABEL} of nodes cut into this profile)",
    )
    check_label_value(profile, "product", product, example=product_example)
    raw_profile = get_str(profile, "mig_profile", example=MIG_PROFILE_EXAMPLE)
    single_profile = None if raw_profile is None else check_mig_profile(profile, "mig_profile", raw_profile)
    return MigSettings(strategy="single", mig_profile=single_profile, product=product)


def render(profile: GpuProfile, kernel_id: str) -> PodFragment:
    settings = parse_options(profile)
    if settings.strategy == "mixed":
        assert settings.mig_profile is not None
        return PodFragment(
            limits={mig_resource_name(settings.mig_profile): "1"},
            labels=size_labels(profile),
            annotations=size_annotations(profile),
        )
    assert settings.product is not None
    return PodFragment(
        limits={"nvidia.com/gpu": "1"},
        node_selector={PRODUCT_LABEL: settings.product},
        labels=size_labels(profile),
        annotations=size_annotations(profile),
    )
