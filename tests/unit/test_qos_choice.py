"""QOS choice at submission: the smallest tier that fits, from the tiers the site applies."""

from __future__ import annotations

import pytest

from gateway.errors import ServiceError
from gateway.jobs.submission import QOS_TIERS, pick_qos
from gateway.slurm.policy import load_policy


def test_tiers_match_the_applied_policy() -> None:
    policy = load_policy()
    assert [(t.name, t.max_wall_min, t.max_gpus_per_user)
            for t in sorted(policy.values(), key=lambda t: t.max_wall_min)] == list(QOS_TIERS)


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


@pytest.mark.parametrize(("allowed", "minutes", "gpus", "tier"), [
    (("ft-small", "ft-standard", "ft-large"), 60, 2, "ft-standard"),   # ft-small allows 1 GPU per user
    (("ft-small", "ft-standard", "ft-large"), 60, 3, "ft-large"),
    (("ft-small", "ft-standard", "ft-large"), 2000, 2, "ft-large"),    # the time needs ft-large anyway
    (("ft-small", "site-gpu-tier"), 60, 16, "site-gpu-tier"),          # a site's own tier: Slurm decides
])
def test_smallest_tier_that_fits_the_gpus(allowed: tuple[str, ...], minutes: int, gpus: int, tier: str) -> None:
    assert pick_qos(allowed, minutes, gpus) == tier


def test_more_gpus_than_any_tier_allows_names_the_limit() -> None:
    with pytest.raises(ServiceError, match=r"asks for 8 GPUs but your QOS tiers allow at most 4 per user "
                                           r"\(ft-large: MaxTRESPerUser=gres/gpu=4\)") as e:
        pick_qos(("ft-small", "ft-large"), 60, 8)
    assert e.value.param == "resources.gpus" and e.value.code == "gpu_limit"
    with pytest.raises(ServiceError, match="at most 1 per user"):
        pick_qos(("ft-small",), 60, 2)


def test_a_tenant_without_tiers_is_told_to_ask() -> None:
    with pytest.raises(ServiceError, match="no QOS tier"):
        pick_qos((), 10)
