"""How far the job-time estimate was from what jobs took: the site's fixed guess against the speed
measured on earlier jobs (``gateway.services.speed``), on real finished jobs (issue 35).

    python bench/estimates.py [DB ...]     history: every SQLite gateway database the test tiers left
                                            (default /var/lib/slurm-finetune/gateway/test-*/gw.db)
    python bench/estimates.py --run [--repeats 3]
                                            the job mix: real jobs on the dev cluster (root; `finetune
                                            dev-cluster up` first), one at a time, through the API

**The job mix** (``--run``): a fresh gateway and tenant; tiny-chat jobs of three dataset sizes and 1-3
epochs (about 3,000 to 90,000 training tokens: 10 to 40 s each on this machine, so the start is a
large share of the short ones, as the issue's "about 5 min for a job that took 54 s" was), one at a
time, each estimated by the API (``POST /v1/fine_tuning/jobs/estimate``) just before it is created.
The first three (one of each size) calibrate: the site's guess is all there is then. Then
``--repeats`` rounds of the six mixed jobs, in an order that alternates. Per measured job: the
gateway's estimate (the fit), the site's guess and the single rate (the estimator before this one:
the median of tokens / wall time) on the same history, each against the job's wall time on the node
(``finished_at - started_at``, the gateway's own record).

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
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))      # before bench/, whose gateway.py is not the package

from gateway.config import Settings  # noqa: E402
from gateway.services.speed import RECENT, Run, expected_seconds, speed_of  # noqa: E402

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
    attempt: int = 0

    @property
    def wall_s(self) -> float:
        return (self.finished - self.started).total_seconds()


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def jobs_of(path: str) -> list[Job]:
    """The succeeded jobs of one gateway database, oldest finish first."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        rows = con.execute("SELECT model, tenant_id, gpus, estimated_tokens, started_at, finished_at, attempt "
                           "FROM fine_tuning_jobs WHERE status = 'succeeded' AND started_at IS NOT NULL AND "
                           "finished_at IS NOT NULL AND estimated_tokens > 0 ORDER BY finished_at").fetchall()
        con.close()
    except sqlite3.Error:
        return []
    key = hash(path) & 0xFFFFFF       # tenant ids are per database: one tenant per (database, id)
    return [Job(path, m, key * 1000 + t, g or 1, int(n), _when(s), _when(f), a or 0)
            for m, t, g, n, s, f, a in rows]


def single_rate(history: list[Job], settings: Settings) -> float | None:
    """The estimator before the fit (issue 35's first step), for comparison: one rate, the median over
    tenants of each tenant's median tokens / wall second; None under 3 jobs."""
    by_tenant: dict[int, list[float]] = {}
    for j in history:
        by_tenant.setdefault(j.tenant_id, []).append(j.tokens / j.wall_s)
    if sum(len(v) for v in by_tenant.values()) < 3:
        return None
    return statistics.median(statistics.median(v) for v in by_tenant.values())


def errors(jobs: list[Job], settings: Settings) -> dict[str, list[float]]:
    """|expected - real| / real of each estimator over ``jobs`` (each from the jobs of its model that
    finished before it, requeued ones left out as the gateway leaves them out), for the jobs that had
    at least 3 before them: ``guess``, ``single rate``, ``fit`` (the gateway's ``speed_of``)."""
    out: dict[str, list[float]] = {"guess": [], "single rate": [], "fit": []}
    by_model: dict[str, list[Job]] = {}
    for job in sorted(jobs, key=lambda j: j.finished):     # one site's history: the same nodes throughout
        by_model.setdefault(job.model, []).append(job)
    for group in by_model.values():
        for i, job in enumerate(group):
            history = [j for j in group[:i] if j.attempt == 0 and j.wall_s >= 1][-RECENT:]
            if job.wall_s < 1 or len(history) < 3:
                continue
            rate = single_rate(history, settings)
            speed = speed_of([Run(j.tenant_id, j.gpus, j.tokens, j.wall_s) for j in history], settings)
            assert rate is not None and speed is not None
            speedup = 1 + (job.gpus - 1) * settings.parallel_efficiency
            for name, expect in (("guess", expected_seconds(settings, job.tokens, job.gpus)),
                                 ("single rate", job.tokens / (rate * speedup)),
                                 ("fit", expected_seconds(settings, job.tokens, job.gpus, speed))):
                out[name].append(abs(expect - job.wall_s) / job.wall_s)
    return out


def report(errs: dict[str, list[float]]) -> None:
    """Median and p90 of each estimator's error, and the fit's ratio to the peer's (the guess)."""
    for name, values in errs.items():
        print(f"  {name:12s} median {100 * statistics.median(values):6.1f} %   p90 {100 * _p(values, 90):7.1f} %"
              f"   ({len(values)} jobs)")
    print(f"  ratio fit/guess (median error): {statistics.median(errs['fit']) / statistics.median(errs['guess']):.3f}"
          f"; fit/single rate: {statistics.median(errs['fit']) / statistics.median(errs['single rate']):.3f}")


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


