"""Measured training speed: what the estimate and the time limit use once jobs of a base model
have run here, instead of the site's fixed guess (``throughput_tokens_per_s`` + ``job_overhead_s``).

A finished job's speed is its tokens over its wall time on the node: ``estimated_tokens`` (the
gateway's own count at create: the file's validated tokens x epochs) over ``finished_at -
started_at`` (the gateway's own observations of Slurm), so the wall time holds the model load,
the evals and the save too, and nothing of it comes from a file the tenant's processes write (its
trainer's events could claim any speed). One tenant cannot steer everyone's estimates either: the
speed is the median over tenants of each tenant's median, of the latest ``RECENT`` succeeded jobs
of that base model (per GPU: a gang's tokens count at ``parallel_efficiency`` per extra rank), and
it is used once ``MIN_JOBS`` of them are known, within ``CLAMP`` times the site's guess.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session

from gateway.config import Settings
from gateway.models import FineTuningJob
from gateway.state import JobState

RECENT = 200       # the latest succeeded jobs of a model that count
MIN_JOBS = 3       # fewer known: the site's guess
CLAMP = 8.0        # the measured speed stays within [guess / CLAMP, guess * CLAMP]
MIN_WALL_S = 1.0


@dataclass(frozen=True)
class Speed:
    """Tokens per second of one GPU, the whole job's wall time included, and how many jobs said so."""

    tokens_per_s: float
    jobs: int
    tenants: int


@dataclass(frozen=True)
class Run:
    """What one finished job tells: its tenant, GPUs, tokens and wall seconds (all the gateway's own facts)."""

    tenant_id: int
    gpus: int
    tokens: int
    wall_s: float


def per_gpu(run: Run, settings: Settings) -> float:
    """Run ``run``'s tokens per second of one GPU (its ranks counted as the estimate counts them)."""
    speedup = 1 + (max(1, run.gpus) - 1) * settings.parallel_efficiency
    return run.tokens / run.wall_s / speedup


def speed_of(runs: Iterable[Run], settings: Settings) -> Speed | None:
    """The median over tenants of each tenant's median per-GPU speed; None under ``MIN_JOBS`` runs."""
    by_tenant: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        if run.tokens > 0 and run.wall_s >= MIN_WALL_S:
            by_tenant[run.tenant_id].append(per_gpu(run, settings))
    jobs = sum(len(v) for v in by_tenant.values())
    if jobs < MIN_JOBS:
        return None
    guess = site_speed(settings)
    measured = statistics.median(statistics.median(v) for v in by_tenant.values())
    return Speed(min(max(measured, guess / CLAMP), guess * CLAMP), jobs, len(by_tenant))


def site_speed(settings: Settings) -> float:
    """The site's guess as one number: tokens per second of one GPU over a 30-minute job, overhead
    included (what a measured speed replaces)."""
    tokens = settings.throughput_tokens_per_s * 1800
    return tokens / (1800 + settings.job_overhead_s)


def runs_of(session: Session, model: str, limit: int = RECENT) -> list[Run]:
    """The latest ``limit`` succeeded jobs of base model ``model`` that ran on a node, as Runs."""
    j = FineTuningJob.__table__.c  # type: ignore[attr-defined]
    rows = session.connection().execute(
        sa.select(j.tenant_id, j.gpus, j.estimated_tokens, j.started_at, j.finished_at)
        .where(j.model == model, j.status == JobState.SUCCEEDED.value, j.started_at.is_not(None),
               j.finished_at.is_not(None), j.estimated_tokens.is_not(None))
        .order_by(j.finished_at.desc()).limit(limit))
    return [Run(tid, gpus or 1, int(tokens or 0), _seconds(started, finished))
            for tid, gpus, tokens, started, finished in rows]


def measured_speed(session: Session, settings: Settings, model: str) -> Speed | None:
    """The measured speed of base model ``model`` on this site's nodes, or None (the site's guess then)."""
    return speed_of(runs_of(session, model), settings)


def _seconds(start: datetime | None, end: datetime | None) -> float:
    return (end - start).total_seconds() if start is not None and end is not None else 0.0
