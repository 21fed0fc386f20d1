"""QOS choice at submission: the smallest tier that fits, from the tiers the site applies."""

from __future__ import annotations

import pytest

from gateway.errors import ServiceError
from gateway.jobs.submission import QOS_TIERS, pick_qos
from gateway.slurm.policy import load_policy


def test_tiers_match_the_applied_policy() -> None:
    policy = load_policy()
    assert [(t.name, t.max_wall_min) for t in sorted(policy.values(), key=lambda t: t.max_wall_min)] \
        == list(QOS_TIERS)


@pytest.mark.parametrize(("allowed", "minutes", "tier"), [
    (("ft-small", "ft-standard", "ft-large"), 60, "ft-small"),
    (("ft-small", "ft-standard", "ft-large"), 240, "ft-small"),
    (("ft-small", "ft-standard", "ft-large"), 241, "ft-standard"),
    (("ft-small", "ft-standard", "ft-large"), 4000, "ft-large"),
    (("ft-standard",), 10, "ft-standard"),          # a tier the tenant lacks is skipped
    (("ft-small",), 5000, "ft-small"),               # nothing fits: its first tier (Slurm refuses the time)
])
def test_smallest_fitting_tier(allowed: tuple[str, ...], minutes: int, tier: str) -> None:
    assert pick_qos(allowed, minutes) == tier


def test_a_tenant_without_tiers_is_told_to_ask() -> None:
    with pytest.raises(ServiceError, match="no QOS tier"):
        pick_qos((), 10)
