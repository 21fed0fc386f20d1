"""How far the job-time estimate was from what jobs took: the site's fixed guess against the speed
measured on earlier jobs (``gateway.services.speed``), on real finished jobs (issue 35).

    python bench/estimates.py [DB ...]     (default: every SQLite gateway database the test tiers left
                                            under /var/lib/slurm-finetune/gateway/test-*/gw.db)

For each succeeded job that ran on a node (``started_at``, ``finished_at``, ``estimated_tokens``:
the gateway's own facts) it compares the expected wall time with the real one:

- **guess** (the peer: what every estimate was before): ``tokens / (throughput_tokens_per_s x
  speed-up) + job_overhead_s`` with the site's settings (printed);
- **measured**: ``tokens / (speed x speed-up)``, the speed from the jobs of the same base model that
  finished *before* this one (all the databases as one site's history, in time order; ``speed_of``:
  median over tenants of each tenant's median, the latest 200; none under 3 jobs, the guess then), as
  the gateway computes it at create.

It prints the median and 90th percentile of the absolute error (|expected - real| / real) of each,
and their ratio. Accuracy, not speed: nothing is timed here.
"""

from __future__ import annotations

import argparse
import glob
import sqlite3
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))      # before bench/, whose gateway.py is not the package

from gateway.config import Settings  # noqa: E402
from gateway.services.speed import Run, speed_of  # noqa: E402

DEFAULT_GLOB = "/var/lib/slurm-finetune/gateway/test-*/gw.db"


@dataclass(frozen=True)
class Job:
    db: str
    model: str
    tenant_id: int
    gpus: int
    tokens: int
    started: datetime
    finished: datetime

    @property
    def wall_s(self) -> float:
        return (self.finished - self.started).total_seconds()


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def jobs_of(path: str) -> list[Job]:
    """The succeeded jobs of one gateway database, oldest finish first."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        rows = con.execute("SELECT model, tenant_id, gpus, estimated_tokens, started_at, finished_at FROM "
                           "fine_tuning_jobs WHERE status = 'succeeded' AND started_at IS NOT NULL AND "
                           "finished_at IS NOT NULL AND estimated_tokens > 0 ORDER BY finished_at").fetchall()
        con.close()
    except sqlite3.Error:
        return []
    key = hash(path) & 0xFFFFFF       # tenant ids are per database: one tenant per (database, id)
    return [Job(path, m, key * 1000 + t, g or 1, int(n), _when(s), _when(f)) for m, t, g, n, s, f in rows]


def errors(jobs: list[Job], settings: Settings) -> tuple[list[float], list[float], int]:
    """(guess errors, measured errors, how many estimates had a measured speed) over ``jobs``."""
    guess, measured, calibrated = [], [], 0
    by_model: dict[str, list[Job]] = {}
    for job in sorted(jobs, key=lambda j: j.finished):     # one site's history: the same nodes throughout
        by_model.setdefault(job.model, []).append(job)
    for group in by_model.values():
        for i, job in enumerate(group):
            if job.wall_s < 1:
                continue
            speedup = 1 + (job.gpus - 1) * settings.parallel_efficiency
            expect_guess = job.tokens / (settings.throughput_tokens_per_s * speedup) + settings.job_overhead_s
            guess.append(abs(expect_guess - job.wall_s) / job.wall_s)
            speed = speed_of([Run(j.tenant_id, j.gpus, j.tokens, j.wall_s) for j in group[max(0, i - 200):i]],
                             settings)
            if speed is None:
                measured.append(guess[-1])
                continue
            calibrated += 1
            measured.append(abs(job.tokens / (speed.tokens_per_s * speedup) - job.wall_s) / job.wall_s)
    return guess, measured, calibrated


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dbs", nargs="*", help=f"gateway SQLite databases (default {DEFAULT_GLOB})")
    args = parser.parse_args()
    paths = args.dbs or sorted(glob.glob(DEFAULT_GLOB))
    settings = Settings()
    jobs = [j for p in paths for j in jobs_of(p)]
    print(f"peer (the site's guess): throughput_tokens_per_s={settings.throughput_tokens_per_s}, "
          f"job_overhead_s={settings.job_overhead_s}, parallel_efficiency={settings.parallel_efficiency}")
    print(f"{len(jobs)} succeeded jobs from {len(paths)} databases; models: "
          f"{', '.join(sorted({j.model for j in jobs})) or '-'}")
    if not jobs:
        return
    guess, measured, calibrated = errors(jobs, settings)
    walls = sorted(j.wall_s for j in jobs)
    print(f"real wall time: median {statistics.median(walls):.0f} s, range {walls[0]:.0f}-{walls[-1]:.0f} s")
    print(f"estimates with a measured speed: {calibrated} of {len(measured)} (the rest: under 3 earlier jobs)")
    g50, m50 = statistics.median(guess), statistics.median(measured)
    print(f"absolute error, median: guess {100 * g50:.0f} %, measured {100 * m50:.0f} %  "
          f"(ratio measured/guess {m50 / g50:.2f})")
    print(f"absolute error, p90:    guess {100 * _p(guess, 90):.0f} %, measured {100 * _p(measured, 90):.0f} %")


if __name__ == "__main__":
    main()
