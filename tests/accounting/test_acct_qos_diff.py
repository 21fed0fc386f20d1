"""QOS policy vs `sacctmgr show qos` (recorded from the dev cluster): only the difference is applied."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.slurm.policy import (
    PolicyError,
    QosTier,
    diff_qos,
    load_policy,
    parse_qos_show,
    parse_slurm_duration,
    unmanaged_qos,
)
from tests.accounting.conftest import ACCT_DATA


def _cluster():  # type: ignore[no-untyped-def]
    return parse_qos_show((ACCT_DATA / "sacctmgr_show_qos.txt").read_text())


def test_recorded_qos_parse() -> None:
    rows = {r.name: r for r in _cluster()}
    small = rows["ft-small"]
    assert small.max_gpus_per_user == 1 and small.max_wall_min == 240
    assert small.flags == {"DenyOnLimit"} and small.max_submit_jobs_per_user == 50
    assert rows["ft-large"].max_wall_min == 3 * 1440
    assert rows["normal"].max_gpus_per_user is None and rows["normal"].max_jobs_per_user is None


def test_shipped_policy_matches_the_cluster_it_was_applied_to() -> None:
    # sacctmgr lowercased the descriptions; that is not a difference
    assert diff_qos(load_policy(), _cluster()) == []
    assert unmanaged_qos(load_policy(), _cluster()) == ["normal"]


def test_only_changed_fields_are_sent() -> None:
    tiers = load_policy()
    tiers["ft-small"] = replace(tiers["ft-small"], max_wall_min=300, max_gpus_per_user=2)
    (change,) = diff_qos(tiers, _cluster())
    assert change.action == "modify" and change.name == "ft-small"
    assert change.settings == ("MaxTRESPerUser=gres/gpu=2", "MaxWall=300")
    assert "MaxWall 240 -> 300" in change.describe()


def test_new_tier_is_added_with_all_settings() -> None:
    tiers = {"ft-xl": QosTier("ft-xl", "xl", 5, 8, 60, 2, 4, False)}
    (change,) = diff_qos(tiers, _cluster())
    assert change.action == "add" and "Flags=-1" in change.settings and len(change.settings) == 7


def test_flag_removal_is_a_difference() -> None:
    tiers = load_policy()
    tiers["ft-large"] = replace(tiers["ft-large"], deny_on_limit=False)
    (change,) = diff_qos(tiers, _cluster())
    assert change.settings == ("Flags=-1",)


def test_description_with_pipe_is_kept() -> None:
    (row,) = parse_qos_show("q|1|gres/gpu=1|30:00|1|2|DenyOnLimit|a | b\n")
    assert row.description == "a | b" and row.max_wall_min == 30


def test_bad_line_raises() -> None:
    with pytest.raises(PolicyError, match="line 1"):
        parse_qos_show("q|1\n")


@pytest.mark.parametrize(("text", "minutes"), [
    ("1-00:00:00", 1440), ("04:00:00", 240), ("30:00", 30), ("", None), ("00:00:30", 1)])
def test_slurm_duration(text: str, minutes: int | None) -> None:
    assert parse_slurm_duration(text) == minutes
