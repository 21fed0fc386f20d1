"""Gateway benchmarks on the real dev cluster (root; `finetune dev-cluster up` first; wrk installed).

(a) Metadata API throughput and latency, our gateway vs its peer in the same run: `wrk` (one thread,
    16 keep-alive connections, a Lua script per operation) on loopback drives `finetune serve
    --workers N` and the peer, bench/floor_app.py (a bare FastAPI + SQLModel app serving the same
    rows: the FastAPI/SQLModel tutorial way, sync routes and a Session per request, token from an
    in-memory dict, under `uvicorn --workers N` with uvloop and httptools). Both read 200 finished
    jobs with 30 events each, written to the database first; operations: retrieve a job, list 20
    jobs, list 20 events, and the mix 40/30/30. SQLite and PostgreSQL (a throwaway server), 1 and 2
    workers; a 3 s warm-up run per server is dropped; --repeats alternating runs (ours, floor, then
    floor, ours), medians. Server CPU per operation is the CPU of the server's process tree (and,
    on PostgreSQL, of the database server's processes, printed apart) over the requests wrk made.
    Goal: >= 1,400 mixed ops/s with p99 <= 50 ms on SQLite with 2 workers, at most 1.2 x the
    floor's CPU per operation.
(b) Slurm commands per reconcile cycle: 300 real held Slurm jobs (`sbatch --hold`, as
    three bench tenants, through SlurmClient.submit), 300 matching job rows, then
    ``Reconciler.cycle`` with a LocalRunner that logs every command; at 10, 100 and 300
    active jobs. Goal: constant, <= 2. Peer: asking Slurm per job (one squeue each).
    Every held job is scancelled at the end.
(c) Writes under the mix (ours, SQLite, the most workers): creates (real sbatch as the tenant) and
    cancels at --create-rate beside a wrk mix; every job must end cancelled with its Slurm id.

    /opt/slurm-finetune/venv/bin/python bench/gateway.py [--seconds 5] [--repeats 3] [--workers 1,2]

Runtime: about 10 minutes.
"""

from __future__ import annotations

