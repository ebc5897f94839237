"""Reading a uid and gid out of a JupyterHub auth state (gateway.hub_ids), without a Hub."""

from __future__ import annotations

import pytest

from gateway.hub_ids import IdentityRefused, ids_from_state, parse_setting
from kernelmgr.core.errors import ConfigError

pytestmark = pytest.mark.pure

LDAP = {"user_attributes": {"uidNumber": ["1001"], "gidNumber": ["2001"]}}


def test_ldap_attributes_nested_keys_and_one_value_lists_give_the_ids() -> None:
    setting = parse_setting({"uid": "user_attributes.uidNumber", "gid": "user_attributes.gidNumber"})
    assert ids_from_state("alice", LDAP, setting) == (1001, 2001)
    assert ids_from_state("alice", {"uid": 7}, parse_setting({"uid": "uid"})) == (7, 7)  # gid: the uid


def test_a_base_turns_a_numeric_account_id_into_a_uid() -> None:
    setting = parse_setting({"uid": "github_user.id", "uid_base": 100000, "gid": "org_gid", "gid_base": 0})
    assert ids_from_state("bob", {"github_user": {"id": 42}, "org_gid": "3000"}, setting) == (100042, 3000)


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        (None, "enable_auth_state"),
        ({"user_attributes": {}}, "has no 'user_attributes.uidNumber'"),
        ({"user_attributes": {"uidNumber": ["x1"]}}, "not a number"),
        ({"user_attributes": {"uidNumber": ["0"], "gidNumber": ["0"]}}, "never run as root"),
    ],
)
def test_a_user_without_usable_ids_is_refused_saying_what_to_fix(state: object, needle: str) -> None:
    setting = parse_setting({"uid": "user_attributes.uidNumber", "gid": "user_attributes.gidNumber"})
    with pytest.raises(IdentityRefused, match="carol") as refused:
        ids_from_state("carol", state, setting)
    assert needle in refused.value.message


@pytest.mark.parametrize(
    "raw", [{"gid": "g"}, {"uid": 3}, {"uid": "u", "shell": "s"}, {"uid": "u", "uid_base": -1}, "uidNumber"]
)
def test_a_bad_setting_is_a_config_error(raw: object) -> None:
    with pytest.raises(ConfigError, match="user_ids_from_auth_state"):
        parse_setting(raw)
