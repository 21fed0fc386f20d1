"""Measured training speed: what the estimate and the time limit use once jobs of a base model
have run here, instead of the site's fixed guess (``throughput_tokens_per_s`` + ``job_overhead_s``).

A finished job tells its tokens and its wall time on the node: ``estimated_tokens`` (the gateway's
own count at create: the file's validated tokens x epochs) and ``finished_at - started_at`` (the
gateway's own observations of Slurm), so the wall time holds the model load, the evals and the save
too, and nothing of it comes from a file the tenant's processes write (its trainer's events could
claim any speed). A job that was requeued is left out: its wall time holds the wait in the queue.

The model is the one the guess has, fitted: ``wall = overhead + tokens / rate`` (per GPU: a gang's
tokens count at ``parallel_efficiency`` per extra rank). A single rate (tokens over wall time) is
wrong for short and long jobs alike: a 10-s job is mostly its start, a 3-hour one barely (on the
test tiers' 456 jobs the median error went from 41 % to 36 %, p90 from 169 % to 84 %: see
bench/estimates.py). The fit is Theil-Sen's within each tenant (the median of the slopes between
pairs of one tenant's jobs, each tenant's slopes weighing 1 together), then the median residual as
the overhead (each tenant's jobs weighing 1 together): one tenant's many slow jobs are one
tenant's say, whatever their number. With no spread of sizes to fit a slope (every job the same
size, or a slope that is not positive) it is the single rate, the median over tenants of each
tenant's median. It is used once ``MIN_JOBS`` jobs are known, within ``CLAMP`` times the site's guess.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session

from gateway.config import Settings
from gateway.models import FineTuningJob
from gateway.state import JobState

RECENT = 100       # the latest succeeded jobs of a model that count (a fit is over their pairs: 4,950)
MIN_JOBS = 3       # fewer known: the site's guess
CLAMP = 32.0       # the measured rate (and overhead) stays within CLAMP times the site's guess (a GPU site's guess
                   # is far from a CPU dev cluster's tiny model: x8 cost the fit 7 points of median error)
MIN_WALL_S = 1.0


@dataclass(frozen=True)
class Speed:
    """Tokens per second of one GPU while it trains, the seconds a job takes beyond that (start,
    model load, evals, save), and how many jobs and tenants said so."""

    tokens_per_s: float
    jobs: int
    tenants: int
    overhead_s: float = 0.0


@dataclass(frozen=True)
class Run:
    """What one finished job tells: its tenant, GPUs, tokens and wall seconds (all the gateway's own facts)."""

    tenant_id: int
    gpus: int
    tokens: int
    wall_s: float


def per_gpu_tokens(run: Run, settings: Settings) -> float:
    """Run ``run``'s tokens as one GPU's (its ranks counted as the estimate counts them)."""
    return run.tokens / (1 + (max(1, run.gpus) - 1) * settings.parallel_efficiency)


def speed_of(runs: Iterable[Run], settings: Settings) -> Speed | None:
    """The fitted speed of ``runs`` (see the module doc); None under ``MIN_JOBS`` usable runs."""
    usable = [r for r in runs if r.tokens > 0 and r.wall_s >= MIN_WALL_S]
    if len(usable) < MIN_JOBS:
        return None
    counts = Counter(r.tenant_id for r in usable)
    xs = [per_gpu_tokens(r, settings) for r in usable]
    ys = [r.wall_s for r in usable]
    slope = _tenant_theil_sen([r.tenant_id for r in usable], xs, ys)
    guess = settings.throughput_tokens_per_s
    if slope is not None and slope > 0:
        rate = min(max(1 / slope, guess / CLAMP), guess * CLAMP)
        overhead = weighted_median([y - x / rate for x, y in zip(xs, ys, strict=True)],
                                   [1 / counts[r.tenant_id] for r in usable])
        return Speed(rate, len(usable), len(counts), min(max(0.0, overhead), settings.job_overhead_s * CLAMP))
    by_tenant: dict[int, list[float]] = defaultdict(list)
    for r, x in zip(usable, xs, strict=True):
        by_tenant[r.tenant_id].append(x / r.wall_s)
    measured = statistics.median(statistics.median(v) for v in by_tenant.values())
    site = site_speed(settings)
    return Speed(min(max(measured, site / CLAMP), site * CLAMP), len(usable), len(counts))


def _tenant_theil_sen(tenants: Sequence[int], xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Theil-Sen within each tenant: the weighted median of the slopes between every two of a
    tenant's jobs of different sizes, each tenant's slopes weighing 1 together (a slope between two
    tenants' jobs would let one tenant's outliers pair with everyone's); None when no tenant has two sizes."""
    by_tenant: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(tenants):
        by_tenant[t].append(i)
    slopes: list[float] = []
    weights: list[float] = []
    for idx in by_tenant.values():
        own = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for a, i in enumerate(idx) for j in idx[a + 1:] if xs[j] != xs[i]]
        if own:
            slopes += own
            weights += [1 / len(own)] * len(own)
    return weighted_median(slopes, weights) if slopes else None


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The lowest value at which the weights of it and those below reach half the total."""
    half, acc = sum(weights) / 2, 0.0
    pairs = sorted(zip(values, weights, strict=True))
    for value, weight in pairs:
        acc += weight
        if acc >= half:
            return value
    return pairs[-1][0]


def site_speed(settings: Settings) -> float:
    """The site's guess as one number: tokens per second of one GPU over a 30-minute job, overhead
    included (what the single measured rate replaces)."""
    tokens = settings.throughput_tokens_per_s * 1800
    return tokens / (1800 + settings.job_overhead_s)


def expected_seconds(settings: Settings, training_tokens: int, gpus: int = 1, speed: Speed | None = None) -> float:
    """How long ``training_tokens`` should take on ``gpus`` ranks (counted at ``parallel_efficiency``
    each beyond the first): at the ``speed`` measured on this site's finished jobs of the model
    (its overhead and rate), else at the site's guess (``throughput_tokens_per_s`` + ``job_overhead_s``)."""
    speedup = 1 + (gpus - 1) * settings.parallel_efficiency
    if speed is not None:
        return speed.overhead_s + training_tokens / (speed.tokens_per_s * speedup)
    return training_tokens / (settings.throughput_tokens_per_s * speedup) + settings.job_overhead_s


def runs_of(session: Session, model: str, limit: int = RECENT) -> list[Run]:
    """The latest ``limit`` succeeded jobs of base model ``model`` that ran on a node in one attempt, as Runs."""
    j = FineTuningJob.__table__.c  # type: ignore[attr-defined]
    rows = session.connection().execute(
        sa.select(j.tenant_id, j.gpus, j.estimated_tokens, j.started_at, j.finished_at)
        .where(j.model == model, j.status == JobState.SUCCEEDED.value, j.started_at.is_not(None),
               j.finished_at.is_not(None), j.estimated_tokens.is_not(None), j.attempt == 0)
        .order_by(j.finished_at.desc()).limit(limit))
    return [Run(tid, gpus or 1, int(tokens or 0), _seconds(started, finished))
            for tid, gpus, tokens, started, finished in rows]


def measured_speed(session: Session, settings: Settings, model: str) -> Speed | None:
    """The measured speed of base model ``model`` on this site's nodes, or None (the site's guess then)."""
    return speed_of(runs_of(session, model), settings)


def _seconds(start: datetime | None, end: datetime | None) -> float:
    return (end - start).total_seconds() if start is not None and end is not None else 0.0
