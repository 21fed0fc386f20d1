"""Gateway benchmarks on the real dev cluster (root; `finetune dev-cluster up` first).

(a) Metadata API throughput and latency: concurrent clients (processes x threads, one
    keep-alive httpx.Client each) on loopback against `python -m gateway serve`, a mix
    of list / retrieve / events, plus creates. Goal: >= 1,400 ops/s with p99 <= 50 ms on
    SQLite. Peer, side by side: the same workload with the gateway on PostgreSQL (a
    throwaway server started as in tests/service/conftest.py). Creates submit to Slurm
    for real (sbatch as the tenant): so as not to flood the cluster with training jobs,
    one creator thread creates at a low fixed rate (--create-rate, default 2/s) and
    cancels each job right after its create returns; the readers hit jobs made that way
    before the clock starts. Creates are reported apart and also counted in the mix.
(b) Slurm commands per reconcile cycle: 300 real held Slurm jobs (`sbatch --hold`, as
    three bench tenants, through SlurmClient.submit), 300 matching job rows, then
    ``Reconciler.cycle`` with a LocalRunner that logs every command; at 10, 100 and 300
    active jobs. Goal: constant, <= 2. Peer: asking Slurm per job (one squeue each).
    Every held job is scancelled at the end.
(c) Create-to-sbatch latency: POST /v1/fine_tuning/jobs on an idle gateway until the job
    row has its slurm_job_id (the API submits before it answers), vs a bare sbatch.

    /opt/slurm-finetune/venv/bin/python bench/gateway.py [--seconds 15] [--clients 2x8]

Runtime: about 3 minutes.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.config import Settings  # noqa: E402
from gateway.db import make_engine, migrate  # noqa: E402
from gateway.models import Role  # noqa: E402
from gateway.slurm import JobScript, LocalRunner, SlurmClient  # noqa: E402
from gateway.slurm.admin import Admin, unix_user_for  # noqa: E402
from gateway.slurm.runner import CommandResult  # noqa: E402

STORAGE = Path("/srv/slurm-finetune")
MODEL = "tiny-chat"
READ_TENANT = "t-bench-a"
HOLD_TENANTS = ("t-bench-b", "t-bench-c", "t-bench-d")   # 50 ft-small + 50 ft-standard each = 300
FAST_HP = {"n_epochs": 1, "batch_size_tokens": 512, "max_seq_len": 256}


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ processes
class Postgres:
    """A throwaway PostgreSQL server (initdb + pg_ctl as ``postgres``, trust on 127.0.0.1)."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not bins:
            raise SystemExit("bench: PostgreSQL is not installed (apt-get install postgresql)")
        self.bindir = Path(bins[-1]).parent
        self.base = Path(tempfile.mkdtemp(prefix="sft-bench-pg-"))
        shutil.chown(self.base, "postgres", "postgres")
        data, sock, port = self.base / "data", self.base / "sock", free_port()
        sock.mkdir()
        shutil.chown(sock, "postgres", "postgres")
        self._as_pg(str(self.bindir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "-E", "UTF8")
        self._as_pg(str(self.bindir / "pg_ctl"), "-D", str(data), "-l", str(self.base / "log"), "-w", "start",
                    "-o", f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off")
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def _as_pg(self, *argv: str) -> None:
        res = subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {res.stderr or res.stdout}")

    def stop(self) -> None:
        self._as_pg(str(self.bindir / "pg_ctl"), "-D", str(self.base / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.base, ignore_errors=True)


def onboard(db_url: str, tenants: Sequence[str]) -> dict[str, str]:
    """Slurm account + unix user + storage (idempotent), DB row and a member token per tenant."""
    from sqlmodel import Session

    from gateway.access.tokens import create_token
    from gateway.services.tenants import ensure_tenant

    admin = Admin(LocalRunner(), storage_root=STORAGE)
    engine = make_engine(db_url)
    migrate(engine)
    tokens = {}
    with Session(engine) as s:
        for t in tenants:
            admin.add_tenant(t, shares=5, qos=["ft-small", "ft-standard"])
            tokens[t], _ = create_token(session=s, role=Role.MEMBER, tenant=ensure_tenant(session=s, name=t))
        s.commit()
    engine.dispose()
    return tokens


class Server:
    """`python -m gateway serve` on a free loopback port, its log in ``workdir``."""

    def __init__(self, workdir: Path, db_url: str, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"serve-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "SFT_DATABASE_URL": db_url, "SFT_RECONCILE_INTERVAL_S": "1", **env})
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench: the gateway did not start; see {self.log.name}")
            time.sleep(0.2)

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Api:
    """A tenant's view of one gateway."""

    def __init__(self, url: str, token: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def req(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return dict(r.json())

    def upload(self, workdir: Path, n: int = 80) -> str:
        from trainer.toydata import toy_conversations

        path = workdir / "train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in toy_conversations(n)))
        with open(path, "rb") as f:
            obj = self.req("POST", "/v1/files", data={"purpose": "fine-tune"}, files={"file": (path.name, f)})
        assert obj["status"] == "processed", obj
        return str(obj["id"])

    def create(self, file_id: str, hp: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.req("POST", "/v1/fine_tuning/jobs",
                        json={"model": MODEL, "training_file": file_id, "hyperparameters": hp or FAST_HP})

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.req("POST", f"/v1/fine_tuning/jobs/{job_id}/cancel")

    def job(self, job_id: str) -> dict[str, Any]:
        return self.req("GET", f"/v1/fine_tuning/jobs/{job_id}")

    def wait(self, job_id: str, ok: Callable[[dict[str, Any]], bool], timeout: float = 120,
             poll: float = 0.1) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            j = self.job(job_id)
            if ok(j):
                return j
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: job {job_id} still {j['status']}/{j.get('phase')} after {timeout:.0f}s")
            time.sleep(poll)


def create_and_cancel(api: Api, file_id: str) -> tuple[float, dict[str, Any]]:
    """(seconds the create took, the created job), then cancel it at once."""
    t0 = time.perf_counter()
    job = api.create(file_id)
    dt = time.perf_counter() - t0
    if job["status"] not in ("succeeded", "failed", "cancelled"):
        api.cancel(job["id"])
    return dt, job


def settle(api: Api, job_ids: Sequence[str], timeout: float = 90) -> None:
    """Wait until none of ``job_ids`` is still active (cancelled jobs leave Slurm)."""
    for jid in job_ids:
        api.wait(jid, lambda j: j["status"] in ("succeeded", "failed", "cancelled"), timeout, poll=0.5)


# ------------------------------------------------------------------ (a) load
def _reader(url: str, token: str, job_ids: list[str], stop_at: float, start_at: float,
            seed: int) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    out: list[tuple[str, float]] = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        while (now := time.monotonic()) < stop_at:
            x, jid = rng.random(), rng.choice(job_ids)
            op, path = (("list", "/v1/fine_tuning/jobs?limit=20") if x < 0.3 else
                        ("retrieve", f"/v1/fine_tuning/jobs/{jid}") if x < 0.7 else
                        ("events", f"/v1/fine_tuning/jobs/{jid}/events?limit=20"))
            t0 = time.perf_counter()
            r = c.get(path)
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                op = "error"
            if now >= start_at:
                out.append((op, dt))
    return out


def _reader_process(args: tuple[str, str, list[str], float, float, int, int],
                    ) -> list[tuple[str, float]]:
    url, token, job_ids, stop_at, start_at, threads, seed = args
    results: list[list[tuple[str, float]]] = [[] for _ in range(threads)]

    def run(i: int) -> None:
        results[i] = _reader(url, token, job_ids, stop_at, start_at, seed * 100 + i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return [x for r in results for x in r]


@dataclass
class LoadResult:
    db: str
    seconds: float
    ops: list[tuple[str, float]] = field(default_factory=list)
    creates: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0

    @property
    def rate(self) -> float:
        return (len(self.ops) + len(self.creates)) / self.seconds

    def lat(self, op: str | None = None) -> list[float]:
        if op == "create":
            return self.creates
        return [d for o, d in self.ops if op is None or o == op] + (self.creates if op is None else [])

    def line(self, op: str | None = None) -> str:
        v = self.lat(op)
        return (f"{op or 'all':<9} {len(v):>7} ops  p50 {1000 * pct(v, 0.5):7.2f} ms  "
                f"p99 {1000 * pct(v, 0.99):7.2f} ms")


def load(db: str, server: Server, token: str, file_id: str, workdir: Path, seconds: float,
         procs: int, threads: int, create_rate: float) -> LoadResult:
    """Seed jobs (created + cancelled), then readers for ``seconds`` with a creator beside them."""
    api = Api(server.url, token)
    seeded = [create_and_cancel(api, file_id)[1]["id"] for _ in range(8)]
    settle(api, seeded)
    warmup = 2.0
    start_at = time.monotonic() + warmup + 1.0   # the pool's processes start inside the warmup
    stop_at = start_at + seconds
    res = LoadResult(db, seconds)
    created: list[str] = []

    def creator() -> None:
        nxt = start_at
        while (now := time.monotonic()) < stop_at:
            if now < nxt:
                time.sleep(min(nxt - now, stop_at - now))
                continue
            dt, job = create_and_cancel(api, file_id)
            created.append(job["id"])
            if nxt >= start_at and time.monotonic() <= stop_at:
                res.creates.append(dt)
            nxt += 1.0 / create_rate

    def cpu_window() -> None:
        time.sleep(max(0.0, start_at - time.monotonic()))
        before = server.cpu_s()
        time.sleep(max(0.0, stop_at - time.monotonic()))
        res.server_cpu_s = server.cpu_s() - before

    ct, cw = threading.Thread(target=creator), threading.Thread(target=cpu_window)
    ct.start()
    cw.start()
    with mp.get_context("fork").Pool(procs) as pool:
        parts = pool.map(_reader_process, [(server.url, token, seeded, stop_at, start_at, threads, i)
                                           for i in range(procs)])
    ct.join()
    cw.join()
    res.ops = [x for p in parts for x in p]
    settle(api, created)
    return res


def run_a(workdir: Path, seconds: float, procs: int, threads: int, create_rate: float,
          pg: Postgres | None) -> dict[str, LoadResult]:
    out: dict[str, LoadResult] = {}
    dbs = {"sqlite": f"sqlite:///{workdir / 'bench-a.db'}", **({"postgresql": pg.url} if pg else {})}
    for name, url in dbs.items():
        token = onboard(url, [READ_TENANT])[READ_TENANT]
        server = Server(workdir, url)
        try:
            api = Api(server.url, token)
            file_id = api.upload(workdir)
            print(f"(a) {name}: {procs} processes x {threads} client threads, {seconds:.0f}s, "
                  f"creates at {create_rate}/s ...", flush=True)
            out[name] = load(name, server, token, file_id, workdir, seconds, procs, threads, create_rate)
            if name == "sqlite":
                out["create_idle"] = LoadResult("sqlite", 1.0, creates=create_latency(api, file_id))
        finally:
            server.stop()
    return out


# ---------------------------------------------------------------- (c) create
def create_latency(api: Api, file_id: str, n: int = 10) -> list[float]:
    """Seconds from POST to an answer holding slurm_job_id, on an idle gateway; each job is
    cancelled at once and waited out before the next (so none queues behind another)."""
    out = []
    for _ in range(n):
        dt, job = create_and_cancel(api, file_id)
        assert job["slurm_job_id"], job
        out.append(dt)
        settle(api, [job["id"]])
    return out


# -------------------------------------------------------------- (b) reconcile
class HoldRunner(LocalRunner):
    """A LocalRunner whose sbatch submits held jobs (they never start)."""

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, input: str | None = None,
            env: Mapping[str, str] | None = None) -> CommandResult:
        if argv and argv[0] == "sbatch":
            argv = [argv[0], "--hold", *argv[1:]]
        return super().run(argv, timeout=timeout, input=input, env=env)


def submit_held(n_per_qos: int) -> tuple[dict[int, str], list[float]]:
    """{slurm id: tenant} of held jobs, and the seconds each bare sbatch took."""
    client = SlurmClient(HoldRunner())
    ids: dict[int, str] = {}
    took = []
    for tenant in HOLD_TENANTS:
        d = STORAGE / "tenants" / tenant / "jobs" / "bench-held"
        d.mkdir(parents=True, exist_ok=True)
        shutil.chown(d.parent, unix_user_for(tenant), unix_user_for(tenant))
        shutil.chown(d, unix_user_for(tenant), unix_user_for(tenant))
        for qos in ("ft-small", "ft-standard"):
            script = JobScript(job_name="bench-held", account=tenant, qos=qos, job_dir=str(d),
                               command=("/bin/true",), gpus=1, cpus=1, mem_mb=128, time_limit_min=5)
            for _ in range(n_per_qos):
                t0 = time.perf_counter()
                ids[client.submit(script, user=unix_user_for(tenant))] = tenant
                took.append(time.perf_counter() - t0)
    return ids, took


def insert_rows(engine: Any, held: dict[int, str]) -> None:
    """One queued job row per held Slurm job, as the gateway would have after sbatch."""
    from sqlmodel import Session, select

    from gateway.models import DataFile, FineTuningJob, Tenant
    from gateway.services.tenants import ensure_tenant

    with Session(engine) as s:
        files = {}
        for t in HOLD_TENANTS:
            tenant = s.exec(select(Tenant).where(Tenant.name == t)).first() or ensure_tenant(session=s, name=t)
            s.flush()
            assert tenant.id is not None
            f = DataFile(tenant_id=tenant.id, filename="bench.jsonl", bytes=1, sha256="0" * 64, status="processed")
            s.add(f)
            files[t] = (tenant.id, f.id)
        for sid, t in held.items():
            tid, fid = files[t]
            s.add(FineTuningJob(tenant_id=tid, status="queued", training_file=fid, model=MODEL,
                                slurm_job_id=sid, qos="ft-small"))
        s.commit()


def run_b(workdir: Path) -> dict[str, Any]:
    from gateway.jobs.reconciler import Reconciler

    onboard(f"sqlite:///{workdir / 'bench-b.db'}", HOLD_TENANTS)
    print("(b) submitting 300 held jobs ...", flush=True)
    t0 = time.monotonic()
    held, sbatch_s = submit_held(50)
    print(f"    {len(held)} held jobs submitted in {time.monotonic() - t0:.1f}s", flush=True)
    out: dict[str, Any] = {"sbatch": sbatch_s, "cycles": {}}
    try:
        engine = make_engine(f"sqlite:///{workdir / 'bench-b.db'}")
        settings = Settings(database_url=str(engine.url), storage_root=STORAGE)
        items = sorted(held.items())
        done = 0
        for n in (10, 100, 300):
            insert_rows(engine, dict(items[done:n]))
            done = n
            log: list[tuple[str, ...]] = []
            rec = Reconciler(engine, settings, SlurmClient(LocalRunner(log)))
            rows = []
            for _ in range(4):
                log.clear()
                t = time.perf_counter()
                stats = rec.cycle()
                rows.append((len(log), time.perf_counter() - t, stats.jobs, [c[0] for c in log]))
            out["cycles"][n] = rows
        client = SlurmClient(LocalRunner())
        t = time.perf_counter()
        for sid in held:
            client.queue([sid])
        out["per_job_s"] = time.perf_counter() - t
        engine.dispose()
    finally:
        LocalRunner().run(["scancel", *map(str, held)], timeout=120)
    return out


# ---------------------------------------------------------------------- main
def report(a: dict[str, LoadResult], b: dict[str, Any] | None) -> None:
    print("\n== (a) metadata API: list 30% / retrieve 40% / events 30% (+ creates, cancelled at once)")
    for name in ("sqlite", "postgresql"):
        if name not in a:
            continue
        r = a[name]
        n = len(r.ops) + len(r.creates)
        print(f"{name}: {r.rate:,.0f} ops/s over {r.seconds:.0f}s; server CPU {1000 * r.server_cpu_s / n:.2f} ms/op "
              f"({r.server_cpu_s / r.seconds:.2f} cores busy; one process tops out near "
              f"{n / r.server_cpu_s:,.0f} ops/s per core it gets)")
        for op in (None, "list", "retrieve", "events", "create"):
            print("   " + r.line(op))
        errors = len(r.lat("error"))
        if errors:
            print(f"   errors: {errors}")
    if "sqlite" in a:
        s = a["sqlite"]
        ok = s.rate >= 1400 and pct(s.lat(), 0.99) <= 0.050
        print(f"goal >= 1,400 ops/s and p99 <= 50 ms on SQLite: {'MET' if ok else 'NOT MET'} "
              f"({s.rate:,.0f} ops/s, p99 {1000 * pct(s.lat(), 0.99):.1f} ms)")
    if "sqlite" in a and "postgresql" in a:
        s, p = a["sqlite"], a["postgresql"]
        print(f"SQLite / PostgreSQL: throughput x{s.rate / p.rate:.2f}, "
              f"p50 x{pct(s.lat(), .5) / pct(p.lat(), .5):.2f}, p99 x{pct(s.lat(), .99) / pct(p.lat(), .99):.2f}")
    if b:
        print("\n== (b) reconcile cycle with N active jobs (real held Slurm jobs)")
        for n, rows in b["cycles"].items():
            cmds = sorted({r[0] for r in rows})
            times = [r[1] for r in rows]
            print(f"N={n:>3}: Slurm commands per cycle {cmds} ({', '.join(rows[-1][3])}); "
                  f"first cycle {1000 * times[0]:.0f} ms, then median {1000 * statistics.median(times[1:]):.0f} ms")
        n300 = b["cycles"][300]
        per_job = b["per_job_s"]
        print(f"peer (one squeue per job): 300 commands, {1000 * per_job:.0f} ms; batched: {n300[-1][0]} commands, "
              f"{1000 * statistics.median([r[1] for r in n300[1:]]):.0f} ms (whole cycle) -> "
              f"x{300 / max(1, n300[-1][0]):.0f} fewer commands")
    if "create_idle" in a:
        c = a["create_idle"].creates
        print("\n== (c) create-to-sbatch (POST until the row has slurm_job_id), idle gateway, SQLite")
        print(f"n={len(c)}  p50 {1000 * pct(c, .5):.0f} ms  p99 {1000 * pct(c, .99):.0f} ms")
        if b:
            sb = b["sbatch"]
            print(f"bare sbatch --hold as the tenant: p50 {1000 * pct(sb, .5):.0f} ms  p99 {1000 * pct(sb, .99):.0f} ms"
                  f" -> the gateway adds x{pct(c, .5) / pct(sb, .5):.2f} of sbatch's p50")
        if "sqlite" in a:
            u = a["sqlite"].creates
            print(f"under the (a) load: n={len(u)}  p50 {1000 * pct(u, .5):.0f} ms  p99 {1000 * pct(u, .99):.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--clients", default="2x8", help="PROCESSESxTHREADS of reader clients")
    ap.add_argument("--create-rate", type=float, default=2.0, help="creates per second during (a)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,pg")
    args = ap.parse_args()
    if os.geteuid() != 0 or LocalRunner().run(["scontrol", "ping"], timeout=10).returncode != 0:
        raise SystemExit("bench: needs root and the dev cluster (`finetune dev-cluster up`)")
    procs, threads = (int(x) for x in args.clients.split("x"))
    skip = set(args.skip.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="sft-bench-gw-"))
    os.chmod(workdir, 0o755)
    pg = Postgres() if "pg" not in skip and "a" not in skip else None
    try:
        a = run_a(workdir, args.seconds, procs, threads, args.create_rate, pg) if "a" not in skip else {}
    finally:
        if pg:
            pg.stop()
    b = run_b(workdir) if "b" not in skip else None
    report(a, b)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
