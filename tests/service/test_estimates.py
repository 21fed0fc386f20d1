"""Estimates from measured speed (issue 35): once jobs of a base model have run here, the estimate and
the time limit take their speed (tokens over wall time, both the gateway's own facts) instead of the
site's guess; one tenant's slow jobs do not move everyone's estimate; under three jobs the guess stays."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import Session, select

from gateway.models import FineTuningJob, Tenant, utcnow
from gateway.services.speed import CLAMP, Run, expected_seconds, site_speed, speed_of
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, chat_lines
from tests.service.test_metadata_filter import gw_meta  # noqa: F401 - the fixture

pytestmark = pytest.mark.service
JOBS = "/v1/fine_tuning/jobs"


def _finished(gw: Gateway, tenant: str, file_id: str, tokens: int, wall_s: float, n: int) -> None:
    """``n`` succeeded jobs of tiny-chat for ``tenant``: ``tokens`` each in ``wall_s`` on the node."""
    with Session(gw.app.state.engine) as s:
        tid = s.exec(select(Tenant.id).where(Tenant.name == tenant)).one()
        for _ in range(n):
            start = utcnow() - timedelta(hours=1)
            s.add(FineTuningJob(tenant_id=tid, training_file=file_id, model="tiny-chat", status="succeeded",
                                estimated_tokens=tokens, started_at=start,
                                finished_at=start + timedelta(seconds=wall_s)))
        s.commit()


def test_the_estimate_takes_the_measured_speed_once_jobs_ran(gw_meta: Gateway) -> None:  # noqa: F811
    gw = gw_meta
    file_id = gw.upload(TENANT_A, chat_lines(12)).json()["id"]
    body = {"model": "tiny-chat", "training_file": file_id, "hyperparameters": {"n_epochs": 1}}
    guess = gw.client.post(JOBS + "/estimate", headers=gw.auth(TENANT_A), json=body).json()
    assert guess["speed"]["source"] == "site guess" and guess["time_limit_minutes"] >= 5
    _finished(gw, TENANT_A, file_id, tokens=600_000, wall_s=600, n=2)          # 1,000 tokens/s
    _finished(gw, TENANT_B, gw.upload(TENANT_B, chat_lines(12)).json()["id"], tokens=600_000, wall_s=600, n=2)
    est = gw.client.post(JOBS + "/estimate", headers=gw.auth(TENANT_A), json=body).json()
    assert est["speed"] == {"source": "measured", "tokens_per_s": 1000.0, "overhead_s": 0.0, "jobs": 4, "tenants": 2}
    assert est["time_limit_minutes"] == 5 and est["expected_seconds"] <= 2    # a few hundred tokens at 1,000/s


def test_one_tenant_cannot_steer_everyones_speed() -> None:
    from gateway.config import Settings

    settings = Settings()
    honest = [Run(t, 1, 1_000_000, 1000.0) for t in (1, 2) for _ in range(3)]       # 1,000 tokens/s
    slow = [Run(3, 1, 1_000, 1000.0) for _ in range(50)]                              # 1 token/s, 50 jobs
    speed = speed_of(honest + slow, settings)
    assert speed is not None and speed.tokens_per_s == 1000.0 and speed.tenants == 3
    alone = speed_of(slow, settings)
    assert alone is not None and alone.tokens_per_s == pytest.approx(site_speed(settings) / CLAMP)    # clamped
    assert speed_of(honest[:2], settings) is None                                     # under 3 jobs: the guess


def test_jobs_of_several_sizes_give_the_overhead_and_the_rate_apart() -> None:
    """30 s to start and finish and 1,000 tokens/s, from jobs of 4 sizes (a little noise on each):
    the fit finds both, and predicts a job 10 times longer than any of them within 2 %, where one
    rate (tokens over wall time) would be off by the overhead's share."""
    from gateway.config import Settings

    settings = Settings()
    runs = [Run(t, 1, n, 30 + n / 1000 + noise) for t, noise in ((1, 0.5), (2, -0.4), (3, 0.2))
            for n in (10_000, 40_000, 90_000, 200_000)]
    speed = speed_of(runs, settings)
    assert speed is not None and speed.tokens_per_s == pytest.approx(1000, rel=0.02)
    assert speed.overhead_s == pytest.approx(30, abs=1.5)
    assert expected_seconds(settings, 2_000_000, 1, speed) == pytest.approx(2030, rel=0.02)


def test_one_tenant_with_many_jobs_cannot_steer_the_fit() -> None:
    """Two tenants' jobs say 30 s + 1,000 tokens/s; a third's 60 jobs of two sizes say 10 tokens/s:
    the fit stays the two tenants' (each tenant's jobs weigh as one tenant, however many)."""
    from gateway.config import Settings

    settings = Settings()
    honest = [Run(t, 1, n, 30 + n / 1000) for t in (1, 2) for n in (10_000, 50_000, 100_000)]
    slow = [Run(3, 1, n, 30 + n / 10) for _ in range(30) for n in (1_000, 2_000)]
    speed = speed_of(honest + slow, settings)
    assert speed is not None and speed.tokens_per_s == pytest.approx(1000, rel=0.05) and speed.tenants == 3
