"""Isolation per size: what each backend enforces, in the API and in docs/kubernetes.md (pure, no server)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.backends.isolation import isolation_of, table
from kernelmgr.config import ElasticKernels
from kernelmgr.core.profiles import BACKENDS, parse_profile
from kernelmgr.server.models import profiles_model

pytestmark = pytest.mark.pure

ISOLATION_PAGE = Path(__file__).resolve().parents[1] / "docs" / "kubernetes.md"


def size(backend: str, fraction: float = 0.25, **options: Any) -> Any:
    raw: dict[str, Any] = {"gpu_fraction": fraction, "backend": backend, "options": options}
    if fraction < 1:
        raw["memory_mib"] = 8192
    return parse_profile("s", raw)


@pytest.mark.parametrize(
    ("profile", "local", "expected"),
    [
        (size("whole", 1), False, ("whole", "hard", "hard")),
        (size("mig", mig_profile="1g.10gb"), False, ("mig", "hard", "hard")),
        (size("shared"), False, ("shared-time-slicing", "none", "none")),
        (size("shared", mps=True), False, ("shared-mps", "soft", "soft")),
        (size("hami"), False, ("hami", "soft", "soft")),
        (size("hami", 2), False, ("hami", "hard", "hard")),
        (size("volcano"), False, ("volcano", "soft", "soft")),
        (size("dra", 1), False, ("dra", "hard", "hard")),
        (size("dra", mig_profile="1g.10gb"), False, ("dra-mig", "hard", "hard")),
        (size("dra", sharing="MPS"), False, ("dra-mps", "hard", "hard")),
        (size("dra", sharing="consumable"), False, ("dra-consumable", "none", "none")),
        (size("gpushare"), False, ("gpushare", "none", "none")),
        (size("gpushare", 1, device_memory_mib=16384), False, ("gpushare", "hard", "hard")),
        (size("vcuda"), False, ("vcuda", "soft", "soft")),
        (size("vcuda", 2), False, ("vcuda", "hard", "hard")),
        (size("hami"), True, ("local", "none", "none")),
        (size("whole", 1), True, ("local", "soft", "soft")),
    ],
)
def test_isolation_of_each_backend_and_size(
    profile: Any, local: bool, expected: tuple[str, str, str]
) -> None:
    found = isolation_of(profile, local=local)
    assert (found.mechanism, found.memory, found.compute) == expected
    assert found.why and "\n" not in found.why


def test_local_mps_is_soft() -> None:
    found = isolation_of(size("hami"), local=True, use_mps=True)
    assert (found.memory, found.compute) == ("soft", "soft")


def test_table_covers_every_backend_and_local() -> None:
    mechanisms = {isolation.mechanism.split("-")[0] for _, isolation in table()}
    assert mechanisms == {*BACKENDS, "local"}


def test_the_isolation_table_says_what_the_code_says() -> None:
    """The documented isolation table is the code's, row by row, so an admin reads what the API reports."""
    text = ISOLATION_PAGE.read_text()
    section = text.split("## Isolation per size", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (?!size |---)(.+?) \| (\w+) \| (\w+) \| (.+?) \|$", section, flags=re.M)
    assert rows == [(name, i.memory, i.compute, i.why) for name, i in table()]


def test_profiles_api_reports_the_kubernetes_backends_isolation_in_kubernetes_mode(tmp_path: Path) -> None:
    profiles = {
        "frac": {"gpu_fraction": 0.5, "memory_mib": 8192, "backend": "gpushare"},
        "vc": {"gpu_fraction": 0.5, "memory_mib": 8192, "backend": "vcuda"},
    }
    inventory = [{"uuid": "GPU-0", "name": "T4", "memory_mib": 16384}]
    for provisioner, expected in [
        ("elastic-kubernetes-provisioner", {"frac": ("gpushare", "none"), "vc": ("vcuda", "soft")}),
        ("elastic-local-provisioner", {"frac": ("local", "none"), "vc": ("local", "none")}),
    ]:
        runtime = ElasticKernels(
            profiles=profiles,
            gpu_inventory=inventory,
            checkpoint_root=str(tmp_path / "ck"),
            kernel_provisioner=provisioner,
        ).build()
        model = profiles_model(runtime, {})
        found = {
            p["name"]: (p["isolation"]["mechanism"], p["isolation"]["memory"]) for p in model["profiles"]
        }
        assert found == expected, provisioner
