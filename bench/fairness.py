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

``--scenario gang``: small jobs behind many-GPU jobs (the seed's "starvation of
small LoRA jobs behind a 64-GPU full fine-tune", scaled to the dev cluster's
2 nodes x 4 GPUs). Tenant A (``t-gang-a``) submits a backlog of 4-GPU jobs (a
whole node each); a moment later tenant B (``t-gang-b``) starts a trickle of
short 1-GPU jobs, one every ``--every`` seconds. Two policies, in alternating
repeats, each from zeroed fairshare usage (``RawUsage=0``):

- ``shipped``: what slurm-finetune configures. QOS priority caps, scaled from
  qos_policy.toml: a big-job tier (``ft-bench-big``: priority 10, at most 4 GPUs
  per user, like ft-large) and a small-job tier (``ft-bench-small``: priority 30,
  at most 4 GPUs per user: half the cluster, as ft-small is a slice of a large
  one); and honest ``--time``, the gateway's estimate rule ``ceil(1.5 x length)``
  (without its 5-minute floor, which covers trainer start-up that sleeps do not
  have), so backfill can see where a job fits.
- ``uncapped``: ``shipped`` without the big tier's per-user GPU cap
  (``ft-bench-big-uncapped``: priority 10, 8 GPUs per user): what the cap buys.
- ``flat``: the same Slurm (multifactor fairshare, backfill) without the two:
  one tier for both tenants (``ft-bench-flat``: priority 20, 8 GPUs per user)
  and every ``--time`` at the tier's MaxWall (30 min), what a submission that
  does not estimate its length gets.

This is an ablation of our policy on one scheduler, not a race with another
product: Slurm is the scheduler in both. Reported per policy (medians over the
repeats): B's wait and slowdown ((wait + run) / run) against B's job length,
A's wait, the makespan, GPU utilisation over the makespan, and Jain's index over
the two tenants of x = mean over the tenant's jobs of run / (wait + run) (1.0:
both tenants' jobs wait the same share of their time in the system).

    /opt/slurm-finetune/venv/bin/python bench/fairness.py --scenario gang [--repeats 3]

Runtime: about 3 minutes per repeat and policy (~30 min for 3 repeats of 3 policies).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accounting.fairshare import fairshare_report, jain_index  # noqa: E402
from accounting.render import fairshare_text  # noqa: E402
from accounting.usage import usage_report  # noqa: E402
from accounting.window import Window  # noqa: E402
from gateway.config import get_settings  # noqa: E402
from gateway.slurm import JobScript, LocalRunner, SlurmClient  # noqa: E402
from gateway.slurm.policy import QosTier  # noqa: E402
from gateway.slurm.records import AcctRecord, Owner  # noqa: E402
from gateway.state import SLURM_ACTIVE  # noqa: E402
from gateway.storage.layout import unix_user_for  # noqa: E402
from gateway.storage.onboarding import TenantAdmin  # noqa: E402

A, B = "t-fair-a", "t-fair-b"
BENCH_QOS = QosTier(name="ft-bench", description="fairness bench: a whole node pair per user",
                    priority=10, max_gpus_per_user=8, max_wall_min=30, max_jobs_per_user=8,
                    max_submit_jobs_per_user=60, deny_on_limit=True)


def setup(admin: TenantAdmin) -> None:
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

# --- scenario gang: 1-GPU jobs behind 4-GPU jobs ---------------------------------

GA, GB = "t-gang-a", "t-gang-b"
GANG_TIERS = {
    "ft-bench-big": QosTier(name="ft-bench-big", description="fairness bench: big jobs, as ft-large",
                            priority=10, max_gpus_per_user=4, max_wall_min=30, max_jobs_per_user=8,
                            max_submit_jobs_per_user=60, deny_on_limit=True),
    "ft-bench-small": QosTier(name="ft-bench-small", description="fairness bench: small jobs, as ft-small",
                              priority=30, max_gpus_per_user=4, max_wall_min=30, max_jobs_per_user=8,
                              max_submit_jobs_per_user=60, deny_on_limit=True),
    "ft-bench-big-uncapped": QosTier(name="ft-bench-big-uncapped", description="fairness bench: big, no cap",
                                     priority=10, max_gpus_per_user=8, max_wall_min=30, max_jobs_per_user=8,
                                     max_submit_jobs_per_user=60, deny_on_limit=True),
    "ft-bench-flat": QosTier(name="ft-bench-flat", description="fairness bench: one tier, no caps",
                             priority=20, max_gpus_per_user=8, max_wall_min=30, max_jobs_per_user=8,
                             max_submit_jobs_per_user=60, deny_on_limit=True),
}
POLICIES = {  # policy -> (A's tier, B's tier, honest --time)
    "shipped": ("ft-bench-big", "ft-bench-small", True),
    "uncapped": ("ft-bench-big-uncapped", "ft-bench-small", True),
    "flat": ("ft-bench-flat", "ft-bench-flat", False),
}