import argparse
import glob
import json
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.config import Settings  # noqa: E402
from gateway.db import make_engine, migrate  # noqa: E402
from gateway.models import Role  # noqa: E402
from gateway.slurm import JobScript, LocalRunner, SlurmClient  # noqa: E402
from gateway.slurm.runner import CommandResult  # noqa: E402
from gateway.storage.layout import unix_user_for  # noqa: E402
from gateway.storage.onboarding import TenantAdmin  # noqa: E402

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

    admin = TenantAdmin(LocalRunner(), storage_root=STORAGE)
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

    def __init__(self, workdir: Path, db_url: str, workers: int = 1, argv: Sequence[str] | None = None, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"serve-{self.port}.log", "wb")  # noqa: SIM115
        argv = list(argv or [sys.executable, "-m", "gateway", "serve", "--workers", str(workers),
                             "--log-level", "warning"])
        self.proc = subprocess.Popen(
            [*argv, "--port", str(self.port)],
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
OPS = {"retrieve": 0.4, "list": 0.3, "events": 0.3}     # the mix's weights


def seed_reads(db_url: str, tenant: str, n_jobs: int = 200, n_events: int = 30) -> list[str]:
    """``n_jobs`` finished job rows of ``tenant``, ``n_events`` events each, written straight to the DB:
    what a tenant's history looks like after a while; the readers ask for these."""
    from sqlmodel import Session, select

    from gateway.models import DataFile, FineTuningJob, JobEvent, Tenant, utcnow

    engine = make_engine(db_url)
    ids = []
    with Session(engine) as s:
        tid = s.exec(select(Tenant).where(Tenant.name == tenant)).one().id
        assert tid is not None
        f = DataFile(tenant_id=tid, filename="bench.jsonl", bytes=1, sha256="0" * 64, status="processed")
        s.add(f)
        for i in range(n_jobs):
            job = FineTuningJob(tenant_id=tid, status="succeeded", training_file=f.id, model=MODEL,
                                slurm_job_id=10_000 + i, qos="ft-small", hyperparameters=dict(FAST_HP),
                                fine_tuned_model=f"ft:{MODEL}:{tenant}::bench{i}", trained_tokens=123_456,
                                finished_at=utcnow(), started_at=utcnow(), result_files=[],
                                progress={"step": 24, "total_steps": 24, "loss": 1.234, "tokens_per_s": 5000.0})
            s.add(job)
            ids.append(job.id)
            for k in range(n_events):
                s.add(JobEvent(job_id=job.id, message=f"Step {k + 1}/24: training loss 1.{k:03d}", type="metrics",
                               data={"step": k + 1, "train_loss": 1.0 + k / 1000, "total_steps": 24}))
        s.commit()
    engine.dispose()
    return ids


def tree_cpu_s(pid: int, reaped: bool = False) -> float:
    """CPU seconds (user + system) of ``pid`` and every descendant (uvicorn's workers); ``reaped``: also
    what their children that already exited used (the kernel adds it to the parent that waited)."""
    parent: dict[int, int] = {}
    times: dict[int, float] = {}
    tck = os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(fields[1])
        times[int(d.name)] = sum(int(x) for x in fields[11:15 if reaped else 13]) / tck
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += [c for c, pp in parent.items() if pp == p]
    return total


def user_cpu_s(user: str) -> float:
    """CPU seconds of every process of unix ``user`` (the PostgreSQL server's backends)."""
    import pwd

    uid, tck, total = pwd.getpwnam(user).pw_uid, os.sysconf("SC_CLK_TCK"), 0.0
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == uid:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tck
        except OSError:
            continue
    return total


class Floor(Server):
    """The peer: bench/floor_app.py under uvicorn, the FastAPI docs' production command."""

    def __init__(self, workdir: Path, db_url: str, tokens: dict[str, int], workers: int):
        super().__init__(workdir, db_url, workers=workers, argv=[
            sys.executable, "-m", "uvicorn", "bench.floor_app:app", "--workers", str(workers),
            "--log-level", "warning", "--no-access-log"],
            FLOOR_DB_URL=db_url, FLOOR_TOKENS=json.dumps(tokens))


WRK_LUA = """
local paths = {%s}
local auth = "Bearer %s"
local i = 0
request = function()
  i = i %% #paths + 1
  return wrk.format("GET", paths[i], {["Authorization"] = auth})
end
"""


def paths_for(op: str, job_ids: Sequence[str], n: int = 1000, seed: int = 7) -> list[str]:
    """``n`` request paths: of one operation, or of the mix ("mix") by OPS's weights."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = op if op != "mix" else rng.choices(list(OPS), weights=list(OPS.values()))[0]
        jid = rng.choice(job_ids)
        out.append({"retrieve": f"/v1/fine_tuning/jobs/{jid}", "list": "/v1/fine_tuning/jobs?limit=20",
                    "events": f"/v1/fine_tuning/jobs/{jid}/events?limit=20"}[kind])
    return out


@dataclass
class Run:
    """One wrk run against one server."""

    server: str
    op: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    server_cpu_s: float
    db_cpu_s: float
    client_cpu_s: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.server_cpu_s / max(1, self.requests)


def _ms(text: str) -> float:
    for unit, k in (("us", 0.001), ("ms", 1.0), ("s", 1000.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * k
    return float(text) * 1000


def parse_wrk(out: str) -> tuple[int, float, float, float, int]:
    """(requests, seconds, p50 ms, p99 ms, non-2xx responses + socket errors) from ``wrk --latency``."""
    import re

    m = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if not m:
        raise RuntimeError(f"bench: cannot read wrk's output:\n{out}")
    secs = float(m.group(2)) * (0.001 if m.group(3) == "ms" else 1.0)
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    bad = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    bad += sum(int(x) for x in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return int(m.group(1)), secs, _ms(lat["50"]), _ms(lat["99"]), bad


def wrk(server: Server, name: str, op: str, token: str, job_ids: Sequence[str], seconds: float,
        connections: int, workdir: Path, pg: bool) -> Run:
    """One wrk run (one thread: the client takes as little of the 2 cores as a client can)."""
    import resource

    lua = workdir / f"{op}.lua"
    lua.write_text(WRK_LUA % (", ".join(json.dumps(p) for p in paths_for(op, job_ids)), token))
    c0, s0 = resource.getrusage(resource.RUSAGE_CHILDREN), tree_cpu_s(server.proc.pid)
    d0 = user_cpu_s("postgres") if pg else 0.0
    res = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:.0f}s", "--latency", "-s", str(lua),
                          server.url], capture_output=True, text=True, timeout=seconds + 60)
    s1, c1 = tree_cpu_s(server.proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
    d1 = user_cpu_s("postgres") if pg else 0.0
    if res.returncode != 0:
        raise RuntimeError(f"bench: wrk failed: {res.stderr}")
    n, secs, p50, p99, bad = parse_wrk(res.stdout)
    return Run(name, op, n, secs, p50, p99, bad, s1 - s0, d1 - d0,
               (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime))


def check_same_rows(ours: Server, floor: Server, token: str, job_id: str) -> None:
    """Both servers answer for the same job row (the peer does the same work, not less)."""
    a = httpx.get(f"{ours.url}/v1/fine_tuning/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}).json()
    b = httpx.get(f"{floor.url}/v1/fine_tuning/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}).json()
    assert a["id"] == b["id"] == job_id and a["trained_tokens"] == b["trained_tokens"], (a, b)


def run_a(workdir: Path, seconds: float, repeats: int, connections: int, workers_list: Sequence[int],
          pg: Postgres | None, create_rate: float) -> dict[str, Any]:
    """Ours vs the floor, alternating, per database and worker count; then writes under the mix (ours)."""
    from sqlmodel import Session, select

    from gateway.models import Tenant

    out: dict[str, Any] = {"runs": [], "writes": None}
    dbs = {"sqlite": None, **({"postgresql": pg.url} if pg else {})}
    for db, url in dbs.items():
        if url is None:
            from gateway.cli.privsep import service_owned_dir

            url = f"sqlite:///{service_owned_dir(Settings(), f'bench-a-{os.getpid()}') / 'bench-a.db'}"
        token = onboard(url, [READ_TENANT])[READ_TENANT]
        job_ids = seed_reads(url, READ_TENANT)
        engine = make_engine(url)
        with Session(engine) as s:
            tid = s.exec(select(Tenant).where(Tenant.name == READ_TENANT)).one().id
        engine.dispose()
        for workers in workers_list:
            ours, floor = Server(workdir, url, workers=workers), Floor(workdir, url, {token: int(tid or 0)}, workers)
            try:
                check_same_rows(ours, floor, token, job_ids[0])
                print(f"(a) {db}, {workers} worker(s): warm-up, then {repeats} x (ours, floor) x "
                      f"{['mix', *OPS]} for {seconds:.0f} s each, {connections} connections ...", flush=True)
                for srv, name in ((ours, "ours"), (floor, "floor")):
                    wrk(srv, name, "mix", token, job_ids, 3, connections, workdir, pg=False)    # warm-up, dropped
                for rep in range(repeats):
                    for op in ["mix", *OPS]:
                        pair = [(ours, "ours"), (floor, "floor")]
                        for srv, name in pair if rep % 2 == 0 else pair[::-1]:
                            r = wrk(srv, name, op, token, job_ids, seconds, connections, workdir, pg=db != "sqlite")
                            out["runs"].append((db, workers, r))
                if db == "sqlite" and workers == max(workers_list) and create_rate > 0:
                    out["writes"] = writes_under_mix(ours, token, job_ids, seconds * 2, connections, workdir,
                                                     create_rate)
            finally:
                ours.stop()
                floor.stop()
    return out


def writes_under_mix(server: Server, token: str, job_ids: Sequence[str], seconds: float, connections: int,
                     workdir: Path, create_rate: float) -> dict[str, Any]:
    """Creates (real sbatch as the tenant) and cancels at ``create_rate`` beside a wrk mix; every job
    must end cancelled with a Slurm id."""
    api = Api(server.url, token)
    file_id = api.upload(workdir)
    creates: list[float] = []
    cancels: list[float] = []
    made: list[dict[str, Any]] = []
    stop_at = time.monotonic() + seconds

    def creator() -> None:
        nxt = time.monotonic()
        while time.monotonic() < stop_at:
            time.sleep(max(0.0, nxt - time.monotonic()))
            t0 = time.perf_counter()
            job = api.create(file_id)
            t1 = time.perf_counter()
            api.cancel(job["id"])
            creates.append(t1 - t0)
            cancels.append(time.perf_counter() - t1)
            made.append(job)
            nxt += 1.0 / create_rate

    t = threading.Thread(target=creator)
    t.start()
    mix = wrk(server, "ours", "mix", token, job_ids, seconds, connections, workdir, pg=False)
    t.join()
    settle(api, [j["id"] for j in made])
    ends = [api.job(j["id"]) for j in made]
    assert all(j["slurm_job_id"] for j in made), "a create answered without a Slurm id"
    assert all(e["status"] == "cancelled" for e in ends), [e["status"] for e in ends]
    return {"mix": mix, "creates": creates, "cancels": cancels, "jobs": len(made)}


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
def _median_run(runs: list[Run]) -> dict[str, float]:
    return {k: statistics.median(getattr(r, k) for r in runs)
            for k in ("rate", "p50_ms", "p99_ms", "cpu_ms", "errors")} | {
        "db_ms": statistics.median(1000 * r.db_cpu_s / max(1, r.requests) for r in runs),
        "client_ms": statistics.median(1000 * r.client_cpu_s / max(1, r.requests) for r in runs)}


def _pick(a: dict[str, Any], db: str, workers: int, op: str, server: str) -> dict[str, float]:
    return _median_run([r for d, w, r in a["runs"] if (d, w, r.op, r.server) == (db, workers, op, server)])


def report(a: dict[str, Any], b: dict[str, Any] | None) -> None:
    if a:
        print("\n== (a) metadata API, wrk (1 thread) on loopback; medians of the alternating repeats")
        print("peer: bench/floor_app.py, bare FastAPI + SQLModel (sync def routes, a Session per request, "
              "tenant-scoped select, token from an in-memory dict), `uvicorn --workers N --no-access-log "
              "--log-level warning` with uvloop and httptools: the FastAPI docs' production setup")
        keys = sorted({(db, w, r.op) for db, w, r in a["runs"]},
                      key=lambda k: (k[0] != "sqlite", k[1], k[2] != "mix", k[2]))
        print(f"{'db':<10} {'wk':>2} {'op':<8} | {'ours ops/s':>10} {'p50':>6} {'p99':>6} {'cpu/op':>7} | "
              f"{'floor ops/s':>11} {'p50':>6} {'p99':>6} {'cpu/op':>7} | {'rate':>5} {'cpu':>5}")
        for db, w, op in keys:
            o, f = _pick(a, db, w, op, "ours"), _pick(a, db, w, op, "floor")
            extra = (f"  (PostgreSQL's own CPU/op: ours {o['db_ms']:.2f}, floor {f['db_ms']:.2f} ms)"
                     if db != "sqlite" else "")
            err = f"  ERRORS ours {o['errors']:.0f} floor {f['errors']:.0f}" if o["errors"] or f["errors"] else ""
            print(f"{db:<10} {w:>2} {op:<8} | {o['rate']:>10,.0f} {o['p50_ms']:>6.2f} {o['p99_ms']:>6.2f} "
                  f"{o['cpu_ms']:>6.3f}m | {f['rate']:>11,.0f} {f['p50_ms']:>6.2f} {f['p99_ms']:>6.2f} "
                  f"{f['cpu_ms']:>6.3f}m | x{o['rate'] / f['rate']:>4.2f} x{o['cpu_ms'] / f['cpu_ms']:>4.2f}"
                  f"{extra}{err}")
        for db, w in sorted({(d, ww) for d, ww, _ in a["runs"]}):
            each = {srv: ", ".join(f"{r.rate:,.0f}" for d, ww, r in a["runs"]
                                   if (d, ww, r.op, r.server) == (db, w, "mix", srv)) for srv in ("ours", "floor")}
            print(f"  {db} {w} worker(s), mix ops/s of each repeat: ours {each['ours']}; floor {each['floor']}")
        mixes = [(w, _pick(a, "sqlite", w, "mix", "ours"), _pick(a, "sqlite", w, "mix", "floor"))
                 for w in sorted({w for d, w, r in a["runs"] if d == "sqlite"})]
        if mixes:
            w, o, f = mixes[-1]
            ok = o["rate"] >= 1400 and o["p99_ms"] <= 50 and o["cpu_ms"] <= 1.2 * f["cpu_ms"]
            print(f"goal (SQLite, {w} workers, mix): >= 1,400 ops/s, p99 <= 50 ms, CPU/op <= 1.2 x floor: "
                  f"{'MET' if ok else 'NOT MET'} ({o['rate']:,.0f} ops/s, p99 {o['p99_ms']:.1f} ms, "
                  f"CPU/op x{o['cpu_ms'] / f['cpu_ms']:.2f} of the floor's)")
        if a.get("writes"):
            wr = a["writes"]
            c, x, m = wr["creates"], wr["cancels"], wr["mix"]
            print(f"writes under the mix (ours, SQLite): {wr['jobs']} creates (real sbatch) "
                  f"p50 {1000 * pct(c, .5):.0f} ms p99 {1000 * pct(c, .99):.0f} ms; "
                  f"cancels p50 {1000 * pct(x, .5):.0f} ms p99 {1000 * pct(x, .99):.0f} ms; every job cancelled "
                  f"with its Slurm id; the mix beside them {m.rate:,.0f} ops/s, p99 {m.p99_ms:.1f} ms")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5, help="seconds per wrk run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--workers", default="1,2", help="comma-separated API worker counts")
    ap.add_argument("--create-rate", type=float, default=2.0, help="creates per second beside the mix (0: none)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,pg")
    args = ap.parse_args()
    if os.geteuid() != 0 or LocalRunner().run(["scontrol", "ping"], timeout=10).returncode != 0:
        raise SystemExit("bench: needs root and the dev cluster (`finetune dev-cluster up`)")
    if "a" not in args.skip.split(",") and shutil.which("wrk") is None:
        raise SystemExit("bench: wrk is not installed (scripts/bootstrap.sh installs it: apt-get install wrk)")
    skip = set(args.skip.split(","))
    workdir = Path(tempfile.mkdtemp(prefix="sft-bench-gw-"))
    os.chmod(workdir, 0o755)
    pg = Postgres() if "pg" not in skip and "a" not in skip else None
    try:
        a = run_a(workdir, args.seconds, args.repeats, args.connections,
                  [int(w) for w in args.workers.split(",")], pg, args.create_rate) if "a" not in skip else {}
    finally:
        if pg:
            pg.stop()
    b = run_b(workdir) if "b" not in skip else None
    report(a, b)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
