"""A day at planning scale on a simulated cluster, our gateway vs bare Slurm in the same run
(root; the dev cluster with simulated nodes: `finetune dev-cluster up --sim-nodes 40`).

The platform's sizing: 1,850 fine-tune jobs a day, 320 training at once, small LoRA jobs beside
64-GPU gangs. This bench compresses such a day (``--day-s``) onto the dev cluster's simulated
nodes (``--nodes`` slurmd on this host, ``--gpus-per-node`` GPUs each, partition ``sim``: the real
slurmctld, slurmdbd, fairshare, QOS, prolog and epilog) and runs it twice, alternating:

- **ours**: every job through the gateway's API (the official openai client), one or two
  gateways (``--gateways``) on SQLite or PostgreSQL (``--db``), with a read mix of the metadata
  API (retrieve, list jobs, list events) at ``--mix-rate`` operations a second beside it;
- **peer**: the same jobs submitted straight to Slurm with ``sbatch`` as each tenant's user: the
  same batch scripts (``gateway.slurm.render``), the same simulated trainer and spec, the same QOS,
  time limits, partition and Slurm; no gateway. Cancels are plain ``scancel`` at the same moments.

Jobs run ``trainer.simulate`` (the gateway's ``simulate_trainer_speedup`` site setting): no ML,
the job's time from its tokens at a simulated speed, divided by the speed-up, and the trainer's
events, heartbeats, checkpoints, signals and exit codes, in a few tens of MB.

The workload (``make_plan``, seeded): 8 tenants of uneven demand (two heavy, three medium, two
light, one that also submits the gang jobs), equal fairshare, arrivals that peak mid-day plus two
bursts, 72 % 1-GPU jobs and the rest 2, 4 or 8 GPUs, ``--gangs`` jobs over 8 whole nodes (64 GPUs),
a load of ``--load`` x the GPUs on average, 7 % of jobs cancelled (some while queued), and one node
lost for a tenth of the day (``scontrol update state=down``, then resumed).

Reported (the JSON line at the end, and a table): jobs lost, duplicated or not final (must be 0),
GPU utilisation over the day and the makespan, queue wait p50/p95 per tenant class and for small
jobs queued while a gang waited, a demand-aware fairness figure (in each minute with a queue, each
tenant's GPU-time against its max-min fair share of what it asked for), and, for ours only: the
reconcile cycle p50/p99, events ingestion lag (event written by the job → row the API serves)
p50/p99, cancel → GPUs free p99, the read mix's p50/p99 and achieved rate, database size, and the
gateway's CPU seconds per job.

    /opt/slurm-finetune/venv/bin/python bench/capacity.py [--jobs 1850] [--day-s 3600] \\
        [--nodes 40] [--gpus-per-node 8] [--db sqlite|postgres] [--gateways 1|2] [--repeats 3] \\
        [--mix-rate 100] [--speedup 24]

The short version of this run (tests/slurm/test_zz_capacity.py) checks the invariants in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from gateway.slurm.policy import QosTier  # noqa: E402
from gateway.slurm.render import JobScript, render_sbatch  # noqa: E402
from gateway.storage.layout import unix_user_for  # noqa: E402

STORAGE = Path("/srv/slurm-finetune")
MODEL = "tiny-chat"
PARTITION = "sim"
SCRUB = Path("/var/lib/slurm-finetune/scrub")
TERMINAL = ("succeeded", "failed", "cancelled")
# tenant → (class, share of the day's jobs)
TENANTS = {"t-cap-h1": ("heavy", 0.28), "t-cap-h2": ("heavy", 0.28), "t-cap-m1": ("medium", 0.10),
           "t-cap-m2": ("medium", 0.10), "t-cap-m3": ("medium", 0.10), "t-cap-l1": ("light", 0.05),
           "t-cap-l2": ("light", 0.05), "t-cap-g1": ("gang", 0.04)}
GPU_SIZES = ((1, 0.72), (2, 0.16), (4, 0.08), (8, 0.04))
EXAMPLES = 40                     # chats in each tenant's training file


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(round(q * len(s), 6)) - 1))]


# ------------------------------------------------------------------ the workload
@dataclass(frozen=True)
class PlannedJob:
    key: str                 # the plan's name for it (the peer's job name)
    t: float                 # when it is submitted, seconds after the day starts
    tenant: str
    gpus: int
    nodes: int
    seconds: float           # how long it trains (simulated), once running
    cancel_after: float | None = None      # cancelled this long after its submission


@dataclass(frozen=True)
class Plan:
    jobs: tuple[PlannedJob, ...]
    day_s: float
    nodes: int
    gpus_per_node: int
    node_loss: tuple[str, float, float] | None     # (node, down at, resumed at)
    mean_s: float = 0.0                            # the mean 1-node job's running time

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def make_plan(n_jobs: int, day_s: float, nodes: int, gpus_per_node: int, *, load: float = 0.9,
              gangs: int = 2, cancel_frac: float = 0.07, host: str = "", seed: int = 1) -> Plan:
    """The day's jobs (seeded: the same arguments give the same plan): see the module doc."""
    rng = random.Random(seed)
    gang_nodes = min(8, max(2, nodes // 2))
    gang_gpus = gang_nodes * gpus_per_node
    sizes = [g for g, _ in GPU_SIZES if g <= gpus_per_node]
    weights = [w for g, w in GPU_SIZES if g <= gpus_per_node]
    mean_gpus = sum(g * w for g, w in zip(sizes, weights, strict=True)) / sum(weights)
    # offered load = jobs x mean seconds x mean GPUs / day = load x GPUs; gangs run 3 x the mean
    mean_s = load * nodes * gpus_per_node * day_s / (n_jobs * mean_gpus + gangs * 3 * gang_gpus)
    grid = [0.5 + math.sin(math.pi * (i + 0.5) / 1000) ** 2 for i in range(1000)]   # busier mid-day
    total = sum(grid)

    def arrival() -> float:
        x, acc = rng.random() * total, 0.0
        for i, w in enumerate(grid):
            acc += w
            if acc >= x:
                return (i + rng.random()) / 1000 * day_s
        return day_s * rng.random()

    names = list(TENANTS)
    shares = [TENANTS[t][1] for t in names]
    jobs: list[PlannedJob] = []
    bursts = {"t-cap-h1": 0.25, "t-cap-h2": 0.6}      # a tenant that submits 4 % of the day at once
    burst_n = max(1, round(0.04 * n_jobs))
    for i in range(n_jobs - gangs):
        tenant = rng.choices(names, shares)[0]
        t = arrival()
        if tenant in bursts and burst_n > 0 and rng.random() < 0.3:
            t = bursts[tenant] * day_s + rng.random() * day_s / 120
        gpus = rng.choices(sizes, weights)[0]
        seconds = min(4 * mean_s, max(0.2 * mean_s, rng.lognormvariate(math.log(mean_s) - 0.18, 0.6)))
        jobs.append(PlannedJob(key=f"cap{i:05d}", t=round(t, 2), tenant=tenant, gpus=gpus, nodes=1,
                               seconds=round(seconds, 1)))
    for k in range(gangs):
        jobs.append(PlannedJob(key=f"gang{k}", t=round((0.2 + 0.35 * k) * day_s, 2), tenant="t-cap-g1",
                               gpus=gang_gpus, nodes=gang_nodes, seconds=round(3 * mean_s, 1)))
    for i in rng.sample(range(len(jobs) - gangs), round(cancel_frac * n_jobs)):
        j = jobs[i]
        jobs[i] = PlannedJob(**{**asdict(j), "cancel_after": round(rng.uniform(0.05, 1.0) * j.seconds, 1)})
    jobs.sort(key=lambda j: j.t)
    # down for a tenth of the day, at least 60 s: a lost node comes back after a reboot, with nothing of its
    # old jobs left (Slurm's KillWait is 30 s: a job requeued onto the node it was killed on before that,
    # same job id, fails to join its job_container namespace)
    down = round(0.45 * day_s, 1)
    loss = (f"{host}-s{max(1, nodes // 2 + 1)}", down, round(down + max(60.0, 0.1 * day_s), 1)) if host else None
    return Plan(jobs=tuple(jobs), day_s=day_s, nodes=nodes, gpus_per_node=gpus_per_node, node_loss=loss,
                mean_s=mean_s)


def cap_qos(plan: Plan) -> QosTier:
    """The bench's tier: at most half the cluster's GPUs per tenant (a gang fits), no job-count cap
    below the day's burst (the shipped tiers are sized for the two-node dev cluster)."""
    return QosTier(name="ft-cap", description="capacity bench: planning-scale per-tenant limits", priority=20,
                   max_gpus_per_user=max(plan.gpus // 2, max(j.gpus for j in plan.jobs)), max_wall_min=3 * 24 * 60,
                   max_jobs_per_user=1000, max_submit_jobs_per_user=5000, deny_on_limit=True)


# ------------------------------------------------------------------ the simulated trainer's time
STEP_TOKENS = 1 << 20      # batch_size_tokens: one optimizer step per epoch (a few events a minute per job)


def speedup_for(plan: Plan, train_bytes: int) -> float:
    """The simulated trainer's speed-up that makes one epoch of the tenants' file on one GPU last a
    tenth of the plan's mean job, so whole epochs set every job's length to within ~10 %."""
    from trainer.simulate import BYTES_PER_TOKEN, TOKENS_PER_S

    return round(train_bytes / BYTES_PER_TOKEN / TOKENS_PER_S / (plan.mean_s / 10), 6)


def epochs_for(job: PlannedJob, train_bytes: int, speedup: float) -> int:
    """The n_epochs that make the simulated trainer run ``job.seconds`` (as near as whole epochs go):
    its own plan (``trainer.simulate.make_plan``) for one epoch, scaled."""
    from trainer.simulate import HYPERPARAMETERS, JOB, TOKENS_PER_S, make_plan

    one = make_plan({**HYPERPARAMETERS, "epochs": 1, "batch_size_tokens": STEP_TOKENS}, train_bytes, None,
                    JOB["validation_split"], world_size=job.gpus, tokens_per_s=TOKENS_PER_S, speedup=speedup,
                    seconds=None)
    return max(1, min(100, round(job.seconds / (one.step_s * one.total_steps))))


# ------------------------------------------------------------------ Slurm helpers
def run(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, **kw)


def sacct(ids: Sequence[int]) -> list[dict[str, Any]]:
    """sacct's allocation records (requeued runs included) of ``ids``: id, name, state, times, GPUs, nodes."""
    rows = []
    fmt = "JobIDRaw,JobName,Account,State,Submit,Start,End,AllocTRES,NodeList"
    for i in range(0, len(ids), 400):
        chunk = ",".join(str(j) for j in ids[i:i + 400])
        out = run(["sacct", "-X", "-D", "-P", "-n", "-j", chunk, f"--format={fmt}"]).stdout
        for line in out.splitlines():
            p = line.split("|")
            if len(p) != 9 or not p[0].isdigit():
                continue
            gpus = next((int(x.split("=")[1]) for x in p[7].split(",") if x.startswith("gres/gpu=")), 0)
            rows.append({"id": int(p[0]), "name": p[1], "account": p[2], "state": p[3].split()[0],
                         "submit": _ts(p[4]), "start": _ts(p[5]), "end": _ts(p[6]), "gpus": gpus, "nodes": p[8]})
    return rows


def _ts(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()     # sacct prints local time, as time.time() counts
    except ValueError:
        return None


def set_node(node: str, state: str) -> None:
    extra = ["reason=capacity bench: node lost"] if state == "down" else []
    run(["scontrol", "update", f"nodename={node}", f"state={state}", *extra])


def reset_usage(tenants: Sequence[str]) -> None:
    """Zero the tenants' fairshare usage, so each run starts from the same priorities."""
    for t in tenants:
        run(["sacctmgr", "-i", "modify", "account", f"name={t}", "set", "RawUsage=0"])


def epilog_end(job_id: int, nodes: Sequence[str]) -> float | None:
    """When the last of the job's nodes' epilogs finished (its scrub reports), or None."""
    ends = []
    for node in nodes:
        try:
            r = json.loads((SCRUB / node / f"{job_id}-epilog.json").read_text())
            ends.append(datetime.fromisoformat(r["started"]).timestamp() + float(r["seconds"]))
        except (OSError, ValueError, KeyError):
            return None
    return max(ends) if ends else None


def expand(nodelist: str) -> list[str]:
    from gateway.slurm.records import expand_nodelist

    return list(expand_nodelist(nodelist)) if nodelist and nodelist != "None assigned" else []


# ------------------------------------------------------------------ one run's figures
@dataclass
class Outcome:
    """What happened to one planned job in one run."""

    key: str
    issued: float                    # when the plan submits it (t0 + its time): waits count from here
    submit_s: float | None = None    # how long the submission took (the API's create, or sbatch)
    slurm_ids: list[int] = field(default_factory=list)
    status: str | None = None        # ours: the API's final status; peer: sacct's state
    error: str | None = None
    cancel_issued: float | None = None
    cleanup: str | None = None


@dataclass
class RunResult:
    side: str                        # ours | peer
    t0: float
    outcomes: dict[str, Outcome]
    acct: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)


def figures(plan: Plan, r: RunResult) -> dict[str, Any]:
    """The run's figures: invariants, utilisation, waits, fairness (see the module doc)."""
    by_id = defaultdict(list)
    for a in r.acct:
        by_id[a["id"]].append(a)
    jobs = {j.key: j for j in plan.jobs}
    lost = [k for k, o in r.outcomes.items() if not o.slurm_ids and o.status not in ("cancelled",)]
    dup = [k for k, o in r.outcomes.items() if len(set(o.slurm_ids)) > 1]
    stuck = [k for k, o in r.outcomes.items() if o.status not in (*TERMINAL, "COMPLETED", "CANCELLED", "FAILED",
                                                                   "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")]
    ran = {k for k, o in r.outcomes.items() if any(expand(a["nodes"]) for i in o.slurm_ids for a in by_id[i])}
    unconfirmed = [k for k, o in r.outcomes.items()
                   if r.side == "ours" and (o.cleanup == "pending" or (k in ran and o.cleanup != "confirmed"))]
    cap = plan.gpus
    day_end = r.t0 + plan.day_s
    used_day, used_all, last_end = 0.0, 0.0, r.t0
    runs: dict[str, list[tuple[float, float, int]]] = defaultdict(list)       # tenant → (start, end, gpus)
    waits: dict[str, list[float]] = defaultdict(list)
    start_of: dict[str, float] = {}
    for k, o in r.outcomes.items():
        recs = [a for i in o.slurm_ids for a in by_id[i] if a["start"] and a["end"] and expand(a["nodes"])]
        for a in recs:
            used_all += a["gpus"] * (a["end"] - a["start"])
            used_day += a["gpus"] * max(0.0, min(a["end"], day_end) - max(a["start"], r.t0))
            last_end = max(last_end, a["end"])
            runs[jobs[k].tenant].append((a["start"], a["end"], a["gpus"]))
        if recs:
            start_of[k] = min(a["start"] for a in recs)
            # sacct's times are whole seconds: a job that started at once may show a start before its submission
            waits[TENANTS[jobs[k].tenant][0] if jobs[k].nodes == 1 else "gang-jobs"].append(
                max(0.0, start_of[k] - o.issued))
    makespan = last_end - r.t0
    subs = [o.submit_s for o in r.outcomes.values() if o.submit_s is not None]
    gang_pending = [(r.outcomes[k].issued, start_of.get(k, last_end)) for k in jobs if k.startswith("gang")
                    and k in r.outcomes]
    behind = [max(0.0, start_of[k] - r.outcomes[k].issued) for k, j in jobs.items() if j.gpus == 1 and k in start_of
              and any(a <= r.outcomes[k].issued <= b for a, b in gang_pending)]
    return {
        "jobs": len(r.outcomes), "lost": len(lost), "duplicated": len(dup), "not_final": len(stuck),
        "cleanup_unconfirmed": len(unconfirmed),
        "statuses": dict(sorted(_count(o.status or "none" for o in r.outcomes.values()).items())),
        "gpu_util_day": round(used_day / (cap * plan.day_s), 4),
        "gpu_util_makespan": round(used_all / (cap * makespan), 4) if makespan > 0 else None,
        "makespan_s": round(makespan, 1),
        "wait_s": {c: {"p50": round(pct(v, 0.5), 1), "p95": round(pct(v, 0.95), 1), "n": len(v)}
                   for c, v in sorted(waits.items())},
        "submit_s": {"p50": round(pct(subs, 0.5), 3), "p99": round(pct(subs, 0.99), 3)},
        "small_behind_gang_wait_s": {"p50": round(pct(behind, 0.5), 1), "p95": round(pct(behind, 0.95), 1),
                                     "n": len(behind)},
        "fairness": fairness(plan, r, runs, start_of),
        "examples": {"lost": lost[:5], "duplicated": dup[:5], "not_final": stuck[:5], "unconfirmed": unconfirmed[:5]},
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for x in items:
        out[x] += 1
    return out


def water_fill(capacity: float, demand: dict[str, float]) -> dict[str, float]:
    """Max-min fair shares of ``capacity`` among equal-share tenants, none above its demand."""
    fair = {t: 0.0 for t in demand}
    left, open_ = capacity, {t for t, d in demand.items() if d > 0}
    while open_ and left > 1e-9:
        each = left / len(open_)
        for t in sorted(open_, key=lambda t: demand[t]):
            give = min(each, demand[t] - fair[t])
            fair[t] += give
            left -= give
            if demand[t] - fair[t] <= 1e-9:
                open_.discard(t)
    return fair


def fairness(plan: Plan, r: RunResult, runs: dict[str, list[tuple[float, float, int]]],
             start_of: dict[str, float]) -> dict[str, Any]:
    """In each slice of the day (a hundredth) where jobs waited (at least 2 % of the GPU-time), each
    tenant's GPU-time against its max-min fair share of the GPU-time used in that slice, given what
    it asked for (its running plus its waiting jobs' GPUs); per tenant the sum over those slices of
    got / fair (1.0: at least its fair share), and the lowest tenant's. ``min_single_node``: the same
    with waiting gang jobs left out of the demand (a gang waits for whole nodes to drain, which no
    fair share gives it sooner: Slurm's backfill and the gang's QOS decide that, not fairness)."""
    out = _fairness(plan, r, runs, start_of, gangs=True)
    out["min_single_node"] = _fairness(plan, r, runs, start_of, gangs=False)["min"]
    return out


def _fairness(plan: Plan, r: RunResult, runs: dict[str, list[tuple[float, float, int]]],
              start_of: dict[str, float], *, gangs: bool) -> dict[str, Any]:
    jobs = {j.key: j for j in plan.jobs}
    pending: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for k, o in r.outcomes.items():
        end = start_of.get(k)
        if end is None and o.cancel_issued:
            end = o.cancel_issued
        if end is not None and end > o.issued and (gangs or jobs[k].nodes == 1):
            pending[jobs[k].tenant].append((o.issued, end, jobs[k].gpus))
    step = plan.day_s / 100
    got_sum: dict[str, float] = defaultdict(float)
    fair_sum: dict[str, float] = defaultdict(float)
    contended = 0

    def overlap(iv: list[tuple[float, float, int]], a: float, b: float) -> float:
        return sum(g * max(0.0, min(e, b) - max(s, a)) for s, e, g in iv)

    t = r.t0
    while t < r.t0 + plan.day_s:
        a, b = t, t + step
        waiting = {ten: overlap(pending[ten], a, b) for ten in TENANTS}
        if sum(waiting.values()) >= 0.02 * plan.gpus * step:
            got = {ten: overlap(runs[ten], a, b) for ten in TENANTS}
            demand = {ten: got[ten] + waiting[ten] for ten in TENANTS}
            fair = water_fill(sum(got.values()), demand)
            for ten in TENANTS:
                got_sum[ten] += got[ten]
                fair_sum[ten] += fair[ten]
            contended += 1
        t = b
    ratio = {ten: round(got_sum[ten] / fair_sum[ten], 3) for ten in TENANTS if fair_sum[ten] > 0}
    return {"contended_slices": contended, "per_tenant": ratio, "min": min(ratio.values()) if ratio else None}


# ------------------------------------------------------------------ the day, through a gateway
class Gateways:
    """One or two `gateway serve` processes on one database, started as the installed runtime."""

    def __init__(self, workdir: Path, db_url: str, n: int, env: dict[str, str]):
        from bench.gateway import free_port

        self.procs, self.urls, self.logs = [], [], []
        for _ in range(n):
            port = free_port()
            log = open(workdir / f"serve-{port}.log", "wb")  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--log-level", "warning"],
                cwd="/", stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SFT_DATABASE_URL": db_url, **env}))
            self.urls.append(f"http://127.0.0.1:{port}")
            self.logs.append(log)
        deadline = time.monotonic() + 90
        for url, proc in zip(self.urls, self.procs, strict=True):
            while True:
                try:
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"bench: a gateway did not start; see {workdir}")
                time.sleep(0.3)

    def cpu_s(self) -> float:
        """CPU seconds of the gateways' process trees (their reaped children included)."""
        return sum(_tree_cpu(p.pid) for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in self.logs:
            log.close()


def _tree_cpu(pid: int) -> float:
    from bench.gateway import tree_cpu_s

    return tree_cpu_s(pid, reaped=True)


def broker_cpu_s() -> float:
    """CPU of the storage broker (the process answering at its socket) and what it reaped (its
    per-tenant children, the tenants' sbatch)."""
    from gateway.config import Settings
    from gateway.storage.launch import _peer_pid

    pid = _peer_pid(Settings().broker_socket)
    return _tree_cpu(pid) if pid else 0.0


class Mix(threading.Thread):
    """Open-loop reads at ``rate`` a second over the gateways: retrieve a job 40 %, list 20 jobs 30 %,
    list a job's events 30 %, as random tenants, on the jobs created so far; latencies kept."""

    def __init__(self, urls: list[str], tokens: dict[str, str], known: dict[str, list[str]], rate: float):
        super().__init__(daemon=True)
        self.urls, self.tokens, self.known, self.rate = urls, tokens, known, rate
        self.lat: list[float] = []
        self.errors = 0
        self.seconds = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        if self.rate <= 0:
            return
        rng = random.Random(3)
        clients = {u: httpx.Client(base_url=u, timeout=30) for u in self.urls}
        pool = ThreadPoolExecutor(8)
        t_next = began = time.monotonic()
        while not self.done.is_set():
            t_next += 1 / self.rate
            delay = t_next - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            tenant = rng.choice(list(self.tokens))
            ids = self.known.get(tenant) or []
            if not ids:
                continue
            jid = rng.choice(ids)
            op = rng.choices(("retrieve", "list", "events"), (0.4, 0.3, 0.3))[0]
            path = {"retrieve": f"/v1/fine_tuning/jobs/{jid}", "list": "/v1/fine_tuning/jobs?limit=20",
                    "events": f"/v1/fine_tuning/jobs/{jid}/events?limit=20"}[op]
            pool.submit(self._one, clients[rng.choice(self.urls)], path, self.tokens[tenant])
        pool.shutdown(wait=True)
        self.seconds = time.monotonic() - began

    def _one(self, client: httpx.Client, path: str, token: str) -> None:
        t = time.perf_counter()
        try:
            ok = client.get(path, headers={"Authorization": f"Bearer {token}"}).status_code == 200
        except httpx.HTTPError:
            ok = False
        self.lat.append(time.perf_counter() - t)
        if not ok:
            self.errors += 1


def onboard(db_url: str, plan: Plan, audit_key: Path) -> tuple[dict[str, str], str]:
    """The tenants (Slurm account with the bench's tier, unix user, storage), a member token each and
    a sysadmin token (for /metrics), audited under the gateways' key."""
    from sqlmodel import Session

    from gateway.access import audit
    from gateway.access.tokens import create_token
    from gateway.db import make_engine, migrate
    from gateway.models import Role
    from gateway.services.tenants import ensure_tenant
    from gateway.slurm import LocalRunner
    from gateway.storage.onboarding import TenantAdmin

    admin = TenantAdmin(LocalRunner(), storage_root=STORAGE)
    tier = cap_qos(plan)
    admin.apply_qos({tier.name: tier})
    engine = make_engine(db_url)
    migrate(engine)
    audit.use_key_file(engine, audit_key)
    tokens = {}
    with Session(engine) as s:
        for t in TENANTS:
            admin.add_tenant(t, shares=5, qos=[tier.name])
            tokens[t], _ = create_token(session=s, role=Role.MEMBER, tenant=ensure_tenant(session=s, name=t))
        sysadmin, _ = create_token(session=s, role=Role.SYSADMIN, tenant=None)
        s.commit()
    engine.dispose()
    return tokens, sysadmin


def training_file(workdir: Path) -> Path:
    from trainer.toydata import toy_conversations

    path = workdir / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in toy_conversations(EXAMPLES, seed=5)))
    return path


def gateway_env(speedup: float, state: Path) -> dict[str, str]:
    """The gateways' settings: the simulated trainer on the simulated partition, no per-tenant cap on
    active jobs below the day's (the shipped 20 is a small site's), the audit key in ``state``."""
    return {"SFT_SIMULATE_TRAINER_SPEEDUP": f"{speedup:g}", "SFT_SLURM_PARTITION": PARTITION,
            "SFT_MAX_ACTIVE_JOBS_PER_TENANT": "100000", "SFT_AUDIT_KEY_FILE": str(state / "audit.key"),
            "SFT_CREDENTIALS_FILE": str(state / "cred.json"), "SFT_CANCEL_DEADLINE_S": "30",
            "SFT_CHECKPOINT_EVERY_STEPS": "10",
            "SFT_RECONCILE_INTERVAL_S": os.environ.get("SFT_RECONCILE_INTERVAL_S", "2")}


def day_ours(plan: Plan, workdir: Path, *, db_url: str | None = None, gateways: int = 1, speedup: float,
             mix_rate: float = 0.0, drain_s: float | None = None, echo: Any = print) -> RunResult:
    """The day through the gateway(s) (on ``db_url``, else a fresh SQLite file); returns when every
    job is final and cleaned up, or at the drain limit."""
    from openai import OpenAI
    from sqlmodel import Session, select

    from gateway.cli.privsep import service_owned_dir
    from gateway.config import Settings
    from gateway.db import make_engine
    from gateway.models import FineTuningJob

    # the gateways drop to their service user: their SQLite file and audit key live in a dir it owns
    state = service_owned_dir(Settings(), f"capacity-{workdir.name}-{time.time_ns()}")
    db_url = db_url or f"sqlite:///{state / 'gw.db'}"
    tokens, sysadmin = onboard(db_url, plan, state / "audit.key")
    reset_usage(list(TENANTS))
    path = training_file(workdir)
    gws = Gateways(workdir, db_url, gateways, gateway_env(speedup, state))
    engine = make_engine(db_url)
    try:
        clients = {t: OpenAI(base_url=gws.urls[i % len(gws.urls)] + "/v1", api_key=tok, max_retries=2, timeout=120)
                   for i, (t, tok) in enumerate(tokens.items())}
        files = {}
        for t, c in clients.items():
            with open(path, "rb") as f:
                files[t] = c.files.create(file=f, purpose="fine-tune").id
        size = path.stat().st_size
        known: dict[str, list[str]] = defaultdict(list)
        mix = Mix(gws.urls, tokens, known, mix_rate)
        outcomes: dict[str, Outcome] = {}
        ids: dict[str, str] = {}
        cpu0, broker0 = gws.cpu_s(), broker_cpu_s()
        t0 = time.time()
        mix.start()
        lock = threading.Lock()

        def create(j: PlannedJob) -> None:
            o = Outcome(j.key, t0 + j.t)
            sent = time.time()
            try:
                job = clients[j.tenant].fine_tuning.jobs.create(
                    model=MODEL, training_file=files[j.tenant], suffix=j.key,
                    hyperparameters={"n_epochs": epochs_for(j, size, speedup), "batch_size_tokens": STEP_TOKENS,
                                     "max_seq_len": 256},
                    extra_body={"resources": {"gpus": j.gpus, "nodes": j.nodes}})
                o.submit_s = time.time() - sent
                with lock:
                    ids[j.key] = job.id
                    known[j.tenant].append(job.id)
            except Exception as e:        # noqa: BLE001 - a refused create is a figure, not a crash
                o.error = f"{type(e).__name__}: {str(e)[:200]}"
            outcomes[j.key] = o

        def cancel(j: PlannedJob) -> None:
            jid = ids.get(j.key)
            if jid is None:
                return
            outcomes[j.key].cancel_issued = time.time()
            try:
                clients[j.tenant].fine_tuning.jobs.cancel(jid)
            except Exception as e:        # noqa: BLE001 - e.g. it had already finished: 409
                outcomes[j.key].error = f"cancel: {type(e).__name__}"
        _drive(plan, t0, create, cancel, echo)
        drain = drain_s if drain_s is not None else plan.day_s + 600
        deadline = time.time() + drain
        while time.time() < deadline:
            with Session(engine) as s:
                rows = s.exec(select(FineTuningJob.status, FineTuningJob.cleanup)
                              .where(FineTuningJob.id.in_(list(ids.values())))).all()   # type: ignore[attr-defined]
            active = sum(1 for st, cl in rows if st not in TERMINAL or cl == "pending")
            if not active:
                break
            echo(f"  draining: {active} jobs not final or not cleaned up")
            time.sleep(min(30.0, max(2.0, drain / 50)))
        mix.done.set()
        mix.join(60)
        cpu = gws.cpu_s() - cpu0 + broker_cpu_s() - broker0
        metrics = httpx.get(gws.urls[0] + "/metrics", headers={"Authorization": f"Bearer {sysadmin}"}, timeout=60).text
        with Session(engine) as s:
            rows = {r.id: r for r in s.exec(select(FineTuningJob).where(
                FineTuningJob.id.in_(list(ids.values())))).all()}   # type: ignore[attr-defined]
            lag = ingestion_lags(s, rows)
        by_key = {k: rows[v] for k, v in ids.items() if v in rows}
        named = slurm_ids_by_name(t0)
        for k, row in by_key.items():
            o = outcomes[k]
            o.status, o.cleanup = row.status, row.cleanup
            o.slurm_ids = named.get(row.id) or ([row.slurm_job_id] if row.slurm_job_id else [])
        acct = sacct(sorted({i for o in outcomes.values() for i in o.slurm_ids}))
        extra = {"cycle_s": cycle_quantiles(metrics), "ingest_lag_s": lag,
                 "cancel_to_free_s": cancel_to_free(outcomes, acct),
                 "mix": {"ops": len(mix.lat), "errors": mix.errors,
                         "rate": round(len(mix.lat) / max(1.0, mix.seconds), 1),
                         "p50_ms": round(1000 * pct(mix.lat, 0.5), 1), "p99_ms": round(1000 * pct(mix.lat, 0.99), 1)},
                 "db_bytes": db_bytes(db_url, engine), "gateway_cpu_s_per_job": round(cpu / max(1, len(ids)), 3),
                 "slurm_records": len(acct),
                 "jobs": {k: {"id": v.id, "qos": v.qos, "time_limit_min": v.time_limit_min}
                          for k, v in by_key.items()}}
        return RunResult("ours", t0, outcomes, acct, extra)
    finally:
        gws.stop()
        engine.dispose()


def _drive(plan: Plan, t0: float, create: Any, cancel: Any, echo: Any) -> None:
    """Submit, cancel and lose a node at the plan's times (offsets from ``t0``). Each tenant is a user
    of its own: its submissions and cancels go through a pool of its own (4 at a time), so no tenant's
    burst queues another's requests in the bench itself."""
    events: list[tuple[float, int, Any]] = [(j.t, 1, (create, j)) for j in plan.jobs]
    events += [(j.t + j.cancel_after, 2, (cancel, j)) for j in plan.jobs if j.cancel_after is not None]
    if plan.node_loss:
        node, down, up = plan.node_loss
        events += [(down, 0, (set_node, node, "down")), (up, 0, (set_node, node, "resume"))]
    events.sort(key=lambda e: (e[0], e[1]))
    pools = {t: ThreadPoolExecutor(4) for t in TENANTS}
    last_echo = 0.0
    for at, kind, (fn, *args) in events:
        delay = t0 + at - time.time()
        if delay > 0:
            time.sleep(delay)
        if kind:
            pools[args[0].tenant].submit(fn, *args)
        else:
            fn(*args)
        if time.time() - last_echo > max(10.0, plan.day_s / 20):
            last_echo = time.time()
            echo(f"  t={time.time() - t0:6.0f}s of {plan.day_s:.0f}s")
    for pool in pools.values():
        pool.shutdown(wait=True)


def slurm_ids_by_name(since: float) -> dict[str, list[int]]:
    """Every Slurm job on the simulated partition since ``since``, by job name (the gateway names each
    job's Slurm job after it: a second id under one name is a duplicate submission)."""
    start = datetime.fromtimestamp(since - 60).strftime("%Y-%m-%dT%H:%M:%S")
    out = run(["sacct", "-X", "-D", "-P", "-n", "-a", "-r", PARTITION, "-S", start,
               "--format=JobIDRaw,JobName"]).stdout
    named: dict[str, set[int]] = defaultdict(set)
    for line in out.splitlines():
        jid, _, name = line.partition("|")
        if jid.isdigit():
            named[name].add(int(jid))
    return {name: sorted(ids) for name, ids in named.items()}


def cycle_quantiles(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("sft_reconcile_cycle_seconds_quantile{"):
            q = line.split('quantile="')[1].split('"')[0]
            out[f"p{round(float(q) * 100)}"] = round(float(line.split()[-1]), 4)
    return out


def ingestion_lags(s: Any, rows: dict[str, Any]) -> dict[str, float]:
    """Event written by the job (the line's ``unix``) → the row the API serves (its ``created_at``),
    for every step's metrics line of every job."""
    from sqlmodel import select

    from gateway.models import JobEvent, Tenant

    tenants = {t.id: t.name for t in s.exec(select(Tenant)).all()}
    served: dict[tuple[str, int], float] = {}
    for ev in s.exec(select(JobEvent).where(JobEvent.type == "metrics")
                     .where(JobEvent.job_id.in_(list(rows)))).all():   # type: ignore[attr-defined]
        step = (ev.data or {}).get("step")
        if isinstance(step, int) and "train_loss" in (ev.data or {}):
            served.setdefault((ev.job_id, step), ev.created_at.timestamp())
    lags = []
    for jid, row in rows.items():
        path = STORAGE / "tenants" / tenants[row.tenant_id] / "jobs" / jid / "events.jsonl"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("type") == "metrics" and (jid, ev.get("step")) in served:
                lags.append(served.pop((jid, ev["step"])) - float(ev["unix"]))
    return {"p50": round(pct(lags, 0.5), 3), "p99": round(pct(lags, 0.99), 3), "n": len(lags)}


def cancel_to_free(outcomes: dict[str, Outcome], acct: list[dict[str, Any]]) -> dict[str, float]:
    """A cancel of a running job → its nodes' epilogs done (the GPUs free for the next job)."""
    by_id = {a["id"]: a for a in acct}
    out = []
    for o in outcomes.values():
        if o.cancel_issued is None or not o.slurm_ids:
            continue
        a = by_id.get(o.slurm_ids[-1])
        if not a or not a["start"] or a["start"] > o.cancel_issued or not a["end"] or a["end"] < o.cancel_issued:
            continue       # not running when cancelled
        end = epilog_end(a["id"], expand(a["nodes"]))
        if end is not None:
            out.append(end - o.cancel_issued)
    return {"p50": round(pct(out, 0.5), 2), "p99": round(pct(out, 0.99), 2), "n": len(out)}


def db_bytes(db_url: str, engine: Any) -> int:
    if db_url.startswith("sqlite:///"):
        base = Path(db_url[len("sqlite:///"):])
        return sum(p.stat().st_size for p in (base, base.with_name(base.name + "-wal")) if p.exists())
    import sqlalchemy as sa

    with engine.connect() as c:
        return int(c.execute(sa.text("select pg_database_size(current_database())")).scalar())


# ------------------------------------------------------------------ the same day, straight to Slurm
def day_peer(plan: Plan, workdir: Path, ours: RunResult, *, speedup: float, drain_s: float | None = None,
             echo: Any = print) -> RunResult:
    """The day as users submitting to Slurm themselves: each job's batch script rendered as the gateway
    renders it (same command, QOS, time limit, GPUs, CPUs, memory, partition), its spec the gateway's
    spec of the same tenant with this job's epochs, GPUs and a job dir of its own; ``sbatch`` as the
    tenant's user at the plan's moment, ``scancel`` at the cancel's."""
    from gateway.config import Settings
    from gateway.jobs.submission import trainer_command

    settings = Settings(simulate_trainer_speedup=speedup, slurm_partition=PARTITION)
    reset_usage(list(TENANTS))
    size = training_file(workdir).stat().st_size
    info = ours.extra["jobs"]
    template: dict[str, dict[str, Any]] = {}
    for key, j in info.items():
        tenant = next(p.tenant for p in plan.jobs if p.key == key)
        spec = STORAGE / "tenants" / tenant / "jobs" / j["id"] / "spec.json"
        if tenant not in template and spec.exists():
            template[tenant] = json.loads(spec.read_text())
    limits = [j["time_limit_min"] for j in info.values() if j["time_limit_min"]]
    tag = f"capacity-peer-{int(time.time())}"
    scripts: dict[str, str] = {}
    for p in plan.jobs:
        user = unix_user_for(p.tenant)
        d = STORAGE / "tenants" / p.tenant / tag / p.key
        d.mkdir(parents=True, mode=0o700)
        for x in (d.parent, d):
            shutil.chown(x, user, user)
            os.chmod(x, 0o700)
        spec = json.loads(json.dumps(template[p.tenant]))
        spec.update(job_dir=str(d), job_id=None, world_size=p.gpus)
        spec["hyperparameters"]["epochs"] = epochs_for(p, size, speedup)
        (d / "spec.json").write_text(json.dumps(spec))
        shutil.chown(d / "spec.json", user, user)
        ours_job = info.get(p.key) or {}
        scripts[p.key] = render_sbatch(JobScript(
            job_name=p.key, account=p.tenant, qos=ours_job.get("qos") or "ft-cap", job_dir=str(d),
            command=trainer_command(settings, d / "spec.json"), gpus=p.gpus // p.nodes, nodes=p.nodes,
            cpus=settings.job_cpus, mem_mb=settings.job_mem_mb * (p.gpus // p.nodes),
            time_limit_min=ours_job.get("time_limit_min") or max(limits), grace_s=settings.signal_grace_s,
            partition=PARTITION, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                      "TOKENIZERS_PARALLELISM": "false"}))
    outcomes: dict[str, Outcome] = {}
    lock = threading.Lock()

    def submit(p: PlannedJob) -> None:
        o = Outcome(p.key, t0 + p.t)
        sent = time.time()
        res = run(["runuser", "-u", unix_user_for(p.tenant), "--", "sbatch", "--parsable", "--export=NONE"],
                  input=scripts[p.key], cwd="/")
        o.submit_s = time.time() - sent
        if res.returncode == 0 and res.stdout.strip().split(";")[0].isdigit():
            o.slurm_ids = [int(res.stdout.strip().split(";")[0])]
        else:
            o.error = res.stderr.strip()[:200]
        with lock:
            outcomes[p.key] = o

    def cancel(p: PlannedJob) -> None:
        o = outcomes.get(p.key)
        if o and o.slurm_ids:
            o.cancel_issued = time.time()
            run(["scancel", str(o.slurm_ids[0])])

    t0 = time.time()
    _drive(plan, t0, submit, cancel, echo)
    ids = [i for o in outcomes.values() for i in o.slurm_ids]
    deadline = time.time() + (drain_s if drain_s is not None else plan.day_s + 600)
    while time.time() < deadline:
        queued = set(run(["squeue", "-h", "-p", PARTITION, "-o", "%i"]).stdout.split()) & {str(i) for i in ids}
        if not queued and not busy_nodes():
            break
        echo(f"  draining: {len(queued)} jobs in Slurm")
        time.sleep(5)
    acct = sacct(ids)
    last = {a["id"]: a["state"] for a in acct}
    for o in outcomes.values():
        o.status = last.get(o.slurm_ids[0]) if o.slurm_ids else None
    return RunResult("peer", t0, outcomes, acct)


def busy_nodes() -> list[str]:
    """The simulated nodes still completing a job (their epilog running)."""
    out = run(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %T"]).stdout
    return [n for n, st in (line.split() for line in out.splitlines() if line.strip()) if "comp" in st]


# ------------------------------------------------------------------ main
def median_of(runs: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for r in runs:
        v: Any = r
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, int | float) and not math.isnan(v):
            values.append(float(v))
    return round(statistics.median(values), 4) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1850)
    ap.add_argument("--day-s", type=float, default=3600)
    ap.add_argument("--nodes", type=int, default=40)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gangs", type=int, default=2)
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--gateways", type=int, default=1)
    ap.add_argument("--mix-rate", type=float, default=100.0, help="metadata reads a second beside the day")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/sft-capacity"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root (it onboards tenants and submits as them)")
    from gateway.devcluster.cluster import short_hostname

    host = short_hostname()
    have = run(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N"]).stdout.split()
    if len(have) < args.nodes:
        raise SystemExit(f"bench: partition {PARTITION} has {len(have)} nodes; run "
                         f"`finetune dev-cluster up --sim-nodes {args.nodes} --sim-gpus-per-node {args.gpus_per_node}`")
    plan = make_plan(args.jobs, args.day_s, args.nodes, args.gpus_per_node, load=args.load, gangs=args.gangs,
                     host=host, seed=args.seed)
    args.workdir.mkdir(parents=True, exist_ok=True)
    speedup = speedup_for(plan, training_file(args.workdir).stat().st_size)
    print(f"capacity: {len(plan.jobs)} jobs over {args.day_s:.0f}s on {args.nodes} nodes x {args.gpus_per_node} "
          f"GPUs; {args.db}, {args.gateways} gateway(s), read mix {args.mix_rate:g}/s; node lost: {plan.node_loss}; "
          f"mean job {plan.mean_s:.0f}s; simulated trainer speed-up {speedup:g}")
    print("peer: the same batch scripts, specs, QOS and time limits, `sbatch` as each tenant's user "
          "(--export=NONE, as the gateway submits), `scancel` at the same moments; the same Slurm, "
          "prolog and epilog")
    order = ["ours", "peer", "peer", "ours", "ours", "peer"]
    order = (order * ((args.repeats + 2) // 3))[:2 * args.repeats]
    results: dict[str, list[dict[str, Any]]] = {"ours": [], "peer": []}
    first: RunResult | None = None
    pg = None
    for i, side in enumerate(order):
        if side == "peer" and first is None:
            side = "ours"
        wd = args.workdir / f"run{i}-{side}"
        shutil.rmtree(wd, ignore_errors=True)
        wd.mkdir(parents=True)
        print(f"== run {i + 1}/{len(order)}: {side}")
        t = time.time()
        if side == "ours":
            url = None
            if args.db == "postgres":
                from bench.gateway import Postgres

                pg = Postgres()
                url = pg.url
            try:
                r = day_ours(plan, wd, db_url=url, gateways=args.gateways, speedup=speedup, mix_rate=args.mix_rate)
            finally:
                if pg:
                    pg.stop()
                    pg = None
            first = first or r
        else:
            assert first is not None
            r = day_peer(plan, wd, first, speedup=speedup)
        f = figures(plan, r)
        f.update({k: v for k, v in r.extra.items() if k != "jobs"})
        print(json.dumps({"run": i + 1, "side": side, "wall_s": round(time.time() - t), **f}))
        results[side].append(f)
    report(results)
    ok = all(f["lost"] == 0 and f["duplicated"] == 0 and f["not_final"] == 0 for f in results["ours"]) and \
        all(f["cleanup_unconfirmed"] == 0 for f in results["ours"])
    return 0 if ok else 1


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    ours, peer = results["ours"], results["peer"]
    rows = [("GPU utilisation over the day", ("gpu_util_day",)), ("GPU utilisation over the makespan",
                                                                   ("gpu_util_makespan",)),
            ("makespan s", ("makespan_s",)), ("fairness min (got / fair share)", ("fairness", "min")),
            ("fairness min, waiting gangs left out", ("fairness", "min_single_node"))]
    for cls in ("heavy", "medium", "light", "gang", "gang-jobs"):
        rows += [(f"wait p50 s ({cls})", ("wait_s", cls, "p50")), (f"wait p95 s ({cls})", ("wait_s", cls, "p95"))]
    rows += [("wait p95 s (1-GPU jobs queued while a gang waited)", ("small_behind_gang_wait_s", "p95")),
             ("submission p50 s (API create / sbatch)", ("submit_s", "p50")),
             ("submission p99 s (API create / sbatch)", ("submit_s", "p99"))]
    head = f"median of {len(ours)} / {len(peer)} runs"
    print(f"\n{head:58} {'ours':>10} {'peer':>10} {'ratio':>7}")
    summary: dict[str, Any] = {}
    for label, path in rows:
        a, b = median_of(ours, *path), median_of(peer, *path)
        ratio = round(a / b, 3) if a is not None and b else None
        summary[".".join(path)] = {"ours": a, "peer": b, "ratio": ratio}
        print(f"{label:58} {a if a is not None else '-':>10} {b if b is not None else '-':>10} "
              f"{ratio if ratio is not None else '-':>7}")
    summary["lost_worst"] = max((f["lost"] + f["duplicated"] + f["not_final"]) for f in ours)
    print(f"{'lost + duplicated + not final (ours, worst run)':58} {summary['lost_worst']:>10}")
    for label, path in (("reconcile cycle p50 s", ("cycle_s", "p50")), ("reconcile cycle p99 s", ("cycle_s", "p99")),
                        ("events ingestion lag p50 s", ("ingest_lag_s", "p50")),
                        ("events ingestion lag p99 s", ("ingest_lag_s", "p99")),
                        ("cancel -> GPUs free p99 s", ("cancel_to_free_s", "p99")),
                        ("read mix achieved ops/s", ("mix", "rate")), ("read mix p50 ms", ("mix", "p50_ms")),
                        ("read mix p99 ms", ("mix", "p99_ms")), ("database bytes at the end", ("db_bytes",)),
                        ("gateway CPU s per job", ("gateway_cpu_s_per_job",))):
        v = median_of(ours, *path)
        summary[".".join(path)] = v
        print(f"{label:58} {v if v is not None else '-':>10}")
    print(json.dumps({"bench": "capacity", **summary}))


if __name__ == "__main__":
    sys.exit(main())
