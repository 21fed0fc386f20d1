"""Name validation and the QOS policy file."""

from __future__ import annotations

import pytest

from gateway.slurm.policy import PolicyError, load_policy, parse_policy, parse_wall
from gateway.slurm.validate import InvalidNameError, validate_tenant_name


@pytest.mark.parametrize("name", ["acme", "lab-42", "ml_team", "ab"])
def test_good_tenant_names(name: str) -> None:
    assert validate_tenant_name(name) == name


@pytest.mark.parametrize("name", [
    "a", "Acme", "a b", "..", "../etc", "a/b", "acme;id", "$(id)", "`id`", "a|b", "-acme",
    "1acme", "x" * 25, "", "acme\n", "ac me", "éte"])
def test_bad_tenant_names(name: str) -> None:
    with pytest.raises(InvalidNameError, match="invalid tenant name"):
        validate_tenant_name(name)


def test_shipped_policy_has_tiers() -> None:
    tiers = load_policy()
    assert set(tiers) == {"ft-small", "ft-standard", "ft-large"}
    std = tiers["ft-standard"]
    assert std.max_gpus_per_user == 2 and std.max_wall_min == 1440
    assert "MaxTRESPerUser=gres/gpu=2" in std.sacctmgr_settings()


def test_policy_rejects_unknown_key_listing_valid_ones() -> None:
    with pytest.raises(PolicyError, match=r"unknown keys \['max_gpu'\]; valid: \["):
        parse_policy('[qos.x]\npriority=1\nmax_gpu=2\n')


def test_policy_rejects_bad_values() -> None:
    base = ('[qos.x]\npriority=1\nmax_gpus_per_user={g}\nmax_wall="{w}"\n'
            'max_jobs_per_user=1\nmax_submit_jobs_per_user=1\n')
    with pytest.raises(PolicyError, match="max_gpus_per_user must be an integer >= 1"):
        parse_policy(base.format(g=0, w="01:00:00"))
    with pytest.raises(PolicyError, match="max_wall 'soon'"):
        parse_policy(base.format(g=1, w="soon"))


@pytest.mark.parametrize(("text", "minutes"), [("01:00:00", 60), ("1-00:00:00", 1440),
                                                ("0-00:30:30", 31), (90, 90)])
def test_parse_wall(text: str | int, minutes: int) -> None:
    assert parse_wall(text, "t") == minutes