@dataclass
class GangRun:
    policy: str
    b_wait: list[float]
    b_slowdown: list[float]
    a_wait: list[float]
    makespan_s: float
    utilisation: float
    jain: float


def gang_setup(admin: TenantAdmin) -> None:
    admin.apply_qos(GANG_TIERS)  # only the bench tiers: the shipped ones are left as they are
    for t in (GA, GB):
        admin.add_tenant(t, shares=10, qos=list(GANG_TIERS))


def time_limit(policy: str, seconds: int) -> int:
    """--time in minutes: the gateway's rule (1.5 x length, rounded up), or the tier's MaxWall."""
    honest = POLICIES[policy][2]
    return max(1, math.ceil(1.5 * seconds / 60)) if honest else GANG_TIERS[POLICIES[policy][0]].max_wall_min


def gang_script(tenant: str, qos: str, d: Path, seconds: int, gpus: int, minutes: int) -> JobScript:
    return JobScript(job_name="bench-gang", account=tenant, qos=qos, job_dir=str(d),
                     # a sleep that outlives the early SIGUSR1 Slurm may send a 1-minute job
                     # ("up to 60 seconds earlier than specified", sbatch(1) --signal)
                     command=("/bin/bash", "-c", f"trap '' USR1; exec /bin/sleep {seconds}"),
                     gpus=gpus, cpus=1, mem_mb=256, time_limit_min=minutes, grace_s=10, requeue=False)


def gang_once(client: SlurmClient, runner: LocalRunner, storage: Path, policy: str, args) -> GangRun:  # type: ignore[no-untyped-def]
    qa, qb, _ = POLICIES[policy]
    for t in (GA, GB):  # each run starts from the same fairshare state
        runner.run(["sacctmgr", "--immediate", "modify", "account", "where", f"name={t}",
                    "set", "RawUsage=0"], timeout=60).check()
    wait_until("an idle cluster", lambda: not any(q.state in SLURM_ACTIVE for q in client.queue()), 120, poll=1)
    tag = f"{policy}-{datetime.now(UTC).strftime('%H%M%S')}"
    big = gang_script(GA, qa, job_dir(storage, GA, tag), args.big_s, 4, time_limit(policy, args.big_s))
    small = gang_script(GB, qb, job_dir(storage, GB, tag), args.small_s, 1, time_limit(policy, args.small_s))
    ids_a: list[int] = []
    ids_b: list[int] = []
    try:
        t0 = time.monotonic()
        ids_a = [client.submit(big, user=unix_user_for(GA)) for _ in range(args.big_jobs)]
        time.sleep(2)
        for k in range(args.small_jobs):  # B's trickle, on a fixed timetable
            time.sleep(max(0.0, t0 + 2 + k * args.every - time.monotonic()))
            ids_b.append(client.submit(small, user=unix_user_for(GB)))
        wait_until("every bench job to finish", lambda: all(
            not s.active for s in client.states(ids_a + ids_b).values()), 900, poll=2)
        time.sleep(2)  # slurmdbd receives the last end records asynchronously
        rows = {r.job_id_raw: r for r in client.accounting(ids_a + ids_b)}
    finally:
        cleanup(client, ids_a + ids_b)
    return gang_figures(policy, rows, ids_a, ids_b, gpus_total=8)


def gang_figures(policy: str, rows: dict[int, AcctRecord], ids_a: list[int], ids_b: list[int],
                 gpus_total: int) -> GangRun:
    got = [rows[j] for j in ids_a + ids_b if j in rows and rows[j].start and rows[j].end]
    if len(got) != len(ids_a) + len(ids_b):
        raise SystemExit(f"bench: sacct has {len(got)} of {len(ids_a) + len(ids_b)} finished jobs")

    def run_s(r: AcctRecord) -> float:
        return float(r.elapsed_s or 0)

    def wait_s(r: AcctRecord) -> float:
        return float(r.wait_s or 0)

    a, b = [rows[j] for j in ids_a], [rows[j] for j in ids_b]
    first = min(r.submit for r in got if r.submit)
    last = max(r.end for r in got if r.end)
    makespan = (last - first).total_seconds()
    used = sum(r.gpus * run_s(r) for r in got)
    share = [statistics.fmean(run_s(r) / max(run_s(r) + wait_s(r), 1e-9) for r in rs) for rs in (a, b)]
    return GangRun(policy=policy, b_wait=[wait_s(r) for r in b],
                   b_slowdown=[(wait_s(r) + run_s(r)) / max(run_s(r), 1e-9) for r in b],
                   a_wait=[wait_s(r) for r in a], makespan_s=makespan,
                   utilisation=used / (gpus_total * makespan), jain=jain_index(share) or 0.0)


def p95(values: list[float]) -> float:
    q = sorted(values)
    return q[min(len(q) - 1, round(0.95 * (len(q) - 1)))]


