"""GPU sizes: parsing, defaults and the messages an admin sees for bad configuration."""

from __future__ import annotations

import pytest

from kernelmgr.core.errors import ConfigError
from kernelmgr.core.profiles import parse_profile, parse_profiles

pytestmark = pytest.mark.pure


def test_fractional_profile_defaults() -> None:
    small = parse_profile("small", {"gpu_fraction": 0.25, "memory_mib": 10240})
    assert small.display_name == "GPU small (10 GiB)"
    assert small.compute_percent == 25
    assert small.backend == "hami"
    assert small.is_fractional and small.whole_gpus == 0


def test_whole_gpu_profile() -> None:
    two = parse_profile("two", {"gpu_fraction": 2})
    assert two.whole_gpus == 2
    assert two.memory_mib is None
    assert two.backend == "whole"
    assert two.display_name == "GPU two (2 GPUs)"


def test_order_is_kept() -> None:
    parsed = parse_profiles({"b": {"gpu_fraction": 1}, "a": {"gpu_fraction": 0.5, "memory_mib": 1}})
    assert list(parsed) == ["b", "a"]


@pytest.mark.parametrize(
    ("name", "raw", "fragment"),
    [
        ("small", {"gpu_fraction": 1.5}, "profiles['small'].gpu_fraction: must be a fraction"),
        ("small", {"gpu_fraction": 0}, "gpu_fraction: must be > 0"),
        ("small", {"gpu_fraction": -0.1}, "gpu_fraction: must be > 0"),
        ("small", {"gpu_fraction": "half"}, "gpu_fraction: must be a number"),
        ("small", {"gpu_fraction": True}, "gpu_fraction: must be a number"),
        ("small", {"memory_mib": 1}, "gpu_fraction: is required"),
        ("small", {"gpu_fraction": 0.5}, "memory_mib: is required for a fractional"),
        ("small", {"gpu_fraction": 0.5, "memory_mib": -3}, "memory_mib: must be a positive integer"),
        ("small", {"gpu_fraction": 0.5, "memory_mib": 10, "compute_percent": 0}, "compute_percent"),
        ("small", {"gpu_fraction": 0.5, "memory_mib": 10, "backend": "magic"}, "backend: must be one of"),
        ("small", {"gpu_fraction": 0.5, "memory_mib": 10, "backend": "whole"}, "'whole' hands out entire"),
        ("small", {"gpu_fraction": 0.5, "memory_mib": 10, "colour": "red"}, "small'].colour: unknown key"),
        ("Big GPU", {"gpu_fraction": 1}, "size name 'Big GPU' must be"),
    ],
)
def test_bad_profiles_name_the_key(name: str, raw: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_profile(name, raw)
    assert fragment in str(caught.value)


def test_profiles_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="must be an object"):
        parse_profiles([{"gpu_fraction": 1}])  # type: ignore[arg-type]