SIZES = (40, 120, 360)                  # conversations per dataset: the job mix's three sizes
MIX = ((40, 1), (360, 2), (120, 1), (40, 3), (360, 1), (120, 3))    # (size, epochs) of one round
HP = {"batch_size_tokens": 512, "max_seq_len": 256}
TENANT = "bench-estimates"


def run_mix(workdir: Path, repeats: int) -> tuple[list[Job], list[float]]:
    """The job mix (module doc) through a fresh gateway: its jobs from the gateway's database, and
    the gateway's own estimate (``expected_seconds``) of each job after the calibration."""
    from bench.gateway import Api, Server, onboard
    from gateway.access import audit
    from gateway.cli.privsep import service_owned_dir
    from gateway.db import make_engine

    # the gateway drops to its service user: its SQLite file and audit key live in a dir it owns
    state = service_owned_dir(Settings(), f"estimates-{time.time_ns()}")
    db = state / "gw.db"
    url = f"sqlite:///{db}"
    token = onboard(url, [TENANT])[TENANT]
    engine = make_engine(url)
    audit.use_key_file(engine, state / "audit.key")
    engine.dispose()
    server = Server(workdir, url, SFT_AUDIT_KEY_FILE=str(state / "audit.key"))
    said: dict[str, float] = {}
    try:
        api = Api(server.url, token)
        files = {}
        for n in SIZES:
            files[n] = api.upload(workdir, n)
        plan = [(n, 1) for n in SIZES] + [step for r in range(repeats) for step in (MIX if r % 2 == 0 else MIX[::-1])]
        for i, (n, epochs) in enumerate(plan):
            body = {"model": "tiny-chat", "training_file": files[n], "hyperparameters": {**HP, "n_epochs": epochs}}
            est = api.req("POST", "/v1/fine_tuning/jobs/estimate", json=body)
            job = api.req("POST", "/v1/fine_tuning/jobs", json=body)
            done = api.wait(job["id"], lambda j: j["status"] in ("succeeded", "failed", "cancelled"), 600, poll=0.5)
            if done["status"] != "succeeded":
                raise SystemExit(f"bench: job {job['id']} {done['status']}: {done.get('error')}")
            if i >= len(SIZES):
                said[job["id"]] = float(est["expected_seconds"])
            print(f"  job {i + 1:2d}/{len(plan)}: {n} conversations x {epochs} epochs: estimate "
                  f"{est['expected_seconds']} s ({est['speed']['source']})", flush=True)
    finally:
        server.stop()
    con = sqlite3.connect(db)
    ids = con.execute("SELECT id FROM fine_tuning_jobs WHERE status = 'succeeded' ORDER BY finished_at").fetchall()
    con.close()
    jobs = jobs_of(str(db))
    return jobs, [said[i] for (i,) in ids if i in said]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dbs", nargs="*", help=f"gateway SQLite databases (default {DEFAULT_GLOB})")
    parser.add_argument("--run", action="store_true", help="run the job mix on the dev cluster (root)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the mix (--run)")
    args = parser.parse_args()
    settings = Settings()
    print(f"peer (the site's guess): throughput_tokens_per_s={settings.throughput_tokens_per_s}, "
          f"job_overhead_s={settings.job_overhead_s}, parallel_efficiency={settings.parallel_efficiency}")
    if args.run:
        workdir = Path(tempfile.mkdtemp(prefix="sft-estimates-", dir="/var/tmp"))
        jobs, said = run_mix(workdir, args.repeats)
        errs = errors(jobs, settings)
        walls = [j.wall_s for j in jobs[len(SIZES):]]
        check = [abs(e - w) / w for e, w in zip(said, walls, strict=True)]
        print(f"job mix: {len(jobs)} jobs, {len(jobs) - len(SIZES)} measured; wall time "
              f"{min(walls):.0f}-{max(walls):.0f} s; the gateway's own estimates: median error "
              f"{100 * statistics.median(check):.1f} % (the fit below recomputes them from the same history)")
        report(errs)
        shutil.rmtree(workdir, ignore_errors=True)
        return
    paths = args.dbs or sorted(glob.glob(DEFAULT_GLOB))
    jobs = [j for p in paths for j in jobs_of(p)]
    print(f"{len(jobs)} succeeded jobs from {len(paths)} databases; models: "
          f"{', '.join(sorted({j.model for j in jobs})) or '-'}")
    if not jobs:
        return
    walls = sorted(j.wall_s for j in jobs)
    print(f"real wall time: median {statistics.median(walls):.0f} s, range {walls[0]:.0f}-{walls[-1]:.0f} s")
    report(errors(jobs, settings))


if __name__ == "__main__":
    main()