def gang_line(r: GangRun) -> str:
    return (f"{r.policy:8s} B wait p50 {statistics.median(r.b_wait):5.0f}s p95 {p95(r.b_wait):5.0f}s "
            f"max {max(r.b_wait):5.0f}s | B slowdown p50 {statistics.median(r.b_slowdown):4.1f} "
            f"p95 {p95(r.b_slowdown):4.1f} | A wait p50 {statistics.median(r.a_wait):5.0f}s "
            f"max {max(r.a_wait):5.0f}s | makespan {r.makespan_s:4.0f}s util {r.utilisation:4.0%} "
            f"| Jain {r.jain:.3f}")


def gang_main(args) -> int:  # type: ignore[no-untyped-def]
    settings = get_settings()
    runner = LocalRunner()
    client = SlurmClient(runner)
    gang_setup(TenantAdmin(runner, storage_root=settings.storage_root, parent_account=settings.parent_account))
    print(f"workload: A {args.big_jobs} x 4 GPUs x {args.big_s}s at t=0; B {args.small_jobs} x 1 GPU x "
          f"{args.small_s}s, one every {args.every}s from t=2; 2 nodes x 4 GPUs")
    for policy in POLICIES:
        qa, qb, honest = POLICIES[policy]
        print(f"policy {policy}: A in {qa}, B in {qb}; --time A {time_limit(policy, args.big_s)} min, "
              f"B {time_limit(policy, args.small_s)} min ({'honest' if honest else 'MaxWall'})")
    runs: list[GangRun] = []
    for i in range(args.repeats):
        order = list(POLICIES) if i % 2 == 0 else list(reversed(POLICIES))  # alternating
        for policy in order:
            r = gang_once(client, runner, settings.storage_root, policy, args)
            runs.append(r)
            print(f"repeat {i + 1}: {gang_line(r)}", flush=True)
    print("\nmedians over the repeats (per-run figures, then the median across runs):")
    med: dict[str, dict[str, float]] = {}
    for policy in POLICIES:
        rs = [r for r in runs if r.policy == policy]
        med[policy] = {
            "b_wait_p50": statistics.median(statistics.median(r.b_wait) for r in rs),
            "b_wait_p95": statistics.median(p95(r.b_wait) for r in rs),
            "b_slow_p50": statistics.median(statistics.median(r.b_slowdown) for r in rs),
            "a_wait_p50": statistics.median(statistics.median(r.a_wait) for r in rs),
            "a_wait_max": statistics.median(max(r.a_wait) for r in rs),
            "makespan": statistics.median(r.makespan_s for r in rs),
            "util": statistics.median(r.utilisation for r in rs),
            "jain": statistics.median(r.jain for r in rs),
        }
    names = {"b_wait_p50": "B wait p50 (s)", "b_wait_p95": "B wait p95 (s)",
             "b_slow_p50": "B slowdown p50", "a_wait_p50": "A wait p50 (s)", "a_wait_max": "A wait max (s)",
             "makespan": "makespan (s)", "util": "GPU utilisation", "jain": "Jain's index"}
    print(f"{'':18s} " + " ".join(f"{p:>9s}" for p in POLICIES) + f" {'shipped/flat':>13s}")
    for k, label in names.items():
        s, f = med["shipped"][k], med["flat"][k]
        print(f"{label:18s} " + " ".join(f"{med[p][k]:9.2f}" for p in POLICIES)
              + f" {s / f if f else float('nan'):13.2f}")
    print(f"B's job length: {args.small_s}s; A's: {args.big_s}s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=40, help="tenant A's 1-GPU jobs")
    ap.add_argument("--small", type=int, default=4, help="tenant B's 1-GPU jobs")
    ap.add_argument("--job-s", type=int, default=15, help="seconds each job sleeps")
    ap.add_argument("--scenario", choices=("burst", "gang"), default="burst")
    ap.add_argument("--repeats", type=int, default=3, help="gang: alternating repeats per policy")
    ap.add_argument("--big-jobs", type=int, default=4, help="gang: tenant A's 4-GPU jobs")
    ap.add_argument("--big-s", type=int, default=45, help="gang: seconds each 4-GPU job sleeps")
    ap.add_argument("--small-jobs", type=int, default=18, help="gang: tenant B's 1-GPU jobs")
    ap.add_argument("--small-s", type=int, default=15, help="gang: seconds each 1-GPU job sleeps")
    ap.add_argument("--every", type=float, default=5.0, help="gang: seconds between B's submissions")
    args = ap.parse_args()
    if args.scenario == "gang":
        return gang_main(args)

    settings = get_settings()
    client = SlurmClient(LocalRunner())
    admin = TenantAdmin(LocalRunner(), storage_root=settings.storage_root, parent_account=settings.parent_account)
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
    active = [(j, s) for j, s in client.states(ids).items() if s.active] if ids else []
    for j, s in active:
        if s.queue is not None:         # the bench's own job: cancelled as its owner's
            client.cancel(j, owner=Owner(s.queue.user, s.queue.account), deadline_s=5)
    print(f"cleanup: cancelled {len(active)} bench job(s) still active")


if __name__ == "__main__":
    sys.exit(main())
