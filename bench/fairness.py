"""Fairness under a burst, on the real dev cluster (root; `finetune dev-cluster up` first).

Tenant A submits a burst of short 1-GPU jobs that fills every GPU; tenant B
then submits a few. Peer: tenant A itself, i.e. the question is whether B's
small jobs queue behind A's whole burst (FIFO) or start as soon as one A job
ends (fairshare). Goal: B's first job starts within one A-job length of its
submission. Prints B's wait vs A's, each tenant's usage share vs entitled share
over the bench window (from sacct, via accounting/), and Jain's index.

Limits: the shipped tiers cap a user at 4 GPUs (ft-large) and 20 submitted jobs,
so a single tenant cannot contend for all 8 GPUs with 40 jobs. The bench
therefore creates its own tier ``ft-bench`` (8 GPUs, 8 running, 60 submitted per
user, priority 10) through the diff-based QOS apply (no other tier is touched)
and gives it to both bench tenants, so only fairshare can tell them apart.

    /opt/slurm-finetune/venv/bin/python bench/fairness.py [--burst 40] [--job-s 15]

Runtime: about burst x job_s / 8 GPUs + 30 s (~2 min by default). Every job it
submitted is cancelled at the end, finished or not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accounting.fairshare import fairshare_report  # noqa: E402
from accounting.render import fairshare_text  # noqa: E402
from accounting.usage import usage_report  # noqa: E402
from accounting.window import Window  # noqa: E402
from gateway.config import get_settings  # noqa: E402
from gateway.slurm import JobScript, LocalRunner, SlurmClient  # noqa: E402
from gateway.slurm.admin import Admin, unix_user_for  # noqa: E402
from gateway.slurm.policy import QosTier  # noqa: E402
from gateway.slurm.records import AcctRecord  # noqa: E402

A, B = "t-fair-a", "t-fair-b"
BENCH_QOS = QosTier(name="ft-bench", description="fairness bench: a whole node pair per user",
                    priority=10, max_gpus_per_user=8, max_wall_min=30, max_jobs_per_user=8,
                    max_submit_jobs_per_user=60, deny_on_limit=True)


def setup(admin: Admin) -> None:
    admin.apply_qos({BENCH_QOS.name: BENCH_QOS})  # only ft-bench: other tiers are left as they are
    for t in (A, B):
        admin.add_tenant(t, shares=10, qos=[BENCH_QOS.name, "ft-standard"])


def job_dir(storage: Path, tenant: str, tag: str) -> Path:
    import shutil

    d = storage / "tenants" / tenant / "jobs" / f"bench-fair-{tag}"
    d.mkdir(parents=True, exist_ok=True)
    user = unix_user_for(tenant)
    shutil.chown(d.parent, user, user)
    shutil.chown(d, user, user)
    return d


def submit_many(client: SlurmClient, tenant: str, n: int, seconds: int, d: Path) -> list[int]:
    script = JobScript(job_name="bench-fair", account=tenant, qos=BENCH_QOS.name, job_dir=str(d),
                       command=("/bin/sleep", str(seconds)), gpus=1, cpus=1, mem_mb=256,
                       time_limit_min=5)
    return [client.submit(script, user=unix_user_for(tenant)) for _ in range(n)]


def wait_until(what: str, ok, timeout: float, poll: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = ok()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def fmt_s(values: list[float]) -> str:
    if not values:
        return "-"
    q = sorted(values)
    return (f"first {values[0]:.0f}s  p50 {statistics.median(q):.0f}s  "
            f"p95 {q[min(len(q) - 1, round(0.95 * (len(q) - 1)))]:.0f}s  max {q[-1]:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=40, help="tenant A's 1-GPU jobs")
    ap.add_argument("--small", type=int, default=4, help="tenant B's 1-GPU jobs")
    ap.add_argument("--job-s", type=int, default=15, help="seconds each job sleeps")
    args = ap.parse_args()

    settings = get_settings()
    client = SlurmClient(LocalRunner())
    admin = Admin(LocalRunner(), storage_root=settings.storage_root, parent_account=settings.parent_account)
    setup(admin)
    tag = datetime.now(UTC).strftime("%H%M%S")
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    ids_a: list[int] = []
    ids_b: list[int] = []
    try:
        t0 = time.monotonic()
        ids_a = submit_many(client, A, args.burst, args.job_s, job_dir(settings.storage_root, A, tag))
        print(f"A submitted {len(ids_a)} x 1 GPU x {args.job_s}s in {time.monotonic() - t0:.1f}s")
        running = wait_until("A's burst to take the GPUs", lambda: sum(
            s.state == "RUNNING" for s in client.states(ids_a).values()), 60)
        time.sleep(1)
        running = sum(s.state == "RUNNING" for s in client.states(ids_a).values())
        print(f"A running: {running} jobs (8 GPUs in the cluster; others' jobs may hold some)")
        b_submit = time.monotonic()
        ids_b = submit_many(client, B, args.small, args.job_s, job_dir(settings.storage_root, B, tag))
        print(f"B submitted {len(ids_b)} x 1 GPU x {args.job_s}s at +{b_submit - t0:.0f}s")
        shares = {r.account: r.fairshare for r in client.sshare() if r.user and r.account in (A, B)}
        print(f"fairshare factors when B submitted: {shares}")
        wait_until("every bench job to finish", lambda: all(
            not s.active for s in client.states(ids_a + ids_b).values()), 60 + 3 * args.burst * args.job_s / 8,
            poll=2)
        report(client, start, ids_a, ids_b, args.job_s)
    finally:
        cleanup(client, ids_a + ids_b)
    return 0


def _waits(rows: dict[int, AcctRecord], ids: list[int]) -> list[float]:
    return [w for j in ids if j in rows and (w := rows[j].wait_s) is not None]


def _times(rows: dict[int, AcctRecord], ids: list[int], attr: str) -> list[datetime]:
    return sorted(t for j in ids if j in rows and (t := getattr(rows[j], attr)) is not None)


def report(client: SlurmClient, start: datetime, ids_a: list[int], ids_b: list[int], job_s: int) -> None:
    time.sleep(2)  # slurmdbd receives the last end records asynchronously
    end = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    rows = {r.job_id_raw: r for r in client.accounting(ids_a + ids_b)}
    waits_a, waits_b = _waits(rows, ids_a), _waits(rows, ids_b)
    a_len = statistics.median([float(rows[j].elapsed_s or 0) for j in ids_a if j in rows])
    print(f"\nA waits ({len(waits_a)} jobs): {fmt_s(waits_a)}")
    print(f"B waits ({len(waits_b)} jobs): {fmt_s(waits_b)}")
    print(f"A-job length (median ElapsedRaw): {a_len:.0f}s (sleep {job_s}s)")
    b_starts, b_subs = _times(rows, ids_b, "start"), _times(rows, ids_b, "submit")
    if b_starts and b_subs:
        first_b, b_sub = b_starts[0], b_subs[0]
        first_b_wait = (first_b - b_sub).total_seconds()
        ok = first_b_wait <= a_len
        print(f"B's first job started {first_b_wait:.0f}s after B submitted: "
              f"{'within' if ok else 'NOT within'} one A-job length ({a_len:.0f}s) -> goal "
              f"{'MET' if ok else 'MISSED'}")
        # The fairness question proper: did B take the first GPU that came free after it
        # submitted, or did A's older pending jobs go first?
        overtook = sum(1 for t in _times(rows, ids_a, "start") if b_sub < t < first_b)
        frees = [t for t in _times(rows, ids_a, "end") if t > b_sub]
        gap = (first_b - frees[0]).total_seconds() if frees else float("nan")
        print(f"A jobs that started after B submitted and before B's first start: {overtook}; "
              f"B's first start came {gap:.0f}s after the first A job ended after B submitted")
    if waits_b and waits_a:
        print(f"ratio B median wait / A median wait: "
              f"{statistics.median(waits_b) / max(statistics.median(waits_a), 1e-9):.2f}")
    window = Window(start, end)
    usage = usage_report(client.sacct(start, end, accounts=[A, B]), window)
    fs = fairshare_report(client.sshare(), usage, tenants=[A, B])
    print("\n" + fairshare_text(fs, "table"))


def cleanup(client: SlurmClient, ids: list[int]) -> None:
    active = [j for j, s in client.states(ids).items() if s.active] if ids else []
    for j in active:
        client.cancel(j, deadline_s=5)
    print(f"cleanup: cancelled {len(active)} bench job(s) still active")


if __name__ == "__main__":
    sys.exit(main())
