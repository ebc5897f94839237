"""The quota rules on their own: effective limits from defaults, groups and users; refusals."""

from __future__ import annotations

import pytest

from gateway.quota import Holding, Limits, QuotaTable, parse_limits, refusal
from kernelmgr.core.errors import ConfigError

pytestmark = pytest.mark.pure

SIZES = ["small", "medium", "whole"]


def table(default: dict, groups: dict | None = None, users: dict | None = None) -> QuotaTable:
    return QuotaTable(
        default=parse_limits("default", default, SIZES),
        groups={g: parse_limits(g, v, SIZES) for g, v in (groups or {}).items()},
        users={u: parse_limits(u, v, SIZES) for u, v in (users or {}).items()},
    )


def test_groups_give_the_most_generous_value_and_the_user_entry_wins() -> None:
    quotas = table(
        {"max_kernels": 2, "max_gpu": 0.5, "profiles": ["small"]},
        groups={"a": {"max_gpu": 1, "profiles": ["medium"]}, "b": {"max_gpu": 2, "max_kernels": 1}},
        users={"zoe": {"max_gpu": 0.25}},
    )
    assert quotas.limits_for("ann") == Limits(2, 0.5, frozenset({"small"}))
    assert quotas.limits_for("ann", ["a", "b"]) == Limits(1, 2.0, frozenset({"medium"}))
    assert quotas.limits_for("zoe", ["b"]) == Limits(1, 0.25, frozenset({"small"}))
    unlimited = table({"max_gpu": 1}, groups={"x": {"max_gpu": None}})
    assert unlimited.limits_for("ann", ["x"]).max_gpu is None


def test_refusals_name_the_limit_and_what_is_held() -> None:
    limits = Limits(max_kernels=2, max_gpu=0.5, profiles=frozenset({"small", "medium"}))
    assert refusal(limits, Holding(1, 0.25), "small", 0.25, True) is None
    assert "not offered" in (refusal(limits, Holding(0, 0), "whole", 1.0, True) or "")
    assert "you have 2 of 2 kernels" in (refusal(limits, Holding(2, 0), "small", 0.25, True) or "")
    # A resume adds no kernel: only the GPU limit applies.
    assert refusal(limits, Holding(2, 0), "small", 0.25, False) is None
    assert "hold 0.25 of 0.5 GPU" in (refusal(limits, Holding(1, 0.25), "medium", 0.5, False) or "")
    assert refusal(limits, Holding(5, 5), None, 0.0, False) is None  # CPU kernels hold no GPU


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ([], "must be a mapping"),
        ({"max_kernel": 1}, "unknown keys ['max_kernel']"),
        ({"max_kernels": -1}, "max_kernels must be a whole number"),
        ({"max_kernels": True}, "max_kernels must be a whole number"),
        ({"max_gpu": "1"}, "max_gpu must be a number"),
        ({"profiles": "small"}, "profiles must be a list"),
        ({"profiles": ["huge"]}, "unknown GPU sizes ['huge']"),
    ],
)
def test_bad_entries_say_what_to_fix(raw: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_limits("ElasticQuota.users['ann']", raw, SIZES)
    assert fragment in err.value.message and "ElasticQuota.users['ann']" in err.value.message
