"""Two gateways on one PostgreSQL with jobs in flight (issue 20): SIGKILL the one holding the reconciler
lease; the other takes the lease within the stated bound (about 4/3 x SFT_RECONCILER_LEASE_S, plus one
poll) and finishes every job; no job is lost, submitted twice or published twice."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlmodel import Session, col, select

from gateway.models import JobEvent
from tests.service.conftest import pg_url  # noqa: F401  (the throwaway PostgreSQL server fixture)
from tests.slurm.livegateway import FAST_HP, LiveGateway, chat_file, free_port, terminal
from tests.slurm.test_cli_jobs import fresh_pg_database

pytestmark = pytest.mark.slurm
T = "t-failover"
LEASE_S = 4.0
BOUND_S = LEASE_S * 4 / 3 + 3.0       # expiry, a standby's poll (ttl/3), and a reconcile interval or two


@pytest.fixture(scope="module")
def pair(cluster: None, pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveGateway, ...]]:  # noqa: F811
    first = LiveGateway(tmp_path_factory.mktemp("failover"), (T,), db_url=fresh_pg_database(pg_url),
                        SFT_RECONCILER_LEASE_S=str(LEASE_S))
    second = copy.copy(first)                      # same database, tokens and audit key; its own process
    second.port = free_port()
    second.url = f"http://127.0.0.1:{second.port}"
    second.start()
    try:
        yield first, second
    finally:
        second.proc and second.proc.poll() is None and second.proc.terminate()
        first.stop()


def _holder(gw: LiveGateway) -> tuple[int, int]:
    """(pid of the lease's holder, epoch); the holder is ``host:pid:nonce``."""
    with gw.engine.connect() as c:
        holder, epoch = c.execute(sa.text("SELECT holder, epoch FROM leader_leases WHERE name = 'reconciler'")).one()
    return (int(holder.split(":")[1]) if holder else 0), int(epoch)


def test_killing_the_leader_hands_the_jobs_to_the_other_gateway(pair: tuple[LiveGateway, ...], tmp_path: Path) -> None:
    first, second = pair
    by_pid = {g.proc.pid: g for g in pair if g.proc}
    deadline = time.monotonic() + 30
    while _holder(first)[0] not in by_pid:
        assert time.monotonic() < deadline, "no gateway took the reconciler lease"
        time.sleep(0.2)
    leader_pid, epoch = _holder(first)
    once = subprocess.run([sys.executable, "-m", "gateway", "reconcile", "--once"], cwd="/", env=first.env,
                          capture_output=True, text=True, timeout=120)
    assert once.returncode == 1 and "holds the reconciler lease" in once.stderr, once.stderr   # a third stands by
    leader = by_pid[leader_pid]
    survivor = second if leader is first else first
    fid = survivor.upload(T, chat_file(tmp_path / "f.jsonl", 1500, seed=81))
    jobs = [survivor.create(T, fid, {**FAST_HP, "seed": i}) for i in range(3)]
    survivor.wait(T, jobs[0]["id"], lambda j: terminal(j) or (j.get("progress") or {}).get("step", 0) >= 2, 180)

    leader.kill9()
    killed = time.monotonic()
    while _holder(first)[0] != survivor.proc.pid:  # type: ignore[union-attr]
        assert time.monotonic() - killed < 3 * BOUND_S, "the surviving gateway never took the lease"
        time.sleep(0.1)
    took = time.monotonic() - killed
    print(f"\nSIGKILL of the leader (pid {leader_pid}); the other gateway led {took:.1f} s later "
          f"(lease {LEASE_S:.0f} s, bound {BOUND_S:.1f} s), epoch {epoch} -> {_holder(first)[1]}")
    assert took <= BOUND_S and _holder(first)[1] == epoch + 1

    done = [survivor.wait(T, j["id"], terminal, 400) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 3, [d["error"] for d in done]
    with Session(first.engine) as s:
        for d in done:
            published = s.exec(select(JobEvent).where(JobEvent.job_id == d["id"],
                                                      col(JobEvent.message) == "The job has successfully completed"))
            assert len(published.all()) == 1, d["id"]               # published once
    for d in done:                                                   # submitted once: one Slurm job per name
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobIDRaw", f"--name={d['id']}", "-S", "now-1hour"],
                             capture_output=True, text=True, check=True).stdout.split()
        assert sorted(set(out)) == [str(d["slurm_job_id"])], (d["id"], out)
