"""What each backend enforces for a GPU size: memory and compute, hard, soft or none.

GPU-sharing mechanisms differ most in what they do *not* do, and an admin choosing one (or a user
choosing a size) should see that before a neighbour's kernel takes all the memory. This module
turns a size into a plain description, shown as ``isolation`` on ``GET /api/elastic/profiles``
and mirrored in the README's backend table. It is pure: it reads only the size and its options
(already validated at configuration load).

The levels:

* ``hard``: enforced below the kernel's reach, by hardware or the driver (an entire device, a MIG
  instance, an MPS daemon's limits);
* ``soft``: enforced by a user-space layer in the kernel's own process (HAMi-core, vCUDA) or by a
  setting the kernel's code could change: it holds for ordinary code, not against a determined
  user;
* ``none``: nothing enforces it; at most the kernel is told its share (framework variables).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kernelmgr.backends import dra, shared
from kernelmgr.core.profiles import GpuProfile, parse_profile

Level = Literal["hard", "soft", "none"]
#: Name of the description for local kernels (one machine, no scheduler), whatever the size's backend.
LOCAL = "local"


@dataclass(frozen=True)
class Isolation:
    """What the platform enforces for one size, and why in one line."""

    mechanism: str
    memory: Level
    compute: Level
    why: str

    def to_dict(self) -> dict[str, str]:
        return {"mechanism": self.mechanism, "memory": self.memory, "compute": self.compute, "why": self.why}


def isolation_of(profile: GpuProfile, *, local: bool = False, use_mps: bool = False) -> Isolation:
    """The isolation a kernel of ``profile`` gets: on Kubernetes from its backend, else locally."""
    if local:
        return _local(profile, use_mps)
    backend = profile.backend
    whole = not profile.is_fractional
    if backend == "whole":
        return Isolation(backend, "hard", "hard", "the device plugin gives the pod entire GPUs")
    if backend == "mig":
        return Isolation(backend, "hard", "hard", "a MIG instance has its own memory and SMs in hardware")
    if backend == "shared":
        if shared.parse_options(profile).mps:
            return Isolation(
                "shared-mps",
                "soft",
                "soft",
                "the MPS daemon hard-caps each replica at the node's fixed share; the size's own "
                "tighter limits are client variables the kernel's code could change",
            )
        return Isolation(
            "shared-time-slicing",
            "none",
            "none",
            "time-slicing hands every sharer the whole GPU; the kernel is only told its share",
        )
    if backend in ("hami", "volcano"):
        if whole:
            return Isolation(backend, "hard", "hard", "gpucores 100: the GPUs are this pod's alone")
        return Isolation(
            backend,
            "soft",
            "soft",
            "HAMi-core, a hook in the kernel's process, fails allocations past the cap, throttles launches",
        )
    if backend == "dra":
        return _dra(profile)
    if backend == "gpushare":
        if whole:
            return Isolation(
                backend, "hard", "hard", "it asks for all the GPU's memory: nothing else fits beside it"
            )
        return Isolation(
            backend,
            "none",
            "none",
            "gpushare schedules by memory, then hands over the whole GPU; the kernel is told its share",
        )
    if backend == "vcuda":
        if whole:
            return Isolation(
                backend, "hard", "hard", "vcuda-core multiples of 100 are whole GPUs, this pod's alone"
            )
        return Isolation(
            backend,
            "soft",
            "soft",
            "the vCUDA library, a hook in the kernel's process, caps allocations and throttles launches",
        )
    return Isolation(backend, "none", "none", "unknown backend: nothing is known to enforce the size")


def _dra(profile: GpuProfile) -> Isolation:
    settings = dra.parse_options(profile)
    if settings.mig_profile is not None:
        return Isolation("dra-mig", "hard", "hard", "a MIG device: memory and SMs split in hardware")
    if settings.sharing == "MPS":
        return Isolation(
            "dra-mps", "hard", "hard", "the driver's MPS daemon caps each client's pinned memory and SM share"
        )
    if settings.sharing == "consumable":
        return Isolation(
            "dra-consumable",
            "none",
            "none",
            "consumable capacity only packs claims by memory at scheduling; nothing caps use at run time",
        )
    return Isolation("dra", "hard", "hard", "each kernel's claim allocates entire GPUs to it alone")


def _local(profile: GpuProfile, use_mps: bool) -> Isolation:
    if not profile.is_fractional:
        return Isolation(
            LOCAL,
            "soft",
            "soft",
            "CUDA_VISIBLE_DEVICES hides the other GPUs; code in the kernel could widen it before CUDA starts",
        )
    if use_mps:
        return Isolation(
            LOCAL,
            "soft",
            "soft",
            "MPS enforces the client limits the kernel starts with; its code could change them",
        )
    return Isolation(
        LOCAL,
        "none",
        "none",
        "several kernels share the GPU; each is only told its share through framework variables",
    )


def table() -> list[tuple[str, Isolation]]:
    """(example size, isolation) for every mechanism, fractional and whole: the README's table.

    ``tests/test_backend_isolation.py`` checks the README against it, so the two cannot drift.
    """

    def size(fraction: float, backend: str, **options: object) -> GpuProfile:
        memory = None if fraction >= 1 else 20480
        raw: dict[str, object] = {"gpu_fraction": fraction, "backend": backend, "options": dict(options)}
        if memory is not None:
            raw["memory_mib"] = memory
            raw["compute_percent"] = 25
        if backend == "mig":
            raw["options"] = {"mig_profile": "1g.10gb"}
        if backend == "gpushare" and fraction >= 1:
            raw["options"] = {"device_memory_mib": 81920}
        return parse_profile("example", raw)

    rows = [
        ("whole, N GPUs", isolation_of(size(1, "whole"))),
        ("mig, one MIG slice", isolation_of(size(0.25, "mig"))),
        ("shared, time-slicing replica", isolation_of(size(0.25, "shared"))),
        ("shared with mps", isolation_of(size(0.25, "shared", mps=True))),
        ("hami, fraction", isolation_of(size(0.25, "hami"))),
        ("hami, whole GPUs", isolation_of(size(1, "hami"))),
        ("volcano, fraction", isolation_of(size(0.25, "volcano"))),
        ("dra, whole GPUs", isolation_of(size(1, "dra"))),
        ("dra, mig_profile", isolation_of(size(0.25, "dra", mig_profile="1g.10gb"))),
        ("dra, sharing MPS", isolation_of(size(0.25, "dra", sharing="MPS"))),
        ("dra, sharing consumable", isolation_of(size(0.25, "dra", sharing="consumable"))),
        ("gpushare, fraction", isolation_of(size(0.25, "gpushare"))),
        ("gpushare, whole GPU", isolation_of(size(1, "gpushare"))),
        ("vcuda, fraction", isolation_of(size(0.25, "vcuda"))),
        ("vcuda, whole GPUs", isolation_of(size(1, "vcuda"))),
        ("local, whole GPUs", isolation_of(size(1, "whole"), local=True)),
        ("local, fraction", isolation_of(size(0.25, "hami"), local=True)),
        ("local, fraction with local_mps", isolation_of(size(0.25, "hami"), local=True, use_mps=True)),
    ]
    return rows
